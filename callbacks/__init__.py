"""Lightning callbacks for Keel training: each owns one job and its metrics (tags: docs/tensorboard.md)."""

from keel.callbacks.checkpointing import GracefulInterrupt, RunCheckpoint
from keel.callbacks.grad_norms import GradNormMonitor
from keel.callbacks.layer_importance import LayerImportance
from keel.callbacks.progress import StepProgressBar
from keel.callbacks.stability import Failure, StabilityMonitor
from keel.callbacks.throughput import SpeedMonitor

__all__ = ["Failure", "GracefulInterrupt", "GradNormMonitor", "LayerImportance", "RunCheckpoint", "SpeedMonitor",
           "StabilityMonitor", "StepProgressBar"]
