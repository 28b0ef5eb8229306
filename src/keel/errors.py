"""The error types `keel` reports as one line: bad input (config, data, checkpoint, CLI; exit 2) and storage a run
cannot write to (exit 1)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A value that cannot work; the message names the key (or file) and what is allowed."""


def require(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError("key: message") unless ok."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


class StorageError(OSError):
    """A file a run must write cannot be (no space, read-only, no permission): the message names the path, the
    reason and what was kept."""
