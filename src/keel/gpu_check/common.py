"""What every section of `keel gpu-check` shares: the sizes each runs at on a device type, running `keel` as a
subprocess, and a figure held to a bound (a threshold)."""

from __future__ import annotations

import gc
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field

import torch
import yaml

from keel.config import conf_dir

BENCH_RUN = ["--steps", "10", "--warmup", "3", "--repeats", "3"]
PAPER_WARMUP = 5  # the paper section's first steps, untimed: compile, allocator


@dataclass(frozen=True)
class Sizes:
    """What each section runs on one device type."""

    bench: dict[str, list[str]]  # label -> keel bench options
    bench_compile: str
    pretrain_model: list[str]
    pretrain_runs: dict[str, list[str]]  # label -> trainer overrides
    depth_model: dict  # ModelConfig fields but depth
    depth_start: int
    depth_max: int
    head: tuple[int, int, int]  # tokens, width, vocab of the loss-head check
    paper_model: list[str]  # model overrides of the paper section
    paper_batch: int  # its micro-batch
    paper_steps: int  # its training steps (the first PAPER_WARMUP untimed)
    multi: list[str]  # the multi section's model and trainer (devices: every GPU, or 2 CPU processes)
    fsdp: list[str]  # the fsdp section's model, micro-batch and trainer but devices
    data: list[str] = field(default_factory=list)  # default data overrides


def paper_block() -> dict:
    """The paper's block (conf/model/paper_d64.yaml) at any depth: its model fields but scheme and depth."""
    fields = yaml.safe_load((conf_dir() / "model" / "paper_d64.yaml").read_text())
    return {key: value for key, value in fields.items() if key not in ("scheme", "depth")}


def sizes_for(device: str) -> Sizes:
    if device == "cuda":
        return Sizes(
            bench={
                "350M: 20 blocks x 1024": [
                    "--depth",
                    "20",
                    "--width",
                    "1024",
                    "--heads",
                    "16",
                    "--seq-len",
                    "1024",
                    "--vocab",
                    "50304",
                    "--batch",
                    "8",
                    *BENCH_RUN,
                ],
                "paper_d64 width, 8 blocks": [
                    "--depth",
                    "8",
                    "--width",
                    "1024",
                    "--heads",
                    "16",
                    "--seq-len",
                    "2048",
                    "--vocab",
                    "50304",
                    "--batch",
                    "4",
                    *BENCH_RUN,
                ],
            },
            bench_compile="on",
            # 64 blocks: 128 sublayers whose norm gains act in turn (the FSDP-against-one-process loss check)
            pretrain_model=[
                "model.depth=64",
                "model.width=512",
                "model.n_heads=8",
                "model.seq_len=512",
                "trainer.micro_batch_size=16",
            ],
            pretrain_runs={
                "trainer=gpu": ["trainer=gpu"],
                "trainer=fsdp devices=1": ["trainer=fsdp", "trainer.devices=1", "trainer.compile=true"],
            },
            depth_model=paper_block(),
            depth_start=64,
            depth_max=4096,
            head=(8192, 1024, 50304),
            # micro-batch 4 x 2,048: within an 80 GB GPU without activation checkpointing (keel.memory's estimate)
            paper_model=["model=paper_d64"],
            paper_batch=4,
            paper_steps=30,
            multi=[
                "model.depth=8",
                "model.width=512",
                "model.n_heads=8",
                "model.seq_len=512",
                "trainer.micro_batch_size=8",
                "trainer.accelerator=gpu",
            ],
            fsdp=["model=paper_d64", "trainer.micro_batch_size=4", "trainer.accelerator=gpu", "trainer.compile=true"],
            data=["data=stdlib"],
        )
    tiny = ["model.depth=2", "model.width=32", "model.n_heads=2", "model.seq_len=32", "model.vocab_size=512"]
    return Sizes(
        bench={
            "tiny: 2 blocks x 32": [
                "--depth",
                "2",
                "--width",
                "32",
                "--heads",
                "2",
                "--seq-len",
                "32",
                "--vocab",
                "512",
                "--batch",
                "4",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--repeats",
                "1",
                "--threads",
                "1",
            ]
        },
        bench_compile="off",
        pretrain_model=[*tiny, "trainer.micro_batch_size=4", "trainer.threads=1"],
        pretrain_runs={
            "trainer=cpu": ["trainer=cpu", "trainer.compile=false"],
            "trainer=fsdp devices=2": ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"],
        },
        depth_model=dict(width=32, n_heads=2, seq_len=32, vocab_size=512),
        depth_start=2,
        depth_max=8,  # no out-of-memory to find on a CPU: the doubling stops here
        head=(256, 32, 512),
        paper_model=tiny,
        paper_batch=4,
        paper_steps=PAPER_WARMUP + 2,
        multi=[*tiny, "trainer.micro_batch_size=4", "trainer.threads=1", "trainer.accelerator=cpu"],
        fsdp=[
            *tiny,
            "trainer.micro_batch_size=4",
            "trainer.threads=1",
            "trainer.accelerator=cpu",
            "trainer.compile=false",
        ],
        # 40-odd standard-library files, as tests/conftest.py's corpus: seconds to tokenize
        data=[
            "data=text_files",
            "data.text_files.paths=[" + ",".join(f"{sysconfig.get_paths()['stdlib']}/{c}*.py" for c in "abc") + "]",
            "data.vocab_size=512",
            "data.val_fraction=0.3",  # held-out files for the generated tasks (multi)
            "data.prepare_workers=1",
        ],
    )


def keel(*argv: str, timeout: float, module: str = "keel.cli") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=timeout)


def failed(done: subprocess.CompletedProcess) -> str | None:
    return None if done.returncode == 0 else f"exit {done.returncode}: {done.stderr[-2000:]}"


def free_memory(dev: torch.device) -> None:
    """Between a section's runs: the last run's tensors collected and, on CUDA, the allocator's cached blocks
    returned to the device, so that the next run's peak memory is its own."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def threshold(value: float | None, ok: bool, shown: str, bound: str, source: str) -> dict:
    """A figure held to a bound: printed as `shown (bound; source)`, failing the section when not ok."""
    return {"ok": ok, "value": value, "shown": shown, "threshold": bound, "source": source}


def skipped(reason: str) -> dict:
    return {"ok": True, "skipped": reason}


def mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f} MB"
