"""What a device is and what a process holds on it: the probes `keel bench` and `keel gpu-check` share."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import time
from pathlib import Path

import torch

from keel.config import Config

MATMUL_SIZE, MATMUL_REPEATS = 2048, 10
# On a CPU the probe's matmuls are sized to it: the largest power of two up to MATMUL_SIZE whose one matmul is
# predicted (from a 256^3 one) to take at most this. A CPU without fast bf16 (AVX2 only: ~1 GFLOP/s) would
# otherwise spend minutes on 2048^3 bf16 matmuls.
PROBE_SECONDS = 0.5
PROBE_START = 256


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and the cores this process may use."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {len(os.sched_getaffinity(0))} cores"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_size(seconds_at_start: float) -> int:
    """The CPU probe's matmul size, given how long one PROBE_START^3 matmul took (time grows with size^3)."""
    size = PROBE_START
    while size < MATMUL_SIZE and seconds_at_start * (2 * size / PROBE_START) ** 3 <= PROBE_SECONDS:
        size *= 2
    return size


@functools.lru_cache
def matmul_size(device: torch.device, dtype: torch.dtype, threads: int) -> int:
    """MATMUL_SIZE on a GPU; on a CPU, sized to its speed in this dtype (probe_size), once per process."""
    if device.type != "cpu":
        return MATMUL_SIZE
    torch.set_num_threads(threads)
    a = torch.randn(PROBE_START, PROBE_START, dtype=dtype)
    a @ a  # first call: allocation, kernel selection
    start = time.perf_counter()
    a @ a
    return probe_size(time.perf_counter() - start)


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, threads: int) -> float:
    """The best FLOP/s of MATMUL_REPEATS square matmuls: what this device reaches on the easiest possible work."""
    size = matmul_size(device, dtype, threads)
    torch.set_num_threads(threads)
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    a @ b  # first call: allocation, kernel selection
    best = float("inf")
    for _ in range(MATMUL_REPEATS):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def resident_bytes(peak: bool = False) -> int:
    """This process's resident memory now (VmRSS), or its peak since the last reset_peak_resident (VmHWM)."""
    key = "VmHWM" if peak else "VmRSS"
    status = Path("/proc/self/status").read_text()
    return int(status.split(f"{key}:")[1].split()[0]) * 1024


def reset_peak_resident() -> int | None:
    """Hand freed heap back to the OS (glibc) and restart the kernel's peak-RSS count; the RSS now, or None where
    Linux's /proc/self/clear_refs is not available."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)  # else pages freed before would be reused unseen
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return resident_bytes()
    except OSError:
        return None


def set_threads(cfg: Config) -> None:
    """One intra-op thread per available core, shared among the processes on this node (trainer.devices of
    them, CPU or GPU ranks alike) after a core for each of their loader workers: more threads than cores (e.g. 8
    GPU ranks each taking every core) oversubscribes the CPU."""
    threads = cfg.trainer.threads
    if threads == 0:
        cores = len(os.sched_getaffinity(0))
        threads = max(1, (cores - cfg.trainer.devices * cfg.data.loader_workers) // cfg.trainer.devices)
    torch.set_num_threads(threads)
    # Lightning's DDP/FSDP launcher resets every process to cores / processes unless OMP_NUM_THREADS is set, and
    # torchrun sets it to 1; the ranks started after this inherit it
    os.environ["OMP_NUM_THREADS"] = str(threads)
