"""The throughput monitor's options: `callbacks.throughput.*`."""

from __future__ import annotations

from dataclasses import dataclass

from keel.callbacks.options import CallbackConfig
from keel.errors import require


@dataclass
class ThroughputConfig(CallbackConfig):
    """tokens/s, FLOP/s, MFU and data-wait share (keel.callbacks.throughput); every trainer.log_every_n_steps."""

    name = "throughput"
    priority = -100  # last: its step timing then includes the other callbacks' work
    callback = "keel.callbacks.throughput.ThroughputMonitor"

    window: int = 20  # optimizer steps averaged
    peak_flops: float = 0.0  # per device; 0 = look the GPU up (bf16/fp16 runs; CPU: no MFU)

    def __post_init__(self) -> None:
        require(self.window >= 2, self.key("window"), "must be >= 2")
        require(self.peak_flops >= 0, self.key("peak_flops"), "must be >= 0 (0 = look up)")
