"""Where a learning rate carries, read from complete runs (docs/lr-transfer.md): each sweep's optimum as the vertex
of a parabola in log LR through its best grid point and their neighbours (per seed, and through the seeds' mean
losses), how far it moves from width 64 to 256 under sp and under mup (the transfer grids, keel.experiments.grids),
the loss a width-256 model gives up when trained at width 64's optimum instead of its own, and the optimum against
depth at width 32 for Keel and Pre-LN (the trained models' grids)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from keel.artifacts import CONFIG, read_eval_history
from keel.experiments.records import MANIFEST, load_run_config
from keel.experiments.stats import MIN_SEEDS, fmt, fmt_median_range, median

# what a user wants of mup (issue #61): width 64's optimum within 1.5x of width 256's, and a width-256 model trained at
# it within 0.02 nat of its own best
MOVE_GOAL, GIVEN_UP_GOAL = 1.5, 0.02


@dataclass(frozen=True)
class SweepRun:
    scheme: str
    parametrization: str
    depth: int
    width: int
    steps: int  # trainer.max_steps: the optimum moves with the run's length, so depths compare at equal steps
    lr: float
    seed: int
    loss: float  # the final held-out loss: the last in-loop evaluation's, at the last step
    branch_base_depth: int | None = None  # model.branch_base_depth: Pre-LN's 1/L branch rule from that depth

    @property
    def rule(self) -> str:
        """The scheme, and its depth rule if any: what the depth table follows over the depths."""
        return (
            self.scheme if self.branch_base_depth is None else f"{self.scheme}, branches x {self.branch_base_depth}/N"
        )


# a report's sweeps: a key (the width and parametrization, or the grid) -> (its finished runs, every listed run's axes)
Sweeps = dict[object, tuple[list[SweepRun], list[dict]]]


def read_sweep(grid_dir: Path) -> tuple[list[SweepRun], list[dict]]:
    """A sweep's finished runs (their last in-loop evaluation at the last step) and the axes of every run its
    sweep.json lists."""
    if not (grid_dir / MANIFEST).is_file():
        return [], []
    listed = json.loads((grid_dir / MANIFEST).read_text())["runs"]
    runs = []
    for name in (entry["name"] for entry in listed):
        run_dir = grid_dir / name
        history = read_eval_history(run_dir) if (run_dir / CONFIG).is_file() else None
        if not history or not history["evaluations"]:
            continue
        cfg = load_run_config(run_dir)
        last = history["evaluations"][-1]
        if last["step"] == cfg.trainer.max_steps - 1:
            m = cfg.model
            loss = last["val_loss"]
            runs.append(
                SweepRun(
                    m.scheme,
                    m.parametrization,
                    m.depth,
                    m.width,
                    cfg.trainer.max_steps,
                    cfg.optim.lr,
                    cfg.run.seed,
                    loss,
                    m.branch_base_depth,
                )
            )
    return runs, [entry["axes"] for entry in listed]


@dataclass(frozen=True)
class Optimum:
    lr: float  # the parabola's vertex; at an edge of the sweep, that edge's LR
    loss: float  # the parabola's value there (at an edge: the loss measured there)
    edge: str = ""  # "lowest" / "highest": the best grid point is the sweep's lowest / highest LR, no vertex

    def cell(self) -> str:
        return f"{'<= ' if self.edge == 'lowest' else '>= ' if self.edge == 'highest' else ''}{fmt(self.lr)}"


def _parabola(points: list[tuple[float, float]]) -> np.ndarray:
    """Coefficients (a, b, c) of loss = a x^2 + b x + c, x = log2 LR, exactly through three points."""
    x = [math.log2(lr) for lr, _ in points]
    return np.polyfit(x, [loss for _, loss in points], 2)


def _around(points: list[tuple[float, float]], index: int) -> list[tuple[float, float]]:
    """The three consecutive grid points centred on index (shifted inward at an edge)."""
    start = min(max(index - 1, 0), len(points) - 3)
    return points[start : start + 3]


def optimum(points: list[tuple[float, float]]) -> Optimum | None:
    """The optimum of one sweep's (LR, loss) points (one loss per LR, at least three LRs): the vertex of the parabola
    in log2 LR through the best point and its two neighbours; at an edge of the sweep (or where those three points do
    not curve upward) the best grid point, marked. None with fewer than three LRs."""
    points = sorted(points)
    if len(points) < 3:
        return None
    best = min(range(len(points)), key=lambda i: points[i][1])
    if best in (0, len(points) - 1):
        return Optimum(*points[best], "lowest" if best == 0 else "highest")
    a, b, c = _parabola(points[best - 1 : best + 2])
    if a <= 0:
        return Optimum(*points[best])
    x = -b / (2 * a)
    return Optimum(2**x, float(a * x * x + b * x + c))


def loss_at(points: list[tuple[float, float]], lr: float) -> float | None:
    """One sweep's loss at lr, read off the parabola in log2 LR through the three grid points nearest it; None
    outside the sweep's LRs (no extrapolation)."""
    points = sorted(points)
    if len(points) < 3 or not points[0][0] <= lr <= points[-1][0]:
        return None
    nearest = min(range(len(points)), key=lambda i: abs(math.log2(points[i][0] / lr)))
    a, b, c = _parabola(_around(points, nearest))
    x = math.log2(lr)
    return float(a * x * x + b * x + c)


def by_seed(runs: list[SweepRun]) -> dict[int, list[tuple[float, float]]]:
    """seed -> its (LR, final loss) points."""
    seeds: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        seeds.setdefault(run.seed, []).append((run.lr, run.loss))
    return dict(sorted(seeds.items()))


def mean_curve(points: list[tuple[float, float]], seeds: int) -> list[tuple[float, float]]:
    """(LR, the mean final loss over the seeds) from (LR, final loss) points, one per run, at the LRs that have a
    point from every one of `seeds` seeds."""
    lrs: dict[float, list[float]] = {}
    for lr, loss in points:
        lrs.setdefault(lr, []).append(loss)
    return sorted((lr, statistics.mean(losses)) for lr, losses in lrs.items() if len(losses) == seeds)


def complete_seeds(runs: list[SweepRun]) -> list[int]:
    """The seeds with a finished run at every LR of the sweep: those its mean curve averages."""
    return [seed for seed, points in by_seed(runs).items() if len(points) == len({r.lr for r in runs})]


def sweep_row(label: str, runs: list[SweepRun], listed: int) -> tuple[dict, dict[int, Optimum | None], Optimum | None]:
    """A sweep's row of the report: its mean loss per LR, each seed's optimum and the optimum of the seeds' mean
    curve (the seeds complete at every LR)."""
    seeds = by_seed(runs)
    optima = {seed: optimum(points) for seed, points in seeds.items()}
    complete = complete_seeds(runs)
    finished = [(r.lr, r.loss) for r in runs if r.seed in complete]
    pooled = optimum(mean_curve(finished, len(complete))) if complete else None
    resolved = [o.lr for o in optima.values() if o is not None and not o.edge]
    row = {
        "sweep": label,
        "runs": f"{len(runs)} of {listed}",
        "mean final held-out loss per LR (seeds)": ", ".join(
            f"{fmt(lr)}: {loss:.3f}" for lr, loss in mean_curve([(r.lr, r.loss) for r in runs], len(seeds)) or []
        )
        or "-",
        "optimum per seed": ", ".join(f"s{seed}: {o.cell() if o else '-'}" for seed, o in optima.items()) or "-",
        "median [range] of the seeds' vertices": fmt_median_range(resolved),
        "optimum of the mean curve": f"{pooled.cell()} ({len(complete)} seed{'s' * (len(complete) != 1)})"
        if pooled
        else "-",
    }
    return row, optima, pooled


def loss_given_up(target: list[SweepRun], tuned_lr: float) -> list[dict]:
    """Per seed of the target sweep: its loss at tuned_lr (the parabola through its nearest grid points) minus its
    loss at its own optimum, in nats; the best grid point's loss stands in for an optimum at the sweep's edge."""
    rows = []
    for seed, points in by_seed(target).items():
        own = optimum(points)
        at = loss_at(points, tuned_lr)
        if own is not None and at is not None:
            rows.append({"seed": seed, "own optimum": own.cell(), "given up (nats)": at - own.loss})
    return rows


def width_transfer(sweeps: Sweeps, base: int, target: int) -> list[str]:
    """The report's width-transfer tables over the sweeps (width, parametrization) -> (runs, listed) present."""
    from keel.experiments.tables import markdown_table

    rows, pooled_optima, seed_optima = [], {}, {}
    for (width, parametrization), (runs, listed) in sorted(sweeps.items()):
        row, optima, pooled = sweep_row(f"width {width}, {parametrization}", runs, len(listed))
        rows.append(row)
        pooled_optima[width, parametrization] = pooled
        seed_optima[width, parametrization] = [o for o in optima.values() if o is not None and not o.edge]
    text = [markdown_table(rows), ""]
    verdicts = []
    for parametrization in ("sp", "mup"):
        tuned, own = pooled_optima.get((base, parametrization)), pooled_optima.get((target, parametrization))
        if tuned is None or (target, parametrization) not in sweeps:
            continue
        base_seeds = [o.lr for o in seed_optima[base, parametrization]]
        target_seeds = [o.lr for o in seed_optima[target, parametrization]]
        move = own.lr / tuned.lr if own is not None and not (own.edge or tuned.edge) else None
        given = loss_given_up(sweeps[target, parametrization][0], tuned.lr) if not tuned.edge else []
        losses = [r["given up (nats)"] for r in given]
        verdicts.append(
            {
                "parametrization": parametrization,
                f"optimum at {base} (mean curve)": tuned.cell(),
                f"optimum at {target} (mean curve)": own.cell() if own else "-",
                f"move {base} -> {target}": f"{fmt(move)}x" if move else "-",
                "move, seeds' vertices (median ratio [min-max])": _ratio_range(target_seeds, base_seeds),
                f"loss given up at {target}, trained at {base}'s optimum (nats, per seed)": ", ".join(
                    f"s{r['seed']}: {r['given up (nats)']:.4f}" for r in given
                )
                or "-",
                "median [range]": fmt_median_range(losses),
                f"goals (move within {MOVE_GOAL}x, given up <= {GIVEN_UP_GOAL} nat)": _against_goals(move, losses),
            }
        )
    if verdicts:
        text += [markdown_table(verdicts), ""]
    return text


def _against_goals(move: float | None, given_up: list[float]) -> str:
    """Whether the mean curves' move (up or down) and the seeds' median loss given up meet the goals; no verdict on
    fewer than MIN_SEEDS seeds."""
    if len(given_up) < MIN_SEEDS:
        return f"n = {len(given_up)}, no verdict"
    loss = median(given_up)
    return (
        f"move {'-' if move is None else 'met' if max(move, 1 / move) <= MOVE_GOAL else 'missed'}, "
        f"loss {'met' if loss <= GIVEN_UP_GOAL else 'missed'} "
        f"(within it in {sum(g <= GIVEN_UP_GOAL for g in given_up)} of {len(given_up)} seeds)"
    )


def _ratio_range(over: list[float], under: list[float]) -> str:
    if not over or not under:
        return "-"
    return f"{fmt(median(over) / median(under))} [{fmt(min(over) / max(under))}-{fmt(max(over) / min(under))}]"


def depth_transfer(runs_by_grid: Sweeps) -> list[str]:
    """The optimum against depth per scheme and run length over the depth grids present (sweeps of Keel and Pre-LN,
    and of Pre-LN under a depth rule: at its base depth it is plain Pre-LN, whose row of the same length stands for it
    there). Depths are set side by side only at equal steps: the optimum moves with the run's length."""
    from keel.experiments.tables import markdown_table

    rows, pooled = [], {}
    for grid, (runs, listed) in runs_by_grid.items():
        for rule in dict.fromkeys(r.rule for r in runs):
            mine = [r for r in runs if r.rule == rule]
            first = mine[0]
            of_scheme = sum(1 for axes in listed if axes.get("scheme", first.scheme) == first.scheme)
            label = f"{rule}, {first.depth} x {first.width}, {first.steps} steps ({grid})"
            row, _, best = sweep_row(label, mine, of_scheme)
            rows.append(row)
            pooled.setdefault((rule, first.steps), []).append((first.depth, best, len(complete_seeds(mine))))
    of_rule = {r.rule: r for runs, _ in runs_by_grid.values() for r in runs}
    for (rule, steps), points in pooled.items():
        base = of_rule[rule].branch_base_depth
        plain = {point[0]: point for point in pooled.get((of_rule[rule].scheme, steps), [])}
        if base in plain and base not in {point[0] for point in points}:
            points.append(plain[base])
        points.sort(key=lambda point: point[0])

    def at(depth: int, o: Optimum | None, seeds: int) -> str:  # a depth's optimum, its seed count where below 3
        few = f" ({seeds} seed{'s' * (seeds != 1)})" if o and seeds < MIN_SEEDS else ""
        return f"{depth}: {o.cell() if o else '-'}{few}"

    moves = [
        {
            "scheme": rule,
            "steps": steps,
            "optimum by depth (mean curve)": ", ".join(at(*point) for point in points),
            "shallowest / deepest": fmt(points[0][1].lr / points[-1][1].lr)
            + ("x (an edge: a bound)" if any(o.edge for _, o, _ in (points[0], points[-1])) else "x"),
        }
        for (rule, steps), points in sorted(pooled.items(), key=lambda item: (item[0][0], -item[0][1]))
        if len(points) >= 2 and points[0][1] is not None and points[-1][1] is not None
    ]
    return [markdown_table(rows), "", *([markdown_table(moves), ""] if moves else [])]


def sections(out: Path) -> list[str]:
    """The report's sections for the transfer grids and the depth grids present under out."""
    from keel.experiments.grids import GRIDS, TRANSFER_WIDTHS
    from keel.experiments.roles import DEPTH_GRIDS, DEPTH_RULE_GRIDS, SHORT_DEPTH_GRIDS, TRANSFER_GRIDS

    text = []
    sweeps = {}
    for grid in TRANSFER_GRIDS:
        runs, listed = read_sweep(out / grid)
        if runs:
            _, width = GRIDS[grid].point
            sweeps[width, grid.rsplit("-", 1)[1]] = (runs, listed)
    if sweeps:
        base, target = TRANSFER_WIDTHS
        blocks = GRIDS[TRANSFER_GRIDS[0]].point[0]
        text += [
            f"## LR transfer across width on complete runs: Keel, {blocks} blocks, sp and mup (base width {base})",
            "",
            "Optima: the vertex of the parabola in log2 LR through the best grid point and its two neighbours ('<=' "
            "/ '>=': the best point is the sweep's edge); the mean curve averages the seeds finished at every LR. "
            f"Loss given up: each width-{target} seed's loss at width {base}'s optimum (its parabola through the "
            "nearest grid points) minus its loss at its own optimum.",
            "",
            *width_transfer(sweeps, base, target),
        ]
    depth = {grid: read_sweep(out / grid) for grid in (*DEPTH_GRIDS, *SHORT_DEPTH_GRIDS, *DEPTH_RULE_GRIDS)}
    depth = {grid: found for grid, found in depth.items() if found[0]}
    if depth:
        text += ["## The LR optimum against depth, complete runs", "", *depth_transfer(depth)]
    return text
