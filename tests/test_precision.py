"""Precision: Keel exact under bf16 autocast where a bf16 stream would not be, the stream kept fp32, the CPU
RMSNorm's hand-written backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keel.gpu_check.precision import sublayer_update_error
from keel.model import KeelLM, RMSNorm
from keel.ops.rms_norm import RMSNormFunction
from keeltest.model import capture, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bf16_autocast_keeps_keel_exact_where_a_bf16_stream_would_not():
    torch.manual_seed(0)
    model = KeelLM(tiny(depth=128, init="unit"))  # L = 256: the branch is ~1/256 of alpha * x + F
    idx = torch.randint(64, (2, 16))
    logits_err, update_err = sublayer_update_error(model, idx, bf16_stream=False)
    ctl_logits_err, ctl_update_err = sublayer_update_error(model, idx, bf16_stream=True)
    assert logits_err < 0.01 and update_err < 0.02  # the figures: docs/model.md (its depth-128 row)
    assert ctl_update_err > 0.3  # the branch is mostly lost to rounding
    assert ctl_logits_err > 3 * logits_err


def test_stream_stays_fp32_under_autocast_and_bf16_weights():
    torch.manual_seed(0)
    model = KeelLM(tiny(scheme="keel"))
    outputs, _ = capture(model.sublayers())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(64, (2, 16)))
    model.to(torch.bfloat16)  # bf16-true: branches compute in bf16, the stream stays fp32
    logits = model(torch.randint(64, (2, 16)))
    assert logits.dtype == torch.bfloat16 and logits.isfinite().all()
    assert {out.dtype for out in outputs} == {torch.float32} and len(outputs) == 2 * 2 * 4


@pytest.mark.parametrize("gain", [True, False])
@pytest.mark.parametrize("alpha", [None, 1.0, 32.0])
def test_cpu_rmsnorm_matches_torch_rms_norm(alpha, gain):
    """The CPU norm's hand-written backward (RMSNorm(x + alpha * skip) as one autograd step, with or without its
    gain) against F.rms_norm differentiated by autograd in fp64, and its fp64 form against finite differences."""
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-5, gain=gain)
    if gain:
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.3)
    x, skip = torch.randn(2, 3, 5, 16).unbind(0)
    inputs = [x.requires_grad_(), *([norm.weight] if gain else [])]
    if alpha is not None:
        inputs.insert(1, skip.requires_grad_())
    exact = [t.detach().double().requires_grad_() for t in inputs]
    exact_weight = exact[-1] if gain else None
    out = norm(x, skip, alpha) if alpha is not None else norm(x)
    ref = F.rms_norm(exact[0] + alpha * exact[1] if alpha is not None else exact[0], (16,), exact_weight, 1e-5)
    grad = torch.randn_like(out)
    torch.testing.assert_close(out, ref.float())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, exact, grad.double())):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)

    def fn(x, *rest):
        skip = rest[0] if alpha is not None else None
        return RMSNormFunction.apply(x, skip, alpha or 1.0, rest[-1] if gain else None, 1e-5)

    assert torch.autograd.gradcheck(fn, exact)


def test_cpu_rmsnorm_refuses_double_backward():
    """Its backward is written out, not differentiable itself: a second derivative must fail loudly rather than
    come out silently wrong (gradient penalties, Hessian-vector products)."""
    x = torch.randn(4, 16, requires_grad=True)
    norm = RMSNorm(16, eps=1e-5)
    (grad,) = torch.autograd.grad(norm(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        grad.sum().backward()
