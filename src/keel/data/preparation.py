"""`keel data`: one pass over data.source spooled to local disk and split, a tokenizer, the shards of each split
(written in a seeded document order by litdata's optimize()), val_docs.jsonl, and the manifest, written last.

    keel data [--config FILE] [--force] [key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import numpy as np
from litdata import TokensLoader, optimize
from tokenizers import Tokenizer

from keel.config import Config, DataConfig, load_config
from keel.data.shards import (
    MANIFEST, SPLITS, TOKENIZER, VAL_DOCS, chunk_digests, data_path, require_sequences, sha256, storage,
    tokens_per_chunk,
)
from keel.data.sources import get_source, read_documents
from keel.data.sources.base import MAX_UNDECODABLE, SkippedFiles
from keel.data.tokenizer import eos_id_of, load_tokenizer, train_tokenizer
from keel.errors import ConfigError

# Characters of spooled text per optimize() input: small enough to spread over the workers, large enough for
# each tokenizer call to batch many documents.
SPAN_CHARS = 1_000_000
# data.* keys that shape every build, whatever the source (each source adds its own: Source.settings)
COMMON_SETTINGS = ("source", "max_chars", "val_fraction", "seed", "shuffle_documents", "tokenizer")


def is_validation(doc_id: str, val_fraction: float, seed: int) -> bool:
    """Whether a document is held out: decided by a hash of (seed, id) alone, so it is stable."""
    digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


def build_settings(data: DataConfig) -> dict[str, Any]:
    """The data.* values that determine what `keel data` builds: recorded in the manifest, compared on re-runs."""
    keys = [*COMMON_SETTINGS, *get_source(data.source).settings]
    if data.tokenizer is None:
        keys.append("vocab_size")  # shapes only a tokenizer trained here
    return {key: getattr(data, key) for key in keys}


# ------------------------------------------------------------------------------- spooling: one pass over the source


class _Spool:
    """One split's documents as JSON lines on local disk, and where each one lies, for the shard writers."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.chars = 0
        self._offset = 0
        self._starts, self._lengths, self._doc_chars = array("q"), array("q"), array("q")  # per document

    @property
    def documents(self) -> int:
        return len(self._starts)

    def add(self, out: BinaryIO, doc_id: str, text: str) -> None:
        line = (json.dumps({"id": doc_id, "text": text}) + "\n").encode()
        out.write(line)
        self._starts.append(self._offset)
        self._lengths.append(len(line))
        self._doc_chars.append(len(text))
        self._offset += len(line)
        self.chars += len(text)

    def spans(self, order: np.ndarray) -> list[list[tuple[int, int]]]:
        """The documents in `order`, grouped into spans of about SPAN_CHARS characters (one optimize() input each):
        each span a list of (byte offset, byte length) of its documents' lines."""
        spans: list[list[tuple[int, int]]] = [[]]
        span_chars = 0
        for doc in order.tolist():
            if span_chars >= SPAN_CHARS:
                spans.append([])
                span_chars = 0
            spans[-1].append((self._starts[doc], self._lengths[doc]))
            span_chars += self._doc_chars[doc]
        return spans

    def texts(self) -> Iterator[str]:
        with open(self.path, encoding="utf-8") as lines:
            for line in lines:
                yield json.loads(line)["text"]


def document_order(count: int, data: DataConfig, split: str) -> np.ndarray:
    """The order documents are written to shards: a seeded permutation (data.seed, per split), so every chunk is a
    uniform sample of the corpus; corpus order with data.shuffle_documents=false."""
    if not data.shuffle_documents:
        return np.arange(count)
    return np.random.default_rng([data.seed, SPLITS.index(split)]).permutation(count)


def _spool(data: DataConfig, workdir: str, skipped: SkippedFiles) -> dict[str, _Spool]:
    source = get_source(data.source)
    spools = {split: _Spool(os.path.join(workdir, f"{split}.jsonl")) for split in SPLITS}
    with open(spools["train"].path, "wb") as train, open(spools["val"].path, "wb") as val:
        for doc_id, text in read_documents(data, skipped):
            held_out = is_validation(doc_id, data.val_fraction, data.seed)
            spools["val" if held_out else "train"].add(val if held_out else train, doc_id, text)
    total = sum(spool.documents for spool in spools.values())
    if total == 0:
        binary = f"; {skipped.count} binary or non-UTF-8 file(s) skipped, e.g. {skipped.first}" if skipped.count else ""
        raise ConfigError(f"data.source={data.source}: the corpus is empty: no non-blank text in "
                          f"{source.describe(data)}{binary}")
    for split, spool in spools.items():
        if spool.documents == 0:
            raise ConfigError(
                f"data.val_fraction={data.val_fraction}: the {split} split got none of the {total} document(s) "
                f"({source.describe(data)}); use more text{source.more_documents}, or another data.val_fraction or "
                "data.seed"
            )
    return spools


# ------------------------------------------------------------------------------------------------------ the shards


class _SpanEncoder:
    """The optimize() worker function: one spooled span of documents -> their ids, each document ended by EOS."""

    def __init__(self, tokenizer: Tokenizer, eos_id: int, dtype: np.dtype) -> None:
        self.tokenizer, self.eos_id, self.dtype = tokenizer, eos_id, dtype

    def __call__(self, span: tuple[str, list[tuple[int, int]]]) -> np.ndarray:
        path, documents = span
        texts = []
        with open(path, "rb") as spool:
            for start, length in documents:
                spool.seek(start)
                texts.append(json.loads(spool.read(length))["text"])
        ids: list[int] = []
        for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False):
            ids += encoding.ids
            ids.append(self.eos_id)
        return np.asarray(ids, dtype=self.dtype)


@contextlib.contextmanager
def _worker_environment(workdir: str) -> Iterator[None]:
    # Workers are forked where the platform allows it: spawn re-imports torch in each one (10-20 s on a busy
    # 2-core box). Forked workers cannot use the tokenizers thread pool the BPE training started (tokenizers
    # would say so and fall back), so they encode single-threaded: the workers are the parallelism.
    # optimize() stages chunks bound for an object store in $TMPDIR/chunks, one folder for every process on the
    # machine (two builds delete each other's chunks): each build gets its own under workdir.
    # optimize() sets the start method process-wide; it is put back for DataLoaders started later.
    previous_method = multiprocessing.get_start_method(allow_none=True)
    settings = {"TOKENIZERS_PARALLELISM": "false", "DATA_OPTIMIZER_CACHE_FOLDER": os.path.join(workdir, "chunks"),
                "DATA_OPTIMIZER_DATA_CACHE_FOLDER": os.path.join(workdir, "inputs")}
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        multiprocessing.set_start_method(previous_method, force=True)
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _write_shards(data: DataConfig, spool: _Spool, split: str, encoder: _SpanEncoder, workdir: str) -> None:
    spans = [(spool.path, documents) for documents in spool.spans(document_order(spool.documents, data, split))]
    with _worker_environment(os.path.join(workdir, split)):
        optimize(
            fn=encoder,
            inputs=spans,
            output_dir=data_path(data.dir, split),
            chunk_bytes=data.chunk_bytes,
            num_workers=min(data.prepare_workers, len(spans)),
            item_loader=TokensLoader(),
            mode="overwrite",
            keep_data_ordered=True,  # the same inputs and workers give byte-identical shards
            start_method="fork" if sys.platform == "linux" else "spawn",
        )


def _existing_build(cfg: Config, fs: fsspec.AbstractFileSystem, force: bool) -> dict | None:
    """The manifest of a complete build at data.dir that matches the config; None if one must be built."""
    data = cfg.data
    try:
        manifest = json.loads(fs.cat_file(data_path(data.dir, MANIFEST)))
    except (OSError, ValueError):  # absent or unreadable: nothing complete is there
        return None
    complete = all(fs.exists(data_path(data.dir, name)) for name in (TOKENIZER, "train/index.json", "val/index.json"))
    if force or not complete:
        return None
    settings, built = build_settings(data), manifest.get("settings", {})
    changed = sorted(key for key in set(settings) | set(built) if settings.get(key) != built.get(key))
    changes = [f"data.{key}: {built.get(key)!r} -> {settings.get(key)!r}" for key in changed]
    other_tokenizer = not {"tokenizer", "vocab_size"}.isdisjoint(changed)
    if data.tokenizer and os.path.isfile(data.tokenizer):
        if sha256(Path(data.tokenizer).read_bytes()) != manifest.get("tokenizer_sha256"):
            changes.append(f"the contents of {data.tokenizer}")
            other_tokenizer = True
    if changes:
        built_with = "another tokenizer" if other_tokenizer else "other data settings"
        raise ConfigError(
            f"{data.dir} already holds shards built with {built_with} ({'; '.join(changes)}): "
            "pass --force to rebuild them, or choose another data.dir"
        )
    require_sequences(fs, data.dir, cfg.model.seq_len)
    return manifest


def prepare(cfg: Config, force: bool = False) -> dict:
    """Build the tokenizer, shards, val_docs.jsonl and manifest at cfg.data.dir unless already there; the manifest."""
    data, source = cfg.data, get_source(cfg.data.source)
    fs = storage(data.dir)
    if (manifest := _existing_build(cfg, fs, force)) is not None:
        print(f"keel data: {data.dir} is up to date ({manifest['tokens']['train']:,} train / "
              f"{manifest['tokens']['val']:,} val tokens); nothing to do (--force rebuilds)")
        return manifest

    start = time.perf_counter()
    given = load_tokenizer(data.tokenizer) if data.tokenizer else None  # before reading: fail fast
    fs.makedirs(data_path(data.dir), exist_ok=True)
    if fs.exists(data_path(data.dir, MANIFEST)):
        fs.rm_file(data_path(data.dir, MANIFEST))  # the directory is incomplete until the new manifest is written
    timings = {}
    with tempfile.TemporaryDirectory(prefix="keel-data-") as workdir:
        print(f"keel data: reading {source.describe(data)}")
        skipped = SkippedFiles()
        spools = _spool(data, workdir, skipped)
        timings["read_s"] = time.perf_counter() - start
        if skipped.count:
            print(f"keel data: skipped {skipped.count} binary or non-UTF-8 file(s) (a NUL byte, or more than "
                  f"{MAX_UNDECODABLE:.0%} undecodable bytes), the first: {skipped.first}")

        mark = time.perf_counter()
        if given is None:
            print(f"keel data: training a {data.vocab_size}-token byte-level BPE "
                  f"on {spools['train'].chars:,} characters")
            tokenizer = train_tokenizer(spools["train"].texts(), data.vocab_size)
            tokenizer_bytes = tokenizer.to_str().encode()
        else:
            tokenizer, tokenizer_bytes = given
        eos_id, vocab_size = eos_id_of(tokenizer), tokenizer.get_vocab_size()
        fs.pipe_file(data_path(data.dir, TOKENIZER), tokenizer_bytes)
        timings["tokenizer_s"] = time.perf_counter() - mark

        dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)
        encoder = _SpanEncoder(tokenizer, eos_id, dtype)
        for split in SPLITS:
            mark = time.perf_counter()
            _write_shards(data, spools[split], split, encoder, workdir)
            timings[f"{split}_shards_s"] = time.perf_counter() - mark
        fs.put_file(spools["val"].path, data_path(data.dir, VAL_DOCS))

    require_sequences(fs, data.dir, cfg.model.seq_len)
    timings["total_s"] = time.perf_counter() - start
    manifest = {
        "source": {"kind": data.source, "description": source.describe(data)},
        "settings": build_settings(data),
        "documents": {split: spools[split].documents for split in SPLITS},
        "chars": {split: spools[split].chars for split in SPLITS},
        "tokens": {split: sum(tokens_per_chunk(fs, data.dir, split)) for split in SPLITS},
        "skipped_files": {"binary_or_not_utf8": skipped.count, "first": skipped.first},
        "chunk_sha256": {split: chunk_digests(fs, data.dir, split) for split in SPLITS},
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "eos_token": tokenizer.id_to_token(eos_id),
        "dtype": dtype.name,
        "tokenizer_sha256": sha256(tokenizer_bytes),
        "timings": {key: round(seconds, 2) for key, seconds in timings.items()},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "keel_version": metadata.version("keel"),
    }
    fs.pipe_file(data_path(data.dir, MANIFEST), json.dumps(manifest, indent=2).encode())
    documents, tokens = manifest["documents"], manifest["tokens"]
    print(f"keel data: wrote {data.dir}: {documents['train']:,} train / {documents['val']:,} val documents, "
          f"{tokens['train']:,} / {tokens['val']:,} tokens, vocabulary {vocab_size}; "
          + ", ".join(f"{key[:-2]} {seconds:.1f} s" for key, seconds in timings.items()))
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keel data", description="Build tokenized litdata shards from data.source.")
    parser.add_argument("--config", help="YAML merged over conf/config.yaml (data.* and model.seq_len matter here)")
    parser.add_argument("--force", action="store_true", help="rebuild even if data.dir already holds shards")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="e.g. data=text_files 'data.paths=[docs/*.md]'")
    args = parser.parse_intermixed_args(argv)  # options may follow overrides: `keel data $ARGS --force`
    prepare(load_config(args.config, args.overrides), force=args.force)
    return 0
