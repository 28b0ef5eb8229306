"""The one activation model (keel.memory.activation_bytes) that the CPU and the GPU estimates share: counted from
what autograd saves, in fp32 and under bf16 autocast, for every scheme."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from keel.config import ModelConfig, load_config
from keel.config.model import SCHEMES, sublayer_specs
from keel.memory import (
    CPU_ACTIVATION_SLACK,
    activation_bytes,
    block_bytes_per_token,
    cpu_training_bytes,
    gpu_training_terms,
)
from keel.model import KeelLM


@pytest.mark.parametrize(("scheme", "kib"), [("keel", 55), ("preln", 47)])
def test_activations_per_token_and_block_reproduce_the_measured_figures(scheme, kib):
    # issue #35: eager saved-for-backward at width 1024 under bf16, Keel 55 KiB and Pre-LN 47 KiB per token per block
    cfg = ModelConfig(scheme=scheme, depth=4, width=1024, n_heads=16, n_kv_heads=8, ffn="swiglu", ffn_mult=3.0)
    per_block = block_bytes_per_token(cfg, sublayer_specs(cfg)[-1], compute_bytes=2)
    assert per_block / 2**10 == pytest.approx(kib, rel=0.05)


def saved_bytes(cfg: ModelConfig, tokens: int, compute_bytes: int) -> int:
    """Bytes of the distinct storages one forward keeps for its backward: in fp32 (4) or under bf16 autocast (2)."""
    torch.manual_seed(0)
    model, storages = KeelLM(cfg), {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    idx = torch.randint(0, cfg.vocab_size, (1, tokens))
    bf16_mixed = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)  # as Lightning's
    precision = bf16_mixed if compute_bytes == 2 else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), precision:
        model(idx, targets=idx)
    return sum(storages.values())


@pytest.mark.parametrize("compute_bytes", [2, 4])
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("ffn", ["gelu", "swiglu"])
def test_activations_per_token_match_what_autograd_saves(scheme, ffn, compute_bytes):
    def config(depth):
        return ModelConfig(scheme=scheme, depth=depth, width=64, n_heads=4, n_kv_heads=2, ffn=ffn, seq_len=32,
                           vocab_size=64, loss_chunk=0)

    # the difference of depths 4 and 2 and of 32 and 16 tokens: what grows with both, i.e. per token and block
    measured = (saved_bytes(config(4), 32, compute_bytes) - saved_bytes(config(2), 32, compute_bytes)
                - saved_bytes(config(4), 16, compute_bytes) + saved_bytes(config(2), 16, compute_bytes))
    per_token = activation_bytes(config(4), 1, compute_bytes) - activation_bytes(config(2), 1, compute_bytes)
    assert measured == 16 * per_token


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("checkpointing", ["none", 0.5])
def test_the_cpu_and_gpu_estimates_count_the_same_activations(precision, checkpointing):
    cfg = load_config(overrides=["model.depth=8", "model.width=64", "model.n_heads=4", "trainer.micro_batch_size=4",
                                 f"trainer.precision={precision}", f"trainer.activation_checkpointing={checkpointing}"])
    checkpointed = cfg.trainer.checkpointed_blocks(cfg.model.depth)
    # on CPU: what doubling the micro-batch adds, with the model's state and the process's own unchanged
    doubled = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_size=8))
    cpu = cpu_training_bytes(doubled, checkpointed) - cpu_training_bytes(cfg, checkpointed)
    counted = activation_bytes(cfg.model, 4 * cfg.model.seq_len, 4 if precision == "32-true" else 2, checkpointed)
    assert gpu_training_terms(cfg.model, cfg.trainer)["activations"] == counted
    assert cpu == pytest.approx((1 + CPU_ACTIVATION_SLACK) * counted, abs=1)  # peak RSS's share beyond them
