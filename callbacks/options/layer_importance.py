"""The layer-importance callback's options: `callbacks.layer_importance.*`."""

from __future__ import annotations

from dataclasses import dataclass

from keel.callbacks.options import CallbackConfig
from keel.errors import require


@dataclass
class LayerImportanceConfig(CallbackConfig):
    """Loss increase when each block is skipped, on a fixed batch (keel.callbacks.layer_importance)."""

    name = "layer_importance"
    priority = 20
    callback = "keel.callbacks.layer_importance.LayerImportance"

    every_n_steps: int = 200  # measure every this many optimizer steps
    max_blocks: int = 16  # evenly spaced subset for deep models (first and last always included); 0 = all

    def __post_init__(self) -> None:
        require(self.every_n_steps >= 1, self.key("every_n_steps"), "must be >= 1")
        require(self.max_blocks >= 0, self.key("max_blocks"), "must be >= 0 (0 = all)")
