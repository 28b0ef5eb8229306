"""Will it fit on the GPU? The memory one training process needs on its GPU, estimated from the config before
anything is allocated (keel.memory does the same for CPU runs), and a run that exceeds the GPU's memory refused at
start-up with the estimate and the keys to change (docs/model.md, "Memory estimate"). Not measured on a GPU yet:
the activation terms were counted on CPU, the runtime term is an allowance.

    model state    weights, gradients and AdamW state by precision (STATE_BYTES), 1 / world size under FSDP; DDP's
                   gradient buckets; the bf16 weight copies autocast saves for backward, or FSDP's gathered units
    activations    what autograd keeps per token and block (block_bytes_per_token) x micro-batch tokens x depth;
                   a checkpointed block keeps its fp32 input, and one block's are recomputed at a time
    loss head      one chunk's logits (model.loss_chunk; the full logits under the plain head)
    runtime        CUDA context, cuBLAS workspaces, NCCL buffers

A run fits when the estimate plus ALLOCATOR_MARGIN does: what `keel estimate` prints, what the start-up check and
trainer.activation_checkpointing=auto use.
"""

from __future__ import annotations

import dataclasses
import os

from keel.errors import ConfigError
from keel.memory import checkpointing_setting, fewest_checkpointed_blocks, peak_activations
from keel.model import parameter_counts
from keel.ops.chunked_ce import DEFAULT_CHUNK
from keel.parallel import resolve_precision
from keel.schemes import ModelConfig, SublayerSpec, sublayer_specs

# Per parameter: weights, gradients, AdamW's two moments. Lightning's bf16-mixed (and 16-mixed) is torch.autocast
# (cache_enabled=False) around the fp32 parameters: they are the master weights (there is no second fp32 copy), and
# gradients and AdamW state are fp32 too. bf16-true keeps all three in bf16 (AdamW's state takes the parameters' dtype).
STATE_BYTES = {"32-true": (4, 4, 8), "bf16-mixed": (4, 4, 8), "16-mixed": (4, 4, 8), "bf16-true": (2, 2, 4)}
# FSDP holds a few units unsharded at once: the root (embedding, final norm, head: not resharded after forward) and
# about two blocks (the one computing, the one prefetched), each with its gathered compute copy and its unsharded
# gradient (bf16 under bf16-mixed, then fp32 for the reduce-scatter): ~8 bytes per parameter of those units
FSDP_UNSHARDED_BYTES = 8
RUNTIME_BYTES = 2 * 2**30  # CUDA context (~0.5 GiB), cuBLAS workspaces, NCCL buffers: an allowance
# PyTorch's caching allocator reserves more than the tensors it hands out (cached blocks split for smaller tensors,
# freed memory of one size not reused for another): a run must fit its estimate plus this fraction. This project's
# choice until a GPU measures torch.cuda.max_memory_reserved() against max_memory_allocated() for these runs.
ALLOCATOR_MARGIN = 0.10


def gpu_precision(trainer) -> str:
    return resolve_precision(trainer, accelerator="gpu")  # on a GPU whatever this machine has (tests run on CPU)


def matmul_bytes(trainer) -> int:
    """Bytes per element of what the matmuls take and give: bf16 (or fp16) but under 32-true."""
    return 4 if gpu_precision(trainer) == "32-true" else 2


def block_bytes_per_token(cfg: ModelConfig, specs: tuple[SublayerSpec, SublayerSpec], compute_bytes: int) -> int:
    """What autograd keeps per token for one block's backward, eager, in bytes; compute_bytes: 2 under bf16 autocast
    (or bf16 weights), 4 in fp32. Counted from the tensors saved at width 1024 (SwiGLU 3072, 16 heads / 8 KV heads,
    bf16 autocast on CPU, saved_tensors_hooks, distinct storages: docs/model.md): Keel 56,400 bytes (55.1 KiB) and
    Pre-LN 48,200 (47.1 KiB), the issue #35 figures, which this reproduces exactly, as it does every other scheme's
    (GELU and GQA too, at width 256). Unmeasured on CUDA, where F.rms_norm (also one fp32 tensor and 1/rms per norm)
    and CUDA's SDPA kernels take their place; torch.compile saves less."""
    c, kv, hidden = cfg.width, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden
    norms = sum(spec.norm_in + spec.norm_out for spec in specs)
    fp32 = norms * (4 * c + 4)  # each norm's fp32 input (or normalized output) and its 1/rms
    # attention: the qkv projection's input and its output (held by v's view), q and k after RoPE, SDPA's output,
    # the out projection's input; SDPA's fp32 log-sum-exp per head
    attn = compute_bytes * (c + (c + 2 * kv) + c + kv + c + c) + 4 * cfg.n_heads
    if specs[0].qkv_norm:  # HybridNorm: q, k, v normalized in fp32 (1/rms per head) and v cast back, instead of
        # the projection's output
        attn += (4 - compute_bytes) * (c + 2 * kv) + compute_bytes * kv + 4 * (cfg.n_heads + 2 * cfg.kv_heads)
    # FFN: the up projection's input and output (SwiGLU: gate and up, held by their views), SiLU's output (SwiGLU),
    # the down projection's input
    ffn = compute_bytes * (c + (4 if cfg.ffn == "swiglu" else 2) * hidden)
    return fp32 + attn + ffn


def activation_bytes(cfg: ModelConfig, tokens: int, compute_bytes: int, checkpointed: int) -> int:
    """One micro-batch's saved activations over every block at their peak; checkpointed: how many blocks (the first
    ones) keep only their fp32 input, their activations recomputed one block at a time (keel.memory.peak_activations)."""
    per_block = [block_bytes_per_token(cfg, specs, compute_bytes) for specs in sublayer_specs(cfg)]
    return tokens * peak_activations(per_block, 4 * cfg.width, checkpointed)


def loss_head_bytes(cfg: ModelConfig, tokens: int) -> int:
    """The fused LM head and cross-entropy (keel.ops.chunked_ce) at its peak, from the model's loss_chunk: ~12
    bytes per logit of one chunk (the compute-precision logits, their fp32 copy and log-softmax, the gradient cast
    back) plus the fp32 hidden-state and weight gradients it keeps for backward; 0, the plain head: ~12 bytes per
    logit of the whole micro-batch (the saved fp32 log-softmax, then two fp32 gradients of its size)."""
    chunk = DEFAULT_CHUNK["cuda"] if cfg.loss_chunk is None else cfg.loss_chunk
    if chunk == 0:
        return 12 * tokens * cfg.vocab_size
    return 12 * min(chunk, tokens) * cfg.vocab_size + 4 * tokens * cfg.width + 6 * cfg.vocab_size * cfg.width


def gpu_training_terms(model: ModelConfig, trainer) -> dict[str, int]:
    """Bytes one training process needs on its GPU, by term (trainer: keel.config.TrainerConfig)."""
    precision = gpu_precision(trainer)
    weights, grads, adamw = STATE_BYTES[precision]
    counts = parameter_counts(model)
    params = sum(counts.values())
    fsdp = trainer.resolved_strategy == "fsdp"
    shards = trainer.shard_size
    tokens = trainer.micro_batch_size * model.seq_len
    checkpointed = trainer.checkpointed_blocks(model.depth)
    terms = {"weights": weights * params // shards, "gradients": grads * params // shards,
             "AdamW state": adamw * params // shards}
    if trainer.resolved_strategy == "ddp":  # the reducer's flat buckets: a second copy of the gradients
        terms["DDP buckets"] = grads * params
    if fsdp:
        unsharded = params - counts["blocks"] + 2 * counts["blocks"] // model.depth
        terms["FSDP unsharded units"] = FSDP_UNSHARDED_BYTES * unsharded
    elif precision.endswith("-mixed") and checkpointed < model.depth:  # cast per matmul, saved for its backward
        terms["autocast weight copies"] = 2 * counts["blocks"] * (model.depth - checkpointed) // model.depth
    terms["activations"] = activation_bytes(model, tokens, matmul_bytes(trainer), checkpointed)
    terms["loss head"] = loss_head_bytes(model, tokens)
    terms["runtime"] = RUNTIME_BYTES
    return terms


def gpu_memory_bytes() -> int:
    """This process's GPU's memory (its local rank's device)."""
    import torch

    return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK") or 0)).total_memory


def gpu_budget_bytes(trainer) -> int | None:
    """The memory each GPU has for the run: the visible GPU's, capped at trainer.gpu_memory_gib; that key alone
    where no GPU is visible (planning a cluster run elsewhere); None where neither says."""
    import torch

    configured = None if trainer.gpu_memory_gib is None else int(trainer.gpu_memory_gib * 2**30)
    if not torch.cuda.is_available():
        return configured
    return min(gpu_memory_bytes(), configured or gpu_memory_bytes())


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def gpu_training_bytes(model: ModelConfig, trainer) -> int:
    return sum(gpu_training_terms(model, trainer).values())


def with_margin(need: int) -> int:
    """The memory an estimate of `need` bytes asks of the GPU: the estimate plus ALLOCATOR_MARGIN."""
    return int(need * (1 + ALLOCATOR_MARGIN))


def fewest_fitting_blocks(model: ModelConfig, trainer, have: int) -> int:
    """The fewest blocks to checkpoint for the run to fit `have` bytes per GPU with the margin; all if none does."""
    return fewest_checkpointed_blocks(model.depth, lambda blocks: with_margin(gpu_training_bytes(
        model, dataclasses.replace(trainer, activation_checkpointing=checkpointing_setting(blocks, model.depth)))), have)


def gpu_auto_checkpointing(model: ModelConfig, trainer, have: int | None) -> str | float:
    """trainer.activation_checkpointing=auto on GPUs of `have` bytes: the fewest blocks that fit; every block where
    the GPU's memory is unknown (keel estimate without a GPU or trainer.gpu_memory_gib)."""
    blocks = model.depth if have is None else fewest_fitting_blocks(model, trainer, have)
    return checkpointing_setting(blocks, model.depth)


def remedies(model: ModelConfig, trainer, have: int) -> list[str]:
    """The changes that bring the estimate under `have`, the most helpful first, each applied on top of the ones
    before it and said with the estimate it leaves: activation checkpointing and FSDP in the order of what they save,
    then the largest micro-batch that fits, with grad_accum raised to keep the global batch. Activation checkpointing
    is ranked by what checkpointing every block saves, and proposed as auto: the fewest blocks that fit, if some do.
    The estimates said are without the margin; what must fit `have` is with it."""
    options = {}
    if trainer.checkpointed_blocks(model.depth) < model.depth:
        options["activation checkpointing"] = {"activation_checkpointing": "all"}
    if trainer.resolved_strategy != "fsdp" and trainer.world_size > 1 and trainer.precision != "16-mixed":
        options["trainer.strategy=fsdp"] = {"strategy": "fsdp"}
    steps = []
    need = gpu_training_bytes(model, trainer)
    while options and with_margin(need) > have:
        after = {key: gpu_training_bytes(model, dataclasses.replace(trainer, **change))
                 for key, change in options.items()}
        key = min(after, key=after.get)
        trainer, need = dataclasses.replace(trainer, **options.pop(key)), after[key]
        if key == "activation checkpointing":
            blocks = fewest_fitting_blocks(model, trainer, have)
            trainer = dataclasses.replace(trainer, activation_checkpointing=checkpointing_setting(blocks, model.depth))
            need = gpu_training_bytes(model, trainer)
            if blocks < model.depth:
                steps.append(f"trainer.activation_checkpointing=auto (the first {blocks} of {model.depth} blocks -> "
                             f"{gib(need)})")
                continue
            key = "trainer.activation_checkpointing=all"
        steps.append(f"{key} (-> {gib(need)})")
    sequences = trainer.micro_batch_size * trainer.grad_accum
    for micro in range(trainer.micro_batch_size - 1, 0, -1) if with_margin(need) > have else ():
        if sequences % micro == 0:
            need = gpu_training_bytes(model, dataclasses.replace(trainer, micro_batch_size=micro,
                                                                 grad_accum=sequences // micro))
            if with_margin(need) <= have or micro == 1:
                steps.append(f"trainer.micro_batch_size={micro} trainer.grad_accum={sequences // micro} "
                             f"(-> {gib(need)})")
                break
    if with_margin(need) > have:
        steps.append("more GPUs under trainer.strategy=fsdp, or GPUs with more memory")
    return steps


def check_gpu_fits(cfg, have: int) -> None:
    """Refuse a GPU run (cfg: keel.config.Config) whose estimated memory per GPU, with the allocator margin, exceeds
    `have` bytes (the GPU's memory), naming the terms and the keys to change; trainer.check_memory=false starts it
    anyway."""
    model, t = cfg.model, cfg.trainer
    terms = gpu_training_terms(model, t)
    if with_margin(need := sum(terms.values())) <= have:
        return
    breakdown = ", ".join(f"{name} {gib(n)}" for name, n in terms.items())
    raise ConfigError(f"{run_shape(model, t)} needs about {gib(need)} per GPU ({breakdown}), "
                      f"{gib(with_margin(need))} with the {ALLOCATOR_MARGIN:.0%} allocator margin, more than the "
                      f"{gib(have)} of this GPU; change, in this order: {', then '.join(remedies(model, t, have))}; "
                      "or set trainer.check_memory=false to start anyway")


def run_shape(model: ModelConfig, trainer) -> str:
    """The sizes and layout a GPU estimate depends on, in words (with activation checkpointing's per-block cost)."""
    params = sum(parameter_counts(model).values())
    checkpointed = trainer.checkpointed_blocks(model.depth)
    per_block = activation_bytes(model, 1, matmul_bytes(trainer), 0) / model.depth
    saved = f"{per_block / 2**10:.1f} KiB per token per block"
    checkpointing = ("on, every block" if checkpointed == model.depth else
                     f"on, the first {checkpointed} of {model.depth} blocks; the others keep {saved}" if checkpointed
                     else f"off: {saved}")
    return (f"model.depth={model.depth}, model.width={model.width}, trainer.micro_batch_size={trainer.micro_batch_size}"
            f" x model.seq_len={model.seq_len} ({params / 1e9:.2f} B parameters, {gpu_precision(trainer)}, "
            f"{trainer.resolved_strategy} over {trainer.world_size} GPU(s), activation checkpointing {checkpointing})")
