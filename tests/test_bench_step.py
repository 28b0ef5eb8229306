"""`keel bench` times the LightningModule's own training step: its TrainStep, driving KeelLitModule without a
Trainer, trains a model exactly as Lightning's fit does - same weights, same LR - with clipping acting."""

from __future__ import annotations

import lightning
import pytest
import torch
from torch.utils.data import DataLoader

from keel.bench.step import TrainStep
from keel.config import Config, ModelConfig, OptimConfig, TrainerConfig
from keel.lit import KeelLitModule

STEPS = 3


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_bench_step_is_the_step_lightning_runs(one_thread, precision):
    cfg = Config(
        model=ModelConfig(depth=2, width=32, n_heads=2, seq_len=16, vocab_size=64),
        trainer=TrainerConfig(compile=False, precision=precision, max_steps=STEPS),
        optim=OptimConfig(lr=1e-2, warmup_steps=2, grad_clip=0.05),
    )
    batch = torch.randint(64, (2, 17))
    torch.manual_seed(0)
    bare = KeelLitModule(cfg)
    torch.manual_seed(0)
    fitted = KeelLitModule(cfg)
    step = TrainStep(bare, batch)
    losses = [step() for _ in range(STEPS)]
    assert bare.global_grad_norm > cfg.optim.grad_clip  # the clip acted at the last step
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        max_steps=STEPS,
        gradient_clip_val=cfg.optim.grad_clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(fitted, train_dataloaders=DataLoader([batch] * STEPS, batch_size=None))
    assert all(torch.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert step.optimizer.param_groups[0]["lr"] == trainer.optimizers[0].param_groups[0]["lr"]
    for (name, trained), param in zip(bare.model.named_parameters(), fitted.model.parameters()):
        torch.testing.assert_close(trained, param, rtol=0, atol=0, msg=name)
