"""keel.experiments.lr_transfer's reading of complete-run LR sweeps: the optimum as the vertex of a parabola in log2 LR,
the loss read off at another LR, the loss given up at another width's optimum; every expected value computed here
from curves whose optimum is known by construction."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from keel.experiments.lr_transfer import SweepRun, depth_transfer, loss_at, loss_given_up, optimum, width_transfer

ROOT = Path(__file__).resolve().parents[1]
GOALS = "goals (move within 1.5x, given up <= 0.02 nat)"
LRS = [0.0025, 0.005, 0.01, 0.02, 0.04]


def curve(best: float, floor: float = 4.0, k: float = 0.1) -> list[tuple[float, float]]:
    """A sweep whose loss is a parabola in log2 LR with its vertex at LR `best`."""
    return [(lr, floor + k * math.log2(lr / best) ** 2) for lr in LRS]


def runs(
    width: int,
    parametrization: str,
    bests: dict[int, float],
    scheme: str = "keel",
    depth: int = 8,
    rule: int | None = None,
    steps: int = 1000,
) -> list[SweepRun]:
    return [
        SweepRun(scheme, parametrization, depth, width, steps, lr, seed, loss, rule)
        for seed, best in bests.items()
        for lr, loss in curve(best)
    ]


def test_the_optimum_is_the_vertex_of_the_parabola_through_the_best_point_and_its_neighbours():
    found = optimum(curve(0.013))
    assert found.lr == pytest.approx(0.013) and found.loss == pytest.approx(4.0) and found.edge == ""
    # only the three points around the best count: a far point off the parabola does not move the vertex
    bent = curve(0.013)
    bent[-1] = (bent[-1][0], 9.0)
    assert optimum(bent).lr == pytest.approx(0.013)
    # the best point at an edge: no vertex, the edge's LR, marked
    falling = optimum(curve(0.1))
    assert (falling.lr, falling.edge, falling.cell()) == (0.04, "highest", ">= 0.04")
    assert optimum(curve(0.001)).cell() == "<= 0.0025"
    assert optimum(curve(0.013)[:2]) is None  # two LRs: no parabola


def test_the_loss_at_another_lr_is_read_off_the_local_parabola_and_never_extrapolated():
    points = curve(0.013)
    assert loss_at(points, 0.01) == pytest.approx(points[2][1])  # a grid point: its own loss
    assert loss_at(points, 0.007) == pytest.approx(4.0 + 0.1 * math.log2(0.007 / 0.013) ** 2)
    assert loss_at(points, 0.001) is None and loss_at(points, 0.05) is None


def test_the_loss_given_up_at_the_base_widths_optimum_per_seed():
    target = runs(256, "sp", {1: 0.005, 2: 0.0025 * 2**0.75})
    given = loss_given_up(target, 0.01)
    assert [row["seed"] for row in given] == [1, 2]
    assert given[0]["given up (nats)"] == pytest.approx(0.1 * 1.0**2)  # one factor of 2 from its optimum
    assert given[1]["given up (nats)"] == pytest.approx(0.1 * 1.25**2)


def test_width_transfer_gives_the_move_and_the_loss_given_up_under_each_parametrization():
    # sp: the optimum falls 4x from width 64 to 256; mup: it stays (for the third seed as well)
    seeds = (1, 2, 3)
    sweeps = {
        (64, "sp"): (runs(64, "sp", dict.fromkeys(seeds, 0.01)), [{}] * 15),
        (256, "sp"): (runs(256, "sp", dict.fromkeys(seeds, 0.0025 * 2**0.75)), [{}] * 15),
        (64, "mup"): (runs(64, "mup", dict.fromkeys(seeds, 0.01)), [{}] * 15),
        (256, "mup"): (runs(256, "mup", {1: 0.01, 2: 0.01, 3: 0.01 * 2**0.25}), [{}] * 15),
    }
    text = "\n".join(width_transfer(sweeps, 64, 256))
    verdicts = {
        line.split(" | ")[0].strip("| "): line
        for line in text.splitlines()
        if line.startswith("| sp") or line.startswith("| mup")
    }
    assert "| 0.42x |" in verdicts["sp"]  # 0.0025 * 2^0.75 / 0.01
    assert "s1: 0.1562, s2: 0.1562" in verdicts["sp"]  # 1.25 factors of 2 from its own optimum: 0.1 * 1.25^2
    assert "s1: 0.0000, s2: 0.0000, s3: 0.0063" in verdicts["mup"]  # 0.1 * 0.25^2 for the third seed
    assert verdicts["sp"].endswith("| move missed, loss missed (within it in 0 of 3 seeds) |")
    assert verdicts["mup"].endswith("| move met, loss met (within it in 3 of 3 seeds) |")
    # two seeds at width 256: no verdict
    sweeps[256, "mup"] = (runs(256, "mup", {1: 0.01, 2: 0.01}), [{}] * 15)
    (mup,) = [line for line in width_transfer(sweeps, 64, 256)[2].splitlines() if line.startswith("| mup")]
    assert mup.endswith("| n = 2, no verdict |")


def test_the_depth_table_follows_a_depth_rule_from_plain_pre_ln_at_its_base_depth_and_equal_steps():
    """Pre-LN's optimum halves per 4x depth; under the 1/L rule from 16 blocks it holds. Depths are compared at equal
    steps only (the optimum moves with the run's length: here 1.25x higher at 500 steps), and the rule's row starts
    from plain Pre-LN's 16-block optimum of the same length (the same model there); each row keeps its own label."""
    seeds = dict.fromkeys((1, 2, 3), 0.0)

    def grid(depth: int, best: float, steps: int = 2000, rule: int | None = None):
        return runs(32, "sp", {seed: best for seed in seeds}, "preln", depth, rule, steps), [{"scheme": "preln"}] * 15

    text = depth_transfer(
        {
            "tuned-depth-d16": grid(16, 0.02),
            "lr-d64": grid(64, 0.01),
            "tuned-depth-d256": grid(256, 0.00625, steps=500),
            "tuned-short-depth-d16": grid(16, 0.025, steps=500),
            "depth-rule-d64": grid(64, 0.02, rule=16),
            "depth-rule-d256": grid(256, 0.025 * 2**-0.25, steps=500, rule=16),
        }
    )
    moves = {tuple(cell.strip() for cell in line.split("|")[1:3]): line for line in text[2].splitlines()[2:]}
    assert "| preln, branches x 16/N, 64 x 32, 2000 steps (depth-rule-d64) | 15 of 15 |" in text[0]
    assert "| preln, 16 x 32, 500 steps (tuned-short-depth-d16) | 15 of 15 |" in text[0]
    assert list(moves) == [
        ("preln", "2000"),
        ("preln", "500"),
        ("preln, branches x 16/N", "2000"),
        ("preln, branches x 16/N", "500"),
    ]
    assert moves["preln", "2000"].endswith("| 16: 0.02, 64: 0.01 | 2x |")
    assert moves["preln", "500"].endswith("| 16: 0.025, 256: 0.00625 | 4x |")
    assert moves["preln, branches x 16/N", "2000"].endswith("| 16: 0.02, 64: 0.02 | 1x |")
    assert moves["preln, branches x 16/N", "500"].endswith("| 16: 0.025, 256: 0.021 | 1.19x |")
    # a grid committed part-way (seed 1 alone at 256 blocks): its optimum says from how many seeds
    seed_one = runs(32, "sp", {1: 0.00625}, "preln", 256, None, 500), [{"scheme": "preln"}] * 15
    text = depth_transfer({"tuned-short-depth-d16": grid(16, 0.025, steps=500), "tuned-depth-d256": seed_one})
    assert "| preln, 256 x 32, 500 steps (tuned-depth-d256) | 5 of 15 |" in text[0]
    assert text[2].splitlines()[-1].endswith("| 16: 0.025, 256: 0.00625 (1 seed) | 4x |")


def test_the_transfer_tables_of_docs_lr_transfer_are_what_the_report_writes_over_the_committed_records():
    """docs/lr-transfer.md's complete-run tables are blocks `keel paper-report --docs docs` writes
    (keel.experiments.doc_blocks); they read the sweeps' final held-out losses alone, so the committed records
    rebuild them anywhere, in make test."""
    from keel.experiments.doc_blocks import blocks, mark_tables
    from keel.experiments.lr_transfer import sections

    written = blocks(mark_tables("\n".join(sections(ROOT / "docs/experiments/runs"))))
    page = blocks((ROOT / "docs/lr-transfer.md").read_text())
    assert len(written) == 4  # the width sweeps and their verdicts; the depth sweeps and the optimum against depth
    for name, block in written.items():
        assert page.get(name) == block, f"docs/lr-transfer.md's {name!r} block is not the report's: --docs docs"


def test_the_readmes_mup_row_quotes_the_width_transfer_verdict():
    """README's `model.parametrization` row quotes the mup row of docs/lr-transfer.md's verdict table (held to the
    records above): the move of the optimum and the median [range] of the loss given up; and its words on depth and
    run length to the depth tables."""
    from keel.experiments.doc_blocks import blocks

    page = blocks((ROOT / "docs/lr-transfer.md").read_text())
    block = page["LR transfer across width on complete runs: Keel, 8 blocks, sp and mup (base width 64), table 2"]
    header, _, *rows = block.splitlines()[1:-1]
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    verdicts = {
        row.split("|")[1].strip(): dict(zip(columns, (c.strip() for c in row.strip("|").split("|")))) for row in rows
    }
    mup, sp = verdicts["mup"], verdicts["sp"]
    (readme,) = [
        line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `model.parametrization`")
    ]
    assert f"moved {mup['move 64 -> 256']} to width 256" in readme
    assert f"gave up a median {mup['median [range]'].replace(' [', ' nat [')}" in readme
    within, seeds = map(int, re.search(r"within it in (\d+) of (\d+) seeds", mup[GOALS]).groups())
    met = mup[GOALS].startswith("move met, loss met")
    assert f"{'met' if met else 'missed'} by the median, missed by {seeds - within} seed of {seeds}" in readme
    assert (
        f"under sp it moved {sp['move 64 -> 256']} and gave up a median {sp['median [range]'].replace(' [', ' nat [')}"
        in readme
    )
    # and its depth and run-length words to the depth tables: Keel's shallowest / deepest at 2,000 steps, and its
    # 16 x 32 optima (mean curve) over 2,000 and 500 steps
    depth = page["The LR optimum against depth, complete runs"]
    (moves,) = [
        row
        for row in page["The LR optimum against depth, complete runs, table 2"].splitlines()
        if row.startswith("| keel | 2000 |")
    ]
    optima = {
        steps: row.split("|")[-2].split(" (")[0].strip()
        for steps in (2000, 500)
        for row in depth.splitlines()
        if row.startswith(f"| keel, 16 x 32, {steps} steps ")
    }
    assert f"Keel's falls {moves.split('|')[-2].strip()} from 16 to 64 blocks" in readme
    assert f"at 16 x 32 it is {optima[2000]} over 2,000 steps, {optima[500]} over 500" in readme
