"""The schemes against docs/schemes.md: forward invariants (unit rms after each norm, Keel's sum over alpha),
each scheme's structure and final-norm rule, the rendered formulas, and a scheme as one table entry."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from keel.config import ModelConfig
from keel.config.model import SCHEMES, Scheme, SublayerSpec, formulas, needs_final_norm, sublayer_specs
from keel.errors import ConfigError
from keel.model import SCHEME_INITS, KeelLM
from keeltest.model import capture, fixed_batch_steps, loglog_slope, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def token_rms(x: torch.Tensor) -> torch.Tensor:
    return x.square().mean(-1).sqrt()


@pytest.mark.parametrize("init", ["unit", "normal"])
@pytest.mark.parametrize("scheme", ["keel", "postln", "deepnorm", "mixln"])  # the schemes with a Norm_out
def test_post_normalized_outputs_have_unit_rms(scheme, init):
    torch.manual_seed(0)
    model = KeelLM(tiny(scheme=scheme, init=init, depth=6))
    # sublayer 0 is skipped: at N(0, 0.02) init its sum has rms ~0.02, where eps = 1e-5 costs ~1%
    outputs, _ = capture([sub.norm_out for sub in model.sublayers()[1:] if sub.norm_out is not None])
    model(torch.randint(64, (2, 16)))
    assert outputs
    for out in outputs:
        torch.testing.assert_close(token_rms(out), torch.ones(out.shape[:-1]), atol=1e-3, rtol=0)


@pytest.mark.parametrize("init", ["unit", "normal"])
@pytest.mark.parametrize("first_block", ["v1", "v2"])
def test_keel_sum_over_alpha_has_unit_rms(init, first_block):
    torch.manual_seed(0)
    cfg = tiny(init=init, depth=16, keel_first_block=first_block)
    model = KeelLM(cfg)
    # from block 1's FFN on, every Keel sublayer's input is a normalized stream, so rms(alpha x + F) / alpha
    # = 1 + cos(x, F) * r / alpha + O(r^2 / alpha^2) with r = rms(F) ~ 1: within 1 / L of 1
    sums = []
    for sub in model.sublayers()[3:]:  # Norm_out receives (F, skip, alpha) and normalizes F + alpha * skip
        sub.norm_out.register_forward_pre_hook(lambda m, args: sums.append((args[0] + args[2] * args[1]).detach()))
    model(torch.randint(64, (2, 16)))
    assert len(sums) == cfg.n_sublayers - 3
    for s in sums:
        torch.testing.assert_close(
            token_rms(s) / cfg.n_sublayers, torch.ones(s.shape[:-1]), atol=1 / cfg.n_sublayers, rtol=0
        )


@pytest.mark.parametrize("overrides", [{}, {"ffn": "swiglu", "n_heads": 4, "n_kv_heads": 2}])
def test_deepnorm_beta_lands_on_ffn_v_and_out_only(overrides):
    cfg = tiny(scheme="deepnorm", **overrides)
    torch.manual_seed(0)
    deep = KeelLM(cfg)
    torch.manual_seed(0)
    plain = KeelLM(tiny(scheme="deepnorm", deepnorm_beta=1.0, **overrides))
    beta = (8 * cfg.depth) ** -0.25
    assert [spec.alpha for pair in sublayer_specs(cfg) for spec in pair] == [(2 * cfg.depth) ** 0.25] * cfg.n_sublayers
    qk_rows = (cfg.n_heads + cfg.kv_heads) * cfg.head_dim
    for d, p in zip(deep.blocks, plain.blocks):
        da, pa = d.attn.branch, p.attn.branch
        torch.testing.assert_close(da.qkv.weight[:qk_rows], pa.qkv.weight[:qk_rows], rtol=0, atol=0)  # q, k
        torch.testing.assert_close(da.qkv.weight[qk_rows:], beta * pa.qkv.weight[qk_rows:])  # v
        torch.testing.assert_close(da.out.weight, beta * pa.out.weight)
        for name in ("up", "down"):
            torch.testing.assert_close(getattr(d.ffn.branch, name).weight, beta * getattr(p.ffn.branch, name).weight)


@pytest.mark.parametrize("scheme", ["hybridnorm", "hybridnorm_star"])
def test_hybridnorm_structure(scheme):
    torch.manual_seed(0)
    model = KeelLM(tiny(scheme=scheme, init="unit"))
    x = torch.randn(2, 16, 32) * 3
    for i, block in enumerate(model.blocks):
        star_block = scheme == "hybridnorm_star" and i == 0
        attn = block.attn
        assert attn.norm_out is None and (attn.norm_in is not None) == star_block  # x + Attn_QKVN([Norm](x))
        for qkv_norm in (attn.branch.q_norm, attn.branch.k_norm, attn.branch.v_norm):
            assert qkv_norm.weight.shape == (model.cfg.head_dim,)  # per head, shared across heads
        torch.nn.init.zeros_(block.ffn.branch.down.weight)  # FFN(.) = 0 leaves only the skip
        skip = block.ffn(x)
        expected = x if star_block else F.rms_norm(x, (32,), eps=1e-5)  # Pre-LN skip vs HybridNorm's u = Norm(x)
        torch.testing.assert_close(skip, expected)


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5, 7, 8, 16, 64])
def test_mixln_postln_block_count(depth):
    specs = sublayer_specs(tiny(scheme="mixln", depth=depth))
    post = [attn.norm_out and not attn.norm_in for attn, _ in specs]
    n_post = math.floor(0.25 * depth)
    assert post == [True] * n_post + [False] * (depth - n_post)  # Post-LN first, Pre-LN after
    assert (
        sum(attn.norm_out for attn, _ in sublayer_specs(tiny(scheme="mixln", depth=100, mixln_post_fraction=0.29)))
        == 29
    )


@pytest.mark.parametrize(
    "overrides, final_norm",
    [
        ({"scheme": "preln"}, True),
        ({"scheme": "postln"}, False),
        ({"scheme": "postln", "postln_final_norm": True}, True),
        ({"scheme": "deepnorm"}, False),
        ({"scheme": "hybridnorm"}, True),
        ({"scheme": "hybridnorm_star"}, True),
        ({"scheme": "mixln"}, True),
        ({"scheme": "keel"}, False),
        ({"scheme": "keel", "keel_first_block": "v2"}, False),
        ({"scheme": "keel", "depth": 1}, True),  # v1 with N = 1: the last sublayer is plain Pre-LN
        ({"scheme": "keel", "depth": 1, "keel_first_block": "v2"}, False),
    ],
)
def test_final_norm_rule(overrides, final_norm):
    cfg = tiny(**overrides)
    assert needs_final_norm(cfg) == final_norm
    assert (KeelLM(cfg).final_norm is not None) == final_norm


def test_keel_first_block_rules():
    L = 8
    v1, v2 = (sublayer_specs(tiny(keel_first_block=rule)) for rule in ("v1", "v2"))
    assert [(s.norm_in, s.norm_out, s.alpha) for s in v1[0]] == [(True, False, 1.0), (True, False, 1.0)]
    assert [(s.norm_in, s.norm_out, s.alpha) for s in v2[0]] == [(True, False, 1.0), (True, True, 1.0)]
    for specs in (v1, v2):
        assert all((s.norm_in, s.norm_out, s.alpha) == (True, True, L) for pair in specs[1:] for s in pair)
    assert sublayer_specs(tiny(keel_alpha=3.0))[1][0].alpha == 3.0


@pytest.mark.parametrize("first_block", ["v1", "v2"])
def test_keel_without_inner_norm_is_postln_with_alpha(first_block):
    """The ablation (paper's "Attempt 1"): after block 0, Norm(L * x + F(x)); block 0 keeps its rule."""
    L = 8
    plain, ablated = (
        sublayer_specs(tiny(keel_first_block=first_block, keel_inner_norm=inner)) for inner in (True, False)
    )
    assert ablated[0] == plain[0]
    assert all((s.norm_in, s.norm_out, s.alpha) == (False, True, L) for pair in ablated[1:] for s in pair)
    assert not needs_final_norm(tiny(keel_first_block=first_block, keel_inner_norm=False))
    model = KeelLM(tiny(keel_first_block=first_block, keel_inner_norm=False))
    assert model.blocks[1].attn.norm_in is None and model.blocks[1].ffn.norm_out is not None
    assert torch.isfinite(model(torch.randint(0, 64, (2, 8)))).all()


def test_depth_scaled_branches_are_pre_ln_with_each_branch_times_base_over_depth():
    """model.branch_base_depth=D (docs/model.md): at depth D plain Pre-LN bit for bit; at depth N each sublayer is
    x + (D/N) F(Norm(x)), F as drawn at depth D: Pre-LN with the init of D and its branches' last matrices x D/N
    computes the same logits; any other scheme refuses the key."""
    torch.manual_seed(0)
    plain = KeelLM(tiny(scheme="preln", depth=2))
    torch.manual_seed(0)
    based = KeelLM(tiny(scheme="preln", depth=2, branch_base_depth=2))
    ids = torch.randint(0, 64, (2, 8))
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), based.state_dict().values()))
    assert torch.equal(plain(ids), based(ids))

    torch.manual_seed(0)
    deep = KeelLM(tiny(scheme="preln", depth=8, branch_base_depth=2))
    torch.manual_seed(0)
    drawn_at_2 = KeelLM(tiny(scheme="preln", depth=8, init="normal"))  # the draw before gpt2's 1/sqrt(2 x depth)
    for block, drawn in zip(deep.blocks, drawn_at_2.blocks):
        torch.testing.assert_close(block.ffn.branch.down.weight, drawn.ffn.branch.down.weight / 2, rtol=0, atol=0)
    assert {spec.formula() for pair in sublayer_specs(deep.cfg) for spec in pair} == {"x + 0.25 F(Norm_in(x))"}
    unscaled = KeelLM(tiny(scheme="preln", depth=8))
    unscaled.load_state_dict(deep.state_dict())
    with torch.no_grad():
        for block in unscaled.blocks:
            block.attn.branch.out.weight.mul_(0.25)
            block.ffn.branch.down.weight.mul_(0.25)
    torch.testing.assert_close(unscaled(ids), deep(ids))
    with pytest.raises(ConfigError, match="model.branch_base_depth: scales Pre-LN's residual branches"):
        tiny(scheme="keel", branch_base_depth=2)


def stream_update_rms(depth: int, branch_base_depth: int | None) -> float:
    """The rms change of Pre-LN's last stream (the final norm's input) on a fixed batch after 4 AdamW steps at LR
    1e-2 on it, width 32: how far the same LR moves the output at this depth."""
    torch.manual_seed(0)
    shape = dict(width=32, n_heads=4, vocab_size=256, seq_len=32)
    model = KeelLM(ModelConfig(scheme="preln", depth=depth, branch_base_depth=branch_base_depth, **shape))
    streams = []
    model.final_norm.register_forward_pre_hook(lambda module, args: streams.append(args[0].detach()))
    batch = fixed_batch_steps(model, 4, 1e-2)  # the first forward sees the initial model
    with torch.no_grad():
        model(batch[:, :-1])
    return (streams[-1] - streams[0]).pow(2).mean().sqrt().item()


def test_depth_scaled_branches_keep_an_lrs_step_the_same_size_at_every_depth():
    """A depth coordinate check: over depths 2-32 the same 4 AdamW steps move plain Pre-LN's last stream 0.09 -> 4.4
    (log-log slope 1.41: the LR that suits 2 blocks is far too large at 32), Pre-LN x 2/N's 0.09 -> 0.08 (-0.05)."""
    depths = (2, 4, 8, 16, 32)
    plain = loglog_slope(depths, [stream_update_rms(depth, None) for depth in depths])
    ruled = loglog_slope(depths, [stream_update_rms(depth, 2) for depth in depths])
    assert plain > 1.0 and abs(ruled) < 0.15, (plain, ruled)


def test_every_scheme_has_its_own_blocks_and_an_unknown_one_is_refused():
    """One table entry per scheme (no fall-through to Keel): the seven layouts differ, and a scheme outside
    the table is an error naming the allowed ones, wherever the specs are asked for."""
    layouts = {
        scheme: (sublayer_specs(tiny(scheme=scheme)), needs_final_norm(tiny(scheme=scheme))) for scheme in SCHEMES
    }
    assert len({repr(layout) for layout in layouts.values()}) == len(SCHEMES)
    cfg = tiny()
    cfg.scheme = "rezero"  # past validation, as a config edited after loading would be
    for ask in (sublayer_specs, needs_final_norm, KeelLM):
        with pytest.raises(ConfigError, match="model.scheme: unknown scheme 'rezero'; allowed: keel, preln"):
            ask(cfg)


def test_rendered_formulas_match_the_schemes_doc():
    """docs/schemes.md's table of every scheme's sublayers at 16 blocks is what the code renders, entry by entry."""
    doc = (Path(__file__).parents[1] / "docs" / "schemes.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (`.+\)) \|$", doc, re.MULTILINE))
    assert set(rows) == set(SCHEMES)
    for scheme, text in rows.items():
        rendered = ", ".join(f"`{formula}` ({n})" for formula, n in formulas(ModelConfig(depth=16, scheme=scheme)))
        assert rendered == text, scheme


def test_a_scheme_is_one_entry(monkeypatch):
    """Adding a scheme is one SCHEMES entry (and one SCHEME_INITS entry for its own init): with a toy one (Post-LN
    with alpha 2, a final norm, its own init and bottom block) registered, the config accepts it, the model builds
    and trains a step, and every rule it carries is the one used."""
    from keel.gradflow import bottom_middle_top

    def halve_head(model):
        model.head.weight.mul_(0.5)

    toy = SublayerSpec(norm_in=False, norm_out=True, alpha=2.0)
    monkeypatch.setitem(SCHEMES, "toy", Scheme(lambda cfg: [(toy, toy)] * cfg.depth, bottom_block=lambda cfg: 1))
    monkeypatch.setitem(SCHEME_INITS, "toy", halve_head)
    cfg = tiny(scheme="toy", init_std=0.02)
    torch.manual_seed(0)
    model = KeelLM(cfg)
    torch.manual_seed(0)
    plain = KeelLM(tiny(scheme="postln", init_std=0.02))
    assert torch.allclose(model.head.weight, 0.5 * plain.head.weight)  # the common init, then the toy's
    assert model.final_norm is not None and bottom_middle_top(cfg)[0] == 1
    assert formulas(cfg) == [("Norm_out(2 x + F(x))", 2 * cfg.depth)]
    idx = torch.randint(cfg.vocab_size, (2, cfg.seq_len))
    model(idx, targets=idx).backward()
    assert all(p.grad is not None for p in model.parameters())
