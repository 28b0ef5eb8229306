"""The paper's claims about trained models, for `keel paper-report`: complete runs (warm-up, then cosine to the end)
of Keel and Pre-LN over seeds, each a `keel sweep` grid under the report's directory, judged from the records each
run leaves (config.yaml, stability.json, eval_history.json; never TensorBoard's events) and, for layer use, the
redundancy.csv `keel redundancy` wrote over a grid's final checkpoints (<grid>/redundancy/).

    Table 2      lr-d16, lr-d64: per scheme and peak LR, the final held-out loss and task scores; monotone in LR?
    Section 9    the same runs: each task's score against held-out loss along training (every in-loop evaluation),
                 Keel minus Pre-LN at common loss levels, each run's score interpolated along its own trajectory
    Section 8    the loss increase when one block is removed (first, middle, last), from <grid>/redundancy/
    Table 3      tuned-depth-d16, lr-d64, tuned-depth-d256 (width 32): each scheme at its own best LR (lowest mean
                 final held-out loss) of its sweep; the Keel - Pre-LN gap at those LRs against depth, over the
                 depths whose sweeps have VERDICT_SEEDS finished seeds in every cell

A run counts once its last evaluation is at its last step (the grids evaluate there); a cell is the mean, the sample
sd, [min, max] and n over the seeds; "seeds apart" means the two schemes' seed ranges do not overlap.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from keel.artifacts import CONFIG, read_eval_history, read_stability
from keel.experiments.plots import pyplot, save_figure
from keel.experiments.records import (
    LAYER_USE_PLOT,
    LOSS_VS_TASKS_PLOT,
    MANIFEST,
    REDUNDANCY,
    SWEEP_TIME,
    checkpoint_run,
    load_run_config,
    read_redundancy_rows,
)
from keel.experiments.roles import DEPTH_GRIDS, LR_GRIDS, TUNED_GRIDS
from keel.experiments.stats import apart, direction, fmt, fmt_sd, spread
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
    init: str
    seed: int  # run.seed: the init and the batch order, shared by the schemes' runs of one seed
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
    time_record = run_dir / SWEEP_TIME
    cpu_s = json.loads(time_record.read_text())["cpu_s"] if time_record.is_file() else None
    return TrainedRun(
        run_dir.name,
        cfg.model.scheme,
        cfg.model.depth,
        cfg.model.width,
        cfg.optim.lr,
        cfg.model.init_kind,
        cfg.run.seed,
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


def read_redundancy(path: Path, runs: list[TrainedRun]) -> tuple[dict[str, list[float]], int]:
    """Per finished run, the loss increase of each removed block (block order), from a redundancy.csv over the
    grid's checkpoints (each <grid>/<run>/checkpoints/<file>); and how many checkpoints it has of no finished run."""
    names = {r.name for r in runs}
    increases: dict[str, dict[int, float]] = {}
    for row in read_redundancy_rows(path):
        increases.setdefault(checkpoint_run(row["path"]), {})[row["block"]] = row["loss_increase"]
    known = {name: [blocks[b] for b in sorted(blocks)] for name, blocks in increases.items() if name in names}
    return known, len(increases) - len(known)


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
                        f"middle blocks (1-{depth - 2}), mean": spread([statistics.mean(s[1:-1]) for s in seeds]),
                        f"last block ({depth - 1})": spread([s[-1] for s in seeds]),
                    }
                )
    return table


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
