"""The LightningModule: loss, optimizer, schedule and validation around a plain KeelLM.

Parallelism, activation checkpointing and compile are applied to the model from outside
(`keel.parallel.parallelize`, called in `configure_model`); this module knows nothing of them.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics.text import Perplexity

from keel.config import Config, OptimConfig, from_dict, to_dict
from keel.model import ConfigError, KeelLM
from keel.parallel import parallelize


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


def next_token_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting batch[:, 1:] from batch[:, :-1]; batch: (B, T + 1) token ids."""
    inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
    logits = model(inputs)  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, weight decay on matrices only (`keel bench` times this same optimizer)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"name": "matrices", "params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
        {"name": "gains", "params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},  # norm gains
    ]
    # fused: one kernel for every tensor (CPU and CUDA); the foreach default cost ~4x more per step here
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=True)


class KeelLitModule(L.LightningModule):
    def __init__(self, cfg: Config, tokenizer_json: str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tokenizer_json = tokenizer_json  # stored in every checkpoint: evaluation needs nothing else
        self.model = KeelLM(cfg.model)
        self.val_perplexity = Perplexity()

    def configure_model(self) -> None:
        parallelize(self.model, self.cfg.trainer, getattr(self, "device_mesh", None))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.trainer.micro_batch_size * self.cfg.model.seq_len * self.trainer.world_size

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = next_token_loss(self.model, batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/tokens", float((self.global_step + 1) * self.tokens_per_step * self.cfg.trainer.grad_accum))
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        self.val_perplexity.update(self.model(inputs).float(), targets)

    def on_validation_epoch_end(self) -> None:
        perplexity = self.val_perplexity.compute()
        self.val_perplexity.reset()
        self.log("val/loss", perplexity.log(), prog_bar=True, sync_dist=False)
        self.log("val/ppl", perplexity, sync_dist=False)

    def configure_optimizers(self):
        optim = self.cfg.optim
        optimizer = make_optimizer(self.model, optim)
        max_steps = self.cfg.trainer.max_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim, max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["keel"] = {"config": to_dict(self.cfg), "tokenizer_json": self.tokenizer_json}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        check_same_model(self.cfg, checkpoint)


def check_same_model(cfg: Config, checkpoint: dict) -> None:
    """Refuse to resume a checkpoint of another model: name every differing model.* key."""
    if "keel" not in checkpoint:
        raise ConfigError("resume: not a keel checkpoint (no 'keel' entry)")
    saved = from_dict(checkpoint["keel"]["config"]).model
    diffs = [
        f"model.{key}: checkpoint {getattr(saved, key)!r} != config {getattr(cfg.model, key)!r}"
        for key in vars(cfg.model)
        if getattr(saved, key) != getattr(cfg.model, key)
    ]
    if diffs:
        raise ConfigError("resume: the checkpoint holds a different model; " + "; ".join(diffs))
