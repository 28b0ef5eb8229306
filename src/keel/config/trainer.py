"""The trainer's config (`trainer.*`): devices, strategy, precision, steps and batch, checkpoints, loggers."""

from __future__ import annotations

from dataclasses import dataclass, field

from keel.errors import ConfigError, require

STRATEGIES = ("auto", "single", "ddp", "fsdp")
ACCELERATORS = ("auto", "cpu", "gpu")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true")
# trainer.loggers' names; keel.loggers.LOGGERS holds each one's record under the same name (a test holds the two to
# one set of names)
LOGGERS = ("tensorboard", "csv", "wandb", "mlflow")
ATTENTION = ("auto", "cudnn", "flash", "efficient", "math")  # keel.attention.BACKENDS' names, and auto
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")  # trainer.compile_mode: torch.compile's mode=


def resolve_accelerator(trainer) -> str:
    """trainer.accelerator with auto resolved: gpu where torch sees a CUDA GPU, else cpu. torch is imported only
    for auto, so a config that names its accelerator is loaded and checked without it."""
    if trainer.accelerator != "auto":
        return trainer.accelerator
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def resolve_precision(trainer, accelerator: str | None = None) -> str:
    """trainer.precision, with auto resolved for `accelerator` (default: the one the trainer resolves to)."""
    if trainer.precision != "auto":
        return trainer.precision
    return "bf16-mixed" if (accelerator or resolve_accelerator(trainer)) == "gpu" else "32-true"


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
    micro_batch_size: int = 8  # sequences per device per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step; derived from global_batch_size where that is set
    # sequences per optimizer step over every process (litgpt's global_batch_size): grad_accum is derived from it for
    # the world size at start-up (global / (devices x num_nodes x micro_batch_size), refused unless it divides), so a
    # recipe keeps its batch, budget and schedule on any number of GPUs; null: grad_accum as set
    global_batch_size: int | None = None
    val_every_n_steps: int = 100
    val_batches: int = 16
    log_every_n_steps: int = 10
    checkpoint_every_n_steps: int = 100
    keep_last_k: int = 2  # step-numbered checkpoints kept besides last.ckpt (the newest k); 0 = last.ckpt only
    # write sharded (FSDP) checkpoints in the background: true | false | auto (on under fsdp where the accelerator
    # resolves to a GPU, off on CPU: keel.strategy.resolve_async_checkpoint)
    async_checkpoint: bool | str = "auto"
    # the attention kernel SDPA prefers on GPUs: auto (cuDNN first on Hopper, sm90, and later; elsewhere torch's own
    # order) | cudnn | flash | efficient | math (that one first, the others after); the one in use is said at start-up
    attention: str = "auto"
    # torch.compile each block: true | false | auto (on where the accelerator resolves to a GPU, off on CPU; resolved
    # by Config at load time, so the config, --print-config and the run's config.yaml hold true or false)
    compile: bool | str = True
    # torch.compile's mode for the compiled blocks and loss head: default | max-autotune-no-cudagraphs (inductor
    # times candidate kernels for each matmul and fused op as it compiles and keeps the fastest: a longer compile).
    # The CUDA-graph modes (reduce-overhead, max-autotune) are not offered: untested under FSDP's hooks, which free
    # and re-gather the parameters at every step
    compile_mode: str = "default"
    # recompute activations in backward: none | all | auto | a fraction of the blocks in (0, 1), the first
    # round(fraction x depth) (keel.parallel.apply_activation_checkpointing says why the first); auto: the fewest
    # blocks with which the memory estimate fits, resolved at start-up (keel.memory); true / false: all / none
    activation_checkpointing: bool | int | float | str = "none"
    # each GPU's memory in GiB, as torch reports it (an "80 GB" H100: about 79): what `keel estimate` plans with where
    # no GPU is visible, and a cap on the visible GPU's for the start-up check and activation_checkpointing=auto
    gpu_memory_gib: float | None = None
    # the dtype gradients are summed over processes in: fp32 | bf16 (half the bytes, sums rounded to bf16's 8-bit
    # mantissa); FSDP's reduce-scatter, DDP's all-reduce (its bf16 compression hook): docs/distributed.md
    reduce_dtype: str = "fp32"
    # under fsdp with grad_accum > 1: false reduces gradients once per optimizer step, on its last micro-batch (the
    # earlier ones accumulate each unit's unsharded fp32 gradient: + 4 bytes per parameter per GPU); true
    # reduce-scatters every micro-batch (no unsharded gradients kept; HSDP's all-reduce across nodes still once);
    # auto: false where that fits each GPU with no more activation checkpointing than true needs, else true
    # (keel.memory.resolve_gradient_reduction, at start-up; false on CPU)
    reduce_every_micro_batch: bool | str = "auto"
    # refuse a run whose estimated memory exceeds what this machine (CPU) or each GPU has (keel.memory)
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

    def derived_grad_accum(self) -> int:
        """global_batch_size / (processes x micro_batch_size), refused with the arithmetic where it does not divide or
        disagrees with a grad_accum set by hand (1, the default, counts as unset)."""
        per_micro_batch = self.world_size * self.micro_batch_size
        layout = (
            f"{self.devices} device(s) x {self.num_nodes} node(s) x trainer.micro_batch_size "
            f"{self.micro_batch_size} = {per_micro_batch} sequences per micro-batch"
        )
        require(
            self.global_batch_size >= 1,
            "trainer.global_batch_size",
            f"must be >= 1 sequences per optimizer step, or null; got {self.global_batch_size}",
        )
        if self.global_batch_size % per_micro_batch:
            fitting = [
                micro
                for micro in range(1, self.micro_batch_size + 1)
                if self.global_batch_size % (self.world_size * micro) == 0
            ]
            advice = (
                f"trainer.micro_batch_size={fitting[-1]} divides it on this many processes"
                if fitting
                else f"no micro-batch size divides it on {self.world_size} processes: change the device count"
            )
            raise ConfigError(
                f"trainer.global_batch_size={self.global_batch_size}: not a multiple of {layout}; "
                f"{advice}, or set trainer.global_batch_size=null and trainer.grad_accum by hand"
            )
        derived = self.global_batch_size // per_micro_batch
        require(
            self.grad_accum in (1, derived),
            "trainer.grad_accum",
            f"{self.grad_accum} disagrees with trainer.global_batch_size={self.global_batch_size} / ({layout}) = "
            f"{derived}; leave trainer.grad_accum unset (it is derived), or set trainer.global_batch_size=null",
        )
        return derived

    @property
    def shard_size(self) -> int:
        """Processes each parameter is split over: every one under FSDP, a node's under HSDP, else 1."""
        if self.resolved_strategy != "fsdp":
            return 1
        return self.devices if self.hsdp else self.world_size

    def checkpointed_blocks(self, depth: int) -> int:
        """How many blocks (the first ones) recompute their activations in backward; auto is resolved before."""
        if self.activation_checkpointing == "auto":
            raise ConfigError(
                "trainer.activation_checkpointing=auto is chosen from the memory estimate by keel pretrain "
                "and keel estimate; here give none, all or a fraction of the blocks"
            )
        fraction = {"none": 0.0, "all": 1.0}.get(self.activation_checkpointing, self.activation_checkpointing)
        return min(depth, max(1, round(fraction * depth))) if fraction else 0

    @property
    def resolved_strategy(self) -> str:
        """What runs: single, ddp or fsdp (auto = one device, or DDP over several). The one place auto is resolved:
        every check and build reads this, not trainer.strategy."""
        return self.strategy if self.strategy != "auto" else ("ddp" if self.world_size > 1 else "single")

    def __post_init__(self) -> None:
        require(self.accelerator in ACCELERATORS, "trainer.accelerator", f"allowed: {', '.join(ACCELERATORS)}")
        require(
            self.strategy in STRATEGIES,
            "trainer.strategy",
            f"unknown strategy {self.strategy!r}; allowed: {', '.join(STRATEGIES)}",
        )
        require(
            not self.hsdp or (self.resolved_strategy == "fsdp" and self.num_nodes > 1),
            "trainer.hsdp",
            "shards within each node and replicates across nodes: it needs trainer.strategy=fsdp (trainer=fsdp) "
            f"and trainer.num_nodes > 1 (got strategy {self.strategy}, {self.num_nodes} node(s)); on one node "
            "FSDP alone shards over every process",
        )
        require(self.precision in PRECISIONS, "trainer.precision", f"allowed: {', '.join(PRECISIONS)}")
        for key in (
            "devices",
            "num_nodes",
            "max_steps",
            "micro_batch_size",
            "grad_accum",
            "val_every_n_steps",
            "val_batches",
            "log_every_n_steps",
            "checkpoint_every_n_steps",
        ):
            require(getattr(self, key) >= 1, f"trainer.{key}", f"must be >= 1, got {getattr(self, key)}")
        if self.global_batch_size is not None:
            self.grad_accum = self.derived_grad_accum()
        require(self.threads >= 0, "trainer.threads", "must be >= 0 (0 = automatic)")
        require(self.keep_last_k >= 0, "trainer.keep_last_k", "must be >= 0 (0 = keep last.ckpt only)")
        unknown = [name for name in self.loggers if name not in LOGGERS]
        require(
            not unknown, "trainer.loggers", f"unknown logger(s) {', '.join(unknown)}; allowed: {', '.join(LOGGERS)}"
        )
        require(
            bool(self.loggers) and len(set(self.loggers)) == len(self.loggers),
            "trainer.loggers",
            f"name each logger once, at least one of {', '.join(LOGGERS)}; got {self.loggers}",
        )
        checkpointing = self.activation_checkpointing
        if isinstance(checkpointing, bool) or checkpointing in (0, 1):  # true/false (the older configs'), 1/0
            self.activation_checkpointing = "all" if checkpointing else "none"
        require(
            self.activation_checkpointing in ("none", "all", "auto")
            or (isinstance(checkpointing, float) and 0 < checkpointing < 1),
            "trainer.activation_checkpointing",
            f"allowed: none, all, auto, or a fraction of the blocks in (0, 1) (0.25: the first quarter); got "
            f"{checkpointing!r}",
        )
        require(
            self.gpu_memory_gib is None or self.gpu_memory_gib > 0,
            "trainer.gpu_memory_gib",
            f"must be > 0 (GiB per GPU), or null for the visible GPU's; got {self.gpu_memory_gib}",
        )
        require(
            self.reduce_dtype in ("fp32", "bf16"),
            "trainer.reduce_dtype",
            f"allowed: fp32, bf16; got {self.reduce_dtype!r}",
        )
        require(
            self.reduce_dtype == "fp32" or self.resolved_strategy != "single",
            "trainer.reduce_dtype",
            "bf16 sums gradients over processes in bf16; a single-process run sums none: use trainer=fsdp or "
            "trainer=ddp, or leave it fp32",
        )
        require(
            self.reduce_every_micro_batch in (True, False, "auto"),
            "trainer.reduce_every_micro_batch",
            f"allowed: true, false, auto; got {self.reduce_every_micro_batch!r}",
        )
        require(
            self.reduce_every_micro_batch is not True or self.resolved_strategy == "fsdp",
            "trainer.reduce_every_micro_batch",
            "chooses when FSDP reduces accumulated gradients: it needs trainer.strategy=fsdp (DDP reduces once per "
            f"optimizer step, one process never; got {self.resolved_strategy}); leave it auto",
        )
        require(
            self.attention in ATTENTION, "trainer.attention", f"allowed: {', '.join(ATTENTION)}; got {self.attention!r}"
        )
        require(
            self.compile in (True, False, "auto"),
            "trainer.compile",
            f"allowed: true, false, auto; got {self.compile!r}",
        )
        require(
            self.compile_mode in COMPILE_MODES,
            "trainer.compile_mode",
            f"allowed: {', '.join(COMPILE_MODES)}; got {self.compile_mode!r}",
        )
        require(
            self.async_checkpoint in (True, False, "auto"),
            "trainer.async_checkpoint",
            f"allowed: true, false, auto; got {self.async_checkpoint!r}",
        )
        require(
            self.async_checkpoint is not True or self.resolved_strategy == "fsdp",
            "trainer.async_checkpoint",
            "true writes sharded checkpoints in the background: it needs trainer.strategy=fsdp (trainer=fsdp); "
            f"a {self.resolved_strategy} run saves one file, synchronously",
        )
