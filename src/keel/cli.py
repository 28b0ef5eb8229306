"""`keel <command> ...`: each command is a module with `main(argv) -> int`, imported only when used."""

from __future__ import annotations

import importlib
import sys

from keel.errors import ConfigError, StorageError

COMMANDS = {
    "pretrain": ("keel.pretrain", "train a model from the composed config"),
    "estimate": ("keel.estimate", "a run's memory per GPU (or CPU) from its config, without starting it"),
    "data": ("keel.data.preparation", "build tokenized litdata shards (and a tokenizer) from a corpus"),
    "gradflow": (
        "keel.gradflow",
        "per-sublayer gradient flow at initialization or in a checkpoint, as JSON (and a plot)",
    ),
    "generate": ("keel.generate", "sample text from a checkpoint (KV cache, printed as it is decoded)"),
    "eval": ("keel.evaluation.cli", "lm-eval's command line with the `keel` model registered"),
    "eval-data": ("keel.evaluation.offline", "local copies of lm-eval's task datasets: `keel eval-data fetch DIR`"),
    "compare": ("keel.evaluation.compare", "plot runs' loss and task curves side by side"),
    "maxlr": ("keel.experiments.maxlr", "max tolerable learning rate per scheme (paper Table 1)"),
    "paper-run": ("keel.experiments.paper_run", "run one of the paper's grids (the data `make paper-<grid>` runs)"),
    "paper-report": ("keel.experiments.paper", "the report of `make paper`'s grids (docs/experiments.md)"),
    "sweep": ("keel.experiments.sweep", "grids over scheme, depth, lr, alpha, width"),
    "redundancy": ("keel.experiments.redundancy", "perplexity increase when each block is removed"),
    "consolidate": ("keel.checkpoint.consolidate", "turn a sharded (FSDP) checkpoint into one file"),
    "export": ("keel.export", "a checkpoint as a Hugging Face model directory (transformers, lm-eval hf, TRL)"),
    "bench": ("keel.bench.cli", "training-step throughput, memory and MFU"),
    "gpu-check": ("keel.gpu_check.cli", "GPU acceptance: throughput, training, resume, depth, precision"),
}


def usage() -> str:
    lines = ["usage: keel <command> [options]   (keel <command> --help for each)", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"keel: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return module.main(rest) or 0
    except ConfigError as err:
        print(f"keel {name}: config error: {err}", file=sys.stderr)
        return 2
    except StorageError as err:
        print(f"keel {name}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # Ctrl-C; training stops cleanly first, on other signals too (Interrupted)
        if str(stop) or type(stop) is KeyboardInterrupt:  # an Interrupted without a message: rank 0 said it
            print(f"keel {name}: {stop or 'interrupted'}", file=sys.stderr)
        return getattr(stop, "exit_code", 130)


if __name__ == "__main__":
    sys.exit(main())
