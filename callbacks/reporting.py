"""What the callbacks share: when to act, which blocks get their own tags, and writing scalars, text and
heatmaps from rank 0 to every logger of the run. Scalars go to all of them; text and figures to those that can
show them (TensorBoard, W&B, MLflow), and are skipped on the others (CSV).

Steps are 0-based optimizer-step indices, the x-axis Lightning uses for `train/loss`; an action "every n
steps" runs at steps n-1, 2n-1, ... so that it lands on the same steps as Lightning's own logging.
"""

from __future__ import annotations

import lightning as L
import numpy as np
from lightning.pytorch.loggers import Logger

from keel.loggers import kind_of


def due(step: int, every: int) -> bool:
    """Whether an action with cadence `every` (0 = never) runs at `step`."""
    return every > 0 and (step + 1) % every == 0


def finished_step(trainer: L.Trainer) -> int | None:
    """In on_train_batch_end: the index of the optimizer step this micro-batch completed, or None while
    gradients are still being accumulated (the same test Lightning's own ThroughputMonitor uses)."""
    if trainer.fit_loop._should_accumulate():
        return None
    return trainer.global_step - 1


def evenly_spaced(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n), first and last included; all of them if k <= 0 or k >= n."""
    if k <= 0 or k >= n:
        return list(range(n))
    if k == 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def log_scalars(trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def rich_loggers(trainer: L.Trainer) -> list[Logger]:
    """Rank 0's loggers that show text and figures (none on other ranks)."""
    if not trainer.is_global_zero:
        return []
    return [logger for logger in trainer.loggers if (kind := kind_of(logger)) is not None and kind.shows_media()]


def log_text(trainer: L.Trainer, tag: str, text: str, step: int) -> None:
    for logger in rich_loggers(trainer):
        kind_of(logger).log_text(logger, tag, text, step)


def log_figure(loggers: list[Logger], tag: str, fig, step: int) -> None:
    """A matplotlib figure to each of `loggers` (from rich_loggers), then closed."""
    import matplotlib.pyplot as plt

    for logger in loggers:
        kind_of(logger).log_figure(logger, tag, fig, step)
    plt.close(fig)


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

    def log(self, trainer: L.Trainer, step: int) -> None:
        loggers = rich_loggers(trainer)
        if not loggers or not self.steps:
            return
        import matplotlib

        matplotlib.use("Agg")  # no display; idempotent
        import matplotlib.pyplot as plt

        values = np.array(self.columns, dtype=np.float64).T  # (rows, columns)
        if self.log10:
            values = np.log10(np.where(values > 0, values, np.nan))
        # small, with fixed margins (no tight_layout): drawing is the costly part (~0.3 s of CPU)
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
