"""Training speed: tokens/s, achieved FLOP/s, MFU and the share of time spent waiting for data.

Logged every trainer.log_every_n_steps, over the last `window` optimizer steps (validation time excluded):

    perf/tokens_per_s             all ranks together
    perf/tokens_per_s_per_device
    perf/flops_per_token          training FLOPs per token, from the config (keel.model.flops_per_token)
    perf/flops_per_s              achieved, per device
    perf/mfu                      flops_per_s / peak FLOP/s of one device (GPU only; see peak_flops())
    perf/data_wait_frac           time from one step's end to the next step's start, over the total: data
                                  loading plus anything else between steps (e.g. writing a checkpoint)
    perf/step_ms                  mean wall time of an optimizer step, waiting included
    time/throughput_ms            this callback's own time per step

The windowed arithmetic is Lightning's `Throughput`. Lightning's `ThroughputMonitor` callback is not used: it
needs a `flops_per_batch` attribute on the LightningModule (ours come from the config), does not measure data
wait, and its peak table does not recognise an H200 and lists with-sparsity peaks for some GPUs.
"""

from __future__ import annotations

import time
from collections import deque

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from keel.callbacks._logging import due, finished_step, log_scalars

# Dense (no sparsity) bf16/fp16 tensor-core peak per device, by a substring of torch.cuda.get_device_name();
# the first match wins, so more specific names come first.
PEAK_BF16_FLOPS = (
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h100", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("b200", 2250e12),
    ("a100", 312e12),
    ("l40s", 362e12),
    ("l40", 181e12),
    ("l4", 121e12),
    ("a10", 125e12),  # A10 and A10G (AWS publishes no separate A10G figure)
    ("rtx 4090", 165e12),  # with fp32 accumulation, as PyTorch's bf16 matmuls use
    ("rtx 3090", 71e12),
)
HALF_PRECISIONS = ("bf16-mixed", "bf16-true", "16-mixed", "16-true")


def peak_flops(trainer: L.Trainer, configured: float) -> float | None:
    """Peak FLOP/s of one device: `configured` if > 0, else the table's figure for this GPU under a half
    precision; None on CPU, under fp32 (no default) or for an unknown GPU (warned)."""
    if configured > 0:
        return configured
    device = trainer.strategy.root_device
    if device.type != "cuda" or str(trainer.precision) not in HALF_PRECISIONS:
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((flops for key, flops in PEAK_BF16_FLOPS if key in name.lower()), None)
    if peak is None:
        rank_zero_warn(f"no peak FLOP/s known for {name!r}: set callbacks.throughput.peak_flops to log perf/mfu")
    return peak


class SpeedMonitor(Callback):
    def __init__(self, tokens_per_step: int, flops_per_token: float, window: int = 20, peak_flops: float = 0.0) -> None:
        self.tokens_per_step = tokens_per_step  # per device per optimizer step
        self.flops_per_token = flops_per_token
        self.window = window
        self.configured_peak = peak_flops
        self._val_s = 0.0  # validation time since the last training batch (validation also runs outside fit)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peak = peak_flops(trainer, self.configured_peak)
        self._cuda = trainer.strategy.root_device.type == "cuda"
        self._throughput = Throughput(available_flops=self.peak, world_size=trainer.world_size, window_size=self.window)
        self._waits: deque[float] = deque(maxlen=self.window)
        self._totals: deque[float] = deque(maxlen=self.window)
        self._train_s, self._steps = 0.0, 0
        self._last_end: float | None = None  # end of the previous micro-batch; None before the first
        self._wait = self._busy = self._val_s = self._own_s = 0.0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_s += time.perf_counter() - self._val_start  # not training time, not data wait

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._wait += now - self._last_end - self._val_s
        self._val_s = 0.0
        self._batch_start = now

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if self._cuda:
            torch.cuda.synchronize()  # kernels are asynchronous: the step ends when the device is done
        now = time.perf_counter()
        self._busy += now - self._batch_start
        step = finished_step(trainer)
        if step is not None:
            self._steps += 1
            self._train_s += self._wait + self._busy
            self._throughput.update(
                time=self._train_s,
                batches=self._steps,
                samples=self._steps,
                lengths=self._steps * self.tokens_per_step,
                flops=self.tokens_per_step * self.flops_per_token,
            )
            self._waits.append(self._wait)
            self._totals.append(self._wait + self._busy)
            self._wait = self._busy = 0.0
            if due(step, trainer.log_every_n_steps):
                self._log(trainer, step)
        self._own_s += time.perf_counter() - now
        self._last_end = time.perf_counter()

    def _log(self, trainer: L.Trainer, step: int) -> None:
        rates = self._throughput.compute()  # rates appear once the window is full
        metrics = {
            "perf/flops_per_token": self.flops_per_token,
            "perf/data_wait_frac": sum(self._waits) / sum(self._totals),
            "perf/step_ms": 1e3 * sum(self._totals) / len(self._totals),
            "time/throughput_ms": 1e3 * self._own_s / trainer.log_every_n_steps,
        }
        self._own_s = 0.0
        if "device/items_per_sec" in rates:
            metrics["perf/tokens_per_s_per_device"] = rates["device/items_per_sec"]
            metrics["perf/tokens_per_s"] = rates.get("items_per_sec", rates["device/items_per_sec"])
        if "device/flops_per_sec" in rates:
            metrics["perf/flops_per_s"] = rates["device/flops_per_sec"]
        if "device/mfu" in rates:
            metrics["perf/mfu"] = rates["device/mfu"]
        log_scalars(trainer, metrics, step)
