"""Where a task's documents come from: a local copy written by `keel eval-data fetch DIR` (DIR/<task>/<task>.yaml,
keel.evaluation.offline) or lm-eval's registered task reading the Hugging Face hub or cache."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from keel.errors import ConfigError


def task_yaml(data_dir: str | os.PathLike, task: str) -> Path:
    return Path(data_dir) / task / f"{task}.yaml"


def resolve_tasks(tasks: Sequence[str], data_dir: str | None) -> list[str]:
    """Each task name, or the path of its local copy's YAML where data_dir holds one (lm-eval loads both)."""
    return [
        str(task_yaml(data_dir, name)) if data_dir and task_yaml(data_dir, name).is_file() else name for name in tasks
    ]


def unknown_tasks(tasks: Sequence[str], include_path: str | Sequence[str] | None) -> list[str]:
    """The task names no YAML file in lm-eval's task directory or include_path mentions: lm-eval indexes every task
    (minutes on a busy machine) before it says a name is unknown; a whole-word search of the files' text takes
    seconds. A name found this way may still be unknown (lm-eval then says so); one not found cannot be a task.
    Paths (a local copy's YAML) and wildcard patterns are left to lm-eval."""
    import lm_eval

    names = [name for name in tasks if not Path(name).is_file() and not set("*?[").intersection(name)]
    if not names:
        return []
    extra = include_path if isinstance(include_path, (list, tuple)) else [include_path] if include_path else []
    roots = [Path(lm_eval.__file__).parent / "tasks", *map(Path, extra)]
    text = "\n".join(path.read_text(errors="replace") for root in roots for path in root.rglob("*.yaml"))
    return [name for name in names if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)]


@contextlib.contextmanager
def hub_or_local(data_dir_key: str, data_dir: str | None) -> Iterator[None]:
    """A dataset neither in data_dir nor reachable on the hub becomes a ConfigError that names both ways out."""
    try:
        yield
    except ConnectionError as err:  # what `datasets` raises when the hub cannot be reached (offline mode too)
        where = f"{data_dir_key}={data_dir} has no copy of it" if data_dir else f"{data_dir_key} is not set"
        raise ConfigError(
            f"{err}. A task's documents come either from a local directory or from the Hugging Face hub, and "
            f"neither is available: {where}, and the hub cannot be reached. Provide one of the two: "
            f"{data_dir_key}=DIR (a directory written by `keel eval-data fetch DIR`, which holds DIR/<task>/), "
            "or access to the hub (or a Hugging Face cache that already holds the dataset, with "
            "HF_DATASETS_OFFLINE=1)"
        ) from err
