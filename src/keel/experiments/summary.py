"""The Summary of `keel paper-report`: one short row per verdict on a claim of the paper, each naming its protocol
(ramp and slope), its size (blocks x width) and its paired seeds, with its figure and a test that fits paired seeds
(keel.experiments.stats.Paired: the sign test, Wilcoxon's signed-rank test and the t-test on the log ratios).

A max-LR figure is the median of the per-seed ratios (Keel's max LR over the other scheme's, seed by seed) with
their range, over the seeds where both runs learned and broke on the ramp (a run that never failed gives only a lower
bound). A loss figure is the median of the per-seed differences in nats, tested as ratios of perplexities (their log
is the difference). A comparison over a sweep's peak LRs pairs by seed, each seed's mean over the LRs (its runs share
its init and data: not independent pairs). No verdict on fewer than stats.MIN_SEEDS paired seeds; no comparison
across ramps or slopes: a row whose schemes never ran on one ramp says what each measured and that the matched
comparison is not run; a row whose runs left no record says so.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from keel.artifacts import CONFIG, read_stability
from keel.experiments.grids import GRIDS
from keel.experiments.hold import fit, hold_points, hold_span, limits
from keel.experiments.maxlr_report import max_lr_value, rows_at
from keel.experiments.records import REDUNDANCY, load_run_config
from keel.experiments.roles import DEEP_RUNS, DEPTH_GRIDS, HOLD_GRIDS, LINEAR_DEPTH_TREND, LR_GRIDS
from keel.experiments.stats import (
    MIN_SEEDS,
    Paired,
    apart,
    direction,
    fmt,
    median,
    paired,
    paired_over_conditions,
    seeds_over_conditions,
)
from keel.experiments.trained import (
    LOSS,
    PAIR,
    TrainedGrid,
    TrainedRun,
    best_lr,
    matched_levels,
    means_by_lr,
    middle_costs,
    read_redundancy,
    scores_at_level,
    section8_profile,
)

NAMES = {
    "keel": "Keel",
    "preln": "Pre-LN",
    "postln": "Post-LN",
    "deepnorm": "DeepNorm",
    "mixln": "Mix-LN",
    "hybridnorm": "HybridNorm",
    "hybridnorm-megatron": "HybridNorm, its authors' init",
}
FAMILY = ("postln", "deepnorm", "mixln", "hybridnorm")  # the Post-LN family of Table 1
TABLE1_GRIDS = ("linear-d16", "linear-d64", "table1-d16", "table1-d64")  # the paper's protocol first
FAMILY_GRIDS = ("linear-d16", "linear-d64", "linear-gentle-d16", "linear-gentle-d64", "table1-d16", "table1-d64")
# Keel on the gentle grids' ramp, read beside the family's grids and the depth trend's Post-LN
KEEL_AT_FAMILY_SLOPE = ("linear-gentle-keel-d16", "linear-gentle-keel-d64", "linear-gentle-keel-depth-d16")
LOSS_GRIDS = ("linear-d16", "linear-d64", "hold-d64-slow", "table1-d16", "table1-d64")
HYBRIDNORM = ("hybridnorm", "hybridnorm-megatron")  # HybridNorm's headline: its authors' init (the own-init rule)
FAMILY_CLAIM = "the Post-LN family far below Keel (Table 1)"
COLUMNS = ("claim (section)", "protocol", "blocks x width", "seeds", "figure", "paired test", "verdict")


def short_ramp(ramp: str) -> str:
    return ramp.replace("linear from 0, ", "linear, ").replace(" per step", "/step").replace(" per decade", "/decade")


def slope(ramp: str) -> str:
    """A linear ramp's slope as a short cell (another ramp as short_ramp gives it)."""
    return short_ramp(ramp).removeprefix("linear, ")


def _row(claim: str, protocol: str, size: str, seeds: str, figure: str, test: str, verdict: str) -> dict:
    return dict(zip(COLUMNS, (claim, protocol, size, seeds, figure, test, verdict)))


def tests(p: Paired) -> str:
    """The paired tests' p-values, none below MIN_SEEDS seeds."""
    if p.n < MIN_SEEDS:
        return "-"
    return f"sign {fmt(p.sign_p)}, signed-rank {fmt(p.signed_rank_p)}, t {fmt(p.t_p)}"


def ratio_figure(p: Paired) -> str:
    """The median per-seed ratio [range]."""
    if not p.n:
        return "-"
    return fmt(p.median_ratio) + (f" [{fmt(min(p.ratios))}-{fmt(max(p.ratios))}]" if p.n > 1 else "")


def nats(p: Paired) -> list[float]:
    """A comparison of perplexities as the per-seed differences of their logs (nats)."""
    return [math.log(r) for r in p.ratios]


def nats_figure(p: Paired) -> str:
    """The median per-seed difference in nats [range]."""
    if not p.n:
        return "-"
    diffs = nats(p)
    return f"{statistics.median(diffs):+.3f}" + (f" [{min(diffs):+.3f}, {max(diffs):+.3f}]" if p.n > 1 else "")


def verdict(subject: str, p: Paired) -> str:
    return p.verdict if p.n < MIN_SEEDS else f"{subject} {p.verdict}"


def limits_by_seed(rows: list[dict], scheme: str) -> dict[int, float | None]:
    """Each seed's max LR where the run learned and broke on the ramp (a limit, not a lower bound), else None."""
    return {r["seed"]: max_lr_value(r) if r["failure"] else None for r in rows if r["row"] == scheme}


def seeds_cell(p: Paired, rows: list[dict], a: str, b: str) -> str:
    both = {r["seed"] for r in rows if r["row"] == a} & {r["seed"] for r in rows if r["row"] == b}
    return f"{p.n} of {len(both)}"


def point(rows: list[dict]) -> str:
    return f"{rows[0]['depth']} x {rows[0]['width']}"


def protocol(rows: list[dict]) -> str:
    return "; ".join(dict.fromkeys(short_ramp(r["ramp"]) for r in rows))


def keel_vs_preln(grids: dict[str, list[dict]], names, claim, per_seed, figure) -> list[dict]:
    """A row per grid of names: claim(grid), Keel against Pre-LN paired by seed over per_seed(rows, scheme) (seed ->
    value), figure(Paired) its figure."""
    table = []
    for grid in names:
        rows = [r for r in grids.get(grid, []) if r["row"] in ("keel", "preln")]
        if rows:
            p = paired(per_seed(rows, "keel"), per_seed(rows, "preln"))
            seeds = seeds_cell(p, rows, "keel", "preln")
            table.append(_row(claim(grid), protocol(rows), point(rows), seeds, figure(p), tests(p), verdict("Keel", p)))
    return table


def max_lr_rows(grids: dict[str, list[dict]]) -> list[dict]:
    """Keel against Pre-LN on Table 1's grids, then on the hold map's other slopes."""
    others = [g for names in HOLD_GRIDS.values() for g in names if g not in TABLE1_GRIDS]
    return keel_vs_preln(
        grids,
        [*TABLE1_GRIDS, *others],
        lambda grid: f"Keel's max LR above Pre-LN's ({'Table 1' if grid in TABLE1_GRIDS else 'hold map'})",
        limits_by_seed,
        lambda p: f"Keel / Pre-LN {ratio_figure(p)}",
    )


def hold_rows(grids: dict[str, list[dict]]) -> list[dict]:
    """Per point of the hold map: Keel's and Pre-LN's max LR against the hold, over the linear ramps (like for like)."""
    table = []
    for at in HOLD_GRIDS:
        figures, seeds, slopes = [], [], set()
        for scheme in ("keel", "preln"):
            runs = hold_points(grids, at, scheme, "linear ramps")
            points = limits(runs)
            slopes |= {r["ramp"] for _, r in runs}
            seeds.append(f"{NAMES[scheme]} {len(points)}")
            if (result := fit(points)) is not None:
                figures.append(
                    f"{NAMES[scheme]} hold^{result['exponent']:.2f} "
                    f"[{result['exponent low']:.2f}, {result['exponent high']:.2f}]"
                )
            elif points:
                figures.append(f"{NAMES[scheme]}: holds span {hold_span(points):.2f}x, no line")
        if not slopes:
            continue
        table.append(
            _row(
                "(the protocol) max LR falls as each LR is held longer (hold map)",
                f"linear, {len(slopes)} slopes",
                "{} x {}".format(*at),
                ", ".join(seeds) + " runs",
                "; ".join(figures),
                "95% interval of the exponent",
                "; ".join(
                    f"{NAMES[s]} "
                    + (
                        "falls"
                        if (f := fit(limits(hold_points(grids, at, s, "linear ramps")))) and f["exponent high"] < 0
                        else "no verdict"
                    )
                    for s in ("keel", "preln")
                ),
            )
        )
    return table


def matched(grids: dict[str, list[dict]], rows: list[dict], scheme: str = "keel") -> list[dict]:
    """The scheme's runs at these rows' size on their ramp, in any grid."""
    ramps = {r["ramp"] for r in rows}
    size = (rows[0]["depth"], rows[0]["width"])
    return [r for grid in grids.values() for r in rows_at(grid, *size, scheme) if r["ramp"] in ramps]


def family_rows(grids: dict[str, list[dict]]) -> list[dict]:
    """The Post-LN family against Keel per grid: Keel / each per seed where Keel ran on the grid's ramp, else each
    scheme's median max LR and that the matched comparison is not run."""
    table = []
    for grid in FAMILY_GRIDS:
        rows = grids.get(grid, [])
        members = [s for s in FAMILY if any(r["row"] == s for r in rows)]
        if not rows:
            continue
        if not members:
            seeds, figure, test, verdicts = "0", "no record", "-", "no record"
        elif keel := matched(grids, rows):
            comparisons = {s: paired(limits_by_seed(keel, "keel"), limits_by_seed(rows, s)) for s in members}
            decided = [p for p in comparisons.values() if p.n >= MIN_SEEDS]
            worst = max(decided, key=lambda p: (p.sign_p, p.signed_rank_p, p.t_p or 0)) if decided else None
            figure = "Keel / " + ", ".join(f"{NAMES[s]} {fmt(p.median_ratio)}" for s, p in comparisons.items() if p.n)
            seeds = ", ".join(f"{NAMES[s]} {p.n}" for s, p in comparisons.items())
            test = f"weakest: {tests(worst)}" if worst else "-"
            grouped: dict[str, list[str]] = {}
            for s, p in comparisons.items():
                grouped.setdefault(verdict("Keel", p), []).append(NAMES[s])
            verdicts = "; ".join(f"{', '.join(names)}: {v}" for v, names in grouped.items())
        else:
            figure = "max LR " + ", ".join(
                f"{NAMES[s]} {fmt(median(values))} ({len(values)}/{len(runs)})"
                for s in members
                for runs in [[r for r in rows if r["row"] == s]]
                for values in [[v for v in map(max_lr_value, runs) if v is not None]]
            )
            seeds = str(len({r["seed"] for r in rows}))
            test = "-"
            verdicts = "matched comparison not run: no Keel run on this ramp"
        table.append(_row(FAMILY_CLAIM, protocol(rows), point(rows), seeds, figure, test, verdicts))
    return table


def perplexities(rows: list[dict], scheme: str) -> dict[int, float | None]:
    """Each seed's best held-out perplexity on the ramp."""
    return {
        r["seed"]: math.exp(r["best_heldout"]) if r["best_heldout"] is not None else None
        for r in rows
        if r["row"] == scheme
    }


def best_loss_rows(grids: dict[str, list[dict]]) -> list[dict]:
    """Keel's best held-out loss on the ramp against Pre-LN's, seed by seed."""
    return keel_vs_preln(
        grids,
        LOSS_GRIDS,
        lambda grid: "Keel's perplexity below Pre-LN's (abstract)",
        perplexities,
        lambda p: f"best held-out loss on the ramp, Keel - Pre-LN {nats_figure(p)} nats",
    )


def depth_gap_row(grids: dict[str, list[dict]]) -> list[dict]:
    """The Post-LN variants' gap to Keel against depth, at matched slopes: the depths where Keel and Post-LN share a
    ramp with MIN_SEEDS paired seeds; short of two such depths, what each scheme measured at which slope."""
    depths, measured = [], {}
    for depth, (names, _, width) in LINEAR_DEPTH_TREND.items():
        rows = [r for grid in (*names, *KEEL_AT_FAMILY_SLOPE) for r in rows_at(grids.get(grid, []), depth, width)]
        ramps = {s: {r["ramp"] for r in rows if r["row"] == s} for s in ("keel", "postln")}
        keel_ramps, postln_ramps = ramps.values()
        for s in ramps:
            for ramp in ramps[s]:
                runs = [r for r in rows if r["row"] == s and r["ramp"] == ramp]
                values = [v for v in map(max_lr_value, runs) if v is not None]
                learned = "" if len(values) == len(runs) else f" ({len(values)}/{len(runs)})"
                measured.setdefault((s, slope(ramp)), []).append(f"{depth}: {fmt(median(values))}{learned}")
        for ramp in keel_ramps & postln_ramps:
            on = [r for r in rows if r["ramp"] == ramp]
            if (p := paired(limits_by_seed(on, "keel"), limits_by_seed(on, "postln"))).n >= MIN_SEEDS:
                depths.append((depth, slope(ramp), p))
    if not measured:
        return []
    width = next(iter(LINEAR_DEPTH_TREND.values()))[2]
    if len(depths) >= 2:  # the gap itself, Keel / Post-LN seed by seed, at each depth measured on one slope
        figure = "Keel / Post-LN " + ", ".join(f"{d} ({ramp}): {ratio_figure(p)}" for d, ramp, p in depths)
        gaps = [p.median_ratio for _, _, p in depths]
        verdict_cell = f"{'widens' if direction(gaps) == 'rises' else 'does not widen'}; no trend test"
    else:
        figure = "; ".join(f"{NAMES[s]} ({ramp}) {', '.join(cells)}" for (s, ramp), cells in measured.items())
        verdict_cell = "not measured: matched at fewer than 2 depths"
    return [
        _row(
            "the Post-LN variants' gap to Keel widens with depth (Table 1)",
            "linear, matched slopes",
            f"{', '.join(map(str, LINEAR_DEPTH_TREND))} x {width}",
            f"matched at {len(depths)} depths",
            figure,
            "-",
            verdict_cell,
        )
    ]


def deep_row(out: Path) -> list[dict]:
    """The 1,024-block runs: each scheme the grids list, its non-finite steps, or no record."""
    figures, recorded, protocols = [], {}, set()
    for grid, suffix in DEEP_RUNS.items():
        args = GRIDS[grid].args
        for scheme in args[args.index("--schemes") + 1].split(","):
            name = NAMES[scheme] + (" without gains" if suffix else "")
            runs = sorted(d for d in (out / grid).glob(f"{scheme}-d*") if (d / CONFIG).is_file())
            records = [(d, state) for d in runs if (state := read_stability(d))]
            recorded[name] = len(records)
            steps = [f"{state['nonfinite_steps']} non-finite of {state['steps']} steps" for _, state in records]
            figures.append(f"{name}: " + (", ".join(steps) or "no record"))
            protocols |= {f"LR {fmt(c.optim.lr)}, {c.trainer.max_steps} steps" for c in map(load_run_config, runs)}
    depth, width = GRIDS[next(iter(DEEP_RUNS))].point
    return [
        _row(
            "Keel trains stably past 1,000 layers",
            "; ".join(sorted(protocols)) or "-",
            f"{depth:,} x {width}",
            ", ".join(f"{name} {n}" for name, n in recorded.items()),
            "; ".join(figures),
            "-",
            "Keel: no record"
            if not recorded["Keel"]
            else f"Keel: n = {recorded['Keel']}, no verdict"
            if recorded["Keel"] < MIN_SEEDS
            else "see the section",
        )
    ]


def hybridnorm_row(grids: dict[str, list[dict]]) -> list[dict]:
    """HybridNorm's headline: its authors' init, with N(0, 0.02) beside it."""
    grid, headline = HYBRIDNORM
    rows = grids.get(grid, [])
    own = [r for r in rows if r["row"] == headline]
    if not own:
        return []
    cells = []
    for label in (headline, "hybridnorm"):
        runs = [r for r in rows if r["row"] == label]
        values = [v for v in map(max_lr_value, runs) if v is not None]
        if runs:
            cells.append(
                f"{'its authors init' if label == headline else runs[0]['init']}: {fmt(median(values))} "
                f"[{fmt(min(values, default=None))}-{fmt(max(values, default=None))}] ({len(values)}/{len(runs)})"
            )
    return [
        _row(
            "HybridNorm with the Post-LN family (Table 1)",
            protocol(own),
            point(own),
            str(len(own)),
            "max LR " + "; ".join(cells).replace("its authors init", own[0]["init"] + " (its authors')"),
            "-",
            "matched comparison not run" + ("" if matched(grids, own) else ": no Keel run on this ramp"),
        )
    ]


# ------------------------------------------------------------------------------------------- trained models


def _by_seed(runs: list[TrainedRun], value) -> dict[int, float | None]:
    return {r.seed: value(r) for r in runs}


def _trained_protocol(runs: list[TrainedRun]) -> str:
    lrs = sorted({r.lr for r in runs})
    return f"complete runs, peak LR {fmt(lrs[0])}-{fmt(lrs[-1])}"


def _size(runs: list[TrainedRun]) -> str:
    return f"{runs[0].depth} x {runs[0].width}"


def _seeds(runs: list[TrainedRun]) -> str:
    counts = [sum(r.scheme == s and r.lr == lr for r in runs) for s in PAIR for lr in {r.lr for r in runs}]
    low, high = min(counts), max(counts)
    return f"{low} per LR" if low == high else f"{low}-{high} per LR"


def table2_row(runs: list[TrainedRun]) -> list[dict]:
    """Table 2: in how many task metrics each scheme's means move one way with the peak LR (both schemes ran)."""
    if any(not any(r.scheme == s for r in runs) for s in PAIR):
        return []
    tasks = {}
    for scheme in PAIR:
        means = means_by_lr(runs, scheme)
        directions = [direction(values) for metric, values in means.items() if metric != LOSS]
        tasks[scheme] = (sum(d in ("rises", "falls") for d in directions), len(directions))
    keel, preln = tasks.values()
    holds = keel[0] == keel[1] and preln[0] < preln[1]
    row = _row(
        "Keel's task scores monotone in LR, Pre-LN's not (Table 2)",
        _trained_protocol(runs),
        _size(runs),
        _seeds(runs),
        f"task means monotone in LR: Keel in {keel[0]} of {keel[1]} metrics, Pre-LN in {preln[0]} of {preln[1]}",
        "- (the means' direction)",
        "holds" if holds else "not seen",
    )
    return [row]


def section9_rows(runs: list[TrainedRun]) -> list[dict]:
    """Section 9: the final held-out loss at matched peak LR, paired by seed over the LRs (paired_over_conditions);
    the task scores at matched held-out loss, each (metric, LR, level) cell's seeds apart or not."""
    lrs = sorted(matched_levels(runs))
    perplexities = []
    for lr in lrs:
        cells = [[r for r in runs if r.scheme == s and r.lr == lr] for s in PAIR]
        perplexities.append(tuple(_by_seed(c, lambda r: math.exp(r.final[LOSS])) for c in cells))
    loss = paired_over_conditions(perplexities)
    cells = lower = higher = 0
    for lr, levels in matched_levels(runs).items():
        for metric in list(runs[0].final)[1:]:
            for level in levels:
                keel, preln = scores_at_level(runs, metric, lr, level)
                if keel and preln:
                    cells += 1
                    lower += apart(keel, preln) == "yes" and max(keel) < min(preln)
                    higher += apart(keel, preln) == "yes" and min(keel) > max(preln)
    level_lrs = [lr for lr, levels in matched_levels(runs).items() if levels]
    return [
        _row(
            "at matched LR, Pre-LN's loss lower (Section 9)",
            _trained_protocol(runs),
            _size(runs),
            seeds_over_conditions(perplexities),
            f"Keel - Pre-LN final loss, a seed's mean over the LRs: {nats_figure(loss)} nats",
            tests(loss),
            verdict("Keel", loss),
        ),
        _row(
            "at matched loss, Keel's tasks better (Section 9)",
            f"LR {', '.join(map(fmt, level_lrs))}, 3 loss levels",
            _size(runs),
            _seeds(runs),
            f"{cells} (metric, LR, level) cells: Keel's seeds all above Pre-LN's in {higher}, all below in {lower}",
            "seed ranges apart",
            "holds" if cells and higher == cells else "not seen",
        ),
    ]


def section8_row(out: Path, grid: str, runs: list[TrainedRun]) -> list[dict]:
    """Section 8 from the committed redundancy rows: the loss increase when one middle block is removed (each seed's
    mean over the middle blocks), Keel over Pre-LN, paired by seed over the LRs (paired_over_conditions), with the
    median by LR beside it. The shallow-versus-deep profile of the
    claim as its sources state it belongs beside this row."""
    if not (out / grid / REDUNDANCY).is_file():
        return []
    increases, _ = read_redundancy(out / grid / REDUNDANCY, runs)
    costs = middle_costs(runs, increases)
    per_lr = []
    for lr, pair in costs.items():
        p = paired(*pair)
        few = f" (n = {p.n})" if p.n < MIN_SEEDS else ""
        per_lr.append(f"{fmt(lr)}: {fmt(p.median_ratio) if p.n else '-'}{few}")
    pooled = paired_over_conditions(list(costs.values()))
    return [
        _row(
            "Keel's layers less redundant than Pre-LN's (Section 8)",
            _trained_protocol(runs),
            _size(runs),
            seeds_over_conditions(list(costs.values())),
            f"Keel / Pre-LN middle-block removal cost, a seed's geometric mean over the LRs: {ratio_figure(pooled)}; "
            "median by LR: " + ", ".join(per_lr),
            tests(pooled),
            verdict("Keel", pooled),
        )
    ]


def table3_rows(grids: dict[str, TrainedGrid]) -> list[dict]:
    """Table 3: per depth, each scheme at its own best LR: Keel - Pre-LN final held-out loss paired by seed, and in
    how many task metrics the two schemes' seed ranges are apart; then the gaps against depth. A grid still running
    (records of its finished runs committed session by session) says how many of its runs are in."""
    table, gaps, seeds = [], [], set()
    for grid in DEPTH_GRIDS:
        if grid not in grids:
            gaps.append(f"{GRIDS[grid].point[0]}: no record")
            continue
        runs, listed = grids[grid].runs, grids[grid].listed
        finished = f" ({len(runs)} of {listed} runs finished)" if len(runs) < listed else ""
        best = {s: best_lr(runs, s) for s in PAIR}
        cells = [[r for r in runs if r.scheme == s and r.lr == best[s]] for s in PAIR]
        p = paired(*(_by_seed(c, lambda r: math.exp(r.final[LOSS])) for c in cells))
        seeds.add(p.n)
        tasks = [m for m in runs[0].final if m != LOSS]
        scores = {m: [[r.final[m] for r in c if m in r.final] for c in cells] for m in tasks}
        # one seed a side has no range to be apart (stats.apart)
        higher = sum(apart(k, q) == "yes" and min(k) > max(q) for k, q in scores.values())
        lower = sum(apart(k, q) == "yes" and max(k) < min(q) for k, q in scores.values())
        few = f" (n = {p.n})" if p.n < MIN_SEEDS else ""
        gaps.append(f"{runs[0].depth}: {statistics.median(nats(p)):+.3f}{few}" if p.n else f"{runs[0].depth}: -")
        table.append(
            _row(
                "Keel better at tuned LRs (Table 3)",
                "complete runs, best LR " + ", ".join(f"{NAMES[s]} {fmt(lr)}" for s, lr in best.items()),
                _size(runs),
                f"{p.n}{finished}",
                f"Keel - Pre-LN final loss {nats_figure(p)} nats; tasks with the seeds apart: Keel above in "
                f"{higher}, below in {lower} of {len(tasks)}",
                tests(p),
                verdict("Keel's loss", p),
            )
        )
    if table:
        table.append(
            _row(
                "Keel's gain at tuned LRs grows with depth (Table 3)",
                "complete runs, each scheme at its best LR",
                "width 32",
                ", ".join(map(str, sorted(seeds))) + " per depth",
                "Keel - Pre-LN final loss, median by blocks: " + ", ".join(gaps),
                "-",
                f"no trend test over {len(table)} depths",
            )
        )
    return table


SUMMARY_NOTE = (
    "Written by `keel paper-report` from the records; the sections below give the details. Max LR: the median of "
    "the per-seed ratios [range] over the seeds where both runs learned and broke on the ramp; a loss: the median "
    "per-seed difference [range]; over a sweep's LRs, each seed's mean over them (one seed's runs are not "
    "independent pairs). Paired tests, two-sided, over those seeds: the sign test, Wilcoxon's exact "
    f"signed-rank test and the t-test on the log ratios; no verdict on fewer than {MIN_SEEDS} paired seeds, no "
    "comparison across ramps or slopes."
)


def summary_grids() -> tuple[str, ...]:
    """The max-LR grids the Summary reads (a grid not here is not in it)."""
    names = [*TABLE1_GRIDS, *(g for names in HOLD_GRIDS.values() for g in names), *FAMILY_GRIDS, HYBRIDNORM[0]]
    names += KEEL_AT_FAMILY_SLOPE
    names += [g for names, _, _ in LINEAR_DEPTH_TREND.values() for g in names]
    return tuple(dict.fromkeys(names))


def summary(out: Path, grids: dict[str, list[dict]], trained: dict[str, TrainedGrid]) -> list[dict]:
    """The Summary's rows: the max-LR claims from the collected grids, then the trained-model claims."""
    grids = {name: grids[name] for name in summary_grids() if name in grids}
    table = [
        *max_lr_rows(grids),
        *hold_rows(grids),
        *family_rows(grids),
        *hybridnorm_row(grids),
        *depth_gap_row(grids),
        *best_loss_rows(grids),
        *deep_row(out),
    ]
    profiles = {profile["grid"]: profile for profile in section8_profile(out, trained)}
    for grid in LR_GRIDS:
        if grid in trained:
            runs = trained[grid].runs
            table += [*table2_row(runs), *section9_rows(runs), *section8_row(out, grid, runs)]
            table += [profile_row(runs, profiles[grid])] if grid in profiles else []
    return table + table3_rows(trained)


def profile_row(runs: list[TrainedRun], profile: dict) -> dict:
    """Section 8 as its sources state it: Pre-LN's shallow blocks more redundant than its deep ones, Keel's used more
    uniformly (trained.section8_profile: per LR, every seed of Pre-LN and every paired seed of Keel one way)."""
    return _row(
        "Pre-LN's shallow blocks more redundant, Keel's more uniform (Section 8)",
        _trained_protocol(runs),
        _size(runs),
        f"per LR: {profile['seeds paired per LR']}",
        f"interior blocks' removal cost, shallow / deep half; by thirds: {profile['verdict, thirds']}",
        "every seed one way (sign p >= 0.25)",
        profile["verdict"],
    )
