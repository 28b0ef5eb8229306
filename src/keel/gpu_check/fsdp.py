"""The fsdp and checkpoint sections, each a `keel pretrain trainer=fsdp` run through `python -m keel.gpu_check`
(guarded_pretrain), on every GPU (2 CPU processes with --device cpu).

fsdp: bf16 FSDP with compile and the in-loop evaluation on, on every GPU, then on one; thresholds on the scaling
efficiency (tokens/s per GPU at N over that at 1 >= SCALING_FLOOR) and on the host syncs per step outside logging
steps (CUDA's sync debug mode: none). checkpoint: the fsdp section's model saved synchronously and in the background
(trainer.async_checkpoint): per save, the seconds it held the training loop (blocking), those a later save waited
for the write, those until the checkpoint was whole (total) and its bytes; threshold: the background save holds
the loop at most ASYNC_BLOCKING_MAX of the synchronous one's time."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import warnings
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from keel.artifacts import read_scalars
from keel.cadence import due
from keel.gpu_check.common import Sizes, failed, keel, mb, skipped, threshold

SCALING_FLOOR = 0.85  # tokens/s per GPU on N GPUs over that on one: this project's choice for one NVLink node
FSDP_STEPS, FSDP_LOG_EVERY = 40, 5
GUARD_FROM = 10  # the first steps compile, initialize FSDP lazily and make Lightning's logging state: not guarded
SYNC_WARNING = "called a synchronizing CUDA operation"
# the in-loop evaluation and validation (with a checkpoint) at logging steps, where the host may wait; the periodic
# callbacks log there too; the throughput window: the last 20 steps
FSDP_RECIPE = [
    "trainer.precision=bf16-mixed",
    "eval=generated",
    "eval.enabled=true",
    "eval.limit=20",
    f"eval.every_n_steps={FSDP_STEPS // 2}",
    f"trainer.val_every_n_steps={FSDP_STEPS // 2}",
    f"trainer.checkpoint_every_n_steps={FSDP_STEPS // 2}",
    "trainer.val_batches=2",
    f"trainer.log_every_n_steps={FSDP_LOG_EVERY}",
    f"callbacks.grad_norms.every_n_steps={FSDP_LOG_EVERY}",
    f"callbacks.layer_importance.every_n_steps={FSDP_LOG_EVERY}",
    "callbacks.grad_norms.heatmap_every_n_steps=0",
    f"callbacks.throughput.window={FSDP_STEPS // 2}",
    "trainer.progress_bar=false",
    f"trainer.max_steps={FSDP_STEPS}",
]
CHECKPOINT_STEPS, CHECKPOINT_EVERY = 30, 10  # 3 saves, the last at the end of training
SAVES = "saves.json"  # RunCheckpoint.saves of a run, written by guarded_pretrain
ASYNC_BLOCKING_MAX = (
    0.5  # a save in the background holds the loop at most half as long as a synchronous one: our choice
)
CHECKPOINT_RECIPE = [
    "trainer.precision=bf16-mixed",
    "eval.enabled=false",
    "trainer.progress_bar=false",
    f"trainer.max_steps={CHECKPOINT_STEPS}",
    f"trainer.checkpoint_every_n_steps={CHECKPOINT_EVERY}",
    f"trainer.val_every_n_steps={CHECKPOINT_STEPS}",
    "trainer.val_batches=2",
]


class HostSyncGuard(Callback):
    """CUDA's sync debug mode over each optimizer step from GUARD_FROM on that is not a logging step (nor the
    last), validation and the in-loop evaluation left out: every host wait there, each one recorded with the line
    that made it, written to run.dir/host_syncs-rank<r>.json. "warn", not "error": a rank that raised would leave
    the others waiting in a collective."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.active = trainer.strategy.root_device.type == "cuda"
        self.guarded: set[int] = set()
        if self.active:
            self._catching = warnings.catch_warnings(record=True)
            self.caught = self._catching.__enter__()
            warnings.simplefilter("always")

    def _mode(self, mode: str) -> None:
        if self.active:
            torch.cuda.set_sync_debug_mode(mode)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        guarded = GUARD_FROM <= step < trainer.max_steps - 1 and not due(step, trainer.log_every_n_steps)
        if guarded:
            self.guarded.add(step)
        self._mode("warn" if guarded else "default")

    def on_validation_start(self, trainer, pl_module) -> None:
        self._mode("default")

    def on_train_end(self, trainer, pl_module) -> None:
        if not self.active:
            return
        self._mode("default")
        self._catching.__exit__(None, None, None)
        syncs = [f"{Path(w.filename).name}:{w.lineno}" for w in self.caught if SYNC_WARNING in str(w.message)]
        report = {"guarded_steps": len(self.guarded), "syncs": len(syncs), "where": sorted(set(syncs))}
        (Path(trainer.default_root_dir) / f"host_syncs-rank{trainer.global_rank}.json").write_text(json.dumps(report))


def guarded_pretrain(argv: list[str]) -> int:
    """`python -m keel.gpu_check OVERRIDES`: keel pretrain with the HostSyncGuard (Lightning starts the other
    ranks by running the same command)."""
    from keel.config import load_config
    from keel.training import failure_exit_code, train

    cfg = load_config(overrides=argv)
    trainer = train(cfg, [HostSyncGuard()])
    if trainer.is_global_zero:  # the checkpoint section's figures
        (Path(cfg.run.dir) / SAVES).write_text(json.dumps(trainer.checkpoint_callback.saves))
    return failure_exit_code(cfg, trainer)


def _fsdp_run(sizes: Sizes, out: Path, data: list[str], n: int) -> dict:
    """One bf16 FSDP run on n devices with the in-loop evaluation and the host-sync guard: its figures."""
    run_dir = out / f"fsdp-{n}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resumed one
    done = keel(
        *sizes.fsdp,
        *FSDP_RECIPE,
        *data,
        "trainer=fsdp",
        f"trainer.devices={n}",
        f"run.dir={run_dir}",
        timeout=1800,
        module="keel.gpu_check",
    )
    scalars = read_scalars(run_dir, ["train/loss", "perf/tokens_per_s_per_device", "perf/mfu"])
    history = run_dir / "eval_history.json"
    syncs = [json.loads(path.read_text()) for path in sorted(run_dir.glob("host_syncs-rank*.json"))]
    result = {
        "error": failed(done),
        "loss_finite": bool(scalars.get("train/loss")) and all(math.isfinite(v) for _, v in scalars["train/loss"]),
        "evaluated": history.is_file() and bool(json.loads(history.read_text())["evaluations"]),
        **{
            key: values[-1][1] if (values := scalars.get(tag)) else None
            for key, tag in (("tokens_per_s_per_device", "perf/tokens_per_s_per_device"), ("mfu", "perf/mfu"))
        },
        "host_syncs": syncs,
    }
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the paper model's: gigabytes
    return result


def fsdp(device: str, sizes: Sizes, out: Path, data: list[str]) -> dict:
    """bf16 FSDP, compiled on GPUs, the in-loop evaluation on: on every GPU (2 CPU processes with --device cpu),
    then on one GPU for the scaling efficiency; host syncs outside logging steps counted on CUDA."""
    if error := failed(keel("data", *data, timeout=600)):
        return {"ok": False, "error": f"keel data: {error}"}
    n = torch.cuda.device_count() if device == "cuda" else 2
    runs = {f"fsdp x {n}": _fsdp_run(sizes, out, data, n)}
    if device == "cuda" and n > 1:
        runs["fsdp x 1"] = _fsdp_run(sizes, out, data, 1)
    every, one = runs[f"fsdp x {n}"], runs.get("fsdp x 1")
    label = f"bf16 FSDP x {n}, {'compiled' if device == 'cuda' else 'eager on CPU'}, in-loop evaluation"
    checks = {
        f"{label}: trained, loss finite": every["error"] is None and every["loss_finite"],
        f"{label}: evaluation written": every["evaluated"],
    }
    if device != "cuda":
        syncs, scaling = skipped("cpu (tests/test_host_syncs.py checks the step on CPU)"), skipped("cpu")
    else:
        found = sum(r["syncs"] for r in every["host_syncs"])
        guarded = sum(r["guarded_steps"] for r in every["host_syncs"])
        where = sorted({w for r in every["host_syncs"] for w in r["where"]})
        syncs = threshold(
            found,
            len(every["host_syncs"]) == n and guarded > 0 and found == 0,
            f"{found} in {guarded} rank-steps" + (f" at {', '.join(where)}" if where else ""),
            "= 0",
            "issue #41: the host waits at logging steps only (CUDA sync debug mode)",
        )
        if one is None:
            scaling = skipped(f"{n} GPU visible: scaling needs 2 or more")
        elif every["tokens_per_s_per_device"] and one["tokens_per_s_per_device"]:
            efficiency = every["tokens_per_s_per_device"] / one["tokens_per_s_per_device"]
            scaling = threshold(
                efficiency,
                efficiency >= SCALING_FLOOR,
                f"{efficiency:.1%} ({every['tokens_per_s_per_device']:,.0f} against "
                f"{one['tokens_per_s_per_device']:,.0f} tok/s per GPU)",
                f">= {SCALING_FLOOR:.0%}",
                "this project's choice for one node",
            )
        else:
            scaling = threshold(None, False, "no tokens/s logged", f">= {SCALING_FLOOR:.0%}", "a run failed")
    thresholds = {"host syncs per step outside logging steps": syncs, f"FSDP scaling efficiency, 1 -> {n}": scaling}
    errors = {label: run["error"] for label, run in runs.items() if run["error"]}
    return {
        "ok": all(checks.values()) and all(t["ok"] for t in thresholds.values()),
        "checks": checks,
        "thresholds": thresholds,
        "devices": n,
        "fsdp_runs": runs,
        "errors": errors,
    }


def _save_run(sizes: Sizes, out: Path, data: list[str], n: int, background: bool) -> dict:
    """One FSDP run on n devices saving synchronously or in the background: its saves' median figures."""
    run_dir = out / f"checkpoint-{'async' if background else 'sync'}"
    shutil.rmtree(run_dir, ignore_errors=True)
    done = keel(
        *sizes.fsdp,
        *CHECKPOINT_RECIPE,
        *data,
        "trainer=fsdp",
        f"trainer.devices={n}",
        f"trainer.async_checkpoint={str(background).lower()}",
        f"run.dir={run_dir}",
        timeout=1800,
        module="keel.gpu_check",
    )
    saves = json.loads((run_dir / SAVES).read_text()) if (run_dir / SAVES).is_file() else []
    last = run_dir / "checkpoints" / "last.ckpt"
    result = {
        "error": failed(done),
        "saves": len(saves),
        "whole": all("total_s" in save for save in saves),
        "bytes": sum(f.stat().st_size for f in last.iterdir()) if last.is_dir() else None,
        **{
            key: statistics.median(save[key] for save in saves) if saves else None
            for key in ("blocking_s", "waited_s", "total_s")
            if all(key in save for save in saves)
        },
    }
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the paper model's: gigabytes each
    return result


def checkpoint(device: str, sizes: Sizes, out: Path, data: list[str]) -> dict:
    """The fsdp section's model saved under FSDP on every GPU (2 CPU processes with --device cpu), synchronously
    and in the background (trainer.async_checkpoint): per save (medians of CHECKPOINT_STEPS / CHECKPOINT_EVERY) the
    seconds the save held the training loop, the seconds a later save or the end of training waited for the write,
    the seconds until the checkpoint was whole, and its bytes; threshold (GPU): the background save holds the loop
    at most ASYNC_BLOCKING_MAX of the synchronous one's time."""
    if error := failed(keel("data", *data, timeout=600)):
        return {"ok": False, "error": f"keel data: {error}"}
    n = torch.cuda.device_count() if device == "cuda" else 2
    runs = {"sync": _save_run(sizes, out, data, n, False), "async": _save_run(sizes, out, data, n, True)}
    saves = CHECKPOINT_STEPS // CHECKPOINT_EVERY
    checks = {
        f"{mode} x {n}: trained, {saves} checkpoints whole": run["error"] is None
        and run["saves"] == saves
        and run["whole"]
        for mode, run in runs.items()
    }
    sync, background = runs["sync"], runs["async"]
    if device != "cuda":
        held = skipped("cpu (tests/test_async_checkpoint.py checks the saves on CPU)")
    elif sync.get("blocking_s") and background.get("blocking_s") is not None:
        ratio = background["blocking_s"] / sync["blocking_s"]
        held = threshold(
            ratio,
            ratio <= ASYNC_BLOCKING_MAX,
            f"{background['blocking_s']:.2f} s against "
            f"{sync['blocking_s']:.2f} s ({ratio:.0%}; {mb(sync['bytes'])} per checkpoint)",
            f"<= {ASYNC_BLOCKING_MAX:.0%}",
            "this project's choice",
        )
    else:
        held = threshold(None, False, "no save timed", f"<= {ASYNC_BLOCKING_MAX:.0%}", "a run failed")
    figures = {
        mode: {key: run.get(key) for key in ("bytes", "blocking_s", "waited_s", "total_s")}
        for mode, run in runs.items()
    }
    return {
        "ok": all(checks.values()) and held["ok"],
        "checks": checks,
        "devices": n,
        "saves": figures,
        "thresholds": {"save held the loop, async / sync": held},
        "errors": {mode: run["error"] for mode, run in runs.items() if run["error"]},
    }
