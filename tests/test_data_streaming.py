"""`keel data` reads files a chunk at a time (#34): a plain-text file or a .jsonl record of a gigabyte costs no
more memory than one of a few megabytes, and gives the documents it gave when it was read whole."""

from __future__ import annotations

import io
import json
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import keel.data.sources.base
import keel.data.sources.json_stream
import keel.data.sources.text_files
from keel.config import Config, load_config
from keel.data.preparation import prepare
from keel.data.sources import read_documents
from keel.data.sources.base import SkippedFiles
from keel.data.sources.json_stream import LongRecord
from keel.data.sources.text_files import LONG_LINE_BYTES, cut_chunks, cut_text
from keel.errors import ConfigError

# every kind of character the cutter and the JSON decoder treat apart: line ends, blank lines, whitespace runs,
# characters json escapes (quotes, backslashes, control characters), and non-ASCII, astral (a surrogate pair) too
PARTS = ["word", "deep", " ", "  ", "\n", "\n\n", " \n\n", "\t", "\r\n", '"', "\\", "\x01", "/", "é", "深い", "🚀"]


def random_text(rng: random.Random, parts: int) -> str:
    return "".join(rng.choices(PARTS, k=parts))


def in_chunks(text: str, rng: random.Random, longest: int) -> Iterator[str]:
    """`text` cut at random places into chunks of 1 to `longest` items."""
    start = 0
    while start < len(text):
        size = rng.randint(1, longest)
        yield text[start : start + size]
        start += size


def overrides_for(data_dir: Path, *overrides: str) -> list[str]:
    return [
        "data=text_files",
        f"data.dir={data_dir}",
        "data.vocab_size=300",
        "data.val_fraction=0.2",
        "model.seq_len=32",
        "model.vocab_size=300",
        *overrides,
    ]


def config(tmp_path: Path, *overrides: str) -> Config:
    return load_config(None, overrides_for(tmp_path / "shards", *overrides))


def test_the_streaming_cutter_finds_the_pieces_of_the_whole_text():
    rng = random.Random(0)
    for _ in range(2000):
        text, doc_chars = random_text(rng, rng.randint(0, 300)), rng.choice([0, 1, 2, 3, 7, 20, 100])
        assert list(cut_chunks(in_chunks(text, rng, 40), doc_chars)) == cut_text(text, doc_chars), (text, doc_chars)


def test_a_long_record_is_decoded_as_json_loads_decodes_it_whatever_the_chunks(monkeypatch):
    """Escapes (a surrogate pair's two among them) cut anywhere by the chunks, keys before and after the text field,
    nested values holding strings that look like JSON, ASCII-escaped or not, in UTF-8 or latin-1."""
    rng = random.Random(1)
    for _ in range(1500):
        monkeypatch.setattr(keel.data.sources.json_stream, "READ_BYTES", rng.randint(1, 16))
        encoding = rng.choice(["utf-8", "latin-1"])
        text = random_text(rng, rng.randint(0, 40))
        if encoding == "latin-1":
            text = text.encode("latin-1", errors="ignore").decode("latin-1")
        record = {"before": [1, -2.5e-3, {"k": '"}', "n": None}, True, "\\u"], "text": text, "after": {}}
        if rng.random() < 0.3:
            record = {"text": None if rng.random() < 0.2 else text}
        line = (json.dumps(record, ensure_ascii=rng.random() < 0.5) + rng.choice(["", "\n", " \n"])).encode(encoding)
        file = io.BytesIO(line)
        pieces = LongRecord(file.readline(rng.randint(1, 30)), file, encoding, "f line 1")
        assert "".join(pieces.text_pieces("text")) == (record["text"] or ""), line


def test_files_read_in_chunks_give_the_documents_they_gave_read_whole(tmp_path, monkeypatch):
    """Tiny chunks and a tiny long-line threshold, so that every path is taken: a .jsonl file's short lines are
    records as before, its long ones are cut like plain text (path:line#k, or path:line when one piece is all)."""
    monkeypatch.setattr(keel.data.sources.base, "READ_BYTES", 7)
    monkeypatch.setattr(keel.data.sources.json_stream, "READ_BYTES", 5)
    monkeypatch.setattr(keel.data.sources.text_files, "LONG_LINE_BYTES", 64)
    rng = random.Random(2)
    long_text, plain = random_text(rng, 400), random_text(rng, 600)
    records = [
        {"text": "short"},
        {"text": long_text, "meta": 1},
        {"meta": "x" * 100, "text": "short too"},
        {"text": None, "meta": "y" * 100},
    ]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(record) for record in records).replace("\n", "\n\n", 1))
    (tmp_path / "p.txt").write_text(plain, encoding="utf-8", newline="")
    (tmp_path / "p.py").write_text(plain, encoding="utf-8", newline="")
    cfg = config(tmp_path, f"data.text_files.paths=[{tmp_path}/r.jsonl,{tmp_path}/p.*]", "data.text_files.doc_chars=50")
    docs = list(read_documents(cfg.data))
    jsonl, txt, py = f"{tmp_path}/r.jsonl", f"{tmp_path}/p.txt", f"{tmp_path}/p.py"
    expected = [
        (f"{jsonl}:1", "short"),
        *((f"{jsonl}:3#{k}", piece) for k, piece in enumerate(cut_text(long_text, 50))),
        (f"{jsonl}:4", "short too"),
        (py, plain),
        *((f"{txt}#{k}", piece) for k, piece in enumerate(cut_text(plain, 50))),
    ]
    assert docs == [(doc_id, text) for doc_id, text in expected if text.strip()]


def test_chunked_decoding_finds_what_whole_decoding_found(tmp_path, monkeypatch):
    """The same text, undecodable bytes (U+FFFD) and verdict on binary files, whatever the chunks cut."""
    monkeypatch.setattr(keel.data.sources.base, "READ_BYTES", 3)
    rng = random.Random(3)
    for k in range(200):
        path = tmp_path / f"{k}.txt"
        text = random_text(rng, 50).replace("\x01", "")
        raw = bytearray(text.encode(rng.choice(["utf-8", "utf-16", "utf-16-be", "utf-32"])))
        for _ in range(rng.choice([0, 0, 1, 5])):  # a few bytes broken: sometimes under 1%, sometimes over
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        path.write_bytes(bytes(raw))
        for encoding in ("utf-8", "utf-16", "utf-32"):
            whole = bytes(raw).decode(encoding, errors="replace")
            keep = "\0" not in whole and whole.count("\ufffd") <= 0.01 * len(whole)
            assert SkippedFiles(encoding).read_text(path) == (whole if keep else None)


@pytest.mark.parametrize(
    "record, message",
    [
        (b'{"text": "a\\x"}', "is not utf-8 JSON (Invalid \\escape at character 11)"),
        (b'{"text": "a\x01"}', "is not utf-8 JSON (Invalid control character at character 11)"),
        (b'{"text": "a', "is not utf-8 JSON (Unterminated string starting at character 9)"),
        (b'{"text": "\xff"}', "is not utf-8 JSON (b'\\xff': invalid start byte at byte 10)"),
        (b'{"text": "a" "b"}', "is not utf-8 JSON (expected '}', found '\"' at character 13)"),
        (b'{"meta": [1,,2], "text": "a"}', "is not utf-8 JSON (expected a JSON value, found ',' at character 12)"),
        (b'{"text": "a"} {}', "is not utf-8 JSON (expected the end of the line, found '{' at character 14)"),
        (b'{"meta": 1, "body": "a"}', "has no field 'text' (found: meta, body)"),
        (b'["text", "a"]', "has no field 'text' (it is not a JSON object)"),
        (b'{"text": "a", "text": "b"}', "has field 'text' twice"),
        (b'{"text": ["a"]}', ": 'text' is not a string or null"),
    ],
)
def test_a_malformed_long_record_is_refused_naming_its_path_and_line(tmp_path, monkeypatch, record, message):
    monkeypatch.setattr(keel.data.sources.text_files, "LONG_LINE_BYTES", 8)
    monkeypatch.setattr(keel.data.sources.json_stream, "READ_BYTES", 3)
    (tmp_path / "r.jsonl").write_bytes(b'{"text": "fine"}\n' + record)
    key = "data.text_files.paths" if "is not utf-8 JSON" in message else "data.text_files.text_field"
    with pytest.raises(ConfigError, match=f"^{re.escape(f'{key}: {tmp_path}/r.jsonl line 2')} ?{re.escape(message)}"):
        list(read_documents(config(tmp_path, f"data.text_files.paths=[{tmp_path}/r.jsonl]").data))


def words_text(megabytes: float, seed: int = 0) -> str:
    """Lines of words, non-ASCII among them, in paragraphs: about `megabytes` of UTF-8."""
    rng = random.Random(seed)
    words = "keel highway residual norm layer depth the of and to model naïve café Δx → 深い 🚀".split()
    paragraph = "\n".join(" ".join(rng.choices(words, k=12)) for _ in range(rng.randint(1, 8))) + "\n\n"
    return paragraph * int(megabytes * 1e6 / len(paragraph.encode()))


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A given tokenizer that encodes fast (a word is a token, every one unknown): the tests below are about reading."""
    tokenizer = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_a_multi_megabyte_line_and_plain_file_build_into_the_documents_read_whole(tmp_path, word_tokenizer):
    """Files a few chunks long, at the real thresholds: the record's line is past LONG_LINE_BYTES, so it is cut
    like the plain-text file (it was one document, read whole); the file gives the pieces it gave read whole."""
    record, plain = words_text(5, seed=1), words_text(5, seed=2)
    line = json.dumps({"id": 7, "text": record}, ensure_ascii=False).encode() + b"\n"
    assert len(line) > LONG_LINE_BYTES
    (tmp_path / "r.jsonl").write_bytes(line + b'{"text": "short"}\n')
    (tmp_path / "p.txt").write_text(plain, encoding="utf-8")
    cfg = config(
        tmp_path, f"data.text_files.paths=[{tmp_path}/r.jsonl,{tmp_path}/p.txt]", f"data.tokenizer={word_tokenizer}"
    )
    docs = list(read_documents(cfg.data))
    jsonl, txt = f"{tmp_path}/r.jsonl", f"{tmp_path}/p.txt"
    doc_chars = cfg.data.text_files.doc_chars
    record_pieces, plain_pieces = cut_text(record, doc_chars), cut_text(plain, doc_chars)
    assert docs == [
        *((f"{jsonl}:1#{k}", piece) for k, piece in enumerate(record_pieces)),
        (f"{jsonl}:2", "short"),
        *((f"{txt}#{k}", piece) for k, piece in enumerate(plain_pieces)),
    ]
    assert max(map(len, record_pieces)) <= 2 * doc_chars and "".join(record_pieces) == record
    manifest = prepare(cfg)
    assert sum(manifest["documents"].values()) == len(docs)
    assert sum(manifest["chars"].values()) == len(record) + len("short") + len(plain)


# Peak RSS of `keel data` and of its shard writers: VmHWM of its own process (ru_maxrss would count the forking
# pytest's memory), and ru_maxrss of its children (forks of it, not of pytest)
DATA_PEAK = """
import re, resource, sys
from keel import cli
code = cli.main(["data", *sys.argv[1:]])
own = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1])
print(own * 1024, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr)
sys.exit(code)
"""


def test_the_peak_memory_of_keel_data_does_not_grow_with_a_single_line_record(tmp_path, word_tokenizer):
    """A 1 GB single-line record peaked at 3.5 GB when its line was read whole (its bytes, its text, and copies of
    them downstream): now 20 MB costs what 5 MB costs. Read whole (before), 20 MB peaked 128 MB higher than 5 MB."""
    peaks = []
    for megabytes in (5, 20):
        path = tmp_path / f"r{megabytes}.jsonl"
        path.write_text(json.dumps({"text": words_text(megabytes)}, ensure_ascii=False) + "\n", encoding="utf-8")
        overrides = overrides_for(
            tmp_path / f"shards{megabytes}", f"data.text_files.paths=[{path}]", f"data.tokenizer={word_tokenizer}"
        )
        done = subprocess.run(
            [sys.executable, "-c", DATA_PEAK, *overrides], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        peaks.append([int(peak) for peak in done.stderr.split()[-2:]])
    (own_small, writers_small), (own_large, writers_large) = peaks
    assert own_large <= own_small + 25 * 2**20 and writers_large <= writers_small + 25 * 2**20, peaks
