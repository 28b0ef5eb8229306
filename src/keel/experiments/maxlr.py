"""`keel maxlr`: the paper's maximum tolerable learning rate (Table 1, Section 5.1), probed on the model.

Each probe ramps the LR over the whole run (`--ramp exp`: geometric from --start-lr to --peak-lr; `linear`: from 0)
while a fixed held-out set is scored every --eval-every steps, and stops at a non-finite step or once the held-out
loss has diverged (the stability monitor's spike criterion, capped at the unigram loss); a plateau is no failure.
`keel maxlr collect DIR` (keel.experiments.maxlr_report) judges the recorded curves.

Grid: schemes x depths x seeds (x --alphas for keel, one more row per --variant), a run per cell in
DIR/<row>-d<depth>-s<seed>; rerunning skips finished runs and resumes interrupted ones; --emit commands|slurm
writes one `keel maxlr --only RUN` per run. The CPU miniature applies unless a model group or model.* key is given.
The protocol, its defaults and which settings override it: docs/experiments.md.
"""

from __future__ import annotations

import argparse
import csv
import shlex
from dataclasses import asdict
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from keel.artifacts import read_stability
from keel.cadence import finished_step
from keel.cli_args import OneLineErrorParser, comma_list
from keel.config import Config, load_config, to_yaml
from keel.config.model import PAPER_SCHEMES, scheme_named
from keel.errors import ConfigError
from keel.experiments.axes import resolve_alpha, slug
from keel.experiments.launch import GridCell, slurm_script
from keel.experiments.maxlr_report import MARGIN, collect, unigram_key, unigram_loss
from keel.experiments.maxlr_report import main as report_main
from keel.experiments.records import (
    COMMANDS,
    LOSS_LR,
    MAXLR_SUMMARY,
    MAXLR_TIME,
    SBATCH_SCRIPT,
    already_trained,
    write_manifest,
)
from keel.experiments.timing import train_timed
from keel.schedule import lr_factor

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
# report's criterion, on the held-out loss of 8 fixed batches - 1 nat above its best, or above the unigram loss
# once 0.5 nat below it (spike_ceiling, set per run), past the next evaluation; or a non-finite step.
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
EXP_START_LR = 1e-3


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
        raise ConfigError(
            f"--variant {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE...], "
            "e.g. noinner=model.scheme=keel,model.keel_inner_norm=false"
        )
    return slug(name), items


# model.* keys that leave the model's shape alone: given, the miniature still applies
# (make paper ARGS=model.init=normal)
NOT_SHAPE = ("model.init", "model.init_std")


def uses_miniature(overrides: list[str]) -> bool:
    keys = [item.partition("=")[0] for item in overrides]
    return not any(key == "model" or (key.startswith("model.") and key not in NOT_SHAPE) for key in keys)


def build_grid(args: argparse.Namespace) -> list[GridCell]:
    """One GridCell per (depth, seed, row); rows are the schemes (keel once per alpha) and the variants."""
    depths = args.depths or [
        MINIATURE_DEPTH if uses_miniature(args.overrides) else load_config(args.config, args.overrides).model.depth
    ]
    rows: list[tuple[str, dict, list[str]]] = []
    for scheme in args.schemes:
        alpha_field = scheme_named(scheme).alpha_field
        for alpha in args.alphas if alpha_field and args.alphas else [None]:
            name = scheme + (f"-a{slug(alpha)}" if alpha is not None else "")
            rows.append(
                (
                    name,
                    {"scheme": scheme, **({"alpha": alpha} if alpha is not None else {})},
                    [f"model.scheme={scheme}"],
                )
            )
    rows += [(name, {"variant": name}, overrides) for name, overrides in map(parse_variant, args.variants)]
    runs = []
    for depth in depths:  # seed before row: an interrupted grid leaves whole seeds, every row compared
        for seed in args.seeds:
            for name, axes, overrides in rows:
                run_overrides = [*overrides, f"model.depth={depth}", f"run.seed={seed}"]
                if "alpha" in axes:
                    field = scheme_named(axes["scheme"]).alpha_field
                    run_overrides.append(f"model.{field}={resolve_alpha(axes['alpha'], n_sublayers=2 * depth)!r}")
                runs.append(
                    GridCell(
                        f"{name}-d{depth}-s{seed}",
                        {"row": name, **axes, "depth": str(depth), "seed": str(seed)},
                        run_overrides,
                    )
                )
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
        f"optim.lr={args.peak_lr}",
        *schedule,
        f"optim.warmup_steps={args.steps}",
        f"trainer.max_steps={args.steps}",
        f"trainer.val_every_n_steps={args.eval_every}",
        f"trainer.checkpoint_every_n_steps={args.checkpoint_every}",
        "callbacks.stability.enabled=true",
        "callbacks.stability.stop_on_failure=true",
        "callbacks.stability.rewind=false",  # the failure is the measurement: a probe never rewinds past it
        "callbacks.stability.stagnation_window=0",  # the paper's criterion: divergence only, a plateau is no failure
        f"run.dir={run_dir}",
        "resume=auto",  # an interrupted probe continues; a finished one is skipped
    ]


def step_reaching(cfg: Config, lr: float) -> int:
    """The first step of the probe's ramp whose LR is at least lr (an LR it reaches: checked at start-up)."""
    steps = cfg.trainer.max_steps
    return next(step for step in range(steps) if cfg.optim.lr * lr_factor(step, cfg.optim, steps) >= lr * (1 - 1e-9))


def run_configs(args: argparse.Namespace, runs: list[GridCell], out: Path) -> list:
    base = MINIATURE if uses_miniature(args.overrides) else []
    return [
        load_config(args.config, [*base, *CRITERION, *args.overrides, *run.overrides, *protocol(args, out / run.name)])
        for run in runs
    ]


# ------------------------------------------------------------------------------------------------------ main


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="keel maxlr", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--schemes",
        type=comma_list(str),
        default=list(PAPER_SCHEMES),
        help="comma-separated (default: Keel and the paper's five baselines)",
    )
    parser.add_argument(
        "--depths",
        type=comma_list(int),
        default=[],
        help=f"blocks, comma-separated (default: {MINIATURE_DEPTH} for the miniature, else the model's)",
    )
    parser.add_argument("--seeds", type=comma_list(int), default=[1337], help="run.seed values: init and data order")
    parser.add_argument("--alphas", type=comma_list(str), default=[], help="Keel alphas: numbers or expressions in L")
    parser.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=[],
        help="NAME=KEY=VALUE[,KEY=VALUE...]: one more row (repeatable)",
    )
    parser.add_argument("--peak-lr", type=float, default=3.0, help="where the ramp ends")
    parser.add_argument(
        "--start-lr",
        type=float,
        help=f"where the exponential ramp starts (default {EXP_START_LR:g}; a linear ramp starts at 0)",
    )
    parser.add_argument("--ramp", choices=("exp", "linear"), default="exp")
    parser.add_argument("--steps", type=int, default=560, help="steps of the ramp (= the whole run)")
    parser.add_argument("--eval-every", type=int, default=20, help="steps between held-out evaluations")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (resume)")
    parser.add_argument(
        "--learn-by-lr",
        type=float,
        help="stop a probe that has not learned (held-out loss --margin below the unigram loss) by "
        "the step the ramp reaches this LR: it is never judged, so the rest of its ramp is spent "
        "for nothing (default: climb the whole ramp)",
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=MARGIN,
        help="nats below the unigram loss that count as learned (the report's criterion)",
    )
    parser.add_argument("--out", default="runs/maxlr")
    parser.add_argument("--emit", choices=("run", "commands", "slurm"), default="run")
    parser.add_argument("--sbatch", action="append", default=[], help="an extra #SBATCH option (repeatable)")
    parser.add_argument("--only", action="append", default=[], help="run only this run of the grid (repeatable)")
    parser.add_argument("--print-config", action="store_true", help="print each run's resolved config and exit")
    parser.add_argument("--config", help="YAML merged over conf/config.yaml")
    parser.add_argument("overrides", nargs="*", help="group=choice or key.path=value, applied over the miniature")
    return parser


def check_protocol(args: argparse.Namespace) -> None:
    """Refuse a ramp, an evaluation cadence or an override the protocol cannot run; fills in --start-lr's default."""
    if not args.peak_lr > 0:
        raise ConfigError(f"--peak-lr {args.peak_lr}: must be > 0")
    if args.ramp == "linear" and args.start_lr is not None:
        raise ConfigError(
            f"--start-lr {args.start_lr}: a linear ramp starts at 0; drop --start-lr (it sets where --ramp exp starts)"
        )
    if args.ramp == "exp":
        args.start_lr = EXP_START_LR if args.start_lr is None else args.start_lr
        if not 0 < args.start_lr < args.peak_lr:
            raise ConfigError(f"--start-lr {args.start_lr}: must be > 0 and below --peak-lr {args.peak_lr}")
    for key in ("steps", "eval_every", "checkpoint_every"):
        if getattr(args, key) < 1:
            raise ConfigError(f"--{key.replace('_', '-')}: must be >= 1")
    if args.steps < args.eval_every:  # no held-out evaluation would ever score the ramp
        raise ConfigError(
            f"--steps {args.steps}: must be at least --eval-every {args.eval_every}, or no held-out loss is measured"
        )
    if stagnation := [item for item in args.overrides if item.startswith("callbacks.stability.stagnation")]:
        raise ConfigError(
            f"{stagnation[0]}: keel maxlr judges divergence only (the paper's criterion: a model "
            "that stops improving has not failed); drop the override"
        )
    if args.learn_by_lr is not None and not 0 < args.learn_by_lr <= args.peak_lr:
        raise ConfigError(
            f"--learn-by-lr {args.learn_by_lr}: must be > 0 and at most --peak-lr {args.peak_lr}, an "
            "LR the ramp reaches"
        )


def write_grid_manifest(args: argparse.Namespace, runs: list[GridCell], out: Path) -> None:
    """The grid's MANIFEST: its protocol in words, its peak LR and its runs."""
    ramp = (
        f"{args.start_lr:g} -> {args.peak_lr:g} geometrically"
        if args.ramp == "exp"
        else f"0 -> {args.peak_lr:g} linearly"
    )
    protocol = {
        "protocol": f"LR {ramp} over {args.steps} steps, held-out loss every {args.eval_every} steps"
        + (f", a probe not learned by LR {args.learn_by_lr:g} stopped" if args.learn_by_lr else ""),
        "peak_lr": args.peak_lr,
    }
    if note := write_manifest(out, protocol, [asdict(run) for run in runs]):
        print(f"keel maxlr: {note}", flush=True)


def emit(args: argparse.Namespace, runs: list[GridCell], out: Path) -> None:
    """One `keel maxlr --only RUN` per run, as a script of commands or a SLURM array."""
    commands = [shlex.join(["keel", "maxlr", *grid_argv(args), "--only", run.name]) for run in runs]
    path = out / (COMMANDS if args.emit == "commands" else SBATCH_SCRIPT)
    path.write_text(
        "".join(c + "\n" for c in commands) if args.emit == "commands" else slurm_script(commands, out, args.sbatch)
    )
    print(f"keel maxlr: {len(runs)} runs -> {path}; afterwards: keel maxlr collect {out}")


def probe(cfg: Config, args: argparse.Namespace, unigram: float) -> str:
    """Train one probe under the report's criterion (keel.experiments.maxlr_report: never above the unigram loss
    once learned); what became of it, in words."""
    cfg.callbacks.stability.spike_ceiling = unigram
    cfg.callbacks.stability.spike_ceiling_margin = args.margin
    if args.learn_by_lr is not None:
        cfg.callbacks.stability.learn_by_step = step_reaching(cfg, args.learn_by_lr)
    run_dir = Path(cfg.run.dir)
    total = train_timed(cfg, run_dir / MAXLR_TIME, [LossByLR(cfg.run.dir)])
    state = read_stability(run_dir)
    verdict = (
        f"stopped at step {state['detected_step']} ({state['kind']})"
        if state["failed"]
        else f"ran the ramp to {state['max_lr_seen']:.3g}"
    )
    return f"{verdict} ({state['steps']} steps, {total['wall_s']:.0f} s wall, {total['cpu_s']:.0f} s CPU)"


def run_probes(todo: list[tuple[GridCell, Config]], args: argparse.Namespace) -> None:
    """Train each probe not finished before, the unigram loss measured once per data and batch shape."""
    unigrams: dict[tuple, float] = {}
    for i, (run, cfg) in enumerate(todo, 1):
        if already_trained(Path(cfg.run.dir), cfg):  # probes stop on failure (above)
            print(f"keel maxlr: {i}/{len(todo)} {run.name}: finished before, skipped", flush=True)
            continue
        key = unigram_key(cfg)
        if key not in unigrams:
            unigrams[key] = unigram_loss(cfg)
        print(f"keel maxlr: {i}/{len(todo)} {run.name}: {probe(cfg, args, unigrams[key])}", flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["collect"]:
        return report_main(argv[1:])
    args = build_parser().parse_intermixed_args(argv)  # options may follow overrides (make paper ARGS=...)
    check_protocol(args)
    out = Path(args.out)
    runs = build_grid(args)
    if unknown := [name for name in args.only if name not in {run.name for run in runs}]:
        raise ConfigError(f"--only {', '.join(unknown)}: not in the grid ({', '.join(run.name for run in runs)})")
    configs = run_configs(args, runs, out)  # every config is checked before the first run starts
    selected = [(run, cfg) for run, cfg in zip(runs, configs) if not args.only or run.name in args.only]
    if args.print_config:
        for run, cfg in selected:
            print(f"# keel maxlr run {run.name}\n{to_yaml(cfg)}", end="")
        return 0
    write_grid_manifest(args, runs, out)
    if args.emit != "run":
        emit(args, runs, out)
        return 0
    run_probes(selected, args)
    if not args.only:
        collect(out, args.margin)
        print(f"\n{(out / MAXLR_SUMMARY).read_text()}\nkeel maxlr: wrote {out}/maxlr.csv, maxlr.md, plots")
    return 0


def grid_argv(args: argparse.Namespace) -> list[str]:
    """The options and overrides that define this grid and protocol, as `keel maxlr` arguments (for the emitted
    per-run commands: each rebuilds the same grid and runs its --only run)."""
    argv = ["--schemes", ",".join(args.schemes), "--seeds", ",".join(map(str, args.seeds))]
    argv += ["--depths", ",".join(map(str, args.depths))] if args.depths else []
    argv += ["--alphas", ",".join(args.alphas)] if args.alphas else []
    argv += [f"--variant={variant}" for variant in args.variants]
    for key in (
        "peak_lr",
        "start_lr",
        "ramp",
        "steps",
        "eval_every",
        "checkpoint_every",
        "learn_by_lr",
        "margin",
        "out",
        "config",
    ):
        if getattr(args, key) is not None:
            argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return [*argv, *args.overrides]
