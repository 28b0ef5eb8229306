"""What the experiment commands share: symbolic alpha, width at a fixed parameter budget, training one run and
reading back what it left in its run directory, tables and line plots."""

from __future__ import annotations

import argparse
import ast
import csv
import math
import operator
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from keel.artifacts import CONFIG, read_eval_history, read_scalars, read_stability
from keel.config import Config, ModelConfig, from_dict
from keel.errors import ConfigError
from keel.model import parameter_counts
from keel.config.model import scheme_of


KINDS = {int: "an integer", float: "a number"}  # what comma_list names a cast, in its error


def comma_list(cast: Callable[[str], Any]) -> Callable[[str], list]:
    """An argparse type for `--depths 8,16`: comma-separated values, never confused with trailing key=value
    overrides the way space-separated nargs='+' values would be. A bad value is named in the option's error
    (`argument --depths: 'x' in '8,x' is not an integer`), where argparse would say "invalid <lambda> value"."""

    def values(text: str) -> list:
        parsed = []
        for item in filter(None, (item.strip() for item in text.split(","))):
            try:
                parsed.append(cast(item))
            except ValueError:  # a cast's own argparse.ArgumentTypeError, its message, passes as it is
                kind = KINDS.get(cast, f"a valid {getattr(cast, '__name__', 'value')}")
                raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not {kind}") from None
        return parsed

    return values


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors (a bad option value, an unknown option) are ConfigErrors, which `keel` prints
    as its one line with exit status 2, not as argparse's usage and message."""

    def error(self, message: str):
        if message.endswith("expected one argument"):  # `--members -1,abc`: argparse takes -1,abc for an option
            option = message.partition(":")[0].removeprefix("argument ").split("/")[-1]
            message += f" (a value that starts with '-' goes after '=': {option}=VALUE)"
        raise ConfigError(f"{message}; `{self.prog} --help` lists the options")


# ------------------------------------------------------------------------------------------------ alpha

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}


def resolve_alpha(expr: str | float, n_sublayers: int) -> float:
    """Keel's alpha from a number or an arithmetic expression in L, the number of sublayers: `1`, `sqrt(L)`,
    `L/2`, `L`, `2L`, `L**0.75`. Evaluated on a whitelist of AST nodes, never with eval()."""
    text = re.sub(r"(\d)\s*(?=L|sqrt|\()", r"\1*", str(expr).strip())  # implicit product: 2L -> 2*L

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name) and node.id == "L":
            return float(n_sublayers)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "sqrt" and len(node.args) == 1:
            return math.sqrt(value(node.args[0]))
        raise ValueError(ast.dump(node))

    try:
        alpha = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
        raise ConfigError(f"alpha {expr!r}: not a number or an expression in L "
                          f"(e.g. 1, sqrt(L), L/2, L, 2L): {err}") from None
    if not alpha > 0:
        raise ConfigError(f"alpha {expr!r} = {alpha} at L = {n_sublayers}: must be > 0")
    return alpha


def slug(text: str) -> str:
    """A directory-safe form of an axis value: sqrt(L) -> sqrtL, L/2 -> Ldiv2, 3e-3 -> 3e-3."""
    return re.sub(r"[^\w.+-]", "", str(text).replace("/", "div").replace("*", "x"))


# ------------------------------------------------------------------------------------ parameter budget


def non_embedding_params(model: ModelConfig) -> int:
    """Parameters outside the embedding and the LM head (Kaplan et al.'s count): the blocks and the final norm."""
    counts = parameter_counts(model)
    return counts["blocks"] + counts["final_norm"]


def width_for_budget(model: ModelConfig, depth: int, budget: int) -> int:
    """The width (a multiple of 2 * n_heads: even head dim for RoPE) whose non-embedding parameter count at
    `depth` is closest to `budget`, n_heads and the FFN ratio kept. The count grows with width, so bisect."""
    step = 2 * model.n_heads

    def params(width: int) -> int:
        return non_embedding_params(replace(model, depth=depth, width=width))

    lo, hi = 1, 2
    while params(hi * step) < budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: params(lo * step) < budget <= params(hi * step), or lo = 1
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if params(mid * step) < budget else (lo, mid)
    return min((lo * step, hi * step), key=lambda width: abs(params(width) - budget))


# -------------------------------------------------------------------------------------- runs and results


def train_run(cfg: Config, extra_callbacks: Sequence = ()) -> None:
    """Train one configured run (its stability monitor, eval etc. come from cfg.callbacks)."""
    from keel.training import train  # lightning: imported only by the commands that train

    train(cfg, list(extra_callbacks))


def _eval_scores(run_dir: Path) -> dict[str, float]:
    """The last in-loop evaluation's primary metric per task, from the downstream-eval callback's history."""
    history = read_eval_history(run_dir)
    if not history or not history.get("evaluations"):
        return {}
    last = history["evaluations"][-1]["scores"]
    return {f"eval/{task}/{info['metric']}": last[task][info["metric"]] for task, info in history["tasks"].items()
            if task in last and info["metric"] in last[task]}


def unigram_loss(cfg: Config) -> float:
    """Cross-entropy (nats/token) of the held-out batches validation uses (the first trainer.val_batches of the
    val split) under the training split's token frequencies (add-one smoothed): what a model that learned only
    how often each token occurs would score - the level a model must get well below before it is judged."""
    import numpy as np
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    from keel.data.loading import open_dataset, token_loader
    from keel.data.shards import data_path

    vocab = max(open_dataset(cfg).vocab_size, cfg.model.vocab_size)
    counts = np.zeros(vocab, np.int64)
    for block in StreamingDataset(data_path(cfg.data.dir, "train"), item_loader=TokensLoader(block_size=1 << 16)):
        counts += np.bincount(np.asarray(block), minlength=vocab)
    log_p = np.log((counts + 1) / (counts.sum() + vocab))
    total, tokens = 0.0, 0
    for i, batch in enumerate(token_loader(cfg, "val", shuffle=False)):
        if i == cfg.trainer.val_batches:
            break
        targets = batch[:, 1:].numpy()
        total, tokens = total - log_p[targets].sum(), tokens + targets.size
    return float(total / tokens)


def load_run_config(run_dir: str | Path) -> Config:
    return from_dict(OmegaConf.to_container(OmegaConf.load(Path(run_dir) / CONFIG)))


def finished(run_dir: str | Path, cfg: Config) -> bool:
    """A run (a sweep's or a max-LR probe) is over once its stability monitor recorded every step, or a failure that
    stopped it: told from its records alone, checkpoints gone or not, wherever the run directory now lies."""
    state = read_stability(run_dir)
    return state is not None and (state["steps"] >= cfg.trainer.max_steps
                                  or (state["failed"] and cfg.callbacks.stability.stop_on_failure))


def trained(run_dir: str | Path, cfg: Config) -> bool:
    """finished(), for a command that would train the run otherwise: a record of every step beside a last checkpoint
    that holds fewer (another run's record, or an edited one) is not believed, and the run trains on from its
    checkpoint. Records without checkpoints (committed ones) are believed."""
    if not finished(run_dir, cfg):
        return False
    last = Path(run_dir) / "checkpoints" / "last.ckpt"
    if not last.exists():
        return True
    from keel.checkpoint.read import read_checkpoint  # torch: the training commands have it loaded

    state = read_stability(run_dir)
    return state["failed"] or read_checkpoint(last, weights=False).get("global_step", 0) >= state["steps"]


def run_row(run_dir: str | Path) -> dict[str, Any]:
    """One run as a flat record: what it was (from its config.yaml) and what it left behind - the stability
    monitor's verdict (stability.json), the last validation loss with its TensorBoard step (the 0-based index
    of the optimizer step it followed) and the last task scores (eval_history.json)."""
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    m = cfg.model
    row: dict[str, Any] = {
        "run": run_dir.name, "scheme": m.scheme, "depth": m.depth, "L": m.n_sublayers, "width": m.width,
        "alpha": alpha(m) if (alpha := scheme_of(m).alpha) is not None else None,
        "init": m.init_kind, "params_nonemb": non_embedding_params(m), "lr": cfg.optim.lr,
        "schedule": cfg.optim.schedule, "max_steps": cfg.trainer.max_steps, "seed": cfg.run.seed,
    }
    if (s := read_stability(run_dir)) is not None:
        row |= {"steps": s["steps"], "failed": s["failed"], "failure": s["kind"], "onset_step": s["step"],
                "max_tolerable_lr": s["max_tolerable_lr"], "max_lr_seen": s["max_lr_seen"]}
    if val := read_scalars(run_dir, ["val/loss"]).get("val/loss"):
        row |= {"val_step": val[-1][0], "val_loss": val[-1][1]}
    return row | _eval_scores(run_dir)


# -------------------------------------------------------------------------------------- tables and plots


def fmt(value: float | None) -> str:
    """A figure in a report's prose cell: three significant digits, '-' for none."""
    return "-" if value is None else f"{value:.3g}"


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def median_range(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    """The median, min and max of values (three Nones for none)."""
    return (statistics.median(values), min(values), max(values)) if values else (None, None, None)


def fmt_median_range(values: Sequence[float]) -> str:
    """median [min-max] in a report's prose cell, '-' for none."""
    middle, low, high = median_range(values)
    return "-" if middle is None else f"{fmt(middle)} [{fmt(low)}-{fmt(high)}]"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_table(rows: list[dict[str, Any]], csv_path: Path, md_path: Path | None = None) -> list[str]:
    """rows as CSV (every key any row has, in first-seen order) and, optionally, a markdown table."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    if md_path is not None:
        md_path.write_text(markdown_table(rows, columns) + "\n")
    return columns


def markdown_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """rows as a markdown table; columns: by default every key, in order of first appearance."""
    columns = list(dict.fromkeys(k for row in rows for k in row)) if columns is None else columns
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, title: str, path: Path, dpi: int = 120) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def plot_lines(
    curves: Iterable[tuple[str, Sequence[float], Sequence[float]]],
    path: Path,
    xlabel: str,
    ylabel: str,
    title: str,
    xscale: str = "linear",
    yscale: str = "linear",
    marker: str | None = "o",
    decorate: Callable[[Any], None] | None = None,
) -> None:
    """One line per (label, xs, ys) in one PNG; decorate(ax) adds anything command-specific."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, xs, ys in curves:
        ax.plot(xs, ys, marker=marker, markersize=3, linewidth=1.2, label=label)
    ax.set_xscale(xscale)
    ax.set_yscale(yscale)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if decorate is not None:
        decorate(ax)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
