"""The trends in `keel paper-report`: the Keel / Pre-LN max-LR ratio seed by seed against depth and width (and on the
hold map's ramps), and the loss-optimal LR against width under sp and muP (LR transfer), with their figures."""

from __future__ import annotations

from pathlib import Path

from keel.experiments.maxlr_report import compare, inits, max_lr_value, rows_at
from keel.experiments.plots import pyplot, save_figure
from keel.experiments.roles import HOLD_GRIDS, MUP_WIDTH_TREND, WIDTH_TREND
from keel.experiments.stats import fmt, fmt_median_range, max_over_min, median


def seed_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(Keel's run, Pre-LN's run) for each seed both ran."""
    by = {(r["row"], r["seed"]): r for r in rows}
    return [(run, by["preln", seed]) for (label, seed), run in by.items() if label == "keel" and ("preln", seed) in by]


def ratios(rows: list[dict]) -> list[float | None]:
    """Per seed where Keel is resolved, its max LR over Pre-LN's; None where Pre-LN is not (it never learned: no
    ratio, but not nothing to report). No entry where both ran the ramp unbroken: two lower bounds give no ratio."""
    out = []
    for keel, preln in seed_pairs(rows):
        x, y = max_lr_value(keel), max_lr_value(preln)
        if x is None or (y is not None and not keel["failure"] and not preln["failure"]):
            continue
        out.append(None if y is None else x / y)
    return out


def _ratio_cell(rows: list[dict]) -> str:
    """Keel / Pre-LN per seed where both resolved (">=" / "<=" where one ran the whole ramp unbroken, its peak a
    lower bound), then the seeds with no ratio: only one resolved, neither did, or both ran the ramp unbroken."""
    known, counts = (
        [],
        dict.fromkeys(
            ("Pre-LN unresolved", "Keel unresolved", "neither resolved", "neither broke by the ramp's end"), 0
        ),
    )
    for keel, preln in seed_pairs(rows):
        x, y = max_lr_value(keel), max_lr_value(preln)
        if x is None or y is None:
            counts[
                "Pre-LN unresolved"
                if y is None and x is not None
                else "Keel unresolved"
                if x is None and y is not None
                else "neither resolved"
            ] += 1
        elif not keel["failure"] and not preln["failure"]:
            counts["neither broke by the ramp's end"] += 1
        else:
            known.append((">=" if not keel["failure"] else "<=" if not preln["failure"] else "") + f"{x / y:.2g}")
    parts = [", ".join(known)] if known else []
    return "; ".join(parts + [f"{what} in {n}" for what, n in counts.items() if n]) or "-"


def hold_pairs(grids: dict[str, list[dict]]) -> list[dict]:
    """Per point and ramp of the hold map: Keel / Pre-LN seed by seed, and the sign test's verdict."""
    table = []
    for point, names in HOLD_GRIDS.items():
        for grid in names:
            rows = rows_at(grids.get(grid, []), *point)
            if (test := compare(rows, "keel", "preln", point[0])) is not None:
                table.append(
                    {
                        "blocks x width": f"{point[0]} x {point[1]}",
                        "grid": grid,
                        "ramp": rows[0]["ramp"],
                        "keel / preln (per seed)": _ratio_cell(rows),
                        "verdict": test["verdict"],
                        "sign test p": test["sign test p"],
                        "signed-rank p": test["signed-rank p"],
                        "t p (log ratio)": test["t p (log ratio)"],
                    }
                )
    return table


def trend(grids: dict[str, list[dict]], axis: dict[int, tuple[str, int, int]], name: str) -> tuple[list[dict], dict]:
    """Per point of the axis: each scheme's median max LR and loss-optimal LR, and the Keel / Pre-LN ratio."""
    table, points = [], {}
    for value, (names, depth, width) in axis.items():
        rows = [r for grid in names for r in rows_at(grids.get(grid, []), depth, width)]
        if not rows:
            continue
        entry = {name: value, "grid": ", ".join(grid for grid in names if grid in grids)}
        for scheme in ("keel", "preln", "postln"):
            runs = [r for r in rows if r["row"] == scheme]
            if runs:
                entry[f"{scheme} init"] = inits(runs)
                values = [v for v in map(max_lr_value, runs) if v is not None]
                unbroken = sum(max_lr_value(r) is not None and not r["failure"] for r in runs)  # the peak: a bound
                entry[f"{scheme} max LR"] = f"{fmt(median(values))} ({len(values)}/{len(runs)}" + (
                    f", {unbroken} unbroken by the ramp's end)" if unbroken else ")"
                )
                entry[f"{scheme} loss-optimal"] = fmt(
                    median([r["loss_optimal_lr"] for r in runs if r["loss_optimal_lr"] is not None])
                )
        points[value] = ratios(rows)
        entry["keel / preln (per seed)"] = _ratio_cell(rows)
        table.append(entry)
    return table, points


def transfer(grids: dict[str, list[dict]]) -> tuple[list[dict], dict]:
    """The width trend under sp (WIDTH_TREND) and under mup (MUP_WIDTH_TREND), Keel and Pre-LN: per width the
    loss-optimal and max LR, median [range] over seeds; then how far each median moves over the widths (max / min).
    Also the points for the plot: (scheme, parametrization) -> width -> the seeds' loss-optimal LRs."""
    table, points, medians = [], {}, {}
    for width in WIDTH_TREND:
        entry = {"width": width}
        for scheme in ("keel", "preln"):
            for name, axis in (("sp", WIDTH_TREND), ("mup", MUP_WIDTH_TREND)):
                (grid,), depth, _ = axis[width]
                runs = rows_at(grids.get(grid, []), depth, width, scheme)
                optimal = [r["loss_optimal_lr"] for r in runs if r["loss_optimal_lr"] is not None]
                values = [v for v in map(max_lr_value, runs) if v is not None]
                points.setdefault((scheme, name), {})[width] = optimal
                for column, seeds, cell in (
                    (f"{scheme} {name} loss-optimal LR", optimal, f"({len(optimal)} seeds)"),
                    (f"{scheme} {name} max LR", values, f"({len(values)}/{len(runs)} resolved)"),
                ):
                    entry[column] = f"{fmt_median_range(seeds)} {cell}" if runs else "-"
                    if seeds:
                        medians.setdefault(column, []).append(median(seeds))
        table.append(entry)
    moves = {"width": "max / min over widths"}
    for column in table[0]:
        if (spread := max_over_min(medians.get(column, []))) is not None:
            moves[column] = f"{fmt(spread)}x ({len(medians[column])} widths)"
        elif column != "width":
            moves[column] = "-"
    return [*table, moves], points


def base_width_floor(grids: dict[str, list[dict]], base: int = 64) -> list[dict]:
    """The ramp's noise floor: at the base width mup computes what sp computes (up to float rounding), so the same
    seed's probes under the two should agree; per scheme and seed, each quantity under sp and under mup and their
    ratio (larger / smaller)."""
    table = []
    for scheme in ("keel", "preln"):
        (sp_grid,), depth, _ = WIDTH_TREND[base]
        (mup_grid,), _, _ = MUP_WIDTH_TREND[base]
        sp = {r["seed"]: r for r in rows_at(grids.get(sp_grid, []), depth, base, scheme)}
        mup = {r["seed"]: r for r in rows_at(grids.get(mup_grid, []), depth, base, scheme)}
        for seed in sorted(sp.keys() & mup.keys()):
            entry = {"scheme": scheme, "seed": seed}
            for label, value in (("loss-optimal LR", lambda r: r["loss_optimal_lr"]), ("max LR", max_lr_value)):
                a, b = value(sp[seed]), value(mup[seed])
                entry |= {f"{label} sp": fmt(a), f"{label} mup": fmt(b)}
                entry[f"{label} ratio"] = fmt(max(a, b) / min(a, b)) if a and b else "-"
            table.append(entry)
    return table


def plot_transfer(points: dict, path: Path) -> None:
    """The loss-optimal LR against width, a point per seed and the medians' line, sp dashed and mup solid."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (scheme, name), by_width in points.items():
        color = {"keel": "tab:blue", "preln": "tab:orange"}[scheme]
        style = "-" if name == "mup" else "--"
        xs = [w for w, values in by_width.items() if values]
        for w in xs:
            ax.plot([w] * len(by_width[w]), by_width[w], "o" if name == "mup" else "x", color=color, alpha=0.5)
        ax.plot(xs, [median(by_width[w]) for w in xs], style, color=color, label=f"{scheme} {name}")
    ax.set(xscale="log", yscale="log", xlabel="width (16 blocks)", ylabel="loss-optimal LR")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, "The loss-optimal LR against width: sp and mup (base width 64)", path)


def plot_ratios(depth: dict, width: dict, batch: list[float | None], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, points, label in ((axes[0], depth, "depth (blocks), width 32"), (axes[1], width, "width, 16 blocks")):
        known = {x: [v for v in values if v is not None] for x, values in points.items()}
        for x, values in known.items():
            ax.plot([x] * len(values), values, "o", color="tab:blue", alpha=0.6)
        xs = [x for x in known if known[x]]
        ax.plot(xs, [median(known[x]) for x in xs], "-", color="tab:blue", label="median" if xs else None)
        # seeds where Keel learned and Pre-LN did not: no ratio, marked along the top edge with their count
        unresolved = {x: sum(v is None for v in values) for x, values in points.items() if None in values}
        top = ax.get_xaxis_transform()  # x in data, y in axes fractions
        ax.plot(
            list(unresolved),
            [0.95] * len(unresolved),
            "^",
            color="tab:orange",
            transform=top,
            label="Keel learned, Pre-LN did not (seeds)" if unresolved else None,
        )
        for x, count in unresolved.items():
            ax.annotate(str(count), (x, 0.95), xycoords=top, xytext=(7, -4), textcoords="offset points", fontsize=8)
        if unresolved:
            ax.set_xlim(min([*points, *unresolved]) / 1.3, max([*points, *unresolved]) * 1.3)
        batch_known = [v for v in batch if v is not None]
        if label.startswith("width") and batch_known:
            ax.plot([64] * len(batch_known), batch_known, "s", color="tab:red", alpha=0.7, label="8x tokens per step")
        ax.axhline(1, color="grey", linewidth=1)
        if points:
            ax.set_xscale("log", base=2)
        if xs:
            ax.set_yscale("log")
            values = [1, *batch_known, *(v for x in xs for v in known[x])]
            ax.set_ylim(min(values) / 1.3, max(values) * 2)  # headroom: the top edge's markers above the data
        ax.set_xlabel(label)
        ax.set_ylabel("Keel max LR / Pre-LN max LR")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, "Keel's tolerable LR relative to Pre-LN (a point per seed; > 1: Keel tolerates more)", path)
