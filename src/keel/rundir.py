"""The run directory's housekeeping, done by the one process that writes it (global rank 0) before anything is
written: an exclusive lock, a writability check, leftovers of interrupted saves removed, and a record of what a
resume changed."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from keel.artifacts import CONFIG
from keel.checkpoint import remove_path
from keel.config import Config, from_dict, to_dict, to_yaml
from keel.errors import ConfigError

LOCK = ".keel.lock"
IGNORED_ON_RESUME = ("resume", "run.dir")  # where a run is and how it was started: not its recipe


def say(message: str) -> None:
    print(f"keel pretrain: {message}", file=sys.stderr, flush=True)


def _holder(lock_file: Path) -> dict:
    try:
        return json.loads(lock_file.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDirLock:
    """One writer per run directory: fcntl.flock on <run.dir>/.keel.lock, which the kernel releases when the
    process ends however it ends (a kill -9 leaves a lock nobody holds: stale, taken over). The file names the
    holder (pid, host, start time) for the error a second process gets. Where the filesystem has no flock, the
    file's pid is checked instead (on this host: alive or not; on another host: trusted)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(f"run.dir={self.run_dir}: cannot write there ({err.strerror or err}): "
                              "choose a directory you can write (run.dir=PATH)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(self._in_use(_holder(self.path))) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            self._check_pid(fd)
        previous = _holder(self.path)
        if previous:  # released locks are emptied: this one's holder ended without releasing it
            say(f"run.dir={self.run_dir}: a previous run (pid {previous.get('pid')} on {previous.get('host')}) "
                "ended without releasing its lock; taken over")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def _check_pid(self, fd: int) -> None:
        holder = _holder(self.path)
        same_host = holder.get("host") == socket.gethostname()
        if holder and (not same_host or (holder.get("pid") != os.getpid() and _pid_alive(int(holder["pid"])))):
            os.close(fd)
            raise ConfigError(self._in_use(holder))

    def _in_use(self, holder: dict) -> str:
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('since', '?')})"
        return (f"run.dir={self.run_dir} is in use by another keel process: {who}. Two runs in one directory "
                "would mix their logs and checkpoints; wait for it to end, stop it, or use another run.dir")

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # an empty file: released cleanly
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def remove_orphans(checkpoint_dir: Path) -> None:
    """Temporary files and staging directories of saves a kill interrupted (AtomicCheckpointIO's
    .NAME.tmpPID, the FSDP strategy's .NAME.partial); the lock says no save is running. A .NAME.previous is no
    orphan: resolve_resume falls back to it."""
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
