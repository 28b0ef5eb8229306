"""What `keel pretrain` prints before training: the model (parameters, depth, L, alpha, FLOPs/token) and the run
plan (steps, tokens, tokens per parameter, precision, strategy, world size, threads); and the line it ends with."""

from __future__ import annotations

from collections import Counter

import torch

from keel.checkpoint import LAST, batch_layout, checkpoint_dir
from keel.config import Config
from keel.flops import flops_per_token
from keel.model import KeelLM
from keel.parallel import resolve_accelerator, resolve_precision
from keel.schemes import formulas, init_description, sublayer_specs


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
        f"model       {c.scheme}: depth {c.depth} blocks (L = {c.L} sublayers), width {c.width}, {c.n_heads} heads "
        f"({c.kv_heads} KV), {c.ffn} FFN {c.ffn_hidden}, seq_len {c.seq_len}, vocab {c.vocab_size}",
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
    return [
        f"steps       {t.max_steps:,} x {global_tokens_per_step:,} tokens = {tokens:,} tokens "
        f"({tokens / params:.3g} tokens/parameter, {tokens * flops_per_token(cfg.model):.3g} FLOPs)",
        f"batch       {batch_layout(t)} sequences of {cfg.model.seq_len} tokens",
        f"hardware    {resolve_accelerator(t)}, precision {resolve_precision(t)}, strategy {t.resolved_strategy}, world size "
        f"{t.world_size}, {torch.get_num_threads()} intra-op thread(s) per process"
        + (", torch.compile per block (compiled during the first steps)" if t.compile else ""),
    ]


def run_summary(cfg: Config, model: KeelLM) -> str:
    return "\n".join([*model_summary(model), *run_plan(cfg, model.num_params())])


def run_result(cfg: Config, step: int, heldout: dict | None, saved_step: int | None) -> str:
    """The line a run that was not interrupted ends with: the step it reached, its last held-out loss
    (KeelLitModule.heldout) and the step last.ckpt holds, if this run wrote it."""
    loss = f"val/loss {heldout['loss']:.4f} at step {heldout['step']}" if heldout else "not validated"
    saved = (f"checkpoint {checkpoint_dir(cfg) / LAST} (step {saved_step})" if saved_step is not None
             else "no checkpoint written by this run")
    return f"end         step {step} of {cfg.trainer.max_steps}, {loss}; {saved}"
