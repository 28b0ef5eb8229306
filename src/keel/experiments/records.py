"""What an experiment run leaves behind, in one place: the name of every file the runners (`keel maxlr`, `keel
sweep`, `keel redundancy`) write beside the run directories' own records (keel.artifacts), and their readers.
Torch-free: `keel paper-run` and `keel paper-report` read them."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from keel.artifacts import CONFIG, read_eval_history, read_scalars, read_stability
from keel.config import Config, from_dict
from keel.config.model import scheme_of
from keel.errors import ConfigError

MANIFEST = "sweep.json"  # a grid's runs and protocol (`keel maxlr` and `keel sweep` alike)
MAXLR_TIME = "maxlr_time.json"  # a probe's wall and CPU seconds over its sessions (keel.experiments.timing)
SWEEP_TIME = "sweep_time.json"  # the same, of a `keel sweep` run
LOSS_LR = "loss_lr.csv"  # a probe's (step, lr, training loss) per optimizer step
COMMANDS = "commands.sh"  # --emit commands: one command per run
SBATCH_SCRIPT = "sweep.sbatch"  # --emit slurm: a SLURM array of them
MAXLR_TABLE, MAXLR_SUMMARY = "maxlr.csv", "maxlr.md"  # `keel maxlr collect`'s
MAXLR_PLOT, MAXLR_SEEDS_PLOT = "maxlr.png", "maxlr_seeds.png"
SWEEP_TABLE, SWEEP_SUMMARY = "sweep.csv", "sweep.md"  # `keel sweep`'s
SWEEP_PLOT = "sweep_{metric}_vs_{axis}.png"  # one per metric and axis that varies
REDUNDANCY_DIR = "redundancy"  # a redundancy grid's directory, under the grid it is over
# `keel redundancy`'s table (a row per checkpoint and removed block), its markdown and plot
REDUNDANCY_TABLE, REDUNDANCY_SUMMARY, REDUNDANCY_PLOT = "redundancy.csv", "redundancy.md", "redundancy.png"
REDUNDANCY = f"{REDUNDANCY_DIR}/{REDUNDANCY_TABLE}"  # a grid's table: a run with rows there is not measured again
REPORT = "report.md"  # `keel paper-report`'s, with its figures
HOLD_PLOT, RATIO_PLOT, TRANSFER_PLOT, DEEP_PLOT = "hold.png", "ratio.png", "transfer.png", "deep1024.png"
LOSS_VS_TASKS_PLOT, LAYER_USE_PLOT = "loss_vs_tasks_{grid}.png", "layer_use_{grid}.png"  # per trained grid
LAYER_PROFILE_PLOT = "layer_profile_{grid}.png"  # per trained grid: Section 8's shallow / deep ratio against LR


def write_manifest(out: Path, protocol: dict[str, Any], runs: list[dict]) -> str | None:
    """Write the grid's MANIFEST: its protocol (what all its runs share) and its runs. A runner given part of a grid
    (a subset of its seeds) adds its runs to a listing of the same protocol, so partial runs into one directory list
    them all; a listing of another protocol is replaced. Returns what the user is to be told: the runs the listing
    keeps beyond this command's, or those a replaced listing drops."""
    path = out / MANIFEST
    before = json.loads(path.read_text()) if path.is_file() else {}
    listed = before.pop("runs", [])
    names, listed_names = {run["name"] for run in runs}, {run["name"] for run in listed}
    others = [run["name"] for run in listed if run["name"] not in names]
    if before == protocol:
        runs = [*listed, *(run for run in runs if run["name"] not in listed_names)]
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**protocol, "runs": runs}, indent=1) + "\n")
    if not others:
        return None
    if before == protocol:
        return (
            f"{path} also lists {len(others)} run(s) of this grid beyond this command's ({', '.join(others)}), "
            "from an earlier command over other seeds or LRs; collect reports them too (delete it to list only these)"
        )
    return (
        f"{path} listed a grid of another protocol; it now lists this one, without {', '.join(others)} "
        "(their directories are left as they are)"
    )


REDUNDANCY_NUMBERS = {
    "depth": int,
    "block": int,
    "val_tokens": int,
    "ppl_base": float,
    "ppl_removed": float,
    "ppl_increase": float,
    "loss_increase": float,
}  # a row's numbers, by column
PROVENANCE_COLUMNS = ("commit", "dirty", "keel", "torch", "threads", "cpu")  # keel.provenance.made_by's keys
REDUNDANCY_COLUMNS = ("checkpoint", "path", "scheme", *REDUNDANCY_NUMBERS, *PROVENANCE_COLUMNS)
# what a row measured (its summary's columns): all a row held before rows said what made them
REDUNDANCY_MEASURED = REDUNDANCY_COLUMNS[: -len(PROVENANCE_COLUMNS)]


def read_redundancy_rows(table: Path) -> list[dict]:
    """The rows of a redundancy.csv, numbers parsed (none if there is no table, or an empty one); a table with
    other columns is refused. A row of a table written before rows carried their provenance has it empty."""
    if not table.is_file():
        return []
    with open(table, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is not None and set(reader.fieldnames) not in (
            set(REDUNDANCY_COLUMNS),
            set(REDUNDANCY_MEASURED),
        ):
            raise ConfigError(
                f"{table} is not a redundancy.csv (columns {', '.join(reader.fieldnames)}; expected "
                f"{', '.join(sorted(REDUNDANCY_COLUMNS))})"
            )
        return [
            dict.fromkeys(PROVENANCE_COLUMNS, "") | {key: REDUNDANCY_NUMBERS.get(key, str)(v) for key, v in row.items()}
            for row in reader
        ]


def read_time_record(run_dir: str | Path) -> dict | None:
    """A grid's run's time record (MAXLR_TIME or SWEEP_TIME: cpu_s, wall_s and, since runs say what made them,
    made_by), or None for a run without one."""
    for name in (MAXLR_TIME, SWEEP_TIME):
        if (Path(run_dir) / name).is_file():
            return json.loads((Path(run_dir) / name).read_text())
    return None


def checkpoint_run(path: str) -> str:
    """The name of the run a checkpoint is of (<grid>/<run>/checkpoints/<file>)."""
    return Path(path).parents[1].name


def _eval_scores(run_dir: Path) -> dict[str, float]:
    """The last in-loop evaluation's primary metric per task, from the downstream-eval callback's history."""
    history = read_eval_history(run_dir)
    if not history or not history.get("evaluations"):
        return {}
    last = history["evaluations"][-1]["scores"]
    return {
        f"eval/{task}/{info['metric']}": last[task][info["metric"]]
        for task, info in history["tasks"].items()
        if task in last and info["metric"] in last[task]
    }


def load_run_config(run_dir: str | Path) -> Config:
    return from_dict(OmegaConf.to_container(OmegaConf.load(Path(run_dir) / CONFIG)))


def finished(run_dir: str | Path, cfg: Config) -> bool:
    """A run (a sweep's or a max-LR probe) is over once its stability monitor recorded every step, or a failure that
    stopped it: told from its records alone, checkpoints gone or not, wherever the run directory now lies."""
    state = read_stability(run_dir)
    return state is not None and (
        state["steps"] >= cfg.trainer.max_steps or (state["failed"] and cfg.callbacks.stability.stop_on_failure)
    )


def already_trained(run_dir: str | Path, cfg: Config) -> bool:
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
    from keel.experiments.axes import non_embedding_params  # the model's parameter count: torch

    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    m = cfg.model
    row: dict[str, Any] = {
        "run": run_dir.name,
        "scheme": m.scheme,
        "depth": m.depth,
        "L": m.n_sublayers,
        "width": m.width,
        "alpha": alpha(m) if (alpha := scheme_of(m).alpha) is not None else None,
        "init": m.init_kind,
        "params_nonemb": non_embedding_params(m),
        "lr": cfg.optim.lr,
        "schedule": cfg.optim.schedule,
        "max_steps": cfg.trainer.max_steps,
        "seed": cfg.run.seed,
    }
    if (s := read_stability(run_dir)) is not None:
        row |= {
            "steps": s["steps"],
            "failed": s["failed"],
            "failure": s["kind"],
            "onset_step": s["step"],
            "max_tolerable_lr": s["max_tolerable_lr"],
            "max_lr_seen": s["max_lr_seen"],
        }
    if val := read_scalars(run_dir, ["val/loss"]).get("val/loss"):
        row |= {"val_step": val[-1][0], "val_loss": val[-1][1]}
    return row | _eval_scores(run_dir)
