"""FLOPs: a model's training FLOPs per token, and the peak FLOP/s of a device - the one table `keel bench` and the
throughput callback (perf/mfu) measure MFU against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from keel.config import ModelConfig

# Spec-sheet dense peaks (no sparsity) per device: (substring of torch.cuda.get_device_name(), bf16/fp16 tensor
# core with fp32 accumulation, as PyTorch's half-precision matmuls use; fp32 without TF32, torch's default matmul
# precision; None where the sheet gives none). The first match wins, so more specific names come first ("H100 PCIe"
# before "H100", "L40S" before "L40" before "L4"). `keel bench`, gpu-check and the throughput callback all read it.
GPU_PEAK_FLOPS = (
    ("h200", 989e12, 67e12),
    ("h100 pcie", 756e12, 51e12),
    ("h100 nvl", 835e12, 60e12),
    ("h100", 989e12, 67e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("b200", 2250e12, None),
    ("a100", 312e12, 19.5e12),
    ("l40s", 362e12, 91.6e12),
    ("l40", 181e12, 90.5e12),
    ("l4", 121e12, 30.3e12),
    ("a10", 125e12, 31.2e12),  # A10 and A10G (AWS publishes no separate A10G figure)
    ("rtx 4090", 165e12, 82.6e12),
    ("rtx 3090", 71e12, 35.6e12),
)
HALF_DTYPES = (torch.bfloat16, torch.float16)


def device_peak_flops(device: torch.device, dtype: torch.dtype, override: float = 0.0) -> float | None:
    """Peak FLOP/s of one device computing in dtype: `override` if > 0 (the user's figure), else the spec sheet's
    for this GPU; None on CPU, for an unlisted GPU or a dtype its sheet gives no figure for."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    row = next((row for row in GPU_PEAK_FLOPS if row[0] in name), None)
    if row is None:
        return None
    return row[1] if dtype in HALF_DTYPES else row[2] if dtype == torch.float32 else None


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), PaLM-style: 6 * matmul params
    (head included, embedding lookup excluded) + 12 * blocks * width * seq_len for attention scores."""
    hd, kv = cfg.head_dim, cfg.kv_heads
    attn = cfg.width * (cfg.n_heads + 2 * kv) * hd + cfg.width * cfg.width
    ffn = cfg.width * cfg.ffn_hidden * (3 if cfg.ffn == "swiglu" else 2)
    matmul_params = cfg.depth * (attn + ffn) + cfg.width * cfg.vocab_size
    return 6.0 * matmul_params + 12.0 * cfg.depth * cfg.width * cfg.seq_len
