"""The error types `keel` reports as one line: bad input (config, data, checkpoint, CLI; exit 2) and storage a run
cannot write to (exit 1)."""

from __future__ import annotations

import errno

# The one table of writes that storage refused (checkpoints, `keel data`): errno -> (what happened, what to do)
STORAGE_FAILURES = {
    errno.ENOSPC: ("no space left on the device", "free space"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space"),
    errno.EFBIG: ("the file is too large (past a file size limit or the file system's)",
                  "raise the file size limit (ulimit -f)"),
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


class StorageError(OSError):
    """A file a run must write cannot be (no space, read-only, no permission): the message names the path, the
    reason and what was kept."""
