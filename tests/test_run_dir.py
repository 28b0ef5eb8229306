"""The run directory (docs/failures.md): one process per run dir (the lock), one run per run dir (a fresh start
into a used one refused, or clearing it under run.overwrite; a finished one said complete), a refused start leaving
nothing, an unwritable one refused before training, a copied one continuing from its newest checkpoint, orphan
temporary files removed."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from keel.checkpoint.layout import LAST
from keel.checkpoint.read import read_checkpoint
from keel.dirlock import LOCK
from keel.errors import ConfigError
from keel.rundir import RunDirLock
from keel.training import launched_as_rank_zero, train
from keeltest.runs import EIGHT_STEP_RUN, scalars, tiny_config

HOLD_LOCK = """
import sys
from keel.rundir import RunDirLock
lock = RunDirLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
sys.stdin.read()
"""


def hold_lock(run_dir: Path) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_process_on_a_run_dir_is_refused_naming_the_holder(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    holder = hold_lock(run)
    try:
        with pytest.raises(ConfigError) as err:
            train(tiny_config(tiny_data, run, *EIGHT_STEP_RUN))
        message = str(err.value)
        assert f"in use by another keel process: pid {holder.pid} on host {socket.gethostname()}" in message
        assert sorted(p.name for p in run.iterdir()) == [LOCK]  # nothing written: no config.yaml, tb/, checkpoints/
    finally:
        holder.kill()  # kill -9: the kernel releases the lock, the file still names the holder
        holder.wait()
    assert json.loads((run / LOCK).read_text())["pid"] == holder.pid
    train(tiny_config(tiny_data, run, "trainer.max_steps=2"))  # a stale lock is taken over, and said
    assert (
        f"(pid {holder.pid} on {socket.gethostname()}) ended without releasing its lock; taken over"
        in capsys.readouterr().err
    )
    assert (run / LOCK).read_text() == ""  # released at exit
    with RunDirLock(run):  # and free again
        pass


def test_only_the_launchers_rank_zero_takes_the_lock(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert launched_as_rank_zero()
    for env in ({"LOCAL_RANK": "1"}, {"RANK": "3"}, {"NODE_RANK": "1", "LOCAL_RANK": "0"}, {"SLURM_PROCID": "2"}):
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            assert not launched_as_rank_zero(), env


def test_unwritable_run_dir_is_refused_before_training(tiny_data, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ConfigError, match=rf"run.dir={not_a_dir}/run: cannot write there \(Not a directory\)"):
        train(tiny_config(tiny_data, not_a_dir / "run"))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "readonly"
        locked.mkdir(mode=0o555)
        with pytest.raises(ConfigError, match="cannot write there .Permission denied"):
            train(tiny_config(tiny_data, locked / "run"))


class FirstStep(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


def test_copied_run_dir_continues_from_its_newest_checkpoint_and_keeps_history(tiny_data, tmp_path):
    original, copy = tmp_path / "original", tmp_path / "copy"
    every = ["trainer.checkpoint_every_n_steps=2", "trainer.val_every_n_steps=2", "trainer.val_batches=1"]
    train(tiny_config(tiny_data, original, "trainer.max_steps=4", *every))
    shutil.copytree(original, copy)
    for max_steps in (6, 8):  # restarted twice in the copy: each time from where the last one ended
        first = FirstStep()
        trainer = train(tiny_config(tiny_data, copy, f"trainer.max_steps={max_steps}", *every), [first])
        assert (first.step, trainer.global_step) == (max_steps - 2, max_steps)
        names = sorted(p.name for p in (copy / "checkpoints").iterdir())
        assert names == [LAST, f"step{max_steps - 2:06d}.ckpt", f"step{max_steps:06d}.ckpt"]  # keep_last_k=2, no -v1
        assert read_checkpoint(copy / "checkpoints" / LAST, weights=False)["global_step"] == max_steps
    assert sorted(scalars(copy, "train/loss")) == list(range(8))
    assert read_checkpoint(original / "checkpoints" / LAST, weights=False)["global_step"] == 4  # left alone
    # any step-numbered checkpoint resumes, and the final state of a run is saved whatever the cadence
    back = tmp_path / "back"
    trainer = train(
        tiny_config(
            tiny_data,
            back,
            "trainer.max_steps=7",
            f"resume={copy}/checkpoints/step000006.ckpt",
            "trainer.keep_last_k=1",
            *every,
        )
    )
    assert trainer.global_step == 7
    assert sorted(p.name for p in (back / "checkpoints").iterdir()) == [LAST, "step000007.ckpt"]


def test_orphan_temporary_files_are_removed_at_start_up(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    (checkpoints / ".last.ckpt.partial").mkdir(parents=True)  # a killed FSDP save's staging directory
    (checkpoints / ".last.ckpt.tmp12345").write_bytes(b"half a checkpoint")  # a killed single-file save
    train(tiny_config(tiny_data, run, "trainer.max_steps=2", "trainer.keep_last_k=0"))
    assert sorted(p.name for p in checkpoints.iterdir()) == [LAST]
    assert "removed 2 temporary file(s) of interrupted checkpoint saves" in capsys.readouterr().err


def test_a_run_dir_holds_one_run(tiny_data, tmp_path, capsys):
    """A finished run rerun says it is complete and writes nothing; a fresh start into it is refused with the
    choices; run.overwrite=true deletes the earlier run first, so TensorBoard reads the new run alone."""
    run = tmp_path / "run"
    train(tiny_config(tiny_data, run, *EIGHT_STEP_RUN))
    written = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    capsys.readouterr()
    assert train(tiny_config(tiny_data, run, *EIGHT_STEP_RUN)) is None
    [said] = capsys.readouterr().err.splitlines()
    assert said.startswith(f"keel pretrain: run.dir={run} is complete (step 8 of trainer.max_steps=8, val/loss ")
    assert said.endswith("raise trainer.max_steps to train on, or start another run in a new run.dir")
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == written
    with pytest.raises(
        ConfigError,
        match=r"holds an earlier run \(config.yaml, checkpoints/, tb/\): a fresh start "
        r".*resume=auto .*run.dir=PATH.*run.overwrite=true",
    ):
        train(tiny_config(tiny_data, run, *EIGHT_STEP_RUN, "resume=null"))
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == written
    with pytest.raises(ConfigError, match="run.overwrite=true .* not resume="):
        train(tiny_config(tiny_data, run, "run.overwrite=true", f"resume={run / 'checkpoints' / LAST}"))
    train(tiny_config(tiny_data, run, "trainer.max_steps=2", "run.overwrite=true"))
    assert "run.overwrite=true: deleted the earlier run" in capsys.readouterr().err
    assert sorted(scalars(run, "train/loss")) == [0, 1] and len(list((run / "tb").glob("events.*"))) == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [LAST, "step000002.ckpt"]


def test_a_start_refused_after_writing_leaves_nothing(tiny_data, tmp_path, monkeypatch):
    """A logger that cannot start (W&B without a key) is refused after config.yaml and tb/ are written: they go,
    with the directory the start made; an existing directory keeps what it held."""

    def refuse(cfg, loggers):
        raise ConfigError("trainer.loggers: wandb cannot start a run")

    monkeypatch.setattr("keel.training.log_config", refuse)
    with pytest.raises(ConfigError, match="wandb cannot start"):
        train(tiny_config(tiny_data, tmp_path / "new" / "run"))
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    with pytest.raises(ConfigError, match="wandb cannot start"):
        train(tiny_config(tiny_data, tmp_path / "mine"))
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


def test_a_run_that_left_no_checkpoint_starts_again_only_under_its_own_config(tiny_data, tmp_path, capsys):
    """resume=auto where an earlier start left logs but no checkpoint (a kill before the first): the same config
    starts again with those logs deleted (TensorBoard would draw both starts as one); another config is refused."""
    run = tmp_path / "run"
    train(tiny_config(tiny_data, run, "trainer.max_steps=2"))
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(ConfigError, match=r"holds an earlier run \(config.yaml, tb/, and no checkpoint to continue\)"):
        train(tiny_config(tiny_data, run, "trainer.max_steps=2", "optim.lr=0.001"))
    capsys.readouterr()
    train(tiny_config(tiny_data, run, "trainer.max_steps=2"))
    assert "left no checkpoint: its logs (config.yaml, tb/) are deleted and it starts again" in capsys.readouterr().err
    assert len(list((run / "tb").glob("events.*"))) == 1 and sorted(scalars(run, "train/loss")) == [0, 1]
