"""Things applied *to* a plain KeelLM from outside (torchtitan style): activation checkpointing,
per-block torch.compile and FSDP2 sharding, and the Lightning strategy that goes with them. The model
never knows about them."""

from __future__ import annotations

import os
import shutil
import types
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from keel.checkpoint import commit_dir, refuse_payloads, staging_path
from keel.errors import ConfigError
from keel.model import KeelLM


def apply_activation_checkpointing(model: KeelLM) -> None:
    """Recompute each block's activations in backward: memory O(1 block) instead of O(depth).
    In place (each block's forward becomes a checkpointed call of its class's forward), so parameter names,
    state_dict keys and module hooks stay those of the plain model - `checkpoint_wrapper` strips its
    `_checkpoint_wrapped_module.` prefix from state_dict() but not from named_parameters() - and
    per-block compile still traces it (it silently skips a functools.partial(checkpoint, ...) forward)."""
    for block in model.blocks:
        block.forward = types.MethodType(_checkpointed_forward, block)


def _checkpointed_forward(block, *args, **kwargs):
    # no RNG state to keep: the model has no dropout
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def compile_blocks(model: KeelLM) -> None:
    """Compile each block separately: one graph reused by every block (fast compile at any depth).
    In place (`Module.compile`), unlike `torch.compile(block)`, which would add an `_orig_mod.`
    prefix to every state_dict key and make checkpoints depend on the compile setting."""
    for block in model.blocks:
        block.compile(dynamic=False)


def parallelize(model: KeelLM, trainer, device_mesh=None) -> None:
    """Apply the trainer config's activation checkpointing and compile, then shard over `device_mesh` (given
    by the FSDP strategy only), once. Checkpointing and compile wrap each block before sharding, so each FSDP
    unit is a whole checkpointed / compiled block: recomputation re-gathers that block's parameters alone."""
    if getattr(model, "_keel_parallelized", False):
        return
    if trainer.activation_checkpointing:
        apply_activation_checkpointing(model)
    if trainer.compile:
        compile_blocks(model)
    if device_mesh is not None:
        shard(model, sharding_mesh(device_mesh, trainer), mixed_precision_policy(trainer))
    model._keel_parallelized = True


def sharding_mesh(device_mesh, trainer):
    """The mesh fully_shard shards over: every process (FSDP), or under trainer.hsdp a 2-D mesh of nodes x a
    node's processes, whose first dimension fully_shard replicates over and whose second it shards over (HSDP:
    parameters all-gathered and gradients reduce-scattered within a node only, gradients all-reduced across
    nodes once per step)."""
    if not trainer.hsdp:
        return device_mesh["data_parallel"]
    return init_device_mesh(device_mesh.device_type, (trainer.num_nodes, trainer.devices),
                            mesh_dim_names=("replicate", "shard"))


def shard(model: KeelLM, mesh, mp_policy: MixedPrecisionPolicy) -> None:
    """FSDP2: every parameter is split over the mesh's ranks (dim 0; on a 2-D mesh over its second dimension,
    replicated over its first: HSDP). Each block is one unit, all-gathered just before its forward (and again for
    backward) and freed after; the root unit holds the rest (embedding, final norm, head).

    Every rank starts from rank 0's weights, broadcast one tensor at a time into the others' shards: only rank 0
    needs to build the model for real (the others may build it on the meta device, `KeelLitModule(empty_init=
    True)`), so a node's host holds one full fp32 copy at most, not one per GPU (paper_d512: 26 GB, not 208)."""
    full = model.state_dict() if dist.get_rank() == 0 else {}  # before sharding replaces the parameters
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    built_empty = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if built_empty:
        model.to_empty(device=mesh_device(mesh))
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if built_empty:
        model.reset_buffers()


def mesh_device(mesh) -> torch.device:
    """The device a mesh's ranks compute on (where fully_shard puts their shards): this process's current GPU."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def mixed_precision_policy(trainer) -> MixedPrecisionPolicy:
    """Under bf16-mixed: compute with bf16 copies of the parameters (half the all-gather traffic), reduce
    gradients in fp32; the sharded master weights and the optimizer state stay fp32. cast_forward_inputs=False
    keeps FSDP from casting each block's input - the fp32 residual stream - to bf16, which Keel's
    alpha * x + F(x) cannot afford at depth (see model.py); Lightning's autocast casts the matmul inputs."""
    if resolve_precision(trainer) != "bf16-mixed":
        return MixedPrecisionPolicy()  # fp32 throughout
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def resolve_accelerator(trainer) -> str:
    if trainer.accelerator != "auto":
        return trainer.accelerator
    return "gpu" if torch.cuda.is_available() else "cpu"


def resolve_precision(trainer, accelerator: str | None = None) -> str:
    """trainer.precision, with auto resolved for `accelerator` (default: the one the trainer resolves to)."""
    if trainer.precision != "auto":
        return trainer.precision
    return "bf16-mixed" if (accelerator or resolve_accelerator(trainer)) == "gpu" else "32-true"


def check_trainer(trainer) -> None:
    """Refuse combinations that cannot run, saying what to change, before any process starts."""
    world = trainer.world_size
    if trainer.accelerator == "gpu" and not torch.cuda.is_available():
        raise ConfigError("trainer.accelerator=gpu: no CUDA GPU is visible; use trainer=cpu (or trainer.accelerator=cpu)")
    if resolve_accelerator(trainer) == "gpu" and trainer.devices > torch.cuda.device_count():
        raise ConfigError(f"trainer.devices={trainer.devices}: only {torch.cuda.device_count()} CUDA GPU(s) visible on "
                          "this node; trainer.devices counts GPUs per node")
    if trainer.strategy == "single" and world > 1:
        raise ConfigError(f"trainer.strategy=single runs one process, not trainer.devices x trainer.num_nodes = {world}; "
                          "use trainer=ddp or trainer=fsdp")
    if trainer.strategy == "fsdp" and world < 2 and resolve_accelerator(trainer) == "cpu":
        raise ConfigError("trainer.strategy=fsdp: FSDP shards over >= 2 processes; on CPU use trainer.devices=2 or trainer=cpu")
    if trainer.compile and resolve_accelerator(trainer) == "cpu" and (missing := missing_cpp_compiler()):
        raise ConfigError(f"trainer.compile=true: torch.compile on CPU builds C++ kernels, and no C++ compiler was found "
                          f"({missing}); install one (e.g. apt install g++, xcode-select --install) or set "
                          "trainer.compile=false")
    if trainer.compile and resolve_accelerator(trainer) == "gpu" and (missing := missing_c_compiler()):
        raise ConfigError(f"trainer.compile=true: torch.compile on GPU builds Triton kernels, whose launchers Triton "
                          f"compiles with a C compiler, and none was found ({missing}); install one (e.g. apt install "
                          "gcc) or point $CC at one, or set trainer.compile=false")
    if trainer.num_nodes > 1 and not (SLURMEnvironment.detect() or TorchElasticEnvironment.detect() or "NODE_RANK" in os.environ):
        raise ConfigError(f"trainer.num_nodes={trainer.num_nodes}: start one launcher per node with torchrun or srun "
                          "(docs/distributed.md); run alone, every node would wait for the others forever")


def missing_cpp_compiler() -> str | None:
    """Why inductor would find no C++ compiler (it would fail at the first compiled step), or None if it finds one:
    asked the way inductor asks, so $CXX and torch's own search order count."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        cxx = inductor_config.cpp.cxx
        return "searched " + ", ".join(str(c) for c in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if c)
    return None


def missing_c_compiler() -> str | None:
    """Why Triton would find no C compiler for its kernels' launchers (it would fail at the first compiled step),
    or None: looked for as triton.runtime.build does, $CC, else gcc or clang on PATH (not asked of Triton itself,
    which caches its answer for the process)."""
    if cc := os.environ.get("CC"):
        return None if shutil.which(cc) else f"$CC={cc} is not a program"
    return None if shutil.which("gcc") or shutil.which("clang") else "no $CC, and neither gcc nor clang on PATH"


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 through Lightning's ModelParallelStrategy (data parallel over every process, no tensor parallel;
    `parallelize` shards the model in configure_model). Its distributed checkpoints - a directory of per-rank
    shards plus rank 0's meta.pt - are written to a staging directory first, then swapped in whole, so a
    crash mid-save leaves the previous checkpoint readable; their `.metadata` and byte entries are checked for code
    before torch reads them."""

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        path = Path(self.broadcast(str(filepath)))
        staging = staging_path(path)
        if self.is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)  # left by a save that crashed
        self.barrier()
        super().save_checkpoint(checkpoint, staging, storage_options)  # returns once every rank wrote its shards
        if self.is_global_zero:
            commit_dir(staging, path)
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_dir():  # torch would unpickle .metadata and the byte entries as they are: refuse a payload first
            refuse_payloads(path)
        return super().load_checkpoint(path, weights_only)


def build_strategy(trainer):
    """The Lightning strategy for trainer.strategy: auto = one device, or DDP over several; nccl between
    GPUs, gloo between CPU processes."""
    check_trainer(trainer)
    if trainer.resolved_strategy == "single":
        return "auto"
    backend = "nccl" if resolve_accelerator(trainer) == "gpu" else "gloo"
    if trainer.strategy == "fsdp":
        return FSDP2Strategy(
            data_parallel_size=trainer.world_size, tensor_parallel_size=1, save_distributed_checkpoint=True,
            process_group_backend=backend,
        )
    return DDPStrategy(process_group_backend=backend)
