"""The one rule that says a run has diverged, fed its judged losses one at a time: online by the stability monitor
(callbacks/stability.py, a point per evaluation or per step) and offline by `keel maxlr collect`
(keel.experiments.maxlr_report, over a probe's logged held-out losses). Torch-free."""

from __future__ import annotations

import math


def divergence_bar(best: float, spike_margin: float, ceiling: float | None, ceiling_margin: float) -> float:
    """The loss above which a run is diverging: the best loss so far + spike_margin, capped at `ceiling` (the unigram
    loss) once the best is ceiling_margin below it - a model that has learned and falls back to unigram has failed,
    even within the margin."""
    bar = best + spike_margin
    if ceiling is not None and best <= ceiling - ceiling_margin:
        bar = min(bar, ceiling)
    return bar


class DivergenceJudge:
    """A run's losses in step order against divergence_bar: a loss above the bar opens an excursion, one within it
    ends it; the run has diverged once an excursion lasts `patience` steps (or at a non-finite loss).

    consecutive: an excursion's length is the number of points above the bar (a point per step: the training loss);
    else the steps since the last point within it (points every few steps: held-out evaluations)."""

    def __init__(
        self,
        spike_margin: float,
        patience: int,
        ceiling: float | None = None,
        ceiling_margin: float = 0.0,
        consecutive: bool = False,
    ) -> None:
        self.spike_margin, self.patience, self.consecutive = spike_margin, patience, consecutive
        self.ceiling, self.ceiling_margin = ceiling, ceiling_margin
        self.best = math.inf  # the lowest finite loss so far
        self.good_step = -1  # the last point within the bar
        self.over = 0  # the current excursion's length (0: within the bar)
        self.above = False  # whether the last point was above the bar (or not finite)

    @property
    def bar(self) -> float:
        return divergence_bar(self.best, self.spike_margin, self.ceiling, self.ceiling_margin)

    def see(self, step: int, loss: float) -> bool:
        """Judge the loss at `step`: True where the run is found diverged, at a non-finite loss or where an
        excursion reaches `patience` (once per excursion)."""
        finite = math.isfinite(loss)
        if finite:
            self.best = min(self.best, loss)
        self.above = not (finite and loss <= self.bar)
        if not self.above:
            self.over, self.good_step = 0, step
            return False
        before, self.over = self.over, self.over + 1 if self.consecutive else step - self.good_step
        return not finite or before < self.patience <= self.over
