"""What every data source is: its documents, a description, and the data.* keys that shape them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from keel.errors import ConfigError

# A plain-text file with a NUL, or with more than this share of its characters undecodable in data.encoding, is
# binary or in another encoding: skipped (counted, the first few paths reported) rather than trained on as U+FFFD soup.
MAX_UNDECODABLE = 0.01
SHOWN_SKIPPED = 5  # paths of skipped files printed and recorded in the manifest


class DataSettings(Protocol):
    """The data.* values the sources read: keel.config.DataConfig's, named by their shape, not imported (keel.config
    imports the source registry)."""

    source: str
    paths: list[str]
    text_field: str
    encoding: str
    hf_dataset: str
    hf_name: str | None
    hf_split: str
    max_chars: int
    doc_chars: int


@dataclass
class SkippedFiles:
    """Reads plain-text files in data.encoding, and keeps account of those left out as binary or undecodable."""

    encoding: str = "utf-8"
    count: int = 0
    first: list[str] = field(default_factory=list)  # the first SHOWN_SKIPPED of them

    def read_text(self, path: Path) -> str | None:
        """The file's text, or None (counted) when it holds a NUL or > MAX_UNDECODABLE undecodable bytes."""
        text = path.read_bytes().decode(self.encoding, errors="replace")
        # a NUL in the text, not in the bytes: a UTF-16 file's bytes hold NULs, its text none
        if "\0" in text or text.count("\ufffd") > MAX_UNDECODABLE * len(text):
            self.count += 1
            if len(self.first) < SHOWN_SKIPPED:
                self.first.append(str(path))
            return None
        return text

    def __str__(self) -> str:
        """e.g. "2 binary or non-utf-8 file(s): a.txt, b.bin" (with ", ... (7 more)" past SHOWN_SKIPPED)."""
        more = f", ... ({self.count - len(self.first)} more)" if self.count > len(self.first) else ""
        return f"{self.count} binary or non-{self.encoding} file(s): {', '.join(self.first)}{more}"


def text_of(record: Any, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        found = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"data.text_field: {where} has no field {text_field!r} (found: {found})")
    return str(record[text_field] or "")


class Source(ABC):
    """A kind of corpus, selected by `data.source=<name>`. Subclasses set `name` and `settings` and define
    `documents` and `describe`; registering an instance in keel.data.sources.SOURCES makes the name valid."""

    name: ClassVar[str]
    # data.* keys (beyond those common to every source) that change what it yields: recorded in the manifest,
    # and a re-run of `keel data` with other values rebuilds
    settings: ClassVar[tuple[str, ...]] = ()
    # how else the same text makes more documents, for the error on a split left empty (e.g. ", a smaller data.x")
    more_documents: ClassVar[str] = ""

    @abstractmethod
    def documents(self, data: DataSettings, skipped: SkippedFiles) -> Iterator[tuple[str, str]]:
        """(id, text) of each document, in a fixed order; the id alone decides its split, so it must be stable.
        Plain-text files are read through `skipped.read_text`, which decodes them in data.encoding and leaves out
        binary or undecodable ones."""

    @abstractmethod
    def describe(self, data: DataSettings) -> str:
        """What is read, in words: printed by `keel data` and recorded in the manifest."""
