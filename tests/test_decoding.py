"""Incremental decoding: cached logits equal the full forward, generation with the KV cache equals full recompute,
a long prompt cropped from the left."""

from __future__ import annotations

import pytest
import torch

from keel.config.model import SCHEMES
from keel.decoding import generate
from keel.model import KeelLM, KVCache
from keeltest.model import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


DECODE_CONFIGS = [{"scheme": s} for s in SCHEMES] + [
    {"scheme": "keel", "n_heads": 4, "n_kv_heads": 2, "ffn": "swiglu"},
    {"scheme": "hybridnorm", "n_heads": 4, "n_kv_heads": 1},
    {"scheme": "keel", "keel_first_block": "v2", "n_heads": 4, "n_kv_heads": 2},
]


@pytest.mark.parametrize("overrides", DECODE_CONFIGS)
def test_cached_logits_equal_full_forward(overrides):
    torch.manual_seed(0)
    model = KeelLM(tiny(init="unit", **overrides))
    idx = torch.randint(64, (2, 12))
    full = model(idx)
    cache = KVCache(model.cfg.depth)
    pieces = [model(idx[:, :5], cache), model(idx[:, 5:8], cache)]  # prefill, then a 3-token chunk
    pieces += [model(idx[:, t : t + 1], cache) for t in range(8, 12)]  # then one token at a time
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 12


@pytest.mark.parametrize("overrides", DECODE_CONFIGS[::3] + DECODE_CONFIGS[-3:])
def test_generate_with_cache_matches_full_recompute(overrides):
    torch.manual_seed(0)
    model = KeelLM(tiny(init="unit", **overrides))
    prompt = torch.randint(64, (2, 4))
    greedy = generate(model, prompt, 8)
    assert greedy.shape == (2, 12) and torch.equal(greedy[:, :4], prompt)
    assert torch.equal(greedy, generate(model, prompt, 8, use_cache=False))
    sampled = [
        generate(
            model, prompt, 8, temperature=0.8, top_k=5, use_cache=cached, generator=torch.Generator().manual_seed(1)
        )
        for cached in (True, False)
    ]
    assert torch.equal(*sampled)
    stop = int(greedy[0, 6])  # row 0 emits it as its third new token
    stopped = [generate(model, prompt, 8, stop_tokens=(stop,), use_cache=cached) for cached in (True, False)]
    assert torch.equal(*stopped)
    first_stop = (stopped[0][0, 4:] == stop).nonzero()[0, 0]
    assert (stopped[0][0, 4 + first_stop :] == stop).all()  # a stopped row keeps emitting the stop token


def test_generate_left_crops_a_long_prompt():
    torch.manual_seed(0)
    model = KeelLM(tiny(init="unit"))  # seq_len 16
    prompt = torch.randint(64, (2, 14))
    out = generate(model, prompt, 6)  # only the last 16 - 6 = 10 prompt tokens fit
    assert out.shape == (2, 20) and torch.equal(out[:, :14], prompt)
    assert torch.equal(out[:, 4:], generate(model, prompt[:, 4:], 6))
    assert torch.equal(out, generate(model, prompt, 6, use_cache=False))
