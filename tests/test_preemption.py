"""One checkpoint event writes the state once: last.ckpt hard-links the step-numbered checkpoint (docs/failures.md,
"Checkpoint history")."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from keel.callbacks import checkpointing
from keel.checkpoint import LAST, AtomicCheckpointIO, link_checkpoint, previous_path, read_checkpoint, staging_path
from keel.training import train

from test_pretrain import CrashAtStep, scalars, tiny_config

STEPS = ["trainer.max_steps=8", "trainer.checkpoint_every_n_steps=4", "trainer.val_every_n_steps=4",
         "trainer.val_batches=2"]


# ------------------------------------------------------------------------- one write per checkpoint event


def count_writes(monkeypatch) -> tuple[list[str], list[int]]:
    """The paths AtomicCheckpointIO writes, and the steps whose weights are checked for finiteness."""
    writes, checks = [], []
    save, finite = AtomicCheckpointIO.save_checkpoint, checkpointing.weights_finite

    def counted_save(self, checkpoint, path, storage_options=None):
        writes.append(Path(path).name)
        return save(self, checkpoint, path, storage_options)

    def counted_check(trainer):
        checks.append(trainer.global_step)
        return finite(trainer)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", counted_save)
    monkeypatch.setattr(checkpointing, "weights_finite", counted_check)
    return writes, checks


@pytest.mark.parametrize("keep_last_k, hard_links", [(1, True), (0, True), (1, False)])
def test_a_checkpoint_event_writes_the_state_once(tiny_data, tmp_path, monkeypatch, capsys, keep_last_k, hard_links):
    writes, checks = count_writes(monkeypatch)
    if not hard_links:  # a filesystem without them: last.ckpt is written in full, and that is said once
        def no_hard_links(*args):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))

        monkeypatch.setattr(os, "link", no_hard_links)
    run = tmp_path / "run"
    every = ["trainer.max_steps=6", "trainer.checkpoint_every_n_steps=2", "trainer.val_every_n_steps=6",
             "trainer.val_batches=1"]
    train(tiny_config(tiny_data, run, *every, f"trainer.keep_last_k={keep_last_k}"))
    assert checks == [2, 4, 6]  # one finiteness check per event
    checkpoints = run / "checkpoints"
    if not hard_links:
        assert writes == ["step000002.ckpt", LAST, "step000004.ckpt", LAST, "step000006.ckpt", LAST]
        assert capsys.readouterr().err.count("cannot hard-link") == 1
    elif keep_last_k:
        assert writes == ["step000002.ckpt", "step000004.ckpt", "step000006.ckpt"]
        assert (checkpoints / LAST).stat().st_ino == (checkpoints / "step000006.ckpt").stat().st_ino
    else:
        assert writes == [LAST, LAST, LAST]
    assert sorted(p.name for p in checkpoints.iterdir()) == [LAST, *(["step000006.ckpt"] if keep_last_k else [])]
    assert read_checkpoint(checkpoints / LAST, weights=False)["global_step"] == 6


def test_last_ckpt_outlives_the_step_checkpoint_it_links_and_resumes_exactly(tiny_data, tmp_path):
    steps = [*STEPS, "trainer.checkpoint_every_n_steps=2", "trainer.keep_last_k=1"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(tiny_config(tiny_data, straight, *steps))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config(tiny_data, run, *steps), [CrashAtStep(7)])
    checkpoints = run / "checkpoints"
    # 2, 4, 6 pruned; 7, the last completed step, saved as the exception ended the run
    assert sorted(p.name for p in checkpoints.iterdir()) == [LAST, "step000007.ckpt"]
    (checkpoints / "step000007.ckpt").unlink()  # as a later prune would
    assert read_checkpoint(checkpoints / LAST, weights=False)["global_step"] == 7
    train(tiny_config(tiny_data, run, *steps))  # resume=auto
    assert scalars(run, "train/loss") == scalars(straight, "train/loss")


def test_linking_a_sharded_checkpoint_replaces_last_whole_and_survives_its_source(tmp_path):
    last = tmp_path / LAST
    for step in (2, 4):
        source = tmp_path / f"step{step:06d}.ckpt"
        source.mkdir()
        for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"):
            (source / name).write_text(f"{name} of step {step}")
        link_checkpoint(source, last)
        assert (last / "meta.pt").read_text() == f"meta.pt of step {step}"
        assert (last / "meta.pt").stat().st_ino == (source / "meta.pt").stat().st_ino  # linked, not copied
    for name in ("step000002.ckpt", "step000004.ckpt"):  # pruned
        for file in (tmp_path / name).iterdir():
            file.unlink()
        (tmp_path / name).rmdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LAST]  # no staging or previous copy left
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert (last / "__1_0.distcp").read_text() == "__1_0.distcp of step 4"
    assert not staging_path(last).exists() and not previous_path(last).exists()
