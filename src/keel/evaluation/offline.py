"""lm-eval's own tasks (arc_easy, hellaswag, ...) on local copies of their Hugging Face datasets, for machines
without the hub: `keel eval-data fetch DIR` downloads each task's dataset once and writes

    DIR/<task>/<split>.jsonl     every split the task reads, one row of the hub dataset per line
    DIR/<task>/<task>.yaml       lm-eval's config of the task, reading those files (written last: a task folder
                                 without it is an unfinished fetch)

Training (eval.data_dir=DIR) and `keel eval` (--metadata data_dir=DIR) then run a task from DIR when
DIR/<task>/<task>.yaml exists, else lm-eval's registered task, whose dataset comes from the hub or the HF cache
(HF_DATASETS_OFFLINE=1). The config is lm-eval's own, with its `dataset_path` replaced by a loader of the local
files: same prompts, same metrics, same process_docs, hence the same scores as with the hub.
"""

from __future__ import annotations

import argparse
import json
import os
import types
from collections.abc import Sequence
from pathlib import Path

import yaml

from keel.errors import ConfigError
from keel.evaluation import standard
from keel.evaluation.local_tasks import task_yaml
from keel.evaluation.suite import task_manager

# The standard downstream suite, by lm-eval's task names: `keel eval-data fetch`'s default.
STANDARD_TASKS = (
    "arc_easy",
    "arc_challenge",
    "boolq",
    "hellaswag",
    "lambada_openai",
    "openbookqa",
    "piqa",
    "winogrande",
    "gsm8k",
)
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
HUB_KEYS = ("dataset_path", "dataset_name", "dataset_kwargs")


def _function_tag(dumper: yaml.SafeDumper, fn: types.FunctionType) -> yaml.Node:
    # lm-eval's !function resolves a dotted name by import when no file beside the YAML matches; its own tasks'
    # helpers are importable as lm_eval.tasks.<folder>.<file>, a task file outside a package is not
    if "/" in fn.__module__:
        raise ConfigError(
            f"{fn.__qualname__} (from {fn.__module__}.py) is not importable: `keel eval-data fetch` "
            "copies lm-eval's own tasks"
        )
    return dumper.represent_scalar("!function", f"{fn.__module__}.{fn.__qualname__}")


class _ConfigDumper(yaml.SafeDumper):
    pass


_ConfigDumper.add_representer(types.FunctionType, _function_tag)


def local_config(config: dict) -> dict:
    """lm-eval's task config (includes and !functions resolved) reading DIR/<task>/<split>.jsonl instead."""
    splits = sorted({config[key] for key in SPLIT_KEYS if config.get(key)})
    local = {key: value for key, value in config.items() if key not in HUB_KEYS}
    local["custom_dataset"] = standard.jsonl
    local["dataset_kwargs"] = {"files": {split: f"{config['task']}/{split}.jsonl" for split in splits}}
    return local


def write_local_task(config: dict, dataset, out_dir: str | os.PathLike) -> Path:
    """Write a task's splits (from `dataset`, the DatasetDict lm-eval's config names) and its local YAML."""
    local = local_config(config)
    task_dir = Path(out_dir) / config["task"]
    task_dir.mkdir(parents=True, exist_ok=True)
    for split, name in local["dataset_kwargs"]["files"].items():
        if split not in dataset:
            raise ConfigError(
                f"{config['task']}: {config['dataset_path']} has no split {split!r} (it has {', '.join(dataset)})"
            )
        partial = Path(out_dir) / f"{name}.partial"
        with open(partial, "w", encoding="utf-8") as f:
            for row in dataset[split]:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        partial.replace(Path(out_dir) / name)
    path = task_yaml(out_dir, config["task"])
    source = " / ".join(str(config[key]) for key in ("dataset_path", "dataset_name") if config.get(key))
    header = f"# lm-eval's {config['task']} on the local copy of {source} written by `keel eval-data fetch`\n"
    path.write_text(
        header + yaml.dump(local, Dumper=_ConfigDumper, sort_keys=False, allow_unicode=True, width=120),
        encoding="utf-8",
    )
    return path


def lm_eval_configs(tasks: Sequence[str]) -> dict[str, dict]:
    """lm-eval's own config of each task, includes and !functions resolved (indexing its tasks takes seconds)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    index = task_manager(tasks).task_index
    unknown = [name for name in tasks if name not in index or index[name].yaml_path is None]
    if unknown:
        raise ConfigError(
            f"--tasks: {', '.join(unknown)}: not a task of lm-eval's with a YAML config "
            f"(`keel eval ls tasks` lists them; the default is {','.join(STANDARD_TASKS)})"
        )
    configs = {name: load_yaml(index[name].yaml_path, resolve_func=True) for name in tasks}
    no_dataset = [name for name, config in configs.items() if not config.get("dataset_path")]
    if no_dataset:
        raise ConfigError(
            f"--tasks: {', '.join(no_dataset)}: not read from a Hugging Face dataset (no "
            "dataset_path), so there is nothing to fetch"
        )
    return configs


def fetch(tasks: Sequence[str], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Download each lm-eval task's dataset (hub, or the HF cache) and write its local copy; {task: YAML path}."""
    import datasets

    written = {}
    for name, config in lm_eval_configs(tasks).items():
        try:
            dataset = datasets.load_dataset(
                config["dataset_path"], config.get("dataset_name"), **(config.get("dataset_kwargs") or {})
            )
        except ConnectionError as err:
            raise ConfigError(
                f"{name}: {err}. `keel eval-data fetch` downloads from the Hugging Face hub: run it where the hub "
                "can be reached (or where the HF cache holds the dataset, with HF_DATASETS_OFFLINE=1), then copy "
                f"{out_dir} to this machine"
            ) from err
        written[name] = write_local_task(config, dataset, out_dir)
        print(f"{name}: {written[name].parent}")
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="keel eval-data",
        description="Local copies of lm-eval's tasks, for in-loop evaluation and `keel eval` without the hub.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_parser = commands.add_parser(
        "fetch", help="download tasks' Hugging Face datasets once and write them to DIR (docs/evaluation.md)"
    )
    fetch_parser.add_argument("dir", metavar="DIR", help="where to write DIR/<task>/ (created if absent)")
    fetch_parser.add_argument(
        "--tasks",
        default=",".join(STANDARD_TASKS),
        help="comma-separated lm-eval task names (default: the standard suite)",
    )
    args = parser.parse_args(argv)
    tasks = [name for name in args.tasks.split(",") if name]
    fetch(tasks, args.dir)
    print(f"use them with eval.data_dir={args.dir} in training, or --metadata data_dir={args.dir} on `keel eval`")
    return 0
