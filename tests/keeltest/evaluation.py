"""The evaluation tests' model, their short run's settings and the bundled standard tasks' names."""

from __future__ import annotations

from pathlib import Path

from keel.config import load_config
from keeltest import QUIET_TRAINER

EVAL_MODEL = ["model.depth=2", "model.width=32", "model.n_heads=2", "model.seq_len=64", "model.vocab_size=512"]


STANDARD_TASKS = [
    "keel_arc_easy",
    "keel_arc_challenge",
    "keel_boolq",
    "keel_gsm8k",
    "keel_hellaswag",
    "keel_lambada_openai",
    "keel_openbookqa",
    "keel_piqa",
    "keel_winogrande",
]


def config(eval_data: str, run_dir: Path, *extra: str):
    return load_config(
        overrides=[*EVAL_MODEL, *QUIET_TRAINER, f"data.dir={eval_data}", f"run.dir={run_dir}", "resume=null", *extra]
    )


SHORT_RUN = [
    "trainer.max_steps=30",
    "trainer.val_every_n_steps=10",
    "trainer.val_batches=2",
    "trainer.checkpoint_every_n_steps=30",
    "eval.every_n_steps=10",
    "eval.limit=16",
]
