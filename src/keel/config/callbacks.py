"""The `callbacks.*` section, made of the options of every configurable callback: each module of
keel.callbacks.options defines one (torch-free), found here by walking that package, so that a new callback needs
no entry in any list. The downstream evaluation's options are a section of their own, `eval.*` (Config.eval).
"""

from __future__ import annotations

import pkgutil
from dataclasses import field, make_dataclass
from importlib import import_module

from keel.callbacks import options
from keel.callbacks.options import CallbackConfig
from keel.callbacks.options.downstream_eval import EvalConfig


def options_classes() -> list[type[CallbackConfig]]:
    """The CallbackConfig subclass each module of keel.callbacks.options defines, by module name."""
    found = []
    for module in pkgutil.iter_modules(options.__path__, f"{options.__name__}."):
        found += [
            value
            for value in vars(import_module(module.name)).values()
            if isinstance(value, type) and issubclass(value, CallbackConfig) and value.__module__ == module.name
        ]
    return found


# every callbacks.<name> section, in the order of their names; the run order is each class's priority
CALLBACKS: tuple[type[CallbackConfig], ...] = tuple(
    sorted((c for c in options_classes() if c is not EvalConfig), key=lambda c: c.name)
)

CallbacksConfig = make_dataclass("CallbacksConfig", [(c.name, c, field(default_factory=c)) for c in CALLBACKS])
CallbacksConfig.__module__ = __name__  # make_dataclass's `module=` is Python >= 3.12; pickling needs it
