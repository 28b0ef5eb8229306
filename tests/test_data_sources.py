"""`keel data` sources: jsonl, parquet, plain text cut into documents, the standard library, hub datasets; the
tokenizer fed bounded pieces; the validation split."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import types

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import keel.data.shard_writing
import keel.data.spooling
from keel.config import DataConfig, TextFilesConfig, load_config
from keel.data.preparation import prepare
from keel.data.sources import SOURCES, read_documents
from keel.data.sources.stdlib import STDLIB_EXCLUDED_DIRS
from keel.data.sources.text_files import cut_text
from keel.data.spooling import SPAN_CHARS, Spool, is_validation
from keel.data.tokenizer import EOS_TOKEN, PIECE_CHARS, tokenizer_pieces, train_tokenizer
from keel.errors import ConfigError
from keeltest.data import VAL_FRACTION, WORDS, config, expected_tokens


def test_jsonl_parquet_and_max_chars(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "a.jsonl").write_text('{"body": "first"}\n\n{"body": "second"}\n')
    pq.write_table(pa.table({"body": ["third", None, "fourth"]}), tmp_path / "b.parquet")
    cfg = config(
        tmp_path, f"data.text_files.paths=[{tmp_path}/*.jsonl,{tmp_path}/*.parquet]", "data.text_files.text_field=body"
    )
    docs = list(read_documents(cfg.data))
    assert docs == [
        (f"{tmp_path}/a.jsonl:1", "first"),
        (f"{tmp_path}/a.jsonl:3", "second"),
        (f"{tmp_path}/b.parquet:0", "third"),
        (f"{tmp_path}/b.parquet:2", "fourth"),
    ]
    cfg.data.max_chars = 8
    assert [text for _, text in read_documents(cfg.data)] == ["first", "sec"]
    cfg.data.text_files.text_field = "text"
    with pytest.raises(ConfigError, match="has no field 'text' \\(found: body\\)"):
        list(read_documents(cfg.data))


def test_cut_text_prefers_paragraph_ends_then_line_ends_then_whitespace():
    line = "word " * 19 + "word\n"  # 100 characters
    paragraph = line * 3 + "\n"  # 301 characters
    prose = paragraph * 40
    pieces = cut_text(prose, 1000)
    assert pieces == [paragraph * 3] * 13 + [paragraph]  # the paragraph end nearest to 1000 characters: 903
    assert cut_text(prose + line * 30, 1000)[: len(pieces) - 2] == pieces[:-2]  # appending changes only the last
    assert cut_text(prose.replace("\n\n", "\n \r\n"), 1000)[0].endswith("\n \r\n")  # blank = whitespace only
    lines = line * 35
    assert cut_text(lines, 1000) == [line * 10] * 3 + [line * 5]  # no paragraph end: at the nearest line end
    assert cut_text(lines, 0) == cut_text(lines, len(lines)) == [lines]
    # a line longer than 2 x doc_chars (a file with no line breaks) is cut where a run of whitespace begins ...
    long_line = "word " * 1000 + "\n"
    pieces = cut_text(long_line, 1000)
    assert "".join(pieces) == long_line and len(pieces) == 5
    assert pieces[0] == "word " * 199 + "word"  # 999: the space at 999 starts the next piece, nearest to 1000
    assert all(piece.startswith(" word") and 995 <= len(piece) <= 1005 for piece in pieces[1:-1])
    assert cut_text(long_line, 1000)[:3] == cut_text(long_line * 2, 1000)[:3]  # and still only by what precedes
    # ... and with no whitespace either, at doc_chars exactly; the last line end closes the last piece
    assert cut_text("x" * 5000 + "\n", 1000) == ["x" * 1000] * 4 + ["x" * 1000 + "\n"]


def test_big_plain_text_files_are_cut_but_source_files_are_not(tmp_path):
    text = ("word " * 19 + "word\n") * 35
    for name in ("big.txt", "big.md", "big.py", "small.txt"):
        (tmp_path / name).write_text(text[:300] if name == "small.txt" else text)
    cfg = config(tmp_path, f"data.text_files.paths=[{tmp_path}/*]", "data.text_files.doc_chars=1000")
    docs = dict(read_documents(cfg.data))
    cut = [f"{tmp_path}/big.{suffix}#{k}" for suffix in ("md", "txt") for k in range(4)]
    assert sorted(docs) == sorted([*cut, f"{tmp_path}/big.py", f"{tmp_path}/small.txt"])
    assert "".join(docs[f"{tmp_path}/big.txt#{k}"] for k in range(4)) == docs[f"{tmp_path}/big.py"] == text
    cfg.data.text_files.doc_chars = 0
    assert len(list(read_documents(cfg.data))) == 4
    with pytest.raises(ConfigError, match="data.text_files.doc_chars"):
        load_config(None, ["data.text_files.doc_chars=-1"])


def test_a_file_without_line_breaks_is_cut_into_documents_and_builds(tmp_path):
    """It used to stay one document, and a corpus of it alone was refused with advice that could not help (a smaller
    data.text_files.doc_chars: lines were never split)."""
    (tmp_path / "corpus").mkdir()
    text = " ".join(random.Random(4).choices(WORDS, k=40_000))  # ~240,000 characters, one line
    (tmp_path / "corpus" / "one_line.txt").write_text(text)
    cfg = config(tmp_path / "shards", corpus=tmp_path / "corpus")
    docs = dict(read_documents(cfg.data))
    assert "".join(docs.values()) == text and len(docs) == len(cut_text(text, TextFilesConfig.doc_chars)) > 50
    assert max(len(doc) for doc in docs.values()) <= 2 * TextFilesConfig.doc_chars
    manifest = prepare(cfg)
    assert manifest["documents"]["train"] + manifest["documents"]["val"] == len(docs)
    assert manifest["tokens"] == expected_tokens(tmp_path / "shards", docs, VAL_FRACTION)


def long_text(characters: int, seed: int = 3) -> str:
    """Words between every kind of whitespace run and punctuation, about `characters` long."""
    rng = random.Random(seed)
    separators = (" ", "  ", "\n", "\t", " \n ", ", ", ". ", "\r\n", "\n\n")
    words, length = [], 0
    while length < characters:
        words.append(rng.choice(WORDS) + rng.choice(separators))
        length += len(words[-1])
    return "".join(words)


def test_long_texts_reach_the_tokenizer_in_pieces_that_change_no_token(built):
    text = long_text(3 * PIECE_CHARS)
    pieces = tokenizer_pieces(text)
    assert "".join(pieces) == text and len(pieces) == 4
    assert all(len(piece) <= PIECE_CHARS for piece in pieces)
    assert all(piece[0].isspace() and not before[-1].isspace() for before, piece in zip(pieces, pieces[1:]))
    assert [len(piece) for piece in tokenizer_pieces("x" * 250_000)] == [PIECE_CHARS, PIECE_CHARS, 50_000]
    tokenizer = Tokenizer.from_file(str(built.dir / "tokenizer.json"))
    assert [i for piece in pieces for i in tokenizer.encode(piece).ids] == tokenizer.encode(text).ids
    # trained on in pieces, the same BPE as on the whole text
    whole = Tokenizer(models.BPE())
    whole.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    whole.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    assert train_tokenizer([text], 400).get_vocab() == whole.get_vocab()


def test_the_shard_encoder_gives_the_tokenizer_bounded_texts_and_the_ids_of_whole_documents(built, tmp_path):
    tokenizer = Tokenizer.from_file(str(built.dir / "tokenizer.json"))
    texts = [long_text(SPAN_CHARS + 3 * PIECE_CHARS // 2), "a short document", long_text(PIECE_CHARS // 2, seed=4)]
    spool = Spool(str(tmp_path / "train.jsonl"))
    with open(spool.path, "wb") as out:
        for number, text in enumerate(texts):
            spool.add(out, str(number), text)
    span = [document for documents in spool.spans(np.arange(len(texts))) for document in documents]  # all three
    calls = []

    class Recording:  # the tokenizer, and what it is given
        def encode_batch(self, batch, add_special_tokens):
            calls.append([len(text) for text in batch])
            return tokenizer.encode_batch(batch, add_special_tokens=add_special_tokens)

    ids = keel.data.shard_writing.SpanEncoder(Recording(), 0, np.dtype(np.uint16))((spool.path, span))
    assert ids.tolist() == [i for text in texts for i in [*tokenizer.encode(text).ids, 0]]  # EOS (0) after each
    assert max(max(call) for call in calls) <= PIECE_CHARS
    assert len(calls) == 2 and sum(calls[0]) >= SPAN_CHARS and sum(calls[0]) - calls[0][-1] < SPAN_CHARS


def test_stdlib_source_skips_test_suites_and_site_packages():
    cfg = load_config(None, ["data.max_chars=200000"])
    ids = [doc_id for doc_id, _ in read_documents(cfg.data)]
    assert ids and all(STDLIB_EXCLUDED_DIRS.isdisjoint(doc_id.split("/")[:-1]) for doc_id in ids)
    assert ids == [doc_id for doc_id, _ in read_documents(cfg.data)]  # a fixed order


def test_split_is_stable_and_close_to_val_fraction():
    ids = [f"doc{i}" for i in range(20000)]
    held_out = [is_validation(i, 0.1, seed=3) for i in ids]
    assert held_out == [is_validation(i, 0.1, seed=3) for i in ids]
    assert abs(sum(held_out) / len(ids) - 0.1) < 0.01
    assert held_out != [is_validation(i, 0.1, seed=4) for i in ids]


def test_hf_without_datasets_or_hub_is_refused_clearly(tmp_path, monkeypatch):
    cfg = load_config(None, ["data=fineweb_edu", f"data.dir={tmp_path}", "data.tokenizer=null"])
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"needs the `datasets` package: pip install"):
        prepare(cfg)

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=unreachable))
    with pytest.raises(ConfigError, match="data.hf.dataset: cannot stream 'HuggingFaceFW/fineweb-edu'.*Couldn't reach"):
        prepare(cfg)


def test_data_source_names_come_from_the_registry():
    """DataConfig accepts the sources the engine registers and refuses any other, naming them all (there is no
    fall-through to one of them); the common keys a source records in the manifest are data.* keys."""
    with pytest.raises(ConfigError, match="^data.source: unknown source 'nope'; allowed: " + ", ".join(SOURCES) + "$"):
        DataConfig(source="nope")
    keys = {field.name for field in dataclasses.fields(DataConfig)}
    for name, source in SOURCES.items():
        assert source.name == name and set(source.settings) <= keys
        assert DataConfig(source=name, text_files=TextFilesConfig(paths=["*.txt"])).source == name


def test_keel_data_imports_no_lightning():
    """`keel data` runs before every `make pretrain`, mostly to find nothing to do: it must not pay for importing
    Lightning (~2.7 s on the loaded 2-core dev machine), which only training's side, keel.data.loading, needs."""
    code = (
        "import sys, keel.cli, keel.data.preparation\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'lightning'))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
