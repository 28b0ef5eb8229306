"""Will it fit? Memory estimates made before anything is allocated, shared by `keel pretrain` and `keel gradflow`:
a size this machine cannot hold is refused with the estimate, instead of swapping or being killed minutes later.

The terms, each fitted to peak RSS measured on CPU (docs/model.md, "Memory estimate"):
    per parameter      weights and gradients, 8 bytes (+ AdamW's two fp32 moments in training: 16)
    per token, block   what autograd keeps for the backward: (16 x width + 4 x FFN hidden) floats
    per block          the modules' Python objects and the autograd graph of one step, whatever the width
    per process        torch, Lightning and the loggers
"""

from __future__ import annotations

import os

from keel.errors import ConfigError
from keel.model import parameter_counts
from keel.schemes import ModelConfig

BLOCK_BYTES = 112 * 2**10  # ~40 KiB of module objects + ~70 KiB of autograd graph per block, measured at width 8
PROCESS_BYTES = 2**30  # a process before its model: 0.9 GiB measured in training (1,000 x 8 and 256 x 64 runs)


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of KeelLM(cfg), without allocating any (keel.model.parameter_counts)."""
    return sum(parameter_counts(cfg).values())


def activation_bytes(cfg: ModelConfig, tokens: int, checkpointed: bool = False) -> int:
    """What one forward keeps for its backward over `tokens` tokens; checkpointed: each block's input only,
    plus one block's activations while it is recomputed."""
    per_block = 4 * (16 * cfg.width + 4 * cfg.ffn_hidden) * tokens
    return (4 * cfg.width * tokens * cfg.depth + per_block) if checkpointed else per_block * cfg.depth


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


def training_bytes(cfg: ModelConfig, micro_batch: int, shards: int = 1, checkpointed: bool = False) -> int:
    """One training process: its share of weights, gradients and AdamW state (1 / shards under FSDP), one
    micro-batch's activations, the blocks' fixed cost and the process's own."""
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


def check_training_fits(cfg) -> None:
    """Refuse a CPU run (cfg: keel.config.Config) whose processes on this machine would not fit in its memory;
    trainer.check_memory=false starts it anyway. GPU runs: keel.gpu_memory."""
    t = cfg.trainer
    shards = t.shard_size
    need = t.devices * training_bytes(cfg.model, t.micro_batch_size, shards, t.activation_checkpointing)
    check_fits(need, f"model.depth={cfg.model.depth}, model.width={cfg.model.width}, trainer.micro_batch_size="
               f"{t.micro_batch_size} x model.seq_len={cfg.model.seq_len} in {t.devices} process(es)",
               parameter_count(cfg.model), "weights, gradients and AdamW state",
               "lower one of them (or set trainer.activation_checkpointing=true), or set trainer.check_memory=false "
               "to start anyway")


def check_fits(need: int, what: str, parameters: int, state: str, remedy: str) -> None:
    """Refuse `what` (a phrase naming the sizes) when `need` bytes exceed what is available; state: what is held
    per parameter; remedy: what to lower and how to start anyway."""
    have = available_bytes()
    if need > have:
        raise ConfigError(f"{what} needs about {need / 2**30:.1f} GiB ({parameters:,} parameters: {state}; plus "
                          f"activations), more than the {have / 2**30:.1f} GiB available here; {remedy}")
