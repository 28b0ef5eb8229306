"""What a configurable callback declares (OLMo-core's `train/callbacks/` shape): its options as a dataclass, the
`callbacks.<name>.*` keys, with their defaults and a one-line comment each, checked in its `__post_init__`; its run
order; and how the callback is built from the whole config. Registering the class in `keel.callbacks.CALLBACKS`
puts its keys in the config and the callback in every run."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from lightning.pytorch.callbacks import Callback

if TYPE_CHECKING:
    from keel.config import Config


@dataclass
class CallbackConfig(ABC):
    name: ClassVar[str]  # its key under callbacks.*
    # run order among the configured callbacks: higher runs first (OLMo-core's convention); Lightning calls each
    # hook on the callbacks in this order, after the fixed ones (checkpoint, interrupt, LR monitor, progress bar)
    priority: ClassVar[int]

    enabled: bool = True  # false: the callback is not built (its other keys are still checked)

    def key(self, field: str) -> str:
        """The option's full key, for error messages."""
        return f"callbacks.{self.name}.{field}"

    def check(self, cfg: Config) -> None:
        """Checks against the rest of the config (run at load time, when enabled); none by default."""

    @abstractmethod
    def build(self, cfg: Config) -> Callback:
        """The callback, for a run of cfg."""
