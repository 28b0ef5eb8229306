"""Lightning callbacks for Keel training: each owns one job and its metrics (tags: docs/tensorboard.md).

CALLBACKS registers the configurable ones: each entry is a callback's config class (keel.callbacks.base), whose
`name` is its key under `callbacks.*` (in this order in the config) and whose `priority` orders the runs.
"""

from keel.callbacks.base import CallbackConfig
from keel.callbacks.grad_norms import GradNormMonitor, GradNormsConfig
from keel.callbacks.layer_importance import LayerImportance, LayerImportanceConfig
from keel.callbacks.progress import StepProgressBar
from keel.callbacks.stability import Failure, StabilityConfig, StabilityMonitor
from keel.callbacks.throughput import SpeedMonitor, ThroughputConfig

CALLBACKS: tuple[type[CallbackConfig], ...] = (
    GradNormsConfig,
    StabilityConfig,
    ThroughputConfig,
    LayerImportanceConfig,
)

__all__ = ["CALLBACKS", "CallbackConfig", "Failure", "GradNormMonitor", "GradNormsConfig", "LayerImportance",
           "LayerImportanceConfig", "SpeedMonitor", "StabilityConfig", "StabilityMonitor", "StepProgressBar",
           "ThroughputConfig"]
