"""keel.parallel's options on CPU: selective activation checkpointing (trainer.activation_checkpointing: none, all,
auto, a fraction of the blocks), compile's mode (trainer.compile_mode) and the gradient reduction's dtype
(trainer.reduce_dtype), under FSDP on 2 gloo processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import keel.parallel
from keel.config import load_config
from keel.errors import ConfigError
from keel.model import KeelLM, next_token_loss
from keel.ops.chunked_ce import compiled_chunk_loss
from keel.parallel import parallelize
from keel.strategy import build_strategy
from keeltest import QUIET_TRAINER, TINY_MODEL

DEPTH = 4


def tiny(*overrides: str):
    return load_config(overrides=[*TINY_MODEL, f"model.depth={DEPTH}", "trainer.compile=false", *overrides])


def record_checkpointed_blocks(model: KeelLM, monkeypatch) -> list[int]:
    """A list that will hold the index of each block of `model` whose forward goes through torch.utils.checkpoint."""
    seen = []
    checkpoint = keel.parallel.checkpoint

    def recording(function, block, *args, **kwargs):
        seen.append(next(i for i, b in enumerate(model.blocks) if b is block))
        return checkpoint(function, block, *args, **kwargs)

    monkeypatch.setattr(keel.parallel, "checkpoint", recording)
    return seen


@pytest.mark.parametrize(
    ("setting", "blocks"),
    [
        ("none", []),
        ("false", []),
        ("0.25", [0]),
        ("0.5", [0, 1]),
        ("0.6", [0, 1]),
        ("0.01", [0]),
        ("all", [0, 1, 2, 3]),
        ("true", [0, 1, 2, 3]),
    ],
)
def test_the_first_blocks_are_checkpointed_and_the_losses_and_gradients_do_not_change(setting, blocks, monkeypatch):
    cfg = tiny(f"trainer.activation_checkpointing={setting}")
    torch.manual_seed(0)
    plain = KeelLM(cfg.model)
    torch.manual_seed(0)
    model = KeelLM(cfg.model)
    parallelize(model, cfg.trainer)
    seen = record_checkpointed_blocks(model, monkeypatch)
    batch = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (plain, model):
        losses.append(next_token_loss(m, batch))
        losses[-1].backward()
    assert sorted(set(seen)) == blocks
    assert torch.equal(losses[1], losses[0])  # recomputation repeats the same fp32 operations
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("2", "allowed: none, all, auto, or a fraction of the blocks in (0, 1)"),
        ("1.5", "allowed: none, all, auto, or a fraction"),
        ("some", "got 'some'"),
    ],
)
def test_other_checkpointing_settings_are_refused_naming_the_key(setting, message):
    with pytest.raises(
        ConfigError, match=r"trainer.activation_checkpointing: .*" + message.replace("(", r"\(").replace(")", r"\)")
    ):
        tiny(f"trainer.activation_checkpointing={setting}")


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_compile_mode_reaches_every_compile_call(mode, monkeypatch):
    """trainer.compile_mode is torch.compile's mode= for each block and the loss head's chunk kernel."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda function, **options: calls.append(options) or function)
    compiled_chunk_loss.cache_clear()  # one compiled kernel per mode, kept by the process: made anew here
    cfg = tiny("trainer.compile=true", f"trainer.compile_mode={mode}")
    model = KeelLM(cfg.model)
    parallelize(model, cfg.trainer)
    compiled_chunk_loss.cache_clear()  # not the recording stand-in for later tests
    assert [options["mode"] for options in calls] == [mode] * (DEPTH + 1)
    assert all(options["dynamic"] is False for options in calls)


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead", "fast"])
def test_other_compile_modes_are_refused_naming_the_allowed_ones(mode):
    with pytest.raises(
        ConfigError, match=f"trainer.compile_mode: allowed: default, max-autotune-no-cudagraphs; got '{mode}'"
    ):
        tiny(f"trainer.compile_mode={mode}")


def test_auto_is_resolved_before_the_model_is_parallelized():
    cfg = tiny("trainer.activation_checkpointing=auto")
    with pytest.raises(ConfigError, match="auto is chosen from the memory estimate by keel pretrain"):
        parallelize(KeelLM(cfg.model), cfg.trainer)


def test_keel_pretrain_resolves_auto_at_start_up_says_it_and_checkpoints_those_blocks(
    tiny_data, tmp_path, monkeypatch, capsys
):
    from keel.cli import main as cli_main
    from keel.memory import cpu_training_bytes

    argv = [
        "pretrain",
        *TINY_MODEL,
        f"model.depth={DEPTH}",
        *QUIET_TRAINER,
        "eval.enabled=false",
        *tiny_data,
        "trainer.max_steps=1",
        "trainer.activation_checkpointing=auto",
        f"run.dir={tmp_path / 'run'}",
    ]
    cfg = load_config(overrides=argv[1:])
    # a machine that holds the run with 2 of its 4 blocks checkpointed, not with 1
    monkeypatch.setattr("keel.memory.available_bytes", lambda: cpu_training_bytes(cfg, 2))
    assert cpu_training_bytes(cfg, 1) > cpu_training_bytes(cfg, 2)
    model_blocks = []
    monkeypatch.setattr(
        keel.parallel, "apply_activation_checkpointing", lambda model, blocks: model_blocks.append(blocks)
    )
    assert cli_main(argv) == 0
    assert "trainer.activation_checkpointing=auto: the first 2 of 4 blocks (0.5)" in capsys.readouterr().err
    assert model_blocks == [2]
    assert load_config(str(tmp_path / "run" / "config.yaml")).trainer.activation_checkpointing == 0.5


def test_bf16_reduction_is_refused_for_one_process_and_is_ddp_s_compression_hook():
    with pytest.raises(
        ConfigError,
        match="trainer.reduce_dtype: bf16 sums gradients over processes in bf16; a single-process run sums none",
    ):
        tiny("trainer.reduce_dtype=bf16")
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    for dtype, hook in (("fp32", None), ("bf16", bf16_compress_hook)):
        strategy = build_strategy(
            tiny("trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", f"trainer.reduce_dtype={dtype}").trainer
        )
        assert strategy._ddp_comm_hook is hook


# ------------------------------------------------------------------ 2 gloo processes, FSDP


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    results = {}
    # each process resolved auto to another fraction (GPUs, or free memory, of different sizes): they agree on the
    # most blocks either asked for, else their FSDP all-gathers in backward would differ
    cfg = tiny(
        "trainer=fsdp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.precision=32-true",
        f"trainer.activation_checkpointing={0.25 if rank == 0 else 0.5}",
    )
    model = KeelLM(cfg.model)
    parallelize(model, cfg.trainer, mesh)
    results["checkpointed"] = [i for i, block in enumerate(model.blocks) if "forward" in vars(block)]
    # the gradients' reduce-scatter in fp32 or bf16: what the sharded parameters' gradients hold after it
    batch = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(rank))
    for dtype in ("fp32", "bf16"):
        cfg = tiny(
            "trainer=fsdp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.precision=32-true",
            f"trainer.reduce_dtype={dtype}",
        )
        torch.manual_seed(0)
        model = KeelLM(cfg.model)
        parallelize(model, cfg.trainer, mesh)
        next_token_loss(model, batch).backward()
        grads = [p.grad.to_local() for p in model.parameters() if isinstance(p.grad, DTensor)]
        results[dtype] = {
            "dtypes": {g.dtype for g in grads},
            "bf16_values": all(torch.equal(g, g.bfloat16().float()) for g in grads),
        }
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_fsdp_processes_agree_on_checkpointed_blocks_and_reduce_in_the_dtype_asked(tmp_path):
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    mp.spawn(_worker, args=(find_free_network_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["checkpointed"] for r in ranks] == [[0, 1], [0, 1]]  # 0.25 and 0.5 of 4 blocks: both checkpoint 2
    for r in ranks:
        # fp32 master gradients either way; summed in bf16, every value is one bf16 can hold
        assert r["fp32"] == {"dtypes": {torch.float32}, "bf16_values": False}
        assert r["bf16"] == {"dtypes": {torch.float32}, "bf16_values": True}
