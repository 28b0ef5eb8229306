"""A clean stop on a signal: `GracefulInterrupt` turns Ctrl-C, SIGTERM and SIGUSR1 into the end of the run after
the step in progress (RunCheckpoint saves it, keel.callbacks.checkpointing), and requeues a SLURM job after SIGUSR1.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from keel.cadence import due
from keel.rundir import say

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # ranks agree on the latest listed that any got
SAID = {signal.SIGINT: "interrupted", signal.SIGTERM: "SIGTERM", signal.SIGUSR1: "SIGUSR1 (SLURM's time-limit warning)"}


def requeue_slurm_job() -> None:
    """After SIGUSR1 in a SLURM job, once its checkpoint is written: put the job back in the queue (SLURM ends this
    run; the next starts the same command, which continues from the checkpoint), said in one line."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return
    if os.environ.get("SLURM_ARRAY_JOB_ID"):  # an array task is requeued by its own id
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        say(
            f"SLURM job {job}: no scontrol on PATH to requeue it; run `scontrol requeue {job}` where there is one "
            "(or submit the same sbatch script again)"
        )
        return
    try:
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
        failure = None if done.returncode == 0 else (done.stderr or done.stdout).strip() or f"exit {done.returncode}"
    except (OSError, subprocess.SubprocessError) as err:
        failure = str(err)
    if failure is None:
        say(f"requeued SLURM job {job} (scontrol requeue {job}): it continues from this checkpoint when it restarts")
    else:
        say(
            f"scontrol requeue {job} failed ({failure}): submit the job with sbatch --requeue, or submit the same "
            "sbatch script again"
        )


class GracefulInterrupt(Callback):
    """Ctrl-C (SIGINT), SIGTERM (a preemption, `kill`, scancel) or SIGUSR1 (`sbatch --signal=USR1@120`: the time
    limit is near) during training: the run stops after the optimizer step in progress and ends as a run ends
    (RunCheckpoint saves it; `keel pretrain` exits 128 + the signal's number). Under several processes they agree
    at each logging step (one all-reduce; trainer.log_every_n_steps) so that all stop after the same one,
    whichever got the signal. After SIGUSR1 in a
    SLURM job rank 0 requeues it. A second Ctrl-C exits at once, without saving; a repeated SIGTERM or SIGUSR1 (a
    task can get one from SLURM and one forwarded by srun) changes nothing."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first signal this process got
        self.signal: signal.Signals | None = None  # the one the processes agreed to stop on
        self.stopped_at: int | None = None
        self._step: int | None = None  # the global step at the last check
        self._rank_zero = True
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            if signum == signal.SIGINT:
                say("second interrupt: exiting now, without a checkpoint")
                os._exit(130)
            return
        self.received = signum
        again = " (press Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""
        if self._rank_zero:  # a signal to the job reaches every rank: one says it
            say(f"{SAID[signum]}: stopping after this step with a checkpoint{again}")

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # before Lightning installs its SIGTERM handler, which it removes at its teardown, before this one's
        self._previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._step = trainer.global_step
        self._rank_zero = trainer.is_global_zero
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:  # over Lightning's SIGTERM one: it ends training with an exception
                signal.signal(signum, self._handle)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._step:  # mid-accumulation: the optimizer step is not done
            return
        self._step = trainer.global_step
        # a collective and a host read: only at logging steps, where the host waits anyway (keel's rule); a signal
        # waits for the next one, at most trainer.log_every_n_steps - 1 steps
        if trainer.world_size == 1 or due(trainer.global_step - 1, trainer.log_every_n_steps):
            self._stop_on(self._agreed_signal(trainer), trainer)

    def _agreed_signal(self, trainer: Trainer) -> int:
        """The latest of STOP_SIGNALS that any rank got (its index + 1), 0 for none."""
        code = STOP_SIGNALS.index(self.received) + 1 if self.received is not None else 0
        if trainer.world_size > 1:
            agreed = trainer.strategy.reduce(torch.tensor(code, device=trainer.strategy.root_device), reduce_op="max")
            code = int(agreed.item())
        return code

    def _stop_on(self, code: int, trainer: Trainer) -> None:
        if code:
            trainer.should_stop = True
            self.stopped_at = trainer.global_step
            self.signal = STOP_SIGNALS[code - 1]

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.stopped_at is None:
            # a signal after the last step's check (during the final validation or evaluation) finds the run done,
            # but its process must stop all the same: `keel sweep` and `keel maxlr` would go on to their next run
            self._stop_on(self._agreed_signal(trainer), trainer)
        if self.stopped_at is None:
            return
        if self.signal == signal.SIGUSR1 and trainer.is_global_zero:
            requeue_slurm_job()
        # no rank returns before the requeue: under srun --kill-on-bad-exit the first to exit ends the others
        trainer.strategy.barrier("GracefulInterrupt.on_fit_end")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                if handler is not None:  # None: not installed from Python, nothing to restore
                    signal.signal(signum, handler)
        self._previous = {}
