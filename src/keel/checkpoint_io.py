"""Writing checkpoints so that a crash never leaves a half-written one in place: single files through a temporary
file and a rename (AtomicCheckpointIO), sharded directories staged beside their target and swapped in whole
(commit_dir), sharded saves in the background (AsyncShardedWriter), and `last.ckpt` as hard links to a save."""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
# imported here, not at the first save: an install without them fails at start-up, not 20 minutes into a run
from torch.distributed.checkpoint import async_save
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

SHARDED_META = "meta.pt"  # Lightning's name for rank 0's part of a distributed checkpoint

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


def staging_path(path: Path) -> Path:
    """Where a sharded checkpoint is written before commit_dir moves it to `path`."""
    return path.with_name(f".{path.name}.partial")


def previous_path(path: Path) -> Path:
    """Where commit_dir keeps the checkpoint it replaces until the new one is in place."""
    return path.with_name(f".{path.name}.previous")


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
    place: a crash between the two renames leaves it there, where keel.resume.resolve_resume(auto) looks next."""
    for written in (staging / SHARDED_META, staging):  # torch's writer syncs the shards and .metadata itself
        _fsync(written)
    previous = previous_path(path)
    if path.exists():
        remove_path(previous)  # stale: `path` is newer
        os.replace(path, previous)
    os.replace(staging, path)
    _fsync(path.parent)
    remove_path(previous)


def stager_outlives_a_save() -> bool:
    """Whether this torch's DefaultStager stages more than once. Some versions (2.11 among them) clear its copy
    table after each stage, and the next save then fails (`KeyError: <class 'type'>`, pytorch#183413); there a
    stager serves one save. Asked of the stager itself, on a one-element tensor, not of the version number."""
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
    except KeyError:
        return False
    finally:
        stager.close()
    return True


class AsyncShardedWriter:
    """Sharded checkpoints written in the background (torch.distributed.checkpoint.async_save, as torchtitan does):
    `start` returns once this rank's shards are copied to host memory (pinned on CUDA, the buffers reused from save
    to save where torch's stager allows) - the only part training waits for - and a thread writes them into the
    staging directory while training goes on. `finish` waits for that write and, on rank 0, moves the checkpoint
    into place (commit_dir): it is visible only once it is whole. One save at a time. The thread's collectives run
    over a gloo group of their own (async_save needs a CPU backend; the training collectives go on in the main
    thread meanwhile)."""

    def __init__(self) -> None:
        self._group = None
        self._stager = None
        self._in_flight: tuple[Future, Path, Path, dict] | None = None  # (the write, its staging directory, its
        # path, when it ended)
        self.finished_at: float | None = None  # time.perf_counter() when the last finished write ended

    @property
    def in_flight(self) -> Path | None:
        """Where the checkpoint being written goes, or None."""
        return self._in_flight[2] if self._in_flight else None

    def done(self) -> bool:
        """Whether nothing is being written (a host-side check: no wait, no collective)."""
        return self._in_flight is None or self._in_flight[0].done()

    def open(self, device: torch.device) -> None:
        """Make the writer's gloo group (a collective: every rank, once the process group is up, so that the group
        meets the network at start-up rather than at the first save) and its stager, for tensors on `device`: one
        kept from save to save with its host buffers, or where this torch's stager serves one save, a new one each
        time (stager_outlives_a_save)."""
        self._group = torch.distributed.new_group(backend="gloo")
        cuda = device.type == "cuda"
        self._options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                       use_non_blocking_copy=cuda)
        self._stager_per_save = not stager_outlives_a_save()
        self._stager = DefaultStager(self._options)

    def start(self, state: dict, staging: Path, path: Path) -> None:
        """Write `state` to `staging`, then later (finish) to `path`; every rank, after `open`."""
        if self._stager is None:
            raise RuntimeError("checkpoint: AsyncShardedWriter.open() was not called")
        if self._in_flight is not None:
            raise RuntimeError(f"checkpoint: {self.in_flight} is still being written; finish() it first")
        if self._stager_per_save and self.finished_at is not None:  # the last save spent it
            self._stager.close()
            self._stager = DefaultStager(self._options)
        future = async_save(state, checkpoint_id=staging, process_group=self._group, async_stager=self._stager)
        ended = {}
        future.add_done_callback(lambda _: ended.setdefault("at", time.perf_counter()))
        self._in_flight = (future, staging, path, ended)

    def finish(self, commit: bool) -> Path | None:
        """Wait for the checkpoint being written, raise what failed in the background, and (commit: rank 0 alone)
        move it into place. Its path, or None if none was being written."""
        if self._in_flight is None:
            return None
        future, staging, path, ended = self._in_flight
        self._in_flight = None
        future.result()
        self.finished_at = ended.get("at", time.perf_counter())  # result() may return before the callback runs
        if commit:
            commit_dir(staging, path)
        return path

    def close(self) -> None:
        """Free the host buffers the stager keeps. A write still in flight (training raised) is left to end on its
        own, never committed: waiting for it could hang on a rank that died."""
        self._in_flight = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None


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
