"""Matplotlib for the reports, files only: the figure module, a figure saved with its title, line plots."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, title: str, path: Path, dpi: int = 120) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def plot_lines(
    curves: Iterable[tuple[str, Sequence[float], Sequence[float]]],
    path: Path,
    xlabel: str,
    ylabel: str,
    title: str,
    xscale: str = "linear",
    yscale: str = "linear",
    marker: str | None = "o",
    decorate: Callable[[Any], None] | None = None,
) -> None:
    """One line per (label, xs, ys) in one PNG; decorate(ax) adds anything command-specific."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, xs, ys in curves:
        ax.plot(xs, ys, marker=marker, markersize=3, linewidth=1.2, label=label)
    ax.set_xscale(xscale)
    ax.set_yscale(yscale)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if decorate is not None:
        decorate(ax)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
