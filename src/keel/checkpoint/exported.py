"""The layout of a directory `keel export` writes (keel.export), as far as Keel reads it back: the parameter names
of the exported model, and the directory as a checkpoint (keel.checkpoint.read.read_checkpoint) for init_from, eval
and generate, its payload (keel.checkpoint.payload) built from config.json and tokenizer.json. Needs safetensors,
not transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from keel.checkpoint.payload import KeelPayload, write_payload
from keel.config import from_dict
from keel.errors import ConfigError

# KeelLM parameter prefixes -> the exported model's (the rest of each name is the same in both)
RENAMES = (
    ("embed.", "model.embed_tokens."),
    ("blocks.", "model.layers."),
    ("final_norm.", "model.norm."),
    ("head.", "lm_head."),
)
MODEL_TYPE = "keel"


def _renamed(state: dict[str, torch.Tensor], renames) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        old, new = next((old, new) for old, new in renames if name.startswith(old))
        out[new + name[len(old) :]] = tensor
    return out


def to_hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A KeelLM state_dict under the exported model's parameter names."""
    return _renamed(state, RENAMES)


def from_hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An exported model's state_dict under KeelLM's parameter names."""
    return _renamed(state, [(new, old) for old, new in RENAMES])


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # ValueError: JSON's, and bytes that are not UTF-8
        raise ConfigError(f"checkpoint: {path} cannot be read (corrupt or truncated?): {err}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"checkpoint: {path} holds a {type(value).__name__}, not the JSON object an export writes")
    return value


def _shard_names(path: Path) -> list[str]:
    """The weight files of an export: model.safetensors, or those its index names - each a file in the directory
    itself (a name reaching outside it is refused)."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return ["model.safetensors"]
    weight_map = _read_json(index).get("weight_map")
    names = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else None
    if not names or not all(isinstance(name, str) and name == Path(name).name != ".." for name in names):
        raise ConfigError(
            f"checkpoint: {index} refused: its weight_map must name weight files in {path} itself, "
            f"got {str(names)[:200]}"
        )
    return names


def _load_weights(path: Path, shards: list[str]) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ConfigError(
            f"checkpoint: reading the exported {path} needs safetensors: pip install 'keel[hf]'"
        ) from None
    state = {}
    for shard in shards:
        try:
            state.update(load_file(path / shard))
        except Exception as err:  # noqa: BLE001 - safetensors' own error type (SafetensorError) is not importable
            raise ConfigError(f"checkpoint: {path / shard} cannot be read (corrupt or truncated?): {err}") from None
    prefixes = tuple(new for _, new in RENAMES)
    foreign = sorted(name for name in state if not name.startswith(prefixes))
    if foreign:
        raise ConfigError(
            f"checkpoint: {path} holds weights a keel export never has ({', '.join(foreign[:3])}): "
            "the export was edited; use the checkpoint it came from"
        )
    return state


def read_export(path: Path, weights: bool = True) -> dict:
    """An exported directory read back as keel.checkpoint.read.read_checkpoint reads a checkpoint: its payload (the
    run's config, tokenizer and held-out loss), step and (unless weights=False) the model's state_dict under KeelLM's
    names; no optimizer state."""
    config = _read_json(path / "config.json")
    run_config = config.get("keel")  # the run's whole config (keel.export.hf_config)
    if config.get("model_type") != MODEL_TYPE or not isinstance(run_config, dict):
        raise ConfigError(
            f"checkpoint: {path} is a model directory that `keel export` did not write (model_type "
            f"{config.get('model_type')!r}); Keel reads back only its own exports"
        )
    try:  # here, naming the file: checked later, its error would read as one in the user's own settings
        from_dict(run_config)
    except ConfigError as err:
        raise ConfigError(
            f"checkpoint: {path / 'config.json'} holds an invalid keel config ({err}); it was edited: "
            "export the checkpoint it came from again"
        ) from None
    shards = _shard_names(path)
    missing = [name for name in ["tokenizer.json", *(shards if weights else [])] if not (path / name).is_file()]
    if missing:
        raise ConfigError(f"checkpoint: {path} is an incomplete export (no {', '.join(missing)})")
    checkpoint = {"global_step": config.get("trained_steps"), "exported": True}
    write_payload(
        checkpoint,
        KeelPayload(
            config=run_config, tokenizer_json=(path / "tokenizer.json").read_text(), heldout=config.get("heldout")
        ),
    )
    if weights:
        state = _load_weights(path, shards)
        if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in state:  # saved once, as the embedding
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        checkpoint["state_dict"] = {f"model.{name}": tensor for name, tensor in from_hf_names(state).items()}
    return checkpoint
