"""Keel: pretraining very deep language models (Chen & Wei, arXiv 2601.19895) and their baselines."""

import importlib

# name -> its module, imported on first access (PEP 562): importing any keel module runs this file, and `keel
# pretrain` checks its config before torch is loaded (KeelLM's module imports it)
_EXPORTS = {"KeelLM": "keel.model", "ModelConfig": "keel.config"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'keel' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
