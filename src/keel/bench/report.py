"""`keel bench`'s results: the JSON (every row's figures) and the printed table."""

from __future__ import annotations

import argparse
import statistics

import torch

from keel.bench.variants import Variant, model_config, reference
from keel.devices import device_name
from keel.flops import flops_per_token
from keel.ops.chunked_ce import default_chunk


def report(
    args: argparse.Namespace, variants: list[Variant], device: torch.device, peaks: list[float], peak_source: str
) -> dict:
    """peaks: the peak FLOP/s of each round (one value repeated where it is given); MFU is the median over rounds
    of each round's model FLOP/s over that round's peak."""
    flops = flops_per_token(model_config(args, args.schemes[0]))  # same for every scheme (and the peer): norms excluded
    rows = []
    for variant in variants:
        tps = statistics.median(variant.tokens_per_s)
        mfu = statistics.median(t * flops / p for t, p in zip(variant.tokens_per_s, peaks))
        ref = reference(variant, variants)
        ratios = [a / b for a, b in zip(variant.tokens_per_s, ref.tokens_per_s)] if ref else None
        rows.append(
            {
                "label": variant.label,
                "kind": variant.kind,
                "scheme": variant.scheme,
                "compile": variant.compile,
                "threads": variant.threads,
                "loader_workers": variant.workers,
                "loss_chunk": loss_chunk(variant, device),
                "members": variant.members,
                "tokens_per_s": tps,
                "tokens_per_s_repeats": variant.tokens_per_s,
                "spread": (max(variant.tokens_per_s) - min(variant.tokens_per_s)) / tps,
                "step_s": variant.members * args.batch * args.seq_len / tps,
                "flops_per_token": flops if variant.kind != "loader" else None,
                "flops_per_s": tps * flops if variant.kind != "loader" else None,
                "mfu": mfu if variant.kind != "loader" else None,
                "peak_memory_bytes": variant.peak_memory,
                "reference": ref.label if ref else None,
                "ratio": statistics.median(ratios) if ratios else None,
                "ratio_repeats": ratios,
            }
        )
    return {
        "device": args.device,
        "device_name": device_name(device),
        "dtype": args.dtype,
        "model": {
            "depth": args.depth,
            "width": args.width,
            "heads": args.heads,
            "seq_len": args.seq_len,
            "vocab": args.vocab,
        },
        "batch": args.batch,
        "tokens_per_step": args.batch * args.seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "peak_flops": statistics.median(peaks),
        "peak_flops_repeats": peaks,
        "peak_flops_source": peak_source,
        "flops_per_token": flops,
        "torch": torch.__version__,
        "rows": rows,
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
