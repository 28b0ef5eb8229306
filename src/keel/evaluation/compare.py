"""`keel compare RUN_DIR RUN_DIR... [--out FILE.png] [--train-loss]`: runs' validation loss and downstream task
curves side by side, from their TensorBoard events (`val/loss`, `eval/<task>/<metric>`) - the paper's Figure 8
question: does the run with the lower loss also do better on the tasks? Prints each run's last values too.

`--train-loss` adds the per-step training loss, and that loss detrended (a centred moving average subtracted), with
its lag-1 autocorrelation: near 0 when consecutive batches are independent samples, clearly positive when stretches
of steps draw from one part of the corpus (log every step, `trainer.log_every_n_steps=1`, for it to mean that).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from keel.artifacts import TENSORBOARD, read_scalars
from keel.errors import ConfigError

LOSS_TAG = "val/loss"
TRAIN_LOSS_TAG = "train/loss"
DETRENDED_TAG = "train/loss minus its moving average"
TASK_PREFIX = "eval/"
NOT_SCORES = ("eval/disagree/", "eval/spearman/")  # the callback's own flags, not task metrics


def read_curves(run_dir: Path, train_loss: bool = False) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the loss and task scalars (and train/loss) in a run's TensorBoard events."""
    return {
        tag: curve
        for tag, curve in read_scalars(run_dir).items()
        if tag == LOSS_TAG
        or (tag.startswith(TASK_PREFIX) and not tag.startswith(NOT_SCORES))
        or (train_loss and tag == TRAIN_LOSS_TAG)
    }


def detrended(curve: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """Each point minus the mean of the `window` points centred on it (points without a full window dropped)."""
    half = window // 2
    values = [value for _, value in curve]
    return [
        (step, values[i] - sum(values[i - half : i + half + 1]) / (2 * half + 1))
        for i, (step, _) in enumerate(curve)
        if half <= i < len(curve) - half
    ]


def lag1_autocorrelation(values: list[float]) -> float:
    mean = sum(values) / len(values)
    centred = [value - mean for value in values]
    return sum(a * b for a, b in zip(centred, centred[1:])) / sum(c * c for c in centred)


def plot(runs: dict[str, dict[str, list[tuple[int, float]]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = [LOSS_TAG, TRAIN_LOSS_TAG, DETRENDED_TAG]
    tags = [tag for tag in first if any(tag in curves for curves in runs.values())]
    tags += sorted({tag for curves in runs.values() for tag in curves} - set(first))
    cols = min(3, len(tags))
    rows = math.ceil(len(tags) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, tag in zip(axes.flat, tags):
        for name, curves in runs.items():
            if tag in curves:
                steps, values = zip(*curves[tag])
                per_step = tag in (LOSS_TAG, TRAIN_LOSS_TAG, DETRENDED_TAG)
                ax.plot(steps, values, marker=None if per_step else "o", markersize=3, linewidth=1, label=name)
        ax.set_title(tag.removeprefix(TASK_PREFIX))
        if "perplexity" in tag:  # spans orders of magnitude early in training
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    for ax in list(axes.flat)[len(tags) :]:
        ax.set_visible(False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="keel compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (run.dir of each training run)")
    parser.add_argument("--out", type=Path, default=Path("compare.png"), help="PNG to write (default: compare.png)")
    parser.add_argument(
        "--train-loss",
        action="store_true",
        help="also the per-step training loss, detrended, and its lag-1 autocorrelation",
    )
    parser.add_argument("--window", type=int, default=25, help="moving-average window of --train-loss (steps)")
    args = parser.parse_args(argv)
    if args.window < 3:
        parser.error("--window must be >= 3 steps")
    runs = {}
    for run_dir in args.runs:
        if not (run_dir / TENSORBOARD).is_dir():
            parser.error(f"{run_dir} has no tb/ directory: not a keel run directory")
        runs[str(run_dir)] = curves = read_curves(run_dir, args.train_loss)
        if not curves:
            raise ConfigError(
                f"compare: {run_dir} has nothing to compare: its tb/ events hold no {LOSS_TAG} or "
                f"{TASK_PREFIX} scalars (validation runs every trainer.val_every_n_steps steps: a run "
                "stopped before the first has none)"
            )
        if args.train_loss:
            if len(curves.get(TRAIN_LOSS_TAG, [])) < 2 * args.window:
                parser.error(
                    f"{run_dir} logged train/loss at fewer than {2 * args.window} steps: "
                    "train with trainer.log_every_n_steps=1, or pass a smaller --window"
                )
            curves[DETRENDED_TAG] = detrended(curves[TRAIN_LOSS_TAG], args.window)
            autocorrelation = lag1_autocorrelation([value for _, value in curves[DETRENDED_TAG]])
            print(
                f"{run_dir}: detrended train/loss (window {args.window}), lag-1 autocorrelation {autocorrelation:+.3f}"
            )
    plot(runs, args.out)
    for name, curves in runs.items():
        last = ", ".join(
            f"{tag.removeprefix(TASK_PREFIX)} {pts[-1][1]:.4f}"
            for tag, pts in sorted(curves.items())
            if tag != DETRENDED_TAG
        )
        print(f"{name}: {last}")
    print(f"wrote {args.out}")
    return 0
