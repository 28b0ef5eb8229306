"""`keel generate checkpoint=PATH --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]`

Sample text from a checkpoint (a single file or an FSDP sharded directory) with the model's KV cache, printing
the prompt, then each new piece of text as soon as it is decoded. The prompt follows an end-of-document token,
as every document does in the training shards; decoding stops at the next one or after --max-new-tokens.
--temperature 0 is greedy decoding. A prompt longer than model.seq_len - max_new_tokens is cut on the left.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator

import torch
from tokenizers import Tokenizer

from keel.checkpoint.read import load_model
from keel.data.tokenizer import eos_id_of
from keel.decoding import stream
from keel.errors import ConfigError
from keel.model import KeelLM

DEFAULT_NEW_TOKENS = 100


def decoded_pieces(tokenizer: Tokenizer, prompt_ids: list[int], new_ids: Iterator[int]) -> Iterator[str]:
    """The text each new token adds. A token can end inside a multi-byte character (byte-level BPE): its
    text is held back until the character is complete."""
    ids, shown = list(prompt_ids), len(tokenizer.decode(prompt_ids))
    for token in new_ids:
        ids.append(token)
        text = tokenizer.decode(ids)
        if not text.endswith("\ufffd"):
            yield text[shown:]
            shown = len(text)
    text = tokenizer.decode(ids)
    if len(text) > shown:
        yield text[shown:]


def sample(
    model: KeelLM,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
) -> Iterator[str]:
    """The continuation of prompt, piece by piece, until end of document or max_new_tokens."""
    eos = eos_id_of(tokenizer)
    prompt_ids = [eos, *tokenizer.encode(prompt, add_special_tokens=False).ids]
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    tokens = stream(
        model,
        torch.tensor([prompt_ids], device=device),
        max_new_tokens,
        temperature,
        top_k,
        stop_tokens=(eos,),
        generator=generator,
    )
    new_ids = (token for token in (int(nxt[0]) for nxt in tokens) if token != eos)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    with torch.no_grad(), autocast:
        yield from decoded_pieces(tokenizer, prompt_ids, new_ids)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="keel generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="checkpoint=PATH or PATH (e.g. runs/default/checkpoints/last.ckpt)")
    parser.add_argument("--prompt", default="", help="text to continue (default: none, a document from scratch)")
    parser.add_argument(
        "--max-new-tokens", type=int, help=f"default {DEFAULT_NEW_TOKENS}, or model.seq_len - 1 where that is less"
    )
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0 = all")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU intra-op threads (default 1: one token at a time is too small a job to share, and "
        "spinning threads slow down many times over on a busy machine; more for wide models)",
    )
    args = parser.parse_args(argv)
    if args.threads < 1:
        raise ConfigError(f"generate: --threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    if not args.temperature >= 0 or args.top_k < 0:  # `not >=`: argparse's float takes nan, which compares false
        raise ConfigError(
            f"generate: --temperature and --top-k must be >= 0 (0 = greedy / all tokens), got "
            f"--temperature {args.temperature} --top-k {args.top_k}"
        )
    model, cfg, tokenizer_json = load_model(args.checkpoint.removeprefix("checkpoint="), args.device)
    if args.max_new_tokens is None:
        args.max_new_tokens = min(DEFAULT_NEW_TOKENS, cfg.model.seq_len - 1)
    if not 1 <= args.max_new_tokens < cfg.model.seq_len:
        raise ConfigError(
            f"generate: --max-new-tokens must be in [1, {cfg.model.seq_len - 1}] "
            f"(the model's seq_len is {cfg.model.seq_len}), got {args.max_new_tokens}"
        )
    if not tokenizer_json:
        raise ConfigError(f"generate: {args.checkpoint} has no tokenizer (tokenizer_json is empty)")
    tokenizer = Tokenizer.from_str(tokenizer_json)
    print(args.prompt, end="", flush=True)
    start = time.perf_counter()
    for piece in sample(
        model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k or None, args.seed
    ):
        print(piece, end="", flush=True)
    print()
    print(f"keel generate: {time.perf_counter() - start:.2f} s on {args.device}", file=sys.stderr)
    return 0
