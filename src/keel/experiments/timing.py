"""How long a grid's run took: its CPU and wall seconds over every session, carried in its checkpoints so that a
resumed run adds to what the interrupted one spent, written beside its records once it ends (keel.experiments.records:
MAXLR_TIME, SWEEP_TIME). Its own module: it needs Lightning, the reports that read the files do not."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from keel.config import Config


class RunTime(Callback):
    """The CPU and wall seconds of a run's earlier sessions (from its checkpoint) plus this one's."""

    def __init__(self) -> None:
        self.earlier = {"cpu_s": 0.0, "wall_s": 0.0}
        self._cpu, self._wall = time.process_time(), time.perf_counter()  # this session's start

    @property
    def state_key(self) -> str:
        return "ProbeCost"  # the key the probes' checkpoints hold it under since before sweeps were timed too

    def state_dict(self) -> dict:
        return {
            "cpu_s": self.earlier["cpu_s"] + time.process_time() - self._cpu,
            "wall_s": self.earlier["wall_s"] + time.perf_counter() - self._wall,
        }

    def load_state_dict(self, state: dict) -> None:
        self.earlier = {"cpu_s": float(state["cpu_s"]), "wall_s": float(state["wall_s"])}


def train_timed(cfg: Config, record: Path, callbacks: Sequence = ()) -> dict[str, float]:
    """Train cfg's run, then write its total time (this process's CPU, all threads: the cost on a shared machine;
    every session) to `record` and return it."""
    from keel.training import train  # lightning: imported only by the commands that train

    timer = RunTime()
    train(cfg, [*callbacks, timer])
    total = {key: round(value, 1) for key, value in timer.state_dict().items()}
    record.write_text(json.dumps(total) + "\n")
    return total
