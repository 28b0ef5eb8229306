"""Tokenizers: a byte-level BPE trained on the corpus, or a given one (file or hub name), and its EOS id."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from keel.errors import ConfigError

EOS_TOKEN = "<|endoftext|>"
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")  # looked up, in this order, in a given tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenization, lossless decoding) with EOS_TOKEN as id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load_tokenizer(name: str) -> tuple[Tokenizer, bytes]:
    """A tokenizer.json path (bytes kept verbatim, so the file's hash identifies it) or a Hugging Face hub name."""
    if os.path.isfile(name):
        raw = Path(name).read_bytes()
        try:
            return Tokenizer.from_str(raw.decode()), raw
        except Exception as err:  # the tokenizers library raises a bare Exception (serde's reason)
            raise ConfigError(f"data.tokenizer: {name} is not a tokenizer.json the tokenizers library can read "
                              f"({' '.join(str(err).split())}); give a complete tokenizer.json, or null to train a BPE "
                              "on the corpus") from None
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
