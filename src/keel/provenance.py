"""What made a record: the code's commit (and whether its code differed from that commit), Keel's and torch's
versions, the intra-op thread count and the CPU. An experiment's run records carry it (keel.experiments.timing), so
that a report can say which code its figures come from and a result that moved can be traced to the change that
moved it. Torch-free: the thread count is the caller's."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

# the paths whose changes change what a run computes; an edit to the docs does not make a record "dirty"
CODE_PATHS = ("src", "callbacks", "conf", "pyproject.toml")


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform says."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def made_by(threads: int, source: Path = Path(__file__)) -> dict:
    """This process's code and machine. commit and dirty are None where Keel does not run from a git checkout (an
    installed wheel: its version says what it is); dirty is whether CODE_PATHS differ from the commit."""
    root = _git(source.parent, "rev-parse", "--show-toplevel")
    commit = dirty = None
    if root is not None:
        commit = _git(Path(root), "rev-parse", "HEAD")
        changes = _git(Path(root), "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
        dirty = None if changes is None else bool(changes)
    return {
        "commit": commit,
        "dirty": dirty,
        "keel": _version("keel"),
        "torch": _version("torch"),
        "threads": threads,
        "cpu": cpu_model(),
    }


def short_commit(record: dict) -> str:
    """The commit that made a record, shortened; Keel's version where it ran from an installed wheel."""
    return (record.get("commit") or f"keel {record.get('keel')}")[:10]


def describe(record: dict | None) -> str:
    """One record's provenance in a few words: the short commit (+ "dirty"), torch and the thread count."""
    if not record:
        return "unrecorded"
    dirty = " dirty" if record.get("dirty") else ""
    return f"{short_commit(record)}{dirty}, torch {record.get('torch')}, {record.get('threads')} thread(s)"
