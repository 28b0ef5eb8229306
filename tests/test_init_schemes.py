"""model.init: each scheme from its own literature's init (docs/schemes.md#initialization), a named init
overriding the recipe, megatron's scaled and truncated branches."""

from __future__ import annotations

import pytest
import torch

from keel.config import ModelConfig
from keel.model import KeelLM
from keeltest.model import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def test_megatron_init_scales_the_branch_outputs_and_truncates():
    """model.init=megatron: every matrix N(0, init_std^2) cut at 3 std; attention out and FFN down further scaled
    by 1/sqrt(2 x depth) (HybridNorm's authors' recipe)."""
    torch.manual_seed(0)
    cfg = ModelConfig(width=256, n_heads=4, seq_len=16, vocab_size=64, depth=8, init="megatron", scheme="hybridnorm")
    model = KeelLM(cfg)
    block = model.blocks[3]
    for weight, std in (
        (block.attn.branch.qkv.weight, 0.02),
        (block.ffn.branch.up.weight, 0.02),
        (block.attn.branch.out.weight, 0.02 / 4),
        (block.ffn.branch.down.weight, 0.02 / 4),
    ):
        assert weight.abs().max() <= 3 * std + 1e-7
        assert weight.std().item() == pytest.approx(std * 0.986, rel=0.03)  # a normal cut at 3 std keeps 98.6% of it


def test_each_scheme_starts_from_its_own_literatures_init():
    """model.init=auto (the default) is the scheme's recipe (docs/schemes.md#initialization): Pre-LN GPT-2's scaled
    output projections, DeepNorm DeepNet's Xavier-normal with gain beta on v, out and FFN (1 on q, k), HybridNorm
    its authors' cut Megatron init, Mix-LN its authors' N(0, 2/5) embedding; Keel and Post-LN plain N(0, 0.02^2)."""
    depth, width = 8, 256
    shape = dict(width=width, n_heads=4, seq_len=16, vocab_size=512, depth=depth)
    beta, scaled = (8 * depth) ** -0.25, 0.02 / (2 * depth) ** 0.5
    xavier_square, xavier_ffn = (2 / (2 * width)) ** 0.5, (2 / (5 * width)) ** 0.5  # fans (256, 256), (256, 1024)
    expected = {  # scheme: (init in force, embedding, q, v, attention out, FFN up, FFN down)
        "keel": ("normal", 0.02, 0.02, 0.02, 0.02, 0.02, 0.02),
        "postln": ("normal", 0.02, 0.02, 0.02, 0.02, 0.02, 0.02),
        "preln": ("gpt2", 0.02, 0.02, 0.02, scaled, 0.02, scaled),
        "deepnorm": (
            "xavier",
            0.02,
            xavier_square,
            beta * xavier_square,
            beta * xavier_square,
            beta * xavier_ffn,
            beta * xavier_ffn,
        ),
        "hybridnorm": ("megatron", *(std * 0.986 for std in (0.02, 0.02, 0.02, scaled, 0.02, scaled))),
        "mixln": ("mixln", 0.4**0.5, 0.02, 0.02, 0.02, 0.02, 0.02),
    }
    for scheme, (kind, *stds) in expected.items():
        torch.manual_seed(0)
        cfg = ModelConfig(**shape, scheme=scheme)
        assert cfg.init == "auto" and cfg.init_kind == kind
        model = KeelLM(cfg)
        attn, ffn = model.blocks[3].attn.branch, model.blocks[3].ffn.branch
        q, _, v = attn.qkv.weight.split(width)
        for name, weight, std in zip(
            ("embedding", "q", "v", "out", "up", "down"),
            (model.embed.weight, q, v, attn.out.weight, ffn.up.weight, ffn.down.weight),
            stds,
        ):
            assert weight.std().item() == pytest.approx(std, rel=0.05), (scheme, name)


@pytest.mark.parametrize("scheme", ["keel", "postln", "deepnorm"])
def test_a_named_init_overrides_the_recipe_and_auto_keeps_the_shared_draw(scheme):
    """model.init=normal is the shared-init comparison for every scheme; where a scheme's recipe is plain N(0, 0.02^2)
    (Keel, Post-LN) `auto` draws the very same weights, so runs recorded with model.init=normal stay comparable."""

    def weights(**overrides):
        torch.manual_seed(3)
        return KeelLM(tiny(scheme=scheme, depth=3, **overrides)).state_dict()

    shared, auto = weights(init="normal"), weights()
    assert tiny(scheme=scheme, init="normal").init_kind == "normal"
    same = all(torch.equal(shared[name], auto[name]) for name in shared)
    assert same == (scheme != "deepnorm")
