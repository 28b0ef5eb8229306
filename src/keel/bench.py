"""`keel bench`: training throughput, peak memory, FLOP/s and MFU of several schemes side by side (docs/bench.md).

    keel bench [--schemes keel,preln] [--compile off,on] [--threads 1,2] [--loss-chunk 0,128] [--members 1,5]
               [--app [--loader-workers 0,1]] [--json FILE]

Each row is a variant, timed in tokens/s:

    step    one scheme's bare training step on a fixed random batch: forward, backward, gradient clipping and the
            AdamW step `keel pretrain` uses (lit.make_optimizer); --peer litgpt adds litgpt's GPT at the same dims;
            with --members K, K models of the scheme trained as one (MembersStep), against its single model
    app     (--app) a short real `keel pretrain` run of the first scheme (train(cfg): loader, logging, callbacks at
            their default cadence), timed from the end of the warm-up steps to the end of the run
    loader  (--app) the training loader (data.token_loader) alone, yielding batches as fast as it can

Every variant runs its warm-up steps first (compile happens there, and its peak memory is taken on one more step);
then the timed repeats are interleaved across variants, in an order rotated each round, so that machine noise
lands on all of them alike. Figures are medians over repeats; each ratio is the median of per-round ratios to a
reference row measured in the same round: a step to Pre-LN's step (same compile, threads and loss head), or, with
several --loss-chunk values, a step with another value to its scheme's step with the first one; an app run to the
bare step of its model, the loader to the fastest step (the training it must keep up with).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from keel.config import OptimConfig, load_config
from keel.devices import (
    MATMUL_REPEATS,
    device_name,
    matmul_size,
    measured_matmul_flops,
    reset_peak_resident,
    resident_bytes,
    synchronize,
)
from keel.errors import ConfigError
from keel.experiments.common import OneLineErrorParser, comma_list
from keel.flops import device_peak_flops, flops_per_token
from keel.lit import adamw, make_optimizer
from keel.memory import check_steps_fit
from keel.model import KeelLM, next_token_loss
from keel.ops.chunked_ce import default_chunk
from keel.parallel import compile_blocks
from keel.peer import PEER_RECIPE, compile_litgpt_blocks, litgpt_model, logits_loss
from keel.schemes import SCHEMES, ModelConfig

REFERENCE_SCHEME = "preln"
LOADER_BATCHES_PER_STEP = 10  # a loader segment reads this many batches per step of a step segment


def peak_flops(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(FLOP/s, where the figure comes from) that MFU is measured against; None: measured in every round (where no
    figure is given or known), because a shared or virtual machine's peak drifts by tens of percent in minutes."""
    if (peak := device_peak_flops(device, dtype, args.peak_flops or 0.0)) is not None:
        return peak, "--peak-flops" if args.peak_flops else f"spec sheet, {device_name(device)}"
    size = matmul_size(device, dtype, max(args.threads))
    return None, (f"measured each round: best of {MATMUL_REPEATS} {size}x{size} {args.dtype} matmuls, "
                  f"{max(args.threads)} threads; median over rounds")


def model_config(args: argparse.Namespace, scheme: str, loss_chunk: int | None = None) -> ModelConfig:
    return ModelConfig(scheme=scheme, depth=args.depth, width=args.width, n_heads=args.heads, seq_len=args.seq_len,
                       vocab_size=args.vocab, loss_chunk=loss_chunk)


class TrainStep:
    """One bare training step of a model on a fixed random batch, as Lightning runs it in `keel pretrain`:
    forward under autocast (bf16) or not (fp32), backward, global-norm clipping, AdamW step."""

    def __init__(self, model: nn.Module, args: argparse.Namespace, device: torch.device,
                 loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = next_token_loss) -> None:
        self.model, self.loss_fn = model.to(device), loss_fn
        self.optim = OptimConfig()
        self.optimizer = make_optimizer(self.model, self.optim)
        self.batch = torch.randint(args.vocab, (args.batch, args.seq_len + 1), device=device)
        self.device, self.bf16 = device, args.dtype == "bf16"

    def __call__(self) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.loss_fn(self.model, self.batch)
        loss.backward()
        if self.optim.grad_clip:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        """Bytes of what the optimizer updates (every parameter here) and of its state."""
        tensors = [p for group in self.optimizer.param_groups for p in group["params"]]
        tensors += [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def peak_memory(self) -> int | None:
        """Parameters + optimizer state + the most one step adds on top (activations, gradients, temporaries):
        CUDA's max allocated; on CPU the peak RSS (VmHWM) over the step, an approximation (allocator caching)."""
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device)
            self()
            synchronize(self.device)
            return self.state_bytes() + torch.cuda.max_memory_allocated(self.device) - start
        start = reset_peak_resident()
        if start is None:
            return None
        self()
        return self.state_bytes() + resident_bytes(peak=True) - start

    def timed(self, steps: int) -> float:
        """Tokens/s over `steps` steps."""
        synchronize(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            self()
        synchronize(self.device)
        return steps * self.batch[..., 1:].numel() / (time.perf_counter() - start)


class MembersStep(TrainStep):
    """TrainStep for `members` models of one shape trained as one: each parameter stacked along a leading member
    axis (torch.func.stack_module_state), the unchanged KeelLM run on each member's slice by torch.func.vmap over
    functional_call, so every op does the work of all members at once; each member has its own init (seed k), its
    own batch and its own global-norm clipping. The optimizer is the same AdamW over the stacked tensors."""

    def __init__(self, build: Callable[[], nn.Module], members: int, args: argparse.Namespace,
                 device: torch.device) -> None:
        from torch.func import functional_call, stack_module_state, vmap

        # CPU attention has no vmap batching rule: torch runs it member by member, as the benchmark measures
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
        models = []
        for seed in range(members):
            torch.manual_seed(seed)
            models.append(build().to(device))
        params, buffers = stack_module_state(models)
        template = models[0].to("meta")

        def loss(member_params, member_buffers, batch):
            return functional_call(template, (member_params, member_buffers), (batch[:, :-1],),
                                   {"targets": batch[:, 1:]})

        self.params, self.buffers, self.loss = params, buffers, vmap(loss)
        self.optim = OptimConfig()
        self.optimizer = adamw(list(params.values()), self.optim, matrix_ndim=3)
        self.batch = torch.randint(args.vocab, (members, args.batch, args.seq_len + 1), device=device)
        self.device, self.bf16 = device, args.dtype == "bf16"

    def __call__(self) -> torch.Tensor:
        """One step of every member; their losses (members,)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            losses = self.loss(self.params, self.buffers, self.batch)  # (members,)
        losses.sum().backward()  # the members share no parameter: each gets its own loss's gradient
        if self.optim.grad_clip:
            grads = [p.grad for p in self.params.values()]
            norms = torch.stack([g.flatten(1).square().sum(1) for g in grads]).sum(0).sqrt()  # (members,)
            scale = (self.optim.grad_clip / (norms + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(scale.view(-1, *[1] * (g.ndim - 1)))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses.detach()


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


def app_config(args: argparse.Namespace, scheme: str, compile: bool, threads: int, workers: int,
               loss_chunk: int | None = None, run_dir: str | None = None):
    """The `keel pretrain` config of an app run: the user's config and overrides, then the bench's model dims,
    device, steps, threads and workers (which must match the step rows); run_dir: a throwaway run directory."""
    return load_config(args.config, [
        *args.overrides,
        f"model.scheme={scheme}", f"model.depth={args.depth}", f"model.width={args.width}",
        f"model.n_heads={args.heads}", f"model.seq_len={args.seq_len}", f"model.vocab_size={args.vocab}",
        f"trainer.micro_batch_size={args.batch}",
        f"trainer.accelerator={'gpu' if args.device == 'cuda' else 'cpu'}",
        f"trainer.precision={'bf16-mixed' if args.dtype == 'bf16' else '32-true'}", "trainer.devices=1",
        f"trainer.compile={compile}", f"trainer.threads={threads}", f"trainer.max_steps={args.warmup + args.steps}",
        f"data.loader_workers={workers}", *([f"model.loss_chunk={loss_chunk}"] if loss_chunk is not None else []),
        *([f"run.dir={run_dir}"] if run_dir else []),
    ])


def app_run(args: argparse.Namespace, scheme: str, compile: bool, threads: int, workers: int,
            loss_chunk: int | None) -> float:
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
    models: list[tuple[str, int | None, Callable[[], nn.Module], Callable[[nn.Module], None], Callable]] = [
        (scheme, chunk, lambda s=scheme, c=chunk: KeelLM(model_config(args, s, c)), compile_blocks, next_token_loss)
        for scheme, chunk in itertools.product(args.schemes, args.loss_chunk)
    ]
    if args.peer == "litgpt":
        models.append(("litgpt", None, lambda: litgpt_model(args), compile_litgpt_blocks, logits_loss))
    for (scheme, chunk, build, compile_fn, loss_fn), compile, threads, members in itertools.product(
        models, args.compile, args.threads, args.members
    ):
        if members > 1 and (compile or scheme == "litgpt"):
            continue  # stacked members run Keel's model eager (refused when asked alone: parse_args)
        torch.manual_seed(0)
        torch.set_num_threads(threads)  # before warm-up: torch.compile specializes (recompiles) per thread count
        if members > 1:
            step = MembersStep(build, members, args, device)
        else:
            model = build()
            if compile:
                compile_fn(model)
            step = TrainStep(model, args, device, loss_fn)
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
    """The row a variant's ratio is taken against (module docstring); None for Pre-LN's own steps."""
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


# -------------------------------------------------------------------------------------------------------- report


def report(args: argparse.Namespace, variants: list[Variant], device: torch.device, peaks: list[float],
           peak_source: str) -> dict:
    """peaks: the peak FLOP/s of each round (one value repeated where it is given); MFU is the median over rounds
    of each round's model FLOP/s over that round's peak."""
    flops = flops_per_token(model_config(args, args.schemes[0]))  # same for every scheme (and the peer): norms excluded
    rows = []
    for variant in variants:
        tps = statistics.median(variant.tokens_per_s)
        mfu = statistics.median(t * flops / p for t, p in zip(variant.tokens_per_s, peaks))
        ref = reference(variant, variants)
        ratios = [a / b for a, b in zip(variant.tokens_per_s, ref.tokens_per_s)] if ref else None
        rows.append({
            "label": variant.label, "kind": variant.kind, "scheme": variant.scheme, "compile": variant.compile,
            "threads": variant.threads, "loader_workers": variant.workers,
            "loss_chunk": loss_chunk(variant, device), "members": variant.members,
            "tokens_per_s": tps, "tokens_per_s_repeats": variant.tokens_per_s,
            "spread": (max(variant.tokens_per_s) - min(variant.tokens_per_s)) / tps,
            "step_s": variant.members * args.batch * args.seq_len / tps,
            "flops_per_token": flops if variant.kind != "loader" else None,
            "flops_per_s": tps * flops if variant.kind != "loader" else None,
            "mfu": mfu if variant.kind != "loader" else None,
            "peak_memory_bytes": variant.peak_memory,
            "reference": ref.label if ref else None,
            "ratio": statistics.median(ratios) if ratios else None, "ratio_repeats": ratios,
        })
    return {
        "device": args.device, "device_name": device_name(device), "dtype": args.dtype,
        "model": {"depth": args.depth, "width": args.width, "heads": args.heads, "seq_len": args.seq_len,
                  "vocab": args.vocab},
        "batch": args.batch, "tokens_per_step": args.batch * args.seq_len,
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "peak_flops": statistics.median(peaks), "peak_flops_repeats": peaks, "peak_flops_source": peak_source,
        "flops_per_token": flops,
        "torch": torch.__version__, "rows": rows,
    }


def loss_chunk(variant: Variant, device: torch.device) -> int | None:
    """Tokens per chunk of the loss head the variant ran (0: plain head); None for the loader and litgpt."""
    if variant.kind == "loader" or variant.scheme == "litgpt":
        return None
    return default_chunk(device) if variant.loss_chunk is None else variant.loss_chunk


def _cell(value: float | None, fmt: str, unit: float = 1.0) -> str:
    return "-" if value is None else format(value / unit, fmt)


def table(result: dict) -> str:
    m = result["model"]
    lines = [
        f"keel bench: {result['device_name']}, {result['dtype']}, {m['depth']} blocks x width {m['width']}, "
        f"{m['heads']} heads, seq {m['seq_len']}, batch {result['batch']}, vocab {m['vocab']}",
        f"model FLOPs/token {result['flops_per_token'] / 1e6:.2f}M; peak {result['peak_flops'] / 1e9:,.1f} GFLOP/s "
        f"({result['peak_flops_source']}); medians of {result['repeats']} interleaved repeats of "
        f"{result['steps']} steps after {result['warmup']} warm-up steps",
        "",
        f"{'variant':<26} {'tokens/s':>10} {'spread':>7} {'ratio':>6}  {'vs':<26} {'ms/step':>8} {'GFLOP/s':>8} "
        f"{'MFU':>6} {'peak MB':>8}",
    ]
    for row in result["rows"]:
        lines.append(
            f"{row['label']:<26} {row['tokens_per_s']:>10,.0f} {row['spread']:>7.0%} {_cell(row['ratio'], '.3f'):>6}  "
            f"{row['reference'] or '-':<26} {row['step_s'] * 1e3:>8.1f} {_cell(row['flops_per_s'], ',.1f', 1e9):>8} "
            f"{_cell(row['mfu'], '.1%'):>6} {_cell(row['peak_memory_bytes'], ',.0f', 2**20):>8}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------- CLI


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def _scheme(text: str) -> str:
    if text not in SCHEMES:
        raise argparse.ArgumentTypeError(f"unknown scheme {text!r}; allowed: {', '.join(SCHEMES)}")
    return text


def _at_least(parser: argparse.ArgumentParser, option: str, values: list[int], least: int, meaning: str = "") -> None:
    if not values or min(values) < least:
        given = ",".join(map(str, values)) or "no value"
        parser.error(f"{option} needs at least one value, each >= {least}{meaning}; got {given}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0))
    parser = OneLineErrorParser(prog="keel bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--schemes", type=comma_list(_scheme), default="keel,preln",
                        help="comma-separated; step ratios are to preln")
    parser.add_argument("--peer", choices=("litgpt",), help="add litgpt's GPT at the same dims (litgpt importable)")
    parser.add_argument("--depth", type=int, default=16, help="blocks")
    parser.add_argument("--width", type=int, default=128, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile happens here); >= 1")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds over all variants")
    parser.add_argument("--threads", type=comma_list(int), default=str(cores), help="intra-op threads, comma-separated")
    parser.add_argument("--compile", type=comma_list(_on_off), default="off", help="off, on or off,on")
    parser.add_argument("--loss-chunk", type=comma_list(int),
                        help="model.loss_chunk values, comma-separated: tokens per chunk of the loss head, 0 = plain "
                             "head (full logits); None: the device's default")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda when available")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast, as bf16-mixed")
    parser.add_argument("--peak-flops", type=float, help="FLOP/s for MFU (default: GPU spec sheet, else measured)")
    parser.add_argument("--members", type=comma_list(int), default="1",
                        help="models trained as one, comma-separated: K > 1 stacks K models of each scheme along a "
                             "member axis (torch.func.vmap; eager, no peer); tokens/s counts every member's tokens")
    parser.add_argument("--app", action="store_true", help="also time short `keel pretrain` runs and the loader")
    parser.add_argument("--loader-workers", type=comma_list(int), default="0",
                        help="data.loader_workers values (--app)")
    parser.add_argument("--config", help="--app: YAML merged over conf/config.yaml, as for keel pretrain")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("overrides", nargs="*", help="--app: key=value / group=choice config overrides (data=...)")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--warmup, --steps and --repeats must be >= 1")
    if not args.schemes or not args.compile:
        parser.error("--schemes and --compile need at least one value")
    _at_least(parser, "--threads", args.threads, 1)
    _at_least(parser, "--members", args.members, 1)
    if max(args.members) > 1 and False not in args.compile:
        parser.error("--members above 1 runs eager: give --compile off (or off,on)")
    if args.loss_chunk is None:
        args.loss_chunk = [None]  # model.loss_chunk: null
    else:
        _at_least(parser, "--loss-chunk", args.loss_chunk, 0, " (0 = plain head)")
    if args.peer == "litgpt" and importlib.util.find_spec("litgpt") is None:
        raise ConfigError(f"--peer litgpt: {PEER_RECIPE}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if device.type == "cpu":  # each step variant keeps its model, gradients and AdamW state through the rounds
        models = [model_config(args, *pair) for pair in itertools.product(args.schemes, args.loss_chunk)]
        check_steps_fit(models * len(args.compile) * len(args.threads) * sum(args.members), args.batch, f"keel bench --depth {args.depth} "
                        f"--width {args.width} --batch {args.batch} x --seq-len {args.seq_len}", "lower them, or bench "
                        "fewer --schemes, --loss-chunk, --compile or --threads values at once")
    peak, peak_source = peak_flops(args, device, dtype)
    variants = build_variants(args, device)
    probe = None
    if peak is None:
        # at the largest thread count: the peak of every core the variants may use
        probe = functools.partial(measured_matmul_flops, device, dtype, max(args.threads))
    peaks = measure(variants, args.repeats, probe) or [peak] * args.repeats
    result = report(args, variants, device, peaks, peak_source)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
