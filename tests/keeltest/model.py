"""The model tests' tiny config (small widths: CPU, one thread) and a recorder of module outputs."""

from __future__ import annotations

from keel.config import ModelConfig

TINY = dict(width=32, n_heads=2, seq_len=16, vocab_size=64)


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, "depth": 4, **overrides})


def capture(modules):
    """Record each module's output, in call order."""
    seen = []
    handles = [module.register_forward_hook(lambda m, args, out: seen.append(out.detach())) for module in modules]
    return seen, handles
