"""Downstream tasks during pretraining, next to validation loss: training loss can hide downstream
differences (the paper's Figure 8: lower loss, no better tasks), so the tasks are watched as the run goes.

Right after every eval.every_n_steps-th validation, each task in eval.tasks runs on its first eval.limit
documents: `eval/<task>/<metric>`, `eval/disagree/<task>` (loss and task moved in opposite directions), at the end
`eval/spearman/<task>`, one printed line per evaluation and `<run.dir>/eval_history.json`. Training is untouched
(eval mode without gradients, RNG states restored, the train dataloader never used); on several processes each rank
scores its share of the documents in lockstep and only rank 0 logs and writes. Tags, cost and tests:
docs/evaluation.md, "In-loop evaluation".
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from scipy.stats import spearmanr

from keel.artifacts import EVAL_HISTORY
from keel.callbacks.log_writing import log_scalars
from keel.callbacks.options.downstream_eval import EvalConfig
from keel.config import Config
from keel.evaluation.lm import KeelEvalLM
from keel.evaluation.suite import load_tasks, primary_metric, run_tasks

HISTORY = EVAL_HISTORY
MIN_POINTS_FOR_SPEARMAN = 3


@contextlib.contextmanager
def preserved_rng():
    """Restore the global RNGs on exit: lm-eval reseeds them, and training must draw what it would have."""
    cuda = torch.cuda.is_initialized()
    states = random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda and torch.cuda.get_rng_state_all()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda:
            torch.cuda.set_rng_state_all(states[3])


def _moved(before: float, after: float, higher_is_better: bool) -> int:
    """+1 better, -1 worse, 0 unchanged."""
    change = (after - before) * (1 if higher_is_better else -1)
    return (change > 0) - (change < 0)


class DownstreamEval(Callback):
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg  # eval.* (its cadence checked against trainer.* by EvalConfig.check at load time)
        self.history: list[dict] = []  # {"step", "val_loss", "wall_s", "scores": {task: {metric: value}}}
        self.tasks: dict = {}
        self.lm: KeelEvalLM | None = None

    @classmethod
    def from_config(cls, options: EvalConfig, cfg: Config) -> DownstreamEval:
        return cls(cfg)

    # Saved in checkpoints, so a resumed run continues the same history.
    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = state_dict["history"]

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.tasks:
            return
        with preserved_rng():
            self.tasks = self._load_tasks(trainer)
        self.primary = {name: primary_metric(task) for name, task in self.tasks.items()}

    def _load_tasks(self, trainer: Trainer) -> dict:
        """Rank 0 loads the tasks first, writing the generated ones under run.dir if data.dir has none, then the
        others (run.dir is on a filesystem every node shares). A failure on rank 0 stops every rank."""
        ev, cfg = self.cfg.eval, self.cfg
        load = functools.partial(load_tasks, ev.tasks, ev.include_path, ev.data_dir, cfg.data.dir, cfg.run.dir)
        tasks, failure = {}, None
        if trainer.is_global_zero:
            try:
                tasks = load()
            except Exception as err:  # noqa: BLE001 - raised below, after the others have heard of it
                failure = err
        if (message := trainer.strategy.broadcast(failure and f"{type(failure).__name__}: {failure}")) is not None:
            if failure is not None:
                raise failure
            raise RuntimeError(f"downstream eval: rank 0 could not load eval.tasks: {message}")
        return tasks or load()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        done = trainer.global_step  # optimizer steps taken
        due = done % self.cfg.eval.every_n_steps == 0 or done == trainer.max_steps
        step = done - 1  # 0-based index of the last step: where Lightning logs this validation's val/loss
        if trainer.sanity_checking or not due or (self.history and self.history[-1]["step"] >= step):
            return
        if (bar := trainer.progress_bar_callback) is not None and hasattr(bar, "status"):  # keel's StepProgressBar
            bar.status(f"evaluating {', '.join(self.tasks)}")
        start = time.perf_counter()
        scores = self._evaluate(pl_module)
        entry = {
            "step": step,
            "val_loss": float(trainer.callback_metrics["val/loss"]),
            "wall_s": time.perf_counter() - start,
            "scores": scores,
        }
        metrics = {f"eval/{task}/{name}": value for task, values in scores.items() for name, value in values.items()}
        metrics["time/downstream_eval_s"] = entry["wall_s"]
        primary = ", ".join(f"{task} {metric} {scores[task][metric]:.4g}" for task, (metric, _) in self.primary.items())
        pl_module.print(f"downstream eval: step {done}: {primary} ({entry['wall_s']:.1f} s)")  # steps as the bar counts
        if self.history:
            metrics.update(self._disagreements(pl_module, self.history[-1], entry))
        self.history.append(entry)
        log_scalars(trainer, metrics, step)
        self._write_history(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rhos = self.spearman()
        for task, rho in rhos.items():
            if rho is not None:  # None: too few evaluations, or a loss or score that never moved
                pl_module.print(
                    f"downstream eval: Spearman(-val loss, {task} {self.primary[task][0]}) over "
                    f"{len(self.history)} evaluations = {rho:.3f}"
                )
        log_scalars(
            trainer,
            {f"eval/spearman/{task}": rho for task, rho in rhos.items() if rho is not None},
            trainer.global_step - 1,
        )
        self._write_history(trainer)

    def _evaluate(self, pl_module: LightningModule) -> dict[str, dict[str, float]]:
        model = pl_module.model
        if self.lm is None:
            self.lm = KeelEvalLM(
                model=model,
                tokenizer_json=pl_module.tokenizer_json,
                batch_size=self.cfg.eval.batch_size,
                distributed=True,  # on one process, the same as False
                # lm-eval fails on a rank that gets no document: share only when every rank gets one
                share_documents=(self.cfg.eval.limit or self.cfg.trainer.world_size) >= self.cfg.trainer.world_size,
            )
        was_training = model.training
        model.eval()
        try:
            with preserved_rng():
                return run_tasks(
                    self.lm, self.tasks, self.cfg.eval.limit, self.cfg.eval.num_fewshot, progress_bars=False
                )
        finally:
            model.train(was_training)

    def _disagreements(self, pl_module: LightningModule, before: dict, after: dict) -> dict[str, float]:
        loss_moved = _moved(before["val_loss"], after["val_loss"], higher_is_better=False)
        flags = {}
        for task, (metric, higher) in self.primary.items():
            old, new = before["scores"][task][metric], after["scores"][task][metric]
            disagree = loss_moved * _moved(old, new, higher) < 0
            flags[f"eval/disagree/{task}"] = float(disagree)
            if disagree:
                pl_module.print(
                    f"downstream eval: step {after['step'] + 1}: "  # history steps are 0-based; the console counts
                    f"val loss {before['val_loss']:.4f} -> {after['val_loss']:.4f} "
                    f"({'better' if loss_moved > 0 else 'worse'}) but {task} {metric} {old:.4f} -> {new:.4f} "
                    f"({'worse' if loss_moved > 0 else 'better'})"
                )
        return flags

    def spearman(self) -> dict[str, float | None]:
        """Per task, the rank correlation of -val loss with the primary metric (sign-flipped if lower is
        better) over the evaluations so far: +1 = the task improved exactly when the loss did."""
        rhos = {}
        for task, (metric, higher) in self.primary.items():
            losses = [-e["val_loss"] for e in self.history]
            scores = [e["scores"][task][metric] * (1 if higher else -1) for e in self.history]
            defined = len(self.history) >= MIN_POINTS_FOR_SPEARMAN and len(set(losses)) > 1 and len(set(scores)) > 1
            rhos[task] = float(spearmanr(losses, scores).statistic) if defined else None
        return rhos

    def _write_history(self, trainer: Trainer) -> None:
        if trainer.is_global_zero:
            tasks = {task: {"metric": name, "higher_is_better": up} for task, (name, up) in self.primary.items()}
            history = {"tasks": tasks, "evaluations": self.history, "spearman": self.spearman()}
            path = Path(self.cfg.run.dir) / HISTORY
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{HISTORY}.tmp")  # then renamed: a reader never sees half a file
            tmp.write_text(json.dumps(history, indent=2))
            os.replace(tmp, path)
