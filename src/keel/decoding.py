"""Decoding from a KeelLM with its KV cache: greedy, or sampled with a temperature and top-k; `keel generate`
and the lm-eval adapter's generate_until use it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from keel.model import KeelLM, KVCache


def generate(model: KeelLM, idx: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
    """idx (B, T) extended by up to max_new_tokens, decoded by `stream` (same options)."""
    new = stream(model, idx, max_new_tokens, **sampling)
    return torch.cat((idx, *(nxt[:, None] for nxt in new)), dim=1)


@torch.no_grad()
def stream(
    model: KeelLM,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_tokens: tuple[int, ...] = (),
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """New tokens for idx (B, T), one step at a time, (B,) each, as they are decoded: up to max_new_tokens.
    temperature 0 = greedy. A row that emits a stop token keeps emitting it; decoding ends when every row has
    stopped. The prompt is cut on the left so that prompt + new tokens fit model.seq_len."""
    keep = model.cfg.seq_len - max_new_tokens
    if keep < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in seq_len={model.cfg.seq_len}")
    out = idx[:, -keep:]
    cache = KVCache(model.cfg.depth) if use_cache else None
    step_input = out
    done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    stops = torch.tensor(stop_tokens, dtype=torch.long, device=idx.device)
    for _ in range(max_new_tokens):
        logits = model(step_input, cache)[:, -1, :].float()  # (B, V)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)
        if len(stop_tokens):
            nxt = torch.where(done, stops[0], nxt)
            done |= torch.isin(nxt, stops)
        yield nxt
        out = torch.cat((out, nxt[:, None]), dim=1)
        step_input = nxt[:, None] if use_cache else out
        if done.all():
            break
