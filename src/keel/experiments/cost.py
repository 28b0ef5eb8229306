"""What a grid's run cost: its CPU and wall seconds over every session, carried in its checkpoints so that a resumed
run adds to what the interrupted one spent, written beside its records once it ends (`keel maxlr`:
maxlr_time.json, `keel sweep`: sweep_time.json). Its own module: it needs Lightning, the reports that read the
files do not."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

from lightning.pytorch.callbacks import Callback

from keel.config import Config
from keel.experiments.common import train_run


class RunCost(Callback):
    """The CPU and wall seconds of a run's earlier sessions (from its checkpoint) plus this one's."""

    def __init__(self) -> None:
        self.earlier = {"cpu_s": 0.0, "wall_s": 0.0}
        self._cpu, self._wall = time.process_time(), time.perf_counter()  # this session's start

    @property
    def state_key(self) -> str:
        return "ProbeCost"  # the key the probes' checkpoints hold it under since before sweeps were timed too

    def state_dict(self) -> dict:
        return {"cpu_s": self.earlier["cpu_s"] + time.process_time() - self._cpu,
                "wall_s": self.earlier["wall_s"] + time.perf_counter() - self._wall}

    def load_state_dict(self, state: dict) -> None:
        self.earlier = {"cpu_s": float(state["cpu_s"]), "wall_s": float(state["wall_s"])}


def train_timed(cfg: Config, record: Path, callbacks: Sequence = ()) -> dict[str, float]:
    """Train cfg's run, then write its total cost (this process's CPU, all threads: the cost on a shared machine;
    every session) to `record` and return it."""
    cost = RunCost()
    train_run(cfg, [*callbacks, cost])
    total = {key: round(value, 1) for key, value in cost.state_dict().items()}
    record.write_text(json.dumps(total) + "\n")
    return total
