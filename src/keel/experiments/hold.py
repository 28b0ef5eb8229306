"""The hold map of `keel paper-report`: how a scheme's max tolerable LR depends on how long its ramp holds each LR.

A ramp's hold at an LR x is the number of steps it spends between x and 4/3 x (maxlr_report.hold_steps): 20 at every
LR on the default geometric ramp, x / (3 * slope) on a linear warm-up from 0. Every max-LR grid of a point (blocks x
width) gives each scheme's limit at the hold its ramp had there; a straight line through log(max LR) against
log(hold), over every resolved seed, says whether the limit depends on the hold (its exponent, with a 95% interval)
and where it would be under a 5,000-step linear warm-up that peaks at the limit (a hold of 5,000 / 3 steps there).
The line is fitted twice: over every ramp, and over the linear ramps alone - the geometric ramps differ from a
warm-up in more than the hold (a model reaches x after fewer steps of training), so the second is the one that
extrapolates like for like.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from keel.experiments.maxlr_report import HOLD_FACTOR, max_lr_value, rows_at
from keel.experiments.plots import pyplot
from keel.experiments.roles import HOLD_GRIDS
from keel.experiments.stats import fmt, log_line_fit, median

HOLD_SCHEMES = ("keel", "preln")
RAMP_SETS = {"every ramp": lambda ramp: True, "linear ramps": lambda ramp: ramp.startswith("linear")}
WARMUP_STEPS = 5000  # the paper's warm-up of its 64-layer max-LR probe (docs/paper.md, Table 1)
WARMUP_HOLD = WARMUP_STEPS * (HOLD_FACTOR - 1)  # its hold at its peak, were the peak the limit: 1,667 steps
# The holds a line is drawn through must span this much: on a linear ramp the hold at the limit moves with the limit,
# so two slopes 2x apart can give nearly the same hold, and a line through them extrapolates any difference between
# the grids (a slow return to the unigram loss, say) to an absurd exponent.
MIN_HOLD_SPAN = 2.0


def hold_points(
    grids: dict[str, list[dict]], point: tuple[int, int], scheme: str, ramps: str = "every ramp"
) -> list[tuple[str, dict]]:
    """(grid, row) of every run of the scheme at the point in the map's grids, on the ramps of RAMP_SETS[ramps]."""
    return [
        (grid, r)
        for grid in HOLD_GRIDS[point]
        for r in rows_at(grids.get(grid, []), *point, scheme)
        if RAMP_SETS[ramps](r["ramp"])
    ]


def limits(runs: list[tuple[str, dict]]) -> list[tuple[float, float]]:
    """(hold, max LR) of the runs that learned and then diverged (a run with no failure up to the peak gives only a
    lower bound, kept out of the fit), the hold being its grid's median. On a linear ramp a run's own hold is its
    max LR over 3 x slope: seed by seed it would rise with the max LR by construction (an exponent of +1 within one
    slope), so the seeds of a grid share one hold and only the grids' holds differ."""
    diverged = [(grid, r["hold_steps"], v) for grid, r in runs if r["failure"] and (v := max_lr_value(r)) is not None]
    grid_hold = {grid: median([h for g, h, _ in diverged if g == grid]) for grid, _, _ in diverged}
    return [(grid_hold[grid], v) for grid, _, v in diverged]


def hold_table(grids: dict[str, list[dict]]) -> list[dict]:
    """Per point, scheme and ramp: the max LR over seeds and the hold the ramp had at it."""
    table = []
    for point in HOLD_GRIDS:
        for scheme in HOLD_SCHEMES:
            runs = hold_points(grids, point, scheme)
            for grid in dict.fromkeys(grid for grid, _ in runs):
                rows = [r for g, r in runs if g == grid]
                values = [v for v in map(max_lr_value, rows) if v is not None]
                holds = [r["hold_steps"] for r in rows if r.get("hold_steps") is not None]
                optimal = [r["loss_optimal_lr"] for r in rows if r["loss_optimal_lr"] is not None]
                table.append(
                    {
                        "blocks x width": f"{point[0]} x {point[1]}",
                        "scheme": scheme,
                        "grid": grid,
                        "ramp": rows[0]["ramp"],
                        "resolved": f"{len(values)}/{len(rows)}",
                        "max LR per seed": ", ".join(fmt(v) for v in values) or "-",
                        "max LR median": fmt(median(values)),
                        "hold at the limit (steps)": fmt(median(holds)),
                        "loss-optimal LR median": fmt(median(optimal)),
                    }
                )
    return table


def fit(points: list[tuple[float, float]], at: float = WARMUP_HOLD) -> dict | None:
    """keel.experiments.stats.log_line_fit of the (hold, max LR) points; None with fewer than two holds or three
    points, or holds spanning less than MIN_HOLD_SPAN."""
    holds = sorted({h for h, _ in points})
    if len(holds) < 2 or len(points) < 3 or hold_span(points) < MIN_HOLD_SPAN:
        return None
    return log_line_fit(points, at) | {"holds": len(holds)}


def hold_span(points: list[tuple[float, float]]) -> float:
    """The longest hold over the shortest."""
    return max(h for h, _ in points) / min(h for h, _ in points)


def hold_fits(grids: dict[str, list[dict]]) -> list[dict]:
    """Per point, scheme and set of ramps: does the max LR depend on the hold, and where would a 5,000-step warm-up
    put it; where the holds span too little for a line, a row that says so."""
    table = []
    for point in HOLD_GRIDS:
        for scheme in HOLD_SCHEMES:
            for ramps in RAMP_SETS:
                points = limits(hold_points(grids, point, scheme, ramps))
                holds = len({h for h, _ in points})
                if (result := fit(points)) is not None:
                    table.append(fit_row(point, scheme, ramps, result))
                elif holds >= 2 and hold_span(points) < MIN_HOLD_SPAN:
                    table.append(
                        {
                            "blocks x width": f"{point[0]} x {point[1]}",
                            "scheme": scheme,
                            "ramps": ramps,
                            "seeds x ramps": f"{len(points)} ({holds} holds)",
                            "exponent [95%]": "-",
                            "limit depends on the hold": f"no line: the holds span {hold_span(points):.2f}x, "
                            f"under {MIN_HOLD_SPAN:g}x",
                        }
                    )
    return table


def fit_row(point: tuple[int, int], scheme: str, ramps: str, result: dict) -> dict:
    depends = not result["exponent low"] <= 0 <= result["exponent high"]
    return {
        "blocks x width": f"{point[0]} x {point[1]}",
        "scheme": scheme,
        "ramps": ramps,
        "seeds x ramps": f"{result['points']} ({result['holds']} holds)",
        "exponent [95%]": f"{result['exponent']:.2f} [{result['exponent low']:.2f}, {result['exponent high']:.2f}]",
        "limit depends on the hold": "yes" if depends else "not measurably",
        f"max LR at a {WARMUP_STEPS:,}-step warm-up (hold {WARMUP_HOLD:.0f}) [95%]": (
            f"{result['value']:.3g} [{result['value low']:.3g}, {result['value high']:.3g}]"
        ),
    }


def plot_hold_map(grids: dict[str, list[dict]], path: Path) -> None:
    """Max LR against the hold at the limit, a panel per point, a colour per scheme, a point per seed and ramp,
    and the fitted line out to the 5,000-step warm-up's hold."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(HOLD_GRIDS), figsize=(5.5 * len(HOLD_GRIDS), 4.2), squeeze=False)
    for ax, point in zip(axes[0], HOLD_GRIDS):
        for color, scheme in zip(("tab:blue", "tab:orange"), HOLD_SCHEMES):
            fitted = {ramps: limits(hold_points(grids, point, scheme, ramps)) for ramps in RAMP_SETS}
            if not fitted["every ramp"]:
                continue
            ax.plot(*zip(*fitted["every ramp"]), "o", color=color, alpha=0.6, label=scheme)
            for (ramps, points), style, marker in zip(fitted.items(), ("--", ":"), ("s", "D")):
                if (result := fit(points)) is None:
                    continue
                xs = np.geomspace(min(h for h, _ in points), WARMUP_HOLD, 20)
                ys = result["value"] * (xs / WARMUP_HOLD) ** result["exponent"]
                ax.plot(xs, ys, style, color=color, linewidth=1, label=f"{scheme}: the line through {ramps}")
                ax.errorbar(
                    [WARMUP_HOLD],
                    [result["value"]],
                    fmt=marker,
                    color=color,
                    yerr=[[result["value"] - result["value low"]], [result["value high"] - result["value"]]],
                )
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="steps between the max LR x and 4/3 x (hold)",
            ylabel="max tolerable LR",
            title=f"{point[0]} blocks x {point[1]}",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"The hold map: max LR against the ramp's hold at the limit (at a {WARMUP_STEPS:,}-step warm-up, "
        "95%: square, every ramp's fit; diamond, the linear ramps')",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
