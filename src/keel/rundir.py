"""The run directory's housekeeping, done by the one process that writes it (global rank 0) before anything is
written: an exclusive lock, a writability check, leftovers of interrupted saves removed, and a record of what a
resume changed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from keel.artifacts import CONFIG
from keel.checkpoint_io import remove_path
from keel.config import Config, from_dict, to_dict, to_yaml
from keel.dirlock import DirLock

IGNORED_ON_RESUME = ("resume", "run.dir")  # where a run is and how it was started: not its recipe


def say(message: str) -> None:
    print(f"keel pretrain: {message}", file=sys.stderr, flush=True)


class RunDirLock(DirLock):
    """One writer per run directory: rank 0 holds it for the whole run (keel.dirlock.DirLock)."""

    key = "run.dir"
    clash = "Two runs in one directory would mix their logs and checkpoints"
    command = "pretrain"


def remove_orphans(checkpoint_dir: Path) -> None:
    """Temporary files and staging directories of saves a kill interrupted (AtomicCheckpointIO's
    .NAME.tmpPID, the FSDP strategy's .NAME.partial); the lock says no save is running. A .NAME.previous is no
    orphan: keel.resume.resolve_resume falls back to it."""
    orphans = sorted([*checkpoint_dir.glob(".*.tmp[0-9]*"), *checkpoint_dir.glob(".*.partial")])
    for orphan in orphans:
        remove_path(orphan)
    if orphans:
        say(f"removed {len(orphans)} temporary file(s) of interrupted checkpoint saves: "
            + ", ".join(orphan.name for orphan in orphans))


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_keys(saved: dict, cfg: Config) -> list[str]:
    """`key: old -> new` for every setting of cfg that differs from the checkpoint's saved config."""
    old, new = _flat(saved), _flat(to_dict(cfg))
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(old.keys() | new.keys())
            if key not in IGNORED_ON_RESUME and old.get(key) != new.get(key)]


def write_config(cfg: Config, checkpoint: dict | None) -> None:
    """<run.dir>/config.yaml; on a resume with other settings (the model's are refused earlier) say which, and
    keep the config they replace as config.<step>.yaml."""
    run_dir = Path(cfg.run.dir)
    if checkpoint is not None and (changes := changed_keys(checkpoint["keel"]["config"], cfg)):
        step = checkpoint.get("global_step", 0)
        kept = run_dir / f"config.{step}.yaml"
        current = run_dir / CONFIG
        if current.is_file():
            os.replace(current, kept)
        else:  # a checkpoint from elsewhere: its own config
            kept.write_text(to_yaml(from_dict(checkpoint["keel"]["config"])))
        say(f"resuming at step {step} with {len(changes)} changed setting(s) (the previous config is kept as "
            f"{kept}):\n  " + "\n  ".join(changes))
    (run_dir / CONFIG).write_text(to_yaml(cfg))
