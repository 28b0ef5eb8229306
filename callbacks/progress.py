"""The run's progress over its optimizer steps (Lightning's bar counts micro-batches per epoch, so with
trainer.grad_accum > 1 its count and ETA are off by that factor, and it restarts each epoch), with the training
speed in tokens/s and the losses, and what the run is doing when it is not stepping: validating, or evaluating
downstream tasks (keel.callbacks.downstream_eval says so through `status`).

On a terminal it is one bar (no nested validation bar). Piped to a file or a job's log, where a bar's redraws
would run together into one line, it writes a plain line every twentieth of the run (and at its end) instead."""

from __future__ import annotations

import sys
import time
from datetime import timedelta

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from keel.cadence import due, finished_step

LINES_PER_RUN = 20  # piped: a line every max_steps / LINES_PER_RUN steps


def loss_text(value: float) -> str:
    """A loss as every line of the console prints it (the bar, the result line)."""
    return f"{value:.4f}"


class StepProgressBar(TQDMProgressBar):
    """`step n/max_steps` across epochs; a resumed run starts at its step. Its speed and ETA count only the steps
    this process has run since its first (which compiles, or restores): that step's seconds would distort both."""

    def __init__(self, tokens_per_step: int, interactive: bool | None = None) -> None:
        super().__init__()
        self.tokens_per_step = tokens_per_step  # over every process (the global batch, in tokens)
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self._loss: str | None = None  # train/loss at the last logging step
        self._val_loss: str | None = None  # val/loss of the last validation, read as it ended (the host waits there)
        self._speed: float | None = None  # tokens/s over the last logging interval without a validation in it
        self._mark: tuple[float, int] | None = None  # (time, step) where the speed's interval starts
        self._timed_from: tuple[float, int] | None = None  # (time, step) after this process's first step
        self._every = 1

    @property
    def train_description(self) -> str:
        return "step"

    def init_train_tqdm(self) -> Tqdm:
        return Tqdm(
            desc=self.train_description,
            disable=self.is_disabled or not self.interactive,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def init_validation_tqdm(self) -> Tqdm:
        return Tqdm(disable=True)  # the training bar says "validating" instead: a nested bar leaves fragments

    def on_train_start(self, trainer: Trainer, *_) -> None:
        super().on_train_start(trainer)
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps)
        bar.initial = bar.n = trainer.global_step
        self._every = max(1, trainer.max_steps // LINES_PER_RUN)
        self._mark, self._timed_from = None, None

    def on_train_epoch_start(self, trainer: Trainer, *_) -> None:
        pass  # one bar for the whole run, not one per epoch

    def status(self, text: str) -> None:
        """What the run is doing between steps, shown until the next step."""
        if self.interactive:
            self.train_progress_bar.set_description_str(f"step ({text})")
        elif self.is_enabled:  # (Lightning disables the bar on every rank but 0)
            print(f"step {self.trainer.global_step}/{self.trainer.max_steps}: {text}", flush=True)

    def on_train_batch_start(self, trainer: Trainer, *_) -> None:
        if self.interactive and self.train_progress_bar.desc != self.train_description:
            self.train_progress_bar.set_description_str(self.train_description, refresh=False)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        step = finished_step(trainer)
        if step is None:  # still accumulating gradients
            return
        now, done = time.perf_counter(), trainer.global_step
        if self._timed_from is None:  # after the first step: it compiled (or restored) and is no measure
            self._timed_from = self._mark = (now, done)
            if self.interactive:
                self.train_progress_bar.reset(total=trainer.max_steps)
                self.train_progress_bar.initial = self.train_progress_bar.n = done
        if due(step, trainer.log_every_n_steps):  # the loss is read at logging steps only: a read waits for the device
            # the last micro-batch's loss (train/loss), which Lightning hands over divided by the accumulation
            self._loss = loss_text(float(outputs["loss"]) * trainer.accumulate_grad_batches)
            if self._mark is not None and done > self._mark[1]:
                self._speed = (done - self._mark[1]) * self.tokens_per_step / (now - self._mark[0])
            self._mark = (now, done)
        if self.interactive:
            bar = self.train_progress_bar
            if self._should_update(done, bar.total):
                bar.n = done
                bar.set_postfix(self._postfix(trainer), refresh=done < trainer.max_steps)  # the end: printed once
        elif self.is_enabled and done % self._every == 0 and done < trainer.max_steps:  # the last: on_train_end
            print(self._line(trainer, now), flush=True)

    def _postfix(self, trainer: Trainer) -> dict[str, str]:
        shown = {}
        if self._speed is not None:
            shown["tokens/s"] = f"{self._speed:,.0f}"
        if self._loss is not None:
            shown["train/loss"] = self._loss
        if self._val_loss is not None:  # not read from the device here: the line is drawn at steps that must not wait
            shown["val/loss"] = self._val_loss
        return shown

    def _line(self, trainer: Trainer, now: float) -> str:
        done, total = trainer.global_step, trainer.max_steps
        line = f"step {done}/{total} ({100 * done // total}%)"
        if self._timed_from is not None and done > self._timed_from[1] and done < total:
            per_step = (now - self._timed_from[0]) / (done - self._timed_from[1])
            line += f", ETA {timedelta(seconds=round(per_step * (total - done)))}"
        return ", ".join([line, *(f"{key} {value}" for key, value in self._postfix(trainer).items())])

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and self.interactive:
            self.status("validating")

    def on_validation_batch_start(self, *_, **__) -> None:
        pass

    def on_validation_batch_end(self, *_, **__) -> None:
        pass

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark = None  # the next speed counts training only
        if (val := trainer.callback_metrics.get("val/loss")) is not None:
            self._val_loss = loss_text(float(val))
        if self.interactive and trainer.state.fn == "fit":
            self.train_progress_bar.set_postfix(self._postfix(trainer), refresh=trainer.global_step < trainer.max_steps)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pass  # Lightning's would redraw the bar with its own formatting of the metrics

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.interactive:
            self.train_progress_bar.set_description_str(self.train_description, refresh=False)
            self.train_progress_bar.set_postfix(self._postfix(trainer), refresh=False)
        super().on_train_end(trainer, pl_module)  # the bar's last state, drawn once as it closes
        if not self.interactive and self.is_enabled:
            print(self._line(trainer, time.perf_counter()), flush=True)

    def print(self, *args, sep: str = " ", **kwargs) -> None:
        if self.interactive:
            super().print(*args, sep=sep, **kwargs)
        else:
            print(*args, sep=sep, **kwargs, flush=True)
