"""Reading a checkpoint: a single file, a sharded (FSDP) directory or a directory `keel export` wrote, through the
safe readers (keel.checkpoint.safe), with a clear error for a missing, corrupt, incomplete or foreign one; its
weights checked against its config before a model of that config is built; the trained model (load_model)."""

from __future__ import annotations

from pathlib import Path

import torch

from keel.checkpoint.exported import read_export
from keel.checkpoint.layout import DCP_METADATA, LAST, SHARDED_META
from keel.checkpoint.payload import has_payload, read_payload
from keel.checkpoint.safe import SafeFileSystemReader, load_in_this_process, refuse_payloads, torch_load
from keel.config import Config, ModelConfig
from keel.config.model import needs_final_norm
from keel.errors import ConfigError, describe_error
from keel.memory import check_model_fits
from keel.model import KeelLM, block_layouts


def _sharded_weights(reader) -> dict[str, torch.Tensor]:
    """The full model state_dict (`model.<param>`), assembled in this process from every rank's shards."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = "state_dict."  # DCP flattens Lightning's {"state_dict": {...}} to dotted keys
    entries = reader.read_metadata().state_dict_metadata
    weights = {
        key[len(prefix) :]: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    load_in_this_process({"state_dict": weights}, reader)
    return weights


def _read_sharded(path: Path, weights: bool) -> dict:
    missing = [name for name in (DCP_METADATA, SHARDED_META) if not (path / name).is_file()]
    if len(missing) == 2:  # nothing of a sharded checkpoint: a run dir, its checkpoints/ or another directory
        meant = next((last for last in (path / "checkpoints" / LAST, path / LAST) if last.exists()), None)
        raise ConfigError(
            f"checkpoint: {path} is not a checkpoint: it has no {DCP_METADATA} nor {SHARDED_META}"
            + (
                f"; did you mean {meant}?"
                if meant
                else " (a checkpoint is a .ckpt file or an FSDP checkpoint directory holding both)"
            )
        )
    if missing:
        raise ConfigError(
            f"checkpoint: {path} is an incomplete sharded checkpoint (no {', '.join(missing)}): "
            "its save was interrupted; resume from another checkpoint"
        )
    try:
        reader = SafeFileSystemReader(path)
        for info in reader.read_metadata().storage_data.values():  # every shard file there, none truncated
            shard = path / info.relative_path
            if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
                raise ConfigError(
                    f"checkpoint: {path} is corrupt: shard file {info.relative_path} is missing or truncated"
                )
        refuse_payloads(path)
        checkpoint = torch_load(path / SHARDED_META)
        if weights:
            checkpoint["state_dict"] = _sharded_weights(reader)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"checkpoint: {path} cannot be read (corrupt or truncated?): {describe_error(err)}") from None
    return checkpoint


def read_checkpoint(path: str | Path, weights: bool = True) -> dict:
    """A checkpoint's dict, from a single file (torch.load, weights_only=True), a sharded directory (its
    meta.pt plus, unless weights=False, the full model state_dict) or a directory `keel export` wrote (weights
    only), with a clear error for a missing, corrupt, incomplete or foreign one."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():  # a model directory `keel export` wrote
        return read_export(path, weights)
    if path.is_dir():
        checkpoint = _read_sharded(path, weights)
    elif path.is_file():
        if path.stat().st_size == 0:
            raise ConfigError(
                f"checkpoint: {path} is empty (0 bytes: an interrupted copy or save?); use another checkpoint"
            )
        checkpoint = torch_load(path, mmap=not weights)  # without the weights, mapped: only the entries used are read
    else:
        raise ConfigError(f"checkpoint: no file or directory at {path}")
    if not isinstance(checkpoint, dict) or not has_payload(checkpoint) or (weights and "state_dict" not in checkpoint):
        raise ConfigError(f"checkpoint: {path} is not a keel checkpoint (no 'keel' and 'state_dict' entries)")
    return checkpoint


def model_state_dict(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The KeelLM state_dict inside a checkpoint read by read_checkpoint (the LightningModule's `model.` entries)."""
    prefix = "model."
    return {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}


def state_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """KeelLM(cfg).state_dict()'s names and shapes (a tied head named too), without building it."""
    specs, blocks = block_layouts(cfg)
    per_layout = {
        spec: {name: tuple(t.shape) for name, t in block.state_dict().items()} for spec, block in blocks.items()
    }
    shapes = {"embed.weight": (cfg.vocab_size, cfg.width)}
    for index, spec in enumerate(specs):
        shapes.update({f"blocks.{index}.{name}": shape for name, shape in per_layout[spec].items()})
    if needs_final_norm(cfg):
        shapes["final_norm.weight"] = (cfg.width,)
    shapes["head.weight"] = (cfg.vocab_size, cfg.width)
    return shapes


def check_state_fits(cfg: ModelConfig, state: dict[str, torch.Tensor], what: str) -> None:
    """Refuse weights (a KeelLM state_dict) that KeelLM(cfg) cannot hold, before anything of cfg's size is built:
    the depth first (counted from the weights' names, so a config's depth alone costs nothing), then every name
    and shape. what: e.g. "checkpoint: PATH" (a config read from a file is as untrusted as its weights)."""
    depth = len({name.split(".")[1] for name in state if name.startswith("blocks.")})
    if depth != cfg.depth:
        raise ConfigError(
            f"{what}: its config says model.depth={cfg.depth}, its weights hold {depth} blocks; the "
            "config or the weights were edited or mixed up: use the checkpoint they came from"
        )
    expected = state_shapes(cfg)
    shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
    wrong = [
        f"{name} {shapes[name]} (config: {shape})"
        for name, shape in expected.items()
        if name in shapes and shapes[name] != shape
    ]
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if wrong or missing or unexpected:
        found = "; ".join(
            f"{kind} {', '.join(names[:3])}" + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")
            for kind, names in (("shapes", wrong), ("missing", missing), ("unexpected", unexpected))
            if names
        )
        raise ConfigError(
            f"{what}: its weights do not match its model config ({found}): the config or the "
            "weights were edited or mixed up: use the checkpoint they came from"
        )


def checked_config(checkpoint: dict, path: str | Path) -> Config:
    """The Config a checkpoint read by read_checkpoint holds, checked against its weights' shapes and this
    machine's memory before a model of its size is built: the config is as untrusted as the file."""
    cfg = read_payload(checkpoint).run_config()
    check_state_fits(cfg.model, model_state_dict(checkpoint), f"checkpoint: {path}")
    check_model_fits(cfg.model, f"checkpoint: {path}")
    return cfg


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[KeelLM, Config, str | None]:
    """A trained KeelLM in eval mode, its Config and its tokenizer.json text, from a checkpoint file or directory."""
    checkpoint = read_checkpoint(path)
    cfg = checked_config(checkpoint, path)
    model = KeelLM(cfg.model)
    model.load_state_dict(model_state_dict(checkpoint))  # every name and shape checked above
    return model.to(device).eval(), cfg, read_payload(checkpoint).tokenizer_json
