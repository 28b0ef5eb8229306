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


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(holder: dict) -> str | None:
    """Why a lock whose flock is still held (or cannot be had) no longer guards anything, if it does not: its holder's
    process is gone from this host, or it is on another host and is this SLURM job's previous run (SLURM runs one
    instance of a job at a time; a requeued job may start on another node while a lock the dead node held lingers on
    the shared filesystem)."""
    if not holder:
        return None
    if holder.get("host") == socket.gethostname():
        return None if pid_alive(int(holder.get("pid", 0))) else "its process is no longer running"
    job = os.environ.get("SLURM_JOB_ID")
    if job and holder.get("slurm_job") == job:
        return f"it is SLURM job {job}'s previous run (requeued here)"
    return None


class DirLock:
    """fcntl.flock on <directory>/.keel.lock, which the kernel releases when the process ends however it ends (a
    kill -9 leaves a lock nobody holds: stale, taken over). The file names the holder (pid, host, start time, SLURM
    job) for the error a second process gets. A lock still held is taken over when its holder is stale (_stale: a
    dead process on this host, or this SLURM job's previous run on another). Where the filesystem has no flock
    (ENOLCK, EOPNOTSUPP: some NFS and parallel filesystems), that is said, and the file alone decides: a live holder
    on this host, or one on another host that is not this job's previous run, refuses the start. Subclasses say
    which directory it is, for the messages. Left by an exception (a start refused after the lock was taken), it
    removes the lock file and directories it created if nothing else was written there: a refused start leaves
    nothing behind, and never removes what was there before."""

    key: ClassVar[str]  # the config key that names the directory, e.g. "run.dir"
    clash: ClassVar[str]  # what two writers would do to each other, e.g. "Two runs in one directory would ..."
    command: ClassVar[str]  # the keel command that takes the lock, for the line saying a stale one was taken over

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK
        self._fd: int | None = None
        self._flocked = False
        self._created: list[Path] = []  # the directories acquire made, deepest first
        self._entries_before: set[str] | None = None  # the directory's entries before, where acquire made the lock

    def acquire(self) -> None:
        try:
            self._created = [d for d in (self.directory, *self.directory.parents) if not d.exists()]
            self.directory.mkdir(parents=True, exist_ok=True)
            entries = set(os.listdir(self.directory))
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(
                f"{self.key}={self.directory}: cannot write there ({err.strerror or err}): "
                f"choose a directory you can write ({self.key}=PATH)"
            ) from None
        no_flock = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._flocked = True
        except BlockingIOError:
            pass
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            no_flock = os.strerror(err.errno)
            self._say(
                f"the filesystem does not support flock ({no_flock}): the lock file's pid, host and SLURM job "
                "decide instead"
            )
        previous = _holder(self.path)
        reason = "ended without releasing its lock"  # the kernel released it: nobody holds it
        mine = previous.get("pid") == os.getpid() and previous.get("host") == socket.gethostname()
        if not self._flocked and previous and not mine:
            if (stale := _stale(previous)) is None:
                os.close(fd)
                delete = f"; if it is not running any more, delete {self.path}" if no_flock else ""
                raise ConfigError(self._in_use(previous) + delete)
            reason = stale if no_flock else f"still holds its lock, but {stale}"
        elif not self._flocked and no_flock is None:  # held by a process that has not written its name yet
            os.close(fd)
            raise ConfigError(self._in_use(previous))
        if previous:  # released locks are emptied: this one's holder ended without releasing it
            self._say(f"a previous process (pid {previous.get('pid')} on {previous.get('host')}) {reason}; taken over")
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "slurm_job": os.environ.get("SLURM_JOB_ID"),
                }
            ).encode(),
            0,
        )
        os.fsync(fd)
        self._fd = fd
        self._entries_before = None if LOCK in entries else entries

    def _say(self, message: str) -> None:
        print(f"keel {self.command}: {self.key}={self.directory}: {message}", file=sys.stderr, flush=True)

    def _in_use(self, holder: dict) -> str:
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('since', '?')})"
        return (
            f"{self.key}={self.directory} is in use by another keel process: {who}. {self.clash}; wait for it to "
            f"end, stop it, or use another {self.key}"
        )

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # an empty file: released cleanly
        if self._flocked:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._flocked = False
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, kind, *exc) -> None:
        leave_nothing = kind is not None and self._wrote_nothing()
        if leave_nothing:  # while still held: a start meanwhile is refused as in use, not given a lock on no file
            self.path.unlink()
        self.release()
        if leave_nothing:
            for directory in self._created:
                try:
                    directory.rmdir()  # only an empty one: another process may have written there meanwhile
                except OSError:
                    break

    def _wrote_nothing(self) -> bool:
        """Whether the directory holds what it held before acquire, plus the lock file acquire made."""
        return self._entries_before is not None and set(os.listdir(self.directory)) == self._entries_before | {LOCK}
