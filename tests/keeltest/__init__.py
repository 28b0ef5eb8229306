"""What the tests share besides fixtures (those are in conftest.py): paths, the tiny-model and quiet-trainer
overrides, and helpers. `tests/` is on pytest's pythonpath (pyproject.toml): `from keeltest import ...`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The full benchmark files and corpora beside the repository, where the project's CI has them (or elsewhere)
SHARED_DATA = Path(os.environ.get("KEEL_SHARED_DATA", REPO.parent / "shared" / "data"))

# A model small enough that a CPU step takes milliseconds, deep enough to have a first block and others.
TINY_MODEL = [
    "model.depth=2",
    "model.width=32",
    "model.n_heads=2",
    "model.seq_len=32",
    "model.vocab_size=512",
]
QUIET_TRAINER = [
    "trainer.micro_batch_size=4",
    "trainer.log_every_n_steps=1",
    "trainer.progress_bar=false",
    "trainer.threads=1",
    "trainer.compile=false",  # trainer=cpu compiles by default; tests that are not about compile skip its start-up
]


def shared_data() -> Path:
    """../shared/data (or $KEEL_SHARED_DATA), or skip: users' clones do not have it; CI does."""
    if not SHARED_DATA.is_dir():
        pytest.skip(
            f"shared data not found at {SHARED_DATA} (only the project's CI machine has it; "
            "KEEL_SHARED_DATA=DIR points elsewhere)"
        )
    return SHARED_DATA


def write_sharded(checkpoint_file: Path, out: Path) -> Path:
    """checkpoint_file's weights and metadata laid out as the FSDP strategy writes them (a directory of
    torch.distributed.checkpoint shards plus meta.pt), by one process standing in for the ranks."""
    import warnings

    import torch
    from torch.distributed.checkpoint import save

    from keel.checkpoint.layout import SHARDED_META

    checkpoint = torch.load(checkpoint_file, weights_only=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save({"state_dict": checkpoint.pop("state_dict")}, checkpoint_id=out, no_dist=True)
    torch.save(checkpoint, out / SHARDED_META)
    return out
