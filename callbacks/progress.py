"""A progress bar over the run's optimizer steps: Lightning's counts micro-batches per epoch, so with
trainer.grad_accum > 1 its count and ETA are off by that factor, and it restarts each epoch."""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar

from keel.callbacks.cadence import due, finished_step


class StepProgressBar(TQDMProgressBar):
    """`step n/max_steps` across epochs; a resumed run starts at its step, and its ETA counts only the steps
    it has run itself."""

    _loss: str | None = None  # train/loss at the last logging step

    @property
    def train_description(self) -> str:
        return "step"

    def on_train_start(self, trainer: Trainer, *_) -> None:
        super().on_train_start(trainer)
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps)
        bar.initial = bar.n = trainer.global_step

    def on_train_epoch_start(self, trainer: Trainer, *_) -> None:
        pass  # one bar for the whole run, not one per epoch

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        step = finished_step(trainer)
        if step is None:  # still accumulating gradients
            return
        if due(step, trainer.log_every_n_steps):  # the loss is read at logging steps only: a read waits for the device
            # the last micro-batch's loss (train/loss), which Lightning hands over divided by the accumulation
            self._loss = f"{float(outputs['loss']) * trainer.accumulate_grad_batches:.3f}"
        bar = self.train_progress_bar
        if self._should_update(trainer.global_step, bar.total):
            bar.n = trainer.global_step
            loss = {"train/loss": self._loss} if self._loss is not None else {}
            bar.set_postfix({**self.get_metrics(trainer, pl_module), **loss})  # refreshes the bar
