"""`keel maxlr [--schemes A,B] [--depths 16,48] [--seeds 1,2,3] [--alphas 1,L] [--variant NAME=KEY=V,...]
[--peak-lr X] [--start-lr X] [--steps N] [--ramp exp|linear] [--eval-every K] [--margin NATS] [--out DIR]
[--emit run|commands|slurm] [--only RUN] [--print-config] [--config FILE] [key=value]`, and
`keel maxlr collect DIR [--margin NATS] [--fixed-lr X] [--pairs A:B,...]`

The paper's maximum tolerable learning rate (Table 1, Section 5.1), judged on the model, not on a batch. The
learning rate ramps over the whole run (`--ramp exp`, the default: geometrically from --start-lr to --peak-lr,
the same number of steps per decade; `--ramp linear`: from 0) while a fixed held-out set (trainer.val_batches
validation batches) is scored every --eval-every steps. The stability monitor (keel.callbacks.stability, with
callbacks.stability.signal=val) ends a run when that held-out loss fails: it stays more than spike_margin above
its best for spike_patience steps (a spike), or does not improve for stagnation_window steps (stagnation); a
non-finite loss or gradient fails at once. The run's max tolerable LR is the LR at the last held-out evaluation
before the failure began - the onset, to the evaluations' resolution; the LR at detection is reported too.

Models learn before they are judged: stagnation counts only once the held-out loss has been --margin nats below
the unigram loss of the same held-out batches (a model knowing only token frequencies; set per run as
callbacks.stability.stagnation_below), and a max LR counts only if the model had got that far below by then
(its best held-out loss up to the max LR's evaluation). A run that fails before (a spike or a non-finite step), or never gets there, is "not resolved", not
a max LR; one that reaches the peak unfailed tolerates >= peak.

Grid: schemes x depths x seeds (x alphas for keel; each --variant is one more row: a name and overrides, e.g.
--variant noinner=model.scheme=keel,model.keel_inner_norm=false). Runs go to DIR/<row>-d<depth>-s<seed>;
rerunning the command skips finished runs and resumes interrupted ones (resume=auto, a checkpoint every
--checkpoint-every steps), so a long grid can be stopped and continued at will; `keel maxlr collect DIR` (and
`keel sweep collect DIR`) tabulates whatever has finished. --emit commands|slurm writes one `keel maxlr --only RUN`
per run (DIR/commands.sh, or a SLURM array DIR/sweep.sbatch with --sbatch options): each task runs this same
protocol in-process, so a probe's intended failure is a result, not a failed job.

The CPU miniature (16 blocks of width 64, 4 heads, 128-token sequences, 8 sequences per step, one thread) applies
only when no model group or model.* key is given: `keel maxlr model=paper_d64 trainer=gpu` runs the paper's
model. callbacks.stability.* (but stagnation_below, set from --margin) and trainer.val_batches override the
protocol's criterion settings. The ramp's defaults were calibrated on the miniature (docs/experiments.md):
calibrate --start-lr, --peak-lr and --steps again at another scale.

Writes DIR/maxlr.csv (a row per run), DIR/maxlr.md (per scheme and depth: median and range of the max LR over
seeds, failure kinds, resolved count, held-out loss at a fixed LR; sign tests between scheme pairs), and plots:
maxlr.png (held-out loss against LR, a line per run) and maxlr_seeds.png (each seed's max LR per scheme).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from keel.callbacks._logging import finished_step
from keel.config import load_config, to_yaml
from keel.experiments.common import (
    comma_list,
    load_run_config,
    markdown_table,
    pyplot,
    resolve_alpha,
    run_row,
    slug,
    train_run,
    unigram_loss,
    write_table,
)
from keel.errors import ConfigError
from keel.experiments.sweep import MANIFEST, Run, slurm_script
from keel.model import PAPER_SCHEMES

DEFAULT_PAIRS = (("keel", "preln"), ("preln", "postln"))
# The CPU miniature, only when no model group or model.* key is given (docs/experiments.md has its cost).
MINIATURE = [
    "model.width=64",
    "model.n_heads=4",
    "model.seq_len=128",
    "trainer.micro_batch_size=8",
    "trainer.threads=1",  # at this width a second thread gains little on an idle CPU and loses much on a shared one
]
MINIATURE_DEPTH = 16
# When a probe stops (before the user's overrides, so callbacks.stability.* and trainer.val_batches tune it): the
# held-out loss on 8 fixed batches, 1 nat above its best and above the unigram loss (spike_floor, set per run),
# past the next evaluation; or a non-finite step. `collect` judges the recorded curve with the report's criterion,
# which is never looser, so stopping here loses nothing it needs.
CRITERION = [
    "callbacks.stability.signal=val",
    "callbacks.stability.spike_margin=1.0",
    "callbacks.stability.spike_patience=40",
    "callbacks.stability.on_nonfinite=stop",
    "trainer.val_batches=8",
    # only what the protocol needs: no in-loop evaluation or per-layer diagnostics
    "eval.enabled=false",
    "callbacks.grad_norms.enabled=false",
    "callbacks.layer_importance.enabled=false",
    "callbacks.throughput.enabled=false",
]
LOSS_LR = "loss_lr.csv"
COST = "maxlr_time.json"  # wall and CPU seconds of the run (of its last session, when resumed)


class LossByLR(Callback):
    """Every optimizer step's (step, lr, training loss), written to <run.dir>/loss_lr.csv."""

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
        if trainer.is_global_zero and self.rows:  # appended: a resumed run continues its file
            new = not self.path.exists()
            with open(self.path, "a", newline="") as f:
                csv.writer(f).writerows([("step", "lr", "loss")] * new + self.rows)


# ------------------------------------------------------------------------------------------------------ grid


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, overrides = text.partition("=")
    items = [item for item in overrides.split(",") if item]
    if not sep or not name or not items or not all("=" in item for item in items):
        raise ConfigError(f"--variant {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE...], "
                          "e.g. noinner=model.scheme=keel,model.keel_inner_norm=false")
    return slug(name), items


def uses_miniature(overrides: list[str]) -> bool:
    return not any(item.partition("=")[0] == "model" or item.startswith("model.") for item in overrides)


def build_grid(args: argparse.Namespace) -> list[Run]:
    """One Run per (depth, seed, row); rows are the schemes (keel once per alpha) and the variants."""
    depths = args.depths or [MINIATURE_DEPTH if uses_miniature(args.overrides)
                             else load_config(args.config, args.overrides).model.depth]
    rows: list[tuple[str, dict, list[str]]] = []
    for scheme in args.schemes:
        for alpha in (args.alphas if scheme == "keel" and args.alphas else [None]):
            name = scheme + (f"-a{slug(alpha)}" if alpha is not None else "")
            rows.append((name, {"scheme": scheme, **({"alpha": alpha} if alpha is not None else {})},
                         [f"model.scheme={scheme}"]))
    rows += [(name, {"variant": name}, overrides) for name, overrides in map(parse_variant, args.variants)]
    runs = []
    for depth in depths:  # seed before row: an interrupted grid leaves whole seeds, every row compared
        for seed in args.seeds:
            for name, axes, overrides in rows:
                run_overrides = [*overrides, f"model.depth={depth}", f"run.seed={seed}"]
                if "alpha" in axes:
                    run_overrides.append(f"model.keel_alpha={resolve_alpha(axes['alpha'], 2 * depth)!r}")
                runs.append(Run(f"{name}-d{depth}-s{seed}", {"row": name, **axes, "depth": str(depth), "seed": str(seed)},
                                run_overrides))
    if len({run.name for run in runs}) < len(runs):
        raise ConfigError("keel maxlr: two runs of the grid have the same name (a variant named like a scheme?)")
    return runs


def protocol(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The overrides that make a run a max-LR probe; they come last, so nothing else can undo them."""
    if args.ramp == "exp":
        schedule = ["optim.schedule=exp_warmup", f"optim.min_lr_ratio={args.start_lr / args.peak_lr!r}"]
    else:
        schedule = ["optim.schedule=linear_warmup"]
    return [
        f"optim.lr={args.peak_lr}", *schedule, f"optim.warmup_steps={args.steps}",
        f"trainer.max_steps={args.steps}", f"trainer.val_every_n_steps={args.eval_every}",
        f"trainer.checkpoint_every_n_steps={args.checkpoint_every}",
        "callbacks.stability.enabled=true", "callbacks.stability.stop_on_failure=true",
        "callbacks.stability.stagnation_window=0",  # the paper's criterion: divergence only, a plateau is no failure
        f"run.dir={run_dir}", "resume=auto",  # an interrupted probe continues; a finished one is skipped
    ]


def run_configs(args: argparse.Namespace, runs: list[Run], out: Path) -> list:
    base = MINIATURE if uses_miniature(args.overrides) else []
    return [load_config(args.config, [*base, *CRITERION, *args.overrides, *run.overrides,
                                      *protocol(args, out / run.name)]) for run in runs]


def finished(run_dir: Path, max_steps: int) -> bool:
    """A probe is done once it failed (the verdict is kept in stability.json) or ran every step."""
    path = run_dir / "stability.json"
    if not path.is_file():
        return False
    state = json.loads(path.read_text())
    return state["failed"] or state["steps"] >= max_steps


# ---------------------------------------------------------------------------------------------------- collect


def unigram_key(cfg) -> tuple:
    """What the unigram loss of the held-out batches depends on."""
    return cfg.data.dir, cfg.model.seq_len, cfg.trainer.micro_batch_size, cfg.trainer.val_batches


def loss_at_lr(heldout: list, lr: float) -> float | None:
    """Held-out loss at the last evaluation whose LR is <= lr; None when the run stopped before the ramp passed lr."""
    if not heldout or heldout[-1][1] is None or heldout[-1][1] < lr:
        return None
    return next((loss for _, at, loss in reversed(heldout) if at is not None and at <= lr), None)


def probe_row(run_dir: Path, label: str, unigram: float, margin: float, fixed_lr: float) -> dict:
    """run_row plus what the protocol adds: the held-out loss at the max LR, the verdict's resolution and
    the held-out loss at fixed_lr."""
    row = {"row": label, **run_row(run_dir)}
    if (run_dir / COST).is_file():
        row |= json.loads((run_dir / COST).read_text())
    state = json.loads((run_dir / "stability.json").read_text())
    heldout = state.get("heldout", [])
    last = (state["step"] - 1 if state["step"] is not None else -1) if row["failed"] else math.inf
    judged = [loss for step, _, loss in heldout if step <= last]  # the evaluations up to the max LR
    row |= {"detected_step": state.get("detected_step"), "detected_lr": state.get("detected_lr"),
            "heldout_at_max_lr": judged[-1] if judged else None,
            "best_heldout": min(judged, default=None), "unigram_loss": unigram,
            # the model had learned by its max LR: its best held-out loss up to there is margin below unigram
            "resolved": bool(judged) and min(judged) <= unigram - margin,
            f"heldout_at_lr_{fixed_lr:g}": loss_at_lr(heldout, fixed_lr)}
    return row


def max_lr_value(row: dict) -> float | None:
    """The number compared across schemes: the max LR, the peak (a lower bound) for a run that never failed,
    None when not resolved."""
    if not row["resolved"]:
        return None
    return row["max_tolerable_lr"] if row["failed"] else row["max_lr_seen"]


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact binomial p-value of wins vs losses under p = 1/2 (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(0, min(wins, losses) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def compare(rows: list[dict], a: str, b: str, depth: int) -> dict | None:
    by_seed = {(r["row"], r["seed"]): r for r in rows if r["depth"] == depth}
    seeds = sorted({seed for label, seed in by_seed if label == a} & {seed for label, seed in by_seed if label == b})
    if not seeds:
        return None
    wins = losses = ties = unresolved = 0
    for seed in seeds:
        x, y = max_lr_value(by_seed[a, seed]), max_lr_value(by_seed[b, seed])
        if x is None or y is None:
            unresolved += 1
        elif math.isclose(x, y, rel_tol=1e-9) or (not by_seed[a, seed]["failed"] and not by_seed[b, seed]["failed"]):
            ties += 1
        elif x > y:
            wins += 1
        else:
            losses += 1
    return {"depth": depth, "comparison": f"{a} vs {b}", "seeds": len(seeds), "first higher": wins,
            "second higher": losses, "ties": ties, "not resolved": unresolved, "sign test p": sign_test(wins, losses),
            "verdict": f"{a} higher in {wins} of {wins + losses + ties} seeds"
                       + (f" ({unresolved} more not resolved)" if unresolved else "")}


def summarize(rows: list[dict], fixed_lr: float) -> list[dict]:
    table = []
    for label, depth in dict.fromkeys((r["row"], r["depth"]) for r in rows):
        runs = [r for r in rows if (r["row"], r["depth"]) == (label, depth)]
        values = [v for v in map(max_lr_value, runs) if v is not None]
        unfailed = sum(1 for r in runs if r["resolved"] and not r["failed"])
        kinds = [r["failure"] for r in runs if r["failed"]]
        fixed = [r[f"heldout_at_lr_{fixed_lr:g}"] for r in runs if r[f"heldout_at_lr_{fixed_lr:g}"] is not None]
        at_max = [r["heldout_at_max_lr"] for r in runs if r["resolved"]]
        table.append({
            "row": label, "depth": depth, "width": runs[0]["width"], "seeds": len(runs),
            "resolved": sum(r["resolved"] for r in runs),
            "median max LR": statistics.median(values) if values else None,
            "min": min(values) if values else None, "max": max(values) if values else None,
            ">= peak (no failure)": unfailed,
            "failures": ", ".join(f"{kind} {kinds.count(kind)}" for kind in dict.fromkeys(kinds)),
            "median held-out at max LR": statistics.median(at_max) if at_max else None,
            f"median held-out at LR {fixed_lr:g}": statistics.median(fixed) if fixed else None,
        })
    return table


def collect(out: Path, margin: float, fixed_lr: float, pairs: list[tuple[str, str]] | None = None) -> list[dict]:
    """The finished probes of DIR as maxlr.csv, maxlr.md and the plots; a listed run not finished is counted."""
    manifest = json.loads((out / MANIFEST).read_text()) if (out / MANIFEST).is_file() else None
    if manifest is None:
        raise ConfigError(f"keel maxlr collect: {out} has no {MANIFEST} (not a keel maxlr output directory)")
    unigrams: dict[tuple, float] = {}
    rows, pending = [], []
    for run in manifest["runs"]:
        run_dir = out / run["name"]
        if not (run_dir / "stability.json").is_file() or not finished(run_dir, load_run_config(run_dir).trainer.max_steps):
            pending.append(run["name"])
            continue
        cfg = load_run_config(run_dir)
        key = unigram_key(cfg)
        if key not in unigrams:
            unigrams[key] = unigram_loss(cfg)
        rows.append(probe_row(run_dir, run["axes"]["row"], unigrams[key], margin, fixed_lr))
    if not rows:
        raise ConfigError(f"keel maxlr collect: no finished run in {out} yet ({len(pending)} listed)")
    write_table(rows, out / "maxlr.csv")
    summary = summarize(rows, fixed_lr)
    labels = list(dict.fromkeys(r["row"] for r in rows))
    pairs = pairs if pairs is not None else [p for p in DEFAULT_PAIRS if p[0] in labels and p[1] in labels]
    tests = [t for depth in dict.fromkeys(r["depth"] for r in rows) for a, b in pairs
             if (t := compare(rows, a, b, depth)) is not None]
    columns = ["run", "failure", "onset_step", "max_tolerable_lr", "detected_step", "detected_lr",
               "heldout_at_max_lr", "best_heldout", f"heldout_at_lr_{fixed_lr:g}", "resolved", "steps", "cpu_s"]
    text = [f"# Max tolerable LR: {manifest.get('protocol', '')}", "",
            f"Unigram loss of the held-out batches: {', '.join(f'{u:.3f}' for u in unigrams.values())}; a max LR "
            f"is resolved when the best held-out loss up to it is <= unigram - {margin:g}. {len(rows)} runs finished"
            + (f", {len(pending)} not (yet): {', '.join(pending)}" if pending else "") + "."
            + (f" CPU time of the finished runs: {sum(r['cpu_s'] for r in rows if 'cpu_s' in r) / 60:.1f} min "
               f"({sum('cpu_s' in r for r in rows)} runs timed)." if any("cpu_s" in r for r in rows) else ""), "",
            markdown_table(summary, list(summary[0])), ""]
    if tests:
        text += ["Sign tests (max LR per seed; a run with no failure counts as the peak; ties and unresolved "
                 "seeds are left out of the test):", "", markdown_table(tests, list(dict.fromkeys(
                     k for t in tests for k in t))), ""]
    text += ["Runs:", "", markdown_table(rows, columns), ""]
    (out / "maxlr.md").write_text("\n".join(text))
    plot(rows, out, unigrams, margin)
    return rows


def plot(rows: list[dict], out: Path, unigrams: dict, margin: float) -> None:
    """maxlr.png: held-out loss against LR, a panel per depth, a colour per row (scheme or variant), a line per
    seed, the max LR dotted; maxlr_seeds.png: each seed's max LR per row."""
    plt = pyplot()
    labels = list(dict.fromkeys(r["row"] for r in rows))
    colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
    depths = list(dict.fromkeys(r["depth"] for r in rows))
    fig, axes = plt.subplots(1, len(depths), figsize=(6.5 * len(depths), 4.5), squeeze=False)
    for ax, depth in zip(axes[0], depths):
        seen = set()
        for r in (r for r in rows if r["depth"] == depth):
            heldout = json.loads((out / r["run"] / "stability.json").read_text()).get("heldout", [])
            points = [(lr, loss) for _, lr, loss in heldout if lr and math.isfinite(loss)]
            if not points:  # failed before its first evaluation
                continue
            label = r["row"] if r["row"] not in seen else None
            seen.add(r["row"])
            ax.plot([p[0] for p in points], [p[1] for p in points], color=colors[r["row"]], linewidth=1, alpha=0.7,
                    label=label)
            if r["resolved"] and r["failed"]:
                ax.plot([r["max_tolerable_lr"]], [r["heldout_at_max_lr"]], "o", color=colors[r["row"]], markersize=4)
        for unigram in unigrams.values():
            ax.axhline(unigram, color="grey", linewidth=1)
            ax.axhline(unigram - margin, color="grey", linewidth=1, linestyle="--")
        ax.set_ylim(top=max(unigrams.values()) + 1.5)
        if ax.lines:
            ax.set_xscale("log")
        ax.set_xlabel("learning rate (ramp)")
        ax.set_ylabel("held-out loss")
        ax.set_title(f"depth {depth} (width {rows[0]['width'] if len(depths) == 1 else next(r['width'] for r in rows if r['depth'] == depth)})"
                     f": dot = max tolerable LR; grey = unigram loss, dashed = -{margin:g} nat", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "maxlr.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(labels) * len(depths)), 4))
    keys = list(dict.fromkeys((r["row"], r["depth"]) for r in rows))
    for i, (label, depth) in enumerate(keys):
        for r in (r for r in rows if (r["row"], r["depth"]) == (label, depth)):
            value = max_lr_value(r)
            marker = "x" if value is None else "o" if r["failed"] else "^"
            shown = value if value is not None else (r["max_tolerable_lr"] or r["max_lr_seen"])
            if shown:  # a run that failed at step 0 has no LR to show
                ax.plot([i], [shown], marker, color=colors[label], alpha=0.8)
    ax.set_xticks(range(len(keys)), [f"{label}\nd{depth}" for label, depth in keys], fontsize=7)
    if ax.lines:
        ax.set_yscale("log")
    ax.set_ylabel("max tolerable LR")
    ax.set_title(f"{out.name}: max LR per seed (o: failure onset; ^: no failure up to the peak; x: not resolved)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "maxlr_seeds.png", dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------ main


def collect_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="keel maxlr collect", description="Tabulate a keel maxlr directory.")
    parser.add_argument("dir")
    parser.add_argument("--margin", type=float, default=0.5, help="nats below the unigram loss for a resolved max LR")
    parser.add_argument("--fixed-lr", type=float, default=0.01, help="report the held-out loss at this LR")
    parser.add_argument("--pairs", type=comma_list(str), default=None, help="A:B,... rows to sign-test")
    args = parser.parse_args(argv)
    pairs = None if args.pairs is None else [tuple(p.split(":", 1)) for p in args.pairs]
    if pairs is not None and any(len(p) != 2 for p in pairs):
        raise ConfigError(f"--pairs {args.pairs}: expected A:B,C:D (row names as in maxlr.md)")
    out = Path(args.dir)
    rows = collect(out, args.margin, args.fixed_lr, pairs)
    print((out / "maxlr.md").read_text())
    print(f"keel maxlr collect: {len(rows)} runs -> {out}/maxlr.csv, maxlr.md, plots")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["collect"]:
        return collect_main(argv[1:])
    parser = argparse.ArgumentParser(prog="keel maxlr", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", type=comma_list(str), default=list(PAPER_SCHEMES),
                        help="comma-separated (default: Keel and the paper's five baselines)")
    parser.add_argument("--depths", type=comma_list(int), default=[],
                        help=f"blocks, comma-separated (default: {MINIATURE_DEPTH} for the miniature, else the model's)")
    parser.add_argument("--seeds", type=comma_list(int), default=[1337], help="run.seed values: init and data order")
    parser.add_argument("--alphas", type=comma_list(str), default=[], help="Keel alphas: numbers or expressions in L")
    parser.add_argument("--variant", dest="variants", action="append", default=[],
                        help="NAME=KEY=VALUE[,KEY=VALUE...]: one more row (repeatable)")
    parser.add_argument("--peak-lr", type=float, default=3.0, help="where the ramp ends")
    parser.add_argument("--start-lr", type=float, default=1e-3, help="where the exponential ramp starts")
    parser.add_argument("--ramp", choices=("exp", "linear"), default="exp")
    parser.add_argument("--steps", type=int, default=560, help="steps of the ramp (= the whole run)")
    parser.add_argument("--eval-every", type=int, default=20, help="steps between held-out evaluations")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (resume)")
    parser.add_argument("--margin", type=float, default=0.5,
                        help="nats below the unigram loss: stagnation is judged, and a max LR resolved, only there")
    parser.add_argument("--fixed-lr", type=float, default=0.01, help="report the held-out loss at this LR")
    parser.add_argument("--out", default="runs/maxlr")
    parser.add_argument("--emit", choices=("run", "commands", "slurm"), default="run")
    parser.add_argument("--sbatch", action="append", default=[], help="an extra #SBATCH option (repeatable)")
    parser.add_argument("--only", action="append", default=[], help="run only this run of the grid (repeatable)")
    parser.add_argument("--print-config", action="store_true", help="print each run's resolved config and exit")
    parser.add_argument("--config", help="YAML merged over conf/config.yaml")
    parser.add_argument("overrides", nargs="*", help="group=choice or key.path=value, applied over the miniature")
    args = parser.parse_intermixed_args(argv)  # options may follow overrides (make paper ARGS=...)
    if not 0 < args.start_lr < args.peak_lr:
        raise ConfigError(f"--start-lr {args.start_lr}: must be > 0 and below --peak-lr {args.peak_lr}")
    for key in ("steps", "eval_every", "checkpoint_every"):
        if getattr(args, key) < 1:
            raise ConfigError(f"--{key.replace('_', '-')}: must be >= 1")
    if stagnation := [item for item in args.overrides if item.startswith("callbacks.stability.stagnation")]:
        raise ConfigError(f"{stagnation[0]}: keel maxlr judges divergence only (the paper's criterion: a model "
                          "that stops improving has not failed); drop the override")
    out = Path(args.out)
    runs = build_grid(args)
    if unknown := [name for name in args.only if name not in {run.name for run in runs}]:
        raise ConfigError(f"--only {', '.join(unknown)}: not in the grid ({', '.join(run.name for run in runs)})")
    configs = run_configs(args, runs, out)  # every config is checked before the first run starts
    if args.print_config:
        for run, cfg in zip(runs, configs):
            if not args.only or run.name in args.only:
                print(f"# keel maxlr run {run.name}\n{to_yaml(cfg)}", end="")
        return 0
    ramp = (f"{args.start_lr:g} -> {args.peak_lr:g} geometrically" if args.ramp == "exp"
            else f"0 -> {args.peak_lr:g} linearly")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).write_text(json.dumps({
        "protocol": f"LR {ramp} over {args.steps} steps, held-out loss every {args.eval_every} steps",
        "peak_lr": args.peak_lr, "runs": [asdict(run) for run in runs]}, indent=1) + "\n")
    if args.emit != "run":
        commands = [shlex.join(["keel", "maxlr", *grid_argv(args), "--only", run.name]) for run in runs]
        path = out / ("commands.sh" if args.emit == "commands" else "sweep.sbatch")
        path.write_text("".join(c + "\n" for c in commands) if args.emit == "commands"
                        else slurm_script(commands, out, args.sbatch))
        print(f"keel maxlr: {len(runs)} runs -> {path}; afterwards: keel maxlr collect {out}")
        return 0
    unigrams: dict[tuple, float] = {}
    todo = [(run, cfg) for run, cfg in zip(runs, configs) if not args.only or run.name in args.only]
    for i, (run, cfg) in enumerate(todo, 1):
        run_dir = Path(cfg.run.dir)
        if finished(run_dir, cfg.trainer.max_steps):
            print(f"keel maxlr: {i}/{len(todo)} {run.name}: finished before, skipped", flush=True)
            continue
        cpu_start = time.process_time()
        key = unigram_key(cfg)
        if key not in unigrams:
            unigrams[key] = unigram_loss(cfg)
        # a probe goes on until it has lost what it learned beyond token frequencies (or its best + 1 nat)
        cfg.callbacks.stability.spike_floor = unigrams[key]
        wall_s = train_run(cfg, [LossByLR(cfg.run.dir)])
        cpu_s = time.process_time() - cpu_start  # this process's CPU, all threads: the cost on a shared machine
        (run_dir / COST).write_text(json.dumps({"wall_s": round(wall_s, 1), "cpu_s": round(cpu_s, 1)}) + "\n")
        state = json.loads((run_dir / "stability.json").read_text())
        verdict = (f"{state['kind']} from step {state['step']}, max LR {state['max_tolerable_lr']}" if state["failed"]
                   else f"no failure up to {state['max_lr_seen']:.3g}")
        print(f"keel maxlr: {i}/{len(todo)} {run.name}: {verdict} ({state['steps']} steps, {wall_s:.0f} s wall, "
              f"{cpu_s:.0f} s CPU)", flush=True)
    if not args.only:
        collect(out, args.margin, args.fixed_lr)
        print(f"\n{(out / 'maxlr.md').read_text()}\nkeel maxlr: wrote {out}/maxlr.csv, maxlr.md, plots")
    return 0


def grid_argv(args: argparse.Namespace) -> list[str]:
    """The options and overrides that define this grid and protocol, as `keel maxlr` arguments (for the emitted
    per-run commands: each rebuilds the same grid and runs its --only run)."""
    argv = ["--schemes", ",".join(args.schemes), "--seeds", ",".join(map(str, args.seeds))]
    argv += ["--depths", ",".join(map(str, args.depths))] if args.depths else []
    argv += ["--alphas", ",".join(args.alphas)] if args.alphas else []
    argv += [f"--variant={variant}" for variant in args.variants]
    for key in ("peak_lr", "start_lr", "ramp", "steps", "eval_every", "checkpoint_every", "margin", "fixed_lr", "out",
                "config"):
        if getattr(args, key) is not None:
            argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return [*argv, *args.overrides]
