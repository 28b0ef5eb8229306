"""The paper's claims about trained models, for `keel paper-report`: complete runs (warm-up, then cosine to the end)
of Keel and Pre-LN over seeds, each a `keel sweep` grid under the report's directory, judged from the records each
run leaves (config.yaml, stability.json, eval_history.json; never TensorBoard's events) and, for layer use, the
redundancy.csv `keel redundancy` wrote over a grid's final checkpoints (<grid>/redundancy/).

    Table 2      lr-d16, lr-d64: per scheme and peak LR, the final held-out loss and task scores; monotone in LR?
    Section 9    the same runs: each task's score against held-out loss along training (every in-loop evaluation),
                 Keel minus Pre-LN at common loss levels, each run's score interpolated along its own trajectory
    Section 8    the loss increase when one block is removed (first, middle, last), from <grid>/redundancy/; Keel
                 against Pre-LN seed by seed; the profile the claim is about: each run's shallow / deep removal
                 cost, per scheme and Keel against Pre-LN (section8_profile: the verdicts, for a Summary)
    Table 3      tuned-depth-d16, lr-d64, tuned-depth-d256 (width 32): each scheme at its own best LR (lowest mean
                 final held-out loss) of its sweep; the Keel - Pre-LN gap at those LRs against depth, over the
                 depths whose sweeps have VERDICT_SEEDS finished seeds in every cell

A run counts once its last evaluation is at its last step (the grids evaluate there); a cell is the mean, the sample
sd, [min, max] and n over the seeds; "seeds apart" means the two schemes' seed ranges do not overlap.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path

from keel.artifacts import CONFIG, read_eval_history, read_stability
from keel.experiments.plots import pyplot, save_figure
from keel.experiments.records import (
    LAYER_PROFILE_PLOT,
    LAYER_USE_PLOT,
    LOSS_VS_TASKS_PLOT,
    MANIFEST,
    REDUNDANCY,
    checkpoint_run,
    load_run_config,
    read_redundancy_rows,
    read_time_record,
)
from keel.experiments.roles import DEPTH_GRIDS, LR_GRIDS, TUNED_GRIDS
from keel.experiments.stats import MIN_SEEDS, Paired, apart, direction, fmt, fmt_sd, paired, sign_test, spread
from keel.experiments.tables import markdown_table

PAIR = ("keel", "preln")
LOSS = "held-out loss"
LEVELS = 3  # held-out-loss levels compared, spread evenly over the range every run of an LR passes through
VERDICT_SEEDS = 3  # a depth joins Table 3's trend once every cell of its sweep has this many finished seeds
# The metrics reported of the generated tasks (the task's name, then the metric), with their chance level: next-line
# picks among 4 choices; last-token must decode an identifier exactly (open vocabulary: ~0). Other tasks: the
# primary metric eval_history.json names, chance not stated.
CHANCE = {
    "keel_next_line acc_mutual_info": 0.25,
    "keel_next_line acc": 0.25,
    "keel_next_line acc_norm": 0.25,
    "keel_last_token acc": 0.0,
}


@dataclass
class TrainedRun:
    name: str
    scheme: str
    depth: int
    width: int
    lr: float
    seed: int  # run.seed: the two schemes' runs of a seed are compared with each other
    init: str
    failed: bool  # the stability monitor's verdict (stability.json): a failure it recorded, stopped or not
    evaluations: list[dict[str, float]]  # per in-loop evaluation: LOSS and each metric -> value
    cpu_s: float | None  # its CPU seconds over its sessions (SWEEP_TIME), None where it was not timed

    @property
    def final(self) -> dict[str, float]:
        return self.evaluations[-1]


@dataclass
class TrainedGrid:
    runs: list[TrainedRun]  # the finished ones
    listed: int  # runs in its sweep.json


def _metrics(history: dict) -> list[str]:
    """The metrics reported of a run's tasks: those CHANCE names for a known task, else the task's primary one."""
    names = []
    for task, info in history["tasks"].items():
        known = [label.split(" ", 1)[1] for label in CHANCE if label.split(" ", 1)[0] == task]
        names += [f"{task} {metric}" for metric in known or [info["metric"]]]
    return names


def read_run(run_dir: Path) -> TrainedRun | None:
    """A run from its records, or None until its last in-loop evaluation is at its last step."""
    history = read_eval_history(run_dir) if (run_dir / CONFIG).is_file() else None
    if not history or not history["evaluations"]:
        return None
    cfg = load_run_config(run_dir)
    if history["evaluations"][-1]["step"] != cfg.trainer.max_steps - 1:
        return None
    metrics = _metrics(history)
    evaluations = []
    for entry in history["evaluations"]:
        scores = {
            f"{task} {metric}": value for task, values in entry["scores"].items() for metric, value in values.items()
        }
        evaluations.append({LOSS: entry["val_loss"], **{m: scores[m] for m in metrics if m in scores}})
    stability = read_stability(run_dir) or {}
    cpu_s = record["cpu_s"] if (record := read_time_record(run_dir)) is not None else None
    return TrainedRun(
        run_dir.name,
        cfg.model.scheme,
        cfg.model.depth,
        cfg.model.width,
        cfg.optim.lr,
        cfg.run.seed,
        cfg.model.init_kind,
        bool(stability.get("failed")),
        evaluations,
        cpu_s,
    )


def cpu_hours(runs: list[TrainedRun]) -> str:
    """The CPU-hours of the timed runs, and how many of them there are."""
    timed = [run.cpu_s for run in runs if run.cpu_s is not None]
    return f"{sum(timed) / 3600:.1f} CPU-hours over the {len(timed)} timed" if timed else "none timed"


def load_trained(out: Path) -> tuple[dict[str, TrainedGrid], list[str]]:
    """The trained-model grids under out with a finished run, and the others (not run, or how far they are)."""
    grids, missing = {}, []
    for name in (*LR_GRIDS, *TUNED_GRIDS):
        if not (out / name / MANIFEST).is_file():
            missing.append(name)
            continue
        listed = [entry["name"] for entry in json.loads((out / name / MANIFEST).read_text())["runs"]]
        runs = [run for run_name in listed if (run := read_run(out / name / run_name)) is not None]
        if runs:
            grids[name] = TrainedGrid(runs, len(listed))
        else:
            missing.append(f"{name} (0 of {len(listed)} runs finished)")
    return grids, missing


def _sizes(runs: list[TrainedRun]) -> str:
    return ", ".join(dict.fromkeys(f"{r.depth} blocks x {r.width}" for r in runs))


def _inits(runs: list[TrainedRun]) -> str:
    return ", ".join(dict.fromkeys(r.init for r in runs))


def _schemes(runs: list[TrainedRun]) -> list[str]:
    return list(dict.fromkeys(r.scheme for r in runs))


def _cell_runs(runs: list[TrainedRun], scheme: str, lr: float) -> list[TrainedRun]:
    return [r for r in runs if r.scheme == scheme and r.lr == lr]


def _values(runs: list[TrainedRun], metric: str) -> list[float]:
    return [r.final[metric] for r in runs if metric in r.final]


def _columns(runs: list[TrainedRun]) -> list[str]:
    return list(dict.fromkeys(m for r in runs for m in r.final))  # LOSS first, then the metrics


def _lrs(runs: list[TrainedRun], scheme: str | None = None) -> list[float]:
    return sorted({r.lr for r in runs if scheme is None or r.scheme == scheme})


# ---------------------------------------------------------------------------------------- Table 2: LR sweep


def means_by_lr(runs: list[TrainedRun], scheme: str) -> dict[str, list[float]]:
    """Per metric (LOSS first), the scheme's mean final value at each of its peak LRs, in LR order."""
    means = {m: [] for m in _columns(runs)}
    for lr in _lrs(runs, scheme):
        for metric in means:
            if values := _values(_cell_runs(runs, scheme, lr), metric):
                means[metric].append(statistics.mean(values))
    return means


def lr_table(runs: list[TrainedRun]) -> tuple[list[dict], list[dict]]:
    """Per scheme and peak LR: the final held-out loss and scores over the seeds; then per scheme and metric
    whether the means are monotone in LR, with the means in LR order."""
    columns, table, verdicts = _columns(runs), [], []
    for scheme in _schemes(runs):
        for lr in _lrs(runs, scheme):
            cell = _cell_runs(runs, scheme, lr)
            entry = {
                "scheme": scheme,
                "init": _inits(cell),
                "peak LR": fmt(lr),
                "stability failures": f"{sum(r.failed for r in cell)}/{len(cell)}",
            }
            for metric in columns:
                entry[metric] = spread(_values(cell, metric))
            table.append(entry)
        verdicts.append(
            {"scheme": scheme}
            | {m: f"{direction(v)}: {', '.join(map(fmt, v))}" for m, v in means_by_lr(runs, scheme).items()}
        )
    return table, verdicts


# ------------------------------------------------------------------------------ Section 9: loss against tasks


def score_at(run: TrainedRun, metric: str, level: float) -> float | None:
    """The metric where the run's held-out loss first reaches level along its evaluations, interpolated linearly
    in the loss between the two evaluations around it; None if it never does."""
    for a, b in pairwise(run.evaluations):
        if metric in a and metric in b and min(a[LOSS], b[LOSS]) <= level <= max(a[LOSS], b[LOSS]):
            if a[LOSS] == b[LOSS]:
                return a[metric]
            return a[metric] + (b[metric] - a[metric]) * (level - a[LOSS]) / (b[LOSS] - a[LOSS])
    return None


def loss_levels(runs: list[TrainedRun]) -> list[float]:
    """LEVELS losses, highest first, spread over the range every run passes through (none if there is none)."""
    high = min(max(e[LOSS] for e in r.evaluations) for r in runs)
    low = max(min(e[LOSS] for e in r.evaluations) for r in runs)
    return [high + (low - high) * i / (LEVELS - 1) for i in range(LEVELS)] if low <= high else []


def _matched_lrs(runs: list[TrainedRun]) -> list[float]:
    """The peak LRs both schemes of PAIR ran."""
    return sorted(set(_lrs(runs, PAIR[0])) & set(_lrs(runs, PAIR[1])))


def chance(metric: str) -> str:
    return "-" if metric not in CHANCE else "~0" if CHANCE[metric] == 0 else fmt(CHANCE[metric])


def matched_levels(runs: list[TrainedRun]) -> dict[float, list[float]]:
    """Per peak LR both schemes of PAIR ran, the held-out-loss levels every run of that LR passes through."""
    return {lr: loss_levels([r for r in runs if r.lr == lr and r.scheme in PAIR]) for lr in _matched_lrs(runs)}


def scores_at_level(runs: list[TrainedRun], metric: str, lr: float, level: float) -> list[list[float]]:
    """Each scheme of PAIR's scores (a list per scheme, its seeds in run order) where its runs of the LR reach the
    held-out-loss level."""
    return [[v for r in _cell_runs(runs, s, lr) if (v := score_at(r, metric, level)) is not None] for s in PAIR]


def matched_gaps(runs: list[TrainedRun]) -> list[dict]:
    """Per metric and peak LR both schemes ran, at each common held-out-loss level (highest first): Keel's mean score
    there minus Pre-LN's, each scheme's sample sd over its seeds, and whether the seed ranges are apart."""
    table = []
    levels = matched_levels(runs)
    for metric in _columns(runs)[1:]:
        for lr in levels:
            entry = {
                "metric": metric,
                "chance": chance(metric),
                "peak LR": fmt(lr),
                f"{LOSS} levels": ", ".join(map(fmt, levels[lr])),
            }
            for i, level in enumerate(levels[lr], 1):
                at = scores_at_level(runs, metric, lr, level)
                gap = statistics.mean(at[0]) - statistics.mean(at[1]) if all(at) else None
                entry[f"level {i}: {PAIR[0]} - {PAIR[1]} (sd {PAIR[0]} / {PAIR[1]}; seeds apart)"] = (
                    f"{fmt(gap)} ({fmt_sd(at[0])} / {fmt_sd(at[1])}; {apart(*at)})"
                )
            table.append(entry)
    return table


def plot_loss_vs_tasks(runs: list[TrainedRun], path: Path, title: str) -> None:
    """Each metric against held-out loss along training: a row of panels per peak LR both schemes ran, a line per
    run (Keel blue, Pre-LN orange), the chance level dotted."""
    lrs = _matched_lrs(runs)
    metrics = _columns(runs)[1:]
    plt = pyplot()
    fig, axes = plt.subplots(len(lrs), len(metrics), figsize=(3.2 * len(metrics), 2.6 * len(lrs)), squeeze=False)
    for row, lr in zip(axes, lrs):
        for ax, metric in zip(row, metrics):
            for scheme, color in zip(PAIR, ("tab:blue", "tab:orange")):
                for i, r in enumerate(_cell_runs(runs, scheme, lr)):
                    points = [(e[LOSS], e[metric]) for e in r.evaluations if metric in e]
                    ax.plot(
                        *zip(*points),
                        "o-",
                        color=color,
                        markersize=2,
                        linewidth=1,
                        alpha=0.7,
                        label=scheme if i == 0 else None,
                    )
            if metric in CHANCE:
                ax.axhline(CHANCE[metric], color="grey", linestyle=":", linewidth=1)
            ax.set(xlabel=f"{LOSS} (LR {fmt(lr)})", ylabel=metric)
            ax.invert_xaxis()  # training runs left to right
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, title, path, dpi=100)


# ------------------------------------------------------------------------------------ Section 8: layer use
#
# The paper's claim, as the review states it: beyond the first block, removing one of Pre-LN's shallow blocks costs
# less than removing a deep one, while Keel's blocks are used more uniformly. The profile compares the interior
# blocks' shallow half with their deep half: block 0 is catastrophic to remove for every scheme (and Keel's is a
# plain Pre-LN block), and Keel's last block ends in the norm the head reads (Keel has no separate final norm), so
# their removal measures where a norm sits, not how much a block is used; both are reported apart.


def read_redundancy(path: Path, runs: list[TrainedRun]) -> tuple[dict[str, list[float]], int]:
    """Per finished run, the loss increase of each removed block (block order), from a redundancy.csv over the
    grid's checkpoints (each <grid>/<run>/checkpoints/<file>); and how many checkpoints it has of no finished run."""
    names = {r.name for r in runs}
    increases: dict[str, dict[int, float]] = {}
    for row in read_redundancy_rows(path):
        increases.setdefault(checkpoint_run(row["path"]), {})[row["block"]] = row["loss_increase"]
    known = {name: [blocks[b] for b in sorted(blocks)] for name, blocks in increases.items() if name in names}
    return known, len(increases) - len(known)


def _middle(increases: list[float]) -> float:
    """The mean loss increase of removing one of the blocks between the first and the last."""
    return statistics.mean(increases[1:-1])


HALVES, THIRDS = 2, 3  # the profile compares the interior's first and last half; the thirds check the split


def _span(depth: int, parts: int) -> int:
    """How many interior blocks (1 to depth - 2) each of the shallow and the deep part has: 1 / parts of them
    (halves: all of them, the middle one of an odd count in neither)."""
    return (depth - 2) // parts


def shallow_deep(increases: list[float], parts: int = HALVES) -> tuple[float, float]:
    """The mean loss increase of removing one block of the interior's shallow part (blocks 1 to span) and of its
    deep part (depth - 1 - span to depth - 2)."""
    span = _span(len(increases), parts)
    return statistics.mean(increases[1 : 1 + span]), statistics.mean(increases[-1 - span : -1])


def profile_ratio(increases: list[float], parts: int = HALVES) -> float | None:
    """shallow / deep (below 1: the shallow blocks cost less to remove, are the more redundant); None where either
    part's mean is not positive (a model whose blocks cost nothing has no profile to compare)."""
    shallow, deep = shallow_deep(increases, parts)
    return shallow / deep if shallow > 0 and deep > 0 else None


def _parts(depth: int, parts: int = HALVES) -> tuple[str, str]:
    span = _span(depth, parts)
    return f"shallow blocks (1-{span})", f"deep blocks ({depth - 1 - span}-{depth - 2})"


def _by_seed(
    cell: list[TrainedRun], increases: dict[str, list[float]], measure: Callable[[list[float]], float | None]
) -> dict[int, float | None]:
    """seed -> the measure of its run's loss increases, over the runs of a cell that have rows."""
    return {r.seed: measure(increases[r.name]) for r in cell if r.name in increases}


def _positive(value: float) -> float | None:
    return value if value > 0 else None  # a ratio of costs needs both positive


def _of_seeds(ratios: dict[int, float | None]) -> Paired:
    """The seeds' ratios (those that have one) against 1: a scheme's shallow / deep alone."""
    return Paired(tuple(v for _, v in sorted(ratios.items()) if v is not None))


def _per_seed(values: dict[int, float | None]) -> str:
    return ", ".join(f"s{seed}: {fmt(v)}" for seed, v in sorted(values.items()))


def _tests(comparison: Paired) -> dict[str, str]:
    cells = comparison.cells()
    return {key: cells[key] for key in ("sign p", "signed-rank p", "t p (log ratio)")}


def layer_use(runs: list[TrainedRun], increases: dict[str, list[float]]) -> list[dict]:
    """Per scheme and peak LR, over the seeds: the loss increase when the first block is removed, the mean over the
    middle blocks (each seed's mean), and the last block."""
    table = []
    for scheme in _schemes(runs):
        for lr in _lrs(runs, scheme):
            cell = [r for r in _cell_runs(runs, scheme, lr) if r.name in increases]
            seeds = [increases[r.name] for r in cell]
            if seeds:
                depth = cell[0].depth
                table.append(
                    {
                        "scheme": scheme,
                        "peak LR": fmt(lr),
                        "first block (0)": spread([s[0] for s in seeds]),
                        f"middle blocks (1-{depth - 2}), mean": spread([_middle(s) for s in seeds]),
                        f"last block ({depth - 1})": spread([s[-1] for s in seeds]),
                    }
                )
    return table


def middle_costs(runs: list[TrainedRun], increases: dict[str, list[float]]) -> dict[float, tuple[dict, dict]]:
    """Per peak LR both schemes ran and have rows for: each scheme's mean middle-block cost by seed."""
    costs = {}
    for lr in _matched_lrs(runs):
        middle = tuple(
            {k: _positive(v) for k, v in _by_seed(_cell_runs(runs, s, lr), increases, _middle).items()} for s in PAIR
        )
        if all(middle):
            costs[lr] = middle
    return costs


def middle_comparisons(runs: list[TrainedRun], increases: dict[str, list[float]]) -> dict[float, Paired]:
    """Per peak LR both schemes ran and have rows for: Keel's mean middle-block cost over Pre-LN's, seed by seed
    (same seed, same LR)."""
    return {lr: paired(*costs) for lr, costs in middle_costs(runs, increases).items()}


def middle_pairs(runs: list[TrainedRun], increases: dict[str, list[float]]) -> list[dict]:
    """middle_comparisons as a table, with the paired tests; no verdict below MIN_SEEDS paired seeds."""
    table = []
    for lr, comparison in middle_comparisons(runs, increases).items():
        table.append(
            {
                "peak LR": fmt(lr),
                "seeds paired": str(comparison.n),
                f"{PAIR[0]} / {PAIR[1]} per seed": comparison.cells()["a / b per seed"],
                "median": comparison.cells()["median ratio"],
                f"{PAIR[0]}'s middle blocks cost": comparison.verdict,
                **_tests(comparison),
            }
        )
    return table


def layer_profile(runs: list[TrainedRun], increases: dict[str, list[float]]) -> list[dict]:
    """Per scheme and peak LR: the shallow and the deep half's mean removal cost over the seeds, each seed's
    shallow / deep, and whether the shallow blocks cost less (the tests of the log ratios against 0)."""
    table = []
    for scheme in _schemes(runs):
        for lr in _lrs(runs, scheme):
            cell = [r for r in _cell_runs(runs, scheme, lr) if r.name in increases]
            if not cell:
                continue
            parts = [shallow_deep(increases[r.name]) for r in cell]
            ratios = _by_seed(cell, increases, profile_ratio)
            comparison = _of_seeds(ratios)
            shallow, deep = _parts(cell[0].depth)
            table.append(
                {
                    "scheme": scheme,
                    "peak LR": fmt(lr),
                    f"{shallow}, mean": spread([s for s, _ in parts]),
                    f"{deep}, mean": spread([d for _, d in parts]),
                    "shallow / deep per seed": _per_seed(ratios),
                    "median": fmt(comparison.median_ratio) if comparison.n else "-",
                    "shallow cost vs deep": comparison.verdict,
                    **_tests(comparison),
                }
            )
    return table


PAPER, REVERSE, NEITHER = "the paper's direction", "the reverse", "neither"


def profile_pairs(runs: list[TrainedRun], increases: dict[str, list[float]], parts: int = HALVES) -> list[dict]:
    """Per peak LR both schemes ran, Section 8's verdict: Pre-LN's shallow / deep over its seeds, and Keel's
    shallow / deep over Pre-LN's seed by seed (above 1: Keel's shallow blocks the more used, relative to its deep
    ones), with how many paired seeds have Keel's profile the flatter (|log shallow / deep| the smaller). The
    paper's direction: Pre-LN's shallow blocks cost less in every seed and Keel's ratio is the higher in every
    paired seed; the reverse: both the other way in every seed; no verdict below MIN_SEEDS seeds in either."""
    table = []
    for lr in _matched_lrs(runs):
        ratios = [_by_seed(_cell_runs(runs, s, lr), increases, partial(profile_ratio, parts=parts)) for s in PAIR]
        if not all(ratios):
            continue
        own = _of_seeds(ratios[1])
        comparison = paired(*ratios)
        both = sorted(seed for seed in ratios[0].keys() & ratios[1].keys() if ratios[0][seed] and ratios[1][seed])
        flatter = sum(abs(math.log(ratios[0][seed])) < abs(math.log(ratios[1][seed])) for seed in both)
        if min(own.n, comparison.n) < MIN_SEEDS:
            verdict = f"n = {min(own.n, comparison.n)}, no verdict"
        elif own.lower == own.n and comparison.higher == comparison.n:
            verdict = PAPER
        elif own.higher == own.n and comparison.lower == comparison.n:
            verdict = REVERSE
        else:
            verdict = NEITHER
        table.append(
            {
                "peak LR": fmt(lr),
                f"{PAIR[1]}'s shallow cost vs deep": own.verdict,
                "seeds paired": str(comparison.n),
                f"{PAIR[0]} / {PAIR[1]} of shallow / deep per seed": comparison.cells()["a / b per seed"],
                "median": comparison.cells()["median ratio"],
                f"{PAIR[0]}'s is": comparison.verdict,
                **_tests(comparison),
                f"{PAIR[0]} flatter": f"{flatter} of {len(both)}",
                "verdict": verdict,
            }
        )
    return table


def profile_verdict(pairs: list[dict]) -> str:
    """The LRs of each verdict in a grid's profile_pairs, in words."""
    by = {}
    for row in pairs:
        by.setdefault(row["verdict"], []).append(row["peak LR"])
    return "; ".join(f"{verdict} at LR {', '.join(lrs)}" for verdict, lrs in by.items()) or "no LR both schemes ran"


def plot_layer_use(runs: list[TrainedRun], increases: dict[str, list[float]], path: Path, title: str) -> None:
    """The loss increase per removed block, the seeds' mean and [min, max], a panel per peak LR."""
    lrs = _lrs([r for r in runs if r.name in increases])
    plt = pyplot()
    fig, axes = plt.subplots(1, len(lrs), figsize=(4 * len(lrs), 3.4), squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for scheme in _schemes(runs):
            seeds = [increases[r.name] for r in _cell_runs(runs, scheme, lr) if r.name in increases]
            if seeds:
                blocks = range(len(seeds[0]))
                (line,) = ax.plot(blocks, [statistics.mean(v) for v in zip(*seeds)], label=scheme)
                ax.fill_between(
                    blocks,
                    [min(v) for v in zip(*seeds)],
                    [max(v) for v in zip(*seeds)],
                    color=line.get_color(),
                    alpha=0.2,
                )
        ax.set(xlabel=f"removed block (LR {fmt(lr)})", ylabel="held-out loss increase")
        ax.set_yscale("symlog", linthresh=1e-2)  # block 0 can cost far more than a middle one; some removals help
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, title, path, dpi=100)


def plot_layer_profile(runs: list[TrainedRun], increases: dict[str, list[float]], path: Path, title: str) -> None:
    """Each run's shallow / deep against the peak LR (log-log), a colour per scheme, the seeds' median joined; 1
    (the shallow and deep halves alike) dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for scheme in _schemes(runs):
        points = [
            (r.lr, v)
            for r in runs
            if r.scheme == scheme and r.name in increases
            if (v := profile_ratio(increases[r.name]))
        ]
        if not points:
            continue
        lrs = sorted({lr for lr, _ in points})
        (line,) = ax.plot(lrs, [statistics.median(v for x, v in points if x == lr) for lr in lrs], "-", label=scheme)
        ax.plot(*zip(*points), "o", color=line.get_color(), markersize=3, alpha=0.6)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set(xscale="log", yscale="log", xlabel="peak LR", ylabel="shallow / deep removal cost (per run)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, title, path, dpi=100)


# ---------------------------------------------------------------------------------- Table 3: tuned depth


def _mean_loss(runs: list[TrainedRun], scheme: str, lr: float) -> float:
    return statistics.mean(_values(_cell_runs(runs, scheme, lr), LOSS))


def best_lr(runs: list[TrainedRun], scheme: str) -> float | None:
    """The peak LR with the lowest mean final held-out loss over the seeds (the lower LR on a tie)."""
    lrs = _lrs(runs, scheme)
    return min(lrs, key=lambda lr: _mean_loss(runs, scheme, lr)) if lrs else None


def sweep_complete(runs: list[TrainedRun]) -> bool:
    """Both schemes at every LR either ran, each cell with VERDICT_SEEDS finished seeds or more: until then a best
    LR may move and one seed's gap is no verdict."""
    return all(len(_cell_runs(runs, scheme, lr)) >= VERDICT_SEEDS for scheme in PAIR for lr in _lrs(runs))


def tuned_depth(grids: dict[str, list[TrainedRun]]) -> tuple[list[dict], list[dict], list[dict]]:
    """Per depth: each scheme's mean final loss per LR and its best; at the best LRs, per metric, both schemes over
    the seeds and the gap; then per metric the gaps against depth and how their size moves, over the depths whose
    sweeps are complete."""
    sweeps, gaps, moves = [], [], {}
    for grid, runs in grids.items():
        depth = runs[0].depth
        best = {scheme: best_lr(runs, scheme) for scheme in PAIR}
        for scheme in PAIR:
            if not (lrs := _lrs(runs, scheme)):
                continue
            at_best = _cell_runs(runs, scheme, best[scheme])
            sweeps.append(
                {
                    "blocks": depth,
                    "grid": grid,
                    "scheme": scheme,
                    "init": _inits([r for r in runs if r.scheme == scheme]),
                    "mean final held-out loss per LR": ", ".join(
                        f"{fmt(lr)}: {fmt(_mean_loss(runs, scheme, lr))}" for lr in lrs
                    ),
                    "best LR": fmt(best[scheme]),
                    "best at the sweep's edge": "yes" if best[scheme] in (lrs[0], lrs[-1]) else "no",
                    "stability failures at it": f"{sum(r.failed for r in at_best)}/{len(at_best)}",
                }
            )
        if None in best.values():
            continue
        complete = sweep_complete(runs)
        for metric in _columns(runs):
            values = {s: _values(_cell_runs(runs, s, best[s]), metric) for s in PAIR}
            gap = statistics.mean(values[PAIR[0]]) - statistics.mean(values[PAIR[1]]) if all(values.values()) else None
            if gap is not None and complete:
                moves.setdefault(metric, []).append((depth, gap))
            gaps.append(
                {
                    "blocks": depth,
                    "metric": metric,
                    "chance": chance(metric) if metric != LOSS else "",
                    f"{PAIR[0]} LR": fmt(best[PAIR[0]]),
                    PAIR[0]: spread(values[PAIR[0]]),
                    f"{PAIR[1]} LR": fmt(best[PAIR[1]]),
                    PAIR[1]: spread(values[PAIR[1]]),
                    f"{PAIR[0]} - {PAIR[1]}": fmt(gap),
                    "seeds apart": apart(*values.values()),
                }
            )
    trend = []
    for metric, points in moves.items():
        points.sort()
        sizes = [abs(gap) for _, gap in points]
        one_sign = len({gap > 0 for _, gap in points}) == 1
        verdict = direction(sizes) if one_sign else "the sign changes"
        trend.append(
            {
                "metric": metric,
                "gap by depth": ", ".join(f"{d}: {fmt(g)}" for d, g in points),
                "its size with depth": {"rises": "grows", "falls": "shrinks"}.get(verdict, verdict),
            }
        )
    return sweeps, gaps, trend


# ---------------------------------------------------------------------------------------------- the report


PAIRED_NOTE = (
    f"Seed by seed: {PAIR[0]}'s run of a seed against {PAIR[1]}'s of the same seed at the same LR; the tests, "
    "two-sided, of the per-seed log ratios against 0: the sign test, Wilcoxon's exact signed-rank test, the "
    f"one-sample t-test; no verdict below {MIN_SEEDS} paired seeds. With {MIN_SEEDS} seeds the sign and the "
    f"signed-rank test cannot give a two-sided p below {fmt(sign_test(MIN_SEEDS, 0))}: a verdict counts seeds, "
    "it does not claim significance."
)


def _profile_split(depth: int) -> str:
    shallow, deep = _parts(depth)
    return (
        f"the interior blocks' halves, {shallow} against {deep}; block 0 (catastrophic to remove for every "
        f"scheme) and the last block ({depth - 1}; Keel's ends in the norm the head reads) apart"
    )


def section8_profile(out: Path, grids: dict[str, TrainedGrid]) -> list[dict]:
    """Section 8's verdict per LR grid that has redundancy rows (for a Summary): its size, the runs, the split,
    the verdict at each LR both schemes ran (profile_verdict), the same with the interior's thirds, and the seeds
    paired at each."""
    rows = []
    for grid in LR_GRIDS:
        if grid not in grids or not (out / grid / REDUNDANCY).is_file():
            continue
        runs = grids[grid].runs
        increases, _ = read_redundancy(out / grid / REDUNDANCY, runs)
        if pairs := profile_pairs(runs, increases):
            rows.append(
                {
                    "grid": grid,
                    "size": _sizes(runs),
                    "runs": f"complete runs, final checkpoints, {PAIR[0]} and {PAIR[1]} each from its own init",
                    "split": _profile_split(runs[0].depth),
                    "verdict": profile_verdict(pairs),
                    "verdict, thirds": profile_verdict(profile_pairs(runs, increases, THIRDS)),
                    "seeds paired per LR": ", ".join(f"{r['peak LR']}: {r['seeds paired']}" for r in pairs),
                }
            )
    return rows


def _section8_comparisons(out: Path, grid: str, runs: list[TrainedRun], increases: dict[str, list[float]]) -> list[str]:
    """Section 8's seed-by-seed comparisons of a grid: the middle blocks' cost, then the shallow-versus-deep profile
    with its verdict and figure (written under out)."""
    depth = runs[0].depth
    text = []
    if middle := middle_pairs(runs, increases):
        text += [
            f"The middle blocks' mean cost, {PAIR[0]} / {PAIR[1]}. {PAIRED_NOTE}",
            "",
            markdown_table(middle),
            "",
        ]
    if profile := layer_profile(runs, increases):
        figure = LAYER_PROFILE_PLOT.format(grid=grid)
        plot_layer_profile(runs, increases, out / figure, f"Shallow / deep removal cost per run ({grid})")
        text += [
            f"### Section 8's profile at {_sizes(runs)} ({grid}): shallow against deep",
            "",
            f"Per run, the mean loss increase of removing one block of the shallow part over the deep part: "
            f"{_profile_split(depth)}. Below 1: the shallow blocks cost less to remove (are the more redundant). "
            "A run whose part costs nothing on average has no ratio (-). Per scheme, the tests are of its seeds' "
            "log ratios against 0.",
            "",
            markdown_table(profile),
            "",
        ]
    if pairs := profile_pairs(runs, increases):
        text += [
            f"{PAIR[0]}'s shallow / deep over {PAIR[1]}'s (above 1: {PAIR[0]}'s shallow blocks the more used, "
            f"relative to its deep ones). {PAIRED_NOTE} {PAIR[0]} flatter: paired seeds whose |log shallow / deep| "
            f"is {PAIR[0]}'s the smaller. The paper's direction: {PAIR[1]}'s shallow blocks cost less in every seed "
            f"and {PAIR[0]}'s ratio is the higher in every paired seed; the reverse: both the other way.",
            "",
            markdown_table(pairs),
            "",
            f"**Section 8's profile at {_sizes(runs)} ({grid}): {profile_verdict(pairs)}.**",
            "",
            "The split checked: with the interior's first and last third instead ({} against {}): {}.".format(
                *_parts(depth, THIRDS), profile_verdict(profile_pairs(runs, increases, THIRDS))
            ),
            "",
        ]
    if profile:
        text += [f"![shallow / deep removal cost per run, {grid}]({LAYER_PROFILE_PLOT.format(grid=grid)})", ""]
    return text


def sections(out: Path, grids: dict[str, TrainedGrid]) -> list[str]:
    """The report's sections for the grids present (plots written under out)."""
    text = []
    note = (
        "Cells: mean ± sample sd [min, max] n=seeds, of finished runs only (last in-loop evaluation at the last "
        "step); the final held-out loss is that evaluation's. Seeds apart: the two schemes' seed ranges do not "
        "overlap. Stability failures: runs whose stability.json records one (they trained on)."
    )
    for grid in LR_GRIDS:
        if grid not in grids:
            continue
        runs, listed = grids[grid].runs, grids[grid].listed
        size = _sizes(runs)
        table, verdicts = lr_table(runs)
        text += [
            f"## Table 2, the LR sweep at {size} ({grid}; {len(runs)} of {listed} runs finished, {cpu_hours(runs)})",
            "",
            note,
            "",
            markdown_table(table),
            "",
            "Monotone in LR? (the means, in LR order)",
            "",
            markdown_table(verdicts),
            "",
        ]
        if gaps := matched_gaps(runs):
            figure = LOSS_VS_TASKS_PLOT.format(grid=grid)
            plot_loss_vs_tasks(runs, out / figure, f"Task scores against held-out loss ({grid})")
            text += [
                f"## Section 9, loss against tasks at {size} ({grid})",
                "",
                f"At {LEVELS} held-out-loss levels every run of the LR passes through (highest first), each "
                "run's score interpolated along its own evaluations; a row without levels: no loss is passed "
                "through by every run of that LR.",
                "",
                markdown_table(gaps),
                "",
                f"![task scores against held-out loss, {grid}]({figure})",
                "",
            ]
        if (out / grid / REDUNDANCY).is_file():
            increases, unknown = read_redundancy(out / grid / REDUNDANCY, runs)
            if table := layer_use(runs, increases):
                figure = LAYER_USE_PLOT.format(grid=grid)
                plot_layer_use(
                    runs, increases, out / figure, f"Held-out loss increase when one block is removed ({grid})"
                )
                skipped = f" ({unknown} checkpoints of unfinished or unknown runs left out)" if unknown else ""
                text += [
                    f"## Section 8, layer use at {size} ({grid}){skipped}",
                    "",
                    "Held-out loss increase when one block is removed (keel redundancy, final checkpoints).",
                    "",
                    markdown_table(table),
                    "",
                    f"![loss increase per removed block, {grid}]({figure})",
                    "",
                ]
                text += _section8_comparisons(out, grid, runs, increases)
        else:
            text += [f"Section 8 at {size}: no {grid}/{REDUNDANCY} yet (make paper-redundancy-{grid}).", ""]
    tuned = {grid: grids[grid].runs for grid in DEPTH_GRIDS if grid in grids}
    if tuned:
        sweeps, gaps, trend = tuned_depth(tuned)
        widths = ", ".join(dict.fromkeys(str(r.width) for runs in tuned.values() for r in runs))
        costs = "; ".join(
            f"{grid}: {len(runs)} of {grids[grid].listed} runs finished, {cpu_hours(runs)}"
            for grid, runs in tuned.items()
        )
        text += [
            f"## Table 3, depth at width {widths}, each scheme at its own best LR",
            "",
            f"{note} {costs}.",
            "",
            markdown_table(sweeps),
            "",
        ]
        if gaps:  # a depth where both schemes have a finished run
            text += [markdown_table(gaps), ""]
        if trend:
            text += [
                f"The gap against depth (the depths whose sweeps have {VERDICT_SEEDS} finished seeds in every cell):",
                "",
                markdown_table(trend),
                "",
            ]
    return text
