"""One typed config drives everything (litgpt style), composed from `conf/` groups (Hydra style).

    keel pretrain [--config FILE] [group=choice ...] [key.path=value ...]

`conf/config.yaml` names the default choice of each group (`model`, `data`, `trainer`, `eval`, `recipe`); a
`group=choice` override picks `conf/<group>/<choice>.yaml` (or a YAML path), merged into that section (a recipe's
file, which sets optimizer and trainer keys together, into the whole config, after the other groups).
`--config FILE` merges on top of `conf/config.yaml`, then dotlist overrides on top of both. The result is
checked against the dataclasses below (`callbacks.*`: each callback's own, keel.callbacks.configs): unknown
keys (with the closest valid ones), wrong types and bad values fail at start-up with the key named.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from keel.callbacks.configs import CALLBACKS, CallbackConfig, EvalConfig
from keel.data.sources import get_source
from keel.errors import ConfigError, require
from keel.loggers import LOGGERS
from keel.schemes import ModelConfig

GROUPS = ("model", "data", "trainer", "eval", "recipe")
ROOT_GROUPS = ("recipe",)  # groups whose files set keys of several sections (optim.*, trainer.*), not one section
STRATEGIES = ("auto", "single", "ddp", "fsdp")
ACCELERATORS = ("auto", "cpu", "gpu")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true")
SCHEDULES = ("cosine", "linear_warmup", "exp_warmup")


def resolve_accelerator(trainer) -> str:
    """trainer.accelerator with auto resolved: gpu where torch sees a CUDA GPU, else cpu. torch is imported only
    for auto, so a config that names its accelerator is loaded and checked without it."""
    if trainer.accelerator != "auto":
        return trainer.accelerator
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


@dataclass
class TrainerConfig:
    # the defaults are conf/trainer/cpu.yaml's (trainer=cpu, the default group choice)
    accelerator: str = "cpu"  # auto | cpu | gpu
    devices: int = 1  # processes per node
    num_nodes: int = 1
    strategy: str = "auto"  # auto (one device, or DDP over several) | single | ddp | fsdp
    hsdp: bool = False  # under fsdp on several nodes: shard within each node, replicate across nodes (HSDP)
    precision: str = "32-true"  # auto: bf16-mixed on GPU, 32-true on CPU
    max_steps: int = 400
    micro_batch_size: int = 8  # sequences per device per step
    grad_accum: int = 1
    val_every_n_steps: int = 100
    val_batches: int = 16
    log_every_n_steps: int = 10
    checkpoint_every_n_steps: int = 100
    keep_last_k: int = 2  # step-numbered checkpoints kept besides last.ckpt (the newest k); 0 = last.ckpt only
    # write sharded (FSDP) checkpoints in the background: true | false | auto (on under fsdp where the accelerator
    # resolves to a GPU, off on CPU: keel.parallel.resolve_async_checkpoint)
    async_checkpoint: bool | str = "auto"
    # torch.compile each block: true | false | auto (on where the accelerator resolves to a GPU, off on CPU; resolved
    # by Config at load time, so the config, --print-config and the run's config.yaml hold true or false)
    compile: bool | str = True
    # recompute activations in backward: none | all | auto | a fraction of the blocks in (0, 1), the first
    # round(fraction x depth) (keel.parallel.apply_activation_checkpointing says why the first); auto: the fewest
    # blocks with which the memory estimate fits, resolved at start-up (keel.estimate); true / false: all / none
    activation_checkpointing: bool | int | float | str = "none"
    # each GPU's memory in GiB, as torch reports it (an "80 GB" H100: about 79): what `keel estimate` plans with where
    # no GPU is visible, and a cap on the visible GPU's for the start-up check and activation_checkpointing=auto
    gpu_memory_gib: float | None = None
    # the dtype gradients are summed over processes in: fp32 | bf16 (half the bytes, sums rounded to bf16's 8-bit
    # mantissa); FSDP's reduce-scatter, DDP's all-reduce (its bf16 compression hook): docs/distributed.md
    reduce_dtype: str = "fp32"
    # refuse a run whose estimated memory exceeds what this machine (CPU, keel.memory) or each GPU (keel.gpu_memory) has
    check_memory: bool = True
    threads: int = 0  # intra-op threads; 0 = one per physical core available to this process
    progress_bar: bool = True  # counts optimizer steps (its ETA holds with grad_accum > 1)
    loggers: list[str] = field(default_factory=lambda: ["tensorboard"])  # any of tensorboard, csv, wandb, mlflow

    @property
    def world_size(self) -> int:
        """Processes of the run: trainer.devices per node x trainer.num_nodes."""
        return self.devices * self.num_nodes

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, over every process."""
        return self.world_size * self.micro_batch_size * self.grad_accum

    @property
    def shard_size(self) -> int:
        """Processes each parameter is split over: every one under FSDP, a node's under HSDP, else 1."""
        if self.resolved_strategy != "fsdp":
            return 1
        return self.devices if self.hsdp else self.world_size

    def checkpointed_blocks(self, depth: int) -> int:
        """How many blocks (the first ones) recompute their activations in backward; auto is resolved before."""
        if self.activation_checkpointing == "auto":
            raise ConfigError("trainer.activation_checkpointing=auto is chosen from the memory estimate by keel pretrain "
                              "and keel estimate; here give none, all or a fraction of the blocks")
        fraction = {"none": 0.0, "all": 1.0}.get(self.activation_checkpointing, self.activation_checkpointing)
        return min(depth, max(1, round(fraction * depth))) if fraction else 0

    @property
    def resolved_strategy(self) -> str:
        """What runs: single, ddp or fsdp (auto = one device, or DDP over several)."""
        return self.strategy if self.strategy != "auto" else ("ddp" if self.world_size > 1 else "single")

    def __post_init__(self) -> None:
        require(self.accelerator in ACCELERATORS, "trainer.accelerator", f"allowed: {', '.join(ACCELERATORS)}")
        require(
            self.strategy in STRATEGIES, "trainer.strategy", f"unknown strategy {self.strategy!r}; allowed: {', '.join(STRATEGIES)}"
        )
        require(not self.hsdp or (self.strategy == "fsdp" and self.num_nodes > 1), "trainer.hsdp",
                "shards within each node and replicates across nodes: it needs trainer.strategy=fsdp (trainer=fsdp) "
                f"and trainer.num_nodes > 1 (got strategy {self.strategy}, {self.num_nodes} node(s)); on one node "
                "FSDP alone shards over every process")
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
        checkpointing = self.activation_checkpointing
        if isinstance(checkpointing, bool) or checkpointing in (0, 1):  # true/false (the older configs'), 1/0
            self.activation_checkpointing = "all" if checkpointing else "none"
        require(self.activation_checkpointing in ("none", "all", "auto") or (
                isinstance(checkpointing, float) and 0 < checkpointing < 1), "trainer.activation_checkpointing",
                f"allowed: none, all, auto, or a fraction of the blocks in (0, 1) (0.25: the first quarter); got "
                f"{checkpointing!r}")
        require(self.gpu_memory_gib is None or self.gpu_memory_gib > 0, "trainer.gpu_memory_gib",
                f"must be > 0 (GiB per GPU), or null for the visible GPU's; got {self.gpu_memory_gib}")
        require(self.reduce_dtype in ("fp32", "bf16"), "trainer.reduce_dtype", f"allowed: fp32, bf16; got {self.reduce_dtype!r}")
        require(self.reduce_dtype == "fp32" or self.resolved_strategy != "single", "trainer.reduce_dtype",
                "bf16 sums gradients over processes in bf16; a single-process run sums none: use trainer=fsdp or "
                "trainer=ddp, or leave it fp32")
        require(self.compile in (True, False, "auto"), "trainer.compile", f"allowed: true, false, auto; got {self.compile!r}")
        require(self.async_checkpoint in (True, False, "auto"), "trainer.async_checkpoint",
                f"allowed: true, false, auto; got {self.async_checkpoint!r}")
        require(self.async_checkpoint is not True or self.resolved_strategy == "fsdp", "trainer.async_checkpoint",
                "true writes sharded checkpoints in the background: it needs trainer.strategy=fsdp (trainer=fsdp); "
                f"a {self.resolved_strategy} run saves one file, synchronously")


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
        for key in ("beta1", "beta2"):  # torch's AdamW would refuse them only once the model is built
            require(0 <= getattr(self, key) < 1, f"optim.{key}", f"must be in [0, 1), got {getattr(self, key)}")
        require(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")
        require(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)")


def _is_text_codec(name: str) -> bool:
    try:  # (not b"": that is "" whatever the name)
        b"a".decode(name, errors="replace")  # LookupError for unknown names and for codecs of bytes (base64, zlib)
    except (LookupError, UnicodeError):  # UnicodeError: the codec "undefined"
        return False
    return True


@dataclass
class DataConfig:
    source: str = "stdlib"  # a name registered in keel.data.sources.SOURCES
    dir: str = "data/stdlib"  # shard directory (local path or an object-store URL litdata supports)
    paths: list[str] = field(default_factory=list)  # text_files: globs of .txt/.md/.py/.jsonl/.parquet files
    text_field: str = "text"  # jsonl/parquet/hf column holding the text
    encoding: str = "utf-8"  # text_files/stdlib: the codec plain-text and .jsonl files are decoded with
    hf_dataset: str = "HuggingFaceFW/fineweb-edu"
    hf_name: str | None = "sample-10BT"
    hf_split: str = "train"
    max_chars: int = 0  # stop reading the source after this many characters; 0 = all
    # text_files: cut longer plain-text files (not .py), and .jsonl records on lines of 4 MiB or more, into documents
    # of ~this size; 0 = never
    doc_chars: int = 4000
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
        require(_is_text_codec(self.encoding), "data.encoding",
                f"{self.encoding!r} is not a text codec Python knows; use one such as utf-8, latin-1, cp1252, utf-16")
        require(self.vocab_size >= 260, "data.vocab_size", "must be >= 260 (256 bytes + special tokens)")
        require(self.loader_workers >= 0 and self.prepare_workers >= 1, "data.loader_workers",
                 "loader_workers must be >= 0 and prepare_workers >= 1")
        require(self.source != "text_files" or bool(self.paths), "data.paths",
                 "data.source=text_files needs at least one glob in data.paths")


@dataclass
class RunConfig:
    dir: str = "runs/default"
    seed: int = 1337


# callbacks.<name>: each registered callback's own config class (keel.callbacks.configs.CALLBACKS), in that order
CallbacksConfig = make_dataclass("CallbacksConfig", [(c.name, c, field(default_factory=c)) for c in CALLBACKS])
CallbacksConfig.__module__ = __name__  # make_dataclass's `module=` is Python >= 3.12; pickling needs it


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
        if fp16 and self.trainer.strategy == "fsdp":
            raise ConfigError("trainer.precision=16-mixed: fp16 loss scaling does not work on FSDP shards; "
                              "use trainer.precision=bf16-mixed (or 32-true)")
        require(not fp16 or not self.optim.grad_clip, "trainer.precision",
                "16-mixed (fp16 loss scaling) cannot clip gradients with keel's fused AdamW; use bf16-mixed (no loss "
                "scaling, same memory), or optim.grad_clip=0 to train fp16 without clipping")
        # here, once every section has checked its own keys: resolving auto may import torch (seconds), and a
        # callback's check below needs the resolved value
        if self.trainer.compile == "auto":
            self.trainer.compile = resolve_accelerator(self.trainer) == "gpu"
        for section in self.callback_configs():
            section.check(self)

    def callback_configs(self) -> list[CallbackConfig]:
        """The enabled callbacks' configs (callbacks.* and eval), in run order: priority, highest first."""
        sections = [*(getattr(self.callbacks, c.name) for c in CALLBACKS), self.eval]
        return sorted((s for s in sections if s.enabled), key=lambda s: -s.priority)

    @property
    def device_tokens_per_step(self) -> int:
        """Tokens one device trains on per optimizer step (x the world size: the global batch, in tokens)."""
        return self.trainer.micro_batch_size * self.trainer.grad_accum * self.model.seq_len


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
    if not path.is_file():  # else read as a YAML error: "cannot parse YAML: [Errno 2] ..."
        raise ConfigError(f"config: {path} {'is a directory, not' if path.is_dir() else 'does not exist: give'} "
                          "a YAML file")
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml's own errors carry line numbers
        raise ConfigError(f"{path}: cannot parse YAML: {err}") from err
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: its top level is a list; a config file maps keys to settings "
                          "(e.g. a line `optim:`, then `  lr: 0.001`)")
    return loaded


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
            keys = _read_yaml(_group_file(group, str(choice)))
            merged = OmegaConf.merge(merged, keys if group in ROOT_GROUPS else {group: keys})
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
