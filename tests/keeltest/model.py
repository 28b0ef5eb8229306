"""The model tests' tiny config (small widths: CPU, one thread), a recorder of module outputs, and what a coordinate
check needs: a fixed batch trained on for a few AdamW steps, and a log-log slope."""

from __future__ import annotations

import torch

from keel.config import ModelConfig, load_config
from keel.lit import make_optimizer
from keel.model import KeelLM, next_token_loss

TINY = dict(width=32, n_heads=2, seq_len=16, vocab_size=64)


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, "depth": 4, **overrides})


def capture(modules):
    """Record each module's output, in call order."""
    seen = []
    handles = [module.register_forward_hook(lambda m, args, out: seen.append(out.detach())) for module in modules]
    return seen, handles


def fixed_batch_steps(model: KeelLM, steps: int, lr: float) -> torch.Tensor:
    """`steps` AdamW steps at `lr` (no weight decay) on one fixed batch of 8 sequences; returns the batch."""
    cfg = model.cfg
    batch = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    optimizer = make_optimizer(model, load_config(overrides=[f"optim.lr={lr}", "optim.weight_decay=0"]).optim)
    for _ in range(steps):
        next_token_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return batch


def loglog_slope(xs, values) -> float:
    """Least-squares slope of log(values) against log(xs)."""
    x, y = torch.tensor(xs, dtype=torch.float64).log(), torch.tensor(values, dtype=torch.float64).log()
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / (x * x).sum())
