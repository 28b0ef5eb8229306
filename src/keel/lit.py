"""The LightningModule: loss, optimizer, schedule and validation around a plain KeelLM.

Parallelism, activation checkpointing and compile are applied to the model from outside
(`keel.parallel.parallelize`, called in `configure_model`); this module knows nothing of them. Each optimizer step
measures its gradient norms once, right after backward (`grad_norms`, `global_grad_norm`: what clipping scales by and
the grad-norm and stability monitors read), and drops an update whose global gradient norm is not finite.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from lightning.pytorch import LightningModule
from torchmetrics import SumMetric

from keel import tensor_norms
from keel.cadence import due, finished_step
from keel.checkpoint.payload import KeelPayload, read_payload, write_payload
from keel.checkpoint.resume import rescale_batch_progress
from keel.config import Config, OptimConfig, to_dict
from keel.model import KeelLM, next_token_loss
from keel.parallel import parallelize
from keel.schedule import lr_factor


def make_optimizer(model: KeelLM, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, weight decay on matrices only. Under model.parametrization=mup the hidden
    matrices train at optim.lr x mup_base_width / width, in a group named "hidden" whose `lr_scale` says so; LambdaLR
    multiplies each group's own initial LR, so the scale holds at every step of the schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = frozenset(map(id, model.hidden_matrices())) if model.cfg.parametrization == "mup" else frozenset()
    matrices = [p for p in params if p.ndim >= 2]
    decay = optim.weight_decay
    groups = [
        {"name": "matrices", "params": [p for p in matrices if id(p) not in hidden], "weight_decay": decay},
        {"name": "gains", "params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},  # norm gains
    ]
    if hidden:
        scale = model.cfg.mup_ratio
        groups.append(
            {
                "name": "hidden",
                "params": [p for p in matrices if id(p) in hidden],
                "weight_decay": decay,
                "lr": optim.lr * scale,
                "lr_scale": scale,
            }
        )
    # fused: one kernel for every tensor (CPU and CUDA), cheaper per step than the foreach default (docs/bench.md)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=True)


class KeelLitModule(LightningModule):
    def __init__(
        self,
        cfg: Config,
        tokenizer_json: str | None = None,
        empty_init: bool = False,
        data_manifest_sha256: str | None = None,
    ) -> None:
        """empty_init: build the model on the meta device (no memory, no values): for a process whose weights
        come from another's when the model is parallelized (configure_model). tokenizer_json and
        data_manifest_sha256 (the shards' identity) go into every checkpoint (keel.checkpoint.payload)."""
        super().__init__()
        self.cfg = cfg
        self.tokenizer_json = tokenizer_json  # evaluation needs nothing else beside the weights
        self.data_manifest_sha256 = data_manifest_sha256
        with torch.device("meta") if empty_init else nullcontext():
            self.model = KeelLM(cfg.model)
        # validation loss summed over tokens, and the tokens, over batches and processes; a NaN loss stays NaN
        # (MeanMetric drops NaNs, and with nan_strategy="disable" ignores its weights: torchmetrics 1.9)
        self.val_loss_sum, self.val_tokens = SumMetric(nan_strategy="disable"), SumMetric(nan_strategy="disable")
        # this optimizer step's gradient norms, set right after its backward (measure_grad_norms)
        self.grad_norms: torch.Tensor | None = None
        self.global_grad_norm: torch.Tensor | None = None
        self.heldout: dict | None = None  # the last validation, {"step", "loss"}: checkpoints keep it (model cards)

    def configure_model(self) -> None:
        parallelize(self.model, self.cfg.trainer, getattr(self, "device_mesh", None))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = next_token_loss(self.model, batch)
        # not prog_bar: Lightning reads a progress-bar value to the host after every batch (StepProgressBar shows
        # it at logging steps); logged values are read only when written, every trainer.log_every_n_steps
        self.log("train/loss", loss)
        return loss

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """Lightning's step, with the step's gradients measured and judged as soon as its closure (the last
        micro-batch's forward and backward) returns: before the on_before_optimizer_step hooks, clipping and the
        update. fp16 loss scaling: the GradScaler drops a non-finite update itself, and only it knows the scale."""

        def closure():
            loss = optimizer_closure()
            self.measure_grad_norms()
            if getattr(self.trainer.precision_plugin, "scaler", None) is None:
                drop_nonfinite_update(self.optimizers(use_pl_optimizer=False), self.global_grad_norm)
            return loss

        optimizer.step(closure=closure)

    def measure_grad_norms(self) -> torch.Tensor:
        """Set (and return) `grad_norms`, the full gradient norm of each parameter (0 without a gradient) in
        model.parameters() order, and `global_grad_norm`, their L2 norm: once per optimizer step, after backward,
        before clipping. A collective under FSDP: every rank measures at the same point."""
        self.grad_norms = tensor_norms.grad_norms(list(self.model.parameters()))
        self.global_grad_norm = torch.linalg.vector_norm(self.grad_norms)
        return self.grad_norms

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """optim.grad_clip (Lightning's gradient_clip_val; norm clipping) by this step's global_grad_norm, folded into
        the fused AdamW step: Lightning calls this after the on_before_optimizer_step hooks (which see the unclipped
        gradients), and the step divides each gradient by `clip_divisor` in its kernel, as it unscales GradScaler's
        gradients, instead of a separate pass over every gradient (clip_grads_with_norm_'s multiply); the step leaves
        the clipped gradients in .grad, as that pass did. Equal to it within fp32 rounding (a division for a
        multiplication), exactly equal when the norm is below the threshold (a division by 1)."""
        # fp16 loss scaling never clips (the config refuses it): its GradScaler sets grad_scale itself, after this
        optimizer.grad_scale = clip_divisor(self.global_grad_norm, gradient_clip_val) if gradient_clip_val else None

    def on_train_batch_end(self, outputs, batch: torch.Tensor, batch_idx: int) -> None:
        # After the last optimizer step: Lightning validates when a stop is asked for, so the final model gets its
        # held-out loss even when max_steps is not a multiple of val_every_n_steps (else it ends unvalidated)
        if self.trainer.global_step >= self.trainer.max_steps:
            self.trainer.should_stop = True
        step = finished_step(self.trainer)
        # only when Lightning writes step metrics (a logging step, or the last): a logged float is a new device tensor
        if step is not None and (due(step, self.trainer.log_every_n_steps) or self.trainer.should_stop):
            global_tokens_per_step = self.cfg.device_tokens_per_step * self.trainer.world_size
            self.log("train/tokens", float((step + 1) * global_tokens_per_step))

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        tokens = batch[:, 1:].numel()
        self.val_loss_sum.update(next_token_loss(self.model, batch) * tokens)
        self.val_tokens.update(tokens)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss_sum.compute() / self.val_tokens.compute()
        self.val_loss_sum.reset()
        self.val_tokens.reset()
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", loss.exp(), sync_dist=False)
        self.heldout = {"step": self.global_step, "loss": loss.item()}

    def configure_optimizers(self):
        optim = self.cfg.optim
        optimizer = make_optimizer(self.model, optim)
        max_steps = self.cfg.trainer.max_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim, max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}

    def on_train_start(self) -> None:
        """A resume restores the checkpoint's optimizer hyper-parameters and the scheduler's base LRs, whatever the
        config now says; the config's win (keel.rundir.write_config has printed what changed). On a fresh start they
        are already the config's: nothing moves."""
        optimizer, scheduler = self.optimizers(use_pl_optimizer=False), self.lr_schedulers()
        configured = make_optimizer(self.model, self.cfg.optim).param_groups  # no state: AdamW allocates it in step
        factor = lr_factor(scheduler.last_epoch, self.cfg.optim, self.cfg.trainer.max_steps)
        for group, wanted in zip(optimizer.param_groups, configured, strict=True):
            group.update({key: value for key, value in wanted.items() if key != "params"})
            group["initial_lr"] = wanted["lr"]
            group["lr"] = wanted["lr"] * factor  # this step's, as LambdaLR would have set it from these base LRs
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        write_payload(
            checkpoint,
            KeelPayload(
                config=to_dict(self.cfg),
                tokenizer_json=self.tokenizer_json,
                heldout=self.heldout,
                data_manifest_sha256=self.data_manifest_sha256,
            ),
        )

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # keel.checkpoint.resume.check_resume has checked it (keel.training) before any work
        self.heldout = read_payload(checkpoint).heldout
        rescale_batch_progress(checkpoint, self.cfg.trainer.grad_accum)


def clip_divisor(global_grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What to divide every gradient by for global-norm clipping at max_norm: the inverse of torch's clip coefficient
    (clip_grads_with_norm_: max_norm / (norm + 1e-6), at most 1), computed on the device (no host read), fp32 as the
    fused optimizers' grad_scale must be; not finite where the norm is not (drop_nonfinite_update drops that step)."""
    return ((global_grad_norm + 1e-6) / max_norm).clamp(min=1.0)


def drop_nonfinite_update(optimizer: torch.optim.Optimizer, global_grad_norm: torch.Tensor) -> None:
    """Have the fused AdamW skip this step if the global gradient norm is not finite (a NaN or inf loss on any rank
    makes it so; the norm is the same on every rank, so all skip alike): decided on the device, without a host
    read, as GradScaler does, through the optimizer's `found_inf`; weights, moments and step count stay as they
    were, and the LR schedule advances. Set at every step: the flag persists until the next."""
    optimizer.found_inf = (~torch.isfinite(global_grad_norm)).float()
