"""Writing checkpoints so that a crash never leaves a half-written one in place: single files through a temporary
file and a rename (AtomicCheckpointIO), sharded directories staged beside their target and swapped in whole
(commit_dir), and `last.ckpt` as hard links to a save (link_checkpoint). Sharded saves: keel.checkpoint.sharded."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from keel.checkpoint.layout import SHARDED_META, previous_path, staging_path


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file in the same directory, fsync, then rename over the target:
    a crash mid-save leaves the previous checkpoint intact."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def commit_dir(staging: Path, path: Path) -> None:
    """Move a complete checkpoint directory to `path`. A directory cannot be renamed over another, so the
    old checkpoint is first renamed aside to previous_path(path) and deleted only once the new one is in
    place: a crash between the two renames leaves it there, where keel.checkpoint.resume.resolve_resume(auto) looks
    next."""
    for written in (staging / SHARDED_META, staging):  # torch's writer syncs the shards and .metadata itself
        _fsync(written)
    previous = previous_path(path)
    if path.exists():
        remove_path(previous)  # stale: `path` is newer
        os.replace(path, previous)
    os.replace(staging, path)
    _fsync(path.parent)
    remove_path(previous)


def link_checkpoint(source: Path, path: Path, copy: bool = False) -> None:
    """Make `path` the checkpoint `source` holds without writing it again: hard links to its file (or to each file of
    a sharded directory), swapped in whole like a save (os.replace, commit_dir), so `path` is replaced atomically and
    deleting `source` later (keep_last_k pruning) leaves it whole. Raises OSError where the filesystem has no hard
    links; copy=True copies the files instead (a second write)."""
    link = shutil.copy2 if copy else os.link
    if source.is_dir():
        staging = staging_path(path)
        remove_path(staging)  # left by a link that crashed
        staging.mkdir()
        try:
            for file in source.iterdir():  # flat: the shards, .metadata, meta.pt
                link(file, staging / file.name)
        except OSError:
            remove_path(staging)
            raise
        commit_dir(staging, path)
        return
    staging = path.with_name(f".{path.name}.tmp{os.getpid()}")  # AtomicCheckpointIO's name: removed if orphaned
    staging.unlink(missing_ok=True)
    try:
        link(source, staging)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    _fsync(path.parent)
