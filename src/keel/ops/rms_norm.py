"""RMSNorm of a sublayer's sum, `RMSNorm(x + alpha * skip) * weight`, in fp32, with a hand-written CPU backward
(weight None: no gain, `model.out_norm_gain=false`).

    y = rms_norm(x, weight, eps)                      # = F.rms_norm(x, (C,), weight, eps)
    y = rms_norm(x, weight, eps, skip=s, alpha=a)     # = F.rms_norm(x + a * s, (C,), weight, eps): Norm_out

On CPU in eager mode, autograd differentiates F.rms_norm's pieces (~17 passes over the activation per norm
forward + backward); RMSNormFunction takes ~9 and allocates less, and normalizes the sum in place. Keel runs twice
Pre-LN's norms, so this is most of the extra norm's eager cost (docs/bench.md). CUDA has a fused F.rms_norm
kernel and torch.compile fuses F.rms_norm and the sum into the block's kernels: both take F.rms_norm, as does a
model run under torch.func.vmap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from keel.ops import under_vmap


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm(x + alpha * skip) * weight (skip, weight may be None); x, skip, weight fp32. Differentiable once: the
    backward is written out, not itself differentiated (double backward raises instead of being silently wrong)."""

    @staticmethod
    def forward(ctx, x, skip, alpha, weight, eps):
        # x, skip: (..., C); mean(s^2) from one pass (no s^2 temporary), then in place on (..., 1) statistics
        s = x if skip is None else torch.add(x, skip, alpha=alpha)
        rstd = torch.linalg.vector_norm(s, dim=-1, keepdim=True).square_().div_(s.shape[-1]).add_(eps).rsqrt_()
        s_hat = s * rstd if skip is None else s.mul_(rstd)  # the sum is our own temporary: normalize it in place
        ctx.save_for_backward(s_hat, weight, rstd)
        ctx.alpha = alpha
        return s_hat if weight is None else s_hat * weight

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        # d/ds of s_hat * w: (g * w - s_hat * mean(g * w * s_hat)) * rstd, as addcmul + one in-place mul
        s_hat, weight, rstd = ctx.saved_tensors
        grad_hat = grad if weight is None else grad * weight
        minus_mean = (grad_hat * s_hat).mean(-1, keepdim=True).neg_()  # (..., 1)
        grad_s = torch.addcmul(grad_hat, s_hat, minus_mean).mul_(rstd)
        grad_skip = grad_s * ctx.alpha if ctx.needs_input_grad[1] else None  # False when skip is None
        grad_weight = (grad * s_hat).flatten(0, -2).sum(0) if ctx.needs_input_grad[3] else None
        return grad_s, grad_skip, None, grad_weight, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, skip: torch.Tensor | None = None, alpha: float = 1.0
) -> torch.Tensor:
    """RMSNorm(x + alpha * skip) * weight over the last dim, computed in fp32 (inputs are cast)."""
    x, weight = x.float(), None if weight is None else weight.float()
    if x.is_cpu and not torch.compiler.is_compiling() and not under_vmap(x, weight, skip):
        return RMSNormFunction.apply(x, skip, alpha, weight, eps)
    if skip is not None:
        x = torch.add(x, skip, alpha=alpha)
    return F.rms_norm(x, x.shape[-1:], weight, eps)
