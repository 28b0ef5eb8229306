"""One typed config drives everything (litgpt style), composed from `conf/` groups (Hydra style).

    keel pretrain [--config FILE] [group=choice ...] [key.path=value ...]

`conf/config.yaml` names the default choice of each group (`model`, `data`, `trainer`, `eval`); a
`group=choice` override picks `conf/<group>/<choice>.yaml` (or a YAML path), merged into that section.
`--config FILE` merges on top of `conf/config.yaml`, then dotlist overrides on top of both. The result is
checked against the dataclasses below: unknown keys (with the closest valid ones), wrong types and bad
values fail at start-up with the key named.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from keel.data.sources import get_source
from keel.errors import ConfigError, require
from keel.model import ModelConfig

GROUPS = ("model", "data", "trainer", "eval")
STRATEGIES = ("auto", "single", "ddp", "fsdp")
ACCELERATORS = ("auto", "cpu", "gpu")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true")
ON_NONFINITE = ("skip", "stop")
LOGGERS = ("tensorboard", "csv", "wandb", "mlflow")
STABILITY_SIGNALS = ("train", "val")
SCHEDULES = ("cosine", "linear_warmup", "exp_warmup")


@dataclass
class TrainerConfig:
    accelerator: str = "auto"  # auto | cpu | gpu
    devices: int = 1  # processes per node
    num_nodes: int = 1
    strategy: str = "auto"  # auto (one device, or DDP over several) | single | ddp | fsdp
    precision: str = "auto"  # auto: bf16-mixed on GPU, 32-true on CPU
    max_steps: int = 400
    micro_batch_size: int = 8  # sequences per device per step
    grad_accum: int = 1
    val_every_n_steps: int = 100
    val_batches: int = 16
    log_every_n_steps: int = 10
    checkpoint_every_n_steps: int = 100
    keep_last_k: int = 2  # step-numbered checkpoints kept besides last.ckpt (the newest k); 0 = last.ckpt only
    compile: bool = False  # torch.compile each block
    activation_checkpointing: bool = False  # recompute each block in backward
    threads: int = 0  # intra-op threads; 0 = one per physical core available to this process
    progress_bar: bool = True  # counts optimizer steps (its ETA holds with grad_accum > 1)
    loggers: list[str] = field(default_factory=lambda: ["tensorboard"])  # any of tensorboard, csv, wandb, mlflow

    def __post_init__(self) -> None:
        require(self.accelerator in ACCELERATORS, "trainer.accelerator", f"allowed: {', '.join(ACCELERATORS)}")
        require(
            self.strategy in STRATEGIES, "trainer.strategy", f"unknown strategy {self.strategy!r}; allowed: {', '.join(STRATEGIES)}"
        )
        require(self.precision in PRECISIONS, "trainer.precision", f"allowed: {', '.join(PRECISIONS)}")
        for key in ("devices", "num_nodes", "max_steps", "micro_batch_size", "grad_accum", "val_every_n_steps",
                    "val_batches", "log_every_n_steps", "checkpoint_every_n_steps"):
            require(getattr(self, key) >= 1, f"trainer.{key}", f"must be >= 1, got {getattr(self, key)}")
        require(self.threads >= 0, "trainer.threads", "must be >= 0 (0 = automatic)")
        require(self.keep_last_k >= 0, "trainer.keep_last_k", "must be >= 0 (0 = keep last.ckpt only)")
        unknown = [name for name in self.loggers if name not in LOGGERS]
        require(not unknown, "trainer.loggers", f"unknown logger(s) {', '.join(unknown)}; allowed: {', '.join(LOGGERS)}")
        require(bool(self.loggers) and len(set(self.loggers)) == len(self.loggers), "trainer.loggers",
                 f"name each logger once, at least one of {', '.join(LOGGERS)}; got {self.loggers}")


@dataclass
class OptimConfig:
    lr: float = 3e-3
    warmup_steps: int = 40
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at trainer.max_steps; exp_warmup starts there
    # cosine | linear_warmup (0 -> lr, then constant) | exp_warmup (lr * min_lr_ratio -> lr geometrically over the
    # warm-up, then constant: equal steps per decade, the max-LR protocol's ramp)
    schedule: str = "cosine"
    weight_decay: float = 0.01  # on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global norm; 0 disables

    def __post_init__(self) -> None:
        require(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        require(self.schedule in SCHEDULES, "optim.schedule", f"allowed: {', '.join(SCHEDULES)}")
        require(self.schedule != "exp_warmup" or self.min_lr_ratio > 0, "optim.min_lr_ratio",
                 "must be > 0 with optim.schedule=exp_warmup (the ramp starts at lr * min_lr_ratio)")
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        require(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)")


@dataclass
class DataConfig:
    source: str = "stdlib"  # a name registered in keel.data.sources.SOURCES
    dir: str = "data/stdlib"  # shard directory (local path or an object-store URL litdata supports)
    paths: list[str] = field(default_factory=list)  # text_files: globs of .txt/.md/.py/.jsonl/.parquet files
    text_field: str = "text"  # jsonl/parquet/hf column holding the text
    hf_dataset: str = "HuggingFaceFW/fineweb-edu"
    hf_name: str | None = "sample-10BT"
    hf_split: str = "train"
    max_chars: int = 0  # stop reading the source after this many characters; 0 = all
    doc_chars: int = 4000  # text_files: cut longer plain-text files (not .py) into documents of ~this size; 0 = never
    tokenizer: str | None = None  # tokenizer.json path or hub name; null = train a byte-level BPE
    vocab_size: int = 4096  # for the trained BPE
    val_fraction: float = 0.02  # held-out documents
    seed: int = 0  # which documents are held out, and the order `keel data` writes them in
    shuffle_documents: bool = True  # write documents in a seeded random order, so each chunk samples the corpus
    shuffle_window: int = 0  # training reads: 0 = a full permutation of each chunk's sequences; N = litdata's
    # windowed shuffle (aligned blocks of N consecutive sequences), only for object stores where locality pays
    verify_checksums: bool = True  # at start-up, local shards against the manifest's sha256 (~6 s per GB, 2 cores)
    cache_dir: str | None = None  # object-store data.dir: local chunk cache; null = litdata's (~/.lightning/chunks)
    prepare_workers: int = 2  # processes for `keel data`
    loader_workers: int = 0  # DataLoader workers while training (0: in the main process; see README)
    chunk_bytes: str = "16MB"

    def __post_init__(self) -> None:
        get_source(self.source)  # raises, naming the registered sources, for an unknown one
        require(0 < self.val_fraction < 1, "data.val_fraction", "must be in (0, 1)")
        require(self.shuffle_window >= 0, "data.shuffle_window",
                 "must be >= 0 (0 = full permutation of each chunk; N = windows of N consecutive sequences)")
        require(self.doc_chars >= 0, "data.doc_chars", "must be >= 0 (0 = one document per plain-text file)")
        require(self.vocab_size >= 260, "data.vocab_size", "must be >= 260 (256 bytes + special tokens)")
        require(self.loader_workers >= 0 and self.prepare_workers >= 1, "data.loader_workers",
                 "loader_workers must be >= 0 and prepare_workers >= 1")
        require(self.source != "text_files" or bool(self.paths), "data.paths",
                 "data.source=text_files needs at least one glob in data.paths")


@dataclass
class RunConfig:
    dir: str = "runs/default"
    seed: int = 1337


@dataclass
class GradNormsConfig:
    """Per-layer gradient norms before clipping (keel.callbacks.grad_norms)."""

    enabled: bool = True
    every_n_steps: int = 10
    heatmap_every_n_steps: int = 100  # depth x step image; 0 = never
    activation_every_n_steps: int = 0  # ||dL/dx_l|| * rms(x_l) via keel.gradflow (one extra fwd+bwd); 0 = off
    max_blocks: int = 32  # blocks with their own scalar tags (evenly spaced); 0 = all. The heatmap shows all

    def __post_init__(self) -> None:
        for key in ("every_n_steps", "heatmap_every_n_steps", "activation_every_n_steps", "max_blocks"):
            require(getattr(self, key) >= 0, f"callbacks.grad_norms.{key}", "must be >= 0")
        require(not self.enabled or self.every_n_steps >= 1, "callbacks.grad_norms.every_n_steps",
                 "must be >= 1 (or set callbacks.grad_norms.enabled=false)")
        require(self.every_n_steps < 1 or self.heatmap_every_n_steps % self.every_n_steps == 0,
                 "callbacks.grad_norms.heatmap_every_n_steps",
                 f"must be a multiple of callbacks.grad_norms.every_n_steps={self.every_n_steps} (0 = never)")


@dataclass
class StabilityConfig:
    """Non-finite steps, irrecoverable loss spikes and stagnation (keel.callbacks.stability)."""

    enabled: bool = True
    on_nonfinite: str = "skip"  # skip: drop that step's update; stop: drop it and end the run (a failure)
    max_nonfinite: int = 5  # under skip: this many consecutive non-finite steps = a failure
    spike_margin: float = 1.0  # smoothed loss above its running minimum by this much (nats) ...
    spike_patience: int = 20  # ... for this many steps = an irrecoverable spike
    stagnation_window: int = 0  # no improvement of the smoothed loss for this many steps = stagnation; 0 = off
    stagnation_min_delta: float = 0.01  # nats that count as an improvement
    stagnation_below: float | None = None  # judge stagnation only once the loss has been <= this; null = always
    stop_on_failure: bool = True  # end the run (final checkpoint, non-zero exit) at the first failure; false: go on
    # what spikes and stagnation judge: train = EMA of the training-batch losses; val = the held-out loss of each
    # validation run (trainer.val_batches fixed batches every trainer.val_every_n_steps; the max-LR protocol's)
    signal: str = "train"

    def __post_init__(self) -> None:
        require(self.signal in STABILITY_SIGNALS, "callbacks.stability.signal", f"allowed: {', '.join(STABILITY_SIGNALS)}")
        require(self.on_nonfinite in ON_NONFINITE, "callbacks.stability.on_nonfinite", f"allowed: {', '.join(ON_NONFINITE)}")
        for key in ("max_nonfinite", "spike_patience"):
            require(getattr(self, key) >= 1, f"callbacks.stability.{key}", "must be >= 1")
        require(self.spike_margin > 0, "callbacks.stability.spike_margin", "must be > 0")
        require(self.stagnation_window >= 0, "callbacks.stability.stagnation_window", "must be >= 0 (0 = off)")
        require(self.stagnation_min_delta >= 0, "callbacks.stability.stagnation_min_delta", "must be >= 0")


@dataclass
class ThroughputConfig:
    """tokens/s, FLOP/s, MFU and data-wait share (keel.callbacks.throughput); logged every trainer.log_every_n_steps."""

    enabled: bool = True
    window: int = 20  # optimizer steps averaged
    peak_flops: float = 0.0  # per device; 0 = look the GPU up (bf16/fp16 runs; CPU: no MFU)

    def __post_init__(self) -> None:
        require(self.window >= 2, "callbacks.throughput.window", "must be >= 2")
        require(self.peak_flops >= 0, "callbacks.throughput.peak_flops", "must be >= 0 (0 = look up)")


@dataclass
class LayerImportanceConfig:
    """Loss increase when each block is skipped, on a fixed validation batch (keel.callbacks.layer_importance)."""

    enabled: bool = True
    every_n_steps: int = 200
    max_blocks: int = 16  # evenly spaced subset for deep models (first and last always included); 0 = all

    def __post_init__(self) -> None:
        require(self.every_n_steps >= 1, "callbacks.layer_importance.every_n_steps", "must be >= 1")
        require(self.max_blocks >= 0, "callbacks.layer_importance.max_blocks", "must be >= 0 (0 = all)")


@dataclass
class CallbacksConfig:
    grad_norms: GradNormsConfig = field(default_factory=GradNormsConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    layer_importance: LayerImportanceConfig = field(default_factory=LayerImportanceConfig)


@dataclass
class EvalConfig:
    """Downstream tasks during training (keel.callbacks.downstream_eval; docs/evaluation.md)."""

    enabled: bool = True
    every_n_steps: int = 100  # a multiple of trainer.val_every_n_steps: tasks run right after validation
    tasks: list[str] = field(default_factory=lambda: ["keel_next_line", "keel_last_token"])  # names, tags or groups
    limit: int | None = 100  # first documents of each task per evaluation; null = all
    num_fewshot: int | None = None  # null: each task's own default
    batch_size: int = 16  # sequences per forward pass
    data_dir: str | None = None  # local standard-suite files (`keel eval-data fetch DIR`); null: the HF hub/cache
    include_path: str | None = None  # a directory of extra lm-eval task YAMLs

    def __post_init__(self) -> None:
        for key in ("every_n_steps", "batch_size"):
            require(getattr(self, key) >= 1, f"eval.{key}", f"must be >= 1, got {getattr(self, key)}")
        require(self.limit is None or self.limit >= 1, "eval.limit", "must be >= 1 or null (all documents)")
        require(self.num_fewshot is None or self.num_fewshot >= 0, "eval.num_fewshot", "must be >= 0 or null")
        require(not self.enabled or bool(self.tasks), "eval.tasks", "name a task, or set eval.enabled=false")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    resume: str | None = None  # null = fresh run; auto = the run dir's last checkpoint if any; or a path
    init_from: str | None = None  # a checkpoint whose model weights start a fresh run (continued pretraining)


def conf_dir() -> Path:
    return Path(str(resources.files("keel.conf")))


def _group_file(group: str, choice: str) -> Path:
    path = Path(choice)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"{group}: no such file {choice}")
        return path
    path = conf_dir() / group / f"{choice}.yaml"
    if not path.exists():
        available = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
        raise ConfigError(f"{group}: unknown choice {choice!r}; available: {', '.join(available)} (or a YAML path)")
    return path


def _valid_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in fields(node):
        value = getattr(node, f.name)
        keys.append(prefix + f.name)
        if is_dataclass(value):
            keys += _valid_keys(value, prefix + f.name + ".")
    return keys


def _explain(err: OmegaConfBaseException) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError):
        close = difflib.get_close_matches(key, _valid_keys(Config()), n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        return ConfigError(f"{key}: unknown config key{hint}")
    if isinstance(err, ValidationError):
        return ConfigError(f"{key}: {str(err).splitlines()[0]}")
    return ConfigError(f"{key}: {str(err).splitlines()[0]}")


def _read_yaml(path: Path) -> DictConfig:
    try:
        return OmegaConf.load(path)
    except Exception as err:  # yaml's own errors carry line numbers
        raise ConfigError(f"{path}: cannot parse YAML: {err}") from err


def _parse_overrides(dotlist: list[str]) -> DictConfig:
    try:
        return OmegaConf.from_dotlist(dotlist)
    except OmegaConfBaseException:
        raise
    except Exception:  # a YAML error in one value: find which, and say so without yaml's traceback
        for item in dotlist:
            try:
                OmegaConf.from_dotlist([item])
            except Exception as err:
                reason = " ".join(str(err).split())
                raise ConfigError(f"override {item!r}: cannot parse its value as YAML ({reason}); quote it or "
                                  "fix the brackets, e.g. data.paths='[a.txt,b.txt]'") from None
        raise


def load_config(config_file: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    base = _read_yaml(conf_dir() / "config.yaml")
    user = _read_yaml(Path(config_file)) if config_file else OmegaConf.create()
    choices = {**base.pop("defaults", {}), **user.pop("defaults", {})}
    dotlist = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. model.depth=32 or trainer=fsdp)")
        if key in GROUPS:
            choices[key] = value
        else:
            dotlist.append(item)
    schema = OmegaConf.structured(Config)
    try:
        merged = schema
        for group, choice in choices.items():
            if group not in GROUPS:
                raise ConfigError(f"defaults.{group}: unknown group; allowed: {', '.join(GROUPS)}")
            merged = OmegaConf.merge(merged, {group: _read_yaml(_group_file(group, str(choice)))})
        merged = OmegaConf.merge(merged, base, user, _parse_overrides(dotlist))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _explain(err) from None


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def from_dict(data: dict) -> Config:
    """A Config from a saved dict (checkpoint hparams), with the same validation as load_config."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), data))
    except OmegaConfBaseException as err:
        raise _explain(err) from None
