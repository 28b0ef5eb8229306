"""The pretrain section: `keel pretrain trainer=gpu` and `trainer=fsdp trainer.devices=1 trainer.compile=true`
(FSDP2 on one GPU: bf16 compute copies, fp32 reduce, fused AdamW on DTensor parameters, compile under FSDP hooks,
an NCCL process group): PRETRAIN_STEPS steps, loss finite and decreasing, then resumed from the checkpoint for
RESUME_STEPS more, starting where it stopped. On a GPU the two runs train on the same batches, and FSDP's
mixed-precision policy computes with bf16 copies of every parameter, Keel's norm gains included (one process keeps
them fp32 under autocast): their losses are held together (FSDP_LOSS_GAP), at a depth where the gains of many
sublayers act in turn."""

from __future__ import annotations

import math
import time
from pathlib import Path

from keel.artifacts import read_scalars
from keel.gpu_check.common import Sizes, failed, keel, skipped, threshold

PRETRAIN_STEPS, RESUME_STEPS = 50, 5
# the mean |loss difference| of the one-process and FSDP runs over the last 10 of the 50 steps: this project's
# choice, unmeasured (a GPU run gives the first figure)
FSDP_LOSS_GAP = 0.05
# constant LR after warm-up: the resumed run's longer trainer.max_steps leaves the schedule unchanged
PRETRAIN_RECIPE = [
    "optim.schedule=linear_warmup",
    "optim.warmup_steps=10",
    "optim.lr=1e-3",
    "eval.enabled=false",
    "trainer.log_every_n_steps=1",
    "trainer.progress_bar=false",
    "trainer.val_every_n_steps=25",
    "trainer.val_batches=2",
    f"trainer.checkpoint_every_n_steps={PRETRAIN_STEPS}",
]


def pretrain(device: str, sizes: Sizes, out: Path, data: list[str]) -> dict:
    """Each trainer config: PRETRAIN_STEPS steps, then resume=auto for RESUME_STEPS more."""
    if error := failed(keel("data", *data, timeout=600)):
        return {"ok": False, "error": f"keel data: {error}"}
    runs = {}
    for label, trainer in sizes.pretrain_runs.items():
        run_dir = out / f"run-{len(runs)}"
        common = [*sizes.pretrain_model, *trainer, *PRETRAIN_RECIPE, *data, f"run.dir={run_dir}", "resume=auto"]
        start = time.perf_counter()
        error = failed(keel("pretrain", *common, f"trainer.max_steps={PRETRAIN_STEPS}", timeout=600))
        seconds = time.perf_counter() - start
        error = error or failed(
            keel("pretrain", *common, f"trainer.max_steps={PRETRAIN_STEPS + RESUME_STEPS}", timeout=300)
        )
        if error:
            runs[label] = {"ok": False, "error": error}
            continue
        losses = dict(read_scalars(run_dir, ["train/loss"]).get("train/loss", []))
        ordered = [losses[step] for step in sorted(losses)]
        first, last = sum(ordered[:10]) / 10, sum(ordered[PRETRAIN_STEPS - 10 : PRETRAIN_STEPS]) / 10
        checks = {
            "every step logged": sorted(losses) == list(range(PRETRAIN_STEPS + RESUME_STEPS)),
            "loss finite": all(map(math.isfinite, ordered)),
            "loss decreasing": last < first,
            # the resumed steps continue the curve: no jump back to an untrained loss
            "resumed where it stopped": max(ordered[PRETRAIN_STEPS:]) < first,
        }
        speed = dict(read_scalars(run_dir, ["perf/tokens_per_s"]).get("perf/tokens_per_s", []))
        runs[label] = {
            "ok": all(checks.values()),
            "checks": checks,
            "loss_first10": first,
            "loss_last10": last,
            "loss_resumed": ordered[PRETRAIN_STEPS:],
            "seconds_50_steps": seconds,
            "tokens_per_s": speed[max(speed)] if speed else None,
            "losses": ordered[:PRETRAIN_STEPS],
        }
    gap = fsdp_loss_gap(device, *runs.values())
    return {
        "ok": all(r["ok"] for r in runs.values()) and gap["ok"],
        "runs": runs,
        "thresholds": {"bf16 FSDP against one process, mean |loss difference| over the last 10 steps": gap},
    }


def fsdp_loss_gap(device: str, one: dict, sharded: dict) -> dict:
    """The one-process and FSDP runs' mean absolute loss difference over the last 10 of their PRETRAIN_STEPS."""
    if device != "cuda":
        return skipped(
            "cpu: FSDP needs 2 processes there, which see other batches than one "
            "(tests/test_fsdp_equivalence.py compares them on equal batches)"
        )
    if "losses" not in one or "losses" not in sharded:
        return threshold(None, False, "a run failed", f"<= {FSDP_LOSS_GAP}", "this project's choice")
    gap = sum(abs(a - b) for a, b in zip(one["losses"][-10:], sharded["losses"][-10:], strict=True)) / 10
    return threshold(
        gap, gap <= FSDP_LOSS_GAP, f"{gap:.4f} nat", f"<= {FSDP_LOSS_GAP}", "this project's choice, unmeasured"
    )
