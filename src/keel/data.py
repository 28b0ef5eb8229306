"""Corpus -> tokenizer -> tokenized litdata shards, and the loaders that stream them into training.

    keel data [--config FILE] [--force] [key=value ...]

builds, under `data.dir` (a local path or an object-store URL litdata supports):

    tokenizer.json      the tokenizer the shards were encoded with (a BPE trained here, a given file, or a hub one)
    train/, val/        litdata token shards (TokensLoader layout): each document's ids followed by the EOS id
    val_docs.jsonl      the held-out documents' raw text, one {"id": ..., "text": ...} per line
    manifest.json       what was built from what; written last, so its presence marks a complete build

A document is held out for validation by a hash of its id and `data.seed`, so the split depends neither on the
reading order nor on how many documents there are. Documents are written in a seeded random order, so each chunk
is a uniform sample of the corpus, and training permutes each chunk's sequences in full: a batch is a random sample
of the training set, not a stretch of it. Training opens the shards through `open_dataset`, which checks them
against the config (and every chunk against its size and hash), and `KeelDataModule`.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import multiprocessing
import os
import re
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Iterator
from array import array
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import numpy as np
import torch
from litdata import StreamingDataLoader, StreamingDataset, TokensLoader, optimize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from keel.config import Config, DataConfig, load_config
from keel.errors import ConfigError

EOS_TOKEN = "<|endoftext|>"
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")  # looked up, in this order, in a given tokenizer
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
VAL_DOCS = "val_docs.jsonl"
SPLITS = ("train", "val")
MANIFEST_KEYS = ("settings", "documents", "tokens", "vocab_size", "eos_id", "tokenizer_sha256")
# Test suites are 60% of the standard library's .py bytes: repetitive test code and deliberately malformed
# fixtures that would triple the preparation time for little signal. The rest (~12 MB, ~3.4M tokens) is
# still several times what the default run trains on.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
PLAIN_TEXT_SUFFIXES = frozenset({".txt", ".md", ".py", ".rst", ".text", ""})
# Source files stay whole documents whatever data.doc_chars says: a module is code's natural unit (its imports and
# definitions are the context of the rest), a code corpus comes as many files anyway, and text_files then reads
# .py files exactly as the stdlib source does.
WHOLE_FILE_SUFFIXES = frozenset({".py"})
PARAGRAPH_END = re.compile(r"\n(?:[^\S\n]*\n)+")  # a line end followed by blank lines (spaces, \r allowed in them)
# Characters of spooled text per optimize() input: small enough to spread over the workers, large enough for
# each tokenizer call to batch many documents.
SPAN_CHARS = 1_000_000
# A plain-text file with a NUL byte, or with more than this share of its characters undecodable as UTF-8, is
# binary or in another encoding: skipped (counted, first path reported) rather than trained on as U+FFFD soup.
MAX_UNDECODABLE = 0.01
REBUILD = "rebuild with `keel data --force` (same data.* settings)"


# ---------------------------------------------------------------------------------------------- reading the corpus


@dataclass
class SkippedFiles:
    """Files left out of the corpus as binary or not UTF-8."""

    count: int = 0
    first: str | None = None

    def read_text(self, path: Path) -> str | None:
        """The file's text, or None (counted) when it holds a NUL byte or > MAX_UNDECODABLE undecodable bytes."""
        raw = path.read_bytes()
        text = raw.decode("utf-8", errors="replace")
        if b"\0" in raw or text.count("\ufffd") > MAX_UNDECODABLE * len(text):
            self.count += 1
            self.first = self.first or str(path)
            return None
        return text


def _stdlib_documents(skipped: SkippedFiles) -> Iterator[tuple[str, str]]:
    root = sysconfig.get_paths()["stdlib"]
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if name not in STDLIB_EXCLUDED_DIRS)  # prune, in order
        for name in sorted(files):
            if name.endswith(".py") and (text := skipped.read_text(Path(folder, name))) is not None:
                yield Path(folder, name).relative_to(root).as_posix(), text


def _matched_files(patterns: list[str]) -> list[str]:
    files: dict[str, None] = {}  # an ordered set: a file matched by two globs is read once
    unmatched = []
    for pattern in patterns:
        matched = [p for p in sorted(glob.glob(os.path.expanduser(pattern), recursive=True)) if os.path.isfile(p)]
        if not matched:
            unmatched.append(pattern)
        files.update(dict.fromkeys(matched))
    if unmatched:
        raise ConfigError(
            f"data.paths: no files match {', '.join(repr(p) for p in unmatched)} (relative to {os.getcwd()}); "
            "fix or drop the glob"
        )
    return list(files)


def _text_of(record: Any, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        found = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"data.text_field: {where} has no field {text_field!r} (found: {found})")
    return str(record[text_field] or "")


def _jsonl_documents(path: str, text_field: str) -> Iterator[tuple[str, str]]:
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)  # UTF-8 (or -16/-32) bytes; a decoding error is a ValueError too
            except ValueError as err:
                raise ConfigError(f"data.paths: {path} line {number} is not UTF-8 JSON ({err})") from None
            yield f"{path}:{number}", _text_of(record, text_field, f"{path} line {number}")


def _parquet_documents(path: str, text_field: str) -> Iterator[tuple[str, str]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        found = ", ".join(parquet.schema_arrow.names)
        raise ConfigError(f"data.text_field: {path} has no column {text_field!r} (found: {found})")
    row = 0
    for batch in parquet.iter_batches(columns=[text_field]):
        for text in batch.column(0).to_pylist():
            yield f"{path}:{row}", text or ""
            row += 1


def cut_text(text: str, doc_chars: int) -> list[str]:
    """`text` in consecutive pieces of about doc_chars characters (the whole text when it is no longer; 0 = never
    cut), which join back into it. Each cut is at the paragraph end (a line end before blank lines) nearest to
    doc_chars past the previous cut when one lies within a quarter of doc_chars of that, else at the nearest line
    end. A line is never split, so long lines make longer pieces. The cuts depend on the text and doc_chars alone,
    and each only on the text up to a little past it: appending to a text changes none but its last pieces."""
    pieces, start = [], 0
    while doc_chars and len(text) - start > doc_chars:
        target, slack = start + doc_chars, doc_chars // 4
        paragraph_ends = [match.end() for match in PARAGRAPH_END.finditer(text, target - slack, target + slack)]
        if paragraph_ends:
            cut = min(paragraph_ends, key=lambda end: abs(end - target))
        else:
            before, after = text.rfind("\n", start, target) + 1, text.find("\n", target) + 1
            cut = min((end for end in (before, after) if end > start), key=lambda end: abs(end - target), default=0)
        if not start < cut < len(text):
            break  # no line end left: the rest is one piece
        pieces.append(text[start:cut])
        start = cut
    return [*pieces, text[start:]]


def _plain_text_documents(path: str, doc_chars: int, skipped: SkippedFiles) -> Iterator[tuple[str, str]]:
    if (text := skipped.read_text(Path(path))) is None:
        return
    pieces = cut_text(text, 0 if Path(path).suffix.lower() in WHOLE_FILE_SUFFIXES else doc_chars)
    if len(pieces) == 1:  # an uncut file keeps its path as id: its split does not depend on data.doc_chars
        yield path, text
    else:
        yield from ((f"{path}#{number}", piece) for number, piece in enumerate(pieces))


def _text_file_documents(data: DataConfig, skipped: SkippedFiles) -> Iterator[tuple[str, str]]:
    for path in _matched_files(data.paths):
        suffix = Path(path).suffix.lower()
        if suffix == ".jsonl":
            yield from _jsonl_documents(path, data.text_field)
        elif suffix == ".parquet":
            yield from _parquet_documents(path, data.text_field)
        elif suffix in PLAIN_TEXT_SUFFIXES:
            yield from _plain_text_documents(path, data.doc_chars, skipped)
        else:
            plain = ", ".join(sorted(s for s in PLAIN_TEXT_SUFFIXES if s))
            raise ConfigError(f"data.paths: {path}: unsupported file type {suffix!r}; use .jsonl, .parquet or {plain}")


def _hf_documents(data: DataConfig) -> Iterator[tuple[str, str]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.source=hf needs the `datasets` package: pip install -e '.[hf]'") from None
    try:
        stream = datasets.load_dataset(data.hf_dataset, name=data.hf_name, split=data.hf_split, streaming=True)
    except Exception as err:  # hub unreachable, unknown dataset / config / split: all end up here
        raise ConfigError(
            f"data.hf_dataset: cannot stream {data.hf_dataset!r} (data.hf_name={data.hf_name!r}, "
            f"data.hf_split={data.hf_split!r}) from the Hugging Face hub: {err}. Check the names and the network, "
            "or use data.source=text_files on a local copy"
        ) from err
    for index, record in enumerate(stream):
        text = _text_of(record, data.text_field, f"record {index}")
        yield f"{data.hf_dataset}/{data.hf_name}/{data.hf_split}:{index}", text


def read_documents(data: DataConfig, skipped: SkippedFiles | None = None) -> Iterator[tuple[str, str]]:
    """(id, text) of each non-blank document of data.source, stopping after data.max_chars characters (0 = all);
    binary and non-UTF-8 files are left out and counted in `skipped`."""
    skipped = skipped if skipped is not None else SkippedFiles()
    if data.source == "stdlib":
        documents = _stdlib_documents(skipped)
    elif data.source == "text_files":
        documents = _text_file_documents(data, skipped)
    else:
        documents = _hf_documents(data)
    remaining = data.max_chars or None
    for doc_id, text in documents:
        if not text.strip():
            continue
        if remaining is not None:
            text = text[:remaining]
            remaining -= len(text)
        yield doc_id, text
        if remaining == 0:
            return


def describe_source(data: DataConfig) -> str:
    if data.source == "stdlib":
        return (f"Python {sys.version.split()[0]} standard library .py files under {sysconfig.get_paths()['stdlib']}, "
                f"except in directories named {', '.join(sorted(STDLIB_EXCLUDED_DIRS))}")
    if data.source == "text_files":
        whole = "/".join(sorted(WHOLE_FILE_SUFFIXES))
        plain = (f"other plain-text files cut into documents of about {data.doc_chars:,} characters" if data.doc_chars
                 else "other plain-text files whole")
        return (f"files matching {', '.join(data.paths)} (field {data.text_field!r} of .jsonl / .parquet, "
                f"{whole} files whole, {plain})")
    return (f"Hugging Face dataset {data.hf_dataset} (name {data.hf_name}, split {data.hf_split}, "
            f"field {data.text_field!r})")


def is_validation(doc_id: str, val_fraction: float, seed: int) -> bool:
    """Whether a document is held out: decided by a hash of (seed, id) alone, so it is stable."""
    digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


def build_settings(data: DataConfig) -> dict[str, Any]:
    """The data.* values that determine what `keel data` builds: recorded in the manifest, compared on re-runs."""
    keys = ["source", "max_chars", "val_fraction", "seed", "shuffle_documents", "tokenizer"]
    keys += {"stdlib": [], "text_files": ["paths", "text_field", "doc_chars"],
             "hf": ["hf_dataset", "hf_name", "hf_split", "text_field"]}[data.source]
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
    spools = {split: _Spool(os.path.join(workdir, f"{split}.jsonl")) for split in SPLITS}
    with open(spools["train"].path, "wb") as train, open(spools["val"].path, "wb") as val:
        for doc_id, text in read_documents(data, skipped):
            held_out = is_validation(doc_id, data.val_fraction, data.seed)
            spools["val" if held_out else "train"].add(val if held_out else train, doc_id, text)
    total = sum(spool.documents for spool in spools.values())
    if total == 0:
        binary = f"; {skipped.count} binary or non-UTF-8 file(s) skipped, e.g. {skipped.first}" if skipped.count else ""
        raise ConfigError(f"data.source={data.source}: the corpus is empty: no non-blank text in "
                          f"{describe_source(data)}{binary}")
    for split, spool in spools.items():
        if spool.documents == 0:
            smaller = ", a smaller data.doc_chars" if data.source == "text_files" else ""
            raise ConfigError(
                f"data.val_fraction={data.val_fraction}: the {split} split got none of the {total} document(s) "
                f"({describe_source(data)}); use more text{smaller}, or another data.val_fraction or data.seed"
            )
    return spools


# ------------------------------------------------------------------------------------------------------ tokenizers


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
        return Tokenizer.from_str(raw.decode()), raw
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


def _sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


# ------------------------------------------------------------------------------------------ data.dir: local or URL


def data_path(data_dir: str, *names: str) -> str:
    """A file or split under data.dir, as fsspec and litdata want it: an absolute local path or a URL."""
    if "://" in data_dir:
        return "/".join([data_dir.rstrip("/"), *names])
    return os.path.abspath(os.path.join(data_dir, *names))


def _storage(data_dir: str) -> fsspec.AbstractFileSystem:
    """The filesystem of data.dir (local, or an object store through its fsspec backend); for s3:// URLs,
    litdata's own client is first made to accept a plain-http endpoint (see _allow_http_s3_endpoint)."""
    scheme = data_dir.split("://", 1)[0] if "://" in data_dir else "file"
    endpoint = _allow_http_s3_endpoint() if scheme == "s3" else None
    try:
        fs = fsspec.core.url_to_fs(data_dir)[0]
    except ImportError as err:
        extra = " (pip install -e '.[s3]')" if scheme == "s3" else ""
        raise ConfigError(f"data.dir={data_dir}: no fsspec backend for {scheme}:// ({err}){extra}") from None
    if scheme != "file":  # fail here, naming the store, rather than in litdata's workers
        bucket = data_dir.split("://", 1)[1].split("/", 1)[0]
        try:
            found = fs.exists(f"{scheme}://{bucket}")
        except Exception as err:  # noqa: BLE001 - endpoint, network and credential errors of any backend
            raise ConfigError(
                f"data.dir={data_dir}: cannot reach the object store ({type(err).__name__}: {err}); check the "
                "endpoint and credentials (for S3: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE)"
            ) from None
        if not found:
            at = f" at {endpoint}" if endpoint else ""
            raise ConfigError(f"data.dir={data_dir}: bucket {bucket!r} cannot be found{at}: it does not exist, the "
                              "endpoint is unreachable, or these credentials cannot see it; create it, or fix "
                              "data.dir or the endpoint (AWS_ENDPOINT_URL)")
    return fs


def _allow_http_s3_endpoint() -> str | None:
    """litdata (0.2.7x) moves S3 chunks through obstore, whose client it builds with fixed options that refuse
    plain http, so an http endpoint (MinIO or another S3-compatible server on a private network) fails with
    "HTTP error: builder error" while boto3 works. When the endpoint boto3 resolves (AWS_ENDPOINT_URL_S3,
    AWS_ENDPOINT_URL or the AWS config file) is http://, those options get obstore's `allow_http`; https
    endpoints and AWS itself are left exactly as litdata sets them. Returns that endpoint (None: AWS's own)."""
    import boto3
    import litdata.streaming.downloader as downloader

    endpoint = boto3.session.Session().client("s3").meta.endpoint_url or ""
    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if endpoint.startswith("http://") and isinstance(options, dict):
        options["allow_http"] = "true"
    return endpoint or None


def _tokens_per_chunk(fs: fsspec.AbstractFileSystem, data_dir: str, split: str) -> list[int]:
    index = data_path(data_dir, split, "index.json")
    if not fs.exists(index):
        raise ConfigError(f"{data_dir}/{split} has no shards: {REBUILD}")
    return [chunk["dim"] for chunk in _chunks(fs, data_dir, split)]


def _chunks(fs: fsspec.AbstractFileSystem, data_dir: str, split: str) -> list[dict]:
    return json.loads(fs.cat_file(data_path(data_dir, split, "index.json")))["chunks"]


def _file_sha256(fs: fsspec.AbstractFileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _chunk_digests(fs: fsspec.AbstractFileSystem, data_dir: str, split: str) -> dict[str, str]:
    """sha256 of each chunk file of a split, by file name."""
    return {chunk["filename"]: _file_sha256(fs, data_path(data_dir, split, chunk["filename"]))
            for chunk in _chunks(fs, data_dir, split)}


def verify_shards(fs: fsspec.AbstractFileSystem, data: DataConfig, manifest: dict) -> None:
    """Every chunk the indexes list is there at its full size; local chunks also match the manifest's sha256
    (data.verify_checksums; hashing ran at 0.18 GB/s on the loaded 2-core dev machine). A shard truncated or
    damaged after the build is refused here, at start-up, not when litdata's reader reaches it mid-run."""
    checksums = manifest.get("chunk_sha256") if data.verify_checksums and "://" not in data.dir else None
    for split in SPLITS:
        for chunk in _chunks(fs, data.dir, split):
            path = data_path(data.dir, split, chunk["filename"])
            size = fs.size(path) if fs.exists(path) else None
            if size != chunk["chunk_bytes"]:
                found = "missing" if size is None else f"{size:,} of its {chunk['chunk_bytes']:,} bytes"
                raise ConfigError(f"{data.dir}/{split}/{chunk['filename']} is truncated or missing ({found}): "
                                  f"{REBUILD}")
            if checksums and _file_sha256(fs, path) != checksums.get(split, {}).get(chunk["filename"]):
                raise ConfigError(f"{data.dir}/{split}/{chunk['filename']} is corrupt (its sha256 is not the one in "
                                  f"{MANIFEST}): {REBUILD}")


def _require_sequences(fs: fsspec.AbstractFileSystem, data_dir: str, seq_len: int) -> None:
    """Each split must hold at least one training sequence (TokensLoader never lets one cross a chunk boundary)."""
    for split in SPLITS:
        chunks = _tokens_per_chunk(fs, data_dir, split)
        if sum(tokens // (seq_len + 1) for tokens in chunks) == 0:
            raise ConfigError(
                f"{data_dir}/{split}: its {sum(chunks)} tokens make no sequence of model.seq_len + 1 = {seq_len + 1} "
                "tokens; use more text (data.paths, data.max_chars), a larger data.val_fraction, "
                "or a smaller model.seq_len"
            )


# ------------------------------------------------------------------------------------------------------ keel data


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
        if _sha256(Path(data.tokenizer).read_bytes()) != manifest.get("tokenizer_sha256"):
            changes.append(f"the contents of {data.tokenizer}")
            other_tokenizer = True
    if changes:
        built_with = "another tokenizer" if other_tokenizer else "other data settings"
        raise ConfigError(
            f"{data.dir} already holds shards built with {built_with} ({'; '.join(changes)}): "
            "pass --force to rebuild them, or choose another data.dir"
        )
    _require_sequences(fs, data.dir, cfg.model.seq_len)
    return manifest


def prepare(cfg: Config, force: bool = False) -> dict:
    """Build the tokenizer, shards, val_docs.jsonl and manifest at cfg.data.dir unless already there; the manifest."""
    data = cfg.data
    fs = _storage(data.dir)
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
        print(f"keel data: reading {describe_source(data)}")
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

    _require_sequences(fs, data.dir, cfg.model.seq_len)
    timings["total_s"] = time.perf_counter() - start
    manifest = {
        "source": {"kind": data.source, "description": describe_source(data)},
        "settings": build_settings(data),
        "documents": {split: spools[split].documents for split in SPLITS},
        "chars": {split: spools[split].chars for split in SPLITS},
        "tokens": {split: sum(_tokens_per_chunk(fs, data.dir, split)) for split in SPLITS},
        "skipped_files": {"binary_or_not_utf8": skipped.count, "first": skipped.first},
        "chunk_sha256": {split: _chunk_digests(fs, data.dir, split) for split in SPLITS},
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "eos_token": tokenizer.id_to_token(eos_id),
        "dtype": dtype.name,
        "tokenizer_sha256": _sha256(tokenizer_bytes),
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


# -------------------------------------------------------------------------------------------------------- training


@dataclass
class DatasetInfo:
    dir: str
    tokenizer_path: str
    tokenizer_json: str
    vocab_size: int
    eos_id: int
    manifest: dict
    manifest_sha256: str  # identifies the build: a checkpoint's loader position refers to these shards only


def open_dataset(cfg: Config) -> DatasetInfo:
    """The shards at cfg.data.dir, checked against the config; a ConfigError says what to run when they don't fit."""
    data = cfg.data
    fs = _storage(data.dir)
    manifest_path = data_path(data.dir, MANIFEST)
    if not fs.exists(manifest_path):
        why = " (it has no manifest.json: an interrupted `keel data`?)" if fs.exists(data_path(data.dir)) else ""
        raise ConfigError(
            f"no shards at {data.dir}{why}: run `keel data` (or `make data`) with the same data.* settings"
        )
    try:
        manifest_bytes = fs.cat_file(manifest_path)
        manifest = json.loads(manifest_bytes)
        if missing := [key for key in MANIFEST_KEYS if key not in manifest]:
            raise ValueError(f"no {', '.join(missing)}")
    except ValueError as err:
        raise ConfigError(f"{data.dir}/{MANIFEST} is corrupt ({err}): {REBUILD}") from None
    tokenizer_path = data_path(data.dir, TOKENIZER)
    raw = fs.cat_file(tokenizer_path) if fs.exists(tokenizer_path) else b""
    if _sha256(raw) != manifest["tokenizer_sha256"]:
        raise ConfigError(
            f"{data.dir}/{TOKENIZER} is missing or is not the one the shards were encoded with: {REBUILD}"
        )
    for split in SPLITS:
        _tokens_per_chunk(fs, data.dir, split)  # raises when the split's index is missing
    verify_shards(fs, data, manifest)

    built_with = manifest["settings"].get("tokenizer")
    if data.tokenizer is not None:
        if os.path.isfile(data.tokenizer):
            same = _sha256(Path(data.tokenizer).read_bytes()) == manifest["tokenizer_sha256"]
        else:  # a hub name, compared by name so that training needs no network
            same = data.tokenizer == built_with
        if not same:
            raise ConfigError(
                f"data.tokenizer={data.tokenizer!r} is not the tokenizer the shards at {data.dir} were built with "
                f"({built_with or 'a BPE trained by keel data'}): run `keel data --force` with this data.tokenizer, "
                "or point data.dir elsewhere"
            )
    if cfg.model.vocab_size < manifest["vocab_size"]:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {manifest['vocab_size']} tokens "
            f"({tokenizer_path}): set model.vocab_size >= {manifest['vocab_size']}"
        )
    return DatasetInfo(
        dir=data.dir,
        tokenizer_path=tokenizer_path,
        tokenizer_json=raw.decode(),
        vocab_size=manifest["vocab_size"],
        eos_id=manifest["eos_id"],
        manifest=manifest,
        manifest_sha256=_sha256(manifest_bytes),
    )


def _stack_long(sequences: list[np.ndarray]) -> torch.Tensor:
    # Shards hold uint16 (or int32) ids; embeddings and cross-entropy want int64.
    return torch.from_numpy(np.stack(sequences).astype(np.int64))


class _ResumableLoader(StreamingDataLoader):
    """A StreamingDataLoader whose epochs after a resumed one start afresh.

    litdata clears its `restore` flag only when an epoch runs into StopIteration, but Lightning stops after
    len(loader) batches; the flag would stay set and every later epoch would replay from the restored position.
    """

    _resumed_epoch_begun = False

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self._resumed_epoch_begun:
            self.restore = self._resumed_epoch_begun = False
        for batch in super().__iter__():
            self._resumed_epoch_begun = self.restore
            yield batch


def token_loader(cfg: Config, split: str, shuffle: bool) -> StreamingDataLoader:
    """(micro_batch_size, seq_len + 1) int64 batches of consecutive tokens from one split of cfg.data.dir."""
    dataset = StreamingDataset(
        data_path(cfg.data.dir, split),
        item_loader=TokensLoader(block_size=cfg.model.seq_len + 1),
        shuffle=shuffle,
        seed=cfg.run.seed,
        drop_last=True,  # the same number of batches on every rank
        # Explicit: litdata's default (None) reads LITDATA_ITEM_SHUFFLE_WINDOW or else 256, which makes ~32 steps
        # of micro-batch 8 in a row come from one stretch of a chunk.
        item_shuffle_window=cfg.data.shuffle_window,
        cache_dir=cfg.data.cache_dir,  # where chunks of an object-store data.dir are downloaded to
    )
    loader = _ResumableLoader(
        dataset, batch_size=cfg.trainer.micro_batch_size, num_workers=cfg.data.loader_workers, collate_fn=_stack_long
    )
    if len(loader) == 0:
        raise ConfigError(
            f"{cfg.data.dir}/{split}: {len(dataset)} sequence(s) of model.seq_len + 1 = {cfg.model.seq_len + 1} tokens "
            f"per device, fewer than one batch of trainer.micro_batch_size={cfg.trainer.micro_batch_size}; "
            "use more text, a larger data.val_fraction, or a smaller model.seq_len or trainer.micro_batch_size"
        )
    return loader


def check_resumable_data(cfg: Config, dataset: DatasetInfo, path: str, checkpoint: dict) -> None:
    """A checkpoint's train-loader position is only meaningful on the shards it was saved on and with the same
    read-time shuffle (litdata would otherwise fail mid-start, or continue on other data)."""
    saved_build = checkpoint.get("KeelDataModule", {}).get("manifest_sha256")
    if saved_build is None and "shuffle_documents" in dataset.manifest["settings"]:
        raise ConfigError(
            f"resume: {path} was written on shards built before `keel data` shuffled documents, and the shards at "
            f"{cfg.data.dir} were built since (with data.shuffle_documents): the saved loader position would point "
            "into other data. Start a new run (resume=null, or another run.dir)"
        )
    if saved_build is not None and saved_build != dataset.manifest_sha256:
        raise ConfigError(
            f"resume: the shards at {cfg.data.dir} are not the ones {path} was trained on (its manifest differs: "
            "rebuilt or replaced since): the saved loader position would point into other data. Resume with the "
            "original shards, or start a new run (resume=null, or another run.dir)"
        )
    loops = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    for state in loops.get("combined_loader", []):  # litdata's StreamingDataLoader state, one per loader
        dataset_state = state.get("dataset", {}) if isinstance(state, dict) else {}
        saved_window = dataset_state.get("item_shuffle_window") if dataset_state.get("shuffle") else None
        if saved_window is not None and saved_window != cfg.data.shuffle_window:
            older = " (litdata's default before keel set data.shuffle_window)" if saved_window == 256 else ""
            raise ConfigError(
                f"resume: {path} read its training sequences with data.shuffle_window={saved_window}{older}; this "
                f"config has {cfg.data.shuffle_window}. Resume with data.shuffle_window={saved_window} to continue "
                "that run exactly, or start a new run (resume=null, or another run.dir)"
            )


def _define_datamodule() -> type:
    import lightning as L

    class KeelDataModule(L.LightningDataModule):
        """Batches (micro_batch_size, seq_len + 1) of int64 token ids from the shards `keel data` built; the
        LightningModule takes inputs [:, :-1] and targets [:, 1:].

        Lightning re-iterates the train loader every epoch (reshuffled), so runs longer than an epoch cycle
        through the data. The loader's position needs nothing here: a StreamingDataLoader is stateful, so
        Lightning's fit loop saves it in every checkpoint (`loops.fit_loop.state_dict.combined_loader`) and
        restores it on resume. This module's own state is the identity of the shards that position refers to.
        """

        def __init__(self, cfg: Config, info: DatasetInfo | None = None) -> None:
            super().__init__()
            self.cfg = cfg
            # fail before the Trainer starts when the shards don't fit; `info`: already opened (and verified)
            self.info = info if info is not None else open_dataset(cfg)

        def train_dataloader(self) -> StreamingDataLoader:
            return token_loader(self.cfg, "train", shuffle=True)

        def val_dataloader(self) -> StreamingDataLoader:
            return token_loader(self.cfg, "val", shuffle=False)

        def state_dict(self) -> dict:
            return {"manifest_sha256": self.info.manifest_sha256}

    KeelDataModule.__module__, KeelDataModule.__qualname__ = __name__, "KeelDataModule"
    return KeelDataModule


def __getattr__(name: str) -> Any:
    # KeelDataModule subclasses lightning's LightningDataModule, and importing lightning takes 5-10 s on a small
    # CPU box: `keel data`, run before every `make pretrain`, should not pay that to find nothing to do.
    if name == "KeelDataModule":
        globals()[name] = datamodule = _define_datamodule()
        return datamodule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
