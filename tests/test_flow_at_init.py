"""Gradient flow at initialization against docs/schemes.md: the skip path per scheme (exactly one, decaying, depth
independent), the full relative flow, Keel's weight-gradient ratios. Small widths, CPU, one thread."""

from __future__ import annotations

import math
from functools import cache

import pytest

from keel.config import ModelConfig
from keel.config.model import SCHEMES
from keel.gradflow import measure
from keeltest.model import TINY

pytestmark = pytest.mark.usefixtures("one_thread")


@cache
def flow(scheme: str, depth: int, detach: bool, init: str = "unit", **overrides) -> dict:
    """gradflow.measure's summary (bottom/middle/top ratios; Keel's block 0 excluded)."""
    cfg = ModelConfig(**TINY, scheme=scheme, depth=depth, init=init, **overrides)
    return measure(cfg, detach_branches=detach, batch=2, seed=0)["summary"]


DEPTHS = (16, 64)


@pytest.mark.parametrize("depth", DEPTHS)
def test_preln_skip_path_is_exactly_one(depth):
    # x + F(detached): the gradient passes the skip unchanged (raw norm; the relative one sees the stream grow)
    summary = flow("preln", depth, True)
    assert summary["act_grad_bottom_top"] == pytest.approx(1.0, abs=1e-6)
    assert summary["act_grad_middle_top"] == pytest.approx(1.0, abs=1e-6)


def test_postln_skip_path_decays_exponentially_with_depth():
    shallow, deep = (flow("postln", depth, True)["rel_act_grad_bottom_top"] for depth in DEPTHS)
    assert shallow < 1e-2  # ~1e-3 in docs/schemes.md
    assert deep < 1e-10  # ~4e-14
    assert deep < shallow**3  # 4x the sublayers: the exponent grows ~4x


@pytest.mark.parametrize("depth", DEPTHS)
def test_keel_skip_ratio_is_depth_independent(depth):
    summary = flow("keel", depth, True)
    assert 0.6 < summary["act_grad_bottom_top"] < 1.1  # ~0.8 raw: block 1's input is block 0's unnormalized output
    assert 0.85 < summary["rel_act_grad_bottom_top"] < 1.2
    assert 0.9 < summary["rel_act_grad_middle_top"] < 1.1
    other = flow("keel", DEPTHS[1 - DEPTHS.index(depth)], True)
    assert abs(summary["act_grad_bottom_top"] - other["act_grad_bottom_top"]) < 0.15


@pytest.mark.parametrize("depth", DEPTHS)
def test_keel_with_alpha_one_collapses_to_postln_decay(depth):
    control = flow("keel", depth, True, keel_alpha=1.0)["rel_act_grad_bottom_top"]
    postln = flow("postln", depth, True)["rel_act_grad_bottom_top"]
    assert control < (1e-2 if depth == 16 else 1e-10)
    assert abs(math.log10(control) - math.log10(postln)) < 1.5  # same decay, within a factor ~30


@pytest.mark.parametrize("depth", DEPTHS)
def test_deepnorm_skip_ratio_near_one(depth):
    summary = flow("deepnorm", depth, True)
    assert 0.9 < summary["rel_act_grad_bottom_top"] < 1.1
    assert 0.9 < summary["rel_act_grad_middle_top"] < 1.1


@pytest.mark.parametrize("depth", DEPTHS)
def test_mixln_skip_path_decays_over_its_postln_part_only(depth):
    summary = flow("mixln", depth, True)
    assert summary["act_grad_middle_top"] == pytest.approx(1.0, abs=1e-6)  # block depth/2 is in the Pre-LN part
    assert summary["act_grad_bottom_top"] < (0.5 if depth == 16 else 1e-2)
    assert summary["act_grad_bottom_top"] > flow("postln", depth, True)["act_grad_bottom_top"]


@pytest.mark.parametrize("depth", DEPTHS)
def test_full_gradient_relative_flow(depth):
    for scheme in ("keel", "deepnorm"):
        assert 0.8 < flow(scheme, depth, False)["rel_act_grad_bottom_top"] < 1.25, scheme
    assert 0.3 < flow("preln", depth, False)["rel_act_grad_bottom_top"] < 3.0  # flat in relative terms
    assert flow("postln", depth, False)["rel_act_grad_bottom_top"] > 0.1  # does not vanish at init
    for scheme in SCHEMES:  # N(0, 0.02) init: r is tiny, every scheme sits near 1
        assert 0.8 < flow(scheme, depth, False, "normal")["rel_act_grad_bottom_top"] < 1.5, scheme


@pytest.mark.parametrize("depth", DEPTHS)
def test_keel_weight_gradient_ratios(depth):
    summary, L = flow("keel", depth, False), 2 * depth
    assert 0.7 < summary["weight_grad_bottom_top"] < 1.4  # block 1 / last block
    assert L / 3 < summary["weight_grad_block0_top"] < 3 * L  # the alpha = 1 block 0: ~L times larger
