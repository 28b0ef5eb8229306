"""The callbacks section: `keel pretrain` of the paper section's model and batch, sizes.paper_steps steps: the step
time with every configurable callback on (the periodic ones every CALLBACKS_EVERY steps), with each off in turn,
and with all off."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from keel.gpu_check.common import PAPER_WARMUP, Sizes, failed, free_memory, keel
from keel.gpu_check.paper import paper_overrides

# The periodic callbacks fire every this many steps (grad_norms' default; layer_importance's is 200), so that each
# one's cost shows in a window of sizes.paper_steps - PAPER_WARMUP steps
CALLBACKS_EVERY = 10


class StepClock(Callback):
    """Seconds per optimizer step from step `start` to the last, the device synchronized only at the window's two
    ends: a synchronization per step would hide what the callbacks make the host wait for. Last in the callback
    list, so each step's time includes every other callback's work."""

    def __init__(self, start: int) -> None:
        self.start, self.began, self.seconds_per_step = start, None, None

    @staticmethod
    def _now(trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.began is None and trainer.global_step == self.start:
            self.began = self._now(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == trainer.max_steps:  # before the final checkpoint (on_train_end)
            self.seconds_per_step = (self._now(trainer) - self.began) / (trainer.global_step - self.start)


def callbacks(device: str, sizes: Sizes, out: Path, data: list[str]) -> dict:
    """`keel pretrain`'s step time (the paper section's model and batch, in this process) with every configurable
    callback on, with each one off in turn, and with all off: what each costs per step. The in-loop downstream
    evaluation runs between steps, after validation, and logs its own time (time/downstream_eval_s): it is off here,
    with validation."""
    from keel.config import CALLBACKS, load_config
    from keel.training import train

    if error := failed(keel("data", *data, timeout=600)):
        return {"ok": False, "error": f"keel data: {error}"}
    steps = sizes.paper_steps
    common = [
        *paper_overrides(device, sizes),
        *data,
        f"trainer.max_steps={steps}",
        "eval.enabled=false",
        "trainer.val_batches=2",
        f"trainer.val_every_n_steps={steps + 1}",
        f"trainer.checkpoint_every_n_steps={steps + 1}",
        f"callbacks.layer_importance.every_n_steps={CALLBACKS_EVERY}",
        f"callbacks.grad_norms.every_n_steps={CALLBACKS_EVERY}",
    ]
    names = [c.name for c in CALLBACKS]
    variants = {
        "all on": [],
        **{f"{name} off": [f"callbacks.{name}.enabled=false"] for name in names},
        "progress bar off": ["trainer.progress_bar=false"],
        "all off": [*(f"callbacks.{name}.enabled=false" for name in names), "trainer.progress_bar=false"],
    }
    runs = {}
    for index, (label, overrides) in enumerate(variants.items()):
        run_dir = out / f"callbacks-{index}"
        clock = StepClock(PAPER_WARMUP)
        try:
            train(load_config(overrides=[*common, *overrides, f"run.dir={run_dir}"]), [clock])
            runs[label] = (
                {"ok": True, "step_ms": 1e3 * clock.seconds_per_step}
                if clock.seconds_per_step
                else {"ok": False, "error": "stopped before its last step: not timed"}
            )
        except torch.OutOfMemoryError as err:
            runs[label] = {"ok": False, "error": f"out of memory: {err}"}
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)  # the paper model's checkpoint: gigabytes a run
            free_memory(torch.device(device))
    if runs["all on"]["ok"]:
        for run in (run for run in runs.values() if run["ok"]):
            run["cost_ms"] = runs["all on"]["step_ms"] - run["step_ms"]  # of what this variant turned off
    return {"ok": all(r["ok"] for r in runs.values()), "callback_runs": runs, "timed_steps": steps - PAPER_WARMUP}
