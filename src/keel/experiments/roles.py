"""The roles `keel paper-report` reads the paper's grids (keel.experiments.grids) in: Table 1's seed tables, the
trends (each a point per grid of one axis), the hold map, the checks beside them and the trained models' grids."""

from __future__ import annotations

from keel.experiments.grids import GRIDS, MUP_WIDTHS


def axis(index: int, *points: str | tuple[str, ...]) -> dict[int, tuple[tuple[str, ...], int, int]]:
    """A trend: its value (the point's blocks, index 0, or width, 1) -> (the point's grids, blocks, width); a point's
    grids are read together (Keel's and Pre-LN's beside the Post-LN family's at its gentler slope)."""
    trend = {}
    for names in points:
        names = (names,) if isinstance(names, str) else names
        point = GRIDS[names[0]].point
        if any(GRIDS[name].point != point for name in names):
            raise ValueError(f"{names}: one point of a trend, but their grids' sizes differ")
        trend[point[index]] = (names, *point)
    return trend


TABLE1 = {  # grid -> the title of its seed table, in report order
    "linear-d16": "Table 1, 16 blocks x 64",
    "linear-d64": "Table 1, 64 blocks x 32",
    "linear-gentle-d16": "Table 1's Post-LN family, 16 blocks x 64, a 4x gentler slope",
    "linear-gentle-d64": "Table 1's Post-LN family, 64 blocks x 32, a 4x gentler slope",
    "table1-d16": "Table 1, 16 blocks x 64",
    "table1-d64": "Table 1, 64 blocks x 32",
    "hybridnorm": "HybridNorm, ramp from 1e-4 over 720 steps",
}
DEPTH_TREND = axis(0, "depth-d16", "table1-d64", "depth-d256")
WIDTH_TREND = axis(1, "depth-d16", "table1-d16", "width-w128", "width-w256")
BATCH_POINT = axis(1, "batch-8x")  # 8x the tokens per step, plotted on the width panel
LINEAR_DEPTH_TREND = axis(
    0,
    ("linear-depth-d16", "linear-gentle-depth-d16"),
    ("linear-d64", "linear-gentle-d64"),
    ("linear-depth-d256", "linear-gentle-depth-d256"),
)
LINEAR_SLOW_DEPTH_TREND = axis(0, "linear-slow-depth-d16", "hold-d64-slow", "linear-slow-depth-d256")
LINEAR_WIDTH_TREND = axis(1, "linear-depth-d16", "linear-d16", "linear-width-w128", "linear-width-w256")
MUP_WIDTH_TREND = axis(1, *(f"mup-width-w{width}" for width in MUP_WIDTHS))  # against WIDTH_TREND's sp grids
# the hold map, per point: the grids whose ramps it compares, slowest hold last
HOLD_GRIDS = {
    GRIDS[names[0]].point: names
    for names in (
        ("table1-d16", "ramp-2x", "hold-d16-fast", "linear-d16", "hold-d16-slow"),
        ("table1-d64", "hold-d64-fast", "linear-d64", "hold-d64-slow"),
    )
}
RAMP_CHECK = ("table1-d16", "ramp-2x")  # the same seeds on the ramp and on one twice as slow
RESOLUTION_PAIRS = (("linear-d16", "resolution-d16"), ("linear-d64", "resolution-d64"))  # Table 1, its perturbed
NOGAIN_PAIRS = (("table1-d16", "nogain-d16"), ("table1-d64", "nogain-d64"), ("depth-d256", "nogain-d256"))
DEEP_RUNS = {"deep1024": "", "deep1024-nogain": " (out_norm_gain=false)"}  # grid -> its runs' label suffix
MAXLR_GRIDS = tuple(name for name, grid in GRIDS.items() if grid.command == "maxlr")
LR_GRIDS = ("lr-d16", "lr-d64")  # Table 2, Sections 8 and 9
TUNED_GRIDS = ("tuned-depth-d16", "tuned-depth-d256")
DEPTH_GRIDS = ("tuned-depth-d16", "lr-d64", "tuned-depth-d256")  # Table 3's depths at width 32
# tuned-depth-d256's 500 steps at 16 blocks: the shallow point of the same length, for the LR optimum against depth
SHORT_DEPTH_GRIDS = ("tuned-short-depth-d16",)
# Pre-LN with the 1/L branch rule from 16 blocks: at 16 its runs are tuned-depth-d16's Pre-LN ones
DEPTH_RULE_GRIDS = ("depth-rule-d64", "depth-rule-d256")
TRANSFER_GRIDS = tuple(name for name in GRIDS if name.startswith("transfer-"))  # width transfer, complete runs
