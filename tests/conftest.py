"""Shared fixtures: a tiny real corpus (standard-library source files), its shards, and tiny-model overrides."""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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
]


def shared_data() -> Path:
    """../shared/data (or $KEEL_SHARED_DATA), or skip: users' clones do not have it; CI does."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (only the project's CI machine has it; "
                    "KEEL_SHARED_DATA=DIR points elsewhere)")
    return SHARED_DATA


@pytest.fixture
def one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronization (and contention on shared cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """About 40 real Python source files (~600 KB) from this interpreter's standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    for path in sorted(stdlib.glob("*.py"))[:40]:
        shutil.copy(path, out / path.name)
    return out


@pytest.fixture(scope="session")
def tiny_data(corpus_dir, tmp_path_factory) -> list[str]:
    """Shards + tokenizer built by `keel data`; returns the data.* overrides that select them."""
    data_dir = tmp_path_factory.mktemp("shards") / "tiny"
    return build_shards(corpus_dir, data_dir, "data.vocab_size=512", "data.val_fraction=0.1")


def build_shards(corpus_dir: Path, data_dir: Path, *overrides: str) -> list[str]:
    """`keel data` over corpus_dir's .py files, read from inside it: the document ids (so the split, held out by
    their hash) are the bare file names, the same on every run, not the per-run temporary path. Returns the data.*
    overrides that select the shards, with corpus_dir's absolute glob (for tests that build other shards from it)."""
    from keel.data import main as data_main

    common = ["data.source=text_files", f"data.dir={data_dir}", "data.prepare_workers=1", *overrides]
    cwd = os.getcwd()
    os.chdir(corpus_dir)
    try:
        assert data_main([*common, "data.paths=['*.py']"]) == 0
    finally:
        os.chdir(cwd)
    return [*common, f"data.paths=[{corpus_dir}/*.py]"]


@pytest.fixture(scope="session")
def tiny_run(tiny_data, tmp_path_factory) -> Path:
    """A run dir whose checkpoints/last.ckpt holds a tiny model trained for 30 steps."""
    from keel.config import load_config
    from keel.pretrain import train

    run = tmp_path_factory.mktemp("trained") / "run"
    overrides = [*TINY_MODEL, *QUIET_TRAINER, *tiny_data, "eval.enabled=false", "trainer.max_steps=30",
                 "trainer.val_every_n_steps=30", "trainer.val_batches=1", "optim.warmup_steps=5", f"run.dir={run}"]
    train(load_config(overrides=overrides))
    return run


def write_sharded(checkpoint_file: Path, out: Path) -> Path:
    """checkpoint_file's weights and metadata laid out as the FSDP strategy writes them (a directory of
    torch.distributed.checkpoint shards plus meta.pt), by one process standing in for the ranks."""
    import warnings

    import torch
    from torch.distributed.checkpoint import save

    from keel.checkpoint import SHARDED_META

    checkpoint = torch.load(checkpoint_file, weights_only=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save({"state_dict": checkpoint.pop("state_dict")}, checkpoint_id=out, no_dist=True)
    torch.save(checkpoint, out / SHARDED_META)
    return out
