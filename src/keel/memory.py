"""Will it fit? The memory a run needs, estimated from its config before anything is allocated, and a run that
exceeds its machine refused at start-up with the estimate and the keys to change (docs/model.md, "Memory estimate").
`keel estimate`, the start-up check (trainer.check_memory) and trainer.activation_checkpointing=auto read it.

One activation model, for CPU and GPU: what autograd keeps per token and block, counted from the tensors each
sublayer saves, eager or compiled (block_bytes_per_token), with activation checkpointing's peak (peak_activations).
Around it:
    CPU    weights, gradients and AdamW state; eager blocks' activations whatever trainer.compile (a compiled CPU
           run's measured peak sits under them too), with CPU_ACTIVATION_SLACK; each block's Python objects and
           autograd graph (BLOCK_BYTES); the process itself (PROCESS_BYTES); against MemAvailable
    GPU    model state by precision and strategy (STATE_BYTES, DDP buckets, FSDP's unsharded units, autocast's
           weight copies); eager or compiled blocks' activations (trainer.compile); the loss head's logits; the
           gradients, less what backward frees before making them (GRADIENTS_IN_PLACE); CUDA's runtime; against
           the GPU's memory, with ALLOCATOR_MARGIN
"""

from __future__ import annotations

import bisect
import dataclasses
import os

from keel.config import ModelConfig, resolve_accelerator, resolve_precision
from keel.config.model import SublayerSpec, sublayer_specs
from keel.errors import ConfigError
from keel.model import parameter_counts
from keel.ops.chunked_ce import DEFAULT_CHUNK

# Per parameter: weights, gradients, AdamW's two moments. Lightning's bf16-mixed (and 16-mixed) is torch.autocast
# (cache_enabled=False) around the fp32 parameters: they are the master weights (there is no second fp32 copy), and
# gradients and AdamW state are fp32 too. bf16-true keeps all three in bf16 (AdamW's state takes the parameters' dtype).
STATE_BYTES = {"32-true": (4, 4, 8), "bf16-mixed": (4, 4, 8), "16-mixed": (4, 4, 8), "bf16-true": (2, 2, 4)}
BLOCK_BYTES = 112 * 2**10  # CPU: a block's module objects and one step's autograd graph, whatever its width
PROCESS_BYTES = 2**30  # CPU: a process before its model (torch, Lightning, the loggers)
# FSDP holds a few units unsharded at once: the root (final norm, head: not resharded after forward), the embedding
# (an upper bound: its own unit, freed after forward) and about two blocks (the one computing, the one prefetched),
# each with its gathered compute copy and its unsharded gradient (bf16 under bf16-mixed, then fp32 for the
# reduce-scatter): ~8 bytes per parameter of those units
FSDP_UNSHARDED_BYTES = 8
RUNTIME_BYTES = 2 * 2**30  # GPU: CUDA context, cuBLAS workspaces, NCCL buffers: an allowance
GRADIENTS_IN_PLACE = "gradients made in freed activations' place"  # a negative GPU term
# PyTorch's caching allocator reserves more than the tensors it hands out (cached blocks split for smaller tensors,
# freed memory of one size not reused for another): a run must fit its estimate plus this fraction. This project's
# choice until a GPU measures torch.cuda.max_memory_reserved() against max_memory_allocated() for these runs.
ALLOCATOR_MARGIN = 0.10
# CPU: peak RSS holds more than the saved activations (the heap's share of the tensors freed in forward, the
# backward's own): this fraction more, fitted to measured peaks (docs/model.md, "Memory estimate")
CPU_ACTIVATION_SLACK = 0.3


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of KeelLM(cfg), without allocating any (keel.model.parameter_counts)."""
    return sum(parameter_counts(cfg).values())


def compute_bytes(precision: str) -> int:
    """Bytes per element of what the matmuls take and give: bf16 (or fp16) but under 32-true."""
    return 4 if precision == "32-true" else 2


def block_bytes_per_token(
    cfg: ModelConfig, specs: tuple[SublayerSpec, SublayerSpec], compute_bytes: int, compiled: bool = False
) -> int:
    """What autograd keeps per token for one block's backward, in bytes; compute_bytes: 2 under bf16 autocast (or
    bf16 weights), 4 in fp32; compiled: the block compiled (keel.parallel.compile_blocks), else eager. Counted from
    the distinct storages saved (saved_tensors_hooks) on CPU, which this reproduces exactly for every scheme, GELU
    and SwiGLU, in fp32 and bf16, eager and compiled (tests/test_memory_activations.py), and issue #35's eager
    figures at width 1024 (docs/model.md, which also sets the eager count beside a GPU step's peak)."""
    c, kv, hidden = cfg.width, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden
    # attention: the qkv projection's input and its output (held by v's view), q and k after RoPE, SDPA's output,
    # the out projection's input; SDPA's fp32 log-sum-exp per head
    attn = compute_bytes * (c + (c + 2 * kv) + c + kv + c + c) + 4 * cfg.n_heads
    if specs[0].qkv_norm:  # HybridNorm: q, k and v's 1/rms per head, and v cast back
        attn += compute_bytes * kv + 4 * (cfg.n_heads + 2 * cfg.kv_heads)
        if not compiled:  # q, k, v normalized in fp32 instead of the projection's output (compiled: recomputed)
            attn += (4 - compute_bytes) * (c + 2 * kv)
    # FFN: the up projection's input and output (SwiGLU: gate and up, held by their views), the down projection's
    # input, and eager SwiGLU's SiLU output, which a compiled block recomputes from the saved gate
    ffn = compute_bytes * (c + (2 if cfg.ffn == "gelu" else 3 if compiled else 4) * hidden)
    norms = sum(spec.norm_in + spec.norm_out for spec in specs)
    if not compiled:  # each norm's fp32 input (or normalized output) and its 1/rms
        return norms * (4 * c + 4) + attn + ffn
    # Compiled (inductor's min-cut partitioner), each norm keeps its 1/rms; its input and output are recomputed in
    # backward from: the block's fp32 input (in fp32 without Norm_in, the qkv projection's input, counted above),
    # the attention branch's output in the compute dtype, and where the FFN sublayer has Norm_out, its fp32 sum
    block_input = 0 if compute_bytes == 4 and not specs[0].norm_in else 4 * c
    return norms * 4 + block_input + compute_bytes * c + 4 * c * specs[1].norm_out + attn + ffn


def activation_bytes(
    cfg: ModelConfig, tokens: int, compute_bytes: int, checkpointed: int = 0, compiled: bool = False
) -> int:
    """One micro-batch's saved activations over every block at their peak; checkpointed: how many blocks (the first
    ones) keep only their fp32 input, their activations recomputed one block at a time (peak_activations);
    compiled: the blocks compiled (trainer.compile)."""
    per_block = [block_bytes_per_token(cfg, specs, compute_bytes, compiled) for specs in sublayer_specs(cfg)]
    return tokens * peak_activations(per_block, 4 * cfg.width, checkpointed)


def peak_activations(per_block: list[int], block_input: int, checkpointed: int) -> int:
    """The peak of the activations a forward keeps for its backward, in bytes: per_block[i] for block i,
    block_input for a checkpointed block, whose `checkpointed` first blocks keep only their input. It is the larger
    of the kept activations as backward starts and of the inputs plus one recomputed block: the first blocks are
    recomputed last, once the later blocks' activations are freed (keel.parallel.apply_activation_checkpointing)."""
    kept = sum(per_block[checkpointed:]) + checkpointed * block_input
    return max(kept, max(per_block[:checkpointed], default=0) + checkpointed * block_input)


def loss_head_bytes(cfg: ModelConfig, tokens: int) -> int:
    """The fused LM head and cross-entropy (keel.ops.chunked_ce) on a GPU at its peak, from the model's loss_chunk:
    ~12 bytes per logit of one chunk (the compute-precision logits, their fp32 copy and log-softmax, the gradient
    cast back) plus the fp32 hidden-state and weight gradients it keeps for backward; 0, the plain head: ~12 bytes
    per logit of the whole micro-batch (the saved fp32 log-softmax, then two fp32 gradients of its size)."""
    chunk = DEFAULT_CHUNK["cuda"] if cfg.loss_chunk is None else cfg.loss_chunk
    if chunk == 0:
        return 12 * tokens * cfg.vocab_size
    return 12 * min(chunk, tokens) * cfg.vocab_size + 4 * tokens * cfg.width + 6 * cfg.vocab_size * cfg.width


def fewest_checkpointed_blocks(depth: int, need, have: int) -> int:
    """The fewest blocks to checkpoint (the first ones) for need(blocks) bytes to fit in `have`; every block if
    none does (the memory check then refuses the run, naming the other changes). Up to depth - 1 blocks, need falls
    with each block checkpointed (its input kept instead of its activations), so bisection finds it; checkpointing
    the last block too saves nothing (peak_activations), so all blocks are never needed where depth - 1 do not fit."""
    return bisect.bisect_left(range(depth), True, key=lambda blocks: need(blocks) <= have)


def checkpointing_setting(blocks: int, depth: int) -> str | float:
    """The trainer.activation_checkpointing value that checkpoints the first `blocks` of `depth` blocks."""
    return "none" if blocks == 0 else "all" if blocks == depth else blocks / depth


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def resolve_activation_checkpointing(cfg) -> str | None:
    """trainer.activation_checkpointing=auto made concrete in cfg (keel.config.Config): the fewest blocks with which
    the run fits its GPU, or on CPU the memory available, before anything is allocated; what was chosen, in words,
    or None when it was not auto. Every process resolves it; keel.parallel makes them agree on the most any needs."""
    t, depth = cfg.trainer, cfg.model.depth
    if t.activation_checkpointing != "auto":
        return None
    if resolve_accelerator(t) == "gpu":
        t.activation_checkpointing = gpu_auto_checkpointing(cfg.model, t, gpu_budget_bytes(t))
    else:
        t.activation_checkpointing = cpu_auto_checkpointing(cfg)
    blocks = t.checkpointed_blocks(depth)
    which = "no block" if blocks == 0 else "every block" if blocks == depth else f"the first {blocks} of {depth} blocks"
    return f"trainer.activation_checkpointing=auto: {which} ({t.activation_checkpointing})"


def defers_reduction(trainer) -> bool:
    """Whether FSDP keeps an optimizer step's gradients unsharded until its last micro-batch (auto counts as not,
    until resolve_gradient_reduction has decided)."""
    return trainer.resolved_strategy == "fsdp" and trainer.grad_accum > 1 and trainer.reduce_every_micro_batch is False


def resolve_gradient_reduction(cfg) -> str | None:
    """trainer.reduce_every_micro_batch=auto made concrete in cfg, after the activation checkpointing: under FSDP with
    micro-batches to accumulate, false (one reduction per optimizer step) where the run still fits each GPU with the
    unsharded gradients that keeps, at the checkpointing it has (so deferring never costs a recomputed block);
    else true. On CPU false; where the GPU's memory is unknown (keel estimate without trainer.gpu_memory_gib) true.
    What was chosen, in words, or None when there was no choice to make. The processes agree on it at start-up
    (keel.strategy.FSDP2Strategy)."""
    t = cfg.trainer
    if t.reduce_every_micro_batch != "auto":
        return None
    if t.resolved_strategy != "fsdp" or t.grad_accum == 1:
        t.reduce_every_micro_batch = False  # nothing is reduced between micro-batches to begin with
        return None
    why = ""
    if resolve_accelerator(t) == "cpu":
        t.reduce_every_micro_batch = False
    elif (have := gpu_budget_bytes(t)) is None:
        t.reduce_every_micro_batch, why = True, ": the GPU's memory is unknown (trainer.gpu_memory_gib)"
    else:
        deferred = dataclasses.replace(t, reduce_every_micro_batch=False)
        t.reduce_every_micro_batch = with_margin(gpu_training_bytes(cfg.model, deferred)) > have
        why = ": deferring would not fit beside the activations" if t.reduce_every_micro_batch else ""
    how = "every micro-batch" if t.reduce_every_micro_batch else "once per optimizer step"
    return (
        f"trainer.reduce_every_micro_batch=auto: gradients reduced {how}{why} "
        f"({str(t.reduce_every_micro_batch).lower()})"
    )


# CPU: this machine's memory, shared by a run's processes (keel pretrain, keel bench, keel gradflow, model readers)


def cpu_activation_bytes(cfg: ModelConfig, tokens: int, compute_bytes: int, checkpointed: int = 0) -> int:
    """activation_bytes as peak RSS counts them on CPU: with CPU_ACTIVATION_SLACK."""
    return int(activation_bytes(cfg, tokens, compute_bytes, checkpointed) * (1 + CPU_ACTIVATION_SLACK))


def measurement_bytes(cfg: ModelConfig, batch: int) -> int:
    """One fp32 forward and backward of `batch` sequences (keel.gradflow): weights, gradients, activations, blocks,
    and the process itself (docs/model.md has the measured peaks)."""
    return (
        8 * parameter_count(cfg)
        + cpu_activation_bytes(cfg, batch * cfg.seq_len, 4)
        + BLOCK_BYTES * cfg.depth
        + PROCESS_BYTES
    )


def model_bytes(cfg: ModelConfig) -> int:
    """KeelLM(cfg) built in fp32, beside the weights it is loaded from: its parameters, the blocks' objects and its
    RoPE tables (angles, cosines and sines: seq_len x head_dim / 2 floats each)."""
    return 4 * parameter_count(cfg) + BLOCK_BYTES * cfg.depth + 6 * cfg.seq_len * cfg.head_dim


def check_model_fits(cfg: ModelConfig, what: str) -> None:
    """Refuse to build a model read from a file (`what` names it) that this machine cannot hold, before building it."""
    check_fits(
        model_bytes(cfg),
        f"{what}: its model (model.depth={cfg.depth}, model.width={cfg.width}, model.seq_len={cfg.seq_len})",
        parameter_count(cfg),
        "fp32 weights",
        "use a machine with more memory",
    )


def training_bytes(
    cfg: ModelConfig, micro_batch: int, shards: int = 1, checkpointed: int = 0, precision: str = "32-true"
) -> int:
    """One CPU training process: its share of weights, gradients and AdamW state (1 / shards under FSDP), one
    micro-batch's activations (`checkpointed` blocks checkpointed), the blocks' fixed cost and the process's own."""
    return (
        sum(STATE_BYTES[precision]) * parameter_count(cfg) // shards
        + cpu_activation_bytes(cfg, micro_batch * cfg.seq_len, compute_bytes(precision), checkpointed)
        + BLOCK_BYTES * cfg.depth
        + PROCESS_BYTES
    )


def check_steps_fit(models: list[ModelConfig], batch: int, what: str, remedy: str) -> None:
    """Refuse training steps of every model in `models` (of `batch` sequences each), all held at once in this
    process, that do not fit in this machine's memory; what: the sizes, in words."""
    need = PROCESS_BYTES + sum(training_bytes(cfg, batch) - PROCESS_BYTES for cfg in models)
    check_fits(
        need,
        f"{what}, {len(models)} model(s) held at once",
        parameter_count(models[0]),
        "weights, gradients and AdamW state, per model",
        remedy,
    )


def available_bytes() -> int:
    """Memory this machine can give without swapping (MemAvailable), else all of it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_training_bytes(cfg, checkpointed: int) -> int:
    """A CPU run's processes on this machine (cfg: keel.config.Config), `checkpointed` blocks checkpointed in each."""
    t = cfg.trainer
    return t.devices * training_bytes(
        cfg.model, t.micro_batch_size, t.shard_size, checkpointed, resolve_precision(t, accelerator="cpu")
    )


def cpu_auto_checkpointing(cfg) -> str | float:
    """trainer.activation_checkpointing=auto on CPU: the fewest blocks with which the run fits the memory available."""
    depth = cfg.model.depth
    return checkpointing_setting(
        fewest_checkpointed_blocks(depth, lambda n: cpu_training_bytes(cfg, n), available_bytes()), depth
    )


def check_training_fits(cfg) -> None:
    """Refuse a CPU run (cfg: keel.config.Config) whose processes on this machine would not fit in its memory;
    trainer.check_memory=false starts it anyway."""
    t = cfg.trainer
    checkpointed = t.checkpointed_blocks(cfg.model.depth)
    more = "" if checkpointed == cfg.model.depth else " (or set trainer.activation_checkpointing=auto or all)"
    check_fits(
        cpu_training_bytes(cfg, checkpointed),
        f"model.depth={cfg.model.depth}, model.width={cfg.model.width}, "
        f"trainer.micro_batch_size={t.micro_batch_size} x model.seq_len={cfg.model.seq_len} in {t.devices} "
        f"process(es)",
        parameter_count(cfg.model),
        "weights, gradients and AdamW state",
        f"lower one of them{more}, or set trainer.check_memory=false to start anyway",
    )


def check_fits(need: int, what: str, parameters: int, state: str, remedy: str) -> None:
    """Refuse `what` (a phrase naming the sizes) when `need` bytes exceed what is available; state: what is held
    per parameter; remedy: what to lower and how to start anyway."""
    have = available_bytes()
    if need > have:
        raise ConfigError(
            f"{what} needs about {gib(need)} ({parameters:,} parameters: {state}; plus activations), "
            f"more than the {gib(have)} available here; {remedy}"
        )


# GPU: one training process on its GPU


def gpu_precision(trainer) -> str:
    return resolve_precision(trainer, accelerator="gpu")  # on a GPU whatever this machine has (tests run on CPU)


def gpu_training_terms(model: ModelConfig, trainer) -> dict[str, int]:
    """Bytes one training process needs on its GPU, by term (trainer: keel.config.TrainerConfig)."""
    precision = gpu_precision(trainer)
    weights, grads, adamw = STATE_BYTES[precision]
    counts = parameter_counts(model)
    params = sum(counts.values())
    shards = trainer.shard_size
    tokens = trainer.micro_batch_size * model.seq_len
    checkpointed = trainer.checkpointed_blocks(model.depth)
    terms = {
        "weights": weights * params // shards,
        "gradients": grads * params // shards,
        "AdamW state": adamw * params // shards,
    }
    if trainer.resolved_strategy == "ddp":  # the reducer's flat buckets: a second copy of the gradients
        terms["DDP buckets"] = grads * params
    if trainer.resolved_strategy == "fsdp":
        unsharded = params - counts["blocks"] + 2 * counts["blocks"] // model.depth
        terms["FSDP unsharded units"] = FSDP_UNSHARDED_BYTES * unsharded
        if defers_reduction(trainer):  # keel.parallel.deferred_gradient_reduction
            terms["unsharded gradients while accumulating"] = (2 if trainer.reduce_dtype == "bf16" else 4) * params
    elif precision.endswith("-mixed") and checkpointed < model.depth:  # cast per matmul, saved for its backward
        terms["autocast weight copies"] = 2 * counts["blocks"] * (model.depth - checkpointed) // model.depth
    terms["activations"] = activation_bytes(model, tokens, compute_bytes(precision), checkpointed, trainer.compile)
    terms["loss head"] = loss_head_bytes(model, tokens)
    if trainer.grad_accum == 1:  # the gradients are made as backward frees what forward kept (zero_grad set them
        # to None): the two never peak together. Accumulated gradients stay through the next micro-batch's forward.
        kept = terms["activations"] + terms["loss head"] + terms.get("autocast weight copies", 0)
        terms[GRADIENTS_IN_PLACE] = -min(terms["gradients"], kept)
    terms["runtime"] = RUNTIME_BYTES
    return terms


def gpu_training_bytes(model: ModelConfig, trainer) -> int:
    return sum(gpu_training_terms(model, trainer).values())


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


def with_margin(need: int) -> int:
    """The memory an estimate of `need` bytes asks of the GPU: the estimate plus ALLOCATOR_MARGIN."""
    return int(need * (1 + ALLOCATOR_MARGIN))


def fewest_fitting_blocks(model: ModelConfig, trainer, have: int) -> int:
    """The fewest blocks to checkpoint for the run to fit `have` bytes per GPU with the margin; all if none does."""
    return fewest_checkpointed_blocks(
        model.depth,
        lambda blocks: with_margin(
            gpu_training_bytes(
                model, dataclasses.replace(trainer, activation_checkpointing=checkpointing_setting(blocks, model.depth))
            )
        ),
        have,
    )


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
    if defers_reduction(trainer):
        options["trainer.reduce_every_micro_batch=true"] = {"reduce_every_micro_batch": True}
    steps = []
    need = gpu_training_bytes(model, trainer)
    while options and with_margin(need) > have:
        after = {
            key: gpu_training_bytes(model, dataclasses.replace(trainer, **change)) for key, change in options.items()
        }
        key = min(after, key=after.get)
        trainer, need = dataclasses.replace(trainer, **options.pop(key)), after[key]
        if key == "activation checkpointing":
            blocks = fewest_fitting_blocks(model, trainer, have)
            trainer = dataclasses.replace(trainer, activation_checkpointing=checkpointing_setting(blocks, model.depth))
            need = gpu_training_bytes(model, trainer)
            if blocks < model.depth:
                steps.append(
                    f"trainer.activation_checkpointing=auto (the first {blocks} of {model.depth} blocks -> {gib(need)})"
                )
                continue
            key = "trainer.activation_checkpointing=all"
        steps.append(f"{key} (-> {gib(need)})")
    sequences = trainer.micro_batch_size * trainer.grad_accum
    for micro in range(trainer.micro_batch_size - 1, 0, -1) if with_margin(need) > have else ():
        if sequences % micro == 0:
            need = gpu_training_bytes(
                model, dataclasses.replace(trainer, micro_batch_size=micro, grad_accum=sequences // micro)
            )
            if with_margin(need) <= have or micro == 1:
                steps.append(
                    f"trainer.micro_batch_size={micro} trainer.grad_accum={sequences // micro} (-> {gib(need)})"
                )
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
    raise ConfigError(
        f"{run_shape(model, t)} needs about {gib(need)} per GPU ({breakdown}), "
        f"{gib(with_margin(need))} with the {ALLOCATOR_MARGIN:.0%} allocator margin, more than the "
        f"{gib(have)} of this GPU; change, in this order: {', then '.join(remedies(model, t, have))}; "
        "or set trainer.check_memory=false to start anyway"
    )


def run_shape(model: ModelConfig, trainer) -> str:
    """The sizes and layout a GPU estimate depends on, in words (with activation checkpointing's per-block cost)."""
    params = parameter_count(model)
    checkpointed = trainer.checkpointed_blocks(model.depth)
    per_block = activation_bytes(model, 1, compute_bytes(gpu_precision(trainer)), compiled=trainer.compile)
    per_block /= model.depth
    saved = f"{per_block / 2**10:.1f} KiB per token per block{', compiled' if trainer.compile else ''}"
    checkpointing = (
        "on, every block"
        if checkpointed == model.depth
        else f"on, the first {checkpointed} of {model.depth} blocks; the others keep {saved}"
        if checkpointed
        else f"off: {saved}"
    )
    return (
        f"model.depth={model.depth}, model.width={model.width}, trainer.micro_batch_size={trainer.micro_batch_size}"
        f" x model.seq_len={model.seq_len} ({params / 1e9:.2f} B parameters, {gpu_precision(trainer)}, "
        f"{trainer.resolved_strategy} over {trainer.world_size} GPU(s), activation checkpointing {checkpointing})"
    )
