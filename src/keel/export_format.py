"""The layout of a directory `keel export` writes (keel.export), as far as Keel reads it back: the parameter names
of the exported model, and the directory as a checkpoint (keel.checkpoint.read_checkpoint) for init_from, eval
and generate. Needs safetensors, not transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from keel.errors import ConfigError

# KeelLM parameter prefixes -> the exported model's (the rest of each name is the same in both)
RENAMES = (("embed.", "model.embed_tokens."), ("blocks.", "model.layers."), ("final_norm.", "model.norm."),
           ("head.", "lm_head."))
MODEL_TYPE = "keel"


def _renamed(state: dict[str, torch.Tensor], renames) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        old, new = next((old, new) for old, new in renames if name.startswith(old))
        out[new + name[len(old):]] = tensor
    return out


def to_hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A KeelLM state_dict under the exported model's parameter names."""
    return _renamed(state, RENAMES)


def from_hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An exported model's state_dict under KeelLM's parameter names."""
    return _renamed(state, [(new, old) for old, new in RENAMES])


def read_export(path: Path, weights: bool = True) -> dict:
    """An exported directory read back as keel.checkpoint.read_checkpoint reads a checkpoint: the run's config,
    tokenizer, step and (unless weights=False) the model's state_dict under KeelLM's names; no optimizer state."""
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != MODEL_TYPE or "keel" not in config:
        raise ConfigError(f"checkpoint: {path} is a model directory that `keel export` did not write (model_type "
                          f"{config.get('model_type')!r}); Keel reads back only its own exports")
    index = path / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    missing = [name for name in ["tokenizer.json", *(shards if weights else [])] if not (path / name).is_file()]
    if missing:
        raise ConfigError(f"checkpoint: {path} is an incomplete export (no {', '.join(missing)})")
    checkpoint = {"keel": {"config": config["keel"], "tokenizer_json": (path / "tokenizer.json").read_text()},
                  "global_step": config.get("trained_steps"), "exported": True}
    if weights:
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ConfigError(f"checkpoint: reading the exported {path} needs safetensors: pip install "
                              "'keel[hf]'") from None

        state = {name: tensor for shard in shards for name, tensor in load_file(path / shard).items()}
        if config.get("tie_word_embeddings"):  # saved once, under the embedding's name
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        checkpoint["state_dict"] = {f"model.{name}": tensor for name, tensor in from_hf_names(state).items()}
    return checkpoint
