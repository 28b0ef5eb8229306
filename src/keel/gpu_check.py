"""`keel gpu-check [--device cuda|cpu] [--out DIR] [data overrides]`: one command, a few minutes, to know whether
Keel's GPU path works on this machine and how fast it is (docs/bench.md, "GPU acceptance: make gpu-check").

    bench      `keel bench --dtype bf16 --compile on` Keel against Pre-LN at a ~350M-parameter config and at
               model=paper_d64's width 1024 with 8 blocks: tokens/s, MFU against the device's dense bf16 peak
               (keel.bench's table), peak memory
    pretrain   `keel pretrain trainer=gpu` and `trainer=fsdp trainer.devices=1 trainer.compile=true` (FSDP2 on one
               GPU: bf16 compute copies, fp32 reduce, fused AdamW on DTensor parameters, compile under FSDP hooks,
               an NCCL process group): 50 steps, loss finite and decreasing, then resumed from the checkpoint for 5
               more steps, starting where it stopped
    depth      the deepest Keel model of width 1024 (paper_d64's block) whose training step fits with activation
               checkpointing, found by doubling the depth from 64, with its peak memory
    paper      model=paper_d64 (seq 2,048) trained on one GPU for PAPER_STEPS steps, bf16 autocast, compiled blocks,
               activation checkpointing off and on: step time, tokens/s, MFU, peak memory against keel.gpu_memory's
               estimate of the same run, the SDPA kernel used, compiled graphs and graph breaks, and the time to
               write its checkpoint (weights and AdamW state); thresholds: MFU (checkpointing off) >= MFU_FLOOR,
               peak memory within MEMORY_TOLERANCE of the estimate
    callbacks  `keel pretrain` of the same model and batch, PAPER_STEPS steps: the step time with every configurable
               callback on (the periodic ones every CALLBACKS_EVERY steps), with each off in turn, and with all off
    multi      with two or more GPUs visible (else skipped, said so), `keel pretrain` on all of them, fp32,
               MULTI_STEPS steps: FSDP against DDP (the same global gradient norm at every step); runs stopped
               halfway and resumed - DDP's on one GPU, FSDP's sharded one on the same GPUs and on half of them -
               against the runs straight through; DDP's in-loop evaluation; a run whose weights go non-finite
               (lr 1e38): every rank stops with exit status 1 and a `nonfinite` failure, none hangs
    fsdp       bf16 FSDP with compile and the in-loop evaluation on, on every GPU, then on one: thresholds on the
               scaling efficiency (tokens/s per GPU at N over that at 1 >= SCALING_FLOOR) and on the host syncs
               per step outside logging steps (CUDA's sync debug mode: none)
    checkpoint the fsdp section's model saved under FSDP on every GPU, synchronously and in the background
               (trainer.async_checkpoint): per save, the seconds it held the training loop (blocking), those a later
               save waited for the write, those until the checkpoint was whole (total) and its bytes; threshold: the
               background save holds the loop at most ASYNC_BLOCKING_MAX of the synchronous one's time
    precision  the fp32 residual stream under bf16 autocast (each sublayer's update kept, as tests/test_model.py
               checks on CPU), the RMSNorm CUDA dispatch (F.rms_norm) against the fp64 reference, the chunked loss
               head against the plain head under autocast, and FSDP2's MixedPrecisionPolicy(cast_forward_inputs=
               False) under autocast: fp32 stream into each block, bf16 weights gathered, fp32 gradients

`--device cpu` runs the same checks at tiny sizes (tests/test_gpu_check.py, so that the script cannot rot before a
GPU is available; trainer=cpu for trainer=gpu, 2 FSDP processes, no compile). Writes DIR/gpu_check.json and prints
a table; exit status 1 when any check failed. A threshold is printed with its figure, its bound and where the bound
comes from; one that only a GPU can measure is "skipped: cpu" on CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch.callbacks import Callback

from keel.artifacts import read_scalars
from keel.callbacks.reporting import due
from keel.config import conf_dir
from keel.devices import device_name
from keel.errors import ConfigError
from keel.model import KeelLM, next_token_loss
from keel.schemes import ModelConfig


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
    paper_steps: int  # its training steps (the first PAPER_WARMUP untimed: compile, allocator)
    multi: list[str]  # the multi section's model and trainer (devices: every GPU, or 2 CPU processes)
    fsdp: list[str]  # the fsdp section's model, micro-batch and trainer but devices
    data: list[str] = field(default_factory=list)  # default data overrides


BENCH_RUN = ["--steps", "10", "--warmup", "3", "--repeats", "3"]
PAPER_WARMUP = 5
# the paper's block (conf/model/paper_d64.yaml) at any depth
PAPER_BLOCK = {key: value for key, value in yaml.safe_load((conf_dir() / "model" / "paper_d64.yaml").read_text()).items()
               if key not in ("scheme", "depth")}
SIZES = {
    "cuda": Sizes(
        bench={
            "350M: 20 blocks x 1024": ["--depth", "20", "--width", "1024", "--heads", "16", "--seq-len", "1024",
                                       "--vocab", "50304", "--batch", "8", *BENCH_RUN],
            "paper_d64 width, 8 blocks": ["--depth", "8", "--width", "1024", "--heads", "16", "--seq-len", "2048",
                                          "--vocab", "50304", "--batch", "4", *BENCH_RUN],
        },
        bench_compile="on",
        pretrain_model=["model.depth=8", "model.width=512", "model.n_heads=8", "model.seq_len=512",
                        "trainer.micro_batch_size=16"],
        pretrain_runs={"trainer=gpu": ["trainer=gpu"],
                       "trainer=fsdp devices=1": ["trainer=fsdp", "trainer.devices=1", "trainer.compile=true"]},
        depth_model=PAPER_BLOCK,
        depth_start=64,
        depth_max=4096,
        head=(8192, 1024, 50304),
        # micro-batch 4 x 2,048: by keel.gpu_memory ~45 GiB without activation checkpointing, so 80 GB GPUs fit too
        paper_model=["model=paper_d64"], paper_batch=4, paper_steps=30,
        multi=["model.depth=8", "model.width=512", "model.n_heads=8", "model.seq_len=512", "trainer.micro_batch_size=8",
               "trainer.accelerator=gpu"],
        fsdp=["model=paper_d64", "trainer.micro_batch_size=4", "trainer.accelerator=gpu", "trainer.compile=true"],
        data=["data=stdlib"],
    ),
    "cpu": Sizes(
        bench={"tiny: 2 blocks x 32": ["--depth", "2", "--width", "32", "--heads", "2", "--seq-len", "32", "--vocab",
                                       "512", "--batch", "4", "--steps", "2", "--warmup", "1", "--repeats", "1",
                                       "--threads", "1"]},
        bench_compile="off",
        pretrain_model=["model.depth=2", "model.width=32", "model.n_heads=2", "model.seq_len=32",
                        "model.vocab_size=512", "trainer.micro_batch_size=4", "trainer.threads=1"],
        pretrain_runs={"trainer=cpu": ["trainer=cpu", "trainer.compile=false"],
                       "trainer=fsdp devices=2": ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"]},
        depth_model=dict(width=32, n_heads=2, seq_len=32, vocab_size=512),
        depth_start=2,
        depth_max=8,  # no out-of-memory to find on a CPU: the doubling stops here
        head=(256, 32, 512),
        paper_model=["model.depth=2", "model.width=32", "model.n_heads=2", "model.seq_len=32", "model.vocab_size=512"],
        paper_batch=4, paper_steps=PAPER_WARMUP + 2,
        multi=["model.depth=2", "model.width=32", "model.n_heads=2", "model.seq_len=32", "model.vocab_size=512",
               "trainer.micro_batch_size=4", "trainer.threads=1", "trainer.accelerator=cpu"],
        fsdp=["model.depth=2", "model.width=32", "model.n_heads=2", "model.seq_len=32", "model.vocab_size=512",
              "trainer.micro_batch_size=4", "trainer.threads=1", "trainer.accelerator=cpu", "trainer.compile=false"],
        # 40-odd standard-library files, as tests/conftest.py's corpus: seconds to tokenize
        data=["data=text_files", "data.paths=[" + ",".join(f"{sysconfig.get_paths()['stdlib']}/{c}*.py" for c in "abc") + "]", "data.vocab_size=512",
              "data.val_fraction=0.3", "data.prepare_workers=1"],  # held-out files for the generated tasks (multi)
    ),
}
PRETRAIN_STEPS, RESUME_STEPS = 50, 5
# constant LR after warm-up: the resumed run's longer trainer.max_steps leaves the schedule unchanged
PRETRAIN_RECIPE = ["optim.schedule=linear_warmup", "optim.warmup_steps=10", "optim.lr=1e-3", "eval.enabled=false",
                   "trainer.log_every_n_steps=1", "trainer.progress_bar=false", "trainer.val_every_n_steps=25",
                   "trainer.val_batches=2", f"trainer.checkpoint_every_n_steps={PRETRAIN_STEPS}"]


def _keel(*argv: str, timeout: float, module: str = "keel.cli") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=timeout)


def _failed(done: subprocess.CompletedProcess) -> str | None:
    return None if done.returncode == 0 else f"exit {done.returncode}: {done.stderr[-2000:]}"


def _free_memory(dev: torch.device) -> None:
    """Between a section's runs: the last run's tensors collected and, on CUDA, the allocator's cached blocks
    returned to the device, so that the next run's peak memory is its own."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------------------- thresholds

# The compiled paper_d64 MFU floor on one GPU (bf16, activation checkpointing off): a floor, this project's choice,
# for want of a measurement: docs/distributed.md ("Expected MFU") reasons 40-55% on H100 / H200, unmeasured; 30% is
# its low end less a quarter. The reviewer's estimate of eager FSDP on 8 x H100 is ~29% (issue #41).
MFU_FLOOR = 0.30
MEMORY_TOLERANCE = 0.10  # measured peak within 10% of keel.gpu_memory's estimate (issue #41's bound)
SCALING_FLOOR = 0.85  # tokens/s per GPU on N GPUs over that on one: this project's choice for one NVLink node


def threshold(value: float | None, ok: bool, shown: str, bound: str, source: str) -> dict:
    """A figure held to a bound: printed as `shown (bound; source)`, failing the section when not ok."""
    return {"ok": ok, "value": value, "shown": shown, "threshold": bound, "source": source}


def skipped(reason: str) -> dict:
    return {"ok": True, "skipped": reason}


def mfu_threshold(run: dict, dev: torch.device) -> dict:
    if dev.type != "cuda":
        return skipped("cpu")
    if "mfu" not in run or run["mfu"] is None:
        return skipped(f"no spec-sheet peak for {device_name(dev)} (keel.flops)" if "mfu" in run else "did not run")
    return threshold(run["mfu"], run["mfu"] >= MFU_FLOOR, f"{run['mfu']:.1%}", f">= {MFU_FLOOR:.0%}",
                     "a floor, this project's choice: docs/distributed.md estimates 40-55%, unmeasured")


def memory_threshold(run: dict, dev: torch.device) -> dict:
    """max_memory_allocated against the estimate's terms that the caching allocator holds (all but its runtime
    allowance: the CUDA context and what lies outside the allocator are not in max_memory_allocated)."""
    if dev.type != "cuda":
        return skipped("cpu")
    if run.get("peak_memory_bytes") is None:
        return skipped("did not run")
    ratio = run["peak_memory_bytes"] / run["allocated_estimate_bytes"]
    return threshold(ratio, abs(ratio - 1) <= MEMORY_TOLERANCE,
                     f"{_mb(run['peak_memory_bytes'])} = {ratio:.2f} x the estimate {_mb(run['allocated_estimate_bytes'])}",
                     f"within {MEMORY_TOLERANCE:.0%}", "issue #41; keel.gpu_memory less its runtime allowance")


# ---------------------------------------------------------------------------------------------------- sections


def bench(device: str, sizes: Sizes, out: Path) -> dict:
    configs = {}
    for label, options in sizes.bench.items():
        path = out / f"bench-{len(configs)}.json"
        done = _keel("bench", "--device", device, "--dtype", "bf16", "--compile", sizes.bench_compile,
                     "--schemes", "keel,preln", *options, "--json", str(path), timeout=300)
        if error := _failed(done):
            configs[label] = {"ok": False, "error": error}
            continue
        result = json.loads(path.read_text())
        rows = {row["scheme"]: row for row in result["rows"]}
        configs[label] = {
            "ok": all(row["tokens_per_s"] > 0 for row in rows.values()),
            "peak_flops": result["peak_flops"], "peak_flops_source": result["peak_flops_source"],
            **{scheme: {key: row[key] for key in ("tokens_per_s", "mfu", "peak_memory_bytes", "ratio")}
               for scheme, row in rows.items()},
            "table": done.stdout.strip(),
        }
    return {"ok": all(c["ok"] for c in configs.values()), "configs": configs}


def pretrain(device: str, sizes: Sizes, out: Path, data: list[str]) -> dict:
    """Each trainer config: PRETRAIN_STEPS steps, then resume=auto for RESUME_STEPS more."""
    if error := _failed(_keel("data", *data, timeout=600)):
        return {"ok": False, "error": f"keel data: {error}"}
    runs = {}
    for label, trainer in sizes.pretrain_runs.items():
        run_dir = out / f"run-{len(runs)}"
        common = [*sizes.pretrain_model, *trainer, *PRETRAIN_RECIPE, *data, f"run.dir={run_dir}", "resume=auto"]
        start = time.perf_counter()
        error = _failed(_keel("pretrain", *common, f"trainer.max_steps={PRETRAIN_STEPS}", timeout=600))
        seconds = time.perf_counter() - start
        error = error or _failed(_keel("pretrain", *common, f"trainer.max_steps={PRETRAIN_STEPS + RESUME_STEPS}",
                                       timeout=300))
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
        runs[label] = {"ok": all(checks.values()), "checks": checks, "loss_first10": first, "loss_last10": last,
                       "loss_resumed": ordered[PRETRAIN_STEPS:], "seconds_50_steps": seconds,
                       "tokens_per_s": speed[max(speed)] if speed else None}
    return {"ok": all(r["ok"] for r in runs.values()), "runs": runs}


def _training_step_memory(cfg: ModelConfig, device: torch.device) -> tuple[int, int]:
    """(peak memory, parameters) of one bf16-autocast training step (micro-batch of 1 sequence, activation
    checkpointing, fused AdamW) of a freshly built model: CUDA's max allocated, or the peak RSS on CPU."""
    from keel.devices import reset_peak_resident, resident_bytes
    from keel.config import OptimConfig
    from keel.lit import make_optimizer
    from keel.parallel import apply_activation_checkpointing

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_resident()
    with torch.device(device):
        model = KeelLM(cfg)
    apply_activation_checkpointing(model)
    optimizer = make_optimizer(model, OptimConfig())
    batch = torch.randint(cfg.vocab_size, (1, cfg.seq_len + 1), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = next_token_loss(model, batch)
    loss.backward()
    optimizer.step()
    params = model.num_params()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), params
    return resident_bytes(peak=True), params


def depth(device: str, sizes: Sizes, out: Path) -> dict:
    """Double the depth until a step no longer fits (or depth_max); the last that fitted."""
    dev, tried, fitted = torch.device(device), [], None
    d = sizes.depth_start
    while d <= sizes.depth_max:
        cfg = ModelConfig(scheme="keel", depth=d, **sizes.depth_model)
        try:
            memory, params = _training_step_memory(cfg, dev)
        except torch.OutOfMemoryError:
            tried.append({"depth": d, "fits": False})
            break
        finally:
            _free_memory(dev)
        fitted = {"depth": d, "fits": True, "peak_memory_bytes": memory, "params": params}
        tried.append(fitted)
        d *= 2
    return {"ok": fitted is not None, "deepest": fitted, "tried": tried,
            "capacity_bytes": torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None}


def _sdpa_kernels(model: KeelLM, batch: torch.Tensor) -> list[str]:
    """The scaled-dot-product-attention implementations (aten ops: flash, cudnn, efficient, math) one training
    step dispatches to, from the profiler."""
    from torch.profiler import profile

    with profile() as prof, torch.autocast(batch.device.type, dtype=torch.bfloat16):
        next_token_loss(model, batch).backward()
    names = {event.key for event in prof.key_averages()}
    return sorted(name.removeprefix("aten::") for name in names
                  if name.startswith("aten::_scaled_dot_product") and not name.endswith("backward"))


def _paper_run(cfg, dev: torch.device, steps: int, out: Path) -> dict:
    """One model of cfg trained `steps` steps as `keel pretrain` trains it on one device (bf16 autocast, blocks
    compiled where trainer.compile, fused AdamW): the figures of the steps after PAPER_WARMUP."""
    from torch._dynamo.utils import counters

    from keel.checkpoint import AtomicCheckpointIO
    from keel.flops import device_peak_flops, flops_per_token
    from keel.gpu_memory import gpu_training_terms
    from keel.lit import make_optimizer
    from keel.parallel import parallelize

    counters.clear()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(0)
    with torch.device(dev):
        model = KeelLM(cfg.model)
    parallelize(model, cfg.trainer)
    optimizer = make_optimizer(model, cfg.optim)
    batch = torch.randint(cfg.model.vocab_size, (cfg.trainer.micro_batch_size, cfg.model.seq_len + 1), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times, losses = [], []
    for step in range(steps):
        sync()
        start = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = next_token_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronizes: the step is done
        if step >= PAPER_WARMUP:
            times.append(time.perf_counter() - start)
    step_s = sorted(times)[len(times) // 2]
    tokens_per_s = batch[:, 1:].numel() / step_s
    peak_flops = device_peak_flops(dev, torch.bfloat16)
    measured = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    terms = gpu_training_terms(cfg.model, cfg.trainer)
    estimate = sum(terms.values())
    kernels = _sdpa_kernels(model, batch)
    graphs = {"frames compiled": counters["frames"]["ok"], "unique graphs": counters["stats"]["unique_graphs"],
              "graph breaks": sum(counters["graph_break"].values())}
    path = out / "paper-checkpoint.ckpt"
    start = time.perf_counter()
    AtomicCheckpointIO().save_checkpoint({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    save_s, save_bytes = time.perf_counter() - start, path.stat().st_size
    path.unlink()
    learned = all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    # graph breaks and the kernels are findings to report, not failures: the run itself must learn
    return {"ok": learned, "loss_first": losses[0],
            "loss_last": losses[-1], "step_ms": 1e3 * step_s, "tokens_per_s": tokens_per_s,
            "mfu": None if peak_flops is None else flops_per_token(cfg.model) * tokens_per_s / peak_flops,
            "peak_memory_bytes": measured, "estimated_memory_bytes": estimate,
            "allocated_estimate_bytes": estimate - terms["runtime"],
            "estimate_over_measured": None if measured is None else estimate / measured, "sdpa": kernels,
            "compile": graphs, "checkpoint_save_s": save_s, "checkpoint_bytes": save_bytes}


def _paper_overrides(device: str, sizes: Sizes) -> list[str]:
    """The paper and callbacks sections' model, trainer and micro-batch (sizes.paper_* on CPU), bf16 autocast."""
    trainer = ["trainer=gpu", "trainer.compile=true"] if device == "cuda" else ["trainer=cpu", "trainer.compile=false"]
    return [*sizes.paper_model, *trainer, f"trainer.micro_batch_size={sizes.paper_batch}",
            "trainer.precision=bf16-mixed"]


def paper(device: str, sizes: Sizes, out: Path) -> dict:
    """The paper's model on one GPU, activation checkpointing off and on (sizes.paper_* on CPU)."""
    from keel.config import load_config

    dev, runs = torch.device(device), {}
    for checkpointing in (False, True):
        cfg = load_config(overrides=[*_paper_overrides(device, sizes),
                                     f"trainer.activation_checkpointing={str(checkpointing).lower()}"])
        label = f"activation checkpointing {'on' if checkpointing else 'off'}"
        try:
            runs[label] = _paper_run(cfg, dev, sizes.paper_steps, out)
        except torch.OutOfMemoryError as err:
            runs[label] = {"ok": False, "error": f"out of memory: {err}"}
        finally:
            _free_memory(dev)
    off, on = runs["activation checkpointing off"], runs["activation checkpointing on"]
    thresholds = {"MFU, compiled, checkpointing off": mfu_threshold(off, dev),
                  "peak memory, checkpointing off": memory_threshold(off, dev),
                  "peak memory, checkpointing on": memory_threshold(on, dev)}
    return {"ok": all(r["ok"] for r in (*runs.values(), *thresholds.values())), "paper_runs": runs,
            "thresholds": thresholds}


# The callbacks section's periodic callbacks fire every this many steps (grad_norms' default; layer_importance's is 200),
# so that each one's cost shows in a window of PAPER_STEPS - PAPER_WARMUP steps
CALLBACKS_EVERY = 10


class StepClock(Callback):
    """Seconds per optimizer step from step `start` to the last, the device synchronized only at the window's two
    ends: a synchronization per step would hide what the callbacks make the host wait for. Last in the callback
    list, so each step's time includes every other callback's work."""

    def __init__(self, start: int) -> None:
        self.start, self.began, self.seconds_per_step = start, None, None

    @staticmethod
    def _now(trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.began is None and trainer.global_step == self.start:
            self.began = self._now(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == trainer.max_steps:  # before the final checkpoint (on_train_end)
            self.seconds_per_step = (self._now(trainer) - self.began) / (trainer.global_step - self.start)


def callbacks(device: str, sizes: Sizes, out: Path, data: list[str]) -> dict:
    """`keel pretrain`'s step time (the paper section's model and batch, in this process) with every configurable
    callback on, with each one off in turn, and with all off: what each costs per step. The in-loop downstream
    evaluation runs between steps, after validation, and logs its own time (time/downstream_eval_s): it is off here,
    with validation."""
    from keel.callbacks.configs import CALLBACKS
    from keel.config import load_config
    from keel.training import train

    if error := _failed(_keel("data", *data, timeout=600)):
        return {"ok": False, "error": f"keel data: {error}"}
    steps = sizes.paper_steps
    common = [*_paper_overrides(device, sizes), *data, f"trainer.max_steps={steps}", "eval.enabled=false",
              "trainer.val_batches=2", f"trainer.val_every_n_steps={steps + 1}",
              f"trainer.checkpoint_every_n_steps={steps + 1}",
              f"callbacks.layer_importance.every_n_steps={CALLBACKS_EVERY}",
              f"callbacks.grad_norms.every_n_steps={CALLBACKS_EVERY}"]
    names = [c.name for c in CALLBACKS]
    variants = {"all on": [], **{f"{name} off": [f"callbacks.{name}.enabled=false"] for name in names},
                "progress bar off": ["trainer.progress_bar=false"],
                "all off": [*(f"callbacks.{name}.enabled=false" for name in names), "trainer.progress_bar=false"]}
    runs = {}
    for index, (label, overrides) in enumerate(variants.items()):
        run_dir = out / f"callbacks-{index}"
        clock = StepClock(PAPER_WARMUP)
        try:
            train(load_config(overrides=[*common, *overrides, f"run.dir={run_dir}"]), [clock])
            runs[label] = ({"ok": True, "step_ms": 1e3 * clock.seconds_per_step} if clock.seconds_per_step
                           else {"ok": False, "error": "stopped before its last step: not timed"})
        except torch.OutOfMemoryError as err:
            runs[label] = {"ok": False, "error": f"out of memory: {err}"}
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)  # the paper model's checkpoint: ~10 GB a run
            _free_memory(torch.device(device))
    if runs["all on"]["ok"]:
        for run in (run for run in runs.values() if run["ok"]):
            run["cost_ms"] = runs["all on"]["step_ms"] - run["step_ms"]  # of what this variant turned off
    return {"ok": all(r["ok"] for r in runs.values()), "callback_runs": runs, "timed_steps": steps - PAPER_WARMUP}


MULTI_STEPS = 10
# fp32 (so that the strategies can be held to each other), a checkpoint and a validation halfway, no compile
# the global gradient norm of each step (the same global batch whatever the split: train/loss is rank 0's share)
MULTI_RECIPE = ["trainer.precision=32-true", "trainer.compile=false", "eval.enabled=false", "optim.warmup_steps=2",
                "optim.schedule=linear_warmup",  # a run stopped halfway has the same LRs as one straight through
                "callbacks.grad_norms.every_n_steps=1",
                "trainer.log_every_n_steps=1", "trainer.progress_bar=false", "trainer.val_batches=2",
                f"trainer.val_every_n_steps={MULTI_STEPS // 2}", f"trainer.checkpoint_every_n_steps={MULTI_STEPS // 2}"]


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
    if error := _failed(_keel("data", *data, timeout=600)):
        return {"ok": False, "error": f"keel data: {error}"}

    def pretrain(name: str, *overrides: str, steps: int = MULTI_STEPS) -> tuple[Path, subprocess.CompletedProcess]:
        run_dir = out / f"multi-{name}"
        done = _keel("pretrain", *sizes.multi, *MULTI_RECIPE, *data, *overrides, f"trainer.max_steps={steps}",
                     f"run.dir={run_dir}", "resume=auto", timeout=900)
        return run_dir, done

    ddp, fsdp = ["trainer=ddp", f"trainer.devices={n}"], ["trainer=fsdp", f"trainer.devices={n}"]
    runs, errors = {}, {}
    for name, overrides in ((f"ddp x {n}", ddp), (f"fsdp x {n}", fsdp)):
        run_dir, done = pretrain(name.split()[0], *overrides)
        runs[name], errors[name] = _global_grad_norms(run_dir), _failed(done)
    # Stopped at step MULTI_STEPS / 2, then resumed: DDP's checkpoint on one device (the global batch split over
    # gradient accumulation: the data stream continues where the n devices left it), FSDP's sharded one on the same
    # devices and, on GPUs, on half of them (on CPU FSDP needs 2 processes: no half of 2)
    resumes = {"1 device": (ddp, ["trainer=ddp", "trainer.devices=1", f"trainer.grad_accum={n}"], f"ddp x {n}", 1e-4),
               "fsdp resumed": (fsdp, fsdp, f"fsdp x {n}", 1e-5)}
    if device == "cuda":
        half = ["trainer=fsdp", f"trainer.devices={n // 2}", f"trainer.grad_accum={n // (n // 2)}"]
        resumes[f"fsdp resumed on {n // 2}"] = (fsdp, half, f"fsdp x {n}", 1e-4)
    resumed = {}
    for index, (label, (first, then, straight, rel)) in enumerate(resumes.items()):
        run_dir, done = pretrain(f"resumed-{index}", *first, steps=MULTI_STEPS // 2)
        errors[f"{label}: first half"] = _failed(done)
        run_dir, done = pretrain(f"resumed-{index}", *then)
        errors[f"{label}: second half"] = _failed(done)
        runs[label] = _global_grad_norms(run_dir)
        resumed[f"{label} = {straight} (rel {rel:.0e})"] = _close(runs[label], runs[straight], rel)
    evaluated, done = pretrain("eval", "trainer=ddp", f"trainer.devices={n}", "eval=generated", "eval.enabled=true",
                               "eval.limit=20", f"eval.every_n_steps={MULTI_STEPS}", steps=MULTI_STEPS)
    errors["ddp evaluation"] = _failed(done)
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
    return {"ok": all(checks.values()), "checks": checks, "devices": n, "global_grad_norms": runs,
            "errors": {k: v for k, v in errors.items() if v}}


FSDP_STEPS, FSDP_LOG_EVERY = 40, 5
GUARD_FROM = 10  # the first steps compile, initialize FSDP lazily and make Lightning's logging state: not guarded
SYNC_WARNING = "called a synchronizing CUDA operation"
# the in-loop evaluation and validation (with a checkpoint) at logging steps, where the host may wait; the periodic
# callbacks log there too; the throughput window: the last 20 steps
FSDP_RECIPE = ["trainer.precision=bf16-mixed", "eval=generated", "eval.enabled=true", "eval.limit=20",
               f"eval.every_n_steps={FSDP_STEPS // 2}", f"trainer.val_every_n_steps={FSDP_STEPS // 2}",
               f"trainer.checkpoint_every_n_steps={FSDP_STEPS // 2}", "trainer.val_batches=2",
               f"trainer.log_every_n_steps={FSDP_LOG_EVERY}", f"callbacks.grad_norms.every_n_steps={FSDP_LOG_EVERY}",
               f"callbacks.layer_importance.every_n_steps={FSDP_LOG_EVERY}", "callbacks.grad_norms.heatmap_every_n_steps=0",
               f"callbacks.throughput.window={FSDP_STEPS // 2}", "trainer.progress_bar=false",
               f"trainer.max_steps={FSDP_STEPS}"]


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


def _guarded_pretrain(argv: list[str]) -> int:
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
    done = _keel(*sizes.fsdp, *FSDP_RECIPE, *data, "trainer=fsdp", f"trainer.devices={n}", f"run.dir={run_dir}",
                 timeout=1800, module="keel.gpu_check")
    scalars = read_scalars(run_dir, ["train/loss", "perf/tokens_per_s_per_device", "perf/mfu"])
    history = run_dir / "eval_history.json"
    syncs = [json.loads(path.read_text()) for path in sorted(run_dir.glob("host_syncs-rank*.json"))]
    result = {"error": _failed(done),
              "loss_finite": bool(scalars.get("train/loss")) and all(math.isfinite(v) for _, v in scalars["train/loss"]),
              "evaluated": history.is_file() and bool(json.loads(history.read_text())["evaluations"]),
              **{key: values[-1][1] if (values := scalars.get(tag)) else None
                 for key, tag in (("tokens_per_s_per_device", "perf/tokens_per_s_per_device"), ("mfu", "perf/mfu"))},
              "host_syncs": syncs}
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the paper model's: ~10 GB
    return result


def fsdp(device: str, sizes: Sizes, out: Path, data: list[str]) -> dict:
    """bf16 FSDP, compiled on GPUs, the in-loop evaluation on: on every GPU (2 CPU processes with --device cpu),
    then on one GPU for the scaling efficiency; host syncs outside logging steps counted on CUDA."""
    if error := _failed(_keel("data", *data, timeout=600)):
        return {"ok": False, "error": f"keel data: {error}"}
    n = torch.cuda.device_count() if device == "cuda" else 2
    runs = {f"fsdp x {n}": _fsdp_run(sizes, out, data, n)}
    if device == "cuda" and n > 1:
        runs["fsdp x 1"] = _fsdp_run(sizes, out, data, 1)
    every, one = runs[f"fsdp x {n}"], runs.get("fsdp x 1")
    label = f"bf16 FSDP x {n}, {'compiled' if device == 'cuda' else 'eager on CPU'}, in-loop evaluation"
    checks = {f"{label}: trained, loss finite": every["error"] is None and every["loss_finite"],
              f"{label}: evaluation written": every["evaluated"]}
    if device != "cuda":
        syncs, scaling = skipped("cpu (tests/test_host_syncs.py checks the step on CPU)"), skipped("cpu")
    else:
        found = sum(r["syncs"] for r in every["host_syncs"])
        guarded = sum(r["guarded_steps"] for r in every["host_syncs"])
        where = sorted({w for r in every["host_syncs"] for w in r["where"]})
        syncs = threshold(found, len(every["host_syncs"]) == n and guarded > 0 and found == 0,
                          f"{found} in {guarded} rank-steps" + (f" at {', '.join(where)}" if where else ""),
                          "= 0", "issue #41: the host waits at logging steps only (CUDA sync debug mode)")
        if one is None:
            scaling = skipped(f"{n} GPU visible: scaling needs 2 or more")
        elif every["tokens_per_s_per_device"] and one["tokens_per_s_per_device"]:
            efficiency = every["tokens_per_s_per_device"] / one["tokens_per_s_per_device"]
            scaling = threshold(efficiency, efficiency >= SCALING_FLOOR,
                                f"{efficiency:.1%} ({every['tokens_per_s_per_device']:,.0f} against "
                                f"{one['tokens_per_s_per_device']:,.0f} tok/s per GPU)", f">= {SCALING_FLOOR:.0%}",
                                "this project's choice for one node")
        else:
            scaling = threshold(None, False, "no tokens/s logged", f">= {SCALING_FLOOR:.0%}", "a run failed")
    thresholds = {"host syncs per step outside logging steps": syncs, f"FSDP scaling efficiency, 1 -> {n}": scaling}
    errors = {label: run["error"] for label, run in runs.items() if run["error"]}
    return {"ok": all(checks.values()) and all(t["ok"] for t in thresholds.values()), "checks": checks,
            "thresholds": thresholds, "devices": n, "fsdp_runs": runs, "errors": errors}


CHECKPOINT_STEPS, CHECKPOINT_EVERY = 30, 10  # 3 saves, the last at the end of training
SAVES = "saves.json"  # RunCheckpoint.saves of a run, written by _guarded_pretrain
ASYNC_BLOCKING_MAX = 0.5  # a save in the background holds the loop at most half as long as a synchronous one: our choice
CHECKPOINT_RECIPE = ["trainer.precision=bf16-mixed", "eval.enabled=false", "trainer.progress_bar=false",
                     f"trainer.max_steps={CHECKPOINT_STEPS}", f"trainer.checkpoint_every_n_steps={CHECKPOINT_EVERY}",
                     f"trainer.val_every_n_steps={CHECKPOINT_STEPS}", "trainer.val_batches=2"]


def _save_run(sizes: Sizes, out: Path, data: list[str], n: int, background: bool) -> dict:
    """One FSDP run on n devices saving synchronously or in the background: its saves' median figures."""
    run_dir = out / f"checkpoint-{'async' if background else 'sync'}"
    shutil.rmtree(run_dir, ignore_errors=True)
    done = _keel(*sizes.fsdp, *CHECKPOINT_RECIPE, *data, "trainer=fsdp", f"trainer.devices={n}",
                 f"trainer.async_checkpoint={str(background).lower()}", f"run.dir={run_dir}", timeout=1800,
                 module="keel.gpu_check")
    saves = json.loads((run_dir / SAVES).read_text()) if (run_dir / SAVES).is_file() else []
    last = run_dir / "checkpoints" / "last.ckpt"
    result = {"error": _failed(done), "saves": len(saves), "whole": all("total_s" in save for save in saves),
              "bytes": sum(f.stat().st_size for f in last.iterdir()) if last.is_dir() else None,
              **{key: statistics.median(save[key] for save in saves) if saves else None
                 for key in ("blocking_s", "waited_s", "total_s") if all(key in save for save in saves)}}
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the paper model's: ~10 GB each
    return result


def checkpoint(device: str, sizes: Sizes, out: Path, data: list[str]) -> dict:
    """The fsdp section's model saved under FSDP on every GPU (2 CPU processes with --device cpu), synchronously
    and in the background (trainer.async_checkpoint): per save (medians of CHECKPOINT_STEPS / CHECKPOINT_EVERY) the
    seconds the save held the training loop, the seconds a later save or the end of training waited for the write,
    the seconds until the checkpoint was whole, and its bytes; threshold (GPU): the background save holds the loop
    at most ASYNC_BLOCKING_MAX of the synchronous one's time."""
    if error := _failed(_keel("data", *data, timeout=600)):
        return {"ok": False, "error": f"keel data: {error}"}
    n = torch.cuda.device_count() if device == "cuda" else 2
    runs = {"sync": _save_run(sizes, out, data, n, False), "async": _save_run(sizes, out, data, n, True)}
    saves = CHECKPOINT_STEPS // CHECKPOINT_EVERY
    checks = {f"{mode} x {n}: trained, {saves} checkpoints whole": run["error"] is None and run["saves"] == saves
              and run["whole"] for mode, run in runs.items()}
    sync, background = runs["sync"], runs["async"]
    if device != "cuda":
        held = skipped("cpu (tests/test_async_checkpoint.py checks the saves on CPU)")
    elif sync.get("blocking_s") and background.get("blocking_s") is not None:
        ratio = background["blocking_s"] / sync["blocking_s"]
        held = threshold(ratio, ratio <= ASYNC_BLOCKING_MAX, f"{background['blocking_s']:.2f} s against "
                         f"{sync['blocking_s']:.2f} s ({ratio:.0%}; {_mb(sync['bytes'])} per checkpoint)",
                         f"<= {ASYNC_BLOCKING_MAX:.0%}", "this project's choice")
    else:
        held = threshold(None, False, "no save timed", f"<= {ASYNC_BLOCKING_MAX:.0%}", "a run failed")
    figures = {mode: {key: run.get(key) for key in ("bytes", "blocking_s", "waited_s", "total_s")}
               for mode, run in runs.items()}
    return {"ok": all(checks.values()) and held["ok"], "checks": checks, "devices": n, "saves": figures,
            "thresholds": {"save held the loop, async / sync": held},
            "errors": {mode: run["error"] for mode, run in runs.items() if run["error"]}}


def sublayers(model: KeelLM) -> list[torch.nn.Module]:
    return [sub for block in model.blocks for sub in (block.attn, block.ffn)]


def sublayer_update_error(model: KeelLM, idx: torch.Tensor, bf16_stream: bool) -> tuple[float, float]:
    """(relative logits error, median relative error of the per-sublayer stream update out - in) of a bf16
    autocast forward against the fp32 forward, on idx's device. bf16_stream rounds every sublayer output and every
    outer norm's input to bf16: what a model whose residual stream is bf16 computes."""

    def run(autocast: bool):
        updates: list[torch.Tensor] = []
        handles = []
        if bf16_stream and autocast:
            for sub in sublayers(model):
                handles.append(sub.register_forward_hook(lambda m, args, out: out.bfloat16().float()))
                if sub.norm_out is not None:
                    handles.append(sub.norm_out.register_forward_pre_hook(lambda m, args: (args[0].bfloat16().float(),)))
        for sub in sublayers(model):  # registered last: sees the rounded output
            handles.append(sub.register_forward_hook(lambda m, args, out: updates.append(out - args[0])))
        with torch.no_grad(), torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(idx).float()
        for handle in handles:
            handle.remove()
        return logits, updates

    (ref_logits, ref_updates), (logits, updates) = run(False), run(True)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    update_errors = torch.tensor([rel(u, r) for u, r in zip(updates[2:], ref_updates[2:])])  # Keel blocks only
    return rel(logits, ref_logits), float(update_errors.median())


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _residual_stream(dev: torch.device) -> dict:
    torch.manual_seed(0)
    model = KeelLM(ModelConfig(width=32, n_heads=2, seq_len=16, vocab_size=64, depth=128, init="unit")).to(dev)
    idx = torch.randint(64, (2, 16), device=dev)
    logits_err, update_err = sublayer_update_error(model, idx, bf16_stream=False)
    _, control_err = sublayer_update_error(model, idx, bf16_stream=True)
    # the CPU test's bounds (tests/test_model.py): updates kept to < 2%, while a bf16 stream loses > 30% of them
    return {"ok": update_err < 0.02 and logits_err < 0.01 and control_err > 0.3, "logits_error": logits_err,
            "update_error": update_err, "bf16_stream_update_error": control_err}


def _rmsnorm(dev: torch.device) -> dict:
    from keel.model import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(1024, eps=1e-5).to(dev)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x, skip = (torch.randn(4, 256, 1024, device=dev, requires_grad=True) for _ in range(2))
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        out = norm(x, skip, 32.0)
    grads = torch.autograd.grad(out, (x, skip, norm.weight), torch.ones_like(out))
    exact = [t.detach().double().requires_grad_() for t in (x, skip, norm.weight)]
    ref = F.rms_norm(exact[0] + 32.0 * exact[1], (1024,), exact[2], 1e-5)
    ref_grads = torch.autograd.grad(ref, exact, torch.ones_like(ref))
    errors = [_relative(out, ref), *(_relative(g, r) for g, r in zip(grads, ref_grads))]
    return {"ok": out.dtype == torch.float32 and max(errors) < 1e-5, "dtype": str(out.dtype),
            "max_relative_error": max(errors)}


def _loss_head(dev: torch.device, tokens: int, width: int, vocab: int) -> dict:
    from keel.ops.chunked_ce import default_chunk, linear_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(tokens, width, device=dev)
    weight = torch.randn(vocab, width, device=dev) * width**-0.5
    targets = torch.randint(vocab, (tokens,), device=dev)
    results = []
    for chunk in (0, default_chunk(dev)):
        leaves = [t.clone().requires_grad_() for t in (x, weight)]
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = linear_cross_entropy(leaves[0], leaves[1], targets, chunk)
        loss.backward()
        results.append([loss.detach(), leaves[0].grad, leaves[1].grad])
    errors = [_relative(c, p) for c, p in zip(results[1], results[0])]
    dtypes = [str(t.dtype) for t in results[1]]
    # tests/test_ops.py's bound for bf16 products against the plain head
    return {"ok": max(errors) < 2e-2 and dtypes == ["torch.float32"] * 3, "chunk": default_chunk(dev),
            "relative_errors": errors, "dtypes": dtypes}


def _fsdp_policy(dev: torch.device) -> dict:
    """One-process FSDP2 with keel's bf16-mixed policy under autocast, then a fused AdamW step on its DTensors."""
    import torch.distributed as dist
    from lightning.fabric.plugins.environments.lightning import find_free_network_port
    from torch.distributed.device_mesh import init_device_mesh

    from keel.config import OptimConfig, load_config
    from keel.lit import make_optimizer
    from keel.parallel import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_network_port()))
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(dev.type, (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        cfg = load_config(overrides=["model.depth=2", "model.width=64", "model.n_heads=2", "model.seq_len=32",
                                     "model.vocab_size=512", "trainer.precision=bf16-mixed"])
        torch.manual_seed(0)
        with torch.device(dev):
            model = KeelLM(cfg.model)
        parallelize(model, cfg.trainer, mesh)
        seen = []
        model.blocks[1].register_forward_pre_hook(
            lambda block, args: seen.append((str(args[0].dtype), str(block.ffn.branch.up.weight.dtype))))
        optimizer = make_optimizer(model, OptimConfig())
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        batch = torch.randint(512, (4, 33), device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = next_token_loss(model, batch)
        loss.backward()
        grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
        optimizer.step()
        moved = all(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, model.parameters()))
        finite = all(p.detach().full_tensor().isfinite().all() for p in model.parameters())
    finally:
        dist.destroy_process_group()
    ok = seen == [("torch.float32", "torch.bfloat16")] and grad_dtypes == ["torch.float32"] and moved and finite
    return {"ok": ok, "block_input_and_weight_dtypes": seen, "grad_dtypes": grad_dtypes,
            "fused_adamw_updated_every_parameter": moved, "finite": finite}


def precision(device: str, sizes: Sizes, out: Path) -> dict:
    dev = torch.device(device)
    checks = {"fp32 residual stream": _residual_stream(dev), "RMSNorm dispatch": _rmsnorm(dev),
              "chunked loss head": _loss_head(dev, *sizes.head), "FSDP2 bf16 policy": _fsdp_policy(dev)}
    return {"ok": all(c["ok"] for c in checks.values()), "checks": checks}


SECTIONS = {"bench": bench, "pretrain": pretrain, "depth": depth, "paper": paper, "callbacks": callbacks,
            "multi": multi, "fsdp": fsdp, "checkpoint": checkpoint, "precision": precision}


# ------------------------------------------------------------------------------------------------------ report


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f} MB"


def table(result: dict) -> str:
    lines = [f"keel gpu-check: {result['device_name']}, torch {result['torch']}, {result['seconds']:.0f} s: "
             f"{'PASS' if result['ok'] else 'FAIL'}", ""]
    for name, section in result["sections"].items():
        lines.append(f"[{'ok' if section['ok'] else 'FAIL'}] {name} ({section['seconds']:.0f} s)")
        if "error" in section:
            lines.append(f"    error: {section['error'].splitlines()[-1] if section['error'] else ''}")
        for label, config in section.get("configs", {}).items():
            lines.append(f"    {label}: " + ("; ".join(
                f"{scheme} {config[scheme]['tokens_per_s']:,.0f} tok/s, MFU {config[scheme]['mfu']:.1%}, "
                f"peak {_mb(config[scheme]['peak_memory_bytes'])}" for scheme in ("keel", "preln"))
                if config["ok"] else f"FAIL {config['error'].splitlines()[-1]}"))
        for label, run in section.get("runs", {}).items():
            lines.append(f"    {label}: " + (
                f"loss {run['loss_first10']:.3f} -> {run['loss_last10']:.3f} (means of the first / last 10 steps), "
                f"resumed {run['loss_resumed'][0]:.3f}, {run['seconds_50_steps']:.0f} s for 50 steps"
                if "checks" in run else "FAIL " + run["error"].splitlines()[-1]))
            lines += [f"        {'ok' if passed else 'FAIL'}: {check}" for check, passed in run.get("checks", {}).items()]
        for label, run in section.get("paper_runs", {}).items():
            lines.append(f"    {label}: " + (
                f"{run['step_ms']:,.0f} ms/step, {run['tokens_per_s']:,.0f} tok/s, MFU "
                + ("-" if run["mfu"] is None else f"{run['mfu']:.1%}")
                + f", peak {_mb(run['peak_memory_bytes'])} (estimate {_mb(run['estimated_memory_bytes'])}), "
                f"SDPA {','.join(run['sdpa'])}, {json.dumps(run['compile'])}, checkpoint "
                f"{_mb(run['checkpoint_bytes'])} in {run['checkpoint_save_s']:.1f} s, loss {run['loss_first']:.3f} -> "
                f"{run['loss_last']:.3f}" if "step_ms" in run else "FAIL " + run["error"].splitlines()[-1]))
        for label, run in section.get("callback_runs", {}).items():
            lines.append(f"    {label}: " + (f"{run['step_ms']:,.1f} ms/step" + (
                f" (what it turned off: {run['cost_ms']:+,.1f} ms/step)" if label != "all on" and "cost_ms" in run
                else "") if run["ok"] else "FAIL " + run["error"].splitlines()[-1]))
        if section.get("deepest"):
            deepest = section["deepest"]
            lines.append(f"    deepest fitting: {deepest['depth']} blocks ({deepest['params']:,} parameters), "
                         f"peak {_mb(deepest['peak_memory_bytes'])}; tried "
                         + ", ".join(f"{t['depth']}{'' if t['fits'] else ' (out of memory)'}" for t in section["tried"]))
        if "skipped" in section:
            lines.append(f"    skipped: {section['skipped']}")
        for label, run in section.get("fsdp_runs", {}).items():
            lines.append(f"    {label}: " + ("FAIL " + run["error"].splitlines()[-1] if run["error"] else
                         "tokens/s per device " + ("-" if run["tokens_per_s_per_device"] is None else
                                                   f"{run['tokens_per_s_per_device']:,.0f}")
                         + ", MFU " + ("-" if run["mfu"] is None else f"{run['mfu']:.1%}")))
        for mode, save in section.get("saves", {}).items():
            lines.append(f"    {mode} save: {_mb(save['bytes'])}, " + ", ".join(
                f"{key.removesuffix('_s')} " + ("-" if save[key] is None else f"{save[key]:.2f} s")
                for key in ("blocking_s", "waited_s", "total_s")))
        for label, row in section.get("thresholds", {}).items():
            lines.append(f"    [skipped] {label}: {row['skipped']}" if "skipped" in row else
                         f"    [{'ok' if row['ok'] else 'FAIL'}] {label}: {row['shown']} "
                         f"(threshold {row['threshold']}: {row['source']})")
        for label, check in section.get("checks", {}).items():
            if isinstance(check, bool):  # the multi section's checks
                lines.append(f"    [{'ok' if check else 'FAIL'}] {label}")
                continue
            figures = {k: v for k, v in check.items() if k != "ok"}
            lines.append(f"    [{'ok' if check['ok'] else 'FAIL'}] {label}: {json.dumps(figures)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keel gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default="out/gpu-check", help="where gpu_check.json and the runs go")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("data", nargs="*", help="data.* overrides for the pretrain runs (default: data=stdlib on "
                        "cuda, a few standard-library files on cpu; built under --out)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible; run `make gpu-check DEVICE=cpu` for the CPU version")
    names = [name for name in args.sections.split(",") if name]
    if unknown := [name for name in names if name not in SECTIONS]:
        raise ConfigError(f"--sections: unknown {', '.join(unknown)}; allowed: {', '.join(SECTIONS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sizes = SIZES[args.device]
    data = args.data or [*sizes.data, f"data.dir={out / 'data'}"]
    start, sections = time.perf_counter(), {}
    for name in names:
        section_start = time.perf_counter()
        extra = (data,) if name in ("pretrain", "callbacks", "multi", "fsdp", "checkpoint") else ()
        try:
            sections[name] = SECTIONS[name](args.device, sizes, out, *extra)
        except Exception as err:  # a broken path is this check's finding, not the end of the others
            sections[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        sections[name]["seconds"] = time.perf_counter() - section_start
        print(f"keel gpu-check: {name} {'ok' if sections[name]['ok'] else 'FAILED'}", file=sys.stderr)
    result = {"device": args.device, "device_name": device_name(torch.device(args.device)), "torch": torch.__version__,
              "seconds": time.perf_counter() - start, "ok": all(s["ok"] for s in sections.values()),
              "sections": sections}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(_guarded_pretrain(sys.argv[1:]))
