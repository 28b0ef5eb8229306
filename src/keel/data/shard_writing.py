"""`keel data`'s shards: the spans of each split encoded by worker processes (SpanEncoder) and written with litdata's
BinaryWriter in its TokensLoader layout, locally or a chunk at a time to an object store; a worker that fails or dies
stops them all, named."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import queue
import re
import signal
import sys
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import fsspec
import numpy as np
from litdata import TokensLoader
from litdata.streaming.writer import BinaryWriter
from tokenizers import Tokenizer
from tqdm import tqdm

from keel.config import DataConfig
from keel.data.shards import data_path, writing
from keel.data.spooling import SPAN_CHARS, Spool, document_order
from keel.data.tokenizer import tokenizer_pieces
from keel.errors import ConfigError


class SpanEncoder:
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


def _shares(spans: list[Any], workers: int) -> list[list[Any]]:
    """Consecutive shares of the spans, one per worker, the remainder going one each to the last workers: as
    litdata's optimize() deals them, so the shards are those it wrote before keel wrote them itself."""
    size, remainder = divmod(len(spans), workers)
    bounds = np.cumsum([0] + [size + (rank >= workers - remainder) for rank in range(workers)]).tolist()
    return [spans[begin:end] for begin, end in zip(bounds, bounds[1:])]


def _shard_writer(
    rank: int,
    spans: list[Any],
    encoder: SpanEncoder,
    chunk_dir: str,
    upload_dir: str | None,
    chunk_bytes: str,
    written: Any,
    report: Connection,
) -> None:
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

            # msg_queue: litdata's optimize() collects each worker's "Rank N inferred the following data format"
            # there; here it is dropped (without one the writer prints it, per worker and split)
            writer = BinaryWriter(
                chunk_dir, chunk_bytes=chunk_bytes, item_loader=TokensLoader(), msg_queue=queue.SimpleQueue()
            )
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
    # Workers are forked where the platform allows it: spawn re-imports torch in each one (docs/data.md). Forked
    # workers cannot use the thread pool the BPE training started: tokenizers checks this variable as a process
    # forks, and without it each worker would print that it falls back to one thread. The workers are the
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


def write_shards(
    data: DataConfig,
    fs: fsspec.AbstractFileSystem,
    spool: Spool,
    split: str,
    encoder: SpanEncoder,
    staging: str,
    workdir: str,
) -> None:
    """The split's shards in <staging>/<split>: written there by the workers on a local data.dir; on an object store
    through <workdir>/<split>, a chunk at a time. Any worker's failure or death stops them all and is raised."""
    spans = [(spool.path, documents) for documents in spool.spans(document_order(spool.documents, data, split))]
    shares = _shares(spans, min(data.prepare_workers, len(spans)))
    remote = "://" in data.dir
    chunk_dir = os.path.join(workdir, split) if remote else data_path(staging, split)
    upload_dir = data_path(staging, split) if remote else None
    print(
        f"keel data: encoding the {split} split ({len(spans)} span(s) of ~{SPAN_CHARS:,} characters) with "
        f"{len(shares)} worker(s)",
        flush=True,
    )
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    written = context.Value("q", 0)
    workers: dict[Connection, tuple[str, multiprocessing.process.BaseProcess]] = {}
    try:
        with _tokenizers_single_threaded():
            for rank, share in enumerate(shares):
                receive, send = context.Pipe(duplex=False)
                worker = context.Process(
                    target=_shard_writer,
                    daemon=True,
                    args=(rank, share, encoder, chunk_dir, upload_dir, data.chunk_bytes, written, send),
                )
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
        merge_indexes(chunk_dir)
    if remote:
        fs.put_file(os.path.join(chunk_dir, "index.json"), f"{upload_dir}/index.json")


def merge_indexes(chunk_dir: str) -> None:
    """The workers' <rank>.index.json -> one index.json listing their chunks in rank order, as litdata's optimize()
    merges them (BinaryWriter.merge() waits for WORLD_SIZE x workers files: forever when keel data runs inside a
    distributed job). Every worker wrote the same TokensLoader config."""
    ranked = sorted(
        (int(m[1]), name) for name in os.listdir(chunk_dir) if (m := re.fullmatch(r"(\d+)\.index\.json", name))
    )
    indexes = []
    for _, name in ranked:
        with open(os.path.join(chunk_dir, name)) as f:
            indexes.append(json.load(f))
    merged = {"chunks": [chunk for index in indexes for chunk in index["chunks"]], "config": indexes[0]["config"]}
    with open(os.path.join(chunk_dir, "index.json.tmp"), "w") as f:
        json.dump(merged, f, sort_keys=True)
    os.replace(os.path.join(chunk_dir, "index.json.tmp"), os.path.join(chunk_dir, "index.json"))
    for _, name in ranked:
        os.remove(os.path.join(chunk_dir, name))
