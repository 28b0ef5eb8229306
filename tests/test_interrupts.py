"""Interrupts, crashes and resumes (docs/failures.md): Ctrl-C, an exception and kill -9 leave a run that resumes
exactly; a second Ctrl-C exits at once; a resume with changed settings says what changed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from keel import training
from keel.checkpoint.layout import LAST
from keel.checkpoint.read import read_checkpoint
from keel.cli import main as cli_main
from keel.schedule import lr_factor
from keel.training import Interrupted, train
from keeltest import QUIET_TRAINER, TINY_MODEL
from keeltest.runs import EIGHT_STEP_RUN, NO_EXTRAS, scalars, tiny_config


def test_resume_with_changed_optimizer_settings_is_reported_and_the_old_config_kept(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny_config(tiny_data, run, "trainer.max_steps=2"))
    old_config = (run / "config.yaml").read_text()
    capsys.readouterr()
    changed = ("trainer.max_steps=4", "optim.lr=0.001", "optim.schedule=linear_warmup", "optim.weight_decay=0.05")
    train(tiny_config(tiny_data, run, *changed))
    err = capsys.readouterr().err
    assert "resuming at step 2 with 4 changed setting(s)" in err
    for change in (
        "optim.lr: 0.003 -> 0.001",
        "optim.schedule: 'cosine' -> 'linear_warmup'",
        "trainer.max_steps: 2 -> 4",
        "optim.weight_decay: 0.01 -> 0.05",
    ):
        assert change in err
    assert (run / "config.2.yaml").read_text() == old_config
    cfg = tiny_config(tiny_data, run, *changed)
    assert "lr: 0.001" in (run / "config.yaml").read_text()
    # and they took effect: the checkpoint's optimizer settings and base LR do not outlive the config that changed them
    lrs = scalars(run, "lr/matrices")
    for step in (2, 3):
        assert lrs[step] == pytest.approx(0.001 * lr_factor(step, cfg.optim, 4), rel=1e-6)
    groups = read_checkpoint(run / "checkpoints" / LAST)["optimizer_states"][0]["param_groups"]
    assert [(g["initial_lr"], g["weight_decay"]) for g in groups] == [(0.001, 0.05), (0.001, 0.0)]  # matrices, gains
    train(tiny_config(tiny_data, run, *changed))
    assert "changed setting" not in capsys.readouterr().err  # same settings: nothing to report


class InterruptAt(Callback):
    """Ctrl-C at a step (count times): the signal, as a terminal sends it."""

    def __init__(self, step: int, count: int = 1) -> None:
        self.step, self.count = step, count

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for _ in range(self.count):
                os.kill(os.getpid(), signal.SIGINT)


def test_sigint_saves_a_checkpoint_and_resume_matches_an_uninterrupted_run(tiny_data, tmp_path, monkeypatch, capsys):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    train(tiny_config(tiny_data, straight, *EIGHT_STEP_RUN))
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(Interrupted, match=f"interrupted: saved step 6 to {interrupted / 'checkpoints' / LAST}"):
        train(tiny_config(tiny_data, interrupted, *EIGHT_STEP_RUN), [InterruptAt(5)])  # step 5 finishes first
    assert read_checkpoint(interrupted / "checkpoints" / LAST, weights=False)["global_step"] == 6
    assert signal.getsignal(signal.SIGINT) is handler  # restored
    train(tiny_config(tiny_data, interrupted, *EIGHT_STEP_RUN))  # resume=auto
    assert scalars(interrupted, "train/loss") == scalars(straight, "train/loss")

    configured = training.build_callbacks  # the command line says so and exits 130
    monkeypatch.setattr(training, "build_callbacks", lambda cfg, dataset: [*configured(cfg, dataset), InterruptAt(1)])
    argv = ["pretrain", *TINY_MODEL, *QUIET_TRAINER, "eval.enabled=false", *tiny_data, *EIGHT_STEP_RUN]
    assert cli_main([*argv, f"run.dir={tmp_path / 'cli'}"]) == 130
    assert "keel pretrain: interrupted: saved step 2 to " in capsys.readouterr().err


class SignalDuringTheLastValidation(Callback):
    """SIGTERM during the held-out evaluation after the last step: past the last step's check for a signal."""

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.global_step == trainer.max_steps:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_after_the_last_step_still_stops_the_sweep(tiny_data, tmp_path, monkeypatch, capsys):
    """The run it reaches is done and saved, but the process stops: `keel sweep` does not go on to its next run (it
    used to, the signal forgotten), and says how to continue."""
    run = tmp_path / "run"
    with pytest.raises(Interrupted, match=f"SIGTERM: saved step 8 to {run / 'checkpoints' / LAST}"):
        train(tiny_config(tiny_data, run, *EIGHT_STEP_RUN), [SignalDuringTheLastValidation()])
    assert read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"] == 8

    configured = training.build_callbacks
    monkeypatch.setattr(
        training, "build_callbacks", lambda cfg, dataset: [*configured(cfg, dataset), SignalDuringTheLastValidation()]
    )
    sweep = tmp_path / "sweep"
    argv = ["sweep", "--lrs", "0.001,0.002", "--out", str(sweep), *TINY_MODEL, *QUIET_TRAINER, *NO_EXTRAS, *tiny_data]
    assert cli_main([*argv, *EIGHT_STEP_RUN]) == 128 + signal.SIGTERM
    assert "keel sweep: SIGTERM: saved step 8 to " in capsys.readouterr().err
    assert (sweep / "lr0.001" / "checkpoints" / LAST).is_file() and not (sweep / "lr0.002").exists()


class CrashMidStep(Callback):
    """Raises in the second micro-batch of a step: the loader is part-way into it."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 5 and batch_idx % 2:
            raise RuntimeError("simulated crash")


def test_an_exception_saves_the_last_completed_step(tiny_data, tmp_path, capsys):
    steps = [*EIGHT_STEP_RUN, "trainer.checkpoint_every_n_steps=100", "trainer.grad_accum=2"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(tiny_config(tiny_data, straight, *steps))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config(tiny_data, run, *steps), [CrashMidStep()])
    assert read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"] == 5
    assert "training raised RuntimeError: saved step 5" in capsys.readouterr().err
    train(tiny_config(tiny_data, run, *steps))  # resume=auto
    assert scalars(run, "train/loss") == scalars(straight, "train/loss")


LAUNCH_SIGNALLED = """
import os, signal, sys
from lightning.pytorch.callbacks import Callback
from keel import cli, training

class Signal(Callback):  # sys.argv[1]: SIGINT twice (Ctrl-C, Ctrl-C) or SIGKILL, as step 6 is about to start
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == 6:
            for _ in range(2):
                os.kill(os.getpid(), getattr(signal, sys.argv[1]))

configured = training.build_callbacks
training.build_callbacks = lambda cfg, dataset: [*configured(cfg, dataset), Signal()]
sys.exit(cli.main(sys.argv[2:]))
"""


def signalled_run(tiny_data, run: Path, signal_name: str) -> subprocess.CompletedProcess:
    argv = [
        "pretrain",
        *TINY_MODEL,
        *QUIET_TRAINER,
        "eval.enabled=false",
        *tiny_data,
        f"run.dir={run}",
        *EIGHT_STEP_RUN,
    ]
    return subprocess.run(
        [sys.executable, "-c", LAUNCH_SIGNALLED, signal_name, *argv], capture_output=True, text=True, timeout=600
    )


def test_kill_9_resumes_from_the_last_checkpoint_exactly(tiny_data, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    train(tiny_config(tiny_data, straight, *EIGHT_STEP_RUN))
    assert signalled_run(tiny_data, killed, "SIGKILL").returncode == -signal.SIGKILL
    assert read_checkpoint(killed / "checkpoints" / LAST, weights=False)["global_step"] == 4  # nothing saved at 6
    train(tiny_config(tiny_data, killed, *EIGHT_STEP_RUN))  # its lock died with it; resume=auto replays steps 4 and 5
    assert scalars(killed, "train/loss") == scalars(straight, "train/loss")


def test_second_sigint_exits_at_once_without_saving(tiny_data, tmp_path):
    run = tmp_path / "run"
    done = signalled_run(tiny_data, run, "SIGINT")
    assert done.returncode == 130, done.stderr[-3000:]
    assert "second interrupt: exiting now, without a checkpoint" in done.stderr
    assert read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"] == 4  # the periodic one
