"""What every data source is: its documents, a description, and the data.* keys that shape them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from keel.errors import ConfigError

if TYPE_CHECKING:  # keel.config imports the source registry: no import of it here at run time
    from keel.config import DataConfig

# A plain-text file with a NUL byte, or with more than this share of its characters undecodable as UTF-8, is
# binary or in another encoding: skipped (counted, first path reported) rather than trained on as U+FFFD soup.
MAX_UNDECODABLE = 0.01


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
    def documents(self, data: DataConfig, skipped: SkippedFiles) -> Iterator[tuple[str, str]]:
        """(id, text) of each document, in a fixed order; the id alone decides its split, so it must be stable.
        Files left out as binary or not UTF-8 are counted in `skipped` (SkippedFiles.read_text does it)."""

    @abstractmethod
    def describe(self, data: DataConfig) -> str:
        """What is read, in words: printed by `keel data` and recorded in the manifest."""
