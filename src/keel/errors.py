"""The error types `keel` reports as one line: bad input (config, data, checkpoint, CLI; exit 2) and storage a run
cannot write to (exit 1); the refusals every command shares."""

from __future__ import annotations

import errno
from pathlib import Path

# The one table of writes that storage refused (checkpoints, `keel data`): errno -> (what happened, what to do)
STORAGE_FAILURES = {
    errno.ENOSPC: ("no space left on the device", "free space"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space"),
    errno.EFBIG: (
        "the file is too large (past a file size limit or the file system's)",
        "raise the file size limit (ulimit -f)",
    ),
    errno.EROFS: ("the file system is read-only", "make it writable"),
    errno.EACCES: ("permission denied", "make it writable"),
    errno.EPERM: ("permission denied", "make it writable"),
}


class ConfigError(ValueError):
    """A value that cannot work; the message names the key (or file) and what is allowed."""


def require(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError("key: message") unless ok."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


def refuse_output(out: Path, command: str, option: str, empty_dir_ok: bool = False) -> None:
    """A command's output (given as `option`) must be new, or with empty_dir_ok an empty directory, under folders
    that are folders: nothing is overwritten, and a file in the way is named rather than raised by mkdir."""
    if out.exists() and not (empty_dir_ok and out.is_dir() and not any(out.iterdir())):
        what = " and is not an empty directory" if empty_dir_ok else ""
        raise ConfigError(f"{command}: {out} already exists{what}; choose a new {option} (nothing is overwritten)")
    blocking = next((parent for parent in out.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise ConfigError(
            f"{command}: cannot write {out}: {blocking} is a file, not a directory; choose another {option}"
        )


def describe_error(err: BaseException) -> str:
    """An exception as a reason a user can read: some (EOFError of an empty file) have no message."""
    return str(err) or type(err).__name__


class StorageError(OSError):
    """A file a run must write cannot be (no space, read-only, no permission): the message names the path, the
    reason and what was kept."""
