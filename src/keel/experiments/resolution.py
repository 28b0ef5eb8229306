"""The resolution of Table 1's linear probes in `keel paper-report`: each seed's max LR under changes that should not
matter (the resolution grids' rows, keel.experiments.grids.PERTURBATIONS) beside its Table 1 value, and the spread
over them per seed (max / min), with its median and max over seeds: how far a max LR moves for no reason, what a
difference between schemes must exceed before a Table 1 verdict rests on it."""

from __future__ import annotations

from keel.experiments.grids import PERTURBATIONS
from keel.experiments.maxlr_report import max_lr_value
from keel.experiments.stats import median

LABELS = {"threads2": "2 threads", "ulp": "init_std + 1 ulp"}  # PERTURBATIONS' names, in the report's words
TABLE1_VALUE = "Table 1"


def _spread(value: float | None) -> str:
    """4 digits: the probes' LR resolution, 5e-4 at a max LR near 0.1, is a spread of 1.005."""
    return "-" if value is None else f"{value:.4g}"


def _value(row: dict | None) -> str:
    """A run's max LR: '>= peak' where it never failed (a bound, no measurement), n.r. never learned, '' not run."""
    if row is None:
        return ""
    value = max_lr_value(row)
    return "n.r." if value is None else f"{value:.4g}" if row["failure"] else f">= {value:.4g}"


def resolution_tables(table1: list[dict], perturbed: list[dict]) -> tuple[list[dict], list[dict]]:
    """Per scheme and seed of the perturbed grid: its max LR in Table 1's grid and under each perturbation, and the
    spread, max / min over them (only where every one failed at a measured LR); then per scheme the spread's median
    and max over the seeds that have one."""
    by = {(r["row"], r["seed"]): r for r in [*table1, *perturbed]}
    seeds, summary = [], []
    for scheme in dict.fromkeys(r["scheme"] for r in perturbed):
        spreads, scheme_seeds = [], sorted({r["seed"] for r in perturbed if r["scheme"] == scheme})
        for seed in scheme_seeds:
            runs = {TABLE1_VALUE: by.get((scheme, seed))}
            runs |= {LABELS[name]: by.get((f"{scheme}-{name}", seed)) for name in PERTURBATIONS}
            measured = [max_lr_value(r) for r in runs.values() if r is not None and r["failure"]]
            spread = max(measured) / min(measured) if len(measured) == len(runs) and all(measured) else None
            spreads += [spread] if spread is not None else []
            seeds.append(
                {"scheme": scheme, "seed": seed, **{label: _value(r) for label, r in runs.items()}}
                | {"spread (max / min)": _spread(spread)}
            )
        summary.append(
            {
                "scheme": scheme,
                "seeds with a spread": f"{len(spreads)}/{len(scheme_seeds)}",
                "spread median": _spread(median(spreads)),
                "spread max": _spread(max(spreads, default=None)),
            }
        )
    return seeds, summary
