"""keel.divergence: the one divergence rule of the stability monitor and of `keel maxlr collect`."""

from __future__ import annotations

import math

from keel.divergence import DivergenceJudge, divergence_bar
from keel.experiments.maxlr_report import judge


def test_the_bar_is_best_plus_margin_capped_at_the_ceiling_once_learned():
    assert divergence_bar(5.0, 1.0, None, 0.5) == 6.0
    assert divergence_bar(5.0, 1.0, 5.2, 0.5) == 6.0  # not yet 0.5 below the ceiling: no cap
    assert divergence_bar(4.0, 1.0, 4.6, 0.5) == 4.6  # learned: a fall back to the ceiling is a failure


def feed(judge_: DivergenceJudge, points: list[tuple[int, float]]) -> list[int]:
    """The steps where the judge finds the run diverged."""
    return [step for step, loss in points if judge_.see(step, loss)]


def test_evaluations_count_the_steps_since_the_last_one_within_the_bar():
    # evaluations every 10 steps, patience 25: above from step 30, diverged once 30 - 20 ... 50 - 20 >= 25
    points = [(0, 6.0), (10, 5.0), (20, 4.5), (30, 6.0), (40, 6.1), (50, 6.2), (60, 6.3)]
    divergence = DivergenceJudge(spike_margin=1.0, patience=25)
    assert feed(divergence, points) == [50]  # once per excursion
    assert divergence.good_step == 20 and divergence.best == 4.5 and divergence.over == 40


def test_an_excursion_that_returns_within_the_bar_is_no_divergence():
    points = [(0, 5.0), (10, 6.5), (20, 6.5), (30, 5.2), (40, 6.5), (50, 5.1)]
    divergence = DivergenceJudge(spike_margin=1.0, patience=25)
    assert feed(divergence, points) == []
    assert not divergence.above and divergence.over == 0 and divergence.good_step == 50


def test_consecutive_points_count_one_each_and_a_non_finite_loss_diverges_at_once():
    steps = DivergenceJudge(spike_margin=0.5, patience=3, consecutive=True)
    assert feed(steps, [(0, 3.0), (1, 3.6), (2, 3.7), (3, 3.8), (4, 3.9)]) == [3]
    nonfinite = DivergenceJudge(spike_margin=0.5, patience=100)
    assert feed(nonfinite, [(0, 3.0), (5, math.nan)]) == [5] and nonfinite.best == 3.0


def test_the_report_judges_a_logged_curve_with_the_same_rule():
    # (step, lr, held-out loss): learned below the unigram loss, then back above it for the patience
    curve = [(0, 0.01, 7.0), (10, 0.02, 5.5), (20, 0.03, 5.0), (30, 0.04, 6.9), (40, 0.05, 6.95), (50, 0.06, 7.1)]
    verdict = judge(curve, unigram=6.8, margin=0.5, spike_margin=3.0, patience=20)
    online = DivergenceJudge(3.0, 20, ceiling=6.8, ceiling_margin=0.5)
    assert feed(online, [(step, loss) for step, _, loss in curve]) == [40]  # 40 - 20 >= patience
    assert (verdict.failure, verdict.onset_step, verdict.max_tolerable_lr) == ("divergence", 30, 0.03)
