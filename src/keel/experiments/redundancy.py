"""`keel redundancy checkpoint=PATH [checkpoint=PATH ...] [--batches N] [--data-dir DIR] [--out DIR]`

The paper's layer redundancy analysis (Section 8): the validation perplexity of a trained model when each
block in turn is removed (skipped: its output is its input), against the intact model's. A redundant block
barely moves it; the paper reports Pre-LN's shallow blocks as redundant and Keel's as not. One or several
checkpoints (`checkpoint=PATH`, a bare PATH or `--checkpoint PATH`, any number) are measured on the first
--batches validation batches of their own data (or of --data-dir, tokenized alike) and drawn side by side.

Writes under --out: redundancy.csv (a row per checkpoint and block), redundancy.md and redundancy.png. With
--append the rows already in --out's redundancy.csv stay, but for the checkpoints measured again: a grid's table
grows as its runs finish, and its committed rows survive where their checkpoints are gone.
The block skipping is keel.layer_skip's, shared with keel.callbacks.layer_importance, which tracks the same
quantity during training.
"""

from __future__ import annotations

import argparse
import math
import os
from itertools import islice
from pathlib import Path

import torch

from keel.checkpoint.read import load_model
from keel.data.loading import token_loader
from keel.devices import set_threads
from keel.errors import ConfigError
from keel.experiments.plots import plot_lines
from keel.experiments.records import (
    REDUNDANCY_MEASURED,
    REDUNDANCY_PLOT,
    REDUNDANCY_SUMMARY,
    REDUNDANCY_TABLE,
    read_redundancy_rows,
)
from keel.experiments.tables import markdown_table, write_table
from keel.layer_skip import skip_losses
from keel.model import KeelLM
from keel.provenance import made_by


@torch.no_grad()
def removal_losses(model: KeelLM, batches: list[torch.Tensor]) -> tuple[float, list[float]]:
    """Mean loss of the intact model and with each block removed, over equal-sized batches (the mean of the
    batch means is then the token mean)."""
    losses = torch.stack([skip_losses(model, batch, list(range(model.cfg.depth))) for batch in batches]).mean(0)
    base, *removed = losses.tolist()
    return base, removed


def measure(path: str, batches: int, batch_size: int | None, data_dir: str | None, device: str) -> list[dict]:
    model, cfg, _ = load_model(path, device)
    cfg.data.loader_workers = 0
    if data_dir:
        cfg.data.dir = data_dir
    if batch_size:
        cfg.trainer.micro_batch_size = batch_size
    set_threads(cfg)
    data = [b.to(device) for b in islice(token_loader(cfg, "val", shuffle=False), batches)]
    base, removed = removal_losses(model, data)
    label = f"{Path(cfg.run.dir).name}/{Path(path).stem} ({cfg.model.scheme}, depth {cfg.model.depth})"
    provenance = made_by(torch.get_num_threads())
    return [
        {
            "checkpoint": label,
            "path": path,
            "scheme": cfg.model.scheme,
            "depth": cfg.model.depth,
            "block": b,
            "val_tokens": sum(x[:, 1:].numel() for x in data),
            "ppl_base": math.exp(base),
            "ppl_removed": math.exp(loss),
            "ppl_increase": math.exp(loss) - math.exp(base),
            "loss_increase": loss - base,
            **provenance,
        }
        for b, loss in enumerate(removed)
    ]


def earlier_rows(table: Path, measured: list[str]) -> list[dict]:
    """The rows of `table` (an earlier redundancy.csv, if any) for checkpoints other than those `measured`."""
    try:
        rows = read_redundancy_rows(table)
    except ConfigError as error:
        raise ConfigError(f"redundancy --append: {error}; give another --out") from None
    again = {os.path.normpath(path) for path in measured}
    return [row for row in rows if os.path.normpath(row["path"]) not in again]


def plot(rows: list[dict], path: Path) -> None:
    curves: dict[str, tuple[list, list]] = {}
    for r in rows:
        blocks, increases = curves.setdefault(r["checkpoint"], ([], []))
        blocks.append(r["block"])
        increases.append(r["ppl_increase"])
    # symlog: removing block 0 can cost orders of magnitude more perplexity than a middle block, some even help
    plot_lines(
        [(label, xs, ys) for label, (xs, ys) in curves.items()],
        path,
        "removed block (0 = first)",
        "validation perplexity increase",
        "Layer redundancy: perplexity increase when one block is skipped",
        yscale="symlog",
    )


def checkpoint_paths(positional: list[str], options: list[str]) -> list[str]:
    paths = [item.removeprefix("checkpoint=") for item in positional] + options
    if not paths:
        raise ConfigError("redundancy: give at least one checkpoint (checkpoint=PATH)")
    return paths


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="keel redundancy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoints", nargs="*", help="checkpoint=PATH or PATH")
    parser.add_argument("--checkpoint", action="append", default=[], help="another checkpoint (repeatable)")
    parser.add_argument("--batches", type=int, default=16, help="validation batches evaluated per removal")
    parser.add_argument("--batch-size", type=int, help="sequences per batch (default: the run's micro batch)")
    parser.add_argument("--data-dir", help="shards to evaluate on (default: each run's data.dir)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="runs/redundancy")
    parser.add_argument(
        "--append", action="store_true", help="keep the rows of other checkpoints already in --out's redundancy.csv"
    )
    args = parser.parse_args(argv)
    paths = checkpoint_paths(args.checkpoints, args.checkpoint)
    out = Path(args.out)
    kept = earlier_rows(out / REDUNDANCY_TABLE, paths) if args.append else []
    rows = kept + [
        row for path in paths for row in measure(path, args.batches, args.batch_size, args.data_dir, args.device)
    ]
    columns = write_table(rows, out / REDUNDANCY_TABLE)
    # the summary without the provenance columns, the same on every row of one session
    (out / REDUNDANCY_SUMMARY).write_text(markdown_table(rows, REDUNDANCY_MEASURED) + "\n")
    plot(rows, out / REDUNDANCY_PLOT)
    kept_note = f" ({len(kept)} of them kept from before)" if kept else ""
    print(
        f"keel redundancy: {len(rows)} blocks{kept_note} -> {out}/redundancy.csv ({', '.join(columns)}), "
        "redundancy.md, redundancy.png"
    )
    return 0
