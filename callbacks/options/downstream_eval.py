"""The in-loop downstream evaluation's options: `eval.*`, a section of its own (Config.eval)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from keel.callbacks.options import CallbackConfig
from keel.errors import require

if TYPE_CHECKING:
    from keel.config.trainer import TrainerConfig


@dataclass
class EvalConfig(CallbackConfig):
    """Downstream tasks during training (keel.callbacks.downstream_eval; docs/evaluation.md): configured by eval.*,
    run among the configured callbacks by its priority (lm-eval loads slowly: its module is imported only when a
    run builds the callback)."""

    name = "eval"
    priority = 10  # after layer importance, before throughput
    callback = "keel.callbacks.downstream_eval.DownstreamEval"

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
        require(
            self.every_n_steps % trainer.val_every_n_steps == 0,
            self.key("every_n_steps"),
            f"must be a multiple of trainer.val_every_n_steps={trainer.val_every_n_steps}, got "
            f"{self.every_n_steps}: tasks run right after a validation, next to its loss",
        )
