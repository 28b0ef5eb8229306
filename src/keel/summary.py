"""What `keel pretrain` prints before training: the model (parameters, depth, L, alpha, FLOPs/token) and the run
plan (steps, tokens, tokens per parameter, precision, strategy, world size, threads; on GPUs torch's CUDA build
and the driver); and the line it ends with."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import torch

from keel.artifacts import TENSORBOARD
from keel.checkpoint.layout import LAST, checkpoint_dir
from keel.checkpoint.resume import batch_layout
from keel.config import Config, resolve_accelerator, resolve_precision
from keel.config.model import formulas, init_description, sublayer_specs
from keel.flops import flops_per_token
from keel.model import KeelLM


def alphas(cfg) -> str:
    """The residual scales of the scheme and how many sublayers use each, e.g. `1 (2 sublayers), 32 (30 sublayers)`."""
    counts = Counter(spec.alpha for block in sublayer_specs(cfg) for spec in block)
    return ", ".join(f"{alpha:.4g} ({n} sublayers)" for alpha, n in counts.items())


def sublayers(cfg) -> str:
    """The scheme's sublayer formulas with their counts, e.g. `x + F(Norm_in(x)) (2), Norm_out(32 x + ...) (30)`."""
    return ", ".join(f"{formula} ({n})" for formula, n in formulas(cfg))


def model_summary(model: KeelLM) -> list[str]:
    c = model.cfg
    params = model.num_params()
    return [
        f"model       {c.scheme}: depth {c.depth} blocks (L = {c.n_sublayers} sublayers), width {c.width}, "
        f"{c.n_heads} heads ({c.kv_heads} KV), {c.ffn} FFN {c.ffn_hidden}, seq_len {c.seq_len}, vocab {c.vocab_size}",
        f"parameters  {params:,} ({model.num_params(embeddings=False):,} non-embedding)",
        f"alpha       {alphas(c)}",
        f"sublayers   {sublayers(c)}",
        f"init        {init_description(c)}",
        f"FLOPs/token {flops_per_token(c):.3g} (training: forward + backward)",
    ]


def run_plan(cfg: Config, params: int) -> list[str]:
    t = cfg.trainer
    global_tokens_per_step = t.world_size * cfg.device_tokens_per_step
    tokens = t.max_steps * global_tokens_per_step
    lines = [
        f"steps       {t.max_steps:,} x {global_tokens_per_step:,} tokens = {tokens:,} tokens "
        f"({tokens / params:.3g} tokens/parameter, {tokens * flops_per_token(cfg.model):.3g} FLOPs)",
        f"batch       {batch_layout(t)} sequences of {cfg.model.seq_len} tokens",
        f"hardware    {resolve_accelerator(t)}, precision {resolve_precision(t)}, strategy {t.resolved_strategy}, "
        f"world size {t.world_size}, {torch.get_num_threads()} intra-op thread(s) per process"
        + (", torch.compile per block (compiled during the first steps)" if t.compile else ""),
    ]
    if resolve_accelerator(t) == "gpu":  # what to compare when a cluster's driver and torch's build disagree
        lines.append(
            f"cuda        torch {torch.__version__} built for CUDA {torch.version.cuda}, "
            f"NVIDIA driver {nvidia_driver_version()}"
        )
    return lines


def nvidia_driver_version() -> str:
    """The NVIDIA driver's version (e.g. 550.54.15): from NVML through pynvml where it is installed, else from
    nvidia-smi, else "unknown" - a line of the summary, never a reason to fail."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # pynvml missing (ImportError) or NVML unusable (pynvml.NVMLError): ask nvidia-smi
        pass
    try:
        query = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):  # not on PATH, failed or hung
        return "unknown"
    return next(iter(query.stdout.split()), "unknown")  # one line per GPU, all the same driver


def run_places(cfg: Config) -> list[str]:
    """Where the run writes and how to watch it: the run directory, the checkpoint cadence, the TensorBoard
    command (with the tensorboard logger) and the evaluation cadence."""
    t = cfg.trainer
    kept = f" (and the newest {t.keep_last_k} step-numbered)" if t.keep_last_k else ""
    lines = [
        f"run dir     {cfg.run.dir} (config.yaml, checkpoints/, logs; one run per directory)",
        f"checkpoints every {t.checkpoint_every_n_steps:,} steps and at the end: {checkpoint_dir(cfg) / LAST}{kept}",
        f"validation  every {t.val_every_n_steps:,} steps and at the end ({t.val_batches} batch(es))"
        + (f"; downstream tasks every {cfg.eval.every_n_steps:,} steps" if cfg.eval.enabled else ""),
    ]
    if "tensorboard" in t.loggers:
        tensorboard = Path(cfg.run.dir) / TENSORBOARD
        lines.append(f"tensorboard tensorboard --logdir {tensorboard}  (then http://localhost:6006)")
    return lines


def run_summary(cfg: Config, model: KeelLM) -> str:
    return "\n".join([*model_summary(model), *run_plan(cfg, model.num_params()), *run_places(cfg)])


def run_result(cfg: Config, step: int, heldout: dict | None, saved_step: int | None) -> str:
    """The line a run that was not interrupted ends with: the step it reached, its last held-out loss
    (KeelLitModule.heldout) and the step last.ckpt holds, if this run wrote it."""
    loss = f"val/loss {heldout['loss']:.4f} at step {heldout['step']}" if heldout else "not validated"
    saved = (
        f"checkpoint {checkpoint_dir(cfg) / LAST} (step {saved_step})"
        if saved_step is not None
        else "no checkpoint written by this run"
    )
    return f"end         step {step} of {cfg.trainer.max_steps}, {loss}; {saved}"
