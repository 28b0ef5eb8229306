"""Resuming a run: which checkpoint `resume` names, every check that it can continue under this config, and what
an elastic resume adjusts in it before Lightning restores it.

keel.training runs `check_resume` before any work: the same model (init_from's weights are checked the same way),
a checkpoint holding the training state in a layout this strategy reads, the same global batch (any split of it
over processes, micro-batch and accumulation: an elastic resume, docs/distributed.md), the same data. Each refusal
is a ConfigError that says what to change.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from keel.checkpoint.layout import LAST, checkpoint_dir, previous_path
from keel.checkpoint.payload import read_payload
from keel.config import Config
from keel.errors import ConfigError

if TYPE_CHECKING:
    from keel.data.loading import DatasetInfo

# model.* keys a resumed run may change: they set how the loss is computed, not what the model is
FREE_ON_RESUME = ("loss_chunk",)


def resolve_resume(cfg: Config) -> str | None:
    """`resume`: null = fresh; auto = the run dir's last checkpoint if there is one (or the one a crash
    mid-commit left aside); else a path (file or sharded directory) that must exist."""
    if cfg.resume in (None, "", "none"):
        return None
    if cfg.resume == "auto":
        last = checkpoint_dir(cfg) / LAST
        for candidate in (last, previous_path(last)):
            if candidate.exists():
                return str(candidate)
        return None
    if not Path(cfg.resume).exists():
        raise ConfigError(f"resume: no checkpoint at {cfg.resume} (use resume=auto, resume=null or an existing path)")
    return cfg.resume


def check_resume(cfg: Config, dataset: DatasetInfo, path: str, checkpoint: dict) -> None:
    """Every check that the checkpoint at `path` (read without its weights) can continue under cfg."""
    check_same_model(cfg, checkpoint)
    check_training_state(cfg.trainer, path, checkpoint)
    check_same_data(cfg, dataset, path, checkpoint)


def check_same_model(cfg: Config, checkpoint: dict, key: str = "resume") -> None:
    """Refuse to resume (or, key="init_from", start from) a checkpoint of another model: name every differing
    model.* key."""
    saved = read_payload(checkpoint, key).run_config().model
    diffs = [
        f"model.{name}: checkpoint {getattr(saved, name)!r} != config {getattr(cfg.model, name)!r}"
        for name in vars(cfg.model)
        if name not in FREE_ON_RESUME and getattr(saved, name) != getattr(cfg.model, name)
    ]
    if diffs:
        raise ConfigError(f"{key}: the checkpoint holds a different model; " + "; ".join(diffs))


def batch_layout(trainer) -> str:
    """Processes x sequences per process per micro-batch x micro-batches per step = the global batch."""
    return (
        f"{trainer.world_size} process(es) x {trainer.micro_batch_size} sequences x {trainer.grad_accum} "
        f"micro-batch(es) = {trainer.global_batch}"
    )


def check_training_state(trainer, path: str | Path, checkpoint: dict) -> None:
    """Nothing resumes from weights alone, only the FSDP strategy reads sharded checkpoints, and only the global
    batch the checkpoint was written with continues its recipe (the learning-rate schedule is in steps). Another
    split of that batch is an elastic resume: the weights and optimizer state are re-sharded on load, and litdata
    re-plans the rest of the epoch's sample stream over the new processes, so no sequence is repeated or skipped."""
    if checkpoint.get("exported"):
        raise ConfigError(
            f"resume: {path} is an exported model (`keel export`: weights only, no optimizer state); "
            f"start a new run from its weights with init_from={path}"
        )
    saved = read_payload(checkpoint).run_config().trainer
    if saved.global_batch != trainer.global_batch:
        raise ConfigError(
            f"resume: {path} was trained with {batch_layout(saved)} sequences per step; this config has "
            f"{batch_layout(trainer)}. A resume keeps the global batch trainer.devices x trainer.num_nodes x "
            f"trainer.micro_batch_size x trainer.grad_accum = {saved.global_batch} (any split of it: e.g. half the "
            "processes and twice trainer.grad_accum); set them so, or start a new run (resume=null, or another run.dir)"
        )
    if Path(path).is_dir() and trainer.resolved_strategy != "fsdp":
        raise ConfigError(
            f"resume: {path} is a sharded (FSDP) checkpoint; resume it with trainer=fsdp, "
            f"or `keel consolidate {path} OUT.ckpt` for evaluation"
        )
    if Path(path).is_file() and "optimizer_states" not in checkpoint:
        raise ConfigError(
            f"resume: {path} holds model weights only (a `keel consolidate` output?); "
            "resume from the checkpoint it was made from"
        )


def check_same_data(cfg: Config, dataset: DatasetInfo, path: str | Path, checkpoint: dict) -> None:
    """A checkpoint's train-loader position is only meaningful on the shards it was saved on and with the same
    read-time shuffle (litdata would otherwise fail mid-start, or continue on other data)."""
    saved_build = read_payload(checkpoint).data_manifest_sha256
    if saved_build is None and "shuffle_documents" in dataset.manifest["settings"]:
        raise ConfigError(
            f"resume: {path} was written on shards built before `keel data` shuffled documents, and the shards at "
            f"{cfg.data.dir} were built since (with data.shuffle_documents): the saved loader position would point "
            "into other data. Start a new run (resume=null, or another run.dir)"
        )
    if saved_build is not None and saved_build != dataset.manifest_sha256:
        raise ConfigError(
            f"resume: the shards at {cfg.data.dir} are not the ones {path} was trained on (its manifest differs: "
            "rebuilt or replaced since): the saved loader position would point into other data. Resume with the "
            "original shards, or start a new run (resume=null, or another run.dir)"
        )
    loops = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    for state in loops.get("combined_loader", []):  # litdata's StreamingDataLoader state, one per loader
        dataset_state = state.get("dataset", {}) if isinstance(state, dict) else {}
        saved_window = dataset_state.get("item_shuffle_window") if dataset_state.get("shuffle") else None
        if saved_window is not None and saved_window != cfg.data.shuffle_window:
            older = " (litdata's default before keel set data.shuffle_window)" if saved_window == 256 else ""
            raise ConfigError(
                f"resume: {path} read its training sequences with data.shuffle_window={saved_window}{older}; this "
                f"config has {cfg.data.shuffle_window}. Resume with data.shuffle_window={saved_window} to continue "
                "that run exactly, or start a new run (resume=null, or another run.dir)"
            )


def rescale_batch_progress(checkpoint: dict, accum: int) -> None:
    """Lightning counts the fit loop's progress in micro-batches, and measures the validation cadence
    (val_check_interval = val_every_n_steps x grad_accum) and the epoch's end in them. An elastic resume at another
    trainer.grad_accum (`accum`) gets, before the loops are restored, the counts this accumulation would have
    reached after the same optimizer steps; otherwise validation would run at other steps than configured."""
    saved_accum = read_payload(checkpoint).run_config().trainer.grad_accum
    if saved_accum == accum:
        return
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for counts in (progress["total"], progress["current"]):
        shift = counts["ready"] // saved_accum * (accum - saved_accum)  # steps x the change in micro-batches per step
        for key in counts:
            counts[key] += shift
