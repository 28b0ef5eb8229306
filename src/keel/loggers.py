"""trainer.loggers: one record per logger name - how the logger is built under the run directory, which id a resumed
run continues it with, how it shows text and figures, and how it is closed. `keel.training` builds and closes them,
keel.callbacks.log_writing sends them text and figures.

Adding a logger = its name in keel.config.trainer.LOGGERS and its record here (and its pip extra in pyproject.toml,
if it needs a package).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, ClassVar

from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

from keel.artifacts import TENSORBOARD
from keel.errors import ConfigError


class LoggerKind:
    name: ClassVar[str]  # its trainer.loggers name (and pip extra, when it needs a package)
    logger_class: ClassVar[type[Logger]]  # Lightning's logger

    def owns(self, logger: Logger) -> bool:
        return type(logger) is self.logger_class

    def build(self, run_dir: str, run_name: str, run_id: str | None) -> Logger:
        """The logger of a run; run_id: what run_id() returned when the run started (None: a new run)."""
        raise NotImplementedError

    def run_id(self, logger: Logger) -> str | None:
        """The id that continues this logger's run on resume; None: nothing to keep."""
        return None

    def log_config(self, logger: Logger, config: dict[str, Any]) -> None:
        logger.log_hyperparams(config)

    def shows_media(self) -> bool:
        """Whether it takes text and figures; the others get scalars only."""
        return type(self).log_text is not LoggerKind.log_text

    def log_text(self, logger: Logger, tag: str, text: str, step: int) -> None:
        """Nothing: this logger shows scalars only."""

    def log_figure(self, logger: Logger, tag: str, fig, step: int) -> None:
        """Nothing: this logger shows scalars only."""

    def close(self, logger: Logger) -> None:
        """Nothing: Lightning finalizes it."""


def artifact_name(tag: str, step: int, suffix: str) -> str:
    """Loggers that keep text and figures as files (MLflow): one per tag and step."""
    return f"{tag}/step_{step:06d}{suffix}"


# TensorBoard's Custom Scalars tab, in this order: what a run is judged by first (its other tabs sort tags by name, so
# there Lightning's flat `epoch` chart comes first and the losses last). Each chart: the tags (regexes matched from
# the start) drawn together; docs/tensorboard.md.
LAYOUT = {
    "loss": {
        "training and held-out loss (nats per token)": ["Multiline", ["train/loss$", "val/loss$"]],
        "held-out perplexity": ["Multiline", ["val/ppl$"]],
    },
    "downstream tasks": {
        "accuracy": ["Multiline", ["eval/[^/]+/acc", "eval/[^/]+/exact_match"]],
        "perplexity": ["Multiline", ["eval/[^/]+/[^/]*perplexity"]],
        "loss against score over the run (Spearman)": ["Multiline", ["eval/spearman/"]],
    },
    "training": {
        "learning rate": ["Multiline", ["lr/"]],
        "global gradient norm (before clipping)": ["Multiline", ["grad/global$"]],
        "stability": ["Multiline", ["stability/loss_excess$", "stability/failed$"]],
        "tokens per second": ["Multiline", ["perf/tokens_per_s$"]],
    },
}


class TensorBoard(LoggerKind):
    name, logger_class = "tensorboard", TensorBoardLogger

    def build(self, run_dir, run_name, run_id):
        return self.logger_class(save_dir=run_dir, name=TENSORBOARD, version="", default_hp_metric=False)

    def log_config(self, logger, config):
        super().log_config(logger, config)
        logger.experiment.add_custom_scalars(LAYOUT)

    def log_text(self, logger, tag, text, step):
        logger.experiment.add_text(tag, text, global_step=step)

    def log_figure(self, logger, tag, fig, step):
        logger.experiment.add_figure(tag, fig, global_step=step, close=False)


class CSV(LoggerKind):
    name, logger_class = "csv", CSVLogger

    def build(self, run_dir, run_name, run_id):
        # a version directory per start: CSVLogger would overwrite the metrics.csv of the run it resumes
        return self.logger_class(save_dir=run_dir, name="csv")


class WandB(LoggerKind):
    """W&B reads its usual environment (WANDB_MODE=offline, WANDB_PROJECT)."""

    name, logger_class = "wandb", WandbLogger

    def build(self, run_dir, run_name, run_id):
        return self.logger_class(
            save_dir=run_dir,
            name=run_name,
            project=os.environ.get("WANDB_PROJECT", "keel"),
            id=run_id or uuid.uuid4().hex[:12],
            resume="allow",
        )

    def run_id(self, logger):
        return logger.version

    def log_config(self, logger, config):
        import wandb

        try:  # the first use starts the W&B run, which is where a missing API key shows
            super().log_config(logger, config)
        except wandb.errors.UsageError as err:
            raise ConfigError(
                f"trainer.loggers: wandb cannot start a run: {err} Run `wandb login` or set "
                "WANDB_API_KEY, or set WANDB_MODE=offline to log into the run dir (`wandb sync` it "
                "later)"
            ) from None

    def log_text(self, logger, tag, text, step):
        logger.log_text(key=tag, columns=["step", "text"], data=[[step, text]], step=step)

    def log_figure(self, logger, tag, fig, step):
        logger.log_image(key=tag, images=[fig], step=step)

    def close(self, logger):
        import wandb  # Lightning leaves the run open, and the next run in this process would log into it

        wandb.finish()


class MLflow(LoggerKind):
    """To MLFLOW_TRACKING_URI if set, else to a SQLite database and artifact folder in the run dir (MLflow 3
    refuses its file store, Lightning's default); the experiment is MLFLOW_EXPERIMENT_NAME (default keel)."""

    name, logger_class = "mlflow", MLFlowLogger

    def build(self, run_dir, run_name, run_id):
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "keel")
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return self.logger_class(
                experiment_name=experiment,
                run_name=run_name,
                tracking_uri=os.environ["MLFLOW_TRACKING_URI"],
                run_id=run_id,
            )
        local = Path(run_dir).resolve()
        local.mkdir(parents=True, exist_ok=True)
        return self.logger_class(
            experiment_name=experiment,
            run_name=run_name,
            tracking_uri=f"sqlite:///{local / 'mlflow.db'}",
            artifact_location=str(local / "mlartifacts"),
            run_id=run_id,
        )

    def run_id(self, logger):
        return logger.run_id

    def log_config(self, logger, config):
        if not logger.experiment.get_run(logger.run_id).data.params:  # a continued run's params cannot change
            logger.log_hyperparams(config)

    def log_text(self, logger, tag, text, step):
        logger.experiment.log_text(logger.run_id, text, artifact_name(tag, step, ".txt"))

    def log_figure(self, logger, tag, fig, step):
        logger.experiment.log_figure(logger.run_id, fig, artifact_name(tag, step, ".png"))


# trainer.loggers' names (keel.config.trainer.LOGGERS) -> their records
LOGGERS: dict[str, LoggerKind] = {kind.name: kind() for kind in (TensorBoard, CSV, WandB, MLflow)}


def kind_of(logger: Logger) -> LoggerKind | None:
    """The record of a logger built from trainer.loggers (None for one added another way)."""
    return next((kind for kind in LOGGERS.values() if kind.owns(logger)), None)
