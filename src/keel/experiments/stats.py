"""The statistics every report of `keel paper-report` shares, and how a report prints them: median and range, mean
and sd over seeds, the sign test, the direction of a sequence, a line through log-log points."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
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
