"""Things applied *to* a plain KeelLM from outside (torchtitan style): activation checkpointing,
per-block torch.compile and FSDP2 sharding, and the Lightning strategy that goes with them. The model
never knows about them."""

from __future__ import annotations

import os
import shutil
import types
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from keel.checkpoint import refuse_payloads
from keel.checkpoint_io import SHARDED_META, AsyncShardedWriter, commit_dir, staging_path
from keel.config import resolve_accelerator, resolve_precision
from keel.errors import ConfigError
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
    return init_device_mesh(device_mesh.device_type, (trainer.num_nodes, trainer.devices),
                            mesh_dim_names=("replicate", "shard"))


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


def resolve_async_checkpoint(trainer) -> bool:
    """trainer.async_checkpoint, with auto resolved: on for sharded (FSDP) checkpoints on GPUs, which a synchronous
    save keeps idle while it writes; off on CPU, so that CPU runs save as they always did."""
    if trainer.async_checkpoint != "auto":
        return trainer.async_checkpoint
    return trainer.resolved_strategy == "fsdp" and resolve_accelerator(trainer) == "gpu"


NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")  # present where Linux has loaded the NVIDIA kernel driver


def check_trainer(trainer) -> None:
    """Refuse combinations that cannot run, saying what to change, before any process starts."""
    world = trainer.world_size
    if trainer.accelerator == "auto" and not torch.cuda.is_available() and NVIDIA_DRIVER.is_file():
        # e.g. a driver older than this torch build needs: torch only warns, and auto would train on the CPU
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(f"trainer.accelerator=auto: torch {torch.__version__} ({build}) sees no GPU, yet this machine "
                          f"has an NVIDIA driver loaded ({NVIDIA_DRIVER.read_text().splitlines()[0].strip()}); install "
                          "the torch build the driver supports (docs/distributed.md, \"The torch build and the GPU "
                          "driver\"), or set trainer.accelerator=cpu to train on the CPU")
    if trainer.accelerator == "gpu" and not torch.cuda.is_available():
        raise ConfigError("trainer.accelerator=gpu: no CUDA GPU is visible; use trainer=cpu (or trainer.accelerator=cpu)")
    visible = torch.cuda.device_count()
    if resolve_accelerator(trainer) == "gpu" and trainer.devices > visible and SLURMEnvironment.detect():
        # e.g. --gpus-per-task=1: Lightning gives each task the GPU of its local rank among those it sees
        raise ConfigError(f"trainer.devices={trainer.devices}: this SLURM task sees {visible} CUDA GPU(s), and each "
                          "process takes the GPU of its local rank among all of its node's; submit with "
                          f"--gpus-per-node={trainer.devices} --ntasks-per-node={trainer.devices}, without "
                          "--gpus-per-task or --gpu-bind (which leave each task only its own GPU)")
    if resolve_accelerator(trainer) == "gpu" and trainer.devices > visible:
        raise ConfigError(f"trainer.devices={trainer.devices}: only {visible} CUDA GPU(s) visible on "
                          "this node; trainer.devices counts GPUs per node")
    if trainer.resolved_strategy == "single" and world > 1:
        raise ConfigError(f"trainer.strategy=single runs one process, not trainer.devices x trainer.num_nodes = {world}; "
                          "use trainer=ddp or trainer=fsdp")
    if trainer.resolved_strategy == "fsdp" and world < 2 and resolve_accelerator(trainer) == "cpu":
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
    before torch reads them. With async_checkpoint the shards are written in the background (AsyncShardedWriter)
    and swapped in by finish_checkpoint, which the checkpoint callback calls once the write is done."""

    def __init__(self, *args, async_checkpoint: bool = False, reduce_every_micro_batch: bool = False,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.async_writer = AsyncShardedWriter() if async_checkpoint else None
        self.reduce_every_micro_batch = reduce_every_micro_batch

    @contextmanager
    def block_backward_sync(self):
        """Lightning enters this around each micro-batch of an optimizer step but its last (under DDP it is
        no_sync; ModelParallelStrategy's own does nothing, so FSDP reduced every micro-batch)."""
        with deferred_gradient_reduction(self.model, reduce_scatter=self.reduce_every_micro_batch):
            yield

    def setup_environment(self) -> None:
        super().setup_environment()
        # every rank reduces at the same micro-batches (each resolved auto from its own GPU): once per step only if
        # all can hold the unsharded gradients
        self.reduce_every_micro_batch = not self.reduce_boolean_decision(not self.reduce_every_micro_batch, all=True)
        if self.async_writer is not None:
            self.async_writer.open(self.root_device)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        path = Path(self.broadcast(str(filepath)))
        staging = staging_path(path)
        if self.is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)  # left by a save that crashed
        self.barrier()
        if self.async_writer is not None:  # Lightning's layout: the tensors by DCP, the rest in rank 0's meta.pt
            staging.mkdir(parents=True, exist_ok=True)
            tensors = {"state_dict": checkpoint.pop("state_dict")}
            tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
            self.async_writer.start(tensors, staging, path)
            if self.is_global_zero:
                torch.save(checkpoint, staging / SHARDED_META)
            return
        super().save_checkpoint(checkpoint, staging, storage_options)  # returns once every rank wrote its shards
        if self.is_global_zero:
            commit_dir(staging, path)
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_dir():  # torch would unpickle .metadata and the byte entries as they are: refuse a payload first
            refuse_payloads(path)
        return super().load_checkpoint(path, weights_only)

    def finish_checkpoint(self) -> Path | None:
        """Wait for the checkpoint being written in the background, raise what failed there, and move it into
        place; its path, or None if none was being written."""
        if self.async_writer is None or self.async_writer.in_flight is None:
            return None
        path = self.async_writer.finish(commit=self.is_global_zero)
        self.barrier()
        return path

    def lightning_module_state_dict(self) -> dict:
        if self.async_writer is None:
            return super().lightning_module_state_dict()
        return get_model_state_dict(self.model)  # the live shards: the writer copies them to host memory itself

    def optimizer_state(self, optimizer) -> dict:
        if self.async_writer is None:
            return super().optimizer_state(optimizer)
        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer))  # as above

    def teardown(self) -> None:
        if self.async_writer is not None:
            self.async_writer.close()
        super().teardown()


def build_strategy(trainer):
    """The Lightning strategy for trainer.resolved_strategy; nccl between GPUs, gloo between CPU processes."""
    check_trainer(trainer)
    if trainer.resolved_strategy == "single":
        return "auto"
    backend = "nccl" if resolve_accelerator(trainer) == "gpu" else "gloo"
    if trainer.resolved_strategy == "fsdp":
        return FSDP2Strategy(
            data_parallel_size=trainer.world_size, tensor_parallel_size=1, save_distributed_checkpoint=True,
            process_group_backend=backend, async_checkpoint=resolve_async_checkpoint(trainer),
            reduce_every_micro_batch=trainer.reduce_every_micro_batch is not False,  # auto unresolved: as before
        )
    # bf16: DDP's own hook casts each gradient bucket to bf16 for the all-reduce and back (torch's default_hooks)
    hook = bf16_compress_hook if trainer.reduce_dtype == "bf16" else None
    return DDPStrategy(process_group_backend=backend, ddp_comm_hook=hook)
