"""The gradient-norm monitor's options: `callbacks.grad_norms.*`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from keel.callbacks.options import CallbackConfig
from keel.errors import require

if TYPE_CHECKING:
    from keel.config.trainer import TrainerConfig


@dataclass
class GradNormsConfig(CallbackConfig):
    """Per-layer gradient norms before clipping (keel.callbacks.grad_norms)."""

    name = "grad_norms"
    priority = 40
    callback = "keel.callbacks.grad_norms.GradNormMonitor"

    every_n_steps: int = 10  # measure and log every this many optimizer steps
    heatmap_every_n_steps: int = 100  # depth x step image; 0 = never
    activation_every_n_steps: int = 0  # ||dL/dx_l|| * rms(x_l) via keel.gradflow (one extra fwd+bwd); 0 = off
    max_blocks: int = 32  # blocks with their own scalar tags (evenly spaced); 0 = all. The heatmap shows all

    def __post_init__(self) -> None:
        for key in ("every_n_steps", "heatmap_every_n_steps", "activation_every_n_steps", "max_blocks"):
            require(getattr(self, key) >= 0, self.key(key), "must be >= 0")
        require(
            not self.enabled or self.every_n_steps >= 1,
            self.key("every_n_steps"),
            f"must be >= 1 (or set {self.key('enabled')}=false)",
        )
        require(
            self.every_n_steps < 1 or self.heatmap_every_n_steps % self.every_n_steps == 0,
            self.key("heatmap_every_n_steps"),
            f"must be a multiple of {self.key('every_n_steps')}={self.every_n_steps} (0 = never)",
        )

    def check(self, trainer: TrainerConfig) -> None:
        require(
            not self.activation_every_n_steps or (trainer.resolved_strategy != "fsdp" and not trainer.compile),
            self.key("activation_every_n_steps"),
            "the activation-gradient profile (keel.gradflow) needs "
            "unsharded, uncompiled blocks: set trainer.compile=false (trainer=cpu compiles by default) and a "
            "strategy other than fsdp, or set it to 0",
        )
