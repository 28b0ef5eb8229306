"""Table 1 in `keel paper-report`: a grid's seed table (each seed's max LR and loss-optimal LR per scheme, medians and
ranges) and its seed-by-seed sign tests, under the report's criterion and a stricter bar."""

from __future__ import annotations

from keel.experiments.maxlr_report import compare, inits, max_lr_value
from keel.experiments.stats import fmt, fmt_median_range, median

STRICT = "best + 0.5"  # the sensitivity table's stricter bar, under which Table 1's sign tests are repeated


def _cell(row: dict) -> str:
    """One run in a table cell: max LR (how far its held-out loss there is above the best before it), or >= peak,
    or n.r.; then the loss-optimal LR and loss."""
    value, above = max_lr_value(row), row.get("above_best_at_max_lr")
    head = (
        "n.r."
        if value is None
        else f">= {value:.3g}"
        if not row["failure"]
        else f"{value:.3g}" + (f" (+{above:.2f})" if above is not None else "")
    )
    return f"{head} / {fmt(row['loss_optimal_lr'])} ({fmt(row['best_heldout'])})"


def seed_table(rows: list[dict]) -> list[dict]:
    """Per row (scheme): every seed's max LR / loss-optimal LR (best held-out), medians and ranges."""
    table = []
    seeds = sorted({r["seed"] for r in rows})
    for label in dict.fromkeys(r["row"] for r in rows):
        runs = {r["seed"]: r for r in rows if r["row"] == label}
        values = [v for v in map(max_lr_value, runs.values()) if v is not None]
        optimal = [r["loss_optimal_lr"] for r in runs.values() if r["loss_optimal_lr"] is not None]
        # a slow learner's bar is the unigram cap: how far above its best a run still counted as sustaining
        above = [
            r["above_best_at_max_lr"]
            for r in runs.values()
            if max_lr_value(r) is not None and r.get("above_best_at_max_lr") is not None
        ]
        entry = {"scheme": label, "init": inits(runs.values())}
        entry |= {f"seed {seed}": _cell(runs[seed]) if seed in runs else "" for seed in seeds}
        entry |= {
            "resolved": f"{len(values)}/{len(runs)}",
            "max LR median [range]": fmt_median_range(values),
            "held-out at it above the best, median [range]": fmt_median_range(above),
            "loss-optimal LR median [range]": fmt_median_range(optimal),
            "best held-out median": fmt(
                median([r["best_heldout"] for r in runs.values() if r["best_heldout"] is not None])
            ),
        }
        table.append(entry)
    return table


def sign_tests(rows: list[dict], pairs: list[tuple[str, str]], criterion: str | None = None) -> list[dict]:
    """Seed-by-seed sign tests of the max LR at each depth of rows (keel.experiments.maxlr_report.compare), under
    the report's criterion or a stricter one of its sensitivity table."""
    return [
        test
        for depth in dict.fromkeys(r["depth"] for r in rows)
        for a, b in pairs
        if (test := compare(rows, a, b, depth, criterion)) is not None
    ]
