"""What a device is and what a process holds on it: the probes `keel bench` and `keel gpu-check` share."""

from __future__ import annotations

import ctypes
import os
import platform
import time
from pathlib import Path

import torch

MATMUL_SIZE, MATMUL_REPEATS = 2048, 10


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


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, threads: int) -> float:
    """The best FLOP/s of MATMUL_REPEATS square matmuls: what this device reaches on the easiest possible work."""
    torch.set_num_threads(threads)
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=dtype) for _ in range(2))
    a @ b  # first call: allocation, kernel selection
    best = float("inf")
    for _ in range(MATMUL_REPEATS):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * MATMUL_SIZE**3 / best


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
