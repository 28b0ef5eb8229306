"""Keel: pretraining very deep language models (Chen & Wei, arXiv 2601.19895) and their baselines."""

from keel.model import KeelLM, ModelConfig

__all__ = ["KeelLM", "ModelConfig"]
