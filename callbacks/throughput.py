"""Training speed: tokens/s, achieved FLOP/s, MFU and the share of time spent waiting for data.

Logged every trainer.log_every_n_steps over the last `window` optimizer steps, rounded up to whole logging
intervals, validation excluded (the `perf/...` tags: docs/tensorboard.md, "Throughput"). Times are host wall times;
the device is synchronized at logging steps only, so an interval's time is the device's without a per-step wait.

The windowed arithmetic is Lightning's `Throughput`; its `ThroughputMonitor` callback is not used: it needs a
`flops_per_batch` attribute on the LightningModule (ours come from the config), does not measure data wait, and
its peak table misses some GPUs (Keel's: keel.flops).
"""

from __future__ import annotations

import time
from collections import deque

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from keel.cadence import due, finished_step
from keel.callbacks.log_writing import log_scalars
from keel.callbacks.options.throughput import ThroughputConfig
from keel.config import Config
from keel.flops import device_peak_flops, flops_per_token

HALF_PRECISIONS = ("bf16-mixed", "bf16-true", "16-mixed", "16-true")


def peak_flops(trainer: Trainer, configured: float) -> float | None:
    """Peak FLOP/s of one device: `configured` if > 0, else the spec sheet's (keel.flops) for this GPU under a half
    precision; None on CPU, under fp32 (no default) or for an unknown GPU (warned)."""
    device = trainer.strategy.root_device
    if configured <= 0 and (device.type != "cuda" or str(trainer.precision) not in HALF_PRECISIONS):
        return None
    peak = device_peak_flops(device, torch.bfloat16, configured)
    if peak is None:
        rank_zero_warn(
            f"no peak FLOP/s known for {torch.cuda.get_device_name(device)!r}: set "
            "callbacks.throughput.peak_flops to log perf/mfu"
        )
    return peak


class ThroughputMonitor(Callback):
    def __init__(
        self, device_tokens_per_step: int, flops_per_token: float, config: ThroughputConfig | None = None
    ) -> None:
        self.device_tokens_per_step = device_tokens_per_step  # tokens one device trains on per optimizer step
        self.flops_per_token = flops_per_token
        self.config = config if config is not None else ThroughputConfig()
        self._val_s = 0.0  # validation time since the last training batch (validation also runs outside fit)

    @classmethod
    def from_config(cls, options: ThroughputConfig, cfg: Config) -> ThroughputMonitor:
        return cls(cfg.device_tokens_per_step, flops_per_token(cfg.model), options)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.peak = peak_flops(trainer, self.config.peak_flops)
        self._cuda = trainer.strategy.root_device.type == "cuda"
        intervals = -(-self.config.window // trainer.log_every_n_steps)  # logging intervals covering the window
        self._throughput = Throughput(
            available_flops=self.peak, world_size=trainer.world_size, window_size=intervals + 1
        )
        # per logging interval: time waiting between steps, total time, optimizer steps
        self._waits: deque[float] = deque(maxlen=intervals)
        self._totals: deque[float] = deque(maxlen=intervals)
        self._counts: deque[int] = deque(maxlen=intervals)
        self._train_s, self._steps, self._interval_steps = 0.0, 0, 0
        self._last_end: float | None = None  # end of the previous micro-batch; None before the first
        self._wait = self._busy = self._val_s = self._own_s = 0.0

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_s += time.perf_counter() - self._val_start  # not training time, not data wait

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._wait += now - self._last_end - self._val_s
        self._val_s = 0.0
        self._batch_start = now

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        step = finished_step(trainer)
        log = step is not None and due(step, trainer.log_every_n_steps)
        if log and self._cuda:
            torch.cuda.synchronize()  # the interval ends when the device is done with it
        now = time.perf_counter()
        self._busy += now - self._batch_start
        if step is not None:
            self._steps += 1
            self._interval_steps += 1
        if log:
            self._train_s += self._wait + self._busy
            self._throughput.update(
                time=self._train_s,
                batches=self._steps,
                samples=self._steps,
                lengths=self._steps * self.device_tokens_per_step,
                flops=self._interval_steps * self.device_tokens_per_step * self.flops_per_token,
            )
            self._waits.append(self._wait)
            self._totals.append(self._wait + self._busy)
            self._counts.append(self._interval_steps)
            self._wait = self._busy = 0.0
            self._interval_steps = 0
            self._log(trainer, step)
        self._own_s += time.perf_counter() - now
        self._last_end = time.perf_counter()

    def _log(self, trainer: Trainer, step: int) -> None:
        rates = self._throughput.compute()  # rates appear once the window is full
        metrics = {
            "perf/flops_per_token": self.flops_per_token,
            "perf/data_wait_frac": sum(self._waits) / sum(self._totals),
            "perf/step_ms": 1e3 * sum(self._totals) / sum(self._counts),
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
