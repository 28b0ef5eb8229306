"""Will it fit? Memory estimates made before anything is allocated, shared by `keel pretrain` and `keel gradflow`:
a size this machine cannot hold is refused with the estimate, instead of swapping or being killed minutes later.

The terms, each fitted to peak RSS measured on CPU (docs/model.md, "Memory estimate"):
    per parameter      weights and gradients, 8 bytes (+ AdamW's two fp32 moments in training: 16)
    per token, block   what autograd keeps for the backward: (16 x width + 4 x FFN hidden) floats
    per block          the modules' Python objects and the autograd graph of one step, whatever the width
    per process        torch, Lightning and the loggers
"""

from __future__ import annotations

import bisect
import os

from keel.errors import ConfigError
from keel.model import parameter_counts
from keel.schemes import ModelConfig

BLOCK_BYTES = 112 * 2**10  # ~40 KiB of module objects + ~70 KiB of autograd graph per block, measured at width 8
PROCESS_BYTES = 2**30  # a process before its model: 0.9 GiB measured in training (1,000 x 8 and 256 x 64 runs)


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of KeelLM(cfg), without allocating any (keel.model.parameter_counts)."""
    return sum(parameter_counts(cfg).values())


def activation_bytes(cfg: ModelConfig, tokens: int, checkpointed: int = 0) -> int:
    """What one forward keeps for its backward over `tokens` tokens, at its peak; checkpointed: how many blocks
    (the first ones) keep only their input, their activations recomputed in backward (peak_activations)."""
    per_block = 4 * (16 * cfg.width + 4 * cfg.ffn_hidden) * tokens
    return peak_activations([per_block] * cfg.depth, 4 * cfg.width * tokens, checkpointed)


def peak_activations(per_block: list[int], block_input: int, checkpointed: int) -> int:
    """The peak of the activations a forward keeps for its backward, in bytes: per_block[i] for block i,
    block_input for a checkpointed block, whose `checkpointed` first blocks keep only their input. It is the larger
    of the kept activations as backward starts and of the inputs plus one recomputed block: the first blocks are
    recomputed last, once the later blocks' activations are freed (keel.parallel.apply_activation_checkpointing)."""
    kept = sum(per_block[checkpointed:]) + checkpointed * block_input
    return max(kept, max(per_block[:checkpointed], default=0) + checkpointed * block_input)


def fewest_checkpointed_blocks(depth: int, need, have: int) -> int:
    """The fewest blocks to checkpoint (the first ones) for need(blocks) bytes to fit in `have`; every block if
    none does (the memory check then refuses the run, naming the other changes). Up to depth - 1 blocks, need falls
    with each block checkpointed (its input kept instead of its activations), so bisection finds it; checkpointing
    the last block too saves nothing (peak_activations), so all blocks are never needed where depth - 1 do not fit."""
    return bisect.bisect_left(range(depth), True, key=lambda blocks: need(blocks) <= have)


def checkpointing_setting(blocks: int, depth: int) -> str | float:
    """The trainer.activation_checkpointing value that checkpoints the first `blocks` of `depth` blocks."""
    return "none" if blocks == 0 else "all" if blocks == depth else blocks / depth


def measurement_bytes(cfg: ModelConfig, batch: int) -> int:
    """One forward and backward of `batch` sequences (keel.gradflow): weights, gradients, activations, blocks, and
    the process itself (`keel gradflow --width 8 --seq-len 8 --batch 1`: 1.17 GiB peak at 3,000 blocks, 1.99 GiB at
    10,000, i.e. 0.8 GiB + 123 KiB per block; estimated 1.36 and 2.2)."""
    return (8 * parameter_count(cfg) + activation_bytes(cfg, batch * cfg.seq_len) + BLOCK_BYTES * cfg.depth
            + PROCESS_BYTES)


def model_bytes(cfg: ModelConfig) -> int:
    """KeelLM(cfg) built in fp32, beside the weights it is loaded from: its parameters, the blocks' objects and its
    RoPE tables (angles, cosines and sines: seq_len x head_dim / 2 floats each)."""
    return 4 * parameter_count(cfg) + BLOCK_BYTES * cfg.depth + 6 * cfg.seq_len * cfg.head_dim


def check_model_fits(cfg: ModelConfig, what: str) -> None:
    """Refuse to build a model read from a file (`what` names it) that this machine cannot hold, before building it."""
    check_fits(model_bytes(cfg), f"{what}: its model (model.depth={cfg.depth}, model.width={cfg.width}, "
               f"model.seq_len={cfg.seq_len})", parameter_count(cfg), "fp32 weights",
               "use a machine with more memory")


def training_bytes(cfg: ModelConfig, micro_batch: int, shards: int = 1, checkpointed: int = 0) -> int:
    """One training process: its share of weights, gradients and AdamW state (1 / shards under FSDP), one
    micro-batch's activations (`checkpointed` blocks checkpointed), the blocks' fixed cost and the process's own."""
    return (16 * parameter_count(cfg) // shards + activation_bytes(cfg, micro_batch * cfg.seq_len, checkpointed)
            + BLOCK_BYTES * cfg.depth + PROCESS_BYTES)


def check_steps_fit(models: list[ModelConfig], batch: int, what: str, remedy: str) -> None:
    """Refuse training steps of every model in `models` (of `batch` sequences each), all held at once in this
    process, that do not fit in this machine's memory; what: the sizes, in words."""
    need = PROCESS_BYTES + sum(training_bytes(cfg, batch) - PROCESS_BYTES for cfg in models)
    check_fits(need, f"{what}, {len(models)} model(s) held at once", parameter_count(models[0]),
               "weights, gradients and AdamW state, per model", remedy)


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
    """A CPU run's processes on this machine (cfg: keel.config.Config), `checkpointed` blocks checkpointed in each.
    Fitted to peak RSS, which counts the allocator's own slack: no margin is added (keel.gpu_memory adds one)."""
    t = cfg.trainer
    return t.devices * training_bytes(cfg.model, t.micro_batch_size, t.shard_size, checkpointed)


def cpu_auto_checkpointing(cfg) -> str | float:
    """trainer.activation_checkpointing=auto on CPU: the fewest blocks with which the run fits the memory available."""
    depth = cfg.model.depth
    return checkpointing_setting(fewest_checkpointed_blocks(depth, lambda n: cpu_training_bytes(cfg, n),
                                                            available_bytes()), depth)


def check_training_fits(cfg) -> None:
    """Refuse a CPU run (cfg: keel.config.Config) whose processes on this machine would not fit in its memory;
    trainer.check_memory=false starts it anyway. GPU runs: keel.gpu_memory."""
    t = cfg.trainer
    checkpointed = t.checkpointed_blocks(cfg.model.depth)
    more = "" if checkpointed == cfg.model.depth else " (or set trainer.activation_checkpointing=auto or all)"
    check_fits(cpu_training_bytes(cfg, checkpointed), f"model.depth={cfg.model.depth}, model.width={cfg.model.width}, "
               f"trainer.micro_batch_size={t.micro_batch_size} x model.seq_len={cfg.model.seq_len} in {t.devices} "
               f"process(es)", parameter_count(cfg.model), "weights, gradients and AdamW state",
               f"lower one of them{more}, or set trainer.check_memory=false to start anyway")


def check_fits(need: int, what: str, parameters: int, state: str, remedy: str) -> None:
    """Refuse `what` (a phrase naming the sizes) when `need` bytes exceed what is available; state: what is held
    per parameter; remedy: what to lower and how to start anyway."""
    have = available_bytes()
    if need > have:
        raise ConfigError(f"{what} needs about {need / 2**30:.1f} GiB ({parameters:,} parameters: {state}; plus "
                          f"activations), more than the {have / 2**30:.1f} GiB available here; {remedy}")
