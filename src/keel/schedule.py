"""The learning-rate schedule as a function of the step: what the LightningModule's scheduler multiplies optim.lr by,
and where `keel maxlr` finds the step its ramp reaches an LR. Torch-free."""

from __future__ import annotations

import math

from keel.config import OptimConfig


def lr_factor(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Multiplier of optim.lr at a step: warm-up (linear from 0, or geometric from min_lr_ratio), then cosine to
    min_lr_ratio (or constant)."""
    if step < optim.warmup_steps:
        if optim.schedule == "exp_warmup":  # min_lr_ratio at step 0, 1 at the last warm-up step
            return optim.min_lr_ratio ** (1 - step / max(1, optim.warmup_steps - 1))
        return (step + 1) / optim.warmup_steps
    if optim.schedule != "cosine":
        return 1.0
    progress = min(1.0, (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps))
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
