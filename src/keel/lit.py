"""The LightningModule: loss, optimizer, schedule and validation around a plain KeelLM.

Parallelism, activation checkpointing and compile are applied to the model from outside
(`keel.parallel.parallelize`, called in `configure_model`); this module knows nothing of them.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import lightning as L
import torch
from torchmetrics import SumMetric

from keel.callbacks.reporting import due, finished_step
from keel.config import Config, OptimConfig, from_dict, to_dict
from keel.errors import ConfigError
from keel.model import KeelLM, next_token_loss
from keel import tensor_norms
from keel.parallel import parallelize

# model.* keys a resumed run may change: they set how the loss is computed, not what the model is
FREE_ON_RESUME = ("loss_chunk",)


def lr_factor(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Multiplier of optim.lr at a step: warm-up (linear from 0, or geometric from min_lr_ratio), then cosine to
    min_lr_ratio (or constant)."""
    if step < optim.warmup_steps:
        if optim.schedule == "exp_warmup":  # min_lr_ratio at step 0, 1 at the last warm-up step
            return optim.min_lr_ratio ** (1 - step / max(1, optim.warmup_steps - 1))
        return (step + 1) / optim.warmup_steps
    if optim.schedule != "cosine":
        return 1.0
    progress = min(1.0, (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps))
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: KeelLM, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, weight decay on matrices only (`keel bench` times this same optimizer);
    under model.parametrization=mup the hidden matrices in a group of their own at LR x mup_base_width / width."""
    params = [p for p in model.parameters() if p.requires_grad]
    if model.cfg.parametrization == "sp":
        return adamw(params, optim)
    return adamw(params, optim, hidden=frozenset(map(id, model.hidden_matrices())), hidden_lr_scale=model.cfg.mup_ratio)


def adamw(params: list[torch.Tensor], optim: OptimConfig, matrix_ndim: int = 2, hidden: frozenset[int] = frozenset(),
          hidden_lr_scale: float = 1.0) -> torch.optim.AdamW:
    """make_optimizer's AdamW over params; matrix_ndim: the dims of a weight matrix (3 for models stacked along a
    leading member axis, `keel bench --members`). hidden: ids of the matrices trained at optim.lr x hidden_lr_scale
    (muP), in a group named "hidden" whose `lr_scale` says so; LambdaLR multiplies each group's own initial LR, so
    the scale holds at every step of the schedule."""
    matrices = [p for p in params if p.ndim >= matrix_ndim]
    decay = optim.weight_decay
    groups = [
        {"name": "matrices", "params": [p for p in matrices if id(p) not in hidden], "weight_decay": decay},
        {"name": "gains", "params": [p for p in params if p.ndim < matrix_ndim], "weight_decay": 0.0},  # norm gains
    ]
    if hidden:
        groups.append({"name": "hidden", "params": [p for p in matrices if id(p) in hidden], "weight_decay": decay,
                       "lr": optim.lr * hidden_lr_scale, "lr_scale": hidden_lr_scale})
    # fused: one kernel for every tensor (CPU and CUDA); the foreach default cost ~4x more per step here
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=True)


class KeelLitModule(L.LightningModule):
    def __init__(self, cfg: Config, tokenizer_json: str | None = None, empty_init: bool = False) -> None:
        """empty_init: build the model on the meta device (no memory, no values): for a process whose weights
        come from another's when the model is parallelized (configure_model)."""
        super().__init__()
        self.cfg = cfg
        self.tokenizer_json = tokenizer_json  # stored in every checkpoint: evaluation needs nothing else
        with torch.device("meta") if empty_init else nullcontext():
            self.model = KeelLM(cfg.model)
        # validation loss summed over tokens, and the tokens, over batches and processes; a NaN loss stays NaN
        # (MeanMetric drops NaNs, and with nan_strategy="disable" ignores its weights: torchmetrics 1.9)
        self.val_loss_sum, self.val_tokens = SumMetric(nan_strategy="disable"), SumMetric(nan_strategy="disable")
        self._grad_norms: torch.Tensor | None = None  # this step's, once asked for (grad_norms())
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

    def on_after_backward(self) -> None:
        self._grad_norms = None  # the gradients changed

    def grad_norms(self) -> torch.Tensor:
        """This step's full gradient norm of each parameter (0 without a gradient), in model.parameters() order:
        computed once per optimizer step, after backward and AMP unscaling, and shared by the grad-norm logging,
        the stability monitor (its L2 norm is the global norm) and clipping. A collective under FSDP: every rank
        asks for it at the same point."""
        if self._grad_norms is None:
            self._grad_norms = tensor_norms.grad_norms(list(self.model.parameters()))
        return self._grad_norms

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """optim.grad_clip (Lightning's gradient_clip_val; norm clipping), with the global norm the callbacks
        already computed: Lightning clips after the on_before_optimizer_step hooks."""
        if not gradient_clip_val:  # fp16 loss scaling never clips: the config refuses it (fused AdamW, Config)
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        total = torch.linalg.vector_norm(self.grad_norms())
        torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, total)

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

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["keel"] = {"config": to_dict(self.cfg), "tokenizer_json": self.tokenizer_json,
                              "heldout": self.heldout}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        check_same_model(self.cfg, checkpoint)
        self.heldout = checkpoint["keel"].get("heldout")
        saved_accum = from_dict(checkpoint["keel"]["config"]).trainer.grad_accum
        rescale_batch_progress(checkpoint, saved_accum, self.cfg.trainer.grad_accum)


def rescale_batch_progress(checkpoint: dict, saved_accum: int, accum: int) -> None:
    """Lightning counts the fit loop's progress in micro-batches, and measures the validation cadence
    (val_check_interval = val_every_n_steps x grad_accum) and the epoch's end in them. An elastic resume at another
    trainer.grad_accum gets, before the loops are restored, the counts this accumulation would have reached after
    the same optimizer steps; otherwise validation would run at other steps than configured."""
    if saved_accum == accum:
        return
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for counts in (progress["total"], progress["current"]):
        shift = counts["ready"] // saved_accum * (accum - saved_accum)  # steps x the change in micro-batches per step
        for key in counts:
            counts[key] += shift


def check_same_model(cfg: Config, checkpoint: dict, key: str = "resume") -> None:
    """Refuse to resume (or, key="init_from", start from) a checkpoint of another model: name every differing
    model.* key."""
    if "keel" not in checkpoint:
        raise ConfigError(f"{key}: not a keel checkpoint (no 'keel' entry)")
    saved = from_dict(checkpoint["keel"]["config"]).model
    diffs = [
        f"model.{key}: checkpoint {getattr(saved, key)!r} != config {getattr(cfg.model, key)!r}"
        for key in vars(cfg.model)
        if key not in FREE_ON_RESUME and getattr(saved, key) != getattr(cfg.model, key)
    ]
    if diffs:
        raise ConfigError(f"{key}: the checkpoint holds a different model; " + "; ".join(diffs))
