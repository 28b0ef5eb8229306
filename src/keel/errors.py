"""The one error type for bad input (config, data, checkpoint, CLI): `keel` prints its message and exits 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A value that cannot work; the message names the key (or file) and what is allowed."""


def require(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError("key: message") unless ok."""
    if not ok:
        raise ConfigError(f"{key}: {message}")
