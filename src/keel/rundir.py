"""The run directory's housekeeping, done by the one process that writes it (global rank 0) before anything is
written: an exclusive lock, a writability check, one run per directory (a fresh start into a directory that holds
another run is refused, or clears it under run.overwrite=true), leftovers of interrupted saves removed, and a record
of what a resume changed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from keel.artifacts import CONFIG, TENSORBOARD
from keel.checkpoint.layout import checkpoint_dir
from keel.checkpoint.payload import read_payload
from keel.checkpoint.resume import resolve_resume
from keel.checkpoint.write import remove_path
from keel.config import Config, from_dict, to_dict, to_yaml
from keel.dirlock import LOCK, DirLock
from keel.errors import ConfigError

IGNORED_ON_RESUME = ("resume", "run.dir", "run.overwrite")  # where a run is and how it was started: not its recipe


def say(message: str) -> None:
    print(f"keel pretrain: {message}", file=sys.stderr, flush=True)


class RunDirLock(DirLock):
    """One writer per run directory: rank 0 holds it for the whole run (keel.dirlock.DirLock). A start refused
    before training began (a logger that cannot start, a bad checkpoint) removes what it wrote in a directory no
    keel process had used (config.yaml, logs): it leaves nothing; once training has begun (`started`), a failure
    keeps everything."""

    key = "run.dir"
    clash = "Two runs in one directory would mix their logs and checkpoints"
    command = "pretrain"
    started = False

    def __exit__(self, kind, *exc) -> None:
        if kind is not None and not self.started and self._entries_before is not None:
            for name in sorted(set(os.listdir(self.directory)) - self._entries_before - {LOCK}):
                remove_path(self.directory / name)
        super().__exit__(kind, *exc)


def earlier_run(cfg: Config) -> list[str]:
    """What in run.dir shows that a run has written there: its config, checkpoints or TensorBoard events."""
    run_dir = Path(cfg.run.dir)
    marks = [run_dir / CONFIG, checkpoint_dir(cfg), run_dir / TENSORBOARD]
    return [
        f"{mark.name}/" if mark.is_dir() else mark.name
        for mark in marks
        if mark.is_file() or (mark.is_dir() and any(mark.iterdir()))
    ]


def clear_run_dir(run_dir: Path) -> None:
    """Delete everything in run_dir but the lock this process holds."""
    for entry in sorted(run_dir.iterdir()):
        if entry.name != LOCK:
            remove_path(entry)


def same_run(cfg: Config) -> bool:
    """Whether run.dir's config.yaml is cfg's (keys that say where a run is and how it was started aside)."""
    saved = Path(cfg.run.dir) / CONFIG
    try:
        return saved.is_file() and not changed_keys(yaml.safe_load(saved.read_text()), cfg)
    except (ValueError, ConfigError):  # unreadable, or of a config keel no longer reads: another run
        return False


def claim_run_dir(cfg: Config) -> None:
    """One run per directory: a fresh start (resume=null, or resume=auto with no checkpoint to continue) into a
    run.dir an earlier run wrote is refused with the choices, or under run.overwrite=true clears it first (all of it
    but the lock this process holds), so that no two runs' checkpoints and logs ever mix (TensorBoard would draw them
    as one). A resume continues the run it finds; under run.overwrite there is none to find."""
    run_dir = Path(cfg.run.dir)
    if not (found := earlier_run(cfg)):
        return
    if cfg.run.overwrite:
        if cfg.resume not in (None, "", "none", "auto"):
            raise ConfigError(
                f"run.overwrite=true deletes the earlier run in {run_dir} and starts afresh: it takes "
                f"resume=auto or resume=null, not resume={cfg.resume} (a checkpoint to continue)"
            )
        clear_run_dir(run_dir)
        say(f"run.overwrite=true: deleted the earlier run in {run_dir} ({', '.join(found)}); starting afresh")
        return
    if resolve_resume(cfg) is not None:
        return
    if cfg.resume == "auto" and same_run(cfg):  # its earlier start ended before its first checkpoint
        clear_run_dir(run_dir)
        say(
            f"run.dir={run_dir}: the earlier start of this run (the same config) left no checkpoint: its logs "
            f"({', '.join(found)}) are deleted and it starts again"
        )
        return
    raise ConfigError(
        f"run.dir={run_dir} holds an earlier run ({', '.join(found)}"
        + ("" if cfg.resume in (None, "", "none") else ", and no checkpoint to continue")
        + "): a fresh start there would mix two runs' checkpoints and logs. Continue it with resume=auto (where it "
        "has a checkpoint), start in another run.dir=PATH, or delete it and start afresh with run.overwrite=true"
    )


def remove_orphans(checkpoint_dir: Path) -> None:
    """Temporary files and staging directories of saves a kill interrupted (AtomicCheckpointIO's
    .NAME.tmpPID, the FSDP strategy's .NAME.partial); the lock says no save is running. A .NAME.previous is no
    orphan: keel.checkpoint.resume.resolve_resume falls back to it."""
    orphans = sorted([*checkpoint_dir.glob(".*.tmp[0-9]*"), *checkpoint_dir.glob(".*.partial")])
    for orphan in orphans:
        remove_path(orphan)
    if orphans:
        say(
            f"removed {len(orphans)} temporary file(s) of interrupted checkpoint saves: "
            + ", ".join(orphan.name for orphan in orphans)
        )


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_keys(saved: dict, cfg: Config) -> list[str]:
    """`key: old -> new` for every setting of cfg that differs from the checkpoint's saved config, read in today's
    spelling (keel.config.from_dict): a key that moved, or one added since with its default, is no change."""
    old, new = _flat(to_dict(from_dict(saved))), _flat(to_dict(cfg))
    return [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(old.keys() | new.keys())
        if key not in IGNORED_ON_RESUME and old.get(key) != new.get(key)
    ]


def write_config(cfg: Config, checkpoint: dict | None) -> None:
    """<run.dir>/config.yaml; on a resume with other settings (the model's are refused earlier) say which, and
    keep the config they replace as config.<step>.yaml."""
    run_dir = Path(cfg.run.dir)
    saved = read_payload(checkpoint).config if checkpoint is not None else None
    if saved is not None and (changes := changed_keys(saved, cfg)):
        step = checkpoint.get("global_step", 0)
        kept = run_dir / f"config.{step}.yaml"
        current = run_dir / CONFIG
        if current.is_file():
            os.replace(current, kept)
        else:  # a checkpoint from elsewhere: its own config
            kept.write_text(to_yaml(from_dict(saved)))
        say(
            f"resuming at step {step} with {len(changes)} changed setting(s) (the previous config is kept as "
            f"{kept}):\n  " + "\n  ".join(changes)
        )
    (run_dir / CONFIG).write_text(to_yaml(cfg))
