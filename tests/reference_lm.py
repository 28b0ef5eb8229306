"""An independent reference for two of the project's schemes: a nanoGPT-style decoder written from the formulas
with torch alone (nothing from keel), so the project's Pre-LN and Keel can be held to it (tests/test_reference.py).

- Pre-LN as GPT-2 / nanoGPT train it: x = x + Attn(Norm(x)); x = x + MLP(Norm(x)); a final norm; every matrix and
  the embedding N(0, 0.02^2), the residual output projections (c_proj) N(0, (0.02 / sqrt(2 n_layer))^2).
- Keel from its paper's formula: the first attention and FFN sublayers plain Pre-LN, every later one
  x = Norm_out(L * x + F(Norm_in(x))), L = 2 n_layer sublayers; no final norm (the last sublayer ends in a norm);
  plain N(0, 0.02^2) everywhere (the paper claims Keel needs no special init).

Both use RMSNorm with a gain, rotary position embeddings (rotate-half), a GELU MLP of 4x width and no biases, the
architecture the project trains. `python tests/reference_lm.py --help` trains both implementations side by side.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn


class Norm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.gain


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width, bias=False)  # q, k, v
        self.c_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)  # (B, H, T, hd)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width, bias=False)
        self.c_proj = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Sublayer(nn.Module):
    """Pre-LN: x + F(Norm(x)). Keel (highway): Norm_out(alpha * x + F(Norm_in(x)))."""

    def __init__(self, branch: nn.Module, width: int, alpha: float | None) -> None:
        super().__init__()
        self.branch, self.norm_in, self.alpha = branch, Norm(width), alpha
        self.norm_out = Norm(width) if alpha is not None else None

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        f = self.branch(self.norm_in(x), *args)
        return x + f if self.norm_out is None else self.norm_out(self.alpha * x + f)


class ReferenceLM(nn.Module):
    def __init__(self, scheme: str, vocab: int, depth: int, width: int, heads: int, seq_len: int) -> None:
        super().__init__()
        assert scheme in ("preln", "keel")
        self.wte = nn.Embedding(vocab, width)
        alpha = None if scheme == "preln" else 2.0 * depth  # Keel: alpha = L sublayers, block 0 plain Pre-LN
        self.h = nn.ModuleList()
        for i in range(depth):
            a = None if i == 0 else alpha
            self.h.append(
                nn.ModuleList([Sublayer(SelfAttention(width, heads), width, a), Sublayer(MLP(width), width, a)])
            )
        self.ln_f = Norm(width) if scheme == "preln" else None
        self.lm_head = nn.Linear(width, vocab, bias=False)
        head_dim = width // heads
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq_len).float(), inv_freq)  # (T, hd/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, p in self.named_parameters():  # nanoGPT's _init_weights, and GPT-2's scaled c_proj for Pre-LN
            if p.ndim == 2:
                scaled = scheme == "preln" and name.endswith("c_proj.weight")
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * depth) if scaled else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.wte(idx)  # (B, T, C)
        for attn, mlp in self.h:
            x = mlp(attn(x, cos, sin))
        if self.ln_f is not None:
            x = self.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab)


# ------------------------------------------------------------------------------ training both side by side


def lr_at(step: int, peak: float, warmup: int, steps: int, floor: float = 0.1) -> float:
    """Linear warm-up from 0, then cosine to floor * peak (the project's default schedule, written anew)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(model: nn.Module, batches: torch.Tensor, held_out: torch.Tensor, peak_lr: float, warmup: int) -> float:
    """AdamW (0.9, 0.95), weight decay 0.01 on matrices, global-norm clipping at 1; batches: (steps, B, T + 1).
    Returns the held-out loss (mean over held_out's (N, B, T + 1) batches) after the last step."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    gains = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.01}, {"params": gains, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for step, batch in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, peak_lr, warmup, len(batches))
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    with torch.no_grad():
        return sum(
            F.cross_entropy(model(b[:, :-1]).flatten(0, 1).float(), b[:, 1:].flatten()).item() for b in held_out
        ) / len(held_out)


def windows(tokens: torch.Tensor, count: int, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """count batches of `batch` random windows of seq_len + 1 tokens: (count, batch, seq_len + 1)."""
    starts = torch.randint(len(tokens) - seq_len - 1, (count, batch), generator=generator)
    return tokens[starts[..., None] + torch.arange(seq_len + 1)]


def main() -> None:
    """Train the project's KeelLM and ReferenceLM, each from its own init, on the same batches, and print the
    held-out losses (docs/experiments.md, "An independent reference")."""
    from tokenizers import Tokenizer

    from keel.config import ModelConfig
    from keel.model import KeelLM  # only the side-by-side run needs the project; the reference itself does not

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument(
        "--data", default="data/stdlib", help="a `keel data` directory (tokenizer.json, val_docs.jsonl)"
    )
    parser.add_argument("--corpus", nargs="+", required=True, help="text files to train and hold out on")
    parser.add_argument("--schemes", default="preln,keel")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_file(f"{args.data}/tokenizer.json")
    tokens = torch.tensor([t for path in args.corpus for t in tokenizer.encode(open(path).read()).ids])
    cut = int(0.9 * len(tokens))
    print(
        f"{len(tokens):,} tokens; {args.depth} x {args.width}, seq {args.seq_len}, batch {args.batch}, "
        f"{args.steps} steps, LR {args.lr:g}"
    )
    print("| scheme | seed | keel.model.KeelLM | reference | difference |\n|---|---|---|---|---|")
    for scheme in args.schemes.split(","):
        for seed in map(int, args.seeds.split(",")):
            data = torch.Generator().manual_seed(seed)
            batches = windows(tokens[:cut], args.steps, args.batch, args.seq_len, data)
            held_out = windows(tokens[cut:], 8, args.batch, args.seq_len, data)
            losses = []
            for build in (
                lambda scheme=scheme: KeelLM(
                    ModelConfig(
                        scheme=scheme,
                        depth=args.depth,
                        width=args.width,
                        n_heads=args.heads,
                        seq_len=args.seq_len,
                        vocab_size=tokenizer.get_vocab_size(),
                    )
                ),
                lambda scheme=scheme: ReferenceLM(
                    scheme, tokenizer.get_vocab_size(), args.depth, args.width, args.heads, args.seq_len
                ),
            ):
                torch.manual_seed(seed)
                losses.append(train(build(), batches, held_out, args.lr, args.warmup))
            print(
                f"| {scheme} | {seed} | {losses[0]:.4f} | {losses[1]:.4f} | {losses[0] - losses[1]:+.4f} |", flush=True
            )


if __name__ == "__main__":
    main()
