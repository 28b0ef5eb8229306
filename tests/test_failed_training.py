"""Training that goes wrong (docs/failures.md): non-finite weights never replace the last finite checkpoint, a save
that storage refuses, shards deleted mid-run, a diverged run reported with its step, kind and max LR."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from keel import training
from keel.checkpoint.layout import LAST
from keel.checkpoint.read import read_checkpoint
from keel.checkpoint.write import AtomicCheckpointIO
from keel.cli import main as cli_main
from keel.errors import ConfigError
from keel.training import train
from keeltest import QUIET_TRAINER, TINY_MODEL
from keeltest.runs import EIGHT_STEP_RUN, CrashAtStep, tiny_config


class NaNWeightsAt(Callback):
    """Every weight becomes NaN at the start of the given step, as after an update that diverged."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                for param in pl_module.parameters():
                    param.fill_(float("nan"))


def test_nonfinite_weights_never_replace_or_prune_the_last_finite_checkpoint(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = tiny_config(
        tiny_data,
        run,
        "trainer.max_steps=12",
        "trainer.checkpoint_every_n_steps=2",
        "trainer.keep_last_k=1",
        "trainer.val_every_n_steps=12",
        "trainer.val_batches=1",
    )
    trainer = train(cfg, [NaNWeightsAt(3)])  # saves at 2 (finite), then 4, 6 ... and the final one (NaN)
    assert training.failure_exit_code(cfg, trainer) == 1  # the stability monitor stopped it: `keel pretrain` exits 1
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [LAST, "nonfinite.ckpt", "step000002.ckpt"]
    for name in (LAST, "step000002.ckpt"):  # the last finite checkpoint, whole
        finite = read_checkpoint(checkpoints / name)
        assert finite["global_step"] == 2 and all(t.isfinite().all() for t in finite["state_dict"].values())
    nonfinite = read_checkpoint(checkpoints / "nonfinite.ckpt")
    assert nonfinite["global_step"] == trainer.global_step > 2
    assert not all(t.isfinite().all() for t in nonfinite["state_dict"].values())
    said = [line for line in capsys.readouterr().err.splitlines() if "the weights are not finite" in line]
    assert said and said[-1] == (
        f"keel pretrain: step {trainer.global_step}: the weights are not finite (NaN or inf): saved as "
        f"{checkpoints / 'nonfinite.ckpt'}, not as a step-numbered checkpoint nor over last.ckpt; "
        f"{checkpoints / LAST} keeps step 2, the last finite checkpoint"
    )


@pytest.mark.parametrize(
    "code, reason, failing",
    [
        (errno.ENOSPC, "no space left on the device", "step000008.ckpt"),
        (errno.EROFS, "the file system is read-only", "step000008.ckpt"),
        (errno.ENOSPC, "no space left on the device", LAST),
    ],
)
def test_a_save_that_storage_refuses_is_one_line_naming_the_last_good_checkpoint(
    tiny_data, tmp_path, monkeypatch, capsys, code, reason, failing
):
    """The saves of step 8 fail as a full tmpfs makes torch's zip writer fail (its RuntimeError raised while
    handling the OSError) or as a read-only file system does; step 4's checkpoint stays the last good one. When
    only last.ckpt fails (step000008.ckpt was written), the message said it kept step 8 while it held step 4."""
    save = AtomicCheckpointIO.save_checkpoint

    def failing_save(self, checkpoint, path, storage_options=None):
        if checkpoint["global_step"] < 8 or (failing == LAST and Path(path).name != LAST):  # step000008 written
            return save(self, checkpoint, path, storage_options)
        try:
            raise OSError(code, os.strerror(code))
        except OSError:
            # raised while handling it, as torch's writer does: the OSError is its __context__, not its __cause__
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904

    def no_hard_links(*args):
        raise OSError(errno.EMLINK, os.strerror(errno.EMLINK))

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", failing_save)
    if failing == LAST:  # last.ckpt links to step000008.ckpt, unless linking fails: then it is written in full
        monkeypatch.setattr(os, "link", no_hard_links)
    run = tmp_path / "run"
    argv = [
        "pretrain",
        *TINY_MODEL,
        *QUIET_TRAINER,
        "eval.enabled=false",
        *tiny_data,
        *EIGHT_STEP_RUN,
        "trainer.compile=false",
        "callbacks.layer_importance.enabled=false",
        f"run.dir={run}",
    ]
    assert cli_main(argv) == 1
    checkpoints = run / "checkpoints"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"keel pretrain: checkpoint: cannot write {checkpoints / failing}: {reason} ({os.strerror(code)}); "
        f"{checkpoints / LAST} keeps step 4, the last finite checkpoint. Free space (or make it writable) and re-run "
        "the same command to continue from there"
    )
    assert read_checkpoint(checkpoints / LAST, weights=False)["global_step"] == 4
    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", save)  # space again: the run continues and ends
    assert cli_main(argv) == 0 and read_checkpoint(checkpoints / LAST, weights=False)["global_step"] == 8


class DeleteTrainShards(Callback):
    """Removes the train split's chunk files once training has started (after the start-up check)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        for chunk in (self.data_dir / "train").glob("*.bin"):
            chunk.unlink()


def test_shards_deleted_while_training_are_named(tiny_data, tmp_path):
    """litdata waits for a missing chunk and then says it timed out, "not a missing object"; keel names the file."""
    data_dir = Path(next(o for o in tiny_data if o.startswith("data.dir=")).split("=", 1)[1])
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    cfg = tiny_config(tiny_data, tmp_path / "run", f"data.dir={copy}", "trainer.max_steps=4")
    chunk = sorted((copy / "train").glob("*.bin"))[0]
    with pytest.raises(
        ConfigError,
        match=rf"^while training: {copy}/train/{chunk.name} is truncated or missing "
        r"\(missing\): .* restore them to continue from its checkpoint",
    ):
        train(cfg, [DeleteTrainShards(copy)])


def test_a_diverged_run_fails_with_step_kind_and_max_lr(tiny_data, tmp_path, capsys):
    argv = [
        "pretrain",
        *TINY_MODEL,
        *QUIET_TRAINER,
        "eval.enabled=false",
        *tiny_data,
        "trainer.max_steps=40",
        "optim.lr=1e6",
        "optim.warmup_steps=2",
        "callbacks.layer_importance.enabled=false",
    ]
    assert cli_main([*argv, f"run.dir={tmp_path / 'default'}"]) == 1
    err = capsys.readouterr().err
    # the first update (LR 5e5) already broke the model: no LR was sustained, none is reported as tolerated
    assert "keel pretrain: the run failed at step 1 (nonfinite:" in err
    assert err.count("keel pretrain: stability: stopping the run: the run failed at step 1") == 1  # as it stops
    assert "max tolerable LR none (it failed from the first step)" in err
    report = json.loads((tmp_path / "default" / "stability.json").read_text())
    assert report["failed"] and report["steps"] < 40 and report["max_tolerable_lr"] is None  # stopped, checkpointed
    assert read_checkpoint(tmp_path / "default" / "checkpoints" / LAST, weights=False)["global_step"] < 40

    assert cli_main([*argv, f"run.dir={tmp_path / 'on'}", "callbacks.stability.stop_on_failure=false"]) == 0
    goes_on = [line for line in capsys.readouterr().err.splitlines() if "training goes on" in line]
    assert goes_on == [line for line in goes_on if line.startswith("keel pretrain: stability: the run failed at ")]
    assert len(goes_on) == 1 and "max tolerable LR" in goes_on[0]  # said once, in a Keel line
    assert json.loads((tmp_path / "on" / "stability.json").read_text())["steps"] == 40


def test_a_crash_in_a_resumed_run_resumes_where_the_run_straight_through_goes(tiny_data, tmp_path):
    """The crash's save holds the data position of the last completed step in a resumed run too: a restored
    litdata dataset hands out its live state, which the next batch moved on, and the second resume skipped a batch."""
    run = [
        "trainer.max_steps=12",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.val_every_n_steps=12",
        "trainer.val_batches=1",
    ]
    train(tiny_config(tiny_data, tmp_path / "straight", *run))
    for crash in (3, 6):  # the second crash is in the run resumed from the first one's save
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(tiny_config(tiny_data, tmp_path / "crashed", *run, "resume=auto"), [CrashAtStep(crash)])
    train(tiny_config(tiny_data, tmp_path / "crashed", *run, "resume=auto"))
    straight, crashed = (
        read_checkpoint(tmp_path / name / "checkpoints" / LAST)["state_dict"] for name in ("straight", "crashed")
    )
    assert all(torch.equal(straight[key], crashed[key]) for key in straight)
