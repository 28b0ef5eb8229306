"""Which kernel runs the model's scaled_dot_product_attention on a GPU (trainer.attention), chosen from outside
the model: torch's SDPA picks the first backend in its priority order that accepts the inputs, and that order
differs between torch versions (cuDNN first on some, flash on others), so a run's speed could change with the
install. Here the order is given, and the backend it picks for the model's shape is said at start-up."""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# trainer.attention's names; auto's order on Hopper (sm90) and later: cuDNN's fused kernel first (torchtitan
# measured it faster end to end than flash on H100), then torch's own order
BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
HOPPER = (9, 0)


def backend_order(preferred: str, capability: tuple[int, int] | None) -> list[str] | None:
    """The SDPA backends in priority order for trainer.attention=`preferred` on a GPU of compute `capability`
    (None: no GPU): the preferred one first, the others after in torch's names' order; auto: cuDNN first from
    Hopper on, else None (torch's own order), as on CPU."""
    if preferred == "auto":
        if capability is None or capability < HOPPER:
            return None
        preferred = "cudnn"
    return [preferred, *(name for name in BACKENDS if name != preferred)]


def backend_in_use(order: list[str], query: torch.Tensor, kv_heads: int) -> str:
    """The first backend of `order` that accepts the model's causal attention on `query`-shaped inputs (B, H, T, hd)
    with `kv_heads` key/value heads, as SDPA itself would choose; asked of torch's own checks."""
    from torch.backends.cuda import (
        SDPAParams,
        can_use_cudnn_attention,
        can_use_efficient_attention,
        can_use_flash_attention,
    )

    checks = {
        "cudnn": can_use_cudnn_attention,
        "flash": can_use_flash_attention,
        "efficient": can_use_efficient_attention,
        "math": lambda params: True,
    }
    batch, heads, tokens, head_dim = query.shape
    key = query.new_empty(batch, kv_heads, tokens, head_dim)
    params = SDPAParams(query, key, key, None, 0.0, True, kv_heads != heads)
    return next(name for name in order if checks[name](params))


def attention_context(order: list[str] | None):
    """The context a run trains in: SDPA restricted to `order`, in that priority (None: torch's defaults)."""
    if order is None:
        return nullcontext()
    return sdpa_kernel([BACKENDS[name] for name in order], set_priority=True)


# what the attention's inputs are under each trainer.precision
PRECISION_DTYPES = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "32-true": torch.float32,
}


def describe_attention(preferred: str, model_cfg, micro_batch: int, precision: str) -> tuple[list[str] | None, str]:
    """The order a GPU run on this process's GPU trains with, and the start-up line that names the backend in use."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK") or 0))  # this rank's GPU, before Lightning sets it
    capability = torch.cuda.get_device_capability(device)
    order = backend_order(preferred, capability)
    if order is None:
        return None, f"SDPA in torch's own order (trainer.attention={preferred}, sm{capability[0]}{capability[1]})"
    query = torch.empty(
        micro_batch,
        model_cfg.n_heads,
        model_cfg.seq_len,
        model_cfg.head_dim,
        dtype=PRECISION_DTYPES[precision],
        device=device,
    )
    used = backend_in_use(order, query, model_cfg.kv_heads)
    return order, f"SDPA {used} (order {', '.join(order)}; trainer.attention={preferred})"
