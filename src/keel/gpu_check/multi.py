"""The multi section: with two or more GPUs visible (else skipped, said so), `keel pretrain` on all of them, fp32,
MULTI_STEPS steps: FSDP against DDP (the same global gradient norm at every step); runs stopped halfway and resumed -
DDP's on one GPU, FSDP's sharded one on the same GPUs and on half of them - against the runs straight through;
DDP's in-loop evaluation; a run whose weights go non-finite (lr 1e38): every rank stops with exit status 1 and a
`nonfinite` failure, none hangs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from keel.artifacts import read_scalars
from keel.gpu_check.common import Sizes, failed, keel

MULTI_STEPS = 10
# fp32 (so that the strategies can be held to each other), a checkpoint and a validation halfway, no compile
# the global gradient norm of each step (the same global batch whatever the split: train/loss is rank 0's share)
MULTI_RECIPE = [
    "trainer.precision=32-true",
    "trainer.compile=false",
    "eval.enabled=false",
    "optim.warmup_steps=2",
    "optim.schedule=linear_warmup",  # a run stopped halfway has the same LRs as one straight through
    "callbacks.grad_norms.every_n_steps=1",
    "trainer.log_every_n_steps=1",
    "trainer.progress_bar=false",
    "trainer.val_batches=2",
    f"trainer.val_every_n_steps={MULTI_STEPS // 2}",
    f"trainer.checkpoint_every_n_steps={MULTI_STEPS // 2}",
]


def _global_grad_norms(run_dir: Path) -> list[float]:
    norms = dict(read_scalars(run_dir, ["grad/global"]).get("grad/global", []))
    return [norms[step] for step in sorted(norms)]


def _close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) > 0 and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def multi(device: str, sizes: Sizes, out: Path, data: list[str]) -> dict:
    """Several GPUs (2 CPU processes with --device cpu): the strategies against one device on the same global
    batches, sharded resume (same and half the devices), evaluation under DDP, a non-finite run on every rank."""
    from keel.artifacts import read_stability

    n = torch.cuda.device_count() if device == "cuda" else 2
    if n < 2:
        return {"ok": True, "skipped": f"{n} GPU visible: this section needs 2 or more"}
    if error := failed(keel("data", *data, timeout=600)):
        return {"ok": False, "error": f"keel data: {error}"}

    def pretrain(name: str, *overrides: str, steps: int = MULTI_STEPS) -> tuple[Path, subprocess.CompletedProcess]:
        run_dir = out / f"multi-{name}"
        done = keel(
            "pretrain",
            *sizes.multi,
            *MULTI_RECIPE,
            *data,
            *overrides,
            f"trainer.max_steps={steps}",
            f"run.dir={run_dir}",
            "resume=auto",
            timeout=900,
        )
        return run_dir, done

    ddp, fsdp = ["trainer=ddp", f"trainer.devices={n}"], ["trainer=fsdp", f"trainer.devices={n}"]
    runs, errors = {}, {}
    for name, overrides in ((f"ddp x {n}", ddp), (f"fsdp x {n}", fsdp)):
        run_dir, done = pretrain(name.split()[0], *overrides)
        runs[name], errors[name] = _global_grad_norms(run_dir), failed(done)
    # Stopped at step MULTI_STEPS / 2, then resumed: DDP's checkpoint on one device (the global batch split over
    # gradient accumulation: the data stream continues where the n devices left it), FSDP's sharded one on the same
    # devices and, on GPUs, on half of them (on CPU FSDP needs 2 processes: no half of 2)
    resumes = {
        "1 device": (ddp, ["trainer=ddp", "trainer.devices=1", f"trainer.grad_accum={n}"], f"ddp x {n}", 1e-4),
        "fsdp resumed": (fsdp, fsdp, f"fsdp x {n}", 1e-5),
    }
    if device == "cuda":
        half = ["trainer=fsdp", f"trainer.devices={n // 2}", f"trainer.grad_accum={n // (n // 2)}"]
        resumes[f"fsdp resumed on {n // 2}"] = (fsdp, half, f"fsdp x {n}", 1e-4)
    resumed = {}
    for index, (label, (first, then, straight, rel)) in enumerate(resumes.items()):
        run_dir, done = pretrain(f"resumed-{index}", *first, steps=MULTI_STEPS // 2)
        errors[f"{label}: first half"] = failed(done)
        run_dir, done = pretrain(f"resumed-{index}", *then)
        errors[f"{label}: second half"] = failed(done)
        runs[label] = _global_grad_norms(run_dir)
        resumed[f"{label} = {straight} (rel {rel:.0e})"] = _close(runs[label], runs[straight], rel)
    evaluated, done = pretrain(
        "eval",
        "trainer=ddp",
        f"trainer.devices={n}",
        "eval=generated",
        "eval.enabled=true",
        "eval.limit=20",
        f"eval.every_n_steps={MULTI_STEPS}",
        steps=MULTI_STEPS,
    )
    errors["ddp evaluation"] = failed(done)
    history = evaluated / "eval_history.json"
    nonfinite_dir, nonfinite = pretrain("nonfinite", *fsdp, "optim.lr=1e38", "callbacks.stability.on_nonfinite=stop")
    stability = read_stability(nonfinite_dir) or {}
    checks = {
        "every run ran": not any(errors.values()),
        f"fsdp x {n} = ddp x {n} (rel 1e-04)": _close(runs[f"fsdp x {n}"], runs[f"ddp x {n}"], 1e-4),
        **resumed,
        "ddp in-loop evaluation written": history.is_file() and bool(json.loads(history.read_text())["evaluations"]),
        "non-finite: exit 1, every rank": nonfinite.returncode == 1 and stability.get("kind") == "nonfinite",
    }
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "devices": n,
        "global_grad_norms": runs,
        "errors": {k: v for k, v in errors.items() if v},
    }
