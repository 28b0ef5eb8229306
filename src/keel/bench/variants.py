"""What `keel bench` runs and in what order: its variants (a step, an app run, the loader), each warmed up, then
timed in interleaved rounds; the row each variant's ratio is taken against."""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from lightning.pytorch.callbacks import Callback

from keel.bench.step import MembersStep, Step, TrainStep
from keel.config import Config, ModelConfig, TrainerConfig, load_config
from keel.devices import synchronize
from keel.lit import KeelLitModule
from keel.model import KeelLM

REFERENCE_SCHEME = "preln"
LOADER_BATCHES_PER_STEP = 10  # a loader segment reads this many batches per step of a step segment


def model_config(args: argparse.Namespace, scheme: str, loss_chunk: int | None = None) -> ModelConfig:
    return ModelConfig(
        scheme=scheme,
        depth=args.depth,
        width=args.width,
        n_heads=args.heads,
        seq_len=args.seq_len,
        vocab_size=args.vocab,
        loss_chunk=loss_chunk,
    )


@dataclass
class Variant:
    kind: str  # step | app | loader
    scheme: str | None
    compile: bool
    threads: int
    workers: int | None  # data.loader_workers (app, loader)
    loss_chunk: int | None  # --loss-chunk value (model.loss_chunk); None: not given (the device default), or litgpt
    run: Callable[[], float]  # one timed segment -> tokens/s
    peak_memory: int | None = None
    members: int = 1  # models trained as one (MembersStep)
    tokens_per_s: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        parts = [f"{self.kind}:{self.scheme}" if self.scheme else self.kind]
        parts[0] += "+compile" if self.compile else ""
        if self.kind != "loader":
            parts.append(f"t{self.threads}")
        if self.loss_chunk is not None:
            parts.append(f"lc{self.loss_chunk}")
        if self.members > 1:
            parts.append(f"m{self.members}")
        if self.workers is not None:
            parts.append(f"w{self.workers}")
        return " ".join(parts)


def train_step(
    args: argparse.Namespace, scheme: str, loss_chunk: int | None, compile: bool, device: torch.device
) -> TrainStep:
    """The LightningModule of `keel pretrain` at the bench's dims (the default optimizer config), its step on a
    random batch; scheme litgpt: litgpt's GPT in the module's place (--peer litgpt)."""
    precision = "bf16-mixed" if args.dtype == "bf16" else "32-true"
    cfg = Config(
        model=model_config(args, REFERENCE_SCHEME if scheme == "litgpt" else scheme, loss_chunk),
        trainer=TrainerConfig(compile=compile, precision=precision),
    )
    module = KeelLitModule(cfg, empty_init=scheme == "litgpt")
    if scheme == "litgpt":
        from keel.bench.peer import LitgptPeer

        module.model = LitgptPeer(cfg.model)
    return TrainStep(module, torch.randint(args.vocab, (args.batch, args.seq_len + 1), device=device))


class _AppTimer(Callback):
    """Tokens/s of the training loop after `skip` batches: wall time between batch ends, so data loading,
    logging, callbacks and any validation or checkpoint in the window all count."""

    def __init__(self, skip: int) -> None:
        self.skip, self.batches, self.tokens = skip, 0, 0
        self.start = self.end = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        synchronize(pl_module.device)
        self.batches += 1
        if self.batches == self.skip:
            self.start = time.perf_counter()
        elif self.batches > self.skip:
            self.tokens += batch[:, 1:].numel() * trainer.world_size
            self.end = time.perf_counter()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.end - self.start)


def app_config(
    args: argparse.Namespace,
    scheme: str,
    compile: bool,
    threads: int,
    workers: int,
    loss_chunk: int | None = None,
    run_dir: str | None = None,
) -> Config:
    """The `keel pretrain` config of an app run: the user's config and overrides, then the bench's model dims,
    device, steps, threads and workers (which must match the step rows); run_dir: a throwaway run directory."""
    return load_config(
        args.config,
        [
            *args.overrides,
            f"model.scheme={scheme}",
            f"model.depth={args.depth}",
            f"model.width={args.width}",
            f"model.n_heads={args.heads}",
            f"model.seq_len={args.seq_len}",
            f"model.vocab_size={args.vocab}",
            f"trainer.micro_batch_size={args.batch}",
            f"trainer.accelerator={'gpu' if args.device == 'cuda' else 'cpu'}",
            f"trainer.precision={'bf16-mixed' if args.dtype == 'bf16' else '32-true'}",
            "trainer.devices=1",
            f"trainer.compile={compile}",
            f"trainer.threads={threads}",
            f"trainer.max_steps={args.warmup + args.steps}",
            f"data.loader_workers={workers}",
            *([f"model.loss_chunk={loss_chunk}"] if loss_chunk is not None else []),
            *([f"run.dir={run_dir}"] if run_dir else []),
        ],
    )


def app_run(
    args: argparse.Namespace, scheme: str, compile: bool, threads: int, workers: int, loss_chunk: int | None
) -> float:
    from keel.training import train

    timer = _AppTimer(skip=args.warmup)
    with tempfile.TemporaryDirectory(prefix="keel-bench-") as run_dir:
        train(app_config(args, scheme, compile, threads, workers, loss_chunk, run_dir), extra_callbacks=[timer])
    return timer.tokens_per_s


def loader_run(args: argparse.Namespace, workers: int) -> float:
    """Tokens/s of the training loader, from its first batch (worker start-up excluded) over the next ones."""
    from keel.data.loading import token_loader

    cfg = app_config(args, args.schemes[0], False, max(args.threads), workers)
    batches = iter(token_loader(cfg, "train", shuffle=True))
    next(batches)
    start, tokens = time.perf_counter(), 0
    for batch in itertools.islice(batches, LOADER_BATCHES_PER_STEP * args.steps):
        tokens += batch[:, 1:].numel()
    return tokens / (time.perf_counter() - start)


def build_variants(args: argparse.Namespace, device: torch.device) -> list[Variant]:
    """Every variant, warmed up (and compiled), its peak memory taken."""
    variants = []
    models = list(itertools.product(args.schemes, args.loss_chunk))
    if args.peer == "litgpt":
        models.append(("litgpt", None))
    for (scheme, chunk), compile, threads, members in itertools.product(
        models, args.compile, args.threads, args.members
    ):
        if members > 1 and (compile or scheme == "litgpt"):
            continue  # stacked members run Keel's model eager (refused when asked alone: parse_args)
        torch.manual_seed(0)
        torch.set_num_threads(threads)  # before warm-up: torch.compile specializes (recompiles) per thread count
        step: Step
        if members > 1:
            batch = torch.randint(args.vocab, (members, args.batch, args.seq_len + 1), device=device)
            step = MembersStep(lambda s=scheme, c=chunk: KeelLM(model_config(args, s, c)), batch, args.dtype == "bf16")
        else:
            step = train_step(args, scheme, chunk, compile, device)
        for _ in range(args.warmup):
            step()
        timed = functools.partial(step.timed, args.steps)
        variant = Variant("step", scheme, compile, threads, None, chunk, timed, step.peak_memory(), members)
        variants.append(variant)
        print(f"keel bench: warmed up {variant.label}", file=sys.stderr)
    if args.app:
        from keel.data.preparation import prepare

        prepare(app_config(args, args.schemes[0], False, max(args.threads), 0))  # no-op when already built
        for compile, threads, workers, chunk in itertools.product(
            args.compile, args.threads, args.loader_workers, args.loss_chunk
        ):
            run = functools.partial(app_run, args, args.schemes[0], compile, threads, workers, chunk)
            variants.append(Variant("app", args.schemes[0], compile, threads, workers, chunk, run))
        for workers in args.loader_workers:
            run = functools.partial(loader_run, args, workers)
            variants.append(Variant("loader", None, False, max(args.threads), workers, None, run))
    return variants


def reference(variant: Variant, variants: list[Variant]) -> Variant | None:
    """The row a variant's ratio is taken against, measured in the same rounds: a step to Pre-LN's step (same
    compile, threads and loss head), or, with several --loss-chunk values, a step with another value to its scheme's
    step with the first one; stacked members to their scheme's single model; an app run to the bare step of its
    model; the loader to the fastest step (the training it must keep up with). None for Pre-LN's own steps."""
    steps = [v for v in variants if v.kind == "step"]
    if variant.kind == "loader":
        return max(steps, key=lambda v: statistics.median(v.tokens_per_s))
    first_chunk = steps[0].loss_chunk  # the first --loss-chunk value
    if variant.kind == "app":
        scheme, chunk = variant.scheme, variant.loss_chunk
    elif variant.members > 1:  # stacked, against the same scheme's single model
        scheme, chunk = variant.scheme, variant.loss_chunk
    elif variant.scheme == "litgpt":  # its own plain head, against Pre-LN's first loss head
        scheme, chunk = REFERENCE_SCHEME, first_chunk
    elif variant.loss_chunk != first_chunk:  # loss heads side by side
        scheme, chunk = variant.scheme, first_chunk
    else:
        scheme, chunk = REFERENCE_SCHEME, variant.loss_chunk
    key = (scheme, chunk, variant.compile, variant.threads)
    same = [v for v in steps if (v.scheme, v.loss_chunk, v.compile, v.threads) == key and v.members == 1]
    return next((v for v in same if v is not variant), None)


def measure(variants: list[Variant], repeats: int, peak_probe: Callable[[], float] | None) -> list[float]:
    """Interleaved rounds: each runs every variant once, starting one further along than the last round, then
    the peak probe (if any); returns the probe's FLOP/s per round."""
    peaks = []
    for round_ in range(repeats):
        shift = round_ % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            torch.set_num_threads(variant.threads)
            variant.tokens_per_s.append(variant.run())
        if peak_probe:
            peaks.append(peak_probe())
        print(f"keel bench: round {round_ + 1}/{repeats} done", file=sys.stderr)
    return peaks
