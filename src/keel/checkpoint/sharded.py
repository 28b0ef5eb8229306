"""The FSDP strategy's sharded checkpoints (keel.strategy.FSDP2Strategy delegates its save and load here): a
directory of per-rank shards plus rank 0's meta.pt, written to a staging directory first, then swapped in whole
(keel.checkpoint.write.commit_dir), so a crash mid-save leaves the previous checkpoint readable; its `.metadata` and
byte entries checked for code before torch reads them (keel.checkpoint.safe.refuse_payloads). With async_checkpoint
the shards are written in the background (AsyncShardedWriter) and swapped in by finish_sharded, which the checkpoint
callback calls (through the strategy) once the write is done."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

# imported here, not at the first save: an install without them fails at start-up, not 20 minutes into a run
from torch.distributed.checkpoint import async_save
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from keel.checkpoint.layout import SHARDED_META, staging_path
from keel.checkpoint.safe import refuse_payloads
from keel.checkpoint.write import commit_dir


def save_sharded(strategy, checkpoint: dict, filepath, write: Callable[[dict, Path], None]) -> None:
    """Save checkpoint (Lightning's dict, the model's and optimizer's state sharded) at filepath on every rank of
    strategy (its broadcast, barrier, is_global_zero and async_writer). write: the strategy's own synchronous
    sharded save into a directory (Lightning's ModelParallelStrategy.save_checkpoint), returning once every rank
    wrote its shards."""
    path = Path(strategy.broadcast(str(filepath)))
    staging = staging_path(path)
    if strategy.is_global_zero:
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that crashed
    strategy.barrier()
    if strategy.async_writer is not None:  # Lightning's layout: the tensors by DCP, the rest in rank 0's meta.pt
        staging.mkdir(parents=True, exist_ok=True)
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        strategy.async_writer.start(tensors, staging, path)
        if strategy.is_global_zero:
            torch.save(checkpoint, staging / SHARDED_META)
        return
    write(checkpoint, staging)
    if strategy.is_global_zero:
        commit_dir(staging, path)
    strategy.barrier()


def finish_sharded(strategy) -> Path | None:
    """Wait for the checkpoint strategy's async_writer is writing in the background, raise what failed there, and
    move it into place; its path, or None if none was being written."""
    if strategy.async_writer is None or strategy.async_writer.in_flight is None:
        return None
    path = strategy.async_writer.finish(commit=strategy.is_global_zero)
    strategy.barrier()
    return path


def load_sharded(strategy, checkpoint_path, read: Callable[[Path], dict]) -> dict:
    """The checkpoint at checkpoint_path (the same on every rank of strategy) through read, the strategy's own
    loader (Lightning's ModelParallelStrategy.load_checkpoint), a sharded one refused first if it would run code:
    torch would unpickle its .metadata and byte entries as they are."""
    path = Path(strategy.broadcast(str(checkpoint_path)))
    if path.is_dir():
        refuse_payloads(path)
    return read(path)


def stager_outlives_a_save() -> bool:
    """Whether this torch's DefaultStager stages more than once. Some versions (2.11 among them) clear its copy
    table after each stage, and the next save then fails (`KeyError: <class 'type'>`, pytorch#183413); there a
    stager serves one save. Asked of the stager itself, on a one-element tensor, not of the version number."""
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
        )
    )
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
        self._options = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
        )
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
