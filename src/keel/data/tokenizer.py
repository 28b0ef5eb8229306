"""Tokenizers: a byte-level BPE trained on the corpus, or a given one (file or hub name), and its EOS id."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from keel.data.sources.text_files import WHITESPACE_START
from keel.errors import ConfigError

EOS_TOKEN = "<|endoftext|>"
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")  # looked up, in this order, in a given tokenizer
# The most characters the tokenizers library is given at once. It holds tens of bytes per character of a text while
# it pre-tokenizes, trains on or encodes it (docs/data.md has the measurement), so longer texts go to it in pieces
# (tokenizer_pieces).
PIECE_CHARS = 100_000
PIECE_SLACK = PIECE_CHARS // 10  # how far before the limit a piece may end to end at whitespace


def tokenizer_pieces(text: str) -> list[str]:
    """`text` in consecutive pieces of at most PIECE_CHARS characters, which join back into it: each ends where the
    last run of whitespace in its final PIECE_SLACK characters begins, or at the limit in a stretch without any. A
    GPT-2-style pre-tokenizer (the trained BPE's) never makes a word across the start of a whitespace run, so those
    pieces encode to exactly the ids of the whole text; a cut at the limit changes at most the word it falls in."""
    pieces, start = [], 0
    while len(text) - start > PIECE_CHARS:
        limit = start + PIECE_CHARS
        spaces = [match.start() for match in WHITESPACE_START.finditer(text, limit - PIECE_SLACK, limit + 1)]
        end = spaces[-1] if spaces else limit
        pieces.append(text[start:end])
        start = end
    return [*pieces, text[start:]]


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenization, lossless decoding) with EOS_TOKEN as id 0, trained on the texts cut
    into tokenizer_pieces (the same words, so the same BPE, in bounded memory)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # its bars draw on a terminal only, but it ends each stage with a newline on stdout wherever that goes
        show_progress=sys.stderr.isatty(),
    )
    tokenizer.train_from_iterator((piece for text in texts for piece in tokenizer_pieces(text)), trainer)
    return tokenizer


def load_tokenizer(name: str) -> tuple[Tokenizer, bytes]:
    """A tokenizer.json path (bytes kept verbatim, so the file's hash identifies it) or a Hugging Face hub name."""
    if os.path.isfile(name):
        raw = Path(name).read_bytes()
        try:
            return Tokenizer.from_str(raw.decode()), raw
        except Exception as err:  # the tokenizers library raises a bare Exception (serde's reason)
            raise ConfigError(
                f"data.tokenizer: {name} is not a tokenizer.json the tokenizers library can read "
                f"({' '.join(str(err).split())}); give a complete tokenizer.json, or null to train a BPE "
                "on the corpus"
            ) from None
    try:
        tokenizer = Tokenizer.from_pretrained(name)
    except Exception as err:
        raise ConfigError(
            f"data.tokenizer: {name!r} is not a file and the Hugging Face hub could not provide it ({err}); "
            "give a tokenizer.json path, or null to train a BPE on the corpus"
        ) from err
    return tokenizer, tokenizer.to_str().encode()


def eos_id_of(tokenizer: Tokenizer) -> int:
    for token in EOS_CANDIDATES:
        if (token_id := tokenizer.token_to_id(token)) is not None:
            return token_id
    raise ConfigError(
        f"data.tokenizer: the tokenizer has none of the end-of-document tokens {', '.join(EOS_CANDIDATES)}"
    )


def same_tokenizer(tokenizer_json: str, other_json: str) -> bool:
    """Whether two tokenizer.json texts encode alike as Keel encodes (never adding special tokens): equal but for
    their post-processors (exports by an older `keel export` add one that puts EOS first)."""
    specs = [json.loads(text) for text in (tokenizer_json, other_json)]
    for spec in specs:
        spec.pop("post_processor", None)
    return specs[0] == specs[1]
