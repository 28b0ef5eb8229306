"""The whole config (Config): its sections, the checks across them, and `run.*`."""

from __future__ import annotations

from dataclasses import dataclass, field

from keel.callbacks.options import CallbackConfig
from keel.callbacks.options.downstream_eval import EvalConfig
from keel.config.callbacks import CALLBACKS, CallbacksConfig
from keel.config.data import DataConfig
from keel.config.model import ModelConfig
from keel.config.optim import OptimConfig
from keel.config.trainer import TrainerConfig, resolve_accelerator
from keel.errors import ConfigError, require

# data.loader_workers=auto on GPUs: two processes reading ahead are plenty for a batch of a few hundred KB of token
# ids per step (a GPU step takes tenths of a second); each takes a core from the node's intra-op threads
GPU_LOADER_WORKERS = 2


@dataclass
class RunConfig:
    dir: str = "runs/default"
    seed: int = 1337
    overwrite: bool = False  # true: delete the earlier run run.dir holds (checkpoints, logs, config) and start afresh


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    resume: str | None = "auto"  # null = fresh run; auto = the run dir's last checkpoint if any; or a path
    init_from: str | None = None  # a checkpoint whose model weights start a fresh run (continued pretraining)

    def __post_init__(self) -> None:
        # fp16 loss scaling: not on FSDP shards at all; elsewhere it must unscale the gradients before clipping them,
        # which torch does not do for the fused AdamW every run uses (Lightning would raise at the first step)
        fp16 = self.trainer.precision == "16-mixed"
        if fp16 and self.trainer.resolved_strategy == "fsdp":
            raise ConfigError(
                "trainer.precision=16-mixed: fp16 loss scaling does not work on FSDP shards; "
                "use trainer.precision=bf16-mixed (or 32-true)"
            )
        require(
            not fp16 or not self.optim.grad_clip,
            "trainer.precision",
            "16-mixed (fp16 loss scaling) cannot clip gradients with keel's fused AdamW; use bf16-mixed (no loss "
            "scaling, same memory), or optim.grad_clip=0 to train fp16 without clipping",
        )
        # here, once every section has checked its own keys: resolving auto may import torch (seconds), and a
        # callback's check below needs the resolved value
        if self.trainer.compile == "auto":
            self.trainer.compile = resolve_accelerator(self.trainer) == "gpu"
        if self.data.loader_workers == "auto":
            self.data.loader_workers = GPU_LOADER_WORKERS if resolve_accelerator(self.trainer) == "gpu" else 0
        for section in self.callback_configs():
            section.check(self.trainer)

    def callback_configs(self) -> list[CallbackConfig]:
        """The enabled callbacks' configs (callbacks.* and eval), in run order: priority, highest first."""
        sections = [*(getattr(self.callbacks, c.name) for c in CALLBACKS), self.eval]
        return sorted((s for s in sections if s.enabled), key=lambda s: -s.priority)

    @property
    def device_tokens_per_step(self) -> int:
        """Tokens one device trains on per optimizer step (x the world size: the global batch, in tokens)."""
        return self.trainer.micro_batch_size * self.trainer.grad_accum * self.model.seq_len
