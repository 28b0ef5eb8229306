"""The registry of data sources: `data.source` names -> Source. Adding a source = its section in
keel.config.data.DataConfig (the name and its keys), and a module defining a Source subclass with its entry in
SOURCES below."""

from __future__ import annotations

from collections.abc import Iterator

from keel.config import DataConfig
from keel.data.sources.base import SkippedFiles, Source
from keel.data.sources.hf import HuggingFace
from keel.data.sources.stdlib import Stdlib
from keel.data.sources.text_files import TextFiles

SOURCES: dict[str, Source] = {
    source.name: source
    for source in (
        Stdlib(),
        TextFiles(),
        HuggingFace(),
    )
}


def read_documents(data: DataConfig, skipped: SkippedFiles | None = None) -> Iterator[tuple[str, str]]:
    """(id, text) of each non-blank document of data.source, stopping after data.max_chars characters (0 = all);
    plain-text files are decoded in data.encoding, and binary or undecodable ones left out and counted in `skipped`."""
    skipped = skipped if skipped is not None else SkippedFiles(data.encoding)
    remaining = data.max_chars or None
    for doc_id, text in SOURCES[data.source].documents(data, skipped):
        if not text.strip():
            continue
        if remaining is not None:
            text = text[:remaining]
            remaining -= len(text)
        yield doc_id, text
        if remaining == 0:
            return
