"""The Summary of `keel paper-report` (keel.experiments.summary): each row's figure is the median of the per-seed
ratios, its verdict waits for 3 paired seeds, a comparison across slopes is not made, a run without a record says so
(docs/experiments.md's Summary is held to the report over the committed records in tests/test_doc_blocks.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from keel.experiments.stats import paired, paired_over_conditions, seeds_over_conditions
from keel.experiments.summary import deep_row, depth_gap_row, family_rows, max_lr_rows

ROOT = Path(__file__).resolve().parents[1]
LINEAR = "linear from 0, 0.0001 per step"
GENTLE = "linear from 0, 2.5e-05 per step"


def probe(scheme: str, seed: int, value: float | None, ramp: str = LINEAR, point=(16, 64)) -> dict:
    """A collected probe row (keel.experiments.maxlr_report) of a run that learned and diverged at value, or that
    never learned (None)."""
    return {
        "row": scheme,
        "seed": seed,
        "depth": point[0],
        "width": point[1],
        "ramp": ramp,
        "failure": "divergence",
        "resolved": value is not None,
        "max_tolerable_lr": value,
        "max_lr_seen": 0.4,
        "best_heldout": 5.0,
    }


def grid(keel: list[float | None], other: list[float | None], scheme: str = "preln", ramp: str = LINEAR) -> list:
    return [probe("keel", s, v, ramp) for s, v in enumerate(keel, 1)] + [
        probe(scheme, s, v, ramp) for s, v in enumerate(other, 1)
    ]


def test_a_max_lr_row_gives_the_median_of_the_per_seed_ratios_and_its_paired_tests():
    # per seed 2, 3 and 0.5: the median ratio is 2; the ratio of the medians (3 / 1) would say 3
    (row,) = max_lr_rows({"linear-d16": grid([0.2, 0.3, 0.4], [0.1, 0.1, 0.8])})
    assert row["protocol"] == "linear, 0.0001/step" and row["blocks x width"] == "16 x 64"
    assert row["seeds"] == "3 of 3" and row["figure"] == "Keel / Pre-LN 2 [0.5-3]"
    assert row["verdict"] == "Keel higher in 2, lower in 1 of 3"
    assert row["paired test"].startswith("sign 1, signed-rank ")


def test_a_comparison_over_a_sweeps_lrs_counts_each_seed_once():
    """Over 4 LRs x 3 seeds, Keel higher at every (LR, seed) pair: 12 pairs would give a sign p of 0.0005, but one
    seed's runs share its init and data, so each seed is the geometric mean of its ratios (n = 3, sign p = 0.25); a
    seed missing an LR is averaged over the LRs it has."""
    per_lr = [({1: 2.0 * lr, 2: 3.0 * lr, 3: 4.0 * lr}, {1: lr, 2: lr, 3: lr}) for lr in (1.0, 2.0, 4.0, 8.0)]
    p = paired_over_conditions(per_lr)
    assert p.ratios == pytest.approx((2.0, 3.0, 4.0)) and p.sign_p == 0.25
    assert seeds_over_conditions(per_lr) == "3, each over 4 LRs"
    per_lr[0] = ({1: 1.0, 2: 27.0}, {1: 1.0, 2: 1.0, 3: 1.0})  # seed 3 lacks LR 1; seed 2 gets 27 there, seed 1 1
    p = paired_over_conditions(per_lr)
    assert p.ratios == pytest.approx((8 ** (1 / 4), (27 * 27) ** (1 / 4), 4.0))
    assert seeds_over_conditions(per_lr) == "3, each over 3-4 LRs"


def test_fewer_than_three_paired_seeds_give_no_verdict_and_no_test():
    # seed 3's Pre-LN never learned: two paired seeds
    (row,) = max_lr_rows({"linear-d64": grid([0.2, 0.3, 0.4], [0.1, 0.1, None])})
    assert (row["seeds"], row["verdict"], row["paired test"]) == ("2 of 3", "n = 2, no verdict", "-")


def test_the_post_ln_family_is_compared_with_keel_only_on_keels_slope():
    family = [probe(s, seed, v, GENTLE) for s, v in (("postln", 0.014), ("deepnorm", 0.016)) for seed in (1, 2, 3)]
    rows = family_rows({"linear-gentle-d16": family, "linear-d16": grid([0.1, 0.12, 0.11], [0.014] * 3, "postln")})
    on_keels, gentle = rows
    assert on_keels["figure"] == "Keel / Post-LN 7.86" and on_keels["verdict"] == "Post-LN: Keel higher in 3 of 3"
    assert gentle["protocol"] == "linear, 2.5e-05/step"
    assert gentle["figure"] == "max LR Post-LN 0.014 (3/3), DeepNorm 0.016 (3/3)"
    assert gentle["verdict"] == "matched comparison not run: no Keel run on this ramp"
    # Keel on the family's slope, in a grid of its own (linear-gentle-keel-d16): the family is compared with it
    keel = [probe("keel", seed, v, GENTLE) for seed, v in ((1, 0.07), (2, 0.08), (3, 0.064))]
    (matched,) = family_rows({"linear-gentle-d16": family, "linear-gentle-keel-d16": keel})
    assert (
        matched["figure"] == "Keel / Post-LN 5, DeepNorm 4.38"
    )  # 0.07 / 0.014; the median of 0.07, 0.08, 0.064 / 0.016
    assert matched["verdict"] == "Post-LN, DeepNorm: Keel higher in 3 of 3"


def test_the_1024_block_row_says_no_record_where_a_run_left_none(tmp_path):
    (tmp_path / "deep1024" / "preln-d1024-lr0.01").mkdir(parents=True)
    shutil.copy(
        ROOT / "docs/experiments/runs/deep1024/preln-d1024-lr0.01/config.yaml",
        tmp_path / "deep1024/preln-d1024-lr0.01/config.yaml",
    )
    (tmp_path / "deep1024/preln-d1024-lr0.01/stability.json").write_text(
        json.dumps({"failed": False, "steps": 200, "nonfinite_steps": 0})
    )
    (row,) = deep_row(tmp_path)
    assert row["protocol"] == "LR 0.01, 200 steps" and row["blocks x width"] == "1,024 x 32"
    assert "Keel: no record" in row["figure"] and "Pre-LN: 0 non-finite of 200 steps" in row["figure"]
    assert row["verdict"] == "Keel: no record"


def test_ratios_equal_up_to_float_rounding_have_no_t_test():
    # 0.75 three times, one of them a rounding off (as LRs on one grid of points give): no spread, no t
    comparison = paired({1: 0.3 * 0.75, 2: 0.7 * 0.75, 3: 0.11 * 0.75}, {1: 0.3, 2: 0.7, 3: 0.11})
    assert len(set(comparison.ratios)) == 2 and comparison.t_p is None
    assert comparison.verdict == "lower in 3 of 3"


def test_the_post_ln_gap_against_depth_is_measured_only_on_one_slope_at_two_depths():
    def runs(scheme: str, depth: int, ramp: str, value: float) -> list[dict]:
        return [probe(scheme, seed, value * (1 + seed / 100), ramp, (depth, 32)) for seed in (1, 2, 3)]

    grids = {
        "linear-depth-d16": runs("keel", 16, LINEAR, 0.14),
        "linear-gentle-depth-d16": runs("postln", 16, GENTLE, 0.022),
        "linear-d64": runs("keel", 64, LINEAR, 0.087),
        "linear-gentle-d64": runs("postln", 64, GENTLE, 0.02),
    }
    (apart,) = depth_gap_row(grids)
    assert apart["seeds"] == "matched at 0 depths"
    assert apart["figure"] == "Keel (0.0001/step) 16: 0.143, 64: 0.0887; Post-LN (2.5e-05/step) 16: 0.0224, 64: 0.0204"
    assert apart["verdict"] == "not measured: matched at fewer than 2 depths"
    grids["linear-gentle-depth-d16"] += runs("keel", 16, GENTLE, 0.088)  # Keel on the family's slope: 4x, then 6x
    grids["linear-gentle-d64"] += runs("keel", 64, GENTLE, 0.12)
    (matched,) = depth_gap_row(grids)
    assert matched["seeds"] == "matched at 2 depths"
    assert matched["figure"] == "Keel / Post-LN 16 (2.5e-05/step): 4 [4-4], 64 (2.5e-05/step): 6 [6-6]"
    assert matched["verdict"] == "widens; no trend test"
