"""The LM head and cross-entropy fused and computed a chunk of tokens at a time (Liger-style fused linear
cross-entropy): the (tokens x vocab) logits, their softmax and their gradient never exist in full.

    loss = linear_cross_entropy(hidden, head_weight, targets, chunk)    # = F.cross_entropy(hidden @ W.T, targets)

For each chunk of `chunk` tokens the forward pass computes the chunk's logits, their log-softmax (the loss) and,
when a gradient is wanted, right away the gradient of the mean loss with respect to those logits (softmax minus
one-hot) and from it the chunk's hidden-state gradient and its share of the weight gradient; backward only scales
the two stored gradients by the incoming one. Peak memory is one chunk's logits (twice: logits, log-softmax)
instead of four full-size (tokens x vocab) fp32 tensors, and the head's FLOPs are the plain head's (no recompute).
On CPU it is also faster (docs/bench.md): each chunk's logits stay in cache across the softmax and both gradient
matmuls, and the gradient is one pass instead of autograd's log-softmax and NLL backward. Where the blocks are
compiled, so is each chunk (`compiled_chunk_loss`, keel.parallel.compile_blocks): one fused kernel after the matmul.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from keel.ops import under_vmap

# Tokens per chunk where model.loss_chunk is null, per device type (docs/bench.md, "Loss head", has the timings):
# on CPU a chunk whose logits stay in cache; on CUDA a chunk big enough to fill the GPU.
DEFAULT_CHUNK = {"cpu": 128, "cuda": 1024}

# what computes one chunk (chunk_loss, or compiled_chunk_loss's): (x, weight, targets, dtype, want_grad) -> (the sum
# of the chunk's losses, the gradient with respect to its logits or None)
ChunkKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype, bool], tuple[torch.Tensor, torch.Tensor | None]
]


def default_chunk(device: torch.device) -> int:
    return DEFAULT_CHUNK.get(device.type, DEFAULT_CHUNK["cuda"])


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's where it is on (as nn.Linear would), else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, kernel: ChunkKernel | None = None
) -> torch.Tensor:
    """Mean cross-entropy of the logits x @ weight.T against targets, in fp32. x: (N, C) hidden states, weight:
    (V, C) head weight, targets: (N,) token ids. chunk: tokens per chunk; 0 = the plain head (full logits).
    kernel: what computes each chunk, `chunk_loss` (eager, the default) or `compiled_chunk_loss`'s."""
    if chunk == 0 or under_vmap(x, weight):  # under vmap: the plain head (the Function has no vmap rule)
        return F.cross_entropy(F.linear(x.to(weight.dtype), weight).float(), targets)
    grad_x, grad_w = (torch.is_grad_enabled() and t.requires_grad for t in (x, weight))
    return _LinearCrossEntropy.apply(
        x, weight, targets, chunk, compute_dtype(weight), grad_x, grad_w, kernel or chunk_loss
    )


def chunk_loss(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype, want_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk of the head: the sum of its tokens' losses (fp32) and, where wanted, its gradient with respect to
    the chunk's logits, in `dtype`. x: (n, C), weight: (V, C), both in `dtype`; targets: (n, 1)."""
    log_probs = torch.log_softmax((x @ weight.T).float(), dim=-1)  # (n, V) fp32
    loss = -log_probs.gather(1, targets).sum()
    if not want_grad:
        return loss, None
    # d(sum of the chunk's losses) / d logits = softmax - one-hot; the 1 / N of the mean comes in backward
    if torch.compiler.is_compiling():  # one fused pass, the gradient written in `dtype`: no fp32 gradient between
        probs = log_probs.exp()
        one_hot = torch.arange(probs.shape[1], device=probs.device) == targets
        return loss, torch.where(one_hot, probs - 1, probs).to(dtype)
    # eager: in place, no other temporary of the chunk's logits' size
    grad_logits = log_probs.exp_().scatter_add_(1, targets, torch.full_like(targets, -1, dtype=torch.float32))
    return loss, grad_logits.to(dtype)


@functools.cache
def compiled_chunk_loss(mode: str = "default") -> ChunkKernel:
    """`chunk_loss` through torch.compile (`mode`: trainer.compile_mode): everything after the logits' matmul (their
    cast, log-softmax, the loss's gather, the softmax minus one-hot, the gradient's cast) fused into one kernel that
    holds no fp32 copy of the logits beside them, where eager makes a pass per op. One compiled function per mode,
    shared by every model; a graph per chunk shape (the full chunks, the last one), dtype and with / without
    gradient."""
    return torch.compile(chunk_loss, dynamic=False, mode=mode)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, chunk, dtype, want_grad_x, want_grad_w, kernel):
        n = x.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty(x.shape, dtype=torch.float32, device=x.device) if want_grad_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if want_grad_w else None
        w = weight.to(dtype)
        with torch.autocast(x.device.type, enabled=False):  # dtypes are explicit here
            for start in range(0, n, chunk):
                xc = x[start : start + chunk].to(dtype)
                chunk_sum, grad_logits = kernel(
                    xc, w, targets[start : start + chunk, None], dtype, want_grad_x or want_grad_w
                )
                loss += chunk_sum
                if grad_x is not None:
                    grad_x[start : start + chunk] = grad_logits @ w
                if grad_w is not None and dtype == torch.float32:
                    grad_w.addmm_(grad_logits.T, xc)  # in place: no (V, C) temporary per chunk
                elif grad_w is not None:  # bf16 products, accumulated over chunks in fp32
                    grad_w += grad_logits.T @ xc
        ctx.save_for_backward(grad_x, grad_w)
        ctx.n, ctx.x_dtype, ctx.w_dtype = n, x.dtype, weight.dtype
        return loss / n

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        scale = grad_loss / ctx.n
        grad_x = None if grad_x is None else (grad_x * scale).to(ctx.x_dtype)
        grad_w = None if grad_w is None else (grad_w * scale).to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None, None, None
