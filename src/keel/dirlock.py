"""One writer per directory (a run dir, a data.dir): an exclusive lock that names its holder. Imports nothing heavy:
`keel data` takes one before a build without paying for Lightning."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import ClassVar

from keel.errors import ConfigError

LOCK = ".keel.lock"


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


class DirLock:
    """fcntl.flock on <directory>/.keel.lock, which the kernel releases when the process ends however it ends (a
    kill -9 leaves a lock nobody holds: stale, taken over). The file names the holder (pid, host, start time) for the
    error a second process gets. Where the filesystem has no flock, the file's pid is checked instead (on this host:
    alive or not; on another host: trusted). Subclasses say which directory it is, for the messages."""

    key: ClassVar[str]  # the config key that names the directory, e.g. "run.dir"
    clash: ClassVar[str]  # what two writers would do to each other, e.g. "Two runs in one directory would ..."
    command: ClassVar[str]  # the keel command that takes the lock, for the line saying a stale one was taken over

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(f"{self.key}={self.directory}: cannot write there ({err.strerror or err}): "
                              f"choose a directory you can write ({self.key}=PATH)") from None
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
            print(f"keel {self.command}: {self.key}={self.directory}: a previous process (pid {previous.get('pid')} "
                  f"on {previous.get('host')}) ended without releasing its lock; taken over", file=sys.stderr,
                  flush=True)
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
        return (f"{self.key}={self.directory} is in use by another keel process: {who}. {self.clash}; wait for it to "
                f"end, stop it, or use another {self.key}")

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # an empty file: released cleanly
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
