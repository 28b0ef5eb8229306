"""The data tests' corpus of random words, the overrides that build it, and what a build should hold."""

from __future__ import annotations

import json
import random
import shutil
import types
from pathlib import Path

from tokenizers import Tokenizer

from keel.config import Config, load_config
from keel.data.spooling import is_validation

WORDS = (
    "keel highway residual norm layer depth gradient the of and to model train token shard loader "
    "naïve café Δx → 深い 🚀"
).split()


DOCUMENTS = 40
LATIN1_TEXT = "déjà vu, voilà, café crème " * 100  # one document
VAL_FRACTION = 0.2


def write_corpus(folder: Path) -> dict[str, str]:
    """DOCUMENTS plain-text files of random words; {path: text}."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    texts = {}
    for i in range(DOCUMENTS):
        path = folder / f"doc{i:02d}.txt"
        text = "\n".join(" ".join(rng.choices(WORDS, k=15)) for _ in range(20)) + "\n"
        path.write_text(text, encoding="utf-8")
        texts[str(path)] = text
    return texts


def overrides_for(data_dir: Path, *overrides: str, corpus: Path | None = None) -> list[str]:
    corpus_glob = f"{corpus}/*.txt" if corpus else "unused"
    return [
        "data=text_files",
        f"data.text_files.paths=[{corpus_glob}]",
        f"data.dir={data_dir}",
        "data.vocab_size=300",
        f"data.val_fraction={VAL_FRACTION}",
        "data.prepare_workers=2",
        "model.seq_len=32",
        "model.vocab_size=300",
        "trainer.micro_batch_size=4",
        *overrides,
    ]


def config(data_dir: Path, *overrides: str, corpus: Path | None = None) -> Config:
    return load_config(None, overrides_for(data_dir, *overrides, corpus=corpus))


def expected_tokens(data_dir: Path, texts: dict[str, str], val_fraction: float) -> dict[str, int]:
    """Per split: the tokens of its documents {id: text}, encoded one by one, plus one EOS each."""
    tokenizer = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    tokens = {"train": 0, "val": 0}
    for doc_id, text in texts.items():
        tokens["val" if is_validation(doc_id, val_fraction, 0) else "train"] += len(tokenizer.encode(text).ids) + 1
    return tokens


def chunk_tokens(data_dir: Path, split: str) -> int:
    return sum(chunk["dim"] for chunk in json.loads((data_dir / split / "index.json").read_text())["chunks"])


def copy_of(built: types.SimpleNamespace, tmp_path: Path, *overrides: str) -> Config:
    shutil.copytree(built.dir, tmp_path / "shards")
    return config(tmp_path / "shards", *overrides, corpus=built.root / "corpus")
