"""`keel data`'s one pass over data.source: each document held out or not (is_validation), spooled to local disk as
JSON lines per split, and cut into spans of about SPAN_CHARS characters, the shard writers' unit of work."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from keel.config import DataConfig
from keel.data.shards import SPLITS, writing
from keel.data.sources import SOURCES, read_documents
from keel.data.sources.base import SkippedFiles
from keel.dirlock import pid_alive
from keel.errors import ConfigError

# Characters of spooled text per span, the unit of work of the shard writers: small enough to spread over the
# workers, large enough for each tokenizer call to batch many documents (and the most one call encodes).
SPAN_CHARS = 1_000_000
SPOOL = "keel-data-"  # the spool's directory in $TMPDIR: keel-data-<pid>-<host>-<tempfile's random part>


def spool_prefix() -> str:
    """How this process's spool directory is named: by its owner, so that a later build tells one left by a killed
    build (kill -9 leaves it) from a running build's."""
    return f"{SPOOL}{os.getpid()}-{socket.gethostname()}-"


def remove_stale_spools() -> None:
    """Remove, from $TMPDIR, the spools of `keel data` processes on this host that are no longer running. A running
    build's is kept (its pid is alive), and so is one whose owner cannot be told: another host's (a shared
    $TMPDIR), or one named before the pid was part of the name."""
    owner = re.compile(rf"{SPOOL}(\d+)-{re.escape(socket.gethostname())}-[a-z0-9_]+")  # tempfile: no "-" in its part
    stale = [
        path
        for path in sorted(Path(tempfile.gettempdir()).glob(f"{SPOOL}*"))
        if (match := owner.fullmatch(path.name)) and path.is_dir() and not pid_alive(int(match[1]))
    ]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)  # another user's, in a shared /tmp, is theirs to remove
    if removed := [str(path) for path in stale if not path.exists()]:
        print(f"keel data: removed the spool(s) of keel data processes no longer running: {', '.join(removed)}")


def is_validation(doc_id: str, val_fraction: float, seed: int) -> bool:
    """Whether a document is held out: decided by a hash of (seed, id) alone, so it is stable."""
    digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


class Spool:
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


def spool_corpus(data: DataConfig, workdir: str, skipped: SkippedFiles) -> dict[str, Spool]:
    source = SOURCES[data.source]
    spools = {split: Spool(os.path.join(workdir, f"{split}.jsonl")) for split in SPLITS}
    with writing(f"the spooled corpus in {workdir}"):
        with open(spools["train"].path, "wb") as train, open(spools["val"].path, "wb") as val:
            for doc_id, text in read_documents(data, skipped):
                held_out = is_validation(doc_id, data.val_fraction, data.seed)
                spools["val" if held_out else "train"].add(val if held_out else train, doc_id, text)
    total = sum(spool.documents for spool in spools.values())
    if total == 0:
        binary = f"; skipped {skipped}" if skipped.count else ""
        raise ConfigError(
            f"data.source={data.source}: the corpus is empty: no non-blank text in {source.describe(data)}{binary}"
        )
    for split, spool in spools.items():
        if spool.documents == 0:
            raise ConfigError(
                f"data.val_fraction={data.val_fraction}: the {split} split got none of the {total} document(s) "
                f"({source.describe(data)}); use more text{source.more_documents}, or another data.val_fraction or "
                "data.seed"
            )
    return spools
