"""How long a grid's run took and what made it: its CPU and wall seconds over every session, and each session's code
and machine (keel.provenance), carried in its checkpoints so that a resumed run adds to what the interrupted one
spent, written beside its records once it ends (keel.experiments.records: MAXLR_TIME, SWEEP_TIME). Its own module: it
needs Lightning, the reports that read the files do not."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from keel.config import Config
from keel.provenance import made_by


class RunTime(Callback):
    """The CPU and wall seconds of a run's earlier sessions (from its checkpoint) plus this one's, and what made
    them: each distinct provenance over the sessions, in order (more than one: the run was resumed on other code, or
    on another machine)."""

    def __init__(self) -> None:
        self.earlier = {"cpu_s": 0.0, "wall_s": 0.0}
        self.earlier_made_by: list[dict] = []
        self.session: dict | None = None  # this session's provenance, once fit starts
        self._cpu, self._wall = time.process_time(), time.perf_counter()  # this session's start

    def on_fit_start(self, trainer, pl_module) -> None:
        self.session = made_by(torch.get_num_threads())  # the threads the trainer set

    @property
    def made_by(self) -> list[dict]:
        sessions = self.earlier_made_by
        return sessions + [self.session] if self.session is not None and self.session not in sessions else sessions

    @property
    def state_key(self) -> str:
        return "ProbeCost"  # the key the probes' checkpoints hold it under since before sweeps were timed too

    def state_dict(self) -> dict:
        return {
            "cpu_s": self.earlier["cpu_s"] + time.process_time() - self._cpu,
            "wall_s": self.earlier["wall_s"] + time.perf_counter() - self._wall,
            "made_by": self.made_by,
        }

    def load_state_dict(self, state: dict) -> None:
        self.earlier = {"cpu_s": float(state["cpu_s"]), "wall_s": float(state["wall_s"])}
        self.earlier_made_by = list(state.get("made_by", []))  # none in checkpoints written before runs recorded it


def train_timed(cfg: Config, record: Path, callbacks: Sequence = ()) -> dict[str, float]:
    """Train cfg's run, then write its total time (this process's CPU, all threads: the cost on a shared machine;
    every session) and what made it to `record` and return it."""
    from keel.training import train  # lightning: imported only by the commands that train

    timer = RunTime()
    train(cfg, [*callbacks, timer])
    state = timer.state_dict()
    total = {"cpu_s": round(state["cpu_s"], 1), "wall_s": round(state["wall_s"], 1), "made_by": state["made_by"]}
    record.write_text(json.dumps(total) + "\n")
    return total
