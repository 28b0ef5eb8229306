"""Training a run: Lightning's Trainer with keel's strategy, precision, callbacks and loggers around KeelLitModule,
in the run directory (keel.pretrain, `keel pretrain`, imports this only once the config is valid)."""

from __future__ import annotations

import getpass
import json
import os
import tempfile
from contextlib import contextmanager, nullcontext
from importlib import import_module
from pathlib import Path

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.loggers import Logger

from keel.artifacts import LOGGER_RUNS
from keel.attention import attention_context, describe_attention
from keel.callbacks.checkpointing import RunCheckpoint
from keel.callbacks.interrupt import SAID, GracefulInterrupt
from keel.callbacks.progress import StepProgressBar
from keel.callbacks.stability import StabilityMonitor, describe
from keel.checkpoint.layout import LAST, checkpoint_dir
from keel.checkpoint.payload import read_payload
from keel.checkpoint.read import check_state_fits, model_state_dict, read_checkpoint
from keel.checkpoint.resume import check_resume, check_same_model, resolve_resume
from keel.checkpoint.write import AtomicCheckpointIO
from keel.config import Config, resolve_accelerator, resolve_precision, to_dict
from keel.console import quiet_libraries
from keel.data.loading import KeelDataModule, check_splits_fit, open_dataset
from keel.data.tokenizer import same_tokenizer
from keel.devices import set_threads
from keel.errors import ConfigError
from keel.lit import KeelLitModule
from keel.loggers import LOGGERS, kind_of
from keel.memory import (
    check_gpu_fits,
    check_training_fits,
    gpu_budget_bytes,
    resolve_activation_checkpointing,
    resolve_gradient_reduction,
)
from keel.rundir import RunDirLock, claim_run_dir, remove_orphans, say, write_config
from keel.strategy import build_strategy
from keel.summary import run_result, run_summary
from keel.trainer_checks import check_trainer


def tell_litdata_the_nodes(cfg: Config) -> None:
    """litdata deals chunks out node by node; it counts nodes from NNODES, else as the world size // this node's
    GPUs, which is 1 on CPU nodes and wrong wherever a run uses fewer GPUs than a node has. The ranks started
    after this inherit it."""
    os.environ["NNODES"] = str(cfg.trainer.num_nodes)


def node_local_compile_cache(cfg: Config) -> None:
    """On several nodes, Triton's kernel cache on each node's own disk unless TRITON_CACHE_DIR says otherwise: its
    default, ~/.triton, is usually a home directory every node shares, which every rank of every node would write at
    once (inductor's own default, /tmp/torchinductor_<user>, is node-local already). The ranks inherit it."""
    if cfg.trainer.num_nodes > 1 and "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"keel-triton-{getpass.getuser()}")


def check_cpu_processes(cfg: Config) -> None:
    """Before anything is allocated: refuse a CPU run that will not fit in this machine's memory (unless
    trainer.check_memory=false), and say when its processes outnumber the cores."""
    if cfg.trainer.check_memory:
        check_training_fits(cfg)
    cores = len(os.sched_getaffinity(0))
    if cfg.trainer.devices > cores:
        say(
            f"trainer.devices={cfg.trainer.devices} starts that many processes on {cores} core(s): they share the "
            "cores and each step is slower than with trainer.devices <= the cores"
        )


def configured_callbacks(cfg: Config) -> list[Callback]:
    """The enabled configurable callbacks (callbacks.*, eval) in their run order (Config.callback_configs), each
    the class its options name, built by its from_config. A callback's module is imported only here, when a run
    builds it: lm-eval, behind the downstream evaluation, loads slowly."""
    callbacks = []
    for options in cfg.callback_configs():
        module, _, name = options.callback.rpartition(".")
        callbacks.append(getattr(import_module(module), name).from_config(options, cfg))
    return callbacks


def build_callbacks(cfg: Config, dataset) -> list[Callback]:
    """The fixed callbacks (trainer.*), then the enabled configurable ones (callbacks.*, eval) in their run order."""
    callbacks: list[Callback] = [
        RunCheckpoint(
            checkpoint_dir(cfg),
            cfg.trainer.checkpoint_every_n_steps,
            cfg.trainer.keep_last_k,
            cfg.trainer.val_every_n_steps,
        ),
        GracefulInterrupt(),
        LearningRateMonitor(logging_interval="step"),
    ]
    if cfg.trainer.progress_bar:
        callbacks.append(StepProgressBar(cfg.device_tokens_per_step * cfg.trainer.world_size))
    return callbacks + configured_callbacks(cfg)


def build_loggers(cfg: Config) -> list[Logger]:
    """trainer.loggers, each Lightning's own (keel.loggers), writing under run.dir; a resumed run continues the
    runs of those that keep one (ids in <run.dir>/logger_runs.json)."""
    runs_file = Path(cfg.run.dir) / LOGGER_RUNS
    runs = json.loads(runs_file.read_text()) if resolve_resume(cfg) and runs_file.is_file() else {}
    loggers = []
    for name in cfg.trainer.loggers:
        try:
            loggers.append(LOGGERS[name].build(cfg.run.dir, Path(cfg.run.dir).name, runs.get(name)))
        except ModuleNotFoundError:
            raise ConfigError(
                f"trainer.loggers: {name} needs its package: pip install 'keel[{name}]' (or pip install "
                f"{name}), or remove {name} from trainer.loggers"
            ) from None
    return loggers


def log_config(cfg: Config, loggers: list[Logger]) -> None:
    """On rank 0: the config as every logger's hyperparameters, and the run ids that build_loggers continues on
    resume."""
    runs = {}
    for logger in loggers:
        kind = kind_of(logger)
        kind.log_config(logger, to_dict(cfg))
        if (run_id := kind.run_id(logger)) is not None:
            runs[kind.name] = run_id
    if runs:
        (Path(cfg.run.dir) / LOGGER_RUNS).write_text(json.dumps(runs))


def slurm_environment() -> list[SLURMEnvironment]:
    """Under srun, the environment Lightning would pick, without its auto-requeue: its SIGUSR1 handler saves an
    hpc_ckpt that resume=auto never reads, from inside the handler, mid-step; GracefulInterrupt stops, saves and
    requeues instead."""
    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def build_trainer(cfg: Config, callbacks: list[Callback], loggers: list[Logger] | None = None) -> Trainer:
    """loggers: those of the fit a rewind ended (their runs go on), else trainer.loggers built afresh. A trainer config
    this machine cannot run is refused first."""
    t = cfg.trainer
    check_trainer(t)
    return Trainer(
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
        inference_mode=False,  # no_grad instead: FSDP2 + NCCL crash under inference_mode on torch builds before the fix
        log_every_n_steps=t.log_every_n_steps,
        logger=build_loggers(cfg) if loggers is None else loggers,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO(), *slurm_environment()],
        enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        default_root_dir=cfg.run.dir,
    )


class Interrupted(KeyboardInterrupt):
    """Training stopped early on a signal (Ctrl-C, SIGTERM, SIGUSR1), after writing a checkpoint: `keel` exits
    128 + the signal's number with this message (empty on the other ranks: rank 0 says it once)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


@contextmanager
def process_group_of_the_run():
    """Destroys the default process group training made once every rank has ended alike: done, or stopped on an
    agreed signal (Interrupted). Left to interpreter exit, gloo's worker threads abort some ranks ("terminate called
    without an active exception", exit 134: a CPU or multi-node run fails after it saved), and Lightning destroys
    only NCCL's at exit. After an error it is left: destroying it while other ranks wait in a collective can hang
    (torchtitan's choice too). A group made before, by the caller, is the caller's to destroy."""
    made_before = torch.distributed.is_initialized()
    ended_alike = False
    try:
        yield
        ended_alike = True
    except Interrupted:
        ended_alike = True
        raise
    finally:
        if ended_alike and not made_before and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def launched_as_rank_zero() -> bool:
    """Whether the launcher made this process global rank 0 (before Lightning knows): torchrun, SLURM and
    Lightning's own launcher set a non-zero rank, local rank or node rank in every other process."""
    keys = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
    return all(int(os.environ.get(key) or 0) == 0 for key in keys)


def start_from(cfg: Config, module: KeelLitModule, ckpt_path: str | None) -> str:
    """Where training starts, said in a line. init_from loads a checkpoint's model weights (not its optimizer,
    schedule or data position) into a fresh run; once the run has a checkpoint of its own, resuming it wins, and
    init_from is not loaded again over its progress. The source, as an absolute path, is kept in cfg (so in
    config.yaml and every checkpoint)."""
    if ckpt_path is not None:
        return f"resuming {ckpt_path}" + (
            " (init_from is not reloaded over this run's progress)" if cfg.init_from else ""
        )
    if not cfg.init_from:
        return f"fresh initialization (seed {cfg.run.seed})"
    cfg.init_from = str(Path(cfg.init_from).resolve())
    checkpoint = read_checkpoint(cfg.init_from)
    check_same_model(cfg, checkpoint, key="init_from")
    payload = read_payload(checkpoint)
    if not same_tokenizer(payload.tokenizer_json, module.tokenizer_json):
        source_data = payload.run_config().data.dir
        raise ConfigError(
            f"init_from: {cfg.init_from} was trained with another tokenizer than {cfg.data.dir}'s; "
            f"build the new data with that tokenizer (data.tokenizer={source_data}/tokenizer.json)"
        )
    state = model_state_dict(checkpoint)
    check_state_fits(cfg.model, state, f"init_from: {cfg.init_from}")  # an edited export: refused, not RuntimeError
    if not module.model.embed.weight.is_meta:  # else rank 0's loaded weights reach it when the model is sharded
        module.model.load_state_dict(state)
    return f"model weights of {cfg.init_from} (step {checkpoint.get('global_step')}); new optimizer, schedule, data"


def close_loggers(trainer: Trainer) -> None:
    for logger in trainer.loggers:
        kind_of(logger).close(logger)


def train(cfg: Config, extra_callbacks: list[Callback] = ()) -> Trainer | None:
    """Train (or resume) the run cfg describes; extra_callbacks are added to the configured ones. None: the run
    was complete already (its checkpoint has trainer.max_steps steps; said in a line). Rank 0 holds
    the run directory's lock throughout, taken before anything is written (the others write nothing before
    rank 0 has joined them)."""
    quiet_libraries()
    set_threads(cfg)
    tell_litdata_the_nodes(cfg)
    node_local_compile_cache(cfg)
    owner = launched_as_rank_zero()
    accelerator = resolve_accelerator(cfg.trainer)
    for chosen in (resolve_activation_checkpointing(cfg), resolve_gradient_reduction(cfg)):  # in this order
        if chosen and owner:
            say(chosen)
    if owner and accelerator == "cpu":
        check_cpu_processes(cfg)
    # every GPU rank checks its own GPU (one that refused alone would leave the others waiting for it); without
    # CUDA, keel.trainer_checks.check_trainer refuses trainer.accelerator=gpu instead
    if accelerator == "gpu" and cfg.trainer.check_memory and torch.cuda.is_available():
        check_gpu_fits(cfg, gpu_budget_bytes(cfg.trainer))
    with process_group_of_the_run(), RunDirLock(cfg.run.dir) if owner else nullcontext() as lock:
        return _train(cfg, extra_callbacks, lock)


def complete_run(cfg: Config, ckpt_path: str, checkpoint: dict) -> str:
    """The line a rerun of a finished run says instead of training."""
    heldout = read_payload(checkpoint).heldout
    loss = f", val/loss {heldout['loss']:.4f} at step {heldout['step']}" if heldout else ""
    return (
        f"run.dir={cfg.run.dir} is complete (step {checkpoint.get('global_step', 0)} of trainer.max_steps="
        f"{cfg.trainer.max_steps}{loss}; {ckpt_path}): raise trainer.max_steps to train on, or start another run "
        "in a new run.dir"
    )


def _train(cfg: Config, extra_callbacks: list[Callback], lock: RunDirLock | None) -> Trainer | None:
    """lock: the run directory's, held by rank 0 (None on the other ranks)."""
    owner = lock is not None
    dataset = open_dataset(cfg)
    check_splits_fit(cfg, dataset.chunk_tokens)
    if owner:  # no save runs now: temporary files in checkpoints/ were left by killed ones
        remove_orphans(checkpoint_dir(cfg))
        claim_run_dir(cfg)
    ckpt_path = resolve_resume(cfg)
    checkpoint = None
    if ckpt_path is not None:  # fail before any work if the checkpoint is unreadable, of another model or layout
        checkpoint = read_checkpoint(ckpt_path, weights=False)
        check_resume(cfg, dataset, ckpt_path, checkpoint)
        if checkpoint.get("global_step", 0) >= cfg.trainer.max_steps:
            if owner:
                say(complete_run(cfg, ckpt_path, checkpoint))
            return None
    seed_everything(cfg.run.seed, workers=True, verbose=False)
    module = build_module(cfg, dataset, owner)
    start = start_from(cfg, module, ckpt_path)
    trainer = build_trainer(cfg, [*build_callbacks(cfg, dataset), *extra_callbacks])
    if owner:
        write_config(cfg, checkpoint)
    order, attention = None, None
    if resolve_accelerator(cfg.trainer) == "gpu":
        order, attention = describe_attention(
            cfg.trainer.attention, cfg.model, cfg.trainer.micro_batch_size, resolve_precision(cfg.trainer)
        )
    if trainer.is_global_zero:
        print(
            f"{run_summary(cfg, module.model)}\n"
            + (f"attention   {attention}\n" if attention else "")
            + f"start       {start}",
            flush=True,
        )
        log_config(cfg, trainer.loggers)
    if owner:
        lock.started = True  # a failure from here on keeps what the run wrote
    try:
        with attention_context(order):
            trainer.fit(module, datamodule=KeelDataModule(cfg, dataset), ckpt_path=ckpt_path)
            while (monitor := stability_monitor(trainer)) is not None and monitor.rewind is not None:
                module, trainer = rewind_fit(cfg, dataset, trainer, monitor, extra_callbacks, owner)
    finally:
        close_loggers(trainer)
    interrupt = next(cb for cb in trainer.callbacks if isinstance(cb, GracefulInterrupt))
    if interrupt.stopped_at is not None:
        step = trainer.checkpoint_callback.saved_step  # an earlier one if this step's weights were not finite
        saved = (
            f"saved step {step} to {checkpoint_dir(cfg) / LAST}"
            if step is not None
            else f"stopped after step {interrupt.stopped_at} without a finite checkpoint (see above)"
        )
        message = f"{SAID[interrupt.signal]}: {saved}; re-run the same command to continue (resume=auto)"
        raise Interrupted(interrupt.signal, message if trainer.is_global_zero else "")  # rank 0 says it for all
    if trainer.is_global_zero:
        saved_step = trainer.checkpoint_callback.saved_step
        print(run_result(cfg, trainer.global_step, module.heldout, saved_step), flush=True)
    return trainer


def build_module(cfg: Config, dataset, owner: bool) -> KeelLitModule:
    """The LightningModule a fit trains. Under FSDP the other ranks' weights come from rank 0's (keel.parallel.shard):
    they build nothing on the host."""
    return KeelLitModule(
        cfg,
        tokenizer_json=dataset.tokenizer_json,
        empty_init=cfg.trainer.resolved_strategy == "fsdp" and not owner,
        data_manifest_sha256=dataset.manifest_sha256,
    )


def stability_monitor(trainer: Trainer) -> StabilityMonitor | None:
    return next((cb for cb in trainer.callbacks if isinstance(cb, StabilityMonitor)), None)


def rewind_fit(
    cfg: Config, dataset, previous: Trainer, monitor: StabilityMonitor, extra_callbacks: list[Callback], owner: bool
) -> tuple[KeelLitModule, Trainer]:
    """The fit after a rewind (callbacks.stability.rewind): from the checkpoint the monitor went back to, as a
    resume, with its rewinds handed to the new monitor (which has the data skipped), the same loggers, and the same
    signal handling: a signal the ended fit received stops the new one after its first step, with a checkpoint."""
    module = build_module(cfg, dataset, owner)
    callbacks = build_callbacks(cfg, dataset)
    interrupt = next(cb for cb in previous.callbacks if isinstance(cb, GracefulInterrupt))
    interrupt.stopped_at = interrupt.signal = None
    callbacks = [interrupt if isinstance(cb, GracefulInterrupt) else cb for cb in callbacks]
    next(cb for cb in callbacks if isinstance(cb, StabilityMonitor)).carry(monitor.rewinds)
    trainer = build_trainer(cfg, [*callbacks, *extra_callbacks], loggers=previous.loggers)
    trainer.fit(module, datamodule=KeelDataModule(cfg, dataset), ckpt_path=monitor.rewind["checkpoint"])
    return module, trainer


def failure_exit_code(cfg: Config, trainer: Trainer | None) -> int:
    """1 when the stability monitor recorded a failure, said with its step, kind and max tolerable LR -
    unless callbacks.stability.stop_on_failure=false asked training to go on (said when it happened)."""
    if trainer is None:  # complete already
        return 0
    monitor = stability_monitor(trainer)
    if monitor is None or monitor.failure is None:
        return 0
    if not cfg.callbacks.stability.stop_on_failure and trainer.global_step >= cfg.trainer.max_steps:
        return 0
    if trainer.is_global_zero:
        say(
            f"{describe(monitor.failure)}. Details: {cfg.run.dir}/stability.json; a lower optim.lr (or "
            "callbacks.stability.* settings) in a new run.dir, or callbacks.stability.stop_on_failure=false to "
            "train on regardless"
        )
    return 1
