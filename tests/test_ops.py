"""keel.ops.chunked_ce: the chunked loss head against the plain head (full logits + F.cross_entropy) on values and
gradients, alone and in KeelLM (tied embeddings too), under no_grad, autocast and bf16 weights, eager and compiled
per chunk; that it never builds a (tokens x vocab) tensor; and the model.loss_chunk key. The FSDP-sharded head:
test_fsdp_equivalence.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from keel.checkpoint.resume import check_same_model
from keel.config import ModelConfig, load_config, to_dict
from keel.errors import ConfigError
from keel.model import KeelLM, next_token_loss
from keel.ops.chunked_ce import compiled_chunk_loss, linear_cross_entropy

pytestmark = pytest.mark.usefixtures("one_thread")

N, C, V = 50, 16, 97  # tokens, width, vocab: 50 tokens leave a partial last chunk for most chunk sizes


def head_inputs(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(V, C, generator=generator) * 0.5).to(dtype).requires_grad_()
    return x, weight, torch.randint(V, (N,), generator=generator)


def loss_and_grads(x, weight, targets, chunk, kernel=None):
    loss = linear_cross_entropy(x, weight, targets, chunk, kernel)
    return (loss, *torch.autograd.grad(loss, (x, weight)))


def assert_rel_close(actual, expected, rel):
    """Relative error of the whole tensor (norm of the difference over the norm), and elementwise at that scale."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    actual, expected = actual.detach(), expected.detach()
    err = float((actual.double() - expected.double()).norm() / expected.double().norm())
    assert err < rel, err
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * float(expected.abs().max()))


@pytest.mark.parametrize("chunk", [1, 7, 16, 50, 4096])
def test_chunked_head_matches_plain_head(chunk):
    x, weight, targets = head_inputs()
    plain = loss_and_grads(x, weight, targets, 0)
    chunked = loss_and_grads(x, weight, targets, chunk)
    for actual, expected in zip(chunked, plain):  # loss, d/dx, d/dweight
        assert_rel_close(actual, expected, 1e-5)


def test_chunked_head_scales_by_the_incoming_gradient_and_accumulates():
    x, weight, targets = head_inputs()
    (3.0 * linear_cross_entropy(x, weight, targets, 8)).backward()
    (linear_cross_entropy(x, weight, targets, 8) * -0.5).backward()  # .grad accumulates over both
    _, grad_x, grad_w = loss_and_grads(x, weight, targets, 0)
    assert_rel_close(x.grad, 2.5 * grad_x, 1e-5)
    assert_rel_close(weight.grad, 2.5 * grad_w, 1e-5)


def test_chunked_head_without_gradients():
    x, weight, targets = head_inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(x, weight, targets, 8)
    assert loss.grad_fn is None
    assert_rel_close(loss, linear_cross_entropy(x, weight, targets, 0).detach(), 1e-5)

    frozen = weight.detach()  # a frozen head: only the hidden states get a gradient
    loss = linear_cross_entropy(x, frozen, targets, 8)
    (grad_x,) = torch.autograd.grad(loss, (x,))
    assert_rel_close(grad_x, loss_and_grads(x, weight, targets, 0)[1], 1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the most elements any op's output has (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


@pytest.mark.parametrize("chunk", [0, 8])
def test_no_tensor_of_tokens_x_vocab_is_built(chunk):
    x, weight, targets = head_inputs()
    with LargestTensor() as probe:
        linear_cross_entropy(x, weight, targets, chunk).backward()
    # the plain head builds the full logits; the chunked one one chunk's, and the weight gradient (V x C)
    assert probe.numel == (N * V if chunk == 0 else max(chunk * V, V * C))


def test_autocast_and_bf16_weights_follow_the_plain_head():
    x, weight, targets = head_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16-mixed: fp32 weights, bf16 matmuls
        plain, chunked = loss_and_grads(x, weight, targets, 0), loss_and_grads(x, weight, targets, 8)
    for actual, expected in zip(chunked, plain):
        assert_rel_close(actual, expected, 2e-2)  # bf16 products; fp32 gradient accumulation across chunks
    assert [t.dtype for t in chunked] == [torch.float32] * 3
    x, weight, targets = head_inputs()
    weight = weight.detach().bfloat16().requires_grad_()  # bf16 weights (FSDP's bf16 compute copies), fp32 stream
    plain, chunked = loss_and_grads(x, weight, targets, 0), loss_and_grads(x, weight, targets, 8)
    for actual, expected in zip(chunked, plain):
        assert_rel_close(actual, expected, 2e-2)
    assert [t.dtype for t in chunked] == [torch.float32, torch.float32, torch.bfloat16]


def test_compiled_chunk_kernel_matches_the_eager_one():
    """trainer.compile's loss head (keel.parallel.compile_blocks): each chunk through torch.compile (inductor's C++ on
    CPU). fp32: loss and gradients within fp32 rounding (exp and the softmax's sums vectorized differently); bf16
    autocast: within bf16 rounding of the logits' gradient (docs/bench.md, "The step"). Chunk 16 of 50 tokens: full
    chunks and a partial last one (a graph each)."""
    x, weight, targets = head_inputs()
    for chunk, autocast, rel in ((16, False, 1e-6), (25, True, 4e-3)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            eager = loss_and_grads(x, weight, targets, chunk)
            compiled = loss_and_grads(x, weight, targets, chunk, compiled_chunk_loss())
        for actual, expected in zip(compiled, eager):  # loss, d/dx, d/dweight
            assert_rel_close(actual, expected, rel)
    with torch.no_grad():  # validation's path: the loss alone
        loss = linear_cross_entropy(x, weight, targets, 25, compiled_chunk_loss())
    assert_rel_close(loss, linear_cross_entropy(x, weight, targets, 25).detach(), 1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_model_loss_head_gradients_match_the_plain_head(tie):
    cfg = ModelConfig(depth=2, width=32, n_heads=2, seq_len=16, vocab_size=97, tie_embeddings=tie)
    torch.manual_seed(0)
    batch = torch.randint(cfg.vocab_size, (3, cfg.seq_len + 1))
    models = {}
    for chunk in (0, 5):
        torch.manual_seed(0)
        models[chunk] = model = KeelLM(ModelConfig(**{**vars(cfg), "loss_chunk": chunk}))
        assert (model.head.weight is model.embed.weight) == tie
        models[chunk].loss = next_token_loss(model, batch)
        models[chunk].loss.backward()
    plain, chunked = models[0], models[5]
    assert_rel_close(chunked.loss.detach(), plain.loss.detach(), 1e-5)
    with torch.no_grad():  # the logits path still returns the full logits
        logits = chunked(batch[:, :-1])
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    assert_rel_close(chunked.loss.detach(), expected, 1e-5)
    for (name, p_chunked), p_plain in zip(chunked.named_parameters(), plain.parameters()):
        assert p_chunked.grad is not None, name
        assert_rel_close(p_chunked.grad, p_plain.grad, 1e-5)


def test_loss_chunk_key_and_resume_across_it():
    cfg = load_config(overrides=["model.loss_chunk=0"])
    assert cfg.model.loss_chunk == 0 and load_config().model.loss_chunk is None  # null: the device default
    with pytest.raises(ConfigError, match="model.loss_chunk: must be >= 0"):
        load_config(overrides=["model.loss_chunk=-8"])
    saved = load_config(overrides=["model.loss_chunk=256"])
    check_same_model(cfg, {"keel": {"config": to_dict(saved)}})  # how the loss is computed: resumable
    with pytest.raises(ConfigError, match="model.depth: checkpoint 3 != config"):
        check_same_model(cfg, {"keel": {"config": to_dict(load_config(overrides=["model.depth=3"]))}})
