"""A report's rows as CSV and markdown tables."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_table(rows: list[dict[str, Any]], csv_path: Path, md_path: Path | None = None) -> list[str]:
    """rows as CSV (every key any row has, in first-seen order) and, optionally, a markdown table."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    if md_path is not None:
        md_path.write_text(markdown_table(rows, columns) + "\n")
    return columns


def markdown_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """rows as a markdown table; columns: by default every key, in order of first appearance."""
    columns = list(dict.fromkeys(k for row in rows for k in row)) if columns is None else columns
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
