"""The hold map (keel.experiments.hold): a power law of the max LR in the hold, recovered with its interval, fitted
over every ramp and over the linear ramps alone; Keel against Pre-LN seed by seed on each ramp."""

from __future__ import annotations

import pytest

from keel.experiments.hold import WARMUP_HOLD, fit, hold_fits
from keel.experiments.roles import HOLD_GRIDS

HOLDS = (20, 40, 240, 380, 600)  # the geometric ramp, the ramp twice as slow and three linear slopes


def law(hold: float, scale: float, exponent: float) -> float:
    return scale * hold**exponent


def test_the_fit_recovers_a_power_law_and_its_value_at_the_warmup():
    wobble = (1.03, 0.97, 1.0)  # three seeds per hold, +-3% around the law
    points = [(h, law(h, 0.9, -0.3) * w) for h in HOLDS for w in wobble]
    result = fit(points)
    assert result["exponent"] == pytest.approx(-0.3, abs=0.02)
    assert result["exponent low"] < -0.3 < result["exponent high"] < 0
    assert result["value"] == pytest.approx(law(WARMUP_HOLD, 0.9, -0.3), rel=0.05)
    assert result["value low"] < law(WARMUP_HOLD, 0.9, -0.3) < result["value high"]
    assert (result["points"], result["holds"]) == (15, 5)
    assert fit([(240, 0.1), (240, 0.11), (240, 0.12)]) is None  # one hold: no line
    assert fit([(480, 0.14), (480, 0.15), (550, 0.08), (550, 0.085)]) is None  # holds 1.15x apart: no line


def row(point: tuple[int, int], scheme: str, hold: float, value: float, linear: bool) -> dict:
    """A collected probe row, as keel.experiments.maxlr_report writes it, of a run that learned and diverged."""
    ramp = "linear from 0, 0.0001 per step" if linear else "geometric from 0.001, 161 steps per decade"
    return {
        "row": scheme,
        "depth": point[0],
        "width": point[1],
        "ramp": ramp,
        "hold_steps": hold,
        "failure": "divergence",
        "resolved": True,
        "max_tolerable_lr": value,
        "max_lr_seen": value * 1.05,
    }


def test_the_linear_ramps_are_fitted_apart_from_the_geometric_ones():
    """Geometric ramps off the linear ramps' line (twice the linear line at a 20-step hold) steepen the
    fit over every ramp; the linear ramps' own fit keeps their exponent."""
    point = next(iter(HOLD_GRIDS))
    geometric, *linear = HOLD_GRIDS[point][:1] + HOLD_GRIDS[point][2:]
    rows: dict[str, list[dict]] = {geometric: [], **{grid: [] for grid in linear}}
    for seed_wobble in (1.02, 0.98):
        rows[geometric].append(row(point, "preln", 20, 0.6 * seed_wobble, linear=False))
        for grid, hold in zip(linear, (240, 380, 600)):
            rows[grid].append(row(point, "preln", hold, law(hold, 0.5, -0.2) * seed_wobble, linear=True))
    fits = {r["ramps"]: r for r in hold_fits(rows) if r["scheme"] == "preln"}
    assert set(fits) == {"every ramp", "linear ramps"}
    exponent = {ramps: float(r["exponent [95%]"].split()[0]) for ramps, r in fits.items()}
    assert exponent["linear ramps"] == pytest.approx(-0.2, abs=0.03)
    assert exponent["every ramp"] < exponent["linear ramps"] - 0.05
    assert fits["linear ramps"]["seeds x ramps"] == "6 (3 holds)"
    assert not any(r["scheme"] == "keel" for r in hold_fits(rows))  # no runs, no line
    close = {
        grid: [row(point, "keel", hold, law(hold, 0.5, -0.2) * w, linear=True) for w in (1.02, 0.98)]
        for grid, hold in zip(linear, (480, 500, 550))
    }
    (refused,) = [r for r in hold_fits(close) if r["ramps"] == "linear ramps"]
    assert refused["limit depends on the hold"] == "no line: the holds span 1.15x, under 2x"
    assert refused["seeds x ramps"] == "6 (3 holds)" and refused["exponent [95%]"] == "-"


def test_each_ramp_of_the_map_compares_keel_with_preln_seed_by_seed():
    from keel.experiments.trends import hold_pairs

    point = next(iter(HOLD_GRIDS))
    grid = HOLD_GRIDS[point][-1]
    rows = {
        grid: [
            {**row(point, scheme, 400, value, linear=True), "seed": seed, "resolved": resolved}
            for scheme, seed, value, resolved in (
                ("keel", "1", 0.09, True),
                ("preln", "1", 0.06, True),
                ("keel", "2", 0.08, True),
                ("preln", "2", 0.05, False),
            )
        ]
    }
    (pair,) = hold_pairs(rows)
    assert pair["grid"] == grid and pair["keel / preln (per seed)"] == "1.5; Pre-LN unresolved in 1"
    assert pair["verdict"] == "keel higher in 1 of 1 seeds (1 more not resolved)"
