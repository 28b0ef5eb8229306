"""`keel pretrain [--config FILE] [--print-config] [group=choice ...] [key=value ...]`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from keel.callbacks import GradNormMonitor, LayerImportance, SpeedMonitor, StabilityMonitor
from keel.checkpoint import LAST, AtomicCheckpointIO, check_resumable, checkpoint_dir, read_checkpoint, resolve_resume
from keel.config import Config, load_config, to_yaml
from keel.data import KeelDataModule, check_resumable_data, open_dataset
from keel.lit import KeelLitModule, check_same_model
from keel.model import ConfigError, flops_per_token
from keel.parallel import build_strategy, resolve_accelerator, resolve_precision


def set_threads(cfg: Config) -> None:
    """One intra-op thread per available core, shared among the processes on this node: more threads than
    cores (e.g. loader workers or 2 ranks each taking every core) oversubscribes the CPU."""
    threads = cfg.trainer.threads
    if threads == 0:
        cores = len(os.sched_getaffinity(0))
        per_process = cfg.trainer.devices if resolve_accelerator(cfg.trainer) == "cpu" else 1
        threads = max(1, (cores - cfg.data.loader_workers) // per_process)
    torch.set_num_threads(threads)


def build_callbacks(cfg: Config, dataset) -> list[Callback]:
    callbacks: list[Callback] = [
        ModelCheckpoint(
            dirpath=checkpoint_dir(cfg),
            filename="step{step:06d}",
            auto_insert_metric_name=False,
            every_n_train_steps=cfg.trainer.checkpoint_every_n_steps,
            save_top_k=0,
            save_last=True,
        ),
        LearningRateMonitor(logging_interval="step"),
    ]
    cb = cfg.callbacks
    if cb.grad_norms.enabled:
        if cb.grad_norms.activation_every_n_steps and (cfg.trainer.strategy == "fsdp" or cfg.trainer.compile):
            raise ConfigError("callbacks.grad_norms.activation_every_n_steps: the activation-gradient profile "
                              "(keel.gradflow) needs unsharded, uncompiled blocks; set it to 0 with "
                              "trainer.strategy=fsdp or trainer.compile=true")
        callbacks.append(GradNormMonitor(cb.grad_norms.every_n_steps, cb.grad_norms.heatmap_every_n_steps,
                                         cb.grad_norms.activation_every_n_steps, cb.grad_norms.max_blocks))
    if cb.stability.enabled:
        s = cb.stability
        callbacks.append(StabilityMonitor(cfg.run.dir, s.on_nonfinite, s.max_nonfinite, s.spike_margin,
                                          s.spike_patience, s.stagnation_window, s.stagnation_min_delta,
                                          s.stop_on_failure, s.signal, s.stagnation_below))
    if cb.layer_importance.enabled:
        callbacks.append(LayerImportance(cb.layer_importance.every_n_steps, cb.layer_importance.max_blocks))
    if cfg.eval.enabled:
        from keel.callbacks.downstream_eval import DownstreamEval  # imported only when used: lm-eval loads slowly

        callbacks.append(DownstreamEval(cfg))
    if cb.throughput.enabled:  # last: its step timing then includes the other callbacks' work
        tokens_per_step = cfg.trainer.micro_batch_size * cfg.model.seq_len * cfg.trainer.grad_accum
        callbacks.append(SpeedMonitor(tokens_per_step, flops_per_token(cfg.model), cb.throughput.window,
                                      cb.throughput.peak_flops))
    return callbacks


def build_trainer(cfg: Config, callbacks: list[Callback]) -> L.Trainer:
    t = cfg.trainer
    return L.Trainer(
        accelerator=resolve_accelerator(t),
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(t),
        precision=resolve_precision(t),
        max_steps=t.max_steps,
        accumulate_grad_batches=t.grad_accum,
        gradient_clip_val=cfg.optim.grad_clip or None,
        val_check_interval=t.val_every_n_steps * t.grad_accum,
        check_val_every_n_epoch=None,
        limit_val_batches=t.val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every_n_steps,
        logger=TensorBoardLogger(save_dir=cfg.run.dir, name="tb", version="", default_hp_metric=False),
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        default_root_dir=cfg.run.dir,
    )


def train(cfg: Config, extra_callbacks: list[Callback] = ()) -> L.Trainer:
    """Train (or resume) the run cfg describes; extra_callbacks are added to the configured ones."""
    set_threads(cfg)
    dataset = open_dataset(cfg)
    ckpt_path = resolve_resume(cfg)
    if ckpt_path is not None:  # fail before any work if the checkpoint is unreadable, of another model or layout
        checkpoint = read_checkpoint(ckpt_path, weights=False)
        check_same_model(cfg, checkpoint)
        check_resumable(cfg.trainer, ckpt_path, checkpoint)
        check_resumable_data(cfg, dataset, ckpt_path, checkpoint)
    L.seed_everything(cfg.run.seed, workers=True, verbose=False)
    module = KeelLitModule(cfg, tokenizer_json=dataset.tokenizer_json)
    trainer = build_trainer(cfg, [*build_callbacks(cfg, dataset), *extra_callbacks])
    if trainer.is_global_zero:
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run.dir) / "config.yaml").write_text(to_yaml(cfg))
    trainer.fit(module, datamodule=KeelDataModule(cfg), ckpt_path=ckpt_path)
    if trainer.global_step % cfg.trainer.checkpoint_every_n_steps:  # the final state, whatever the cadence
        trainer.save_checkpoint(checkpoint_dir(cfg) / LAST, weights_only=False)
    return trainer


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="keel pretrain", description=__doc__)
    parser.add_argument("--config", help="YAML merged over conf/config.yaml")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="group=choice (model=paper_d64) or key.path=value")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    train(cfg)
    return 0
