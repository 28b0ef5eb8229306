"""The GPU memory estimate (keel.memory), on CPU: the GPU's memory is passed in or mocked; partial activation
checkpointing and its auto choice, the allocator margin, `keel estimate`."""

from __future__ import annotations

import pytest

import keel.memory
from keel.cli import main as cli_main
from keel.config import load_config
from keel.errors import ConfigError
from keel.memory import (
    check_gpu_fits,
    cpu_auto_checkpointing,
    cpu_training_bytes,
    gpu_budget_bytes,
    gpu_training_bytes,
    gpu_training_terms,
    resolve_activation_checkpointing,
    resolve_gradient_reduction,
    with_margin,
)
from keel.model import parameter_counts

GB80 = 80 * 10**9


def paper_d64(*overrides: str):
    """paper_d64 on 8 GPUs with eager blocks, whose bytes the figures by hand below count (compiled blocks, the GPU
    default: test_compiled_blocks_are_estimated_by_what_they_save)."""
    return load_config(
        overrides=[
            "model=paper_d64",
            "trainer.accelerator=gpu",
            "trainer.devices=8",
            "trainer.micro_batch_size=8",
            "trainer.compile=false",
            *overrides,
        ]
    )


def test_paper_d64_on_8_gpus_of_80_gb_under_ddp_is_refused_with_numbers_and_keys():
    with pytest.raises(ConfigError) as err:
        check_gpu_fits(paper_d64("trainer=ddp"), GB80)
    message = str(err.value)
    assert "\n" not in message
    assert "needs about 72.9 GiB per GPU" in message and "more than the 74.5 GiB of this GPU" in message
    assert "80.2 GiB with the 10% allocator margin" in message
    assert "activations 55.0 GiB" in message and "AdamW state 6.8 GiB" in message and "DDP buckets 3.4 GiB" in message
    assert "55.0 KiB per token per block" in message
    # the gradients (3.4 GiB) are made as backward frees the activations: counted once, as the larger of the two
    assert "gradients 3.4 GiB" in message and "gradients made in freed activations' place -3.4 GiB" in message
    # by hand: each checkpointed block keeps its input (4 x 1,024 bytes per token) instead of its 56,400 bytes, and
    # no autocast copy of its weights (1.5 GiB / 64), 0.82 GiB in all at 16,384 tokens; 72.9 GiB less 7 of them is
    # the first under 74.5 / 1.1 = 67.7 GiB
    assert (
        "change, in this order: trainer.activation_checkpointing=auto (the first 7 of 64 blocks -> 67.3 GiB)" in message
    )
    assert message.endswith("or set trainer.check_memory=false to start anyway")


def test_paper_d64_with_activation_checkpointing_under_fsdp_fits():
    cfg = paper_d64("trainer=fsdp", "trainer.activation_checkpointing=true")
    check_gpu_fits(cfg, GB80)
    terms = gpu_training_terms(cfg.model, cfg.trainer)
    assert terms["AdamW state"] == pytest.approx(8 * 908e6 / 8, rel=0.01)  # sharded over the 8 GPUs
    # HSDP on 2 nodes: sharded over a node's 8 GPUs, not the 16 of the run
    hsdp = paper_d64(
        "trainer=fsdp", "trainer.activation_checkpointing=true", "trainer.num_nodes=2", "trainer.hsdp=true"
    )
    assert gpu_training_terms(hsdp.model, hsdp.trainer)["AdamW state"] == terms["AdamW state"]
    fsdp16 = paper_d64("trainer=fsdp", "trainer.activation_checkpointing=true", "trainer.num_nodes=2")
    assert gpu_training_terms(fsdp16.model, fsdp16.trainer)["AdamW state"] == pytest.approx(
        terms["AdamW state"] / 2, rel=1e-3
    )


def test_the_refusal_orders_the_remedies_by_what_they_save():
    # paper_d512 under ddp needs both: checkpointing first (activations dominate), then FSDP
    with pytest.raises(
        ConfigError,
        match=r"trainer.activation_checkpointing=all \(-> [\d.]+ GiB\), then "
        r"trainer.strategy=fsdp \(-> [\d.]+ GiB\); or set trainer.check_memory",
    ):
        check_gpu_fits(
            load_config(overrides=["model=paper_d512", "trainer=ddp", "trainer.devices=8", "trainer.accelerator=gpu"]),
            GB80,
        )
    # one GPU cannot shard: a smaller micro-batch (same global batch), then more GPUs or memory
    with pytest.raises(
        ConfigError,
        match=r"trainer.micro_batch_size=1 trainer.grad_accum=8 \(-> [\d.]+ GiB\), then "
        "more GPUs under trainer.strategy=fsdp",
    ):
        check_gpu_fits(load_config(overrides=["model=paper_d512", "trainer=gpu"]), GB80)


def test_the_plain_loss_head_counts_the_full_logits():
    chunked, plain = (
        gpu_training_terms(paper_d64(f"model.loss_chunk={c}").model, paper_d64().trainer)["loss head"]
        for c in ("null", 0)
    )
    assert plain > 8 * chunked  # 16,384 tokens x 50,304 logits, against one chunk of 1,024


def test_keel_pretrain_on_a_gpu_checks_before_anything_is_made(tmp_path, monkeypatch, capsys):
    import torch

    from keel.cli import main as cli_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(keel.memory, "gpu_memory_bytes", lambda: GB80)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # set_threads writes it; restored after the test
    argv = [
        "pretrain",
        "model=paper_d64",
        "trainer=ddp",
        "trainer.devices=8",
        "trainer.compile=false",
        f"trainer.threads={torch.get_num_threads()}",
        f"run.dir={tmp_path / 'run'}",
    ]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "needs about 72.9 GiB per GPU" in err and "trainer.check_memory=false" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model", ["paper_d128", "paper_d256", "paper_d512"])
def test_the_deep_paper_configs_need_activation_checkpointing_and_their_documented_command_fits(model):
    overrides = [f"model={model}", "trainer=fsdp", "trainer.devices=8", "trainer.accelerator=gpu"]
    with pytest.raises(ConfigError, match="change, in this order: trainer.activation_checkpointing=(auto|all)"):
        check_gpu_fits(load_config(overrides=overrides), GB80)
    check_gpu_fits(load_config(overrides=[*overrides, "trainer.activation_checkpointing=true"]), GB80)  # conf/model


def checkpointing(blocks: int, *overrides: str):
    """paper_d64 on 8 GPUs with its first `blocks` of 64 blocks checkpointed."""
    return paper_d64(
        *overrides,
        f"trainer.activation_checkpointing={'none' if blocks == 0 else blocks / 64}"
        if blocks < 64
        else "trainer.activation_checkpointing=all",
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_partial_checkpointing_saves_each_block_s_activations_less_its_input(strategy):
    def need(blocks):
        cfg = checkpointing(blocks, f"trainer={strategy}")
        return gpu_training_bytes(cfg.model, cfg.trainer)

    tokens, per_block = 8 * 2048, 56_400  # Keel's bytes per token per block at width 1,024 (issue #35)
    block_parameters = parameter_counts(paper_d64().model)["blocks"] / 64
    copies = 2 * block_parameters if strategy == "ddp" else 0  # DDP: a block's bf16 weight copies, saved by autocast
    for blocks in (1, 17, 62):  # (block 0, Keel's first, has fewer norms)
        assert need(blocks) - need(blocks + 1) == pytest.approx((per_block - 4 * 1024) * tokens + copies, abs=1)
    assert need(64) > need(63)  # the last block's recomputation happens as backward starts: it saves nothing
    cfg = paper_d64("trainer=fsdp", "trainer.activation_checkpointing=all")  # docs/model.md's table: 10.0 GiB
    assert gpu_training_bytes(cfg.model, cfg.trainer) / 2**30 == pytest.approx(10.0, abs=0.05)


def test_the_margin_refuses_a_run_that_fits_only_without_it():
    cfg = paper_d64("trainer=fsdp")  # 60.1 GiB, 66.1 with the margin
    check_gpu_fits(cfg, 67 * 2**30)
    with pytest.raises(
        ConfigError,
        match=r"needs about 60.1 GiB per GPU \(.*\), 66.1 GiB with the 10% allocator "
        r"margin, more than the 63.0 GiB of this GPU; change, in this order: "
        r"trainer.activation_checkpointing=auto \(the first 4 of 64 blocks",
    ):
        check_gpu_fits(cfg, 63 * 2**30)


def test_auto_takes_the_fewest_blocks_that_fit_the_mocked_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(keel.memory, "gpu_memory_bytes", lambda: 40 * 2**30)
    cfg = paper_d64("trainer=fsdp", "trainer.activation_checkpointing=auto")
    assert resolve_activation_checkpointing(cfg) == (
        "trainer.activation_checkpointing=auto: the first 30 of 64 blocks (0.46875)"
    )
    # by hand: 60.1 GiB, less (56,400 - 4,096) x 16,384 bytes (0.80 GiB) per block, is under 40 / 1.1 = 36.4 GiB
    # from the 30th block on
    for blocks, fits in ((30, True), (29, False)):
        trainer = checkpointing(blocks, "trainer=fsdp").trainer
        assert (with_margin(gpu_training_bytes(cfg.model, trainer)) <= 40 * 2**30) is fits
    # trainer.gpu_memory_gib caps the visible GPU's memory; without a GPU it is the memory planned with
    for gib, budget in (("null", 40 * 2**30), (30, 30 * 2**30), (80, 40 * 2**30)):
        assert gpu_budget_bytes(paper_d64(f"trainer.gpu_memory_gib={gib}").trainer) == budget
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_budget_bytes(paper_d64("trainer.gpu_memory_gib=79").trainer) == 79 * 2**30
    assert gpu_budget_bytes(paper_d64().trainer) is None


def test_auto_on_cpu_takes_the_fewest_blocks_that_fit_the_memory_available(monkeypatch):
    cfg = load_config(
        overrides=[
            "model.depth=64",
            "model.width=256",
            "trainer.micro_batch_size=64",
            "trainer.activation_checkpointing=auto",
        ]
    )
    have = (cpu_training_bytes(cfg, 0) + cpu_training_bytes(cfg, 63)) // 2
    monkeypatch.setattr("keel.memory.available_bytes", lambda: have)
    blocks = round(cpu_auto_checkpointing(cfg) * 64)
    assert cpu_training_bytes(cfg, blocks) <= have < cpu_training_bytes(cfg, blocks - 1)


def test_keel_estimate_plans_a_gpu_run_without_a_gpu(capsys):
    # recipe=paper accumulates gradients (grad_accum 4): they are held through each micro-batch's forward, and the
    # estimate counts them beside the activations
    # estimate, as on a GPU: the blocks compiled (trainer=fsdp's compile=auto, on with a GPU accelerator)
    paper = ["recipe=paper", "model=paper_d64", "trainer=fsdp", "trainer.devices=8", "trainer.accelerator=gpu"]
    assert cli_main(["estimate", *paper, "trainer.gpu_memory_gib=79"]) == 0
    out = capsys.readouterr().out
    assert "auto        trainer.activation_checkpointing=auto: no block (none)" in out
    assert "the others keep 43.0 KiB per token per block, compiled" not in out  # none checkpointed: no others
    assert "activation checkpointing off: 43.0 KiB per token per block, compiled" in out
    # room for the unsharded gradients of the 3 micro-batches before each step's last (4 bytes x 0.91 B: 3.4 GiB)
    assert "auto        trainer.reduce_every_micro_batch=auto: gradients reduced once per optimizer step" in out
    assert "unsharded gradients while accumulating 3.4 GiB" in out
    assert "estimate    52.0 GiB per GPU, 57.2 GiB with the 10% allocator margin" in out
    assert "GPU         79.0 GiB (trainer.gpu_memory_gib)" in out and "verdict     fits, 21.8 GiB to spare" in out
    assert cli_main(["estimate", *paper, "trainer.gpu_memory_gib=40"]) == 0  # auto checkpoints what it must
    assert "auto        trainer.activation_checkpointing=auto: the first 21 of 64 blocks" in capsys.readouterr().out
    assert cli_main(["estimate", *paper, "trainer.gpu_memory_gib=40", "trainer.activation_checkpointing=none"]) == 1
    assert (
        "verdict     does not fit; change, in this order: trainer.activation_checkpointing=auto (the first 21 "
        "of 64 blocks"
    ) in capsys.readouterr().out
    assert cli_main(["estimate", *paper, "trainer.gpu_memory_gib=40", "trainer.compile=false"]) == 0
    assert "auto        trainer.activation_checkpointing=auto: the first 31 of 64 blocks" in capsys.readouterr().out
    assert cli_main(["estimate", *paper]) == 0
    assert "memory unknown: no GPU is visible here; give it as trainer.gpu_memory_gib=GIB" in capsys.readouterr().out


def test_keel_estimate_on_cpu_says_whether_this_machine_holds_the_run(capsys, monkeypatch):
    assert cli_main(["estimate"]) == 0
    assert "verdict     fits" in capsys.readouterr().out
    monkeypatch.setattr("keel.memory.available_bytes", lambda: 2**30)
    assert cli_main(["estimate"]) == 1
    assert "verdict     does not fit: model.depth=16, model.width=128" in capsys.readouterr().out


def test_gradients_are_counted_beside_the_activations_only_while_accumulating():
    # docs/bench.md's H200 run: paper_d64 at 4 x 2,048 tokens with every block checkpointed peaked at the weights,
    # gradients and AdamW state and little more: backward makes the gradients as it frees what forward kept, so the
    # two never peak together
    one = paper_d64(
        "trainer=ddp", "trainer.devices=1", "trainer.micro_batch_size=4", "trainer.activation_checkpointing=all"
    )
    terms = gpu_training_terms(one.model, one.trainer)
    kept = terms["activations"] + terms["loss head"]
    assert terms["gradients made in freed activations' place"] == -min(terms["gradients"], kept)
    accumulating = paper_d64(
        "trainer=ddp",
        "trainer.devices=1",
        "trainer.micro_batch_size=2",
        "trainer.grad_accum=2",
        "trainer.activation_checkpointing=all",
    )
    accumulated = gpu_training_terms(accumulating.model, accumulating.trainer)
    assert "gradients made in freed activations' place" not in accumulated
    assert accumulated["gradients"] == terms["gradients"]


def test_compiled_blocks_are_estimated_by_what_they_save(monkeypatch):
    import torch

    # by hand, Keel's block compiled under bf16 autocast (keel.memory.block_bytes_per_token; C 1,024, K 512, H 3,072):
    # four 1/rms, the block's fp32 input, the attention's bf16 output, the FFN's fp32 sum, attention as eager, and
    # SwiGLU without its SiLU output: 16 + 4C + 2C + 4C + 2 (5C + 3K) + 4 x 16 + 2 (C + 3H) = 44,112 bytes
    eager, compiled = (paper_d64("trainer=ddp", f"trainer.compile={flag}") for flag in ("false", "true"))
    saved = (
        gpu_training_terms(eager.model, eager.trainer)["activations"]
        - gpu_training_terms(compiled.model, compiled.trainer)["activations"]
    )
    # block 0 is Pre-LN's (Keel's v1 first block): its second norm's fp32 input recomputed from the attention's bf16
    # output (2C less) and SwiGLU's SiLU output (2H)
    assert saved == (63 * (56_400 - 44_112) + 2 * 1024 + 2 * 3072) * 8 * 2048
    # eager, the run is refused (test_paper_d64_on_8_gpus_of_80_gb_under_ddp_is_...); compiled, it fits
    check_gpu_fits(compiled, GB80)
    # auto recomputes only what compiled blocks need: fewer blocks than eager ones, and the fewest that fit
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(keel.memory, "gpu_memory_bytes", lambda: 40 * 2**30)
    chosen = {}
    for flag in ("false", "true"):
        cfg = paper_d64("trainer=fsdp", "trainer.activation_checkpointing=auto", f"trainer.compile={flag}")
        resolve_activation_checkpointing(cfg)
        chosen[flag] = blocks = cfg.trainer.checkpointed_blocks(64)
        for n, fits in ((blocks, True), (blocks - 1, False)):
            trainer = checkpointing(n, "trainer=fsdp", f"trainer.compile={flag}").trainer
            assert (with_margin(gpu_training_bytes(cfg.model, trainer)) <= 40 * 2**30) is fits
    assert chosen["true"] < chosen["false"]


def paper_recipe(model: str, *overrides: str):
    """recipe=paper under FSDP on 8 GPUs of 79 GiB (4 micro-batches a step), compiled blocks."""
    return load_config(
        overrides=[
            "recipe=paper",
            f"model={model}",
            "trainer=fsdp",
            "trainer.devices=8",
            "trainer.accelerator=gpu",
            "trainer.gpu_memory_gib=79",
            *overrides,
        ]
    )


@pytest.mark.parametrize("model, defers", [("paper_d64", True), ("paper_d128", False), ("paper_d512", False)])
def test_fsdp_defers_the_reduction_only_where_it_costs_no_recomputed_block(model, defers):
    """trainer.reduce_every_micro_batch=auto: once per optimizer step where the unsharded gradients that keeps fit
    beside the activations at the checkpointing reducing every micro-batch needs, else every micro-batch."""
    cfg = paper_recipe(model)
    every = paper_recipe(model, "trainer.reduce_every_micro_batch=true")
    for config in (cfg, every):
        resolve_activation_checkpointing(config)
    said = resolve_gradient_reduction(cfg)
    assert cfg.trainer.reduce_every_micro_batch is (not defers) and said.endswith(f"({str(not defers).lower()})")
    assert cfg.trainer.activation_checkpointing == every.trainer.activation_checkpointing  # no block more
    terms = gpu_training_terms(cfg.model, cfg.trainer)
    kept = terms.get("unsharded gradients while accumulating")
    assert kept == (4 * sum(parameter_counts(cfg.model).values()) if defers else None)
    assert with_margin(sum(terms.values())) <= 79 * 2**30


@pytest.mark.parametrize(
    "overrides, resolved",
    [
        (["trainer.gpu_memory_gib=null"], True),  # the GPU's memory unknown: as before
        (["trainer.accelerator=cpu", "trainer.devices=2", "model=tiny"], False),  # the host's memory: defer
        (["trainer=ddp"], False),  # nothing to decide: DDP reduces once per step (Lightning's no_sync)
        (["trainer.global_batch_size=64"], False),  # one micro-batch a step: nothing to defer
    ],
)
def test_the_reduction_s_auto_elsewhere(overrides, resolved):
    cfg = paper_recipe("paper_d64", *overrides)
    resolve_gradient_reduction(cfg)
    assert cfg.trainer.reduce_every_micro_batch is resolved


def test_a_deferred_reduction_that_does_not_fit_names_reducing_every_micro_batch():
    cfg = paper_recipe("paper_d512", "trainer.reduce_every_micro_batch=false", "trainer.activation_checkpointing=all")
    with pytest.raises(ConfigError, match=r"change, in this order: trainer.reduce_every_micro_batch=true \(-> "):
        check_gpu_fits(cfg, 79 * 2**30)


def test_reduce_every_micro_batch_is_fsdp_s_alone():
    with pytest.raises(
        ConfigError,
        match="trainer.reduce_every_micro_batch: chooses when FSDP reduces accumulated "
        "gradients: it needs trainer.strategy=fsdp",
    ):
        load_config(overrides=["trainer=ddp", "trainer.reduce_every_micro_batch=true"])
