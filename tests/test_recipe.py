"""The recipe group (conf/recipe/): the CPU recipe is the dataclasses' defaults, the paper recipe's numbers are those
its comments derive, and a recipe sets keys of several sections under the other groups' and the overrides' rule."""

from __future__ import annotations

import pytest
import yaml

from keel.config import OptimConfig, TrainerConfig, conf_dir, load_config
from keel.errors import ConfigError

PAPER_TOKENS = 250e9  # the paper's Table 2 budget (docs/paper.md)


def test_the_cpu_recipe_is_the_default_and_the_dataclasses_defaults():
    recipe = yaml.safe_load((conf_dir() / "recipe" / "cpu.yaml").read_text())
    cfg = load_config()
    for section, defaults in (("trainer", TrainerConfig()), ("optim", OptimConfig())):
        for key, value in recipe[section].items():
            assert getattr(getattr(cfg, section), key) == getattr(defaults, key) == value, f"{section}.{key}"


def test_the_paper_recipe_trains_the_paper_s_token_budget_on_8_gpus():
    cfg = load_config(
        overrides=["recipe=paper", "model=paper_d64", "trainer=fsdp", "trainer.devices=8", "trainer.accelerator=gpu"]
    )
    t = cfg.trainer
    assert t.global_batch == 256 and t.global_batch * cfg.model.seq_len == 524_288
    assert abs(t.max_steps * t.global_batch * cfg.model.seq_len - PAPER_TOKENS) < t.global_batch * cfg.model.seq_len
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.schedule, cfg.optim.min_lr_ratio) == (
        1.5e-3,
        5000,
        "cosine",
        0.1,
    )
    assert cfg.optim.lr < 4.67e-3  # below the paper's max tolerable LR for Pre-LN at 512 layers (docs/paper.md)
    assert (t.val_every_n_steps, t.checkpoint_every_n_steps, cfg.eval.every_n_steps) == (1000, 1000, 1000)
    assert t.activation_checkpointing == "auto" and t.strategy == "fsdp"  # the trainer group's keys are kept
    for eval_choice in ("standard", "none"):  # the recipe's evaluation cadence holds with every eval choice
        assert load_config(overrides=["recipe=paper", f"eval={eval_choice}"]).eval.every_n_steps == 1000


@pytest.mark.parametrize("devices, nodes, accumulation", [(8, 1, 4), (8, 2, 2), (8, 4, 1), (1, 1, 32), (4, 1, 8)])
def test_the_paper_recipe_keeps_its_global_batch_on_any_number_of_gpus(devices, nodes, accumulation):
    cfg = load_config(
        overrides=[
            "recipe=paper",
            "model=paper_d64",
            "trainer=fsdp",
            f"trainer.devices={devices}",
            f"trainer.num_nodes={nodes}",
            "trainer.accelerator=gpu",
        ]
    )
    assert (cfg.trainer.grad_accum, cfg.trainer.global_batch) == (accumulation, 256)
    assert cfg.device_tokens_per_step * devices * nodes == 524_288  # the tokens per step the budget is counted in


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.devices=3"],
            "trainer.global_batch_size=256: not a multiple of 3 device(s) x 1 node(s) x "
            "trainer.micro_batch_size 8 = 24 sequences per micro-batch; no micro-batch size divides it "
            "on 3 processes: change the device count, or set trainer.global_batch_size=null and "
            "trainer.grad_accum by hand",
        ),
        (
            ["trainer.devices=8", "trainer.micro_batch_size=3"],
            "trainer.global_batch_size=256: not a multiple of 8 device(s) x 1 node(s) x trainer.micro_batch_size 3 = "
            "24 sequences per micro-batch; trainer.micro_batch_size=2 divides it",
        ),
        (
            ["trainer.devices=8", "trainer.grad_accum=2"],
            "trainer.grad_accum: 2 disagrees with trainer.global_batch_size=256 / (8 device(s) x 1 node(s) x "
            "trainer.micro_batch_size 8 = 64 sequences per micro-batch) = 4; leave trainer.grad_accum unset "
            "(it is derived), or set trainer.global_batch_size=null",
        ),
        (
            ["trainer.global_batch_size=0"],
            "trainer.global_batch_size: must be >= 1 sequences per optimizer step, or null",
        ),
    ],
)
def test_a_global_batch_the_layout_cannot_reach_is_refused_with_the_arithmetic(overrides, message):
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=["recipe=paper", "trainer=fsdp", "trainer.accelerator=gpu", *overrides])
    assert str(refused.value).startswith(message)


def test_without_a_global_batch_grad_accum_is_as_set():
    cfg = load_config(overrides=["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "trainer.grad_accum=3"])
    assert (cfg.trainer.global_batch_size, cfg.trainer.grad_accum, cfg.trainer.global_batch) == (None, 3, 48)


def test_overrides_and_config_files_win_over_the_recipe(tmp_path):
    assert load_config(overrides=["recipe=paper", "trainer.max_steps=10", "optim.lr=1e-3"]).trainer.max_steps == 10
    own = tmp_path / "own.yaml"
    own.write_text("defaults:\n  recipe: paper\noptim:\n  warmup_steps: 100\n")
    cfg = load_config(str(own))
    assert (cfg.trainer.max_steps, cfg.optim.warmup_steps) == (476837, 100)
