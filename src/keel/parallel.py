"""Things applied *to* a plain KeelLM from outside (torchtitan's `parallelize`): activation checkpointing,
per-block torch.compile and FSDP2 sharding, and FSDP's deferred gradient reduction. The model never knows about them;
the Lightning strategy that calls them is keel.strategy."""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from keel.config import resolve_precision
from keel.model import KeelLM
from keel.ops.chunked_ce import compiled_chunk_loss


def apply_activation_checkpointing(model: KeelLM, blocks: int | None = None) -> None:
    """Recompute the activations of the first `blocks` blocks (default: every one) in backward: all of them, memory
    O(1 block) instead of O(depth). The first ones because backward reaches them last, once the later blocks'
    activations are freed: each then saves its activations less its input, and its recomputation adds no peak of its
    own (Megatron-LM's `--recompute-method block` picks the same; checkpointing the last block would save nothing).
    In place (each block's forward becomes a checkpointed call of its class's forward), so parameter names,
    state_dict keys and module hooks stay those of the plain model - `checkpoint_wrapper` strips its
    `_checkpoint_wrapped_module.` prefix from state_dict() but not from named_parameters() - and
    per-block compile still traces it (it silently skips a functools.partial(checkpoint, ...) forward)."""
    for block in model.blocks[:blocks]:
        block.forward = types.MethodType(_checkpointed_forward, block)


def _checkpointed_forward(block, *args, **kwargs):
    # no RNG state to keep: the model has no dropout
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def compile_blocks(model: KeelLM, mode: str = "default") -> None:
    """Compile each block separately: one graph reused by every block (fast compile at any depth), and the loss
    head's per-chunk kernel (keel.ops.chunked_ce), in torch.compile's `mode` (trainer.compile_mode). In place
    (`Module.compile`), unlike `torch.compile(block)`, which would add an `_orig_mod.` prefix to every state_dict key
    and make checkpoints depend on the compile setting."""
    for block in model.blocks:
        block.compile(dynamic=False, mode=mode)
    model.loss_chunk_kernel = compiled_chunk_loss(mode)


def parallelize(model: KeelLM, trainer, device_mesh=None) -> None:
    """Apply the trainer config's activation checkpointing and compile, then shard over `device_mesh` (given
    by the FSDP strategy only), once. Checkpointing and compile wrap each block before sharding, so each FSDP
    unit is a whole checkpointed / compiled block: recomputation re-gathers that block's parameters alone."""
    if getattr(model, "_keel_parallelized", False):
        return
    if blocks := agreed_checkpointed_blocks(trainer.checkpointed_blocks(model.cfg.depth)):
        apply_activation_checkpointing(model, blocks)
    if trainer.compile:
        compile_blocks(model, trainer.compile_mode)
    if device_mesh is not None:
        shard(model, sharding_mesh(device_mesh, trainer), mixed_precision_policy(trainer))
    model._keel_parallelized = True


def agreed_checkpointed_blocks(blocks: int) -> int:
    """The most blocks any process checkpoints: trainer.activation_checkpointing=auto is resolved by each process from
    its own GPU (or free host memory), and processes that recompute different blocks would issue different FSDP
    all-gathers and wait for each other forever."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return blocks
    every = [0] * dist.get_world_size()
    dist.all_gather_object(every, blocks)
    return max(every)


def sharding_mesh(device_mesh, trainer):
    """The mesh fully_shard shards over: every process (FSDP), or under trainer.hsdp a 2-D mesh of nodes x a
    node's processes, whose first dimension fully_shard replicates over and whose second it shards over (HSDP:
    parameters all-gathered and gradients reduce-scattered within a node only, gradients all-reduced across
    nodes once per step)."""
    if not trainer.hsdp:
        return device_mesh["data_parallel"]
    return init_device_mesh(
        device_mesh.device_type, (trainer.num_nodes, trainer.devices), mesh_dim_names=("replicate", "shard")
    )


def shard(model: KeelLM, mesh, mp_policy: MixedPrecisionPolicy) -> None:
    """FSDP2: every parameter is split over the mesh's ranks (dim 0; on a 2-D mesh over its second dimension,
    replicated over its first: HSDP). Units, as torchtitan makes them: the embedding (untied: its gradient is
    reduce-scattered as its backward ends, not with the root's), each block, and the root holding the rest (final
    norm, head: the loss head reads head.weight without calling the head module, whose own unit would never be
    gathered, and the root is gathered before anything runs). Each unit is all-gathered just before its forward (and
    again for backward) and freed after, except the last block, whose backward comes next: freeing it would gather
    it again at once.

    Every rank starts from rank 0's weights, broadcast one tensor at a time into the others' shards: only rank 0
    needs to build the model for real (the others may build it on the meta device, `KeelLitModule(empty_init=
    True)`), so a node's host holds one full fp32 copy at most, not one per GPU (docs/distributed.md)."""
    full = model.state_dict() if dist.get_rank() == 0 else {}  # before sharding replaces the parameters
    if not model.cfg.tie_embeddings:  # tied, the head's weight is the embedding's: one unit, the root's
        fully_shard(model.embed, mesh=mesh, mp_policy=mp_policy)
    for index, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=index < len(model.blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    built_empty = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if built_empty:
        model.to_empty(device=mesh_device(mesh))
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if built_empty:
        model.reset_buffers()


@contextmanager
def deferred_gradient_reduction(module: torch.nn.Module, reduce_scatter: bool):
    """Within: backward accumulates gradients without reducing them over the processes, for a micro-batch that is
    not its optimizer step's last (trainer.reduce_every_micro_batch). reduce_scatter=False: no communication at all;
    each unit keeps its unsharded gradient (fp32, the reduce dtype) until the last micro-batch reduce-scatters the
    sum once. reduce_scatter=True: each micro-batch reduce-scatters into the sharded gradient as usual, and only
    HSDP's all-reduce across nodes waits for the last. Either way the step's gradients are those of reducing every
    time (tests/test_fsdp_equivalence.py)."""
    units = [unit for unit in module.modules() if isinstance(unit, FSDPModule)]
    for unit in units:
        if reduce_scatter:
            unit.set_requires_all_reduce(False, recurse=False)
        else:
            unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)  # reduce-scatter and all-reduce both back on


def mesh_device(mesh) -> torch.device:
    """The device a mesh's ranks compute on (where fully_shard puts their shards): this process's current GPU."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def mixed_precision_policy(trainer) -> MixedPrecisionPolicy:
    """Under bf16-mixed: compute with bf16 copies of the parameters (half the all-gather traffic), reduce
    gradients in trainer.reduce_dtype (fp32 by default); the sharded master weights and the optimizer state stay
    fp32. cast_forward_inputs=False keeps FSDP from casting each block's input - the fp32 residual stream - to bf16,
    which Keel's alpha * x + F(x) cannot afford at depth (see model.py); Lightning's autocast casts the matmul
    inputs. Other precisions compute in the parameters' dtype; None reduces the gradients in it too."""
    reduce_dtype = torch.bfloat16 if trainer.reduce_dtype == "bf16" else torch.float32
    if resolve_precision(trainer) != "bf16-mixed":
        return MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if trainer.reduce_dtype == "bf16" else None)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
