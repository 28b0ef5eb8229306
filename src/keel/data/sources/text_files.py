"""data.source=text_files: files matched by the data.text_files.paths globs; .jsonl and .parquet records are
documents, plain-text files are cut into documents of about data.text_files.doc_chars characters (source files stay
whole), and so is a .jsonl record too long to read whole. Files are read a chunk at a time: no document is ever held
whole but a .py file, a .parquet row, a .jsonl record under LONG_LINE_BYTES, or anything with
data.text_files.doc_chars=0."""

from __future__ import annotations

import codecs
import glob
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from keel.config import DataConfig
from keel.data.sources.base import SkippedFiles, Source, text_of
from keel.data.sources.json_stream import LongRecord
from keel.errors import ConfigError

PLAIN_TEXT_SUFFIXES = frozenset({".txt", ".md", ".py", ".rst", ".text", ""})
# Source files stay whole documents whatever data.text_files.doc_chars says: a module is code's natural unit (its
# imports and definitions are the context of the rest), a code corpus comes as many files anyway, and text_files
# then reads .py files exactly as the stdlib source does.
WHOLE_FILE_SUFFIXES = frozenset({".py"})
PARAGRAPH_END = re.compile(r"\n(?:[^\S\n]*\n)+")  # a line end followed by blank lines (spaces, \r allowed in them)
WHITESPACE_START = re.compile(r"(?<=\S)\s")  # where a run of whitespace begins
# A .jsonl line whose first this many bytes hold no line end is read as a stream (LongRecord) and its record cut
# like a plain-text file: json.loads would hold it several times over (bytes, text, copies downstream).
LONG_LINE_BYTES = 4 << 20


def matched_files(patterns: list[str]) -> list[str]:
    """The files the data.text_files.paths globs match, each once, in glob order; a ConfigError names any glob
    matching none."""
    files: dict[str, None] = {}  # an ordered set: a file matched by two globs is read once
    unmatched = []
    for pattern in patterns:
        matched = [p for p in sorted(glob.glob(os.path.expanduser(pattern), recursive=True)) if os.path.isfile(p)]
        if not matched:
            unmatched.append(pattern)
        files.update(dict.fromkeys(matched))
    if unmatched:
        raise ConfigError(
            f"data.text_files.paths: no files match {', '.join(repr(p) for p in unmatched)} (relative to "
            f"{os.getcwd()}); "
            "fix or drop the glob"
        )
    return list(files)


def _jsonl_documents(path: str, data: DataConfig) -> Iterator[tuple[str, str]]:
    utf8 = codecs.lookup(data.encoding).name == "utf-8"
    with open(path, "rb") as lines:
        for number in itertools.count(1):
            if not (line := lines.readline(LONG_LINE_BYTES)):
                return
            where = f"{path} line {number}"
            if len(line) == LONG_LINE_BYTES and not line.endswith(b"\n"):
                pieces = LongRecord(line, lines, data.encoding, where).text_pieces(data.text_files.text_field)
                del line  # the record holds it only until it has been read
                yield from numbered(f"{path}:{number}", cut_chunks(pieces, data.text_files.doc_chars))
                continue
            if not line.strip():
                continue
            try:  # json reads UTF-8 bytes itself, a byte-order mark too; a decoding error is a ValueError
                record = json.loads(line if utf8 else line.decode(data.encoding))
            except ValueError as err:
                raise ConfigError(
                    f"data.text_files.paths: {where} is not {data.encoding} JSON ({err}); "
                    "another encoding is read with data.encoding=CODEC"
                ) from None
            yield f"{path}:{number}", text_of(record, "data.text_files.text_field", data.text_files.text_field, where)


def _parquet_documents(path: str, text_field: str) -> Iterator[tuple[str, str]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        found = ", ".join(parquet.schema_arrow.names)
        raise ConfigError(f"data.text_files.text_field: {path} has no column {text_field!r} (found: {found})")
    row = 0
    for batch in parquet.iter_batches(columns=[text_field]):
        for text in batch.column(0).to_pylist():
            yield f"{path}:{row}", text or ""
            row += 1


def cut_text(text: str, doc_chars: int) -> list[str]:
    """`text` in consecutive pieces of about doc_chars characters (the whole text when it is no longer; 0 = never
    cut), which join back into it. Each cut aims at doc_chars past the previous one: at the paragraph end (a line
    end before blank lines) nearest to that point when one lies within a quarter of doc_chars of it, else at the
    nearest line end when one lies within doc_chars of it; in a line longer than that, at the start of the run of
    whitespace nearest to it within a quarter of doc_chars, else at the point itself. So no piece is longer than
    2 x doc_chars, whatever the lines. The cuts depend on the text and doc_chars alone, and each only on the text up
    to 2 x doc_chars past the previous one: appending to a text changes none but its last pieces, and cut_chunks
    finds the same pieces in a text given a chunk at a time."""
    return list(cut_chunks([text], doc_chars))


def cut_chunks(chunks: Iterable[str], doc_chars: int) -> Iterator[str]:
    """cut_text of the text the chunks join into, each piece yielded once the text up to 2 x doc_chars past its
    start has come: memory holds that much and a chunk, not the text (but all of it with doc_chars=0)."""
    if not doc_chars:
        yield "".join(chunks)
        return
    text, start = "", 0
    for chunk in chunks:
        text, start = text[start:] + chunk, 0
        while len(text) - start > 2 * doc_chars:  # _next_cut reads no further than start + 2 x doc_chars
            cut = _next_cut(text, start, doc_chars)
            yield text[start:cut]
            start = cut
    while len(text) - start > doc_chars and (cut := _next_cut(text, start, doc_chars)) < len(text):
        yield text[start:cut]  # (a cut at the end, after the last line end, leaves the rest one piece)
        start = cut
    yield text[start:]


def numbered(doc_id: str, pieces: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(id, piece) of a text's pieces: `doc_id` for an uncut text, so that its split does not depend on
    data.text_files.doc_chars; `doc_id#k` for the k-th piece, from 0, of a cut one."""
    first, second = next(pieces), next(pieces, None)
    if second is None:
        yield doc_id, first
    else:
        for number, piece in enumerate(itertools.chain((first, second), pieces)):
            yield f"{doc_id}#{number}", piece


def _next_cut(text: str, start: int, doc_chars: int) -> int:
    """Where cut_text ends the piece that begins at `start`."""
    target, slack = start + doc_chars, doc_chars // 4

    def nearest(ends: list[int]) -> int:
        return min(ends, key=lambda end: abs(end - target))

    if paragraph_ends := [match.end() for match in PARAGRAPH_END.finditer(text, target - slack, target + slack)]:
        return nearest(paragraph_ends)
    # every search is bounded by ~doc_chars: a line of a hundred megabytes is cut many times
    before, after = text.rfind("\n", start, target) + 1, text.find("\n", target, target + doc_chars) + 1
    if line_ends := [end for end in (before, after) if end > start]:
        return nearest(line_ends)
    spaces = [match.start() for match in WHITESPACE_START.finditer(text, target - slack, target + slack + 1)]
    return nearest(spaces or [target])


def _plain_text_documents(path: str, doc_chars: int, skipped: SkippedFiles) -> Iterator[tuple[str, str]]:
    if (chunks := skipped.read_chunks(Path(path))) is None:
        return
    yield from numbered(path, cut_chunks(chunks, 0 if Path(path).suffix.lower() in WHOLE_FILE_SUFFIXES else doc_chars))


class TextFiles(Source):
    name = "text_files"
    settings = ("encoding",)
    more_documents = ", a smaller data.text_files.doc_chars"

    def documents(self, data: DataConfig, skipped: SkippedFiles) -> Iterator[tuple[str, str]]:
        for path in matched_files(data.text_files.paths):
            suffix = Path(path).suffix.lower()
            if suffix == ".jsonl":
                yield from _jsonl_documents(path, data)
            elif suffix == ".parquet":
                yield from _parquet_documents(path, data.text_files.text_field)
            elif suffix in PLAIN_TEXT_SUFFIXES:
                yield from _plain_text_documents(path, data.text_files.doc_chars, skipped)
            else:
                plain = ", ".join(sorted(s for s in PLAIN_TEXT_SUFFIXES if s))
                raise ConfigError(
                    f"data.text_files.paths: {path}: unsupported file type {suffix!r}; use .jsonl, .parquet or {plain}"
                )

    def describe(self, data: DataConfig) -> str:
        options, whole = data.text_files, "/".join(sorted(WHOLE_FILE_SUFFIXES))
        plain = (
            f"other plain-text files cut into documents of about {options.doc_chars:,} characters"
            if options.doc_chars
            else "other plain-text files whole"
        )
        return (
            f"files matching {', '.join(options.paths)} (field {options.text_field!r} of .jsonl / .parquet, "
            f"{whole} files whole, {plain})"
        )
