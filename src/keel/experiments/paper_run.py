"""`keel paper-run GRID...`: run the paper's grids (keel.experiments.grids), each its keel command with the settings
filled in; `--list SET` names the grids `make SET` runs, `--table` prints docs/grids.md's table of them.

A grid is a keel command and its arguments: "{NAME}" in one is a setting (`make paper SEEDS=1,2`, or
`keel paper-run --set SEEDS=1,2`), {OUT} the grid's directory under PAPER_OUT; a Scaled part differs at paper scale
(PAPER_SCALE=1: --paper-scale). Rerunning a grid skips its finished runs. Torch-free: the Makefile lists it.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import importlib
import shlex
from pathlib import Path

from keel.artifacts import CONFIG
from keel.errors import ConfigError
from keel.experiments.grids import CHECKPOINTS, GRIDS, SBATCH, SETS, SETTINGS, Scaled
from keel.experiments.records import REDUNDANCY, checkpoint_run, finished, load_run_config, read_redundancy_rows


def unmeasured_checkpoints(grid_dir: str) -> list[str]:
    """The last.ckpt of each finished run of the grid at grid_dir (its records show every step: a run still training
    has a last.ckpt too, from the middle of its schedule) that has no rows in the grid's redundancy.csv yet: a rerun
    measures only the runs finished since (`keel redundancy CKPT --append` measures one again)."""
    table = Path(grid_dir) / REDUNDANCY
    try:
        measured = {checkpoint_run(row["path"]) for row in read_redundancy_rows(table)}
    except ConfigError as error:
        raise ConfigError(f"{error}; move it aside and measure the grid again") from None
    runs = [(path, Path(path).parents[1]) for path in sorted(glob.glob(f"{grid_dir}/*/checkpoints/last.ckpt"))]
    return [
        path
        for path, run in runs
        if run.name not in measured and (run / CONFIG).is_file() and finished(run, load_run_config(run))
    ]


def command(
    name: str,
    values: dict[str, str],
    paper_scale: bool = False,
    sbatch: tuple[str, ...] = (),
    checkpoints=unmeasured_checkpoints,
) -> list[str] | None:
    """The grid's keel command line (after `keel`); values: each setting's, OUT's and PAPER_OUT's. None for a
    redundancy grid with no checkpoint to measure."""
    grid = GRIDS[name]
    values = {**values, "OUT": f"{values['PAPER_OUT']}/{name}"}
    argv = [grid.command]
    for part in grid.args:
        for token in (part.paper if paper_scale else part.miniature) if isinstance(part, Scaled) else (part,):
            if token == SBATCH:
                argv += [f"--sbatch={option}" for option in sbatch]
            elif token == CHECKPOINTS:
                if not (paths := checkpoints(f"{values['PAPER_OUT']}/{grid.over}")):
                    return None
                argv += paths
            else:  # split as the shell splits the Makefile's words
                argv += token.format_map(values).split()
    for schemes, seeds in grid.only:
        argv += [
            word
            for scheme in schemes
            for seed in values[seeds].replace(",", " ").split()
            for word in ("--only", f"{scheme}-d{grid.point[0]}-s{seed}")
        ]
    return argv


def grid_set(name: str, paper_scale: bool = False) -> list[str]:
    """The grids `make <name>` runs, in order; at paper scale `make paper` runs only those written for a cluster."""
    return [grid for grid, g in GRIDS.items() if name in g.sets and (g.cluster or not paper_scale or name != "paper")]


def table() -> str:
    """docs/grids.md's table of the grids: each one's command with its settings named ($SEEDS, ...)."""
    values = {key: f"${key}" for key in (*SETTINGS, "PAPER_OUT")}
    lines = ["| `make` | also run by | command |", "|---|---|---|"]
    for name, grid in GRIDS.items():
        scales = (False, True) if any(isinstance(part, Scaled) for part in grid.args) else (False,)
        for paper_scale in scales:
            argv = command(
                name, values, paper_scale, ("$PAPER_SBATCH",), lambda grid_dir: [f"{grid_dir}/*/checkpoints/last.ckpt"]
            )
            target = f"`paper-{name}`" + (" PAPER_SCALE=1" if paper_scale else "")
            lines.append(f"| {target} | {', '.join(f'`{s}`' for s in grid.sets)} | `keel {' '.join(argv)}` |")
    lines += ["", "| setting | default |", "|---|---|"]
    lines += [f"| `{key}` | `{value}` |" for key, value in SETTINGS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    argv, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="keel paper-run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="keel paper-run GRID... [options] [-- ARGS...] | --list SET | --table",
    )
    parser.add_argument("grids", nargs="*", metavar="GRID", help="run these, in order (`--list paper` names them)")
    parser.add_argument("--out", default="runs/paper", help="PAPER_OUT: each grid goes to OUT/GRID")
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"a setting instead of its default (repeatable): {', '.join(SETTINGS)}",
    )
    parser.add_argument("--paper-scale", action="store_true", help="PAPER_SCALE=1: the paper's model")
    parser.add_argument("--sbatch", action="append", default=[], help="at paper scale, an #SBATCH option (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print each grid's command, run nothing")
    parser.add_argument("--list", metavar="SET", choices=SETS, help="print the grids `make SET` runs")
    parser.add_argument("--table", action="store_true", help="print docs/grids.md's table of the grids")
    args = parser.parse_args(argv)
    if args.list or args.table:
        print(" ".join(grid_set(args.list, args.paper_scale)) if args.list else table())
        return 0
    if not args.grids:
        raise ConfigError(f"no grid given; the grids: {', '.join(GRIDS)} (`keel paper-run --table` describes them)")
    for grid in args.grids:
        if grid not in GRIDS:
            close = difflib.get_close_matches(grid, GRIDS, n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ConfigError(f"unknown grid {grid}; {hint}`keel paper-run --table` lists the {len(GRIDS)} grids")
    values = {**SETTINGS, "PAPER_OUT": args.out}
    for item in args.settings:
        key, sep, value = item.partition("=")
        if not sep or key not in SETTINGS:
            raise ConfigError(f"--set {item!r}: expected NAME=VALUE with NAME one of {', '.join(SETTINGS)}")
        values[key] = value
    if args.sbatch and not args.paper_scale:
        raise ConfigError("--sbatch: only at paper scale (--paper-scale), where Table 1 is written as SLURM arrays")
    for grid in args.grids:
        if (grid_command := command(grid, values, args.paper_scale, tuple(args.sbatch))) is None:
            over = f"{args.out}/{GRIDS[grid].over}"
            print(
                f"keel paper-run {grid}: nothing to measure: every finished run of {over} has its rows in "
                f"{over}/{REDUNDANCY} (`make paper-{GRIDS[grid].over}` trains the others)",
                flush=True,
            )
            continue
        command_line = [*grid_command, *extra]
        print(f"keel {shlex.join(command_line)}", flush=True)
        if not args.dry_run:
            status = importlib.import_module(f"keel.experiments.{command_line[0]}").main(command_line[1:])
            if status:
                return status
    return 0
