"""Gradient norms that stay right under FSDP2, where each parameter and gradient is a DTensor shard."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor


def full_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor, as one fp32 vector on the tensors' device.

    A DTensor's norm is the full tensor's, not its local shard's: the DTensor norms come back as partial
    values (sum of squares still to be reduced over the shards) and are stacked and reduced together, one
    collective for all of them. Under FSDP every rank must call this with the same parameters."""
    plain = [i for i, t in enumerate(tensors) if not isinstance(t, DTensor)]
    sharded = [i for i, t in enumerate(tensors) if isinstance(t, DTensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    out = torch.zeros(len(tensors), dtype=torch.float32, device=device)
    if plain:
        out[plain] = torch.stack(torch._foreach_norm([tensors[i] for i in plain])).float()
    if sharded:
        partial = torch.stack(torch._foreach_norm([tensors[i] for i in sharded]))
        out[sharded] = partial.full_tensor().float().to(device)
    return out


def grad_norms(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full gradient norm of each parameter (0 without a gradient), one fp32 vector in params' order; the
    global norm is its L2 norm. A collective under FSDP: every rank calls it with the same parameters."""
    with_grad = [i for i, p in enumerate(params) if p.grad is not None]
    norms = full_norms([params[i].grad for i in with_grad])
    out = torch.zeros(len(params), dtype=torch.float32, device=norms.device)
    out[with_grad] = norms
    return out
