"""Refusals of a trainer config this machine cannot run, before any process starts (keel.training.build_trainer):
a GPU torch cannot see, more devices than visible, a strategy for another number of processes, torch.compile
without the compilers it needs (probed as inductor and Triton look for them), several nodes without a launcher."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

from keel.config import resolve_accelerator
from keel.errors import ConfigError

NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")  # present where Linux has loaded the NVIDIA kernel driver


def check_trainer(trainer) -> None:
    """Refuse combinations that cannot run, saying what to change, before any process starts."""
    world = trainer.world_size
    if trainer.accelerator == "auto" and not torch.cuda.is_available() and NVIDIA_DRIVER.is_file():
        # e.g. a driver older than this torch build needs: torch only warns, and auto would train on the CPU
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        driver = NVIDIA_DRIVER.read_text().splitlines()[0].strip()
        raise ConfigError(
            f"trainer.accelerator=auto: torch {torch.__version__} ({build}) sees no GPU, yet this "
            f"machine has an NVIDIA driver loaded ({driver}); install the torch build "
            'the driver supports (docs/distributed.md, "The torch build and the GPU '
            'driver"), or set trainer.accelerator=cpu to train on the CPU'
        )
    if trainer.accelerator == "gpu" and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.accelerator=gpu: no CUDA GPU is visible; use trainer=cpu (or trainer.accelerator=cpu)"
        )
    visible = torch.cuda.device_count()
    if resolve_accelerator(trainer) == "gpu" and trainer.devices > visible and SLURMEnvironment.detect():
        # e.g. --gpus-per-task=1: Lightning gives each task the GPU of its local rank among those it sees
        raise ConfigError(
            f"trainer.devices={trainer.devices}: this SLURM task sees {visible} CUDA GPU(s), and each "
            "process takes the GPU of its local rank among all of its node's; submit with "
            f"--gpus-per-node={trainer.devices} --ntasks-per-node={trainer.devices}, without "
            "--gpus-per-task or --gpu-bind (which leave each task only its own GPU)"
        )
    if resolve_accelerator(trainer) == "gpu" and trainer.devices > visible:
        raise ConfigError(
            f"trainer.devices={trainer.devices}: only {visible} CUDA GPU(s) visible on "
            "this node; trainer.devices counts GPUs per node"
        )
    if trainer.resolved_strategy == "single" and world > 1:
        raise ConfigError(
            f"trainer.strategy=single runs one process, not trainer.devices x trainer.num_nodes = "
            f"{world}; use trainer=ddp or trainer=fsdp"
        )
    if trainer.resolved_strategy == "fsdp" and world < 2 and resolve_accelerator(trainer) == "cpu":
        raise ConfigError(
            "trainer.strategy=fsdp: FSDP shards over >= 2 processes; on CPU use trainer.devices=2 or trainer=cpu"
        )
    if trainer.compile and resolve_accelerator(trainer) == "cpu" and (missing := missing_cpp_compiler()):
        raise ConfigError(
            f"trainer.compile=true: torch.compile on CPU builds C++ kernels, and no C++ compiler was "
            f"found ({missing}); install one (e.g. apt install g++, xcode-select --install) or set "
            "trainer.compile=false"
        )
    if trainer.compile and resolve_accelerator(trainer) == "gpu" and (missing := missing_c_compiler()):
        raise ConfigError(
            f"trainer.compile=true: torch.compile on GPU builds Triton kernels, whose launchers Triton "
            f"compiles with a C compiler, and none was found ({missing}); install one (e.g. apt install "
            "gcc) or point $CC at one, or set trainer.compile=false"
        )
    launched = SLURMEnvironment.detect() or TorchElasticEnvironment.detect() or "NODE_RANK" in os.environ
    if trainer.num_nodes > 1 and not launched:
        raise ConfigError(
            f"trainer.num_nodes={trainer.num_nodes}: start one launcher per node with torchrun or srun "
            "(docs/distributed.md); run alone, every node would wait for the others forever"
        )


def missing_cpp_compiler() -> str | None:
    """Why inductor would find no C++ compiler (it would fail at the first compiled step), or None if it finds one:
    asked the way inductor asks, so $CXX and torch's own search order count."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        cxx = inductor_config.cpp.cxx
        return "searched " + ", ".join(str(c) for c in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if c)
    return None


def missing_c_compiler() -> str | None:
    """Why Triton would find no C compiler for its kernels' launchers (it would fail at the first compiled step),
    or None: looked for as triton.runtime.build does, $CC, else gcc or clang on PATH (not asked of Triton itself,
    which caches its answer for the process)."""
    if cc := os.environ.get("CC"):
        return None if shutil.which(cc) else f"$CC={cc} is not a program"
    return None if shutil.which("gcc") or shutil.which("clang") else "no $CC, and neither gcc nor clang on PATH"
