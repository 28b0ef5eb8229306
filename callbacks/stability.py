"""Training-failure detection: the three ways the paper's runs die, watched as they happen (it changes no update:
the LightningModule drops a non-finite one itself, monitor or not), and the rewind past a spike (below).

    nonfinite    the step's loss or global gradient norm is NaN/inf: on_nonfinite=skip tolerates up to
                 max_nonfinite consecutive such steps, stop fails at the first
    spike        the judged loss stays spike_margin nats above its running minimum (or above spike_ceiling) for
                 spike_patience steps
    stagnation   it has not improved by stagnation_min_delta for stagnation_window steps (0 = off)
    unlearned    at learn_by_step it has not yet been spike_ceiling_margin below spike_ceiling (0 = off): a model
                 still at the unigram loss is never judged, so a max-LR probe need not climb the rest of its ramp

Spikes, stagnation and learning judge `signal`: train (the EMA of the training losses) or val (each validation's
held-out loss). The first failure and its max tolerable LR (of the last update the model sustained) go to `failure` and
<run.dir>/stability.json; with stop_on_failure (or a non-finite step under on_nonfinite=stop) the run then stops.
Steps are judged at logging steps, all pending ones at once, from values equal on every rank: docs/tensorboard.md.

With `rewind`, a spike or max_nonfinite non-finite steps that would stop the run rewinds it instead (at most
max_rewinds times): every rank stops this fit without saving, RunCheckpoint makes the newest kept checkpoint at least
rewind_steps_before_onset steps before the onset the run's newest, and keel.training fits again from it, handing this
monitor's `rewinds` to the next one, which has the data module skip the global batches from that checkpoint through
the detection plus rewind_skip_steps (the LR x rewind_lr_scale for rewind_lr_steps steps). Each rewind is recorded
(`rewinds`: steps, skipped global batches and tokens) in every later checkpoint and in stability.json.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from keel.artifacts import STABILITY
from keel.cadence import due
from keel.callbacks.checkpointing import RunCheckpoint
from keel.callbacks.log_writing import log_scalars, log_text
from keel.callbacks.options.stability import StabilityConfig
from keel.config import Config
from keel.divergence import DivergenceJudge
from keel.rundir import say

SMOOTHING = 0.9  # EMA of the step loss (~10 steps): spikes and stagnation are judged on the trend, not one batch


@dataclass
class Failure:
    kind: str  # nonfinite | spike | stagnation | unlearned
    step: int  # onset: the first step of the failure
    detected_step: int
    lr: float | None  # learning rate at the onset
    # learning rate of the step before the onset (None: failed from the first step, or never learned)
    max_tolerable_lr: float | None
    loss: float  # step loss (signal val: held-out loss) when detected
    message: str
    detected_lr: float | None = None  # learning rate at the detection


def describe(failure: Failure) -> str:
    """One line for the console: kind, onset step and the max tolerable LR."""
    if failure.kind == "unlearned":
        return f"the run had not learned by step {failure.step} ({failure.message}); no max tolerable LR"
    lr = (
        "none (it failed from the first step)"
        if failure.max_tolerable_lr is None
        else f"{failure.max_tolerable_lr:.4g}"
    )
    return (
        f"the run failed at step {failure.step} ({failure.kind}: {failure.message}; detected at step "
        f"{failure.detected_step}); max tolerable LR {lr}"
    )


def describe_rewind(record: dict, number: int, config: StabilityConfig) -> str:
    """One line for the console: which failure, back to where, what is skipped."""
    first, end = record["skipped_batches"]
    lr = (
        f"; LR x{config.rewind_lr_scale:g} for {config.rewind_lr_steps} steps"
        if config.rewind_lr_steps and config.rewind_lr_scale != 1
        else ""
    )
    return (
        f"rewind {number} of at most {config.max_rewinds}: {record['kind']} from step {record['onset']} "
        f"(detected at step {record['detected_step']}): back to step {record['rewound_to']}, skipping global "
        f"batches {first}-{end - 1} ({end - first} batches, {record['skipped_tokens']:,} tokens){lr}"
    )


class StabilityMonitor(Callback):
    """The checks of `config`; the first failure (and, with a run_dir, stability.json) as the module says."""

    def __init__(
        self, config: StabilityConfig | None = None, run_dir: str | Path | None = None, tokens_per_step: int = 0
    ) -> None:
        self.config = config if config is not None else StabilityConfig()
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.tokens_per_step = tokens_per_step  # over every rank: what a skipped global batch holds
        self.failure: Failure | None = None
        # every rewind of this timeline, oldest first (as stability.json lists them); the last is `rewind` as it ends
        self.rewinds: list[dict] = []
        self.rewind: dict | None = None  # decided in this fit: it ends without saving, keel.training fits again
        self._carried: list[dict] | None = None  # the rewinds handed over by the fit that rewound (carry)
        self.counts = {"nonfinite_steps": 0, "spikes": 0, "stagnations": 0}
        self.max_lr_seen = 0.0
        # trend of the smoothed loss
        self._ema: float | None = None
        # the spike rule: under train, consecutive steps with the EMA above the bar; under val, steps since the last
        # evaluation within it
        self._divergence = DivergenceJudge(
            self.config.spike_margin,
            self.config.spike_patience,
            self.config.spike_ceiling,
            self.config.spike_ceiling_margin,
            consecutive=self.config.signal == "train",
        )
        self._excess: float | None = None  # last judged value - its running minimum (compared with spike_margin)
        self.heldout: list[tuple[int, float | None, float]] = []  # signal val: (step, lr, held-out loss)
        self._ref, self._ref_step = math.inf, -1  # last significant improvement (stagnation)
        self._nonfinite_run = 0
        # per step
        self._loss: torch.Tensor | None = None  # sum of the micro-batches' (1/accumulate)-scaled losses
        # steps not yet judged: (step, lr, this rank's loss, global gradient norm or None), on the device
        self._pending: list[tuple[int, float, torch.Tensor, torch.Tensor | None]] = []
        # (step, lr) back to the earliest onset a failure can still have; under val, pruned at each evaluation
        self._lrs: deque[tuple[int, float]] = deque(
            maxlen=max(self.config.spike_patience, self.config.stagnation_window, self.config.max_nonfinite) + 2
            if self.config.signal == "train"
            else None
        )
        self._scaler = None
        self._elapsed_s, self._timed_steps = 0.0, 0

    @classmethod
    def from_config(cls, options: StabilityConfig, cfg: Config) -> StabilityMonitor:
        return cls(options, cfg.run.dir, cfg.device_tokens_per_step * cfg.trainer.world_size)

    @property
    def max_tolerable_lr(self) -> float | None:
        return self.failure.max_tolerable_lr if self.failure else None

    def summary(self, steps: int) -> dict:
        """What stability.json holds: the first failure (kind None if none), steps run, the largest LR seen."""
        failure = asdict(self.failure) if self.failure else dict.fromkeys(Failure.__dataclass_fields__)
        if failure["loss"] is not None and not math.isfinite(failure["loss"]):
            failure["loss"] = None  # strict JSON has no NaN; the message says what it was
        heldout = {"heldout": self.heldout} if self.config.signal == "val" else {}
        return {
            "failed": self.failure is not None,
            **failure,
            "steps": steps,
            "max_lr_seen": self.max_lr_seen,
            **self.counts,
            "signal": self.config.signal,
            **heldout,
            "rewinds": self.rewinds,
        }

    # ------------------------------------------------------------------------------------------------- hooks

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # fp16 loss scaling: inf gradients are routine there and handled by the scaler, so only the loss is checked
        self._scaler = getattr(trainer.precision_plugin, "scaler", None)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.failure is not None and self.config.stop_on_failure:  # resumed after stopping: the run is over
            trainer.should_stop = True
        if self.rewind is not None:  # resumed from a save written as the rewind was decided: do it now
            trainer.checkpoint_callback.abandon(trainer)
            trainer.should_stop = True
            return
        if self._carried is not None:  # this fit starts at a rewind's checkpoint: skip from here
            self.rewinds, self._carried = self._carried, None
            record = self.rewinds[-1]
            first = trainer.datamodule.position.global_batch
            record["skipped_batches"] = [first, first + record["skipped_steps"]]
            record["skipped_tokens"] = record["skipped_steps"] * self.tokens_per_step
            if trainer.is_global_zero:
                say(describe_rewind(record, len(self.rewinds), self.config))
            self._event(
                trainer,
                record["rewound_to"],
                f"rewound here from step {record['detected_step']}; skipping "
                f"global batches {first} to {first + record['skipped_steps'] - 1}",
            )
            self._write(trainer)
        if self.rewinds:
            trainer.datamodule.skip([record["skipped_batches"] for record in self.rewinds])

    def carry(self, rewinds: list[dict]) -> None:
        """This monitor's fit resumes the checkpoint a rewind went back to: take over the run's rewinds (the last
        is the one being done) in place of the checkpoint's, which predate it."""
        self._carried = [dict(record) for record in rewinds]

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if self.config.signal != "val" or trainer.sanity_checking or loss is None:
            return
        self._judge_pending(trainer)  # the training steps before it come first
        step, loss = trainer.global_step - 1, float(loss)  # validation follows optimizer step global_step - 1
        self.heldout.append((step, self._lr_at(step), loss))
        if math.isfinite(loss):
            self._judge(trainer, step, loss)
        else:
            self._fail(trainer, "nonfinite", step, step, loss, f"held-out loss {loss}", heldout=True)
        earliest = min(self._divergence.good_step, self._ref_step if self.config.stagnation_window else step) - 1
        while self._lrs and self._lrs[0][0] < earliest:
            self._lrs.popleft()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        loss = loss.detach()
        if self._scaler is not None:
            loss = loss / self._scaler.get_scale()
        self._loss = loss if self._loss is None else self._loss + loss

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        if self.rewinds and trainer.global_step < self.rewinds[-1]["rewound_to"] + self.config.rewind_lr_steps:
            for group in optimizer.param_groups:  # the scheduler sets each step's LR afresh after the update
                group["lr"] *= self.config.rewind_lr_scale
        if self._loss is None:  # no backward this step (a training_step that returned None)
            return
        start = time.perf_counter()
        loss, self._loss = self._loss.float(), None
        # the step's global gradient norm, as the LightningModule measured it (and judged it: a non-finite update
        # is dropped there, this only records it); under fp16 loss scaling the scaler's skips are routine
        norm = pl_module.global_grad_norm.to(loss.device) if self._scaler is None else None
        step = trainer.global_step
        self._pending.append((step, optimizer.param_groups[0]["lr"], loss, norm))
        self._elapsed_s += time.perf_counter() - start
        if due(step, trainer.log_every_n_steps):
            self._judge_pending(trainer)

    def _judge_pending(self, trainer: Trainer) -> None:
        """The verdicts on the steps since the last call, in order: one all-reduce (the loss averaged over ranks)
        and one read for all of them. Every rank calls it at the same steps."""
        if not self._pending:
            return
        start = time.perf_counter()
        steps, lrs, losses, norms = zip(*self._pending)
        self._pending = []
        rows = [trainer.strategy.reduce(torch.stack(losses), reduce_op="mean")]
        if norms[0] is not None:
            rows.append(torch.stack(norms).to(rows[0].device))
        for step, lr, (loss, *grad_norm) in zip(steps, lrs, torch.stack(rows, dim=1).tolist()):
            self._lrs.append((step, lr))
            self.max_lr_seen = max(self.max_lr_seen, lr)
            if math.isfinite(loss) and all(math.isfinite(g) for g in grad_norm):
                self._nonfinite_run = 0
                self._ema = loss if self._ema is None else SMOOTHING * self._ema + (1 - SMOOTHING) * loss
                if self.config.signal == "train":
                    self._judge(trainer, step, self._ema)
            else:
                self._on_nonfinite(trainer, step, loss, grad_norm)
        self._elapsed_s += time.perf_counter() - start
        self._timed_steps += len(steps)
        if due(steps[-1], trainer.log_every_n_steps):  # a logging step is always the last: it judges the rest
            self._log_state(trainer, steps[-1])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._judge_pending(trainer)
        if self.rewind is not None:
            # the data of the steps taken since the checkpoint, and the margin past them, are skipped
            self.rewind["discarded_steps"] = trainer.global_step - self.rewind["rewound_to"]
            self.rewind["skipped_steps"] = self.rewind["discarded_steps"] + self.config.rewind_skip_steps
            trainer.checkpoint_callback.rewind_to(trainer, self.rewind["rewound_to"])
        self._write(trainer)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        # Lightning took state_dict() just before: judge the steps still pending, which the checkpoint has trained,
        # and save that state instead. Every rank saves (save_checkpoint is collective), so all join the all-reduce.
        if self._pending and "callbacks" in checkpoint:  # (not in a weights-only one)
            self._judge_pending(trainer)
            checkpoint["callbacks"][self.state_key] = self.state_dict()

    def state_dict(self) -> dict:
        return {
            "failure": asdict(self.failure) if self.failure else None,
            "counts": dict(self.counts),
            "max_lr_seen": self.max_lr_seen,
            "ema": self._ema,
            "best": self._divergence.best,
            "over": self._divergence.over,
            "ref": self._ref,
            "ref_step": self._ref_step,
            "nonfinite_run": self._nonfinite_run,
            "good_step": self._divergence.good_step,
            "heldout": self.heldout,
            "rewinds": self.rewinds,
            "rewind": self.rewind,
        }

    def load_state_dict(self, state: dict) -> None:
        self.failure = Failure(**state["failure"]) if state["failure"] else None
        self.counts.update(state["counts"])
        self.max_lr_seen = state["max_lr_seen"]
        self._ema, self._divergence.best, self._divergence.over = state["ema"], state["best"], state["over"]
        self._ref, self._ref_step, self._nonfinite_run = state["ref"], state["ref_step"], state["nonfinite_run"]
        self._divergence.good_step = state.get("good_step", -1)
        self.heldout = [tuple(point) for point in state.get("heldout", [])]
        self.rewinds = state.get("rewinds", [])
        self.rewind = state.get("rewind")
        if self.rewind is not None:
            self.rewinds[-1] = self.rewind  # one record, as when it was saved

    # ------------------------------------------------------------------------------------------------ checks

    def _on_nonfinite(self, trainer: Trainer, step: int, loss: float, grad_norm: list[float]) -> None:
        self.counts["nonfinite_steps"] += 1
        self._nonfinite_run += 1
        what = f"loss {loss:.4g}" + (f", gradient norm {grad_norm[0]:.4g}" if grad_norm else "")
        self._event(trainer, step, f"non-finite step ({what}): update skipped")
        if self.config.on_nonfinite == "stop":
            self._fail(trainer, "nonfinite", step, step, loss, f"non-finite step ({what})", stop=True)
        elif self._nonfinite_run >= self.config.max_nonfinite:
            onset = step - self._nonfinite_run + 1
            self._fail(trainer, "nonfinite", onset, step, loss, f"{self._nonfinite_run} consecutive non-finite steps")

    def _judge(self, trainer: Trainer, step: int, value: float) -> None:
        """Spike and stagnation checks on one point of the signal: the training EMA, or a held-out loss."""
        divergence, before = self._divergence, self._divergence.over
        diverged = divergence.see(step, value)
        self._excess = value - divergence.best
        if divergence.above:
            if before == 0:
                self.counts["spikes"] += 1
                self._event(
                    trainer,
                    step,
                    f"loss spike: {self.config.signal} loss {value:.3f} is {self._excess:.2f} above its minimum",
                )
            if diverged:
                bar = divergence.bar
                self._fail(
                    trainer,
                    "spike",
                    step - divergence.over + 1,
                    step,
                    value,
                    f"{self.config.signal} loss "
                    f"above {bar:.3f} (its minimum {divergence.best:.3f} + {self.config.spike_margin}"
                    + (", capped at the ceiling" if bar == self.config.spike_ceiling else "")
                    + f") for {divergence.over} steps",
                    heldout=self.config.signal == "val",
                )
        elif before:
            self._event(trainer, step, f"loss spike recovered after {before} steps")
        learn_by, ceiling, ceiling_margin = (
            self.config.learn_by_step,
            self.config.spike_ceiling,
            self.config.spike_ceiling_margin,
        )
        if learn_by and step >= learn_by and self.failure is None and divergence.best > ceiling - ceiling_margin:
            self._fail(
                trainer,
                "unlearned",
                step,
                step,
                value,
                f"{self.config.signal} loss at best "
                f"{divergence.best:.3f}, "
                f"not yet {ceiling_margin} below {ceiling:.3f}",
            )
        below = self.config.stagnation_below
        if not self.config.stagnation_window or (below is not None and divergence.best > below):
            return
        if value < self._ref - self.config.stagnation_min_delta:
            self._ref, self._ref_step = value, step
        elif step - self._ref_step >= self.config.stagnation_window:
            self.counts["stagnations"] += 1
            self._fail(
                trainer,
                "stagnation",
                self._ref_step + 1,
                step,
                value,
                f"{self.config.signal} loss {value:.3f} has not improved on {self._ref:.3f} by "
                f"{self.config.stagnation_min_delta} for {step - self._ref_step} steps",
                heldout=self.config.signal == "val",
            )
            self._ref_step = step  # another stagnation only after another full window

    # ----------------------------------------------------------------------------------------------- outcome

    def _lr_at(self, step: int) -> float | None:
        return next((lr for s, lr in self._lrs if s == step), None)

    def _fail(
        self,
        trainer: Trainer,
        kind: str,
        onset: int,
        step: int,
        loss: float,
        message: str,
        stop: bool = False,
        heldout: bool = False,
    ) -> None:
        """heldout: judged on evaluations, each taken after its step's update (the last tolerated update is the
        one before the onset); else on training losses, each computed before its step's update (a loss at the
        onset comes from the update before it, so the last tolerated one is two steps back; none at onset 1)."""
        if self.rewind is not None:  # this fit is ending to rewind: what it judges now is thrown away
            return
        if not stop and self.config.rewind and self.config.stop_on_failure and kind in ("spike", "nonfinite"):
            refused = self._plan_rewind(trainer, kind, onset, step, loss, message)
            if refused is None:
                return
            message = f"{message}; not rewound: {refused}"
        first = self.failure is None
        if first:
            tolerated = None if kind == "unlearned" else self._lr_at(onset - (1 if heldout else 2))
            self.failure = Failure(kind, onset, step, self._lr_at(onset), tolerated, loss, message, self._lr_at(step))
            self._write(trainer)
        self._event(trainer, step, f"FAILURE ({kind}, onset step {onset}): {message}")
        if stop or self.config.stop_on_failure:
            if not trainer.should_stop and trainer.is_global_zero:  # once (a stop can be asked again before it)
                say(f"stability: stopping the run: {describe(self.failure)}")
            trainer.should_stop = True
        elif first and trainer.is_global_zero:  # the user asked to go on: say it once, not at every later failure
            say(f"stability: {describe(self.failure)}; training goes on (callbacks.stability.stop_on_failure=false)")

    def _plan_rewind(self, trainer: Trainer, kind: str, onset: int, step: int, loss: float, message: str) -> str | None:
        """Rewind to the newest kept checkpoint at least rewind_steps_before_onset steps before `onset`: this fit
        stops without saving more (on_train_end makes that checkpoint the newest). None when decided, else why not.
        Every rank comes here at the same step (the verdicts are the same everywhere); rank 0 reads the directory."""
        if len(self.rewinds) >= self.config.max_rewinds:
            return f"{len(self.rewinds)} rewind(s) already ({self.config.key('max_rewinds')}={self.config.max_rewinds})"
        checkpoints = trainer.checkpoint_callback
        if not isinstance(checkpoints, RunCheckpoint) or not hasattr(trainer.datamodule, "skip"):
            return "this run keeps no step-numbered checkpoints to rewind to"
        checkpoints.finish_save(trainer)  # a save in the background: whole, and a candidate
        latest = onset - self.config.rewind_steps_before_onset
        kept = {at: str(path) for at, path in checkpoints.kept_steps().items()} if trainer.is_global_zero else None
        kept = trainer.strategy.broadcast(kept)
        target = max((s for s in kept if s <= latest), default=None)
        if target is None:
            return (
                f"no kept checkpoint is from step {latest} or earlier (onset {onset} - "
                f"{self.config.key('rewind_steps_before_onset')}={self.config.rewind_steps_before_onset}; kept: "
                f"{', '.join(map(str, sorted(kept))) or 'none'}): checkpoint more often, or keep more "
                "(trainer.keep_last_k)"
            )
        checkpoints.abandon(trainer)
        trainer.should_stop = True
        self.rewind = {
            "kind": kind,
            "onset": onset,
            "detected_step": step,
            "loss": loss if math.isfinite(loss) else None,
            "message": message,
            "rewound_to": target,
            "checkpoint": kept[target],
        }
        self.rewinds.append(self.rewind)
        self._event(trainer, step, f"REWIND ({kind}, onset step {onset}): {message}; rewinding to step {target}")
        return None

    def _event(self, trainer: Trainer, step: int, text: str) -> None:
        log_text(trainer, "stability/events", f"step {step}: {text}", step)
        self._log_state(trainer, step)

    def _log_state(self, trainer: Trainer, step: int) -> None:
        metrics = {f"stability/{name}": float(count) for name, count in self.counts.items()}
        metrics["stability/failed"] = float(self.failure is not None)
        metrics["stability/rewinds"] = float(len(self.rewinds))
        if self._excess is not None:
            metrics["stability/loss_excess"] = self._excess  # what spike_margin is compared with
        if self.max_tolerable_lr is not None:
            metrics["stability/max_tolerable_lr"] = self.max_tolerable_lr
        if self._timed_steps:
            metrics["time/stability_ms"] = 1e3 * self._elapsed_s / self._timed_steps
            self._elapsed_s, self._timed_steps = 0.0, 0
        log_scalars(trainer, metrics, step)

    def _write(self, trainer: Trainer) -> None:
        if self.run_dir is None or not trainer.is_global_zero:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        steps = trainer.global_step
        (self.run_dir / STABILITY).write_text(json.dumps(self.summary(steps), indent=1) + "\n")
