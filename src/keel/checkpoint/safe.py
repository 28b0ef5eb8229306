"""Reading checkpoint files without running code they carry: a torch.save file through
torch.load(weights_only=True), its failure one line (torch_load); a sharded checkpoint's `.metadata` through an
unpickler of the index classes alone, every shard file it names inside the directory, and every byte entry through
torch's weights-only unpickler (refuse_payloads). Every reader of a checkpoint passes here first."""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from keel.checkpoint.layout import DCP_METADATA
from keel.errors import ConfigError, describe_error

TORCH_ZIP_MAGIC = b"PK\x03\x04"  # how every torch.save file starts (a zip archive) since torch 1.6


# Everything a torch.distributed.checkpoint `.metadata` pickle refers to; anything else (os.system, builtins.eval,
# ...) is how a hostile file runs code when unpickled, so it is refused before torch reads the file.
DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
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
        raise ConfigError(
            f"checkpoint: {file} refused: {describe_error(err)}; it may have been made to run code "
            "when loaded: do not use this checkpoint (if it comes from a run you trust, made with "
            "another torch version, report the name above)"
        ) from None
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
        raise ConfigError(
            f"checkpoint: {file} refused: its storage_data is a {type(storage).__name__}, not the "
            "index of its shard files"
        )
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
        raise ConfigError(
            f"checkpoint: {file} refused: it must name shard files in {path} itself, but {outside[0]}"
            f"{others}; do not use this checkpoint (where a shard file is a link to one elsewhere, "
            "copy that file in its place)"
        )


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
        raise ConfigError(
            f"checkpoint: {path} is not a torch.save zip file (a bare pickle, an old torch format, "
            "or corrupt); use a checkpoint a keel run wrote"
        )
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
            raise ConfigError(
                f"checkpoint: {path} refused: it refers to {', '.join(unsafe)}, which a checkpoint "
                "never holds; it may have been made to run code when loaded: do not use this "
                "checkpoint"
            ) from None
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
    entries = {
        fqn: None
        for fqn, entry in reader.read_metadata().state_dict_metadata.items()
        if isinstance(entry, BytesStorageMetadata)
    }
    planner = _WeightsOnlyBytesPlanner(Path(path))
    load_in_this_process(entries, reader, planner)
    if planner.refused:
        others = f" (and {len(planner.refused) - 1} other entries)" if len(planner.refused) > 1 else ""
        raise ConfigError(
            f"checkpoint: {planner.refused[0]}{others}; it may have been made to run code when loaded: "
            "do not use this checkpoint"
        )


def load_in_this_process(state_dict: dict, reader, planner=None) -> None:
    from torch.distributed.checkpoint import load

    with warnings.catch_warnings():  # reading in one process is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
