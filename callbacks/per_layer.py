"""Showing a quantity per layer: which layers get their own tags in a deep model (evenly_spaced), and the quantity
over layers x steps drawn as one image (Heatmap).
"""

from __future__ import annotations

import numpy as np
from lightning.pytorch import Trainer

from keel.callbacks.log_writing import log_figure, rich_loggers


def evenly_spaced(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n), first and last included; all of them if k <= 0 or k >= n."""
    if k <= 0 or k >= n:
        return list(range(n))
    if k == 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


class Heatmap:
    """A per-layer quantity over training (rows = layers, columns = steps), drawn as one image.

    Kept on rank 0 only. Past `max_columns` every other column is dropped, so a long run keeps a bounded,
    evenly thinned history; columns are placed at their true steps, so thinning never distorts the x-axis."""

    def __init__(self, tag: str, rows: list[str], label: str, log10: bool = False, max_columns: int = 256) -> None:
        self.tag, self.rows, self.label, self.log10, self.max_columns = tag, rows, label, log10, max_columns
        self.steps: list[int] = []
        self.columns: list[list[float]] = []

    def add(self, step: int, column: list[float]) -> None:
        self.steps.append(step)
        self.columns.append(column)
        if len(self.steps) > self.max_columns:
            self.steps, self.columns = self.steps[::2], self.columns[::2]

    def log(self, trainer: Trainer, step: int) -> None:
        loggers = rich_loggers(trainer)
        if not loggers or not self.steps:
            return
        import matplotlib

        matplotlib.use("Agg")  # no display; idempotent
        import matplotlib.pyplot as plt

        values = np.array(self.columns, dtype=np.float64).T  # (rows, columns)
        if self.log10:
            values = np.log10(np.where(values > 0, values, np.nan))
        # small, with fixed margins (no tight_layout): drawing is the costly part
        height = 2 + min(len(self.rows), 64) * 0.12  # inches
        fig, ax = plt.subplots(figsize=(8, height), dpi=72)
        fig.subplots_adjust(left=0.1, bottom=0.55 / height, top=1 - 0.35 / height)
        mesh = ax.pcolormesh(self.steps, np.arange(len(self.rows)), values, shading="nearest", cmap="viridis")
        ticks = evenly_spaced(len(self.rows), 24)
        ax.set_yticks(ticks, [self.rows[i] for i in ticks], fontsize=7)
        ax.invert_yaxis()  # first layer on top, as in the model
        ax.set_xlabel("step")
        fig.colorbar(mesh, ax=ax, label=f"log10 {self.label}" if self.log10 else self.label)
        ax.set_title(self.tag, fontsize=9)
        log_figure(loggers, self.tag, fig, step)
