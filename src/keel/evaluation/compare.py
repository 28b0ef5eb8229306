"""`keel compare RUN_DIR RUN_DIR... [--out FILE.png]`: runs' validation loss and downstream task curves side
by side, from their TensorBoard events (`val/loss`, `eval/<task>/<metric>`) - the paper's Figure 8 question:
does the run with the lower loss also do better on the tasks? Prints each run's last values too.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

LOSS_TAG = "val/loss"
TASK_PREFIX = "eval/"
NOT_SCORES = ("eval/disagree/", "eval/spearman/")  # the callback's own flags, not task metrics


def read_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the loss and task scalars in a run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tags = [
        tag
        for tag in events.Tags()["scalars"]
        if tag == LOSS_TAG or (tag.startswith(TASK_PREFIX) and not tag.startswith(NOT_SCORES))
    ]
    # A resumed run's event files may repeat steps: the last value written for a step wins.
    return {tag: sorted({e.step: e.value for e in events.Scalars(tag)}.items()) for tag in tags}


def plot(runs: dict[str, dict[str, list[tuple[int, float]]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tags = [LOSS_TAG] + sorted({tag for curves in runs.values() for tag in curves} - {LOSS_TAG})
    cols = min(3, len(tags))
    rows = math.ceil(len(tags) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, tag in zip(axes.flat, tags):
        for name, curves in runs.items():
            if tag in curves:
                steps, values = zip(*curves[tag])
                ax.plot(steps, values, marker="o" if tag != LOSS_TAG else None, markersize=3, label=name)
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
    args = parser.parse_args(argv)
    runs = {}
    for run_dir in args.runs:
        if not (run_dir / "tb").is_dir():
            parser.error(f"{run_dir} has no tb/ directory: not a keel run directory")
        runs[str(run_dir)] = read_curves(run_dir)
    plot(runs, args.out)
    for name, curves in runs.items():
        last = ", ".join(f"{tag.removeprefix(TASK_PREFIX)} {pts[-1][1]:.4f}" for tag, pts in sorted(curves.items()))
        print(f"{name}: {last}")
    print(f"wrote {args.out}")
    return 0
