"""The optimizer's config (`optim.*`): AdamW and the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass

from keel.errors import require

SCHEDULES = ("cosine", "linear_warmup", "exp_warmup")


@dataclass
class OptimConfig:
    lr: float = 3e-3
    warmup_steps: int = 40
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at trainer.max_steps; exp_warmup starts there
    # cosine | linear_warmup (0 -> lr, then constant) | exp_warmup (lr * min_lr_ratio -> lr geometrically over the
    # warm-up, then constant: equal steps per decade, the max-LR protocol's ramp)
    schedule: str = "cosine"
    weight_decay: float = 0.01  # on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global norm; 0 disables

    def __post_init__(self) -> None:
        require(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        require(self.schedule in SCHEDULES, "optim.schedule", f"allowed: {', '.join(SCHEDULES)}")
        require(
            self.schedule != "exp_warmup" or self.min_lr_ratio > 0,
            "optim.min_lr_ratio",
            "must be > 0 with optim.schedule=exp_warmup (the ramp starts at lr * min_lr_ratio)",
        )
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        for key in ("beta1", "beta2"):  # torch's AdamW would refuse them only once the model is built
            require(0 <= getattr(self, key) < 1, f"optim.{key}", f"must be in [0, 1), got {getattr(self, key)}")
        require(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")
        require(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)")
