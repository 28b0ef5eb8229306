"""The statistics every report of `keel paper-report` shares, and how a report prints them: median and range, mean
and sd over seeds, the sign test, the paired comparison of two schemes seed by seed, the direction of a sequence, a
line through log-log points."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np


def fmt(value: float | None) -> str:
    """A figure in a report's prose cell: three significant digits, '-' for none."""
    return "-" if value is None else f"{value:.3g}"


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def median_range(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    """The median, min and max of values (three Nones for none)."""
    return (statistics.median(values), min(values), max(values)) if values else (None, None, None)


def fmt_median_range(values: Sequence[float]) -> str:
    """median [min-max] in a report's prose cell, '-' for none."""
    middle, low, high = median_range(values)
    return "-" if middle is None else f"{fmt(middle)} [{fmt(low)}-{fmt(high)}]"


def fmt_sd(values: list[float]) -> str:
    return fmt(statistics.stdev(values)) if len(values) > 1 else "-"


def spread(values: list[float]) -> str:
    """mean ± sample sd [min, max] n=seeds ('-' for the sd of one seed)."""
    if not values:
        return "-"
    mean = fmt(statistics.mean(values))
    return f"{mean} ± {fmt_sd(values)} [{fmt(min(values))}, {fmt(max(values))}] n={len(values)}"


def apart(a: list[float], b: list[float]) -> str:
    """Whether the two seed ranges do not overlap: every seed of one beyond every seed of the other; "-" below two
    seeds a side (one seed has no range)."""
    if len(a) < 2 or len(b) < 2:
        return "-"
    return "yes" if min(a) > max(b) or max(a) < min(b) else "no"


def direction(values: list[float]) -> str:
    """How a sequence moves: rises, falls, flat (each step the same way or level), or not monotone."""
    steps = [b - a for a, b in pairwise(values)]
    if not steps:
        return "-"
    if all(s == 0 for s in steps):
        return "flat"
    if all(s >= 0 for s in steps):
        return "rises"
    return "falls" if all(s <= 0 for s in steps) else "not monotone"


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact binomial p-value of wins vs losses under p = 1/2 (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(0, min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


MIN_SEEDS = 3  # a comparison on fewer paired seeds gives its figures but no verdict


@dataclass(frozen=True)
class Paired:
    """a against b over the seeds both have (each pair a / b > 0: an LR, a perplexity): the per-seed ratios and three
    tests of "a and b are alike" that fit paired seeds: the sign test, Wilcoxon's exact signed-rank test on the log
    ratios, and the one-sample t-test on the log ratios (all two-sided)."""

    ratios: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.ratios)

    @property
    def higher(self) -> int:
        return sum(r > 1 for r in self.ratios)

    @property
    def lower(self) -> int:
        return sum(r < 1 for r in self.ratios)

    @property
    def median_ratio(self) -> float:
        """The median of the per-seed ratios (not the ratio of the medians)."""
        return statistics.median(self.ratios)

    @property
    def sign_p(self) -> float:
        return sign_test(self.higher, self.lower)

    @property
    def signed_rank_p(self) -> float | None:
        from scipy import stats

        logs = [math.log(r) for r in self.ratios if r != 1]
        return float(stats.wilcoxon(logs, method="exact").pvalue) if logs else None

    @property
    def t_p(self) -> float | None:
        from scipy import stats

        logs = [math.log(r) for r in self.ratios]
        # no spread (equal ratios, up to float rounding: the same LR grid points): no t
        if len(logs) < 2 or math.isclose(min(logs), max(logs), rel_tol=1e-9, abs_tol=1e-12):
            return None
        return float(stats.ttest_1samp(logs, 0.0).pvalue)

    @property
    def verdict(self) -> str:
        """ "a higher in k of n" (or lower, or level), or "n = 2, no verdict" below MIN_SEEDS paired seeds."""
        if self.n < MIN_SEEDS:
            return f"n = {self.n}, no verdict"
        if self.higher == self.n:
            return f"higher in {self.n} of {self.n}"
        if self.lower == self.n:
            return f"lower in {self.n} of {self.n}"
        return f"higher in {self.higher}, lower in {self.lower} of {self.n}"

    def cells(self) -> dict[str, str]:
        """The comparison as a report's cells."""
        return {
            "seeds": str(self.n),
            "a / b per seed": ", ".join(fmt(r) for r in self.ratios),
            "median ratio": fmt(self.median_ratio) if self.ratios else "-",
            "verdict": self.verdict,
            "sign p": fmt(self.sign_p),
            "signed-rank p": fmt(self.signed_rank_p),
            "t p (log ratio)": fmt(self.t_p),
        }


def paired(a: dict[int, float | None], b: dict[int, float | None]) -> Paired:
    """a / b over the seeds both have a value for (seed -> value)."""
    return Paired(tuple(a[seed] / b[seed] for seed in sorted(a.keys() & b.keys()) if a[seed] and b[seed]))


def paired_over_conditions(conditions: list[tuple[dict[int, float | None], dict[int, float | None]]]) -> Paired:
    """a against b over several conditions (the peak LRs of a sweep), each condition's values by seed: a seed's
    ratio is the geometric mean of its a / b over the conditions where it has both. The runs of one seed share its
    init and data order, so they are not independent pairs: a seed counts once, and the tests have the seeds' n (the
    test of a fixed effect with the seed as a random block)."""
    logs = log_ratios_by_seed(conditions)
    return Paired(tuple(math.exp(statistics.mean(values)) for _, values in sorted(logs.items())))


def log_ratios_by_seed(conditions: list[tuple[dict[int, float | None], dict[int, float | None]]]) -> dict[int, list]:
    """Each seed's log(a / b) over the conditions where it has both."""
    logs: dict[int, list[float]] = {}
    for a, b in conditions:
        for seed in sorted(a.keys() & b.keys()):
            if a[seed] and b[seed]:
                logs.setdefault(seed, []).append(math.log(a[seed] / b[seed]))
    return logs


def seeds_over_conditions(conditions: list[tuple[dict[int, float | None], dict[int, float | None]]]) -> str:
    """The seeds paired_over_conditions pairs, and over how many conditions (LRs) each: "3, each over 4 LRs"."""
    counts = sorted(len(values) for values in log_ratios_by_seed(conditions).values())
    if not counts:
        return "0"
    each = f"{counts[0]}" if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"
    return f"{len(counts)}, each over {each} LRs"


def max_over_min(values: list[float]) -> float | None:
    """max / min of positive values (how far an LR moves over a trend), None with fewer than two."""
    return max(values) / min(values) if len(values) >= 2 else None


def log_line_fit(points: list[tuple[float, float]], at: float) -> dict:
    """Least squares of log(y) on log(x) over at least three (x, y) points with two x or more: the exponent and its
    95% interval, and the line's value at x = `at` with its 95% interval (the mean's, not a new point's)."""
    from scipy import stats

    x = np.log([h for h, _ in points])
    y = np.log([v for _, v in points])
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    dof = len(points) - 2  # >= 1: three points or more
    residual = y - design @ coef
    cov = float(residual @ residual) / dof * np.linalg.inv(design.T @ design)
    t = stats.t.ppf(0.975, dof)
    slope_half = t * math.sqrt(cov[1, 1])
    x0 = np.array([1.0, math.log(at)])
    mean, mean_half = float(x0 @ coef), t * math.sqrt(float(x0 @ cov @ x0))
    return {
        "exponent": float(coef[1]),
        "exponent low": float(coef[1]) - slope_half,
        "exponent high": float(coef[1]) + slope_half,
        "at": at,
        "value": math.exp(mean),
        "value low": math.exp(mean - mean_half),
        "value high": math.exp(mean + mean_half),
        "points": len(points),
    }
