"""`keel pretrain [--config FILE] [--print-config] [group=choice ...] [key=value ...]`."""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.loggers import TensorBoardLogger

from keel.callbacks import (GracefulInterrupt, GradNormMonitor, LayerImportance, RunCheckpoint, SpeedMonitor,
                            StabilityMonitor)
from keel.callbacks.stability import describe
from keel.checkpoint import AtomicCheckpointIO, check_resumable, checkpoint_dir, read_checkpoint, resolve_resume
from keel.config import Config, load_config, to_yaml
from keel.data import KeelDataModule, check_resumable_data, open_dataset
from keel.lit import KeelLitModule, check_same_model
from keel.model import ConfigError, flops_per_token
from keel.parallel import build_strategy, resolve_accelerator, resolve_precision
from keel.rundir import RunDirLock, remove_orphans, say, write_config


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
        RunCheckpoint(checkpoint_dir(cfg), cfg.trainer.checkpoint_every_n_steps, cfg.trainer.keep_last_k),
        GracefulInterrupt(),
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
                                          s.stop_on_failure))
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


class Interrupted(KeyboardInterrupt):
    """Training stopped early on Ctrl-C, after writing a checkpoint (`keel` exits 130 with this message)."""


def launched_as_rank_zero() -> bool:
    """Whether the launcher made this process global rank 0 (before Lightning knows): torchrun, SLURM and
    Lightning's own launcher set a non-zero rank, local rank or node rank in every other process."""
    keys = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
    return all(int(os.environ.get(key) or 0) == 0 for key in keys)


def train(cfg: Config, extra_callbacks: list[Callback] = ()) -> L.Trainer:
    """Train (or resume) the run cfg describes; extra_callbacks are added to the configured ones. Rank 0 holds
    the run directory's lock throughout, taken before anything is written (the others write nothing before
    rank 0 has joined them)."""
    set_threads(cfg)
    owner = launched_as_rank_zero()
    with RunDirLock(cfg.run.dir) if owner else nullcontext():
        return _train(cfg, extra_callbacks, owner)


def _train(cfg: Config, extra_callbacks: list[Callback], owner: bool) -> L.Trainer:
    dataset = open_dataset(cfg)
    if owner:  # no save runs now: temporary files in checkpoints/ were left by killed ones
        remove_orphans(checkpoint_dir(cfg))
    ckpt_path = resolve_resume(cfg)
    checkpoint = None
    if ckpt_path is not None:  # fail before any work if the checkpoint is unreadable, of another model or layout
        checkpoint = read_checkpoint(ckpt_path, weights=False)
        check_same_model(cfg, checkpoint)
        check_resumable(cfg.trainer, ckpt_path, checkpoint)
        check_resumable_data(cfg, dataset, ckpt_path, checkpoint)
    L.seed_everything(cfg.run.seed, workers=True, verbose=False)
    module = KeelLitModule(cfg, tokenizer_json=dataset.tokenizer_json)
    trainer = build_trainer(cfg, [*build_callbacks(cfg, dataset), *extra_callbacks])
    if owner:
        write_config(cfg, checkpoint)
    trainer.fit(module, datamodule=KeelDataModule(cfg), ckpt_path=ckpt_path)
    interrupt = next(cb for cb in trainer.callbacks if isinstance(cb, GracefulInterrupt))
    if interrupt.stopped_at is not None:
        raise Interrupted(f"interrupted: stopped after step {interrupt.stopped_at} with a checkpoint in "
                          f"{checkpoint_dir(cfg)}; re-run the same command to continue (resume=auto)")
    return trainer


def failure_exit_code(cfg: Config, trainer: L.Trainer) -> int:
    """1 when the stability monitor recorded a failure, said with its step, kind and max tolerable LR -
    unless callbacks.stability.stop_on_failure=false asked training to go on (said when it happened)."""
    monitor = next((cb for cb in trainer.callbacks if isinstance(cb, StabilityMonitor)), None)
    if monitor is None or monitor.failure is None:
        return 0
    if not cfg.callbacks.stability.stop_on_failure and trainer.global_step >= cfg.trainer.max_steps:
        return 0
    if trainer.is_global_zero:
        say(f"{describe(monitor.failure)}. Details: {cfg.run.dir}/stability.json; a lower optim.lr (or "
            "callbacks.stability.* settings) in a new run.dir, or callbacks.stability.stop_on_failure=false to "
            "train on regardless")
    return 1


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
    return failure_exit_code(cfg, train(cfg))
