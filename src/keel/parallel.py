"""Things applied *to* a plain KeelLM from outside (torchtitan style): activation checkpointing and
per-block torch.compile. The model never knows about them."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from keel.model import KeelLM


def apply_activation_checkpointing(model: KeelLM) -> None:
    """Recompute each block's activations in backward: memory O(1 block) instead of O(depth)."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def compile_blocks(model: KeelLM) -> None:
    """Compile each block separately: one graph reused by every block (fast compile at any depth)."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, dynamic=False)
