"""`keel maxlr [--schemes A,B,...] [--depths 16,32] [--peak-lr X] [--steps N] [--out DIR] [--config FILE] [key=value]`

The paper's maximum tolerable learning rate (Table 1, Section 5.1): the learning rate rises linearly from 0 to
an aggressive peak over the whole run (optim.schedule=linear_warmup, warm-up = every step). The stability
monitor (keel.callbacks.stability) ends a run at its first failure - a non-finite loss or gradient, an
irrecoverable loss spike or stagnation - and records the learning rate of the step before it: the run's
maximum tolerable LR. A run that reaches the peak without failing tolerates at least the peak.

The defaults are a CPU miniature (MINIATURE below: 16 blocks of width 64, 128-token sequences); key=value
overrides change it (e.g. model=paper_d64 trainer=gpu for the real thing), and callbacks.stability.* tune the
failure criteria. Writes under --out: a run directory per scheme and depth, maxlr.csv, maxlr.md (a Table 1
style summary and the detail) and maxlr.png (loss against learning rate, one curve per run, failures marked).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from keel.callbacks._logging import finished_step
from keel.callbacks.stability import SMOOTHING
from keel.config import load_config
from keel.experiments.common import comma_list, markdown_table, plot_lines, run_row, train_run, write_table

DEFAULT_SCHEMES = ("keel", "preln", "postln", "deepnorm", "hybridnorm", "mixln")
# Sized so the six default runs take <= 20 min on 2 CPU cores (docs/experiments.md has the measurements).
MINIATURE = [
    "model.width=64",
    "model.n_heads=4",
    "model.seq_len=128",
    "trainer.micro_batch_size=8",
    "trainer.threads=1",  # at this width a second thread gains little on an idle CPU and loses much on a shared one
    "callbacks.stability.stagnation_window=50",  # the paper's third failure mode (off in the config default)
    # only what the protocol needs: no validation, in-loop evaluation or per-layer diagnostics
    "eval.enabled=false",
    "callbacks.grad_norms.enabled=false",
    "callbacks.layer_importance.enabled=false",
]
LOSS_LR = "loss_lr.csv"


class LossByLR(Callback):
    """Every optimizer step's (step, lr, loss), written to <run.dir>/loss_lr.csv: the curves of maxlr.png."""

    def __init__(self, run_dir: str) -> None:
        self.path = Path(run_dir) / LOSS_LR
        self.rows: list[tuple[int, float, float]] = []
        self._lr = 0.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._lr = optimizer.param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = finished_step(trainer)
        if step is not None:
            self.rows.append((step, self._lr, float(outputs["loss"])))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerows([("step", "lr", "loss"), *self.rows])


def protocol(scheme: str, depth: int, peak_lr: float, steps: int, run_dir: Path) -> list[str]:
    """The overrides that make a run a max-LR probe; they come last, so nothing else can undo them."""
    return [
        f"model.scheme={scheme}", f"model.depth={depth}",
        f"optim.lr={peak_lr}", "optim.schedule=linear_warmup", f"optim.warmup_steps={steps}",
        f"trainer.max_steps={steps}", f"trainer.val_every_n_steps={steps + 1}",  # never validates
        f"trainer.checkpoint_every_n_steps={steps}",
        "callbacks.stability.enabled=true", "callbacks.stability.stop_on_failure=true",
        f"run.dir={run_dir}", "resume=null",  # every probe starts from scratch
    ]


def verdict(row: dict) -> str:
    """A Table 1 cell: the max tolerable LR and the failure that bounded it."""
    if not row.get("failed"):
        return f">= {row['max_lr_seen']:.3g} (no failure)"
    if row["max_tolerable_lr"] is None:
        return f"fails at step 0 ({row['failure']})"
    return f"{row['max_tolerable_lr']:.3g} ({row['failure']})"


def summary_table(rows: list[dict], schemes: list[str], depths: list[int]) -> str:
    by_key = {(r["scheme"], r["depth"]): r for r in rows}
    table = [{"scheme": s, **{f"depth {d} (L={2 * d})": verdict(by_key[s, d]) for d in depths}} for s in schemes]
    return markdown_table(table, list(table[0]))


def smoothed_curve(run_dir: Path) -> tuple[list[float], list[float]]:
    """(lr, loss EMA) per step: the trend the stability monitor judges, smoothed as it does (non-finite
    losses skipped)."""
    with open(run_dir / LOSS_LR) as f:
        points = [(float(r["lr"]), float(r["loss"])) for r in csv.DictReader(f)]
    lrs, trend, ema = [], [], math.nan
    for lr, loss in points:
        if math.isfinite(loss):
            ema = loss if math.isnan(ema) else SMOOTHING * ema + (1 - SMOOTHING) * loss
        lrs.append(lr)
        trend.append(ema)
    return lrs, trend


def plot(rows: list[dict], out: Path, title: str) -> None:
    curves = [(f"{r['scheme']} d{r['depth']}", *smoothed_curve(out / r["run"])) for r in rows]
    first_losses = [ys[0] for _, _, ys in curves if ys]

    def decorate(ax) -> None:
        for line, row in zip(ax.get_lines(), rows):
            if row.get("failed") and row["max_tolerable_lr"] is not None:
                ax.axvline(row["max_tolerable_lr"], color=line.get_color(), linestyle=":", linewidth=1)
        if first_losses:  # diverged runs climb far above the start; keep the interesting range in view
            ax.set_ylim(top=max(first_losses) + 0.5)

    plot_lines(curves, out / "maxlr.png", "learning rate (linear warm-up)", f"training loss (EMA {SMOOTHING})",
               f"{title}\n(dotted: max tolerable LR = LR at the step before the first failure)", marker=None,
               decorate=decorate)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="keel maxlr", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", type=comma_list(str), default=list(DEFAULT_SCHEMES), help="comma-separated")
    parser.add_argument("--depths", type=comma_list(int), default=[16], help="blocks, comma-separated")
    parser.add_argument("--peak-lr", type=float, default=0.2, help="where the linear ramp ends")
    parser.add_argument("--steps", type=int, default=200, help="steps of the ramp (= the whole run)")
    parser.add_argument("--out", default="runs/maxlr")
    parser.add_argument("--config", help="YAML merged over conf/config.yaml")
    parser.add_argument("overrides", nargs="*", help="group=choice or key.path=value, applied over the miniature")
    args = parser.parse_args(argv)
    out = Path(args.out)
    probes = [(scheme, depth, out / f"{scheme}-d{depth}") for depth in args.depths for scheme in args.schemes]
    # every config is checked before the first run starts
    configs = [load_config(args.config, [*MINIATURE, *args.overrides,
                                         *protocol(scheme, depth, args.peak_lr, args.steps, run_dir)])
               for scheme, depth, run_dir in probes]
    rows = []
    for (scheme, depth, run_dir), cfg in zip(probes, configs):
        wall_s = train_run(cfg, [LossByLR(cfg.run.dir)])
        trend = [loss for loss in smoothed_curve(run_dir)[1] if math.isfinite(loss)]
        row = {**run_row(run_dir), "peak_lr": args.peak_lr, "best_loss_ema": min(trend), "end_loss_ema": trend[-1],
               "wall_s": round(wall_s, 1)}
        rows.append(row)
        print(f"keel maxlr: {scheme} depth {depth}: {verdict(row)} after {row['steps']} steps, {wall_s:.0f} s",
              flush=True)
    write_table(rows, out / "maxlr.csv")
    title = f"max tolerable LR: linear ramp 0 -> {args.peak_lr:g} over {args.steps} steps"
    summary = summary_table(rows, args.schemes, args.depths)
    columns = ["scheme", "depth", "width", "params_nonemb", "failure", "onset_step", "max_tolerable_lr", "steps",
               "best_loss_ema", "end_loss_ema", "wall_s"]
    (out / "maxlr.md").write_text(f"# {title}\n\n{summary}\n\n{markdown_table(rows, columns)}\n")
    plot(rows, out, title)
    print(f"\n{summary}\n\nkeel maxlr: wrote {out}/maxlr.csv, maxlr.md, maxlr.png")
    return 0
