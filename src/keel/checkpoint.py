"""Checkpoints: atomic writes, reading single-file and sharded (FSDP) checkpoints, and
`keel consolidate SHARDED_DIR OUT.ckpt`, which turns a sharded one into a single file.

A single-file checkpoint is Lightning's dict: `state_dict` (keys `model.<param>`), `optimizer_states`, loop
and callback state, and `keel` = {config, tokenizer_json}. A sharded checkpoint is a directory written by
torch.distributed.checkpoint: one `__<rank>_0.distcp` file per rank holding its shards of the weights and
optimizer state, `.metadata` (the global shapes and where each shard lies) and Lightning's `meta.pt`
(everything else, from rank 0: loops, callbacks, data-loader position, `keel`).
"""

from __future__ import annotations

import argparse
import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from keel.checkpoint_io import SHARDED_META, AtomicCheckpointIO
from keel.config import Config, from_dict
from keel.errors import ConfigError
from keel.export_format import read_export
from keel.memory import check_model_fits
from keel.model import KeelLM, check_state_fits

LAST = "last.ckpt"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards, written once all are
TORCH_ZIP_MAGIC = b"PK\x03\x04"  # how every torch.save file starts (a zip archive) since torch 1.6


# Everything a torch.distributed.checkpoint `.metadata` pickle refers to; anything else (os.system, builtins.eval,
# ...) is how a hostile file runs code when unpickled, so it is refused before torch reads the file.
DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata",
                                              "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # and the dtypes, checked by type below
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in DCP_METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a checkpoint index never holds")


def read_dcp_metadata(path: Path) -> Metadata:
    """A sharded checkpoint's `.metadata` (torch.distributed.checkpoint's Metadata), unpickled with only the
    classes such a file holds: a payload (a pickle that calls anything else) is refused and never runs."""
    file = Path(path) / DCP_METADATA
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except Exception as err:
        raise ConfigError(f"checkpoint: {file} refused: {describe_error(err)}; it may have been made to run code "
                          "when loaded: do not use this checkpoint (if it comes from a run you trust, made with "
                          "another torch version, report the name above)") from None
    if not isinstance(metadata, Metadata):
        raise ConfigError(f"checkpoint: {file} refused: it holds a {type(metadata).__name__}, not a checkpoint index")
    _refuse_shards_outside(Path(path), metadata)
    return metadata


def _refuse_shards_outside(path: Path, metadata: Metadata) -> None:
    """Every shard file `.metadata` names must be a file in the checkpoint directory itself, as torch writes them:
    torch joins each entry's relative_path to the directory as it is, so `../other.ckpt/__0_0.distcp`, an absolute
    path or a shard file that is a symlink leading out would have it read another run's weights (or any file)
    silently. Checked here, where every reader passes before it reads a byte of a shard."""
    file, root = path / DCP_METADATA, path.resolve()
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise ConfigError(f"checkpoint: {file} refused: its storage_data is a {type(storage).__name__}, not the "
                          "index of its shard files")
    outside = []
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        try:
            target = (root / name).resolve()
        except (TypeError, ValueError, OSError, RuntimeError) as err:  # not a path, a NUL in it, a symlink loop
            where = f"which is no file name ({describe_error(err)})"
        else:
            if target.parent == root:  # `sub/../__0_0.distcp`, or a link to a file beside it, stays inside
                continue
            where = f"which leads to {target}"
        outside.append(f"its entry {getattr(index, 'fqn', index)} is read from {name!r}, {where}")
    if outside:
        others = f" (and {len(outside) - 1} other entries)" if len(outside) > 1 else ""
        raise ConfigError(f"checkpoint: {file} refused: it must name shard files in {path} itself, but {outside[0]}"
                          f"{others}; do not use this checkpoint (where a shard file is a link to one elsewhere, "
                          "copy that file in its place)")


class SafeFileSystemReader(FileSystemReader):
    """torch.distributed.checkpoint's FileSystemReader, its `.metadata` read through read_dcp_metadata."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata


class _WeightsOnlyBytesPlanner(DefaultLoadPlanner):
    """Unpickles a checkpoint's byte entries (its non-tensor state: the optimizer's param_groups, ...) with torch's
    weights-only unpickler, where DefaultLoadPlanner uses weights_only=False. What it refuses is listed in
    `refused`, not raised: torch.distributed.checkpoint would wrap the exception in its own."""

    def __init__(self, path: Path) -> None:
        super().__init__(flatten_state_dict=False)
        self.path = path
        self.refused: list[str] = []

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception:
            file = self.path / self.metadata.storage_data[read_item.storage_index].relative_path
            self.refused.append(f"{file} refused: its entry {read_item.dest_index.fqn} {_why_not_weights_only(value)}")


def _why_not_weights_only(value: io.BytesIO) -> str:
    value.seek(0)
    try:  # torch's own error is a page of advice; this names the globals it refuses
        unsafe = unsafe_globals(value)
    except Exception as err:
        return f"is not a torch.save object ({describe_error(err)})"
    if not unsafe:
        return "cannot be read by torch.load(weights_only=True)"
    return f"refers to {', '.join(unsafe)}, which torch.load(weights_only=True) does not allow"


def unsafe_globals(file) -> list[str]:
    """The globals a torch.save file (path or file object) refers to that torch's weights-only unpickler refuses."""
    return torch.serialization.get_unsafe_globals_in_checkpoint(file)


def torch_load(path: Path, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) of one checkpoint file, its failure one line: a file that refers to code
    (a payload) is refused naming it, never with torch's advice to retry with weights_only=False. A file that is
    no torch.save zip (a bare pickle, torch's pre-1.6 format) is refused before torch reads it: its weights-only
    unpickler answers one with that advice."""
    with open(path, "rb") as file:
        zipped = file.read(len(TORCH_ZIP_MAGIC)) == TORCH_ZIP_MAGIC
    if not zipped:
        raise ConfigError(f"checkpoint: {path} is not a torch.save zip file (a bare pickle, an old torch format, "
                          "or corrupt); use a checkpoint a keel run wrote")
    try:
        with warnings.catch_warnings():  # torch's request to report a pickle protocol it may not read: see below
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:
        try:
            unsafe = unsafe_globals(path)
        except Exception:  # not even a zip of pickles: damaged
            unsafe = []
        if unsafe:
            raise ConfigError(f"checkpoint: {path} refused: it refers to {', '.join(unsafe)}, which a checkpoint "
                              "never holds; it may have been made to run code when loaded: do not use this "
                              "checkpoint") from None
        raise ConfigError(f"checkpoint: {path} cannot be read (corrupt or truncated?): {_load_reason(err)}") from None


def _load_reason(err: Exception) -> str:
    """torch.load's reason in one line. A weights-only refusal opens with the advice to retry with
    weights_only=False: only the unpickler's own error, after "WeightsUnpickler error:", is kept."""
    text = describe_error(err)
    if not text.startswith("Weights only load failed"):
        return text.splitlines()[0]
    detail = [line.strip() for line in text.partition("WeightsUnpickler error:")[2].splitlines() if line.strip()]
    return "torch.load(weights_only=True) refused it" + (f" ({detail[0]})" if detail else "")


def refuse_payloads(path: Path) -> None:
    """Refuse a sharded checkpoint that would run code when torch.distributed.checkpoint loads it: its `.metadata`
    (read_dcp_metadata) and each of its byte entries, which torch would unpickle with weights_only=False, must pass
    torch's weights-only allow-list. Every reader of a sharded checkpoint calls this first."""
    reader = SafeFileSystemReader(path)
    entries = {fqn: None for fqn, entry in reader.read_metadata().state_dict_metadata.items()
               if isinstance(entry, BytesStorageMetadata)}
    planner = _WeightsOnlyBytesPlanner(Path(path))
    _load_in_this_process(entries, reader, planner)
    if planner.refused:
        others = f" (and {len(planner.refused) - 1} other entries)" if len(planner.refused) > 1 else ""
        raise ConfigError(f"checkpoint: {planner.refused[0]}{others}; it may have been made to run code when loaded: "
                          "do not use this checkpoint")


def _load_in_this_process(state_dict: dict, reader, planner=None) -> None:
    from torch.distributed.checkpoint import load

    with warnings.catch_warnings():  # reading in one process is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(state_dict, storage_reader=reader, planner=planner, no_dist=True)


def describe_error(err: BaseException) -> str:
    """An exception as a reason a user can read: some (EOFError of an empty file) have no message."""
    return str(err) or type(err).__name__


def checkpoint_dir(cfg: Config) -> Path:
    return Path(cfg.run.dir) / "checkpoints"


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
    _load_in_this_process({"state_dict": weights}, reader)
    return weights


def _read_sharded(path: Path, weights: bool) -> dict:
    missing = [name for name in (DCP_METADATA, SHARDED_META) if not (path / name).is_file()]
    if len(missing) == 2:  # nothing of a sharded checkpoint: a run dir, its checkpoints/ or another directory
        meant = next((last for last in (path / "checkpoints" / LAST, path / LAST) if last.exists()), None)
        raise ConfigError(f"checkpoint: {path} is not a checkpoint: it has no {DCP_METADATA} nor {SHARDED_META}"
                          + (f"; did you mean {meant}?" if meant else " (a checkpoint is a .ckpt file or an FSDP "
                             "checkpoint directory holding both)"))
    if missing:
        raise ConfigError(f"checkpoint: {path} is an incomplete sharded checkpoint (no {', '.join(missing)}): "
                          "its save was interrupted; resume from another checkpoint")
    try:
        reader = SafeFileSystemReader(path)
        for info in reader.read_metadata().storage_data.values():  # every shard file there, none truncated
            shard = path / info.relative_path
            if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
                raise ConfigError(f"checkpoint: {path} is corrupt: shard file {info.relative_path} is missing or truncated")
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
            raise ConfigError(f"checkpoint: {path} is empty (0 bytes: an interrupted copy or save?); use another "
                              "checkpoint")
        checkpoint = torch_load(path, mmap=not weights)  # without the weights, mapped: only the entries used are read
    else:
        raise ConfigError(f"checkpoint: no file or directory at {path}")
    if not isinstance(checkpoint, dict) or "keel" not in checkpoint or (weights and "state_dict" not in checkpoint):
        raise ConfigError(f"checkpoint: {path} is not a keel checkpoint (no 'keel' and 'state_dict' entries)")
    return checkpoint


def model_state_dict(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The KeelLM state_dict inside a checkpoint read by read_checkpoint (the LightningModule's `model.` entries)."""
    prefix = "model."
    return {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}


def checked_config(checkpoint: dict, path: str | Path) -> Config:
    """The Config a checkpoint read by read_checkpoint holds, checked against its weights' shapes and this
    machine's memory before a model of its size is built: the config is as untrusted as the file."""
    cfg = from_dict(checkpoint["keel"]["config"])
    check_state_fits(cfg.model, model_state_dict(checkpoint), f"checkpoint: {path}")
    check_model_fits(cfg.model, f"checkpoint: {path}")
    return cfg


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[KeelLM, Config, str | None]:
    """A trained KeelLM in eval mode, its Config and its tokenizer.json text, from a checkpoint file or directory."""
    checkpoint = read_checkpoint(path)
    cfg = checked_config(checkpoint, path)
    model = KeelLM(cfg.model)
    model.load_state_dict(model_state_dict(checkpoint))  # every name and shape checked above
    return model.to(device).eval(), cfg, checkpoint["keel"]["tokenizer_json"]


def refuse_output(out: Path, command: str, option: str, empty_dir_ok: bool = False) -> None:
    """A command's output (given as `option`) must be new, or with empty_dir_ok an empty directory, under folders
    that are folders: nothing is overwritten, and a file in the way is named rather than raised by mkdir."""
    if out.exists() and not (empty_dir_ok and out.is_dir() and not any(out.iterdir())):
        what = " and is not an empty directory" if empty_dir_ok else ""
        raise ConfigError(f"{command}: {out} already exists{what}; choose a new {option} (nothing is overwritten)")
    blocking = next((parent for parent in out.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"{command}: cannot write {out}: {blocking} is a file, not a directory; choose another "
                          f"{option}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="keel consolidate",
        description="Assemble a sharded (FSDP) checkpoint directory into one file that `keel eval` and "
        "keel.checkpoint.load_model read: the full model weights, the run's config, tokenizer and training "
        "progress, without the optimizer state (resume from the sharded directory itself).",
    )
    parser.add_argument("sharded_dir", help="e.g. runs/NAME/checkpoints/last.ckpt (a directory under trainer=fsdp)")
    parser.add_argument("output", help="the single-file checkpoint to write, e.g. NAME.ckpt")
    args = parser.parse_args(argv)
    if not Path(args.sharded_dir).is_dir():
        raise ConfigError(f"consolidate: {args.sharded_dir} is not a sharded checkpoint directory "
                          "(a single-file checkpoint is already what load_model reads)")
    refuse_output(Path(args.output), "consolidate", "output path")
    checkpoint = read_checkpoint(args.sharded_dir)
    AtomicCheckpointIO().save_checkpoint(checkpoint, args.output)
    params = sum(tensor.numel() for tensor in checkpoint["state_dict"].values())
    print(f"keel consolidate: wrote {args.output}: {params:,} parameters, step {checkpoint.get('global_step')}")
    return 0
