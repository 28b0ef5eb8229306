"""What a run directory holds, by name, and the readers that experiments, `keel compare` and gpu-check share.

config.yaml         the resolved config of the run (keel.rundir)
tb/                 TensorBoard events (trainer.loggers: tensorboard; docs/tensorboard.md)
stability.json      the stability monitor's verdict, and the held-out curve under signal=val
eval_history.json   every in-loop downstream evaluation's scores
logger_runs.json    the W&B / MLflow run ids a resume continues
checkpoints/        last.ckpt and the step-numbered ones
"""

from __future__ import annotations

import json
from pathlib import Path

from keel.errors import ConfigError

CONFIG = "config.yaml"
TENSORBOARD = "tb"
STABILITY = "stability.json"
EVAL_HISTORY = "eval_history.json"
LOGGER_RUNS = "logger_runs.json"


def read_scalars(run_dir: str | Path, tags: list[str] | None = None) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard scalars of a run (every event file; all tags, or those listed that exist): tag ->
    [(step, value)] in step order. A resumed run rewrites the steps after its checkpoint: the last value wins."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not (Path(run_dir) / TENSORBOARD).is_dir():
        return {}
    acc = EventAccumulator(str(Path(run_dir) / TENSORBOARD), size_guidance={"scalars": 0})
    acc.Reload()
    found = acc.Tags()["scalars"]
    return {
        tag: sorted({e.step: e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.wall_time)}.items())
        for tag in (found if tags is None else [t for t in tags if t in found])
    }


def _read_json(path: Path, lost: str) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as err:  # a run killed as it wrote it (on a file system without atomic rename), or edited
        raise ConfigError(f"{path} cannot be read (truncated?): {err}; delete it ({lost}) or re-run that run") from None


def read_stability(run_dir: str | Path) -> dict | None:
    """The run's stability.json, or None when the stability monitor wrote none."""
    return _read_json(Path(run_dir) / STABILITY, "the run's verdict is lost")


def read_eval_history(run_dir: str | Path) -> dict | None:
    """The run's eval_history.json (keel.callbacks.downstream_eval: "tasks" {task: {"metric", "higher_is_better"}},
    "evaluations" [{"step", "val_loss", "wall_s", "scores": {task: {metric: value}}}], "spearman"), or None when
    the in-loop evaluation wrote none."""
    return _read_json(Path(run_dir) / EVAL_HISTORY, "the run's task scores are lost")
