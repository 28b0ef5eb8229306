"""Where checkpoints lie: their names in a run directory, the files of a sharded one, and the names a save uses
before its checkpoint is in place."""

from __future__ import annotations

from pathlib import Path

from keel.config import Config

LAST = "last.ckpt"
SHARDED_META = "meta.pt"  # Lightning's name for rank 0's part of a distributed checkpoint
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards, written once all are


def checkpoint_dir(cfg: Config) -> Path:
    return Path(cfg.run.dir) / "checkpoints"


def staging_path(path: Path) -> Path:
    """Where a sharded checkpoint is written before keel.checkpoint.write.commit_dir moves it to `path`."""
    return path.with_name(f".{path.name}.partial")


def previous_path(path: Path) -> Path:
    """Where commit_dir keeps the checkpoint it replaces until the new one is in place."""
    return path.with_name(f".{path.name}.previous")
