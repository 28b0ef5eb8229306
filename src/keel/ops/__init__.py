"""Compute kernels written for Keel in plain PyTorch: pieces of a training step that the model calls."""

import torch


def under_vmap(*tensors: torch.Tensor | None) -> bool:
    """Whether any of the tensors is batched by torch.func.vmap (stacked members, `keel bench --members`): the
    hand-written autograd Functions here have no vmap rule, so their callers take torch's own ops instead."""
    return any(t is not None and torch._C._functorch.is_batchedtensor(t) for t in tensors)
