"""What every data source is: its documents and a description, read from its section of the data config
(`data.<name>.*`, keel.config.data)."""

from __future__ import annotations

import codecs
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from keel.config import DataConfig
from keel.errors import ConfigError

# A plain-text file with a NUL, or with more than this share of its characters undecodable in data.encoding, is
# binary or in another encoding: skipped (counted, the first few paths reported) rather than trained on as U+FFFD soup.
MAX_UNDECODABLE = 0.01
SHOWN_SKIPPED = 5  # paths of skipped files printed and recorded in the manifest
READ_BYTES = 1 << 20  # files are read this much at a time: memory holds a chunk, not a file, whatever its size
BYTE_ORDER_MARKS = {
    "utf-16": (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE),
    "utf-32": (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE),
}


@dataclass
class SkippedFiles:
    """Reads plain-text files in data.encoding, and keeps account of those left out as binary or undecodable."""

    encoding: str = "utf-8"
    count: int = 0
    first: list[str] = field(default_factory=list)  # the first SHOWN_SKIPPED of them

    def read_chunks(self, path: Path) -> Iterator[str] | None:
        """The file's text in chunks of about READ_BYTES, or None (counted) when it holds a NUL or more than
        MAX_UNDECODABLE of its characters undecodable. That verdict takes a first pass over the whole file: the
        chunks are read a second time, so memory holds one of them, never the file."""
        characters = undecodable = 0
        for chunk in decoded_chunks(path, self.encoding):
            # a NUL in the text, not in the bytes: a UTF-16 file's bytes hold NULs, its text none
            if "\0" in chunk:
                break
            characters += len(chunk)
            undecodable += chunk.count("\ufffd")
        else:
            if undecodable <= MAX_UNDECODABLE * characters:
                return decoded_chunks(path, self.encoding)
        self.count += 1
        if len(self.first) < SHOWN_SKIPPED:
            self.first.append(str(path))
        return None

    def read_text(self, path: Path) -> str | None:
        """The whole text of read_chunks, or None."""
        chunks = self.read_chunks(path)
        return None if chunks is None else "".join(chunks)

    def __str__(self) -> str:
        """e.g. "2 binary or non-utf-8 file(s): a.txt, b.bin" (with ", ... (7 more)" past SHOWN_SKIPPED)."""
        more = f", ... ({self.count - len(self.first)} more)" if self.count > len(self.first) else ""
        return f"{self.count} binary or non-{self.encoding} file(s): {', '.join(self.first)}{more}"


def incremental_decoder(encoding: str, start: bytes, errors: str) -> codecs.IncrementalDecoder:
    """A decoder that reads a text a chunk at a time as bytes.decode(encoding, errors) reads it whole, given its first
    bytes: UTF-16 or UTF-32 without a byte-order mark in the machine's byte order (their own incremental decoders
    refuse it)."""
    name = codecs.lookup(encoding).name
    if name in BYTE_ORDER_MARKS and not start.startswith(BYTE_ORDER_MARKS[name]):
        name += "-le" if sys.byteorder == "little" else "-be"
    return codecs.getincrementaldecoder(name)(errors=errors)


def decoded_chunks(path: Path, encoding: str) -> Iterator[str]:
    """The file's text, READ_BYTES at a time, each undecodable byte read as U+FFFD: the characters of
    path.read_bytes().decode(encoding, errors="replace"), a character cut by a chunk included."""
    with open(path, "rb") as file:
        decoder = incremental_decoder(encoding, file.read(4), "replace")
        file.seek(0)
        while chunk := file.read(READ_BYTES):
            yield decoder.decode(chunk)
    yield decoder.decode(b"", final=True)


def text_of(record: Any, key: str, text_field: str, where: str) -> str:
    """record[text_field] as text; a ConfigError naming `key` (the source's text_field key) when it has none."""
    if not isinstance(record, dict) or text_field not in record:
        found = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"{key}: {where} has no field {text_field!r} (found: {found})")
    return str(record[text_field] or "")


class Source(ABC):
    """A kind of corpus, selected by `data.source=<name>`: its keys are the section keel.config.data.DataConfig
    has under that name. Subclasses set `name` and define `documents` and `describe`; keel.data.sources.SOURCES
    maps the name to an instance."""

    name: ClassVar[str]
    # data.* keys besides its own section's that change what it yields (its section's always do): recorded in the
    # manifest with those common to every source, and a re-run of `keel data` with other values rebuilds
    settings: ClassVar[tuple[str, ...]] = ()
    # how else the same text makes more documents, for the error on a split left empty (e.g. ", a smaller data.x")
    more_documents: ClassVar[str] = ""

    @abstractmethod
    def documents(self, data: DataConfig, skipped: SkippedFiles) -> Iterator[tuple[str, str]]:
        """(id, text) of each document, in a fixed order; the id alone decides its split, so it must be stable.
        Plain-text files are read through `skipped.read_text` (or `read_chunks`), which decodes them in data.encoding
        and leaves out binary or undecodable ones."""

    @abstractmethod
    def describe(self, data: DataConfig) -> str:
        """What is read, in words: printed by `keel data` and recorded in the manifest."""
