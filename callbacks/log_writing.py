"""Writing from rank 0 to every logger of the run: scalars to all of them; text and figures to those that can show
them (TensorBoard, W&B, MLflow), skipped on the others (CSV).
"""

from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger

from keel.loggers import kind_of


def log_scalars(trainer: Trainer, metrics: dict[str, float], step: int) -> None:
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def rich_loggers(trainer: Trainer) -> list[Logger]:
    """Rank 0's loggers that show text and figures (none on other ranks)."""
    if not trainer.is_global_zero:
        return []
    return [logger for logger in trainer.loggers if (kind := kind_of(logger)) is not None and kind.shows_media()]


def log_text(trainer: Trainer, tag: str, text: str, step: int) -> None:
    for logger in rich_loggers(trainer):
        kind_of(logger).log_text(logger, tag, text, step)


def log_figure(loggers: list[Logger], tag: str, fig, step: int) -> None:
    """A matplotlib figure to each of `loggers` (from rich_loggers), then closed."""
    import matplotlib.pyplot as plt

    for logger in loggers:
        kind_of(logger).log_figure(logger, tag, fig, step)
    plt.close(fig)
