"""`keel sweep`: grids of complete training runs, and `keel sweep collect DIR`: one table of what they gave.

The grid is the product of the axes given (an axis left out keeps the configured value); --alphas apply to keel
runs only, resolved per depth; --fixed-params gives each depth the width closest to the configured model's
non-embedding parameter count. --emit run trains the runs here, then collects; commands|slurm write them out.
Runs go to DIR/<name> and resume (resume=auto); a rerun skips the finished ones, and each run's CPU and wall
seconds go to DIR/<name>/sweep_time.json. `collect` tabulates each run's last validation loss, task scores
and stability verdict into DIR/sweep.csv and sweep.md, plots each metric against each axis that varies
(docs/grids.md, "Grids of complete runs") and, for an LR sweep of 3 LRs or more, prints the LR to train with: the
optimum of the seeds' mean final validation loss (docs/lr-transfer.md, "The recipe").
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
from dataclasses import asdict
from pathlib import Path

from keel.artifacts import CONFIG
from keel.cli_args import OneLineErrorParser, comma_list
from keel.config import load_config
from keel.config.model import scheme_named
from keel.errors import ConfigError
from keel.experiments.axes import non_embedding_params, resolve_alpha, slug, width_for_budget
from keel.experiments.launch import GridCell, slurm_script
from keel.experiments.lr_transfer import mean_curve, optimum
from keel.experiments.plots import plot_lines
from keel.experiments.records import (
    COMMANDS,
    MANIFEST,
    SBATCH_SCRIPT,
    SWEEP_PLOT,
    SWEEP_SUMMARY,
    SWEEP_TABLE,
    SWEEP_TIME,
    already_trained,
    run_row,
    write_manifest,
)
from keel.experiments.stats import fmt
from keel.experiments.tables import write_table

PLOT_AXES = {"lr": "learning rate", "alpha": "Keel alpha", "depth": "depth (blocks)"}
PLOT_METRICS = {"val_loss": "validation loss", "max_tolerable_lr": "max tolerable LR"}
AXIS_KEYS = {
    "scheme": "model.scheme",
    "depth": "model.depth",
    "width": "model.width",
    "lr": "optim.lr",
    "seed": "run.seed",
}
AXIS_PREFIX = {"scheme": "", "depth": "d", "width": "w", "lr": "lr", "alpha": "a", "seed": "s"}
IDENTITY = ("scheme", "depth", "lr", "alpha_expr", "seed")  # what tells the curves of one plot apart


def build_grid(args: argparse.Namespace) -> list[GridCell]:
    # the runs' model as configured, of the first scheme swept: a key only some schemes take (branch_base_depth)
    # is checked against a scheme the runs use
    scheme = [f"model.scheme={args.schemes[0]}"] if args.schemes else []
    base = load_config(args.config, [*args.overrides, *scheme]).model
    widths = {}
    if args.fixed_params:
        if not args.depths:
            raise ConfigError("sweep --fixed-params: give the depths to trade against width with --depths")
        budget = non_embedding_params(base)
        widths = {d: width_for_budget(base, d, budget) for d in args.depths}
    runs = []
    for scheme, depth, lr, seed in itertools.product(
        args.schemes or [None], args.depths or [None], args.lrs or [None], args.seeds or [None]
    ):
        alpha_field = scheme_named(scheme or base.scheme).alpha_field
        alphas = args.alphas if args.alphas and alpha_field else [None]
        for alpha in alphas:
            values = {
                "scheme": scheme,
                "depth": depth,
                "width": widths.get(depth),
                "lr": lr,
                "alpha": alpha,
                "seed": seed,
            }
            axes = {axis: str(value) for axis, value in values.items() if value is not None}
            overrides = [f"{AXIS_KEYS[axis]}={value}" for axis, value in axes.items() if axis != "alpha"]
            if alpha is not None:
                overrides.append(f"model.{alpha_field}={resolve_alpha(alpha, n_sublayers=2 * (depth or base.depth))!r}")
            name = "-".join(AXIS_PREFIX[axis] + slug(value) for axis, value in axes.items()) or "base"
            runs.append(GridCell(name, axes, overrides))
    return runs


def pretrain_command(args: argparse.Namespace, run: GridCell, out: Path) -> str:
    config = ["--config", args.config] if args.config else []
    return shlex.join(["keel", "pretrain", *config, *args.overrides, *run.overrides, f"run.dir={out / run.name}"])


# ---------------------------------------------------------------------------------------------------- collect


def collect(out: Path) -> list[dict]:
    """One row per run of the sweep in `out` (sweep.csv, sweep.md) and the plots; a listed run not started yet
    gets a row saying so."""
    manifest = out / MANIFEST
    if manifest.is_file():
        runs = json.loads(manifest.read_text())["runs"]
    else:
        runs = [{"name": path.parent.name, "axes": {}} for path in sorted(out.glob("*/config.yaml"))]
    rows = []
    for run in runs:
        run_dir = out / run["name"]
        row = run_row(run_dir) if (run_dir / CONFIG).is_file() else {"run": run["name"], "status": "not started"}
        if "alpha" in run["axes"]:
            row["alpha_expr"] = run["axes"]["alpha"]
        if "row" in run["axes"]:  # a keel maxlr grid: the scheme or variant the run belongs to
            row["row"] = run["axes"]["row"]
        rows.append(row)
    if not rows:
        raise ConfigError(f"sweep collect: no runs in {out} (no {MANIFEST} and no */config.yaml)")
    write_table(rows, out / SWEEP_TABLE, out / SWEEP_SUMMARY)
    plot_sweep(rows, out)
    return rows


def lr_optima(rows: list[dict]) -> list[str]:
    """The LR to train with, per group of finished runs that differ only in LR and seed: the optimum of the seeds'
    mean final validation loss over the LRs every seed finished (keel.experiments.lr_transfer.optimum: the vertex of
    the parabola in log2 LR through the best LR and its neighbours), where there are three such LRs or more."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("val_loss") is not None and r.get("val_step") == r.get("max_steps", 0) - 1:
            groups.setdefault((r["scheme"], r["depth"], r["width"], r.get("alpha")), []).append(r)
    lines = []
    for (scheme, depth, width, _), runs in groups.items():
        seeds = {r["seed"] for r in runs}
        curve = mean_curve([(r["lr"], r["val_loss"]) for r in runs], len(seeds))
        if (best := optimum(curve)) is None:
            continue
        where = {"lowest": " (the sweep's lowest LR: extend it below)", "highest": " (its highest: extend above)"}
        lines.append(
            f"{scheme} {depth} x {width}: optimum LR {best.cell()}{where.get(best.edge, '')}, over {len(curve)} LRs "
            f"x {len(seeds)} seed(s): train with optim.lr={fmt(best.lr)}"
        )
    return lines


def plot_sweep(rows: list[dict], out: Path) -> None:
    for (metric, ylabel), (axis, xlabel) in itertools.product(PLOT_METRICS.items(), PLOT_AXES.items()):
        have = [r for r in rows if r.get(metric) is not None and r.get(axis) is not None]
        if len({r[axis] for r in have}) < 2:
            continue
        own = "alpha_expr" if axis == "alpha" else axis
        keys = [k for k in IDENTITY if k != own and len({r.get(k) for r in have}) > 1]  # label by what varies
        groups: dict[tuple, list[dict]] = {}
        for r in have:
            groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
        curves = []
        for group, members in groups.items():
            members.sort(key=lambda r: r[axis])
            label = " ".join(f"{k}={v}" for k, v in zip(keys, group)) or metric
            curves.append((label, [r[axis] for r in members], [r[metric] for r in members]))
        plot_lines(
            curves,
            out / SWEEP_PLOT.format(metric=metric, axis=axis),
            xlabel,
            ylabel,
            f"{out.name}: {ylabel} against {xlabel}",
            xscale="log" if axis in ("lr", "alpha") else "linear",
        )


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    if argv[:1] == ["collect"]:
        parser = argparse.ArgumentParser(prog="keel sweep collect", description="Collect a sweep's results.")
        parser.add_argument("dir")
        out = Path(parser.parse_args(argv[1:]).dir)
        rows = collect(out)
        print(f"keel sweep collect: {len(rows)} runs -> {out}/sweep.csv, sweep.md, plots")
        for line in lr_optima(rows):
            print(f"keel sweep collect: {line}")
        return 0
    parser = OneLineErrorParser(
        prog="keel sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schemes", type=comma_list(str), default=[])
    parser.add_argument("--depths", type=comma_list(int), default=[])
    parser.add_argument("--lrs", type=comma_list(str), default=[])
    parser.add_argument("--alphas", type=comma_list(str), default=[], help="Keel alpha: numbers or expressions in L")
    parser.add_argument("--seeds", type=comma_list(int), default=[])
    parser.add_argument(
        "--fixed-params", action="store_true", help="width per depth at the configured model's parameter count"
    )
    parser.add_argument("--out", default="runs/sweep")
    parser.add_argument("--emit", choices=("run", "commands", "slurm"), default="run")
    parser.add_argument("--sbatch", action="append", default=[], help="an extra #SBATCH option (repeatable)")
    parser.add_argument("--config", help="YAML merged over conf/config.yaml")
    parser.add_argument("overrides", nargs="*", help="group=choice or key.path=value, for every run")
    args = parser.parse_intermixed_args(argv)  # options may follow overrides (make paper ARGS=...)
    out = Path(args.out)
    runs = build_grid(args)
    # every run's config is checked before anything is written, emitted or trained
    configs = [load_config(args.config, [*args.overrides, *run.overrides, f"run.dir={out / run.name}"]) for run in runs]
    protocol = {"config": args.config, "overrides": args.overrides}
    if note := write_manifest(out, protocol, [asdict(run) for run in runs]):
        print(f"keel sweep: {note}", flush=True)
    if args.emit == "run":
        from keel.experiments.timing import train_timed  # lightning: imported only when training

        for i, (run, cfg) in enumerate(zip(runs, configs), 1):
            if already_trained(cfg.run.dir, cfg):  # from its records (and checkpoint): a rerun never trains it again
                print(f"keel sweep: run {i}/{len(runs)}: {run.name}: finished before, skipped", flush=True)
                continue
            print(f"keel sweep: run {i}/{len(runs)}: {run.name}", flush=True)
            total = train_timed(cfg, Path(cfg.run.dir) / SWEEP_TIME)
            print(
                f"keel sweep: run {i}/{len(runs)}: {run.name}: done ({total['wall_s']:.0f} s wall, "
                f"{total['cpu_s']:.0f} s CPU)",
                flush=True,
            )
        rows = collect(out)
        print(f"keel sweep: {len(runs)} runs -> {out}/sweep.csv, sweep.md, plots")
        for line in lr_optima(rows):
            print(f"keel sweep: {line}")
        return 0
    commands = [pretrain_command(args, run, out) for run in runs]
    if args.emit == "commands":
        path = out / COMMANDS
        path.write_text("".join(command + "\n" for command in commands))
    else:
        path = out / SBATCH_SCRIPT
        path.write_text(slurm_script(commands, out, args.sbatch))
    print(f"keel sweep: {len(runs)} runs -> {path}; afterwards: keel sweep collect {out}")
    return 0
