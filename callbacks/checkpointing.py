"""Checkpoints of a run: `RunCheckpoint` decides when and where they are written (a signal's clean stop, which
writes one, is keel.callbacks.interrupt's).

    <run.dir>/checkpoints/last.ckpt          every trainer.checkpoint_every_n_steps, at the end and on a raise
                                             (after the step's validation and evaluation, where it has them);
                                             hard links to the step-numbered checkpoint of the same save
    <run.dir>/checkpoints/step000400.ckpt    the same saves, step-numbered: the newest trainer.keep_last_k kept
    <run.dir>/checkpoints/nonfinite.ckpt     a save whose weights are not finite, instead of the two above

Each save is written whole before it replaces anything, and older ones are pruned only after; with
trainer.async_checkpoint a save becomes visible only once its background write is complete (docs/failures.md,
docs/distributed.md "In the background").
"""

from __future__ import annotations

import copy
import os
import re
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import CheckpointException  # a BaseException: each rank's failure of a save
from torch.distributed.tensor import DTensor

from keel.cadence import due, finished_step
from keel.checkpoint.layout import LAST
from keel.checkpoint.write import link_checkpoint
from keel.errors import STORAGE_FAILURES, StorageError, describe_error
from keel.rundir import say

STEP_NAME = re.compile(r"^step(\d+)\.ckpt$")
NONFINITE = "nonfinite.ckpt"


def storage_failure(err: BaseException) -> str | None:
    """Why a save failed, if storage is the cause anywhere in the chain: torch's zip writer raises
    `RuntimeError: ... unexpected pos` from the OSError, and torch.distributed.checkpoint collects each rank's."""
    pending, seen = [err], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in STORAGE_FAILURES:
            return f"{STORAGE_FAILURES[current.errno][0]} ({os.strerror(current.errno)})"
        failures = getattr(current, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        pending += [current.__cause__, current.__context__]
    return None


def background_failure(err: BaseException) -> str:
    """What failed in a background write, in one line: torch.distributed.checkpoint raises a CheckpointException
    holding each failed rank's exception (its text is their tracebacks), or the exception itself."""
    failures = getattr(err, "failures", None)  # {rank: exception, or (exception, traceback)}
    if not isinstance(failures, dict) or not failures:
        return describe_error(err).splitlines()[0]
    rank, failure = min(failures.items())
    failure = failure[0] if isinstance(failure, tuple) else failure
    return f"rank {rank}: {type(failure).__name__}: {describe_error(failure).splitlines()[0]}"


def weights_finite(trainer: Trainer) -> bool:
    """Whether every weight is finite, in every process (each checks its own shards under FSDP)."""
    local = (p.to_local() if isinstance(p, DTensor) else p for p in trainer.lightning_module.parameters())
    return trainer.strategy.reduce_boolean_decision(all(bool(t.isfinite().all()) for t in local), all=True)


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, set up so that:
    - last.ckpt is overwritten, never versioned (`last-v1.ckpt`): Lightning versions it when the checkpoint it
      resumed from recorded another directory, i.e. in every copied or renamed run dir;
    - the step-numbered history is pruned by what is in the directory, so a copied dir, another keep_last_k or
      a resume from an older checkpoint keep exactly the newest k of this run's timeline;
    - the final state is saved at the end of training, whatever the cadence;
    - a checkpoint of a step that is validated (every trainer.val_every_n_steps, and the last) is written after
      its validation and in-loop evaluation, so that it records their results, not the previous ones;
    - non-finite weights are saved as nonfinite.ckpt only: they never replace last.ckpt nor enter the history,
      whose pruning would then delete the last finite checkpoint;
    - an exception in a single-process run saves the state of the last completed step (several processes
      would have to agree mid-step, which a failing one cannot).
    """

    def __init__(self, dirpath: str | Path, every_n_steps: int, keep_last_k: int, val_every_n_steps: int = 0) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="step{step:06d}",
            auto_insert_metric_name=False,
            every_n_train_steps=every_n_steps,
            save_top_k=-1 if keep_last_k else 0,  # all, then pruned to keep_last_k by _prune
            save_last=True,
            enable_version_counter=False,
        )
        self.keep_last_k = keep_last_k
        self.val_every_n_steps = val_every_n_steps
        self._after_validation = False  # this step's checkpoint waits for the validation that follows the step
        self._start_step = 0
        self._boundary: tuple[int, dict] | None = None  # (global step, loop and loader state) after the last step
        self._replace: dict | None = None  # entries of the checkpoint being written that _boundary replaces
        self._last_finite_step: int | None = None  # in last.ckpt, saved by this run with finite weights
        self._written: tuple[int, str] | None = None  # (step, path) of this run's last finite write
        self._hard_links = True  # until the filesystem refuses one: last.ckpt is then written in full
        # each write: step, path, seconds the save held the training loop (blocking_s), seconds finish_save waited
        # for a write in the background to end (waited_s), seconds until the checkpoint was whole (total_s)
        self.saves: list[dict] = []
        self._in_flight: dict | None = None  # the entry of saves being written in the background (async saves)
        self.abandoned = False  # a rewind (StabilityMonitor) discards the state since: nothing more is saved

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        with warnings.catch_warnings():  # a resumed run's directory is not empty, by design
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start_step = trainer.global_step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx) -> None:
        # On restart Lightning adds one to the loggers' step counter, on the premise that the checkpoint was
        # written inside a step; the final checkpoint is written after it, so a run extended from it (a larger
        # max_steps) logged every step one too late. With one optimizer the counter is the global step.
        if trainer.global_step == self._start_step:
            trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        if self.abandoned:
            return
        step = finished_step(trainer)
        if self._in_flight and step is not None and due(step, trainer.log_every_n_steps):
            # the ranks agree that the background write is done (a collective: at logging steps only, keel's rule)
            if trainer.strategy.reduce_boolean_decision(trainer.strategy.async_writer.done(), all=True):
                self.finish_save(trainer)
        saved = self._last_global_step_saved
        if step is not None and self._validated_after(trainer):
            every = self._every_n_train_steps
            self._after_validation = every > 0 and trainer.global_step % every == 0
        else:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._last_global_step_saved != saved:
            self._prune(trainer)
        step_done = trainer.global_step != (self._boundary[0] if self._boundary else self._start_step)
        if step_done and trainer.world_size == 1:  # not mid-accumulation
            self._boundary = (trainer.global_step, self._progress(trainer))

    def _validated_after(self, trainer: Trainer) -> bool:
        """Whether Lightning validates after the optimizer step just taken: every val_every_n_steps, at the last
        step (KeelLitModule asks for it) and on a stop (a signal)."""
        done = trainer.global_step
        return (
            trainer.should_stop
            or done >= trainer.max_steps
            or (self.val_every_n_steps > 0 and done % self.val_every_n_steps == 0)
        )

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning runs the checkpoint callbacks last: the step's held-out loss and evaluation are recorded
        deferred, self._after_validation = self._after_validation, False
        if not deferred or self._should_skip_saving_checkpoint(trainer):
            super().on_validation_end(trainer, pl_module)
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        self._prune(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step not in (self._start_step, self._last_global_step_saved) and not self.abandoned:
            self.save_now(trainer)
        self.finish_save(trainer)  # the run ends (or requeues) with its last checkpoint whole and in place

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, StorageError) or self.abandoned:  # a save failed: another would fail the same way
            return
        if self._in_flight and trainer.world_size == 1:  # several processes would have to agree, as below
            try:
                self.finish_save(trainer)
            except Exception as err:
                say(f"training raised {type(exception).__name__}, and the checkpoint being written failed: {err}")
                return
        step = trainer.global_step
        if self._boundary is None or self._boundary[0] != step or step == self._last_global_step_saved:
            return  # nothing completed since the last checkpoint, or several processes (see the class doc)
        self._replace = self._boundary[1]
        try:
            self.save_now(trainer)
            say(
                f"training raised {type(exception).__name__}: saved step {step} to {self.last_model_path}; "
                "re-run the same command to continue from there"
            )
        except Exception as err:  # the original exception is what the user must see
            say(f"training raised {type(exception).__name__}, and its checkpoint could not be written: {err}")
        finally:
            self._replace = None

    @staticmethod
    def _progress(trainer: Trainer) -> dict:
        """The checkpoint entries that move within a step: the loops' progress and the data loader's position, copied:
        a restored litdata dataset returns its live state dict, which the next batch moves on (a crash in a resumed
        run saved the position one batch on, and its resume skipped a batch)."""
        loops = {
            name: getattr(trainer, name).state_dict()
            for name in ("fit_loop", "validate_loop", "test_loop", "predict_loop")
        }
        progress = {"loops": loops}
        if trainer.datamodule is not None:
            progress[type(trainer.datamodule).__qualname__] = trainer.datamodule.state_dict()
        return copy.deepcopy(progress)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        if self._replace is not None:  # the live loops and loader are part-way into the step that failed
            checkpoint.update(self._replace)

    def load_state_dict(self, state_dict: dict) -> None:
        # A copied or renamed run dir: the same files, elsewhere. Lightning would reset (and version last.ckpt).
        last = str(Path(self.dirpath) / LAST)
        super().load_state_dict({**state_dict, "dirpath": self.dirpath, "last_model_path": last, "best_k_models": {}})

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """Every write comes here, once per checkpoint event (the step-numbered one, or last.ckpt when keep_last_k=0):
        the one finiteness check of the event, and non-finite weights go to nonfinite.ckpt instead."""
        if not weights_finite(trainer):
            nonfinite = Path(self.dirpath) / NONFINITE
            self._write(trainer, str(nonfinite))
            if trainer.is_global_zero:
                say(
                    f"step {trainer.global_step}: the weights are not finite (NaN or inf): saved as {nonfinite}, "
                    f"not as a step-numbered checkpoint nor over last.ckpt; {self._kept()}"
                )
            return
        self._write(trainer, filepath)
        self._written = (trainer.global_step, filepath)
        if Path(filepath).name == LAST and not self._in_flight:  # what _kept() names
            self._last_finite_step = trainer.global_step

    def _write(self, trainer: Trainer, filepath: str) -> None:
        """Write (or, async, start writing) the current state to `filepath`; at most one write in the background."""
        self.finish_save(trainer)
        start = time.perf_counter()
        with self._storage_errors(filepath):
            super()._save_checkpoint(trainer, filepath)
        save = {
            "step": trainer.global_step,
            "path": filepath,
            "start": start,
            "blocking_s": time.perf_counter() - start,
            "waited_s": 0.0,
        }
        self.saves.append(save)
        if getattr(trainer.strategy, "async_writer", None) is not None:
            self._in_flight = save
        else:
            save["total_s"] = save["blocking_s"]

    @contextmanager
    def _storage_errors(self, filepath: str):
        """A storage failure while writing `filepath` raised as a StorageError saying what was kept and what to do."""
        try:
            yield
        except (Exception, CheckpointException) as err:
            if (reason := storage_failure(err)) is None:
                raise
            raise StorageError(
                f"checkpoint: cannot write {filepath}: {reason}; {self._kept()}. Free space (or make "
                "it writable) and re-run the same command to continue from there"
            ) from None

    def finish_save(self, trainer: Trainer) -> None:
        """Wait for the checkpoint being written in the background, if any, then make it visible: moved into place,
        last.ckpt linked to it, the history pruned. A failed write raises here, on every rank (torch gathers each
        rank's failure), naming the checkpoint and the rank; nothing it would have replaced is touched."""
        if self._in_flight is None:
            return
        save, self._in_flight = self._in_flight, None
        step, filepath, waiting = save["step"], save["path"], time.perf_counter()
        with self._storage_errors(filepath):
            try:
                trainer.strategy.finish_checkpoint()
            except (Exception, CheckpointException) as err:
                if storage_failure(err) is not None:
                    raise
                raise RuntimeError(
                    f"checkpoint: writing {filepath} in the background failed ({background_failure(err)}"
                    f"); {self._kept()}"
                ) from err
        save["waited_s"] = time.perf_counter() - waiting
        save["total_s"] = trainer.strategy.async_writer.finished_at - save["start"]
        if Path(filepath).name == LAST:
            self._last_finite_step = step
        elif Path(filepath).name != NONFINITE:
            self._link_last(trainer, step, filepath)
            self._prune(trainer)

    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict) -> None:
        """last.ckpt: hard links to the step-numbered checkpoint this event wrote (link_checkpoint: no second write,
        the same atomic replace), or written in full where there is none (keep_last_k=0) or the filesystem has no
        hard links. After non-finite weights (nonfinite.ckpt) it keeps the last finite state."""
        last = str(Path(self.dirpath) / LAST)
        self.last_model_path = last
        if not self.keep_last_k:
            self._save_checkpoint(trainer, last)
            return
        if self._written is None or self._written[0] != trainer.global_step:  # not finite: in nonfinite.ckpt
            return
        if not self._in_flight:  # else once the write is whole (finish_save)
            self._link_last(trainer, *self._written)

    def _link_last(self, trainer: Trainer, step: int, source: str) -> None:
        """last.ckpt: the step-numbered checkpoint `source` of `step`, hard-linked; where the filesystem has none,
        the current state written in full, or after a save in the background (the state has moved on since) a
        copy of `source` by rank 0."""
        last = str(Path(self.dirpath) / LAST)
        if self._hard_links:
            refused = None
            if trainer.is_global_zero:
                try:
                    link_checkpoint(Path(source), Path(last))
                except OSError as err:
                    refused = err.strerror or str(err)
            refused = trainer.strategy.broadcast(refused)  # the others wait for the link, or write last.ckpt too
            if refused is None:
                self._last_finite_step = step
                return
            self._hard_links = False
            if trainer.is_global_zero:
                say(
                    f"checkpoint: cannot hard-link {last} to {source} ({refused}): last.ckpt is written in "
                    "full at each checkpoint from now on (a second write per checkpoint)"
                )
        if getattr(trainer.strategy, "async_writer", None) is None:
            self._write(trainer, last)
        else:
            failed = None
            if trainer.is_global_zero:
                try:
                    link_checkpoint(Path(source), Path(last), copy=True)
                except OSError as err:
                    failed = err
            # every rank waits for rank 0's copy and fails with it: rank 0 failing alone would leave the others
            # waiting for it at their next collective
            if (failed := trainer.strategy.broadcast(failed)) is not None:
                with self._storage_errors(last):
                    raise failed
        self._last_finite_step = step

    @property
    def saved_step(self) -> int | None:
        """The step last.ckpt holds, if this run wrote it (with finite weights)."""
        return self._last_finite_step

    def _kept(self) -> str:
        """What the last good checkpoint is (saves never replace it before they are complete)."""
        last = Path(self.dirpath) / LAST
        if self._last_finite_step is not None:
            return f"{last} keeps step {self._last_finite_step}, the last finite checkpoint"
        return (
            f"{last} (from before this run) is intact"
            if last.exists()
            else "no finite checkpoint was written in this run"
        )

    def save_now(self, trainer: Trainer) -> None:
        """The current state as the next step-numbered checkpoint and last.ckpt, whole when this returns."""
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        self._prune(trainer)
        self.finish_save(trainer)

    def kept_steps(self) -> dict[int, Path]:
        """The step-numbered checkpoints in the directory, by step."""
        names = os.listdir(self.dirpath) if os.path.isdir(self.dirpath) else []
        return {int(m[1]): Path(self.dirpath) / name for name in names if (m := STEP_NAME.match(name))}

    def abandon(self, trainer: Trainer) -> None:
        """The state since the last checkpoint is to be thrown away (a rewind): the save being written in the
        background, if any, is completed, and nothing more is saved by this fit."""
        self.finish_save(trainer)
        self.abandoned = True

    def rewind_to(self, trainer: Trainer, step: int) -> None:
        """Make the checkpoint of `step` the run's newest: the later step-numbered ones (the abandoned timeline's)
        deleted, last.ckpt replaced by links to it (atomically), so that resume=auto continues from it."""
        if trainer.is_global_zero:
            kept = self.kept_steps()
            try:
                link_checkpoint(kept[step], Path(self.dirpath) / LAST)
            except OSError:  # no hard links here: a copy, once
                link_checkpoint(kept[step], Path(self.dirpath) / LAST, copy=True)
            for later in sorted(s for s in kept if s > step):
                trainer.strategy.remove_checkpoint(kept[later])
        self._last_finite_step = step
        trainer.strategy.barrier("RunCheckpoint.rewind_to")

    def _prune(self, trainer: Trainer) -> None:
        """Delete step-numbered checkpoints beyond the newest keep_last_k up to this step. Later-numbered ones
        (left by the timeline a resume from an older checkpoint abandoned) are overwritten when reached. Not while
        a checkpoint is being written in the background: it is not yet the newest (finish_save prunes)."""
        if not self.keep_last_k or self._in_flight or self.abandoned:  # abandoned: the rewind's target stays
            return
        if trainer.is_global_zero:
            steps = self.kept_steps()
            history = sorted(step for step in steps if step <= trainer.global_step)
            for step in history[: -self.keep_last_k]:
                trainer.strategy.remove_checkpoint(steps[step])
        trainer.strategy.barrier("RunCheckpoint._prune")
