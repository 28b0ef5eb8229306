"""Which code made a tree's records, and what they cost: per grid, the commits its runs (or redundancy rows) were
made by, with torch's versions and the thread counts, a flag where a grid mixes commits, has runs made on a tree
whose code differed from its commit, or has runs that do not say (recorded before runs carried keel.provenance), and
the CPU time of its timed runs. `keel paper-report` prints it, so that a figure that moved can be traced to the code
that made it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from keel.artifacts import CONFIG
from keel.experiments.grids import GRIDS
from keel.experiments.records import (
    PROVENANCE_COLUMNS,
    REDUNDANCY_DIR,
    REDUNDANCY_TABLE,
    read_redundancy_rows,
    read_time_record,
)
from keel.provenance import short_commit

UNRECORDED = "unrecorded"


def _count(counter: Counter) -> str:
    return ", ".join(f"{key} ({n})" if len(counter) > 1 else str(key) for key, n in counter.most_common())


def grid_sessions(grid_dir: Path) -> tuple[int, list[list[dict]], list[float]]:
    """A grid's runs (or, for a redundancy grid, its checkpoints measured), what made each: a list per run, of the
    distinct sessions that made it (empty: it does not say), and the CPU seconds of each run that has a time record
    (a redundancy grid's rows have none)."""
    if (grid_dir / REDUNDANCY_TABLE).is_file():
        by_checkpoint: dict[str, list[dict]] = {}
        for row in read_redundancy_rows(grid_dir / REDUNDANCY_TABLE):
            session = {key: row[key] for key in PROVENANCE_COLUMNS} if row["torch"] else None
            by_checkpoint.setdefault(row["path"], [session] if session else [])
        return len(by_checkpoint), list(by_checkpoint.values()), []
    records = [read_time_record(path.parent) for path in sorted(grid_dir.glob(f"*/{CONFIG}"))]
    made = [(record or {}).get("made_by", []) for record in records]
    return len(records), made, [record["cpu_s"] for record in records if record is not None]


def origins_row(grid: str, grid_dir: Path) -> dict | None:
    count, made, cpu_s = grid_sessions(grid_dir)
    if not count:
        return None
    sessions = [session for run in made for session in run]
    commits = Counter(short_commit(s) for s in sessions)
    unrecorded = sum(1 for run in made if not run)
    if unrecorded:
        commits[UNRECORDED] = unrecorded
    dirty = sum(1 for run in made if any(s["dirty"] in (True, "True") for s in run))
    resumed = sum(1 for run in made if len(run) > 1)
    flags = ["mixes commits"] if len(commits) > 1 else []
    flags += [f"{dirty} made on changed code"] if dirty else []
    flags += [f"{resumed} resumed on other code or machine"] if resumed else []
    return {
        "grid": grid,
        "runs": count,
        "commits": _count(commits),
        "torch": _count(Counter(str(s["torch"]) for s in sessions)) or "-",
        "threads": _count(Counter(str(s["threads"]) for s in sessions)) or "-",
        "flag": "; ".join(flags) or "-",
        "timed": f"{len(cpu_s)} of {count}",
        "CPU-min per run": f"{min(cpu_s) / 60:.1f}-{max(cpu_s) / 60:.1f}" if cpu_s else "-",
        "CPU-hours (timed)": f"{sum(cpu_s) / 3600:.2f}" if cpu_s else "-",
    }


def origins_table(out: Path) -> list[dict]:
    """A row per grid of out that has run (each redundancy grid after the grid it measures)."""
    rows = []
    for grid in GRIDS:
        for name, directory in ((grid, out / grid), (f"{grid}/{REDUNDANCY_DIR}", out / grid / REDUNDANCY_DIR)):
            if directory.is_dir() and (row := origins_row(name, directory)) is not None:
                rows.append(row)
    return rows
