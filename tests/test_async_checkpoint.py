"""Sharded checkpoints written in the background (trainer.async_checkpoint, docs/distributed.md): on by default on
GPUs only; under 2-process FSDP a run that saves asynchronously, crashes and resumes trains exactly like one that
was not interrupted, each checkpoint visible only once whole; a failed background write stops the run naming it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from keel.checkpoint.layout import LAST, SHARDED_META
from keel.checkpoint.read import read_checkpoint
from keel.config import load_config
from keel.errors import ConfigError
from keel.strategy import resolve_async_checkpoint
from keeltest.distributed import _command, _env, pretrain, seen
from keeltest.runs import scalars

ASYNC = ["trainer.async_checkpoint=true"]  # the 8 steps of keeltest.distributed.RUN: saves at 4 and 8


@pytest.mark.parametrize(
    "overrides, cuda, on",
    [
        (["trainer=fsdp"], False, False),  # CPU runs save as they did
        (["trainer=fsdp"], True, True),
        (["trainer=fsdp", "trainer.async_checkpoint=false"], True, False),
        (["trainer=ddp"], True, False),  # one file, written by rank 0: nothing to shard
        (
            ["trainer=fsdp", "trainer.async_checkpoint=true", "trainer.accelerator=cpu", "trainer.devices=2"],
            False,
            True,
        ),
    ],
)
def test_async_checkpoint_is_on_for_sharded_checkpoints_on_gpus(monkeypatch, overrides, cuda, on):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    trainer = load_config(overrides=overrides).trainer
    assert resolve_async_checkpoint(trainer) is on


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "true",
            "trainer.async_checkpoint: true writes sharded checkpoints in the background: it needs "
            "trainer.strategy=fsdp (trainer=fsdp); a single run saves one file, synchronously",
        ),
        ("later", "trainer.async_checkpoint: allowed: true, false, auto; got 'later'"),
    ],
)
def test_bad_async_checkpoint_values_say_what_is_allowed(value, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"trainer.async_checkpoint={value}"])
    assert str(err.value) == message


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of this process alone (world size 1), torn down after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("spent_after_a_stage", [False, True])
def test_one_background_writer_saves_twice_in_one_process(
    one_process_group, tmp_path, monkeypatch, spent_after_a_stage
):
    """Every save after the first reuses the writer. Some torch versions' DefaultStager (2.11's, which `make
    test-lowest` runs) clears its copy table after each stage, which broke a run's second background checkpoint;
    spent_after_a_stage makes this torch's stager do so too, and the writer then stages each save with a new one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager

    from keel.checkpoint.sharded import AsyncShardedWriter, stager_outlives_a_save

    if spent_after_a_stage:
        stage = DefaultStager.stage

        def stage_once(self, state_dict, **kwargs):
            staged = stage(self, state_dict, **kwargs)
            self._state_dict_stager.close()  # what DefaultStager._stage does at the end on those versions
            return staged

        monkeypatch.setattr(DefaultStager, "stage", stage_once)
        assert not stager_outlives_a_save()  # found out by the writer's probe
    writer = AsyncShardedWriter()
    writer.open(torch.device("cpu"))
    for step in (1, 2, 3):
        state = {"weight": torch.full((4, 3), float(step)), "moments": {"exp_avg": torch.arange(5.0) * step}}
        staging, path = tmp_path / f".step{step}.partial", tmp_path / f"step{step}"
        staging.mkdir()
        writer.start(state, staging, path)
        torch.save({"global_step": step}, staging / SHARDED_META)  # rank 0's part, as FSDP2Strategy writes it
        assert writer.finish(commit=True) == path and writer.done() and not staging.exists()
        loaded = {"weight": torch.zeros(4, 3), "moments": {"exp_avg": torch.zeros(5)}}
        dcp.load(loaded, checkpoint_id=path)
        assert torch.equal(loaded["weight"], state["weight"])
        assert torch.equal(loaded["moments"]["exp_avg"], state["moments"]["exp_avg"])
    writer.close()


@pytest.mark.slow
def test_async_saves_resume_exactly_and_show_whole_checkpoints_only(tiny_data, straight_run, tmp_path):
    run = tmp_path / "run"
    pretrain(tiny_data, run, "fsdp", crash_at=6, overrides=ASYNC)
    # the save of step 4, started two steps before the crash, was made visible once written (at a logging step)
    assert read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"] == 4
    pretrain(tiny_data, run, "fsdp", overrides=ASYNC)  # resume=auto: from step 4
    checkpoints = run / "checkpoints"
    # waited for at the end: the last one in place, the history pruned to keep_last_k=2, no staging left
    assert sorted(p.name for p in checkpoints.iterdir()) == [LAST, "step000004.ckpt", "step000008.ckpt"]
    assert sorted(p.name for p in (checkpoints / LAST).iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        SHARDED_META,
    ]
    # bit for bit the uninterrupted run that saved synchronously: writing in the background changes no step
    straight = straight_run("fsdp")
    assert sorted(scalars(run, "train/loss")) == list(range(8))
    assert scalars(run, "train/loss") == scalars(straight, "train/loss")
    resumed = read_checkpoint(checkpoints / LAST)["state_dict"]
    uninterrupted = read_checkpoint(straight / "checkpoints" / LAST)["state_dict"]
    assert resumed.keys() == uninterrupted.keys()
    for name, weight in uninterrupted.items():
        assert torch.equal(resumed[name], weight), name


# Every rank's background write of the second checkpoint fails as a full disk would.
FULL_DISK = """
import errno, sys
from torch.distributed.checkpoint import FileSystemWriter
write_data = FileSystemWriter.write_data
def fail_at_step_8(self, plan, planner):
    if "step000008" in str(self.path):
        raise OSError(errno.ENOSPC, "No space left on device")
    return write_data(self, plan, planner)
FileSystemWriter.write_data = fail_at_step_8
"""


@pytest.mark.extended
@pytest.mark.slow
def test_a_failed_background_write_stops_the_run_and_keeps_the_last_checkpoint(tiny_data, tmp_path):
    run = tmp_path / "run"
    command = _command(tiny_data, run, "fsdp", [*ASYNC, "trainer.max_steps=12"])  # step 8's save fails mid-run
    launcher = Path(command[1])
    launcher.write_text(FULL_DISK + launcher.read_text())
    done = subprocess.run(command, env=_env(run, "run"), capture_output=True, text=True, timeout=900)
    assert done.returncode != 0
    assert (
        f"checkpoint: cannot write {run / 'checkpoints' / 'step000008.ckpt'}: no space left on the device"
        in done.stderr
    ), done.stderr[-3000:]
    assert read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"] == 4
    # found failed one step later, at the next logging step: the step after the save trained while it was written
    assert {step for step, _ in seen(run)} == set(range(9))
