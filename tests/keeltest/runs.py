"""Helpers of the tests that train tiny runs: their config, callbacks that crash a step, make it NaN or record its
batch, and readers of what a run logged."""

from __future__ import annotations

import math
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from keel.config import load_config
from keeltest import QUIET_TRAINER, TINY_MODEL

NO_EXTRAS = ["eval.enabled=false"]
# an 8-step run that checkpoints and validates every 4 steps
EIGHT_STEP_RUN = [
    "trainer.max_steps=8",
    "trainer.checkpoint_every_n_steps=4",
    "trainer.val_every_n_steps=4",
    "trainer.val_batches=2",
]
# a 4-step run that checkpoints at step 2
FOUR_STEP_RUN = [
    "trainer.max_steps=4",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.val_every_n_steps=4",
    "trainer.val_batches=1",
    "optim.warmup_steps=4",
]


def tiny_config(tiny_data, run_dir: Path, *extra: str):
    return load_config(overrides=[*TINY_MODEL, *QUIET_TRAINER, *NO_EXTRAS, *tiny_data, f"run.dir={run_dir}", *extra])


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """step -> value for a tag, over every event file of the run (a resumed run adds files)."""
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {event.step: event.value for event in acc.Scalars(tag)}


def events(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


class CrashAtStep(Callback):
    """Simulates a killed process: raises when the given step is about to start."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


class NaNLossAt(Callback):
    """Makes the last block's output (hence the loss and every gradient) NaN during the given steps."""

    def __init__(self, *steps: int) -> None:
        self.steps = set(steps)
        self.handle = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            self.handle = pl_module.model.blocks[-1].register_forward_hook(lambda module, args, out: out * math.nan)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class FirstBatch(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0:
            self.batch = batch.clone()
