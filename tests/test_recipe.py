"""The recipe group (conf/recipe/): the CPU recipe is the dataclasses' defaults, the paper recipe's numbers are those
its comments derive, and a recipe sets keys of several sections under the other groups' and the overrides' rule."""

from __future__ import annotations

import yaml

from keel.config import OptimConfig, TrainerConfig, conf_dir, load_config

PAPER_TOKENS = 250e9  # the paper's Table 2 budget (docs/paper.md)


def test_the_cpu_recipe_is_the_default_and_the_dataclasses_defaults():
    recipe = yaml.safe_load((conf_dir() / "recipe" / "cpu.yaml").read_text())
    cfg = load_config()
    for section, defaults in (("trainer", TrainerConfig()), ("optim", OptimConfig())):
        for key, value in recipe[section].items():
            assert getattr(getattr(cfg, section), key) == getattr(defaults, key) == value, f"{section}.{key}"


def test_the_paper_recipe_trains_the_paper_s_token_budget_on_8_gpus():
    cfg = load_config(overrides=["recipe=paper", "model=paper_d64", "trainer=fsdp", "trainer.devices=8",
                                 "trainer.accelerator=gpu"])
    t = cfg.trainer
    assert t.global_batch == 256 and t.global_batch * cfg.model.seq_len == 524_288
    assert abs(t.max_steps * t.global_batch * cfg.model.seq_len - PAPER_TOKENS) < t.global_batch * cfg.model.seq_len
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.schedule, cfg.optim.min_lr_ratio) == (1.5e-3, 5000,
                                                                                                   "cosine", 0.1)
    assert cfg.optim.lr < 4.67e-3  # below the paper's max tolerable LR for Pre-LN at 512 layers (docs/paper.md)
    assert (t.val_every_n_steps, t.checkpoint_every_n_steps, cfg.eval.every_n_steps) == (1000, 1000, 1000)
    assert t.activation_checkpointing == "auto" and t.strategy == "fsdp"  # the trainer group's keys are kept
    for eval_choice in ("standard", "none"):  # the recipe's evaluation cadence holds with every eval choice
        assert load_config(overrides=["recipe=paper", f"eval={eval_choice}"]).eval.every_n_steps == 1000


def test_overrides_and_config_files_win_over_the_recipe(tmp_path):
    assert load_config(overrides=["recipe=paper", "trainer.max_steps=10", "optim.lr=1e-3"]).trainer.max_steps == 10
    own = tmp_path / "own.yaml"
    own.write_text("defaults:\n  recipe: paper\noptim:\n  warmup_steps: 100\n")
    cfg = load_config(str(own))
    assert (cfg.trainer.max_steps, cfg.optim.warmup_steps) == (476837, 100)
