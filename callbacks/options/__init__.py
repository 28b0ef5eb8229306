"""Each configurable callback's options, one torch-free module per callback beside its behaviour in callbacks/
(OLMo-core's callback-as-config shape): a dataclass subclassing CallbackConfig with the `callbacks.<name>.*` keys
(`eval.*` for the downstream evaluation), their defaults and a one-line comment each, checked in `__post_init__` and
against the trainer's in `check`; the callback's run order; and the class that acts on them, built by its
`from_config(options, cfg)` (keel.training.configured_callbacks).

keel.config.callbacks finds them by walking this package, so every key is checked at start-up without torch or
Lightning; a callback's own module is imported only when a run builds it. Adding a callback: its options module here
and its module in callbacks/ (docs/tensorboard.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from keel.config.trainer import TrainerConfig


@dataclass
class CallbackConfig:
    name: ClassVar[str]  # its key under callbacks.*
    # run order among the configured callbacks: higher runs first (OLMo-core's convention); Lightning calls each
    # hook on the callbacks in this order, after the fixed ones (checkpoint, interrupt, LR monitor, progress bar)
    priority: ClassVar[int]
    # the Lightning callback these options configure, as "module.Class": built by its from_config(options, cfg)
    callback: ClassVar[str]

    enabled: bool = True  # false: the callback is not built (its other keys are still checked)

    def key(self, field: str) -> str:
        """The option's full key, for error messages."""
        return f"callbacks.{self.name}.{field}"

    def check(self, trainer: TrainerConfig) -> None:
        """Checks against the trainer's config (run at load time, when enabled; compile resolved); none by default."""
