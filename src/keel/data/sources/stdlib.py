"""data.source=stdlib: the .py files of the running Python's standard library (offline, always there)."""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from keel.config import DataConfig
from keel.data.sources.base import SkippedFiles, Source

# Test suites are most of the standard library's .py bytes: repetitive test code and deliberately malformed
# fixtures that would triple the preparation time for little signal; the rest is still several times what the
# default run trains on (docs/data.md, "Why the stdlib test suites are excluded").
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


class Stdlib(Source):
    name = "stdlib"
    settings = ("encoding",)

    def documents(self, data: DataConfig, skipped: SkippedFiles) -> Iterator[tuple[str, str]]:
        root = sysconfig.get_paths()["stdlib"]
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = sorted(name for name in subfolders if name not in STDLIB_EXCLUDED_DIRS)  # prune, in order
            for name in sorted(files):
                if name.endswith(".py") and (text := skipped.read_text(Path(folder, name))) is not None:
                    yield Path(folder, name).relative_to(root).as_posix(), text

    def describe(self, data: DataConfig) -> str:
        return (
            f"Python {sys.version.split()[0]} standard library .py files under {sysconfig.get_paths()['stdlib']}, "
            f"except in directories named {', '.join(sorted(STDLIB_EXCLUDED_DIRS))}"
        )
