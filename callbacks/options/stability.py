"""The stability monitor's options: `callbacks.stability.*`."""

from __future__ import annotations

from dataclasses import dataclass

from keel.callbacks.options import CallbackConfig
from keel.errors import require

ON_NONFINITE = ("skip", "stop")
SIGNALS = ("train", "val")


@dataclass
class StabilityConfig(CallbackConfig):
    """Non-finite steps, irrecoverable loss spikes and stagnation (keel.callbacks.stability)."""

    name = "stability"
    priority = 30
    callback = "keel.callbacks.stability.StabilityMonitor"

    # a non-finite step (its update is dropped by the training step, monitor or not) - skip: go on; stop: a
    # failure that ends the run, even with stop_on_failure=false
    on_nonfinite: str = "skip"
    max_nonfinite: int = 5  # under skip: this many consecutive non-finite steps = a failure
    spike_margin: float = 1.0  # smoothed loss above its running minimum by this much (nats) ...
    spike_patience: int = 20  # ... for this many steps = an irrecoverable spike
    # a loss above this level is above its range too, once its minimum has been spike_ceiling_margin below it
    # (keel maxlr: the unigram loss - a model that falls back to token frequencies has diverged); null = none
    spike_ceiling: float | None = None
    spike_ceiling_margin: float = 0.5
    # a run whose judged loss is not yet spike_ceiling_margin below spike_ceiling at this step has not learned: a
    # failure (kind unlearned), so a probe that will never be judged stops climbing its ramp; 0 = off
    learn_by_step: int = 0
    stagnation_window: int = 0  # no improvement of the smoothed loss for this many steps = stagnation; 0 = off
    stagnation_min_delta: float = 0.01  # nats that count as an improvement
    stagnation_below: float | None = None  # judge stagnation only once the loss has been <= this; null = always
    stop_on_failure: bool = True  # end the run (final checkpoint, non-zero exit) at the first failure; false: go on
    # where a spike or max_nonfinite non-finite steps would stop the run (stop_on_failure): rewind every rank to the
    # newest kept checkpoint at least rewind_steps_before_onset steps before the onset, skip the data from it through
    # the detection plus rewind_skip_steps global batches, and go on; at most max_rewinds times (docs/failures.md)
    rewind: bool = True
    rewind_steps_before_onset: int = 10  # the smoothed loss lags the batch losses (~10 steps): look further back
    rewind_skip_steps: int = 100  # global batches skipped past the detection (PaLM: 200-500 in all)
    rewind_lr_scale: float = 1.0  # the LR times this ...
    rewind_lr_steps: int = 0  # ... for this many optimizer steps after a rewind (0 = unchanged)
    max_rewinds: int = 3  # then the failure stands (stop_on_failure)
    # what spikes and stagnation judge: train = EMA of the training-batch losses; val = the held-out loss of each
    # validation run (trainer.val_batches fixed batches every trainer.val_every_n_steps; the max-LR protocol's)
    signal: str = "train"

    def __post_init__(self) -> None:
        require(self.signal in SIGNALS, self.key("signal"), f"allowed: {', '.join(SIGNALS)}")
        require(self.on_nonfinite in ON_NONFINITE, self.key("on_nonfinite"), f"allowed: {', '.join(ON_NONFINITE)}")
        for key in ("max_nonfinite", "spike_patience"):
            require(getattr(self, key) >= 1, self.key(key), "must be >= 1")
        require(self.spike_margin > 0, self.key("spike_margin"), "must be > 0")
        require(self.spike_ceiling_margin >= 0, self.key("spike_ceiling_margin"), "must be >= 0")
        require(self.learn_by_step >= 0, self.key("learn_by_step"), "must be >= 0 (0 = off)")
        require(
            not self.learn_by_step or self.spike_ceiling is not None,
            self.key("learn_by_step"),
            f"needs {self.key('spike_ceiling')} (the loss of a model that has learned nothing, e.g. the unigram "
            "loss): set it, or set learn_by_step=0",
        )
        require(self.stagnation_window >= 0, self.key("stagnation_window"), "must be >= 0 (0 = off)")
        require(self.stagnation_min_delta >= 0, self.key("stagnation_min_delta"), "must be >= 0")
        for key in ("rewind_steps_before_onset", "rewind_skip_steps", "rewind_lr_steps", "max_rewinds"):
            require(getattr(self, key) >= 0, self.key(key), "must be >= 0")
        require(0 < self.rewind_lr_scale <= 1, self.key("rewind_lr_scale"), "must be in (0, 1] (1 = unchanged)")
