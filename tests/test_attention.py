"""trainer.attention: the SDPA backends a GPU run prefers, in order, given to torch as its priority (keel.attention);
the backend in use is said at start-up (GPU only: `keel gpu-check` shows it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keel.attention import BACKENDS, attention_context, backend_order
from keel.config import load_config
from keel.errors import ConfigError


@pytest.mark.parametrize(
    "preferred, capability, order",
    [
        ("auto", (9, 0), ["cudnn", "flash", "efficient", "math"]),  # Hopper: cuDNN first, whatever torch's version says
        ("auto", (10, 0), ["cudnn", "flash", "efficient", "math"]),
        ("auto", (8, 0), None),  # an A100: torch's own order
        ("auto", None, None),  # no GPU
        ("flash", (9, 0), ["flash", "cudnn", "efficient", "math"]),
        ("math", (8, 0), ["math", "cudnn", "flash", "efficient"]),
    ],
)
def test_the_preferred_backend_comes_first_then_the_others(preferred, capability, order):
    assert backend_order(preferred, capability) == order


def test_the_order_is_torch_s_priority_while_training_and_restored_after():
    before = torch._C._get_sdp_priority_order()
    order = ["math", "cudnn", "flash", "efficient"]
    with attention_context(order):
        assert torch._C._get_sdp_priority_order()[: len(order)] == [int(BACKENDS[name]) for name in order]
        q = torch.randn(1, 2, 8, 4)
        assert torch.equal(
            F.scaled_dot_product_attention(q, q, q, is_causal=True),
            F.scaled_dot_product_attention(q, q, q, is_causal=True),
        )  # math runs on CPU too
    assert torch._C._get_sdp_priority_order() == before
    with attention_context(None):  # torch's own
        assert torch._C._get_sdp_priority_order() == before


def test_an_unknown_backend_is_refused_with_the_allowed_ones():
    with pytest.raises(ConfigError, match="trainer.attention: allowed: auto, cudnn, flash, efficient, math; got"):
        load_config(overrides=["trainer.attention=fast"])


def test_every_precision_names_the_dtype_attention_sees():
    from keel.attention import PRECISION_DTYPES
    from keel.config.trainer import PRECISIONS

    assert set(PRECISION_DTYPES) == set(PRECISIONS) - {"auto"}  # auto is resolved before the start-up line
