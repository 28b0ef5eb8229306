"""The bundled tasks, one TaskManager per process, and running tasks on a model for plain metric values."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lm_eval.api.model
import lm_eval.api.task
import lm_eval.utils
import torch
from lm_eval.api.model import LM
from lm_eval.api.task import Task
from lm_eval.defaults import DEFAULT_OTHER_SEED
from lm_eval.evaluator import evaluate
from lm_eval.tasks import TaskManager
from tqdm import tqdm

import keel.evaluation.lm
from keel.console import DropMessages
from keel.data.shards import data_path
from keel.evaluation.local_tasks import hub_or_local, resolve_tasks

TASKS_DIR = Path(__file__).parent / "tasks"  # generated/ and standard/ task YAMLs
STDERR = "_stderr"


# lm-eval warns, for every task with a custom_dataset, that such loaders may want --metadata; ours already read
# theirs (data_dir, corpus_dir, checkpoint), so the hint is noise.
logging.getLogger("lm_eval.api.task").addFilter(DropMessages("Custom kwargs can be passed to `--metadata`"))

# lm-eval renders prompt templates through jinja2's Environment.from_string, which compiles the template anew
# for every document and field (more time than a small model's forward pass: docs/evaluation.md). A template is
# a pure function of its source: compile each source once per process.
lm_eval.utils.env.from_string = functools.lru_cache(maxsize=1024)(lm_eval.utils.env.from_string)


@functools.cache
def _task_manager(include_path: tuple[str, ...], include_defaults: bool, metadata: tuple) -> TaskManager:
    return TaskManager(include_path=list(include_path), include_defaults=include_defaults, metadata=dict(metadata))


def task_manager(
    tasks: Sequence[str] = (),
    include_path: str | None = None,
    data_dir: str | None = None,
    corpus_dir: str | None = None,
    tasks_dir: str | None = None,
) -> TaskManager:
    """A TaskManager indexing the bundled tasks (and include_path), built once per process and argument set.
    lm-eval's own tasks are indexed too (seconds: docs/evaluation.md) only when `tasks` names one that is neither
    bundled nor a YAML path. data_dir (local standard-suite files), corpus_dir (a `keel data` directory, local or an
    object-store URL, for the generated tasks) and tasks_dir (where those are written for a corpus_dir built
    without them: keel.data.generated_tasks) reach the task loaders as task metadata."""
    paths = (str(TASKS_DIR),) + ((include_path,) if include_path else ())
    dirs = {"data_dir": data_dir, "corpus_dir": corpus_dir, "tasks_dir": tasks_dir}
    metadata = tuple(sorted((key, data_path(value)) for key, value in dirs.items() if value))  # URLs as they are
    local = _task_manager(paths, False, metadata)
    if all(name in local.all_tasks or name.endswith(".yaml") for name in tasks):
        return local
    return _task_manager(paths, True, metadata)


def load_tasks(
    tasks: Sequence[str],
    include_path: str | None = None,
    data_dir: str | None = None,
    corpus_dir: str | None = None,
    tasks_dir: str | None = None,
) -> dict[str, Task]:
    """{name: Task} for task names, tags or groups: the bundled tasks, lm-eval's own (from data_dir's copy
    where `keel eval-data fetch` wrote one, else from the hub or the HF cache), or YAML paths."""
    specs = resolve_tasks(tasks, data_dir)
    manager = task_manager(specs, include_path, data_dir, corpus_dir, tasks_dir)
    with hub_or_local("eval.data_dir", data_dir):
        return manager.load(specs)["tasks"]


def primary_metric(task: Task) -> tuple[str, bool]:
    """The metric that stands for a task in loss-vs-task comparisons - the first of its metric_list, with the
    first filter's name for generative tasks - and whether higher is better."""
    name, higher = next(iter(task.higher_is_better().items()))
    filters = [f.name for f in task._filters]
    return (name if filters[0] == "none" else f"{name}/{filters[0]}"), higher


@contextlib.contextmanager
def _without_progress_bars() -> Iterator[None]:
    """lm-eval's progress bars off (building each task's requests, tokenizing them, scoring them): lm-eval has no
    switch for the first, so the tqdm each of these modules calls is a disabled one meanwhile."""
    modules = (lm_eval.api.task, lm_eval.api.model, keel.evaluation.lm)

    def disabled(*args, **kwargs) -> tqdm:
        return tqdm(*args, **{**kwargs, "disable": True})

    try:
        for module in modules:
            module.tqdm = disabled
        yield
    finally:
        for module in modules:
            module.tqdm = tqdm  # what each imported (`from tqdm import tqdm`)


def run_tasks(
    lm: LM,
    tasks: dict[str, Task],
    limit: int | None = None,
    num_fewshot: int | None = None,
    progress_bars: bool = True,
) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of loaded tasks (TaskManager.load(...)["tasks"], reusable: their documents are
    read once). num_fewshot None keeps each task's default (0 if it has none). Metric names are lm-eval's,
    the filter appended for generative tasks ('exact_match/strict-match'). lm-eval's evaluate(), not
    simple_evaluate(), which also probes the environment (seconds of subprocesses) and reseeds the global RNGs;
    no bootstrap standard errors, which would cost more than the evaluation itself. An lm with world_size > 1
    scores its rank's share of the documents; the metrics, over all of them, are returned on every rank.
    progress_bars=False: without lm-eval's bars (in-loop evaluation, under the step bar)."""
    for task in tasks.values():
        if num_fewshot is not None or task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=num_fewshot or 0)
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)  # the same few-shot examples at every evaluation
    with contextlib.nullcontext() if progress_bars else _without_progress_bars():
        results = evaluate(lm=lm, task_dict={"tasks": tasks}, limit=limit, bootstrap_iters=0, log_samples=False)
    metrics = {task: _metrics(values) for task, values in results["results"].items()} if results else None
    if lm.world_size > 1:  # lm-eval returns them on rank 0 alone; every rank gets them (the same eval history)
        shared = [metrics]
        torch.distributed.broadcast_object_list(shared, src=0)
        metrics = shared[0]
    return metrics


def _metrics(values: dict[str, Any]) -> dict[str, float]:
    metrics = {}
    for key, value in values.items():
        metric, _, filter_name = key.partition(",")
        if filter_name and not metric.endswith(STDERR) and isinstance(value, (int, float)):
            metrics[metric if filter_name == "none" else f"{metric}/{filter_name}"] = float(value)
    return metrics
