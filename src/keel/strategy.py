"""The Lightning strategy for trainer.resolved_strategy: DDP, or FSDP2 (FSDP2Strategy) applying keel.parallel's
changes to the model and keeping its sharded checkpoints through keel.checkpoint.sharded."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from keel.checkpoint.sharded import AsyncShardedWriter, finish_sharded, load_sharded, save_sharded
from keel.config import resolve_accelerator
from keel.parallel import deferred_gradient_reduction


def resolve_async_checkpoint(trainer) -> bool:
    """trainer.async_checkpoint, with auto resolved: on for sharded (FSDP) checkpoints on GPUs, which a synchronous
    save keeps idle while it writes; off on CPU, so that CPU runs save as they always did."""
    if trainer.async_checkpoint != "auto":
        return trainer.async_checkpoint
    return trainer.resolved_strategy == "fsdp" and resolve_accelerator(trainer) == "gpu"


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 through Lightning's ModelParallelStrategy (data parallel over every process, no tensor parallel;
    keel.parallel.parallelize shards the model in configure_model). Its distributed checkpoints are saved and
    loaded by keel.checkpoint.sharded: staged and swapped in whole, checked for code before torch reads them, with
    async_checkpoint written in the background and swapped in by finish_checkpoint, which the checkpoint callback
    calls once the write is done."""

    def __init__(self, *args, async_checkpoint: bool = False, reduce_every_micro_batch: bool = False, **kwargs) -> None:
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
        save_sharded(
            self,
            checkpoint,
            filepath,
            lambda state, staging: super(FSDP2Strategy, self).save_checkpoint(state, staging, storage_options),
        )

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        return load_sharded(
            self, checkpoint_path, lambda path: super(FSDP2Strategy, self).load_checkpoint(path, weights_only)
        )

    def finish_checkpoint(self) -> Path | None:
        """Wait for the checkpoint being written in the background, raise what failed there, and move it into
        place; its path, or None if none was being written."""
        return finish_sharded(self)

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
    """The Lightning strategy for trainer.resolved_strategy (checked by keel.trainer_checks.check_trainer); nccl
    between GPUs, gloo between CPU processes."""
    if trainer.resolved_strategy == "single":
        return "auto"
    backend = "nccl" if resolve_accelerator(trainer) == "gpu" else "gloo"
    if trainer.resolved_strategy == "fsdp":
        return FSDP2Strategy(
            data_parallel_size=trainer.world_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=backend,
            async_checkpoint=resolve_async_checkpoint(trainer),
            reduce_every_micro_batch=trainer.reduce_every_micro_batch is not False,  # auto unresolved: as before
        )
    # bf16: DDP's own hook casts each gradient bucket to bf16 for the all-reduce and back (torch's default_hooks)
    hook = bf16_compress_hook if trainer.reduce_dtype == "bf16" else None
    return DDPStrategy(process_group_backend=backend, ddp_comm_hook=hook)
