"""Gradient norms that stay right under FSDP2, where each parameter and gradient is a DTensor shard.

Built without indexing by Python lists: `out[[0, 2]] = ...` makes an index tensor on the host and copies it to the
device, a host wait on every step (tests/test_host_syncs.py catches tensors made from host data in a step)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor


def _stacked_norms(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Each tensor's L2 norm, fp32 on device; DTensors' partial norms (sums of squares still to be reduced over the
    shards) stacked and reduced together, one collective for all of them."""
    if not tensors:
        return []
    norms = torch.stack(torch._foreach_norm(tensors))
    if isinstance(norms, DTensor):
        norms = norms.full_tensor()
    return list(norms.float().to(device).unbind())


def full_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor, as one fp32 vector on the tensors' device.

    A DTensor's norm is the full tensor's, not its local shard's. Under FSDP every rank must call this with the
    same parameters."""
    device = tensors[0].device if tensors else torch.device("cpu")
    if not tensors:
        return torch.zeros(0, dtype=torch.float32, device=device)
    sharded = [isinstance(t, DTensor) for t in tensors]
    norms = {
        kind: iter(_stacked_norms([t for t, s in zip(tensors, sharded) if s == kind], device)) for kind in (False, True)
    }
    return torch.stack([next(norms[kind]) for kind in sharded])


def grad_norms(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full gradient norm of each parameter (0 without a gradient), one fp32 vector in params' order; the
    global norm is its L2 norm. A collective under FSDP: every rank calls it with the same parameters."""
    norms = full_norms([p.grad for p in params if p.grad is not None])
    if len(norms) == len(params):
        return norms
    zero = torch.zeros((), dtype=torch.float32, device=norms.device)
    found = iter(norms.unbind())
    return torch.stack([next(found) if p.grad is not None else zero for p in params])
