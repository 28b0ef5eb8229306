"""`keel paper-report [DIR]`: the report of docs/experiments.md from the grids `make paper` ran under DIR
(default runs/paper), written to DIR/report.md with its figures.

Each `keel maxlr` grid is judged by `keel maxlr collect` (keel.experiments.maxlr_report); this puts them side by
side in the roles keel.experiments.roles gives them, after the Summary (keel.experiments.summary: a row per verdict
on a claim, with its protocol, size, paired seeds and paired tests; docs/experiments.md holds it): Table 1's seed
tables and sign tests (keel.experiments.table1), the Keel / Pre-LN max-LR ratio against depth and width with the
batch point, and LR transfer under muP
(keel.experiments.trends), the hold map (keel.experiments.hold), the two-ramp check, Keel without its outer norms'
gains and the 1,024-block runs (held-out loss, non-finite steps, per-block gradient norms); then the trained-model
claims (keel.experiments.trained). Every table names the init in force. --shared-init DIR2 adds what depends on the
init: each scheme whose init differs between DIR (by default each scheme's own recipe) and DIR2 (the grids run with one
init for all), side by side. A grid not run yet is listed as missing; the rest is reported.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from keel.artifacts import CONFIG, TENSORBOARD, read_scalars, read_stability
from keel.config.model import scheme_of
from keel.errors import ConfigError
from keel.experiments.doc_blocks import mark_tables, write_docs
from keel.experiments.grids import GRIDS
from keel.experiments.hold import hold_fits, hold_table, plot_hold_map
from keel.experiments.lr_transfer import sections as lr_transfer_sections
from keel.experiments.maxlr_report import NotYetRun, collect, inits, max_lr_value
from keel.experiments.origins import origins_table
from keel.experiments.plots import pyplot, save_figure
from keel.experiments.records import DEEP_PLOT, HOLD_PLOT, MANIFEST, RATIO_PLOT, REPORT, TRANSFER_PLOT, load_run_config
from keel.experiments.resolution import resolution_tables
from keel.experiments.roles import (
    BATCH_POINT,
    DEEP_RUNS,
    DEPTH_TREND,
    LINEAR_DEPTH_TREND,
    LINEAR_SLOW_DEPTH_TREND,
    LINEAR_WIDTH_TREND,
    MAXLR_GRIDS,
    MUP_WIDTH_TREND,
    NOGAIN_PAIRS,
    RAMP_CHECK,
    RESOLUTION_PAIRS,
    TABLE1,
    WIDTH_TREND,
)
from keel.experiments.stats import fmt, median
from keel.experiments.summary import COLUMNS, SUMMARY_NOTE, summary
from keel.experiments.table1 import STRICT, seed_table, sign_tests
from keel.experiments.tables import markdown_table
from keel.experiments.trained import load_trained
from keel.experiments.trained import sections as trained_sections
from keel.experiments.trends import base_width_floor, hold_pairs, plot_ratios, plot_transfer, transfer, trend


def ramp_check(short: list[dict], long: list[dict]) -> list[dict]:
    """The same (scheme, seed) on the ramp of table1-d16 and on the ramp twice as slow: a real LR limit stays at
    its LR; an event tied to the step would move to the LR the slower ramp reaches at that step."""
    by = {(r["row"], r["seed"]): r for r in short}
    table = []
    for r in long:
        if (r["row"], r["seed"]) in by:
            s = by[r["row"], r["seed"]]
            table.append(
                {
                    "scheme": r["row"],
                    "seed": r["seed"],
                    "max LR, 560 steps": fmt(max_lr_value(s)),
                    "its onset step": s["onset_step"],
                    "max LR, 1,120 steps": fmt(max_lr_value(r)),
                    "its onset step, 1,120": r["onset_step"],
                    "ratio": fmt(max_lr_value(r) / max_lr_value(s)) if max_lr_value(r) and max_lr_value(s) else "-",
                    "loss-optimal LR, 560 / 1,120": f"{fmt(s['loss_optimal_lr'])} / {fmt(r['loss_optimal_lr'])}",
                }
            )
    return table


def deep_runs(sweeps: list[tuple[Path, str]], plot_path: Path) -> list[dict]:
    """The 1,024-block runs of each (sweep dir, label suffix): held-out loss, non-finite steps, and each block's
    gradient norm at three steps."""
    runs = [
        (out / run["name"], run["name"] + suffix)
        for out, suffix in sweeps
        for run in json.loads((out / MANIFEST).read_text())["runs"]
    ]
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    table = []
    for run_dir, name in runs:
        if not (run_dir / TENSORBOARD).is_dir():
            continue
        scalars = read_scalars(run_dir)
        stability = read_stability(run_dir) or {}
        val = scalars.get("val/loss", [])
        entry = {
            "run": name,
            "steps": stability.get("steps"),
            "non-finite steps": stability.get("nonfinite_steps"),
            "held-out loss (step: value)": ", ".join(f"{s + 1}: {v:.2f}" for s, v in val),
        }
        model = load_run_config(run_dir).model
        bottom = scheme_of(model).bottom_block(model)  # Keel's alpha = 1 block 0 gets ~L times the rest, by design
        numbered = sorted((int(tag.rsplit("_", 1)[1]), tag) for tag in scalars if tag.startswith("grad/ffn/block_"))
        blocks = [tag for block, tag in numbered if block >= bottom]
        steps = sorted({s for tag in blocks for s, _ in scalars[tag]})
        shown = [steps[0], steps[len(steps) // 2], steps[-1]] if steps else []
        for step in shown:
            norms = [dict(scalars[tag]).get(step) for tag in blocks]
            finite = [n for n in norms if n is not None and math.isfinite(n) and n > 0]
            if finite:
                entry[f"ffn grad norm max / smallest non-zero over blocks (Keel: from block 1), step {step + 1}"] = (
                    f"{max(finite) / min(finite):.3g}"
                    + (
                        f" ({len(norms) - len(finite)} of {len(norms)} logged blocks at 0)"
                        if len(finite) < len(norms)
                        else ""
                    )
                )
        if steps:
            last = [dict(scalars[tag]).get(steps[-1]) for tag in blocks]
            axes[0].plot([block for block, _ in numbered if block >= bottom], last, label=name)
        axes[1].plot([s + 1 for s, _ in val], [v for _, v in val], "o-", label=name)
        table.append(entry)
    axes[0].set(xlabel="block", ylabel="||grad|| of the FFN branch weights (last logged step)", yscale="log")
    axes[1].set(xlabel="step", ylabel="held-out loss")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, "1,024 blocks (L = 2,048) at LR 0.01", plot_path)
    return table


def collect_grids(out: Path, names: tuple[str, ...] = MAXLR_GRIDS) -> tuple[dict[str, list[dict]], list[str]]:
    """The max-LR grids of out (by default every one) judged (keel maxlr collect), and the ones missing or with no
    finished run."""
    grids: dict[str, list[dict]] = {}
    missing = []
    for grid in names:
        if (out / grid / MANIFEST).is_file():
            try:
                grids[grid] = collect(out / grid)
            except NotYetRun as err:
                missing.append(f"{grid} ({err})")
        else:
            missing.append(grid)
    return grids, missing


def init_sensitivity(grids: dict[str, list[dict]], shared: dict[str, list[dict]]) -> list[dict]:
    """Per grid and scheme whose init differs between the two trees (each scheme's own recipe; one init for all):
    how many seeds learned, the median max LR and the best held-out loss under each."""
    table = []
    for grid, rows in grids.items():
        for label in dict.fromkeys(r["row"] for r in rows):
            own = [r for r in rows if r["row"] == label]
            other = [r for r in shared.get(grid, []) if r["row"] == label]
            if not other or inits(own) == inits(other):
                continue
            entry = {"grid": grid, "blocks x width": f"{own[0]['depth']} x {own[0]['width']}", "scheme": label}
            for name, runs in (("own", own), ("shared", other)):
                values = [v for v in map(max_lr_value, runs) if v is not None]
                entry |= {
                    f"{name} init": inits(runs),
                    f"{name}: learned": f"{len(values)}/{len(runs)}",
                    f"{name}: max LR median": fmt(median(values)),
                    f"{name}: best held-out median": fmt(
                        median([r["best_heldout"] for r in runs if r["best_heldout"] is not None])
                    ),
                }
            table.append(entry)
    return table


def report(out: Path, shared_init: Path | None = None) -> str:
    grids, missing = collect_grids(out)
    trained, not_trained = load_trained(out)
    missing += not_trained
    text = [f"# Max tolerable LR: the grids of `make paper` ({out})", ""]
    if missing:
        text += ["Not (yet) run: " + ", ".join(missing) + ".", ""]
    text += ["## Summary", "", SUMMARY_NOTE, "", markdown_table(summary(out, grids, trained), COLUMNS), ""]
    text += [
        "Cells: max tolerable LR (divergence criterion; `>=`: no failure up to the peak; n.r.: never learned) / "
        "loss-optimal LR (best held-out loss).",
        "",
    ]
    for grid, title in TABLE1.items():
        if grid in grids:
            ramps = ", ".join(dict.fromkeys(r["ramp"] for r in grids[grid]))
            text += [f"## {title} ({grid}; {ramps})", "", markdown_table(seed_table(grids[grid])), ""]
            labels = {r["row"] for r in grids[grid]}
            pairs = [p for p in (("keel", "preln"), ("keel", "postln")) if set(p) <= labels]
            if pairs:
                tests = sign_tests(grids[grid], pairs) + sign_tests(grids[grid], pairs, STRICT)
                text += [markdown_table(tests), ""]
    for table1, perturbed in RESOLUTION_PAIRS:
        if perturbed in grids and table1 in grids:
            seeds, spread = resolution_tables(grids[table1], grids[perturbed])
            blocks, width = GRIDS[perturbed].point
            text += [
                f"## The resolution, {blocks} x {width}: Table 1's probes under changes that should not matter "
                f"({perturbed} beside {table1})",
                "",
                "Each seed's max LR in Table 1 and with two threads or model.init_std one float32 ulp higher; the "
                "spread, max / min over them, is the resolution a difference between schemes must exceed.",
                "",
                markdown_table(seeds),
                "",
                markdown_table(spread),
                "",
            ]
    if table := hold_table(grids):
        text += ["## The hold map: max LR against the steps the ramp holds each LR", "", markdown_table(table), ""]
        if pairs := hold_pairs(grids):
            text += [markdown_table(pairs), ""]
        if fits := hold_fits(grids):
            text += [markdown_table(fits), ""]
        plot_hold_map(grids, out / HOLD_PLOT)
        text += [f"![max LR against the hold at the limit]({HOLD_PLOT})", ""]
    for axis, title, prefix in (
        (LINEAR_DEPTH_TREND, "Depth at width 32, the paper's protocol", "blocks"),
        (LINEAR_SLOW_DEPTH_TREND, "Depth at width 32, the paper's protocol at half the slope", "blocks"),
        (LINEAR_WIDTH_TREND, "Width at 16 blocks, the paper's protocol", "width"),
    ):
        if table := trend(grids, axis, prefix)[0]:
            text += [f"## {title}", "", markdown_table(table), ""]
    depth_table, depth_points = trend(grids, DEPTH_TREND, "blocks")
    width_table, width_points = trend(grids, WIDTH_TREND, "width")
    batch_table, batch_points = trend(grids, BATCH_POINT, "width")
    for title, table in (("Depth at width 32", depth_table), ("Width at 16 blocks", width_table)):
        if table:
            text += [f"## {title}", "", markdown_table(table), ""]
    if batch_table:
        text += ["## 8x the tokens per step (16 x 64, 64 sequences of 128)", "", markdown_table(batch_table), ""]
    if any(depth_points.values()) or any(width_points.values()):
        plot_ratios(depth_points, width_points, batch_points.get(64, []), out / RATIO_PLOT)
        text += [f"![Keel / Pre-LN max LR against depth and width]({RATIO_PLOT})", ""]
    if any(grid in grids for names, _, _ in MUP_WIDTH_TREND.values() for grid in names):
        table, points = transfer(grids)
        text += [
            "## LR transfer across width: sp and mup (base width 64), 16 blocks, the geometric ramp",
            "",
            markdown_table(table),
            "",
            f"![the loss-optimal LR against width under sp and mup]({TRANSFER_PLOT})",
            "",
        ]
        if floor := base_width_floor(grids):
            text += [
                "The ramp's noise floor: the same seed at the base width, where sp and mup compute alike up to "
                "float rounding:",
                "",
                markdown_table(floor),
                "",
            ]
        plot_transfer(points, out / TRANSFER_PLOT)
    short, long = RAMP_CHECK
    if short in grids and long in grids and (table := ramp_check(grids[short], grids[long])):
        text += ["## Two ramp lengths ({} x {})".format(*GRIDS[short].point), "", markdown_table(table), ""]
    for table1, nogain in NOGAIN_PAIRS:
        if nogain in grids and table1 in grids:
            title = "{} x {}".format(*GRIDS[nogain].point)
            rows = [r for r in grids[table1] if r["row"] == "keel"] + grids[nogain]
            tests = sign_tests(rows, [("keel-nogain", "keel")])
            text += [
                f"## Keel without its outer norms' gains, {title} ({nogain} beside {table1}'s keel rows)",
                "",
                markdown_table(seed_table(rows)),
                "",
            ]
            if tests:
                text += [markdown_table(tests), ""]
    sweeps = [(out / grid, suffix) for grid, suffix in DEEP_RUNS.items() if (out / grid / MANIFEST).is_file()]
    if sweeps:
        table = deep_runs(sweeps, out / DEEP_PLOT)
        if table:
            text += ["## 1,024 blocks", "", markdown_table(table), "", f"![1,024 blocks]({DEEP_PLOT})", ""]
    text += trained_sections(out, trained)
    text += lr_transfer_sections(out)
    if shared_init is not None and (table := init_sensitivity(grids, collect_grids(shared_init)[0])):
        text += [
            "## What depends on the init: each scheme's own recipe against one init for all",
            "",
            f"Each scheme's own recipe: {out}; one init for all: {shared_init}. Learned: seeds whose max LR is "
            "resolved.",
            "",
            markdown_table(table),
            "",
        ]
    if origins := origins_table(out):
        text += [
            "## What made the records, and their cost",
            "",
            "Per grid, the commits its runs were made by (short; `dirty`: the code differed from the commit), torch "
            "and the thread count (a run recorded before runs said what made them counts as unrecorded), and the CPU "
            "time of the runs with a time record (a run resumed before 5 December 2026 counts its last session only).",
            "",
            markdown_table(origins),
            "",
        ]
    return mark_tables("\n".join(text))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="keel paper-report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dir", nargs="?", default="runs/paper")
    parser.add_argument(
        "--shared-init",
        type=Path,
        help="the same grids run with one init for every scheme "
        "(make paper ARGS=model.init=normal PAPER_OUT=DIR): adds the init-sensitivity table",
    )
    parser.add_argument(
        "--docs",
        type=Path,
        help="rewrite the tables the pages of this folder quote between '<!-- keel paper-report: NAME -->' "
        "markers (NAME: the report's section heading) with the report's",
    )
    args = parser.parse_args(argv)
    out = Path(args.dir)
    if args.docs is not None and not args.docs.is_dir():
        raise ConfigError(f"paper-report: --docs {args.docs} is not a directory; give the folder of the pages (docs)")
    for tree in (out, args.shared_init):
        if tree is not None and not tree.is_dir():
            raise ConfigError(
                f"paper-report: {tree} is not a directory; give the DIR `make paper` wrote (PAPER_OUT, "
                "by default runs/paper)"
            )
        if tree is not None and not any(tree.glob(f"*/*/{CONFIG}")):  # a report would list every grid as not run
            raise ConfigError(
                f"paper-report: no grid has run under {tree} (no run directory {tree}/GRID/RUN); run "
                f"them first (make paper PAPER_OUT={tree}); nothing was written"
            )
    text = report(out, args.shared_init)
    (out / REPORT).write_text(text)
    print(text)
    print(f"keel paper-report: wrote {out}/{REPORT}")
    if args.docs is not None:
        for page, name, what in write_docs(text, args.docs):
            print(f"keel paper-report: {page}: block {name!r}: {what}")
    return 0
