"""Multi-GPU commands checked without GPUs: whether every rank gets its batches (keel.data.loading.check_splits_fit,
computed from the config and the shards' chunk sizes), and what trainer=ddp / trainer=fsdp set."""

from __future__ import annotations

import re
import shlex

import pytest
import torch

from keel.cli import main as cli_main
from keel.config import load_config
from keel.data.loading import batches_per_rank, check_splits_fit, open_dataset, token_loader
from keel.errors import ConfigError
from keeltest import QUIET_TRAINER, REPO, TINY_MODEL

# Tokens per litdata chunk of each split. stdlib: the default build (docs/data.md, "The default corpus": 3,373,501 /
# 109,379 tokens, one chunk per split at data.chunk_bytes=16MB). fineweb_edu: a lower bound for its default build
# (data.max_chars=2e9 at >= 4 characters per GPT-2 token, 2% held out, uint16 ids: 8M tokens per 16 MB chunk).
SPLITS = {
    "data/stdlib": {"train": [3_373_501], "val": [109_379]},
    "data/fineweb_edu": {"train": [8_000_000] * 60, "val": [8_000_000, 1_800_000]},
}


def documented_commands() -> list[list[str]]:
    """The overrides of each `keel pretrain` command (make's ARGS included) in the README's "Scaling out" section,
    in docs/distributed.md and in docs/slurm/pretrain.sbatch."""
    readme = (REPO / "README.md").read_text().split("## Scaling out", 1)[1].split("\n## ", 1)[0]
    text = (
        readme
        + (REPO / "docs" / "distributed.md").read_text()
        + (REPO / "docs" / "slurm" / "pretrain.sbatch").read_text()
    ).replace("\\\n", " ")
    lines = re.findall(r"keel(?:\.cli)? pretrain ([^`#\n]*)", text) + re.findall(r'make pretrain ARGS="([^"]*)"', text)
    return [
        [word for word in shlex.split(line) if "=" in word and not word.startswith("run.dir=")]
        for line in lines
        if "..." not in line and "|" not in line
    ]  # not the prose's `trainer=ddp|fsdp`, `... num_nodes=N`


def test_the_old_scaling_command_is_refused_with_the_numbers_per_rank():
    """`trainer=fsdp trainer.devices=8 model=paper_d64` on the default data: 53 validation sequences of 2,049
    tokens, 6 per rank at 8 ranks, no whole batch of 8; at 4 ranks 1 batch, at 2 ranks 3, where 16 are asked."""
    for devices, per_rank, batches in ((8, 6, 0), (4, 13, 1), (2, 26, 3)):
        cfg = load_config(overrides=["trainer=fsdp", f"trainer.devices={devices}", "model=paper_d64"])
        with pytest.raises(ConfigError) as refused:
            check_splits_fit(cfg, SPLITS[cfg.data.dir])
        message = str(refused.value)
        assert message.startswith(
            "trainer.val_batches=16: data/stdlib/val holds 53 sequence(s) of model.seq_len + 1 "
            f"= 2,049 tokens, {per_rank} per rank over {devices} process(es)"
        )
        assert (
            f"{batches} batch(es) of trainer.micro_batch_size=8 per rank, fewer than the 16 trainer.val_batches "
            "asks for"
        ) in message
        assert ("lower trainer.val_batches" in message) == (batches > 0)  # naming 0 would be no way out
        assert "data.val_fraction" in message and "data=fineweb_edu" in message and "\n" not in message


def test_the_documented_scaling_commands_fit_their_data():
    commands = documented_commands()
    assert len(commands) >= 6  # README: fsdp, ddp, make; distributed.md: gpu, ddp, fsdp, torchrun, srun
    for overrides in commands:
        cfg = load_config(overrides=overrides)
        check_splits_fit(cfg, SPLITS[cfg.data.dir])
    multi = {(cfg.trainer.world_size, cfg.data.dir) for cfg in map(lambda o: load_config(overrides=o), commands)}
    assert {(8, "data/stdlib"), (8, "data/fineweb_edu"), (16, "data/fineweb_edu")} <= multi


def test_a_training_split_smaller_than_one_step_is_refused():
    cfg = load_config(overrides=["trainer=ddp", "trainer.devices=8", "trainer.grad_accum=4", "trainer.val_batches=1"])
    splits = {"train": [257 * 8 * 8 * 3 + 256], "val": SPLITS["data/stdlib"]["val"]}  # 3 batches per rank, not 4
    with pytest.raises(
        ConfigError,
        match=r"^trainer.grad_accum=4: data/stdlib/train holds 192 sequence\(s\) .* 24 "
        r"per rank over 8 process\(es\) .*: 3 batch\(es\) .* fewer than the 4 "
        r"trainer.grad_accum asks for; lower trainer.grad_accum to 3 or less, .*"
        r"more training text",
    ):
        check_splits_fit(cfg, splits)
    splits["train"] = [257 * 8 * 8 * 4]
    check_splits_fit(cfg, splits)


def test_the_count_is_the_loaders_own(tiny_data):
    """check_splits_fit's batches per rank are those litdata deals each rank (told it is the last of 2, 4 or 64
    processes, where a remainder would go, as it would be under torch.distributed), with and without workers."""
    from litdata.utilities.env import _DistributedEnv

    for world, workers in ((1, 0), (2, 0), (4, 2), (64, 0)):
        cfg = load_config(
            overrides=[
                *TINY_MODEL,
                *QUIET_TRAINER,
                *tiny_data,
                f"trainer.devices={world}",
                f"data.loader_workers={workers}",
            ]
        )
        info = open_dataset(cfg)
        dataset = token_loader(cfg, "val", shuffle=False).dataset
        dataset.distributed_env = _DistributedEnv(world, world - 1, 1)
        batches = dataset.get_len(workers, cfg.trainer.micro_batch_size) // cfg.trainer.micro_batch_size
        assert batches_per_rank(cfg, info.chunk_tokens["val"])[1] == batches
        cfg.trainer.val_batches = batches
        check_splits_fit(cfg, info.chunk_tokens)
        cfg.trainer.val_batches = batches + 1
        with pytest.raises(ConfigError, match=f": {batches} batch"):
            check_splits_fit(cfg, info.chunk_tokens)


@pytest.mark.parametrize("trainer", ["ddp", "fsdp"])
def test_multi_gpu_trainers_compile_where_the_accelerator_resolves_to_a_gpu(trainer, monkeypatch, capsys):
    """compile: auto (ddp.yaml, fsdp.yaml): on where trainer.accelerator=auto resolves to a GPU (CUDA mocked: 8
    GPUs), off on CPU as before; `keel pretrain --print-config` shows the resolved value; true and false force it."""
    command = ["pretrain", f"trainer={trainer}", "trainer.devices=8", "--print-config"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert cli_main(command) == 0
    printed = capsys.readouterr().out
    assert "  accelerator: auto\n" in printed and "  compile: true\n" in printed
    assert load_config(overrides=[f"trainer={trainer}", "trainer.compile=false"]).trainer.compile is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert cli_main(command) == 0
    assert "  compile: false\n" in capsys.readouterr().out
    assert load_config(overrides=[f"trainer={trainer}", "trainer.compile=true"]).trainer.compile is True
    assert load_config(overrides=[f"trainer={trainer}", "trainer.accelerator=gpu"]).trainer.compile is True


def test_compile_auto_follows_the_named_accelerator_and_cpu_keeps_compiling():
    """trainer=gpu is compile: auto on an accelerator it names (no GPU needed to resolve it); trainer=cpu keeps
    compile: true (the CPU default, docs/bench.md); auto on a CPU accelerator is off; other values are refused."""
    assert load_config(overrides=["trainer=gpu"]).trainer.compile is True
    assert load_config(overrides=["trainer=gpu", "trainer.accelerator=cpu"]).trainer.compile is False
    assert load_config(overrides=["trainer=cpu"]).trainer.compile is True
    assert load_config(overrides=["trainer=cpu", "trainer.compile=auto"]).trainer.compile is False
    with pytest.raises(ConfigError, match=r"^trainer.compile: allowed: true, false, auto; got 'maybe'$"):
        load_config(overrides=["trainer.compile=maybe"])
