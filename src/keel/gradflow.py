"""`keel gradflow`: per-sublayer gradient flow at initialization or in a trained checkpoint, as JSON (and a plot).

    keel gradflow --scheme postln,keel --depth 64 --init unit --detach-branches [--plot flow.png]
    keel gradflow --checkpoint runs/x/checkpoints/last.ckpt [--flatten-gains] [--batch 4] [--plot flow.png]

One loss (random targets on random tokens) is backpropagated through a fresh model per scheme, or the
checkpoint's; forward hooks record, per sublayer input stream x_l, ||dL/dx_l||, the scale-free ||dL/dx_l|| *
rms(x_l), the branch-weight and gain gradient norms, the output rms and the largest channel's share of x_l's
energy, and summarize per block (bottom, middle, top; Keel's alpha = 1 block 0 apart). The fields and ratios:
docs/model.md, "Gradient flow"; what to expect per scheme: docs/schemes.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, replace

import torch

from keel import memory
from keel.config import ModelConfig
from keel.config.model import INITS, KEEL_FIRST_BLOCK, SCHEMES, scheme_of
from keel.errors import ConfigError
from keel.model import KeelLM, RMSNorm

PROFILES = ("rel_act_grad", "weight_grad", "gain_grad", "output_rms", "input_top_share")
MODEL_OPTIONS = {
    "scheme": "keel",
    "depth": 16,
    "width": 64,
    "heads": 4,
    "vocab": 256,
    "init": "normal",
    "alpha": None,
    "keel_first_block": "v1",
}  # defaults of a fresh model; a checkpoint brings its own
PROBE_BLOCKS = 256  # deeper models are timed on this many blocks first, and their progress said


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors if t is not None))


def _rms(x: torch.Tensor) -> float:
    return float(x.double().square().mean().sqrt())


def _top_share(x: torch.Tensor) -> float:
    energy = x.double().square().flatten(0, -2).sum(0)  # (C,)
    return float(energy.max() / energy.sum())


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


class Progress:
    """Lines on stderr through a long measurement (`every` blocks apart; 0: silent): forward and backward, blocks
    done, seconds so far."""

    def __init__(self, blocks: int, every: int = 0) -> None:
        self.blocks, self.every, self.start = blocks, every, time.perf_counter()

    def say(self, what: str) -> None:
        if self.every:
            print(f"keel gradflow: {what}, {time.perf_counter() - self.start:.0f} s", file=sys.stderr, flush=True)

    def block(self, stage: str, done: int) -> None:
        if self.every and done % self.every == 0:
            self.say(f"{stage} {done:,} of {self.blocks:,} blocks")


def measure_model(
    model: KeelLM,
    idx: torch.Tensor,
    targets: torch.Tensor,
    detach_branches: bool = False,
    progress: Progress | None = None,
) -> dict:
    """Gradient flow of one mean cross-entropy loss through `model`: a KeelLM, activation checkpointing
    allowed, not compiled or sharded (hooks). Uses autograd.grad, so parameters' .grad stay untouched."""
    sublayers = model.sublayers()
    inputs: list[torch.Tensor] = [None] * len(sublayers)
    input_grads: list[torch.Tensor] = [None] * len(sublayers)
    outputs: list[torch.Tensor] = [None] * len(sublayers)
    progress = progress or Progress(model.cfg.depth)

    def input_grad(i: int):
        def keep(grad: torch.Tensor) -> None:
            input_grads[i] = grad
            if i % 2 == 0:  # a block's input: the backward has passed through it
                progress.block("backward", model.cfg.depth - i // 2)

        return keep

    def record(i: int):
        def pre_hook(module, args):
            x = args[0]
            inputs[i] = x.detach()
            x.register_hook(input_grad(i))
            if i % 2 == 1:
                progress.block("forward", i // 2 + 1)

        def hook(module, args, out):
            outputs[i] = out.detach()

        return pre_hook, hook

    handles = []
    for i, sub in enumerate(sublayers):
        pre_hook, hook = record(i)
        handles += [sub.register_forward_pre_hook(pre_hook), sub.register_forward_hook(hook)]
        if detach_branches:  # the branch sees a constant: only the skip path carries gradient to x_l
            handles.append(sub.branch.register_forward_pre_hook(lambda m, args: tuple(a.detach() for a in args)))
    try:
        loss = model(idx, targets=targets)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    grad_of = {p: g for p, g in zip(params, grads)}

    rows = []
    for i, sub in enumerate(sublayers):
        gains = [m.weight for m in sub.modules() if isinstance(m, RMSNorm)]
        matrices = [p for p in sub.branch.parameters() if p.ndim >= 2]
        act_grad, input_rms = _norm([input_grads[i]]), _rms(inputs[i])
        rows.append(
            {
                "index": i,
                "block": i // 2,
                "kind": ("attn", "ffn")[i % 2],
                "act_grad": act_grad,
                "input_rms": input_rms,
                "rel_act_grad": act_grad * input_rms,
                "weight_grad": _norm(grad_of.get(p) for p in matrices),
                "gain_grad": _norm(grad_of.get(p) for p in gains),
                "output_rms": _rms(outputs[i]),
                "input_top_share": _top_share(inputs[i]),
            }
        )
    return {"loss": float(loss.detach()), "sublayers": rows, "summary": summarize(model.cfg, rows)}


def bottom_middle_top(cfg: ModelConfig) -> tuple[int, int, int]:
    """The blocks that summary ratios compare; the scheme says which is "bottom" (Keel's alpha = 1 block 0 is not)."""
    return scheme_of(cfg).bottom_block(cfg), cfg.depth // 2, cfg.depth - 1


def summarize(cfg: ModelConfig, rows: list[dict]) -> dict:
    """bottom/top and middle/top ratios per block (see the module docstring for the definitions)."""
    bottom, middle, top = bottom_middle_top(cfg)
    block_input = {key: [rows[2 * b][key] for b in range(cfg.depth)] for key in ("act_grad", "rel_act_grad")}
    block_weight = [math.hypot(rows[2 * b]["weight_grad"], rows[2 * b + 1]["weight_grad"]) for b in range(cfg.depth)]
    summary = {"bottom_block": bottom, "middle_block": middle, "top_block": top}
    for key, values in (*block_input.items(), ("weight_grad", block_weight)):
        summary[f"{key}_bottom_top"] = _ratio(values[bottom], values[top])
        summary[f"{key}_middle_top"] = _ratio(values[middle], values[top])
    summary["weight_grad_block0_top"] = _ratio(block_weight[0], block_weight[top])
    return summary


def measure(
    cfg: ModelConfig,
    detach_branches: bool = False,
    batch: int = 4,
    seed: int = 0,
    model: KeelLM | None = None,
    progress: Progress | None = None,
) -> dict:
    """Measure `model` (default: a fresh one from cfg, seeded) on random tokens and random targets."""
    torch.manual_seed(seed)
    if model is None:
        (progress or Progress(cfg.depth)).say(f"building {cfg.depth:,} blocks")
        model = KeelLM(cfg)
    idx, targets = torch.randint(cfg.vocab_size, (2, batch, cfg.seq_len))
    return measure_model(model, idx, targets, detach_branches, progress)


def announced(cfg: ModelConfig, batch: int, trained: bool) -> Progress:
    """Past PROBE_BLOCKS blocks: the time a whole measurement will take, extrapolated from one of PROBE_BLOCKS blocks
    timed here, said on stderr before it starts, and a Progress that reports every tenth of the blocks."""
    if cfg.depth <= PROBE_BLOCKS:
        return Progress(cfg.depth)
    start = time.perf_counter()
    measure(replace(cfg, depth=PROBE_BLOCKS), batch=batch)
    seconds = (time.perf_counter() - start) * cfg.depth / PROBE_BLOCKS
    if trained:  # its blocks are built already
        seconds /= 2
    print(
        f"keel gradflow: {cfg.scheme}, {cfg.depth:,} blocks: about {seconds / 60:.1f} min (extrapolated from "
        f"{PROBE_BLOCKS} blocks), about {memory.measurement_bytes(cfg, batch) / 2**30:.1f} GiB",
        file=sys.stderr,
        flush=True,
    )
    return Progress(cfg.depth, every=max(1, cfg.depth // 10))


@torch.no_grad()
def flatten_gains(model: KeelLM) -> None:
    """Every norm gain replaced by its mean: the same scale per norm, no channel weighted above another."""
    for module in model.modules():
        if isinstance(module, RMSNorm) and module.weight is not None:
            module.weight.fill_(float(module.weight.mean()))


def check_fits(cfg: ModelConfig, batch: int) -> None:
    memory.check_fits(
        memory.measurement_bytes(cfg, batch),
        f"depth {cfg.depth}, width {cfg.width}, --seq-len {cfg.seq_len}, --batch {batch}",
        memory.parameter_count(cfg),
        "weights and gradients",
        "lower --depth, --width, --seq-len or --batch, or pass --force to try anyway",
    )


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(18, 8), sharex=True)
    axes.flat[-1].axis("off")
    for ax, key in zip(axes.flat, PROFILES):
        for scheme, result in results.items():
            ax.plot([row[key] for row in result["sublayers"]], label=scheme)
        ax.set(title=key, yscale="log", xlabel="sublayer l (0 = block 0 attention)")
    axes.flat[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="keel gradflow", description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("a fresh model (not with --checkpoint, which brings its own)")
    model.add_argument("--scheme", help=f"comma list of: {', '.join(SCHEMES)} (default keel)")
    model.add_argument("--depth", type=int, help="blocks, L = 2 * depth sublayers (default 16)")
    model.add_argument("--width", type=int, help="default 64")
    model.add_argument("--heads", type=int, help="default 4")
    model.add_argument("--vocab", type=int, help="default 256")
    model.add_argument("--init", choices=("auto", *INITS), help="normal (default): N(0, 0.02^2); unit: N(0, 1/fan_in)")
    model.add_argument("--alpha", type=float, help="Keel's alpha (default L = 2 * depth)")
    model.add_argument("--keel-first-block", choices=KEEL_FIRST_BLOCK, help="default v1")
    parser.add_argument(
        "--checkpoint", metavar="CKPT", help="measure this trained model (a keel checkpoint file or directory)"
    )
    parser.add_argument(
        "--flatten-gains", action="store_true", help="with --checkpoint: every norm gain set to its mean first"
    )
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 32; a checkpoint's model.seq_len)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--detach-branches", action="store_true", help="only the skip path carries gradient")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="FILE.png", help="draw the per-sublayer profiles of every scheme")
    parser.add_argument(
        "--force", action="store_true", help="run even where the memory estimate exceeds what is available"
    )
    args = parser.parse_args(argv)
    given = [f"--{name.replace('_', '-')}" for name in MODEL_OPTIONS if getattr(args, name) is not None]
    if args.checkpoint is not None and given:
        parser.error(f"{', '.join(given)}: the checkpoint's model is measured as it is; drop them or --checkpoint")
    if args.flatten_gains and args.checkpoint is None:
        parser.error("--flatten-gains needs --checkpoint (a fresh model's gains are all 1)")
    for name, default in MODEL_OPTIONS.items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    return args


def _trained(args: argparse.Namespace) -> tuple[str, ModelConfig, KeelLM]:
    from keel.checkpoint.read import load_model  # Lightning's import cost only where a checkpoint is read

    model, cfg, _ = load_model(args.checkpoint)
    model.float().train()  # fp32 measurement; train(): the same forward as in training (no dropout exists)
    if args.flatten_gains:
        flatten_gains(model)
    seq_len = args.seq_len or cfg.model.seq_len
    if not 1 <= seq_len <= cfg.model.seq_len:
        raise ConfigError(f"--seq-len {seq_len}: the checkpoint's model takes 1 to {cfg.model.seq_len} tokens")
    model_cfg = replace(cfg.model, seq_len=seq_len)
    return f"{cfg.model.scheme}{' (gains flattened)' if args.flatten_gains else ''}", model_cfg, model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.checkpoint is not None:
        name, cfg, model = _trained(args)
        measured = [(name, cfg, model)]
        title = f"{args.checkpoint}, depth {cfg.depth}"
    else:
        fresh = [
            ModelConfig(
                scheme=scheme.strip(),
                depth=args.depth,
                width=args.width,
                n_heads=args.heads,
                seq_len=args.seq_len or 32,
                vocab_size=args.vocab,
                init=args.init,
                keel_alpha=args.alpha,
                keel_first_block=args.keel_first_block,
            )
            for scheme in args.scheme.split(",")
        ]
        measured = [(cfg.scheme, cfg, None) for cfg in fresh]  # each model built when it is measured
        title = f"depth {args.depth} (L = {2 * args.depth}), {args.init} init"
    results = {}
    for name, cfg, model in measured:
        if not args.force:
            check_fits(cfg, args.batch)
        progress = announced(cfg, args.batch, trained=model is not None)
        results[name] = {
            "config": asdict(cfg),
            **measure(cfg, args.detach_branches, args.batch, args.seed, model, progress),
        }
    print(json.dumps({"options": vars(args), "schemes": results}, indent=1))
    if args.plot:
        mode = "skip path only" if args.detach_branches else "full gradient"
        plot(results, args.plot, f"{title}, {mode}")
    return 0
