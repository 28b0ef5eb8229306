"""redundancy.csv, `keel redundancy`'s table (a row per checkpoint and removed block): its columns and its one reader,
torch-free for `keel paper-run` (which runs it measures) and `keel paper-report` (Section 8) as well as `--append`."""

from __future__ import annotations

import csv
from pathlib import Path

from keel.errors import ConfigError

NUMBERS = {"depth": int, "block": int, "val_tokens": int, "ppl_base": float, "ppl_removed": float,
           "ppl_increase": float, "loss_increase": float}  # a row's numbers, by column
COLUMNS = ("checkpoint", "path", "scheme", *NUMBERS)


def read_rows(table: Path) -> list[dict]:
    """The rows of a redundancy.csv, numbers parsed (none if there is no table, or an empty one); a table with
    other columns is refused."""
    if not table.is_file():
        return []
    with open(table, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is not None and set(reader.fieldnames) != set(COLUMNS):
            raise ConfigError(f"{table} is not a redundancy.csv (columns {', '.join(reader.fieldnames)}; expected "
                              f"{', '.join(sorted(COLUMNS))})")
        return [{key: NUMBERS.get(key, str)(value) for key, value in row.items()} for row in reader]


def checkpoint_run(path: str) -> str:
    """The name of the run a checkpoint is of (<grid>/<run>/checkpoints/<file>)."""
    return Path(path).parents[1].name
