"""The configurable callbacks' options, one dataclass per callback (OLMo-core's `train/callbacks/` shape): the
`callbacks.<name>.*` keys (and `eval.*`) with their defaults and a one-line comment each, checked in `__post_init__`
and against the trainer's in `check`, and the callback's run order. The Lightning side lives in the callbacks'
modules; keel.callbacks.registry.BUILDERS maps each name to how it is built.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from typing import ClassVar

from keel.config.trainer import TrainerConfig
from keel.errors import require

ON_NONFINITE = ("skip", "stop")
SIGNALS = ("train", "val")


@dataclass
class CallbackConfig(ABC):
    name: ClassVar[str]  # its key under callbacks.*, and its entry in keel.callbacks.registry.BUILDERS
    # run order among the configured callbacks: higher runs first (OLMo-core's convention); Lightning calls each
    # hook on the callbacks in this order, after the fixed ones (checkpoint, interrupt, LR monitor, progress bar)
    priority: ClassVar[int]

    enabled: bool = True  # false: the callback is not built (its other keys are still checked)

    def key(self, field: str) -> str:
        """The option's full key, for error messages."""
        return f"callbacks.{self.name}.{field}"

    def check(self, trainer: TrainerConfig) -> None:
        """Checks against the trainer's config (run at load time, when enabled; compile resolved); none by default."""


@dataclass
class GradNormsConfig(CallbackConfig):
    """Per-layer gradient norms before clipping (keel.callbacks.grad_norms)."""

    name = "grad_norms"
    priority = 40

    every_n_steps: int = 10  # measure and log every this many optimizer steps
    heatmap_every_n_steps: int = 100  # depth x step image; 0 = never
    activation_every_n_steps: int = 0  # ||dL/dx_l|| * rms(x_l) via keel.gradflow (one extra fwd+bwd); 0 = off
    max_blocks: int = 32  # blocks with their own scalar tags (evenly spaced); 0 = all. The heatmap shows all

    def __post_init__(self) -> None:
        for key in ("every_n_steps", "heatmap_every_n_steps", "activation_every_n_steps", "max_blocks"):
            require(getattr(self, key) >= 0, self.key(key), "must be >= 0")
        require(not self.enabled or self.every_n_steps >= 1, self.key("every_n_steps"),
                f"must be >= 1 (or set {self.key('enabled')}=false)")
        require(self.every_n_steps < 1 or self.heatmap_every_n_steps % self.every_n_steps == 0,
                self.key("heatmap_every_n_steps"),
                f"must be a multiple of {self.key('every_n_steps')}={self.every_n_steps} (0 = never)")

    def check(self, trainer: TrainerConfig) -> None:
        require(not self.activation_every_n_steps or (trainer.resolved_strategy != "fsdp" and not trainer.compile),
                self.key("activation_every_n_steps"), "the activation-gradient profile (keel.gradflow) needs "
                "unsharded, uncompiled blocks: set trainer.compile=false (trainer=cpu compiles by default) and a strategy "
                "other than fsdp, or set it to 0")


@dataclass
class StabilityConfig(CallbackConfig):
    """Non-finite steps, irrecoverable loss spikes and stagnation (keel.callbacks.stability)."""

    name = "stability"
    priority = 30

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
        require(not self.learn_by_step or self.spike_ceiling is not None, self.key("learn_by_step"),
                f"needs {self.key('spike_ceiling')} (the loss of a model that has learned nothing, e.g. the unigram "
                "loss): set it, or set learn_by_step=0")
        require(self.stagnation_window >= 0, self.key("stagnation_window"), "must be >= 0 (0 = off)")
        require(self.stagnation_min_delta >= 0, self.key("stagnation_min_delta"), "must be >= 0")
        for key in ("rewind_steps_before_onset", "rewind_skip_steps", "rewind_lr_steps", "max_rewinds"):
            require(getattr(self, key) >= 0, self.key(key), "must be >= 0")
        require(0 < self.rewind_lr_scale <= 1, self.key("rewind_lr_scale"), "must be in (0, 1] (1 = unchanged)")


@dataclass
class ThroughputConfig(CallbackConfig):
    """tokens/s, FLOP/s, MFU and data-wait share (keel.callbacks.throughput); every trainer.log_every_n_steps."""

    name = "throughput"
    priority = -100  # last: its step timing then includes the other callbacks' work

    window: int = 20  # optimizer steps averaged
    peak_flops: float = 0.0  # per device; 0 = look the GPU up (bf16/fp16 runs; CPU: no MFU)

    def __post_init__(self) -> None:
        require(self.window >= 2, self.key("window"), "must be >= 2")
        require(self.peak_flops >= 0, self.key("peak_flops"), "must be >= 0 (0 = look up)")


@dataclass
class LayerImportanceConfig(CallbackConfig):
    """Loss increase when each block is skipped, on a fixed batch (keel.callbacks.layer_importance)."""

    name = "layer_importance"
    priority = 20

    every_n_steps: int = 200  # measure every this many optimizer steps
    max_blocks: int = 16  # evenly spaced subset for deep models (first and last always included); 0 = all

    def __post_init__(self) -> None:
        require(self.every_n_steps >= 1, self.key("every_n_steps"), "must be >= 1")
        require(self.max_blocks >= 0, self.key("max_blocks"), "must be >= 0 (0 = all)")


@dataclass
class EvalConfig(CallbackConfig):
    """Downstream tasks during training (keel.callbacks.downstream_eval; docs/evaluation.md): configured by eval.*,
    run among the registered callbacks by its priority (lm-eval loads slowly: keel.callbacks.registry imports the
    callback only when a run builds it)."""

    name = "eval"
    priority = 10  # after layer importance, before throughput

    enabled: bool = True
    every_n_steps: int = 100  # a multiple of trainer.val_every_n_steps: tasks run right after validation
    tasks: list[str] = field(default_factory=lambda: ["keel_next_line", "keel_last_token"])  # names, tags or groups
    limit: int | None = 100  # first documents of each task per evaluation; null = all
    num_fewshot: int | None = None  # null: each task's own default
    batch_size: int = 16  # sequences per forward pass
    data_dir: str | None = None  # local standard-suite files (`keel eval-data fetch DIR`); null: the HF hub/cache
    include_path: str | None = None  # a directory of extra lm-eval task YAMLs

    def __post_init__(self) -> None:
        for key in ("every_n_steps", "batch_size"):
            require(getattr(self, key) >= 1, f"eval.{key}", f"must be >= 1, got {getattr(self, key)}")
        require(self.limit is None or self.limit >= 1, "eval.limit", "must be >= 1 or null (all documents)")
        require(self.num_fewshot is None or self.num_fewshot >= 0, "eval.num_fewshot", "must be >= 0 or null")
        require(not self.enabled or bool(self.tasks), "eval.tasks", "name a task, or set eval.enabled=false")

    def key(self, field: str) -> str:
        return f"eval.{field}"

    def check(self, trainer: TrainerConfig) -> None:
        require(self.every_n_steps % trainer.val_every_n_steps == 0, self.key("every_n_steps"),
                f"must be a multiple of trainer.val_every_n_steps={trainer.val_every_n_steps}, got "
                f"{self.every_n_steps}: tasks run right after a validation, next to its loss")


# every callbacks.<name> section, in the order of their keys; the run order is each class's priority.
# keel.callbacks.registry.BUILDERS builds each (and eval) under the same name (a test holds them to one set of names)
CALLBACKS: tuple[type[CallbackConfig], ...] = (
    GradNormsConfig,
    StabilityConfig,
    ThroughputConfig,
    LayerImportanceConfig,
)
