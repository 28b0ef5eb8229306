"""`keel bench`'s command line: its options, checked, and the run from warm-up to the printed table."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import os
import sys
from pathlib import Path

import torch

import keel.bench
from keel.bench.report import report, table
from keel.bench.variants import build_variants, measure, model_config
from keel.cli_args import OneLineErrorParser, comma_list
from keel.config.model import SCHEMES
from keel.devices import MATMUL_REPEATS, device_name, matmul_size, measured_matmul_flops
from keel.errors import ConfigError
from keel.flops import device_peak_flops
from keel.memory import check_steps_fit


def peak_flops(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(FLOP/s, where the figure comes from) that MFU is measured against; None: measured in every round (where no
    figure is given or known), because a shared or virtual machine's peak drifts by tens of percent in minutes."""
    if (peak := device_peak_flops(device, dtype, args.peak_flops or 0.0)) is not None:
        return peak, "--peak-flops" if args.peak_flops else f"spec sheet, {device_name(device)}"
    size = matmul_size(device, dtype, max(args.threads))
    return None, (
        f"measured each round: best of {MATMUL_REPEATS} {size}x{size} {args.dtype} matmuls, "
        f"{max(args.threads)} threads; median over rounds"
    )


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
    parser = OneLineErrorParser(
        prog="keel bench",
        description=keel.bench.__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--schemes", type=comma_list(_scheme), default="keel,preln", help="comma-separated; step ratios are to preln"
    )
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
    parser.add_argument(
        "--loss-chunk",
        type=comma_list(int),
        help="model.loss_chunk values, comma-separated: tokens per chunk of the loss head, 0 = plain "
        "head (full logits); None: the device's default",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda when available",
    )
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast, as bf16-mixed")
    parser.add_argument("--peak-flops", type=float, help="FLOP/s for MFU (default: GPU spec sheet, else measured)")
    parser.add_argument(
        "--members",
        type=comma_list(int),
        default="1",
        help="models trained as one, comma-separated: K > 1 stacks K models of each scheme along a "
        "member axis (torch.func.vmap; eager, no peer); tokens/s counts every member's tokens",
    )
    parser.add_argument("--app", action="store_true", help="also time short `keel pretrain` runs and the loader")
    parser.add_argument(
        "--loader-workers", type=comma_list(int), default="0", help="data.loader_workers values (--app)"
    )
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
        from keel.bench.peer import PEER_RECIPE

        raise ConfigError(f"--peer litgpt: {PEER_RECIPE}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if device.type == "cpu":  # each step variant keeps its model, gradients and AdamW state through the rounds
        models = [model_config(args, *pair) for pair in itertools.product(args.schemes, args.loss_chunk)]
        check_steps_fit(
            models * len(args.compile) * len(args.threads) * sum(args.members),
            args.batch,
            f"keel bench --depth {args.depth} --width {args.width} --batch {args.batch} x --seq-len {args.seq_len}",
            "lower them, or bench fewer --schemes, --loss-chunk, --compile or --threads values at once",
        )
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
