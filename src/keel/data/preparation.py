"""`keel data`: one pass over data.source spooled to local disk and split, a tokenizer, the shards of each split
(encoded in a seeded document order by worker processes, in litdata's TokensLoader layout), val_docs.jsonl, and the
manifest. A build holds a lock on data.dir, is staged in <data.dir>/.keel-build and moved into place once whole: a
build that fails or is interrupted is removed and leaves data.dir as it was.

    keel data [--config FILE] [--force] [key=value ...]
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import posixpath
import signal
import sys
import tempfile
import threading
import time
import traceback
from array import array
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from importlib import metadata
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import fsspec
import numpy as np
from litdata import TokensLoader
from litdata.streaming.writer import BinaryWriter
from tokenizers import Tokenizer
from tqdm import tqdm

from keel.config import Config, DataConfig, load_config
from keel.data.shards import (
    MANIFEST, PUBLISHING, SPLITS, STAGING, TOKENIZER, VAL_DOCS, chunk_digests, data_path, refuse_foreign_files,
    require_sequences, sha256, storage, tokens_per_chunk,
)
from keel.data.sources import get_source, read_documents
from keel.data.sources.base import MAX_UNDECODABLE, SkippedFiles
from keel.data.tokenizer import eos_id_of, load_tokenizer, tokenizer_pieces, train_tokenizer
from keel.dirlock import DirLock
from keel.errors import ConfigError

# Characters of spooled text per span, the unit of work of the shard writers: small enough to spread over the
# workers, large enough for each tokenizer call to batch many documents (and the most one call encodes).
SPAN_CHARS = 1_000_000
# data.* keys that shape every build, whatever the source (each source adds its own: Source.settings)
COMMON_SETTINGS = ("source", "max_chars", "val_fraction", "seed", "shuffle_documents", "tokenizer")
# A write that ran out of room: what it is, and what to do
OUT_OF_ROOM = {
    errno.ENOSPC: ("no space left on device", "free space or choose another data.dir / TMPDIR"),
    errno.EDQUOT: ("disk quota exceeded", "free space or choose another data.dir / TMPDIR"),
    errno.EFBIG: ("file too large", "raise the file size limit (ulimit -f) or choose another data.dir / TMPDIR"),
}
Result = TypeVar("Result")


class DataDirLock(DirLock):
    """One build per local data.dir at a time, taken only to build: an up-to-date data.dir is read, never written."""

    key = "data.dir"
    clash = "Two builds in one data.dir would replace each other's files"
    command = "data"


@contextlib.contextmanager
def writing(what: str) -> Iterator[None]:
    """Turns a write under it that runs out of room (a full disk, a quota, a file size limit) into one line naming
    `what` was written and what to do, instead of a bare OSError (a write's OSError names no file)."""
    try:
        yield
    except OSError as err:
        if err.errno not in OUT_OF_ROOM:
            raise
        problem, advice = OUT_OF_ROOM[err.errno]
        raise ConfigError(f"{problem} writing {what}: {advice}") from None


def is_validation(doc_id: str, val_fraction: float, seed: int) -> bool:
    """Whether a document is held out: decided by a hash of (seed, id) alone, so it is stable."""
    digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


def build_settings(data: DataConfig) -> dict[str, Any]:
    """The data.* values that determine what `keel data` builds: recorded in the manifest, compared on re-runs."""
    keys = [*COMMON_SETTINGS, *get_source(data.source).settings]
    if data.tokenizer is None:
        keys.append("vocab_size")  # shapes only a tokenizer trained here
    settings = {key: getattr(data, key) for key in keys}
    if "encoding" in settings:  # by its canonical name: "UTF8" and "utf-8" are one setting
        settings["encoding"] = codecs.lookup(data.encoding).name
    return settings


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
        """The documents in `order`, grouped into spans of about SPAN_CHARS characters (a shard writer's unit of work):
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
    with writing(f"the spooled corpus in {workdir}"):
        with open(spools["train"].path, "wb") as train, open(spools["val"].path, "wb") as val:
            for doc_id, text in read_documents(data, skipped):
                held_out = is_validation(doc_id, data.val_fraction, data.seed)
                spools["val" if held_out else "train"].add(val if held_out else train, doc_id, text)
    total = sum(spool.documents for spool in spools.values())
    if total == 0:
        binary = f"; skipped {skipped}" if skipped.count else ""
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
    """A shard writer's function: one spooled span of documents -> their ids, each document ended by EOS. A document
    longer than the tokenizer may take at once goes to it in tokenizer_pieces, and no call encodes more than about
    SPAN_CHARS characters: memory stays bounded whatever the documents."""

    def __init__(self, tokenizer: Tokenizer, eos_id: int, dtype: np.dtype) -> None:
        self.tokenizer, self.eos_id, self.dtype = tokenizer, eos_id, dtype

    def __call__(self, span: tuple[str, list[tuple[int, int]]]) -> np.ndarray:
        path, documents = span
        encoded, batch, batch_chars = [], [], 0  # batch: (piece, whether it ends its document)
        with open(path, "rb") as spool:
            for start, length in documents:
                spool.seek(start)
                pieces = tokenizer_pieces(json.loads(spool.read(length))["text"])
                for number, piece in enumerate(pieces, 1):
                    batch.append((piece, number == len(pieces)))
                    batch_chars += len(piece)
                    if batch_chars >= SPAN_CHARS:
                        encoded.append(self._encode(batch))
                        batch, batch_chars = [], 0
        if batch:
            encoded.append(self._encode(batch))
        return np.concatenate(encoded)

    def _encode(self, batch: list[tuple[str, bool]]) -> np.ndarray:
        ids: list[int] = []
        encodings = self.tokenizer.encode_batch([piece for piece, _ in batch], add_special_tokens=False)
        for (_, ends_document), encoding in zip(batch, encodings):
            ids += encoding.ids
            if ends_document:
                ids.append(self.eos_id)
        return np.asarray(ids, dtype=self.dtype)


def _in_a_thread(function: Callable[..., Result], *args: Any) -> Result:
    """function(*args), run in a daemon thread that the main thread waits for. Python runs a signal's handler in the
    main thread between bytecodes, and the tokenizers library trains a BPE in Rust for minutes without coming back:
    called directly, it held Ctrl-C until it was done. A wait can be interrupted; after Ctrl-C the thread is left to
    end with the process."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = function(*args)
        except BaseException as err:  # noqa: BLE001 - raised again in the main thread
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _shares(spans: list[Any], workers: int) -> list[list[Any]]:
    """Consecutive shares of the spans, one per worker, the remainder going one each to the last workers: as
    litdata's optimize() deals them, so the shards are those it wrote before keel wrote them itself."""
    size, remainder = divmod(len(spans), workers)
    bounds = np.cumsum([0] + [size + (rank >= workers - remainder) for rank in range(workers)]).tolist()
    return [spans[begin:end] for begin, end in zip(bounds, bounds[1:])]


def _shard_writer(rank: int, spans: list[Any], encoder: _SpanEncoder, chunk_dir: str, upload_dir: str | None,
                  chunk_bytes: str, written: Any, report: Connection) -> None:
    """One worker process: its share of the spans, encoded in order and written with litdata's BinaryWriter (as
    optimize() writes them) into chunk-<rank>-<n>.bin files and a <rank>.index.json in chunk_dir; on an object store
    each chunk is then uploaded to upload_dir and removed here. Reports None when done, a ConfigError (a full disk),
    or the traceback of anything else; the main process waits for that report, or for the end of the pipe when the
    worker dies without one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the main process stops us
    os.environ["DATA_OPTIMIZER_GLOBAL_RANK"] = str(rank)  # the writer names its files by it
    try:
        with writing(f"the shards in {chunk_dir}"):
            store = fsspec.core.url_to_fs(upload_dir)[0] if upload_dir else None

            def keep(chunk: str | None) -> None:
                if chunk and store is not None:
                    store.put_file(chunk, f"{upload_dir}/{os.path.basename(chunk)}")
                    os.remove(chunk)

            writer = BinaryWriter(chunk_dir, chunk_bytes=chunk_bytes, item_loader=TokensLoader())
            for index, span in enumerate(spans):
                keep(writer.add_item(index, encoder(span)))
                with written.get_lock():
                    written.value += 1
            for chunk in writer.done():
                keep(chunk)
        report.send(None)
    except ConfigError as err:
        report.send(err)
    except BaseException:  # noqa: BLE001 - whatever it is, the main process says it
        report.send(traceback.format_exc())


@contextlib.contextmanager
def _tokenizers_single_threaded() -> Iterator[None]:
    # Workers are forked where the platform allows it: spawn re-imports torch in each one (10-20 s on a busy 2-core
    # box). Forked workers cannot use the thread pool the BPE training started: tokenizers checks this variable as a
    # process forks, and without it each worker would print that it falls back to one thread. The workers are the
    # parallelism. Set for the forks only: it would also hold back a later tokenizer in this process.
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def _died(process: multiprocessing.process.BaseProcess, name: str) -> ConfigError:
    process.join()
    code = process.exitcode
    if code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
        if code == -signal.SIGKILL:
            how += " (the kernel's out-of-memory killer sends it: use fewer data.prepare_workers, or more memory)"
    else:
        how = f"exited with status {code}"
    return ConfigError(f"{name} {how} before it was done")


def _write_shards(data: DataConfig, fs: fsspec.AbstractFileSystem, spool: _Spool, split: str, encoder: _SpanEncoder,
                  staging: str, workdir: str) -> None:
    """The split's shards in <staging>/<split>: written there by the workers on a local data.dir; on an object store
    through <workdir>/<split>, a chunk at a time. Any worker's failure or death stops them all and is raised."""
    spans = [(spool.path, documents) for documents in spool.spans(document_order(spool.documents, data, split))]
    shares = _shares(spans, min(data.prepare_workers, len(spans)))
    remote = "://" in data.dir
    chunk_dir = os.path.join(workdir, split) if remote else data_path(staging, split)
    upload_dir = data_path(staging, split) if remote else None
    print(f"keel data: encoding the {split} split ({len(spans)} span(s) of ~{SPAN_CHARS:,} characters) with "
          f"{len(shares)} worker(s)", flush=True)
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    written = context.Value("q", 0)
    workers: dict[Connection, tuple[str, multiprocessing.process.BaseProcess]] = {}
    try:
        with _tokenizers_single_threaded():
            for rank, share in enumerate(shares):
                receive, send = context.Pipe(duplex=False)
                worker = context.Process(target=_shard_writer, daemon=True, args=(
                    rank, share, encoder, chunk_dir, upload_dir, data.chunk_bytes, written, send))
                worker.start()
                send.close()  # the worker's copy alone remains: its end, however it ends, reads as end of file here
                workers[receive] = (f"the {split} shard writer (worker {rank} of {len(shares)})", worker)
        with tqdm(total=len(spans), desc=f"{split} shards", unit="span", disable=None) as bar:
            while workers:
                for receive in multiprocessing.connection.wait(list(workers), timeout=1):
                    name, worker = workers.pop(receive)
                    try:
                        outcome = receive.recv()
                    except EOFError:
                        outcome = _died(worker, name)
                    if isinstance(outcome, str):
                        raise RuntimeError(f"{name} failed:\n{outcome}")
                    if outcome is not None:
                        raise outcome
                    worker.join()
                bar.update(written.value - bar.n)
    finally:  # after a failure or Ctrl-C: the others are stopped, not left writing into what is being removed
        for _, worker in workers.values():
            worker.kill()
            worker.join()
    with writing(f"the {split} index in {chunk_dir}"):
        # the workers' <rank>.index.json -> index.json, as optimize() merges them (merge() would wait for as many
        # files as WORLD_SIZE x workers, forever when keel data runs inside a distributed job)
        BinaryWriter(chunk_dir, chunk_bytes=data.chunk_bytes, item_loader=TokensLoader())._merge_no_wait()
    if remote:
        fs.put_file(os.path.join(chunk_dir, "index.json"), f"{upload_dir}/index.json")


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
    if "encoding" in settings:  # builds made before data.encoding existed read UTF-8
        built = {"encoding": "utf-8", **built}
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


def _up_to_date(cfg: Config, fs: fsspec.AbstractFileSystem, force: bool) -> dict | None:
    if (manifest := _existing_build(cfg, fs, force)) is not None:
        print(f"keel data: {cfg.data.dir} is up to date ({manifest['tokens']['train']:,} train / "
              f"{manifest['tokens']['val']:,} val tokens); nothing to do (--force rebuilds)")
    return manifest


def prepare(cfg: Config, force: bool = False) -> dict:
    """Build the tokenizer, shards, val_docs.jsonl and manifest at cfg.data.dir unless already there; the manifest."""
    data = cfg.data
    fs = storage(data.dir)
    if (manifest := _up_to_date(cfg, fs, force)) is not None:
        return manifest
    given = load_tokenizer(data.tokenizer) if data.tokenizer else None  # before reading: fail fast
    # an object store has no lock: two builds into one remote data.dir are not prevented
    with contextlib.nullcontext() if "://" in data.dir else DataDirLock(data.dir):
        if (manifest := _up_to_date(cfg, fs, force)) is not None:  # built meanwhile by the lock's last holder
            return manifest
        refuse_foreign_files(fs, data.dir)  # before any work: a build would replace them
        staging = data_path(data.dir, STAGING)
        if fs.exists(staging):  # left by a build killed before it could remove it (the lock says none is running)
            fs.rm(staging, recursive=True)
        try:
            try:
                manifest = _build(cfg, fs, staging, given)
            except KeyboardInterrupt:
                raise KeyboardInterrupt(f"interrupted: the unfinished build was removed; {data.dir} holds what it "
                                        "held before") from None
            _publish(fs, staging, data.dir)  # interrupted, it leaves an unfinished build: the next run rebuilds it
        finally:
            if fs.exists(staging):
                fs.rm(staging, recursive=True)
    documents, tokens = manifest["documents"], manifest["tokens"]
    print(f"keel data: wrote {data.dir}: {documents['train']:,} train / {documents['val']:,} val documents, "
          f"{tokens['train']:,} / {tokens['val']:,} tokens, vocabulary {manifest['vocab_size']}; "
          + ", ".join(f"{key[:-2]} {seconds:.1f} s" for key, seconds in manifest["timings"].items()))
    return manifest


def _build(cfg: Config, fs: fsspec.AbstractFileSystem, staging: str, given: tuple[Tokenizer, bytes] | None) -> dict:
    """A whole build in `staging`, its manifest written last; the manifest."""
    data, source = cfg.data, get_source(cfg.data.source)
    start = time.perf_counter()
    timings = {}
    with writing(staging):
        fs.makedirs(staging, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="keel-data-") as workdir:
        print(f"keel data: reading {source.describe(data)}")
        skipped = SkippedFiles(data.encoding)
        spools = _spool(data, workdir, skipped)
        timings["read_s"] = time.perf_counter() - start
        if skipped.count:
            print(f"keel data: skipped {skipped} (a NUL, or more than {MAX_UNDECODABLE:.0%} of the characters "
                  "undecodable); files in another encoding are read with data.encoding=CODEC (e.g. latin-1, cp1252)")

        mark = time.perf_counter()
        if given is None:
            print(f"keel data: training a {data.vocab_size}-token byte-level BPE "
                  f"on {spools['train'].chars:,} characters", flush=True)
            tokenizer = _in_a_thread(train_tokenizer, spools["train"].texts(), data.vocab_size)
            tokenizer_bytes = tokenizer.to_str().encode()
        else:
            tokenizer, tokenizer_bytes = given
        eos_id, vocab_size = eos_id_of(tokenizer), tokenizer.get_vocab_size()
        with writing(data_path(staging, TOKENIZER)):
            fs.pipe_file(data_path(staging, TOKENIZER), tokenizer_bytes)
        timings["tokenizer_s"] = time.perf_counter() - mark

        dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)
        encoder = _SpanEncoder(tokenizer, eos_id, dtype)
        for split in SPLITS:
            mark = time.perf_counter()
            _write_shards(data, fs, spools[split], split, encoder, staging, workdir)
            timings[f"{split}_shards_s"] = time.perf_counter() - mark
        with writing(data_path(staging, VAL_DOCS)):
            fs.put_file(spools["val"].path, data_path(staging, VAL_DOCS))

    require_sequences(fs, staging, cfg.model.seq_len)
    timings["total_s"] = time.perf_counter() - start
    manifest = {
        "source": {"kind": data.source, "description": source.describe(data)},
        "settings": build_settings(data),
        "documents": {split: spools[split].documents for split in SPLITS},
        "chars": {split: spools[split].chars for split in SPLITS},
        "tokens": {split: sum(tokens_per_chunk(fs, staging, split)) for split in SPLITS},
        "skipped_files": {"binary_or_undecodable": skipped.count, "first": skipped.first},
        "chunk_sha256": {split: chunk_digests(fs, staging, split) for split in SPLITS},
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "eos_token": tokenizer.id_to_token(eos_id),
        "dtype": dtype.name,
        "tokenizer_sha256": sha256(tokenizer_bytes),
        "timings": {key: round(seconds, 2) for key, seconds in timings.items()},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "keel_version": metadata.version("keel"),
    }
    with writing(data_path(staging, MANIFEST)):
        fs.pipe_file(data_path(staging, MANIFEST), json.dumps(manifest, indent=2).encode())
    return manifest


def _publish(fs: fsspec.AbstractFileSystem, staging: str, data_dir: str) -> None:
    """Moves a whole staged build into data.dir. The old manifest goes first, so data.dir reads as an unfinished build
    until the new one, moved last, marks it complete. Locally every move is a rename on one filesystem: no space
    is needed, and the earlier build is kept until here. Interrupted, the PUBLISHING mark says what is there is
    keel's to replace."""
    refuse_foreign_files(fs, data_dir)  # again: the build took a while
    with writing(data_path(data_dir, PUBLISHING)):
        fs.pipe_file(data_path(data_dir, PUBLISHING), b"")
    if fs.exists(data_path(data_dir, MANIFEST)):
        fs.rm_file(data_path(data_dir, MANIFEST))
    for name in (TOKENIZER, VAL_DOCS, *SPLITS, MANIFEST):
        source, target = data_path(staging, name), data_path(data_dir, name)
        if fs.exists(target):
            fs.rm(target, recursive=True)
        if "://" in data_dir and fs.isdir(source):  # an object store has no directory to rename: each object of the
            for path in fs.ls(source, detail=False):  # split (a flat folder) is copied, then deleted
                fs.mv(path, f"{target}/{posixpath.basename(path)}")
        else:
            fs.mv(source, target)
    fs.rm_file(data_path(data_dir, PUBLISHING))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keel data", description="Build tokenized litdata shards from data.source.")
    parser.add_argument("--config", help="YAML merged over conf/config.yaml (data.* and model.seq_len matter here)")
    parser.add_argument("--force", action="store_true", help="rebuild even if data.dir already holds shards")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="e.g. data=text_files 'data.paths=[docs/*.md]'")
    args = parser.parse_intermixed_args(argv)  # options may follow overrides: `keel data $ARGS --force`
    # Past a file size limit (ulimit -f) the kernel kills the writer with SIGXFSZ, without a word; ignored, the
    # write fails with EFBIG instead, which is reported like a full disk. Shard writers inherit it.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    prepare(load_config(args.config, args.overrides), force=args.force)
    return 0
