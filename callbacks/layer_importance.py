"""Layer importance over training (the paper's Section 8, made dynamic): how much the loss rises when one
block is skipped, i.e. its output replaced by its input, on one fixed validation batch.

Every `every_n_steps`: `importance/block_NNN` (loss skipped - loss of the full model), `importance/base_loss`, a
blocks x steps heatmap (docs/tensorboard.md, "Layer importance"). Deep models measure `max_blocks` evenly spaced
blocks. A skip (keel.layer_skip) swaps the block for a module that returns its input: nothing else changes and
there are no hooks to recompile under torch.compile. Under FSDP every rank runs the same (collective) forwards on
its own batch; the losses are averaged over ranks and rank 0 logs.
"""

from __future__ import annotations

import time

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from keel.cadence import due, finished_step
from keel.callbacks.log_writing import log_scalars
from keel.callbacks.options.layer_importance import LayerImportanceConfig
from keel.callbacks.per_layer import Heatmap, evenly_spaced
from keel.config import Config
from keel.layer_skip import skip_losses


class LayerImportance(Callback):
    def __init__(self, config: LayerImportanceConfig | None = None) -> None:
        self.config = config if config is not None else LayerImportanceConfig()

    @classmethod
    def from_config(cls, options: LayerImportanceConfig, cfg: Config) -> LayerImportance:
        return cls(options)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.datamodule is None:
            raise RuntimeError("LayerImportance takes its fixed batch from trainer.datamodule.val_dataloader()")
        self._batch = next(iter(trainer.datamodule.val_dataloader())).to(pl_module.device)
        self._blocks = evenly_spaced(pl_module.model.cfg.depth, self.config.max_blocks)
        rows = [f"block {b}" for b in self._blocks]
        self._heatmap = Heatmap("importance/heatmap", rows, "loss increase when skipped")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        step = finished_step(trainer)
        if step is None or not due(step, self.config.every_n_steps):
            return
        start = time.perf_counter()
        model = pl_module.model
        was_training = model.training
        model.eval()
        try:
            with trainer.precision_plugin.forward_context():
                losses = skip_losses(model, self._batch, self._blocks)
        finally:
            model.train(was_training)
        base, *skipped = trainer.strategy.reduce(losses, reduce_op="mean").tolist()
        increases = [loss - base for loss in skipped]
        metrics = {f"importance/block_{b:03d}": inc for b, inc in zip(self._blocks, increases)}
        metrics["importance/base_loss"] = base
        if trainer.is_global_zero:
            self._heatmap.add(step, increases)
            self._heatmap.log(trainer, step)
        metrics["time/layer_importance_ms"] = 1e3 * (time.perf_counter() - start)
        log_scalars(trainer, metrics, step)
