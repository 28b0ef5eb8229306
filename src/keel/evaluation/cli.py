"""`keel eval [lm-eval arguments]`: lm-eval's own command line (same arguments, same results files) with
the `keel` model registered and its defaults: --model keel, --include_path <the bundled keel_* tasks>,
--batch_size 16 (lm-eval's own default is 1) and, without a GPU, --device cpu (lm-eval's is cuda:0). For example

    keel eval --model_args checkpoint=runs/default/checkpoints/last.ckpt --tasks keel_generated,keel_arc_easy \\
        --limit 200 --output_path out/eval
    keel eval ls tasks

The generated tasks read the checkpoint's data.dir (or --metadata corpus_dir=DIR). lm-eval's own tasks
(arc_easy, hellaswag, ...) read --metadata data_dir=DIR where `keel eval-data fetch DIR` wrote a copy of
them, else the Hugging Face hub (or its cache, with HF_DATASETS_OFFLINE=1); the keel_* standard tasks read
the original benchmark files in --metadata data_dir=DIR.
"""

from __future__ import annotations

import functools
import os
import sys

import lm_eval.evaluator
import torch
from lm_eval._cli import HarnessCLI
from lm_eval.utils import setup_logging

import keel.evaluation.lm  # noqa: F401  (registers the `keel` model)
from keel.errors import ConfigError
from keel.evaluation.local_tasks import hub_or_local, resolve_tasks, unknown_tasks
from keel.evaluation.suite import TASKS_DIR

RUN_DEFAULTS = {("--model", "-M"): "keel", ("--batch_size", "-b"): "16"}
SUBCOMMANDS = ("run", "ls", "validate")


def _given(argv: list[str], flags: tuple[str, ...]) -> bool:
    return any(arg in flags or arg.startswith(tuple(f"{flag}=" for flag in flags)) for arg in argv)


def with_defaults(argv: list[str]) -> list[str]:
    """lm-eval's arguments with keel's defaults added where absent; a bare call or --help passes through."""
    if not argv or argv[0] in ("-h", "--help"):
        return argv
    command, rest = (argv[0], argv[1:]) if argv[0] in SUBCOMMANDS else ("run", argv)
    defaults = {("--include_path",): str(TASKS_DIR)}
    if command == "run":
        defaults.update(RUN_DEFAULTS)
        if not torch.cuda.is_available():
            defaults[("--device",)] = "cpu"
    for flags, value in defaults.items():
        if not _given(rest, flags):
            rest += [flags[0], value]
    return [command, *rest]


def without_stderr(function):
    """function with this process's stderr (file descriptor 2, which its subprocesses inherit) sent to /dev/null."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        sys.stderr.flush()
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        try:
            return function(*args, **kwargs)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(devnull)

    return call


# lm-eval records the git commit of the working directory in its results (`git describe`, git's stderr inherited):
# outside a git checkout git printed "fatal: not a git repository" on the console; the field is then null
lm_eval.evaluator.get_git_commit_hash = without_stderr(lm_eval.evaluator.get_git_commit_hash)


def main(argv: list[str]) -> int:
    """lm-eval's cli_evaluate(), with the task names that data_dir holds a local copy of turned into its YAML."""
    saved, sys.argv = sys.argv, ["keel eval", *with_defaults(list(argv))]
    try:
        setup_logging()
        parser = HarnessCLI()
        args = parser.parse_args()
        data_dir = (getattr(args, "metadata", None) or {}).get("data_dir")
        if getattr(args, "tasks", None):
            args.tasks = resolve_tasks(args.tasks, data_dir)
            if unknown := unknown_tasks(args.tasks, getattr(args, "include_path", None)):
                raise ValueError(f"Tasks not found: {', '.join(unknown)}")  # said as lm-eval's own, below
        with hub_or_local("--metadata data_dir", data_dir):
            parser.execute(args)
    except FileNotFoundError as err:  # a task's data files (the bundled tasks' loaders name the setting to change)
        raise ConfigError(f"task data: {err}") from None
    except ValueError as err:
        if not str(err).startswith("Tasks not found"):  # lm-eval's words for a --tasks name it does not know
            raise
        raise ConfigError(
            f"--tasks: {err}; `keel eval ls tasks` lists the known ones (the bundled keel_* tasks "
            "among them), or add a directory of task YAMLs with --include_path"
        ) from None
    finally:
        sys.argv = saved
    return 0
