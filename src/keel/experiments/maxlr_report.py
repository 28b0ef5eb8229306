"""`keel maxlr collect DIR`: the max-LR probes of a `keel maxlr` directory judged, tabulated and plotted.

The verdict is computed here from each probe's recorded held-out curve (stability.json), not taken from the run.
A run fails only by a non-finite loss or gradient, or by divergence: its held-out loss stays above its bar (best so
far + spike_margin, and once it has learned never above the unigram loss) for spike_patience steps, or is still
above it when the probe ends; a plateau is no failure. The max tolerable LR is the LR at the last evaluation within
the bar; a run never `margin` nats below the unigram loss is "not resolved". The loss-optimal LR is reported beside
it. The criterion in full: docs/experiments.md, "The protocol".

Writes DIR/maxlr.csv, DIR/maxlr.md (medians and ranges over seeds, sign tests between row pairs, the sensitivity
table), maxlr.png and maxlr_seeds.png.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from keel.artifacts import CONFIG, read_stability
from keel.cli_args import comma_list
from keel.config import Config
from keel.divergence import DivergenceJudge
from keel.errors import ConfigError
from keel.experiments.plots import pyplot
from keel.experiments.records import (
    MANIFEST,
    MAXLR_PLOT,
    MAXLR_SEEDS_PLOT,
    MAXLR_SUMMARY,
    MAXLR_TABLE,
    finished,
    load_run_config,
    read_time_record,
    run_row,
)
from keel.experiments.stats import MIN_SEEDS, Paired, median_range, sign_test
from keel.experiments.tables import markdown_table, write_table
from keel.provenance import describe

DEFAULT_PAIRS = (("keel", "preln"), ("keel", "postln"))
MARGIN = 0.5  # nats below the unigram loss that count as "learned"
HOLD_FACTOR = 4 / 3  # the hold at an LR x: the steps a ramp spends between x and 4/3 x (the geometric ramp's 20)
# The sensitivity table: the same curves judged with other settings (None: the run's spike_margin); the looser
# ones are lower bounds where a probe stopped (see above).
VARIANTS = {
    "learned 0.25": {"margin": 0.25, "spike_margin": None, "relative_only": False},
    "learned 1": {"margin": 1.0, "spike_margin": None, "relative_only": False},
    "best + 0.5": {"margin": MARGIN, "spike_margin": 0.5, "relative_only": False},
    "relative only": {"margin": MARGIN, "spike_margin": None, "relative_only": True},
}


class NotYetRun(ConfigError):
    """A grid none of whose runs has finished: a report lists it as not (yet) run."""


@dataclass
class Verdict:
    failure: str | None  # divergence | nonfinite | None (none up to the end of the probe)
    onset_step: int | None  # the first evaluation above the bar (nonfinite: the non-finite step)
    max_tolerable_lr: float | None  # LR at the last evaluation within the bar before it (nonfinite: the step before)
    heldout_at_max_lr: float | None
    above_best_at_max_lr: float | None  # how far the held-out loss at the max LR is above the best before it
    resolved: bool  # the best held-out loss up to the max LR was margin below the unigram loss
    loss_optimal_lr: float | None  # LR of the lowest held-out loss on the ramp
    best_heldout: float | None
    leaves_unigram_lr: float | None  # LR from which the held-out loss stays above the unigram loss (having been below)


def judge(
    heldout: list,
    unigram: float,
    margin: float,
    spike_margin: float,
    patience: int,
    nonfinite: tuple[int, float | None] | None = None,
    relative_only: bool = False,
) -> Verdict:
    """The verdict on one held-out curve [(step, lr, loss), ...]; nonfinite: (step, LR of the step before) of the
    run's non-finite stop, if any. relative_only: the bar is best + spike_margin throughout (the criterion that
    misses the collapse of a model that learned little; reported for comparison)."""
    points = [(step, lr, loss) for step, lr, loss in heldout if lr is not None]
    divergence = DivergenceJudge(spike_margin, patience, None if relative_only else unigram, margin)
    good: tuple | None = None  # the last evaluation within the bar
    onset: tuple | None = None  # the first evaluation of the current excursion above it
    failure = None
    for point in points:
        diverged = divergence.see(point[0], point[2])
        if not divergence.above:
            good, onset = point, None
            continue
        onset = onset or point
        if diverged:
            failure = "divergence"
            break
    if failure is None and onset is not None:  # above the bar when the probe ended: it never came back
        failure = "divergence"
    if nonfinite is not None and (failure is None or nonfinite[0] < onset[0]):
        failure, onset = "nonfinite", (nonfinite[0], None, None)
        good = next(((s, lr, loss) for s, lr, loss in reversed(points) if s < nonfinite[0]), None)
        max_lr = nonfinite[1]
    else:
        max_lr = good[1] if failure and good else None
    judged = [loss for step, _, loss in points if math.isfinite(loss) and (not failure or step < onset[0])]
    finite = [(loss, lr) for _, lr, loss in points if math.isfinite(loss)]
    best_loss, best_lr = min(finite) if finite else (None, None)
    below = [i for i, (_, _, loss) in enumerate(points) if math.isfinite(loss) and loss < unigram]
    leaves = points[below[-1] + 1][1] if below and below[-1] + 1 < len(points) else None
    at_max_lr = good[2] if failure and good else None
    above_best = (
        None
        if at_max_lr is None
        else at_max_lr - min(loss for step, _, loss in points if step <= good[0] and math.isfinite(loss))
    )
    return Verdict(
        failure,
        onset[0] if failure else None,
        max_lr,
        at_max_lr,
        above_best,
        bool(judged) and min(judged) <= unigram - margin,
        best_lr,
        best_loss,
        leaves,
    )


def rows_at(rows: list[dict], depth: int, width: int, scheme: str | None = None) -> list[dict]:
    """A grid's rows of one size (blocks x width), of one row label (scheme or variant) or all."""
    return [r for r in rows if (r["depth"], r["width"]) == (depth, width) and scheme in (None, r["row"])]


def inits(rows) -> str:
    """The init in force of these runs (model.init resolved: keel.config.ModelConfig.init_kind)."""
    return ", ".join(dict.fromkeys(r["init"] for r in rows))


def max_lr_value(row: dict) -> float | None:
    """The number compared across schemes: the max LR, the peak (a lower bound) for a run that never failed,
    None when not resolved."""
    if not row["resolved"]:
        return None
    return row["max_tolerable_lr"] if row["failure"] else row["max_lr_seen"]


def probe_verdict(
    state: dict,
    cfg: Config,
    unigram: float,
    margin: float,
    spike_margin: float | None = None,
    relative_only: bool = False,
) -> Verdict:
    """The verdict on a probe's stability.json `state` under its own patience and (by default) spike margin."""
    nonfinite = (state["step"], state["max_tolerable_lr"]) if state["kind"] == "nonfinite" else None
    stability = cfg.callbacks.stability
    return judge(
        state.get("heldout", []),
        unigram,
        margin,
        spike_margin or stability.spike_margin,
        stability.spike_patience,
        nonfinite,
        relative_only,
    )


def ramp_name(optim) -> str:
    """A probe's ramp as a table names it: linear with its slope (LR per step), or geometric with its pace."""
    if optim.schedule == "linear_warmup":
        return f"linear from 0, {optim.lr / optim.warmup_steps:.3g} per step"
    decades = math.log10(1 / optim.min_lr_ratio)
    return f"geometric from {optim.lr * optim.min_lr_ratio:.3g}, {optim.warmup_steps / decades:.0f} steps per decade"


def hold_steps(optim, lr: float | None) -> float | None:
    """The steps the probe's ramp spends between lr and HOLD_FACTOR * lr: on a linear ramp from 0 it grows with lr
    (a long warm-up holds every LR near its limit for long), on a geometric one it is the same at every LR."""
    if lr is None:
        return None
    if optim.schedule == "linear_warmup":
        return (HOLD_FACTOR - 1) * lr * optim.warmup_steps / optim.lr
    return optim.warmup_steps * math.log(HOLD_FACTOR) / math.log(1 / optim.min_lr_ratio)


def probe_row(run_dir: Path, label: str, cfg: Config, unigram: float, margin: float) -> dict:
    """run_row (what the run was) with the verdict of the report's criterion, and its time (MAXLR_TIME)."""
    row = {"row": label, **run_row(run_dir)}
    for key in ("failed", "onset_step", "max_tolerable_lr"):  # the run's own stop, superseded by the verdict
        row.pop(key, None)
    row["stop"] = row.pop("failure", None)
    if (record := read_time_record(run_dir)) is not None:
        row |= {"cpu_s": record["cpu_s"], "wall_s": record["wall_s"]}
    row["made_by"] = "; ".join(map(describe, (record or {}).get("made_by", []))) or describe(None)
    state = read_stability(run_dir)
    row |= {**asdict(probe_verdict(state, cfg, unigram, margin)), "unigram_loss": unigram, "ramp": ramp_name(cfg.optim)}
    row["hold_steps"] = hold_steps(cfg.optim, max_lr_value(row))
    for name, variant in VARIANTS.items():
        row[f"max LR, {name}"] = max_lr_value({**row, **asdict(probe_verdict(state, cfg, unigram, **variant))})
    return row


def compare(rows: list[dict], a: str, b: str, depth: int, criterion: str | None = None) -> dict | None:
    """The sign test of a's max LR against b's, seed by seed, under the report's criterion or under one of
    VARIANTS (criterion: its name)."""

    def value(row: dict) -> float | None:
        return max_lr_value(row) if criterion is None else row[f"max LR, {criterion}"]

    by_seed = {(r["row"], r["seed"]): r for r in rows if r["depth"] == depth}
    seeds = sorted({seed for label, seed in by_seed if label == a} & {seed for label, seed in by_seed if label == b})
    if not seeds:
        return None
    wins = losses = ties = unresolved = 0
    ratios = []  # a / b of the seeds the sign test counts
    for seed in seeds:
        x, y = value(by_seed[a, seed]), value(by_seed[b, seed])
        if x is None or y is None:
            unresolved += 1
        elif math.isclose(x, y, rel_tol=1e-9) or (not by_seed[a, seed]["failure"] and not by_seed[b, seed]["failure"]):
            ties += 1
        else:
            ratios.append(x / y)
            wins, losses = wins + (x > y), losses + (x < y)
    tests = Paired(tuple(ratios))
    return {
        "depth": depth,
        "comparison": f"{a} vs {b}" + (f" ({criterion})" if criterion else ""),
        "seeds": len(seeds),
        "first higher": wins,
        "second higher": losses,
        "ties": ties,
        "not resolved": unresolved,
        "sign test p": sign_test(wins, losses),
        "signed-rank p": tests.signed_rank_p if tests.n >= MIN_SEEDS else None,  # none below MIN_SEEDS seeds
        "t p (log ratio)": tests.t_p if tests.n >= MIN_SEEDS else None,
        "verdict": f"{a} higher in {wins} of {wins + losses + ties} seeds"
        + (f" ({unresolved} more not resolved)" if unresolved else ""),
    }


def summarize(rows: list[dict]) -> list[dict]:
    table = []
    for label, depth in dict.fromkeys((r["row"], r["depth"]) for r in rows):
        runs = [r for r in rows if (r["row"], r["depth"]) == (label, depth)]
        median, low, high = median_range([v for v in map(max_lr_value, runs) if v is not None])
        best_lr = median_range([r["loss_optimal_lr"] for r in runs if r["loss_optimal_lr"] is not None])
        kinds = [r["failure"] for r in runs if r["failure"]]
        table.append(
            {
                "row": label,
                "depth": depth,
                "width": runs[0]["width"],
                "seeds": len(runs),
                "resolved": sum(r["resolved"] for r in runs),
                "median max LR": median,
                "min": low,
                "max": high,
                ">= peak (no failure)": sum(1 for r in runs if r["resolved"] and not r["failure"]),
                "failures": ", ".join(f"{kind} {kinds.count(kind)}" for kind in dict.fromkeys(kinds)),
                "median loss-optimal LR": best_lr[0],
                "loss-optimal min": best_lr[1],
                "loss-optimal max": best_lr[2],
                "median best held-out": median_range(
                    [r["best_heldout"] for r in runs if r["best_heldout"] is not None]
                )[0],
            }
        )
    return table


def sensitivity(rows: list[dict]) -> list[dict]:
    """The median max LR (and how many seeds resolved) per row and depth under the report's criterion and under
    each of VARIANTS, judged on the same curves."""
    table = []
    for label, depth in dict.fromkeys((r["row"], r["depth"]) for r in rows):
        runs = [r for r in rows if (r["row"], r["depth"]) == (label, depth)]
        entry = {"row": label, "depth": depth}
        for name, values in [("criterion", list(map(max_lr_value, runs)))] + [
            (name, [r[f"max LR, {name}"] for r in runs]) for name in VARIANTS
        ]:
            values = [v for v in values if v is not None]
            entry[name] = f"{statistics.median(values):.3g} ({len(values)}/{len(runs)})" if values else "-"
        table.append(entry)
    return table


def collect(out: Path, margin: float = MARGIN, pairs: list[tuple[str, str]] | None = None) -> list[dict]:
    """The finished probes of DIR as maxlr.csv, maxlr.md and the plots; a listed run not finished is counted."""
    manifest = json.loads((out / MANIFEST).read_text()) if (out / MANIFEST).is_file() else None
    if manifest is None:
        raise ConfigError(f"keel maxlr collect: {out} has no {MANIFEST} (not a keel maxlr output directory)")
    unigrams: dict[tuple, float] = {}
    rows, pending = [], []
    for run in manifest["runs"]:
        run_dir = out / run["name"]
        cfg = load_run_config(run_dir) if (run_dir / CONFIG).is_file() else None
        if cfg is None or not finished(run_dir, cfg):
            pending.append(run["name"])
            continue
        key = unigram_key(cfg)
        if key not in unigrams:
            unigrams[key] = unigram_loss(cfg)
        rows.append(probe_row(run_dir, run["axes"]["row"], cfg, unigrams[key], margin))
    if not rows:
        raise NotYetRun(f"keel maxlr collect: no finished run in {out} yet ({len(pending)} listed)")
    write_table(rows, out / MAXLR_TABLE)
    summary = summarize(rows)
    labels = list(dict.fromkeys(r["row"] for r in rows))
    pairs = pairs if pairs is not None else [p for p in DEFAULT_PAIRS if p[0] in labels and p[1] in labels]
    tests = [
        t
        for depth in dict.fromkeys(r["depth"] for r in rows)
        for a, b in pairs
        if (t := compare(rows, a, b, depth)) is not None
    ]
    columns = [
        "run",
        "failure",
        "onset_step",
        "max_tolerable_lr",
        "heldout_at_max_lr",
        "above_best_at_max_lr",
        "hold_steps",
        "loss_optimal_lr",
        "best_heldout",
        "leaves_unigram_lr",
        "resolved",
        "stop",
        "steps",
        "cpu_s",
    ]
    timed = [r["cpu_s"] for r in rows if "cpu_s" in r]
    text = [
        f"# Max tolerable LR: {manifest.get('protocol', '')}",
        "",
        f"Unigram loss of the held-out batches: {', '.join(f'{u:.3f}' for u in unigrams.values())}; the "
        f"criterion is divergence (keel.experiments.maxlr_report); a max LR is resolved when the best held-out "
        f"loss up to it is <= unigram - {margin:g}. {len(rows)} runs finished"
        + (f", {len(pending)} not (yet): {', '.join(pending)}" if pending else "")
        + "."
        + (f" CPU time of the finished runs: {sum(timed) / 60:.1f} min ({len(timed)} runs timed)." if timed else ""),
        "",
        markdown_table(summary, list(summary[0])),
        "",
        "The same curves judged otherwise (median max LR, resolved seeds / seeds): the bar never above the "
        f"unigram loss once the model is 0.25 or 1 nat below it (criterion: {margin:g}); a bar of best + 0.5 "
        "nat; the bar relative to the best alone (no unigram cap). The looser two (learned 1, relative only) "
        "are lower bounds where a probe stopped by the criterion:",
        "",
        markdown_table(sensitivity(rows), ["row", "depth", "criterion", *VARIANTS]),
        "",
    ]
    if tests:
        text += [
            "Sign tests (max LR per seed; a run with no failure counts as the peak; ties and unresolved "
            "seeds are left out of the test):",
            "",
            markdown_table(tests, list(dict.fromkeys(k for t in tests for k in t))),
            "",
        ]
    text += ["Runs:", "", markdown_table(rows, columns), ""]
    (out / MAXLR_SUMMARY).write_text("\n".join(text))
    plot(rows, out, unigrams, margin)
    return rows


def unigram_loss(cfg: Config) -> float:
    """Cross-entropy (nats/token) of the held-out batches validation uses (the first trainer.val_batches of the
    val split) under the training split's token frequencies (add-one smoothed): what a model that learned only
    how often each token occurs would score - the level a model must get well below before it is judged."""
    import numpy as np
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    from keel.data.loading import open_dataset, token_loader
    from keel.data.shards import data_path

    vocab = max(open_dataset(cfg).vocab_size, cfg.model.vocab_size)
    counts = np.zeros(vocab, np.int64)
    for block in StreamingDataset(data_path(cfg.data.dir, "train"), item_loader=TokensLoader(block_size=1 << 16)):
        counts += np.bincount(np.asarray(block), minlength=vocab)
    log_p = np.log((counts + 1) / (counts.sum() + vocab))
    total, tokens = 0.0, 0
    for i, batch in enumerate(token_loader(cfg, "val", shuffle=False)):
        if i == cfg.trainer.val_batches:
            break
        targets = batch[:, 1:].numpy()
        total, tokens = total - log_p[targets].sum(), tokens + targets.size
    return float(total / tokens)


def unigram_key(cfg: Config) -> tuple:
    """What the unigram loss of the held-out batches depends on."""
    return cfg.data.dir, cfg.model.seq_len, cfg.trainer.micro_batch_size, cfg.trainer.val_batches


def plot(rows: list[dict], out: Path, unigrams: dict, margin: float) -> None:
    """maxlr.png: held-out loss against LR, a panel per depth, a colour per row (scheme or variant), a line per
    seed, the max LR as a dot and the loss-optimal LR as a cross; maxlr_seeds.png: each seed's max LR per row."""
    plt = pyplot()
    labels = list(dict.fromkeys(r["row"] for r in rows))
    colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
    depths = list(dict.fromkeys(r["depth"] for r in rows))
    fig, axes = plt.subplots(1, len(depths), figsize=(6.5 * len(depths), 4.5), squeeze=False)
    for ax, depth in zip(axes[0], depths):
        seen = set()
        for r in (r for r in rows if r["depth"] == depth):
            heldout = read_stability(out / r["run"]).get("heldout", [])
            points = [(lr, loss) for _, lr, loss in heldout if lr and math.isfinite(loss)]
            if not points:  # failed before its first evaluation
                continue
            label = r["row"] if r["row"] not in seen else None
            seen.add(r["row"])
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                color=colors[r["row"]],
                linewidth=1,
                alpha=0.7,
                label=label,
            )
            if r["resolved"] and r["failure"] and r["heldout_at_max_lr"] is not None:
                ax.plot([r["max_tolerable_lr"]], [r["heldout_at_max_lr"]], "o", color=colors[r["row"]], markersize=4)
            ax.plot([r["loss_optimal_lr"]], [r["best_heldout"]], "x", color=colors[r["row"]], markersize=5)
        for unigram in unigrams.values():
            ax.axhline(unigram, color="grey", linewidth=1)
            ax.axhline(unigram - margin, color="grey", linewidth=1, linestyle="--")
        ax.set_ylim(top=max(unigrams.values()) + 1.5)
        if ax.lines:
            ax.set_xscale("log")
        width = next(r["width"] for r in rows if r["depth"] == depth)
        ax.set_xlabel("learning rate (ramp)")
        ax.set_ylabel("held-out loss")
        ax.set_title(
            f"{depth} blocks x {width}: dot = max tolerable LR, x = loss-optimal LR; grey = unigram loss, "
            f"dashed = -{margin:g} nat",
            fontsize=8,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / MAXLR_PLOT, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(labels) * len(depths)), 4))
    keys = list(dict.fromkeys((r["row"], r["depth"]) for r in rows))
    for i, (label, depth) in enumerate(keys):
        for r in (r for r in rows if (r["row"], r["depth"]) == (label, depth)):
            value = max_lr_value(r)
            marker = "x" if value is None else "o" if r["failure"] else "^"
            shown = value if value is not None else (r["max_tolerable_lr"] or r["max_lr_seen"])
            if shown:  # a run that failed at step 0 has no LR to show
                ax.plot([i - 0.1], [shown], marker, color=colors[label], alpha=0.8)
            if r["loss_optimal_lr"]:
                ax.plot([i + 0.1], [r["loss_optimal_lr"]], "s", color=colors[label], alpha=0.4, markersize=4)
    ax.set_xticks(range(len(keys)), [f"{label}\nd{depth}" for label, depth in keys], fontsize=7)
    if ax.lines:
        ax.set_yscale("log")
    ax.set_ylabel("learning rate")
    ax.set_title(
        f"{out.name}: max LR per seed (o: divergence onset; ^: none up to the peak; x: not resolved); "
        "squares: loss-optimal LR",
        fontsize=8,
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / MAXLR_SEEDS_PLOT, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="keel maxlr collect", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dir")
    parser.add_argument(
        "--margin", type=float, default=MARGIN, help="nats below the unigram loss that count as learned"
    )
    parser.add_argument("--pairs", type=comma_list(str), default=None, help="A:B,... rows to sign-test")
    args = parser.parse_args(argv)
    pairs = None if args.pairs is None else [tuple(p.split(":", 1)) for p in args.pairs]
    if pairs is not None and any(len(p) != 2 for p in pairs):
        raise ConfigError(f"--pairs {args.pairs}: expected A:B,C:D (row names as in maxlr.md)")
    out = Path(args.dir)
    rows = collect(out, args.margin, pairs)
    print((out / MAXLR_SUMMARY).read_text())
    print(f"keel maxlr collect: {len(rows)} runs -> {out}/maxlr.csv, maxlr.md, plots")
    return 0
