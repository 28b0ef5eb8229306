"""`keel data`: what a build writes (tokenizer, shards, val docs, manifest), reruns and forced rebuilds, the
settings and inputs it refuses, damaged input and shards."""

from __future__ import annotations

import json
import random
import re

import pytest
from tokenizers import Tokenizer

from keel import cli
from keel.config import TextFilesConfig
from keel.data.loading import open_dataset
from keel.data.preparation import prepare
from keel.data.sources import read_documents
from keel.data.spooling import is_validation
from keel.data.tokenizer import EOS_TOKEN, train_tokenizer
from keel.errors import ConfigError
from keeltest.data import (
    DOCUMENTS,
    LATIN1_TEXT,
    VAL_FRACTION,
    chunk_tokens,
    config,
    copy_of,
    expected_tokens,
    write_corpus,
)


def test_build_writes_tokenizer_shards_val_docs_and_manifest(built):
    for name in ("tokenizer.json", "manifest.json", "val_docs.jsonl", "train/index.json", "val/index.json"):
        assert (built.dir / name).is_file(), name
    manifest = json.loads((built.dir / "manifest.json").read_text())
    assert manifest == built.manifest
    assert manifest["source"]["kind"] == "text_files"
    assert manifest["eos_id"] == 0 and manifest["eos_token"] == EOS_TOKEN
    assert manifest["keel_version"] and manifest["created"]
    expected_val = {path for path in built.texts if is_validation(path, VAL_FRACTION, 0)}
    assert manifest["documents"] == {"train": DOCUMENTS - len(expected_val), "val": len(expected_val)}
    val_docs = [json.loads(line) for line in (built.dir / "val_docs.jsonl").read_text().splitlines()]
    assert {doc["id"] for doc in val_docs} == expected_val
    assert all(doc["text"] == built.texts[doc["id"]] for doc in val_docs)


def test_token_counts_add_up(built):
    expected = expected_tokens(built.dir, built.texts, VAL_FRACTION)
    for split in ("train", "val"):
        assert built.manifest["tokens"][split] == expected[split] == chunk_tokens(built.dir, split)


def test_tokenizer_round_trips_text(built):
    tokenizer = Tokenizer.from_file(str(built.dir / "tokenizer.json"))
    assert tokenizer.token_to_id(EOS_TOKEN) == 0
    assert tokenizer.get_vocab_size() == built.manifest["vocab_size"] <= 300
    for text in [*list(built.texts.values())[:3], "def f(x):\n\treturn x ** 2  # never seen: ÆØÅ ∑ 😀\r\n"]:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_rerun_is_a_no_op(built, capsys):
    before = {path: path.stat().st_mtime_ns for path in built.dir.rglob("*")}
    assert prepare(built.cfg) == built.manifest
    assert "up to date" in capsys.readouterr().out
    assert {path: path.stat().st_mtime_ns for path in built.dir.rglob("*")} == before


def test_shards_built_with_another_tokenizer_are_refused(built, tmp_path):
    with pytest.raises(ConfigError, match=r"another tokenizer \(data.vocab_size: 300 -> 320\).*--force"):
        prepare(config(built.dir, "data.vocab_size=320", corpus=built.root / "corpus"))
    other = tmp_path / "other.json"
    train_tokenizer(["some other text"], 260).save(str(other))
    with pytest.raises(ConfigError, match="another tokenizer.*--force"):
        prepare(config(built.dir, f"data.tokenizer={other}", corpus=built.root / "corpus"))


def test_shards_built_with_another_doc_chars_are_refused(built):
    changed = rf"other data settings \(data.text_files.doc_chars: {TextFilesConfig.doc_chars} -> 100\)"
    with pytest.raises(ConfigError, match=changed):
        prepare(config(built.dir, "data.text_files.doc_chars=100", corpus=built.root / "corpus"))


def test_force_rebuilds_with_the_new_settings(built, tmp_path, capsys):
    cfg = copy_of(built, tmp_path, "data.vocab_size=280")
    overrides = [
        "data=text_files",
        f"data.text_files.paths=[{built.root}/corpus/*.txt]",
        f"data.dir={cfg.data.dir}",
        "data.vocab_size=280",
        f"data.val_fraction={VAL_FRACTION}",
        "model.seq_len=32",
    ]
    assert cli.main(["data", *overrides]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli.main(["data", "--force", *overrides]) == 0
    assert open_dataset(cfg).vocab_size == 280


def test_given_tokenizer_file_is_used_verbatim(built, tmp_path):
    tokenizer = built.dir / "tokenizer.json"
    cfg = config(
        tmp_path / "shards", f"data.tokenizer={tokenizer}", "data.vocab_size=999", corpus=built.root / "corpus"
    )
    manifest = prepare(cfg)
    assert (tmp_path / "shards" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    assert manifest["tokenizer_sha256"] == built.manifest["tokenizer_sha256"]
    assert manifest["tokens"] == built.manifest["tokens"] and "vocab_size" not in manifest["settings"]
    assert open_dataset(cfg).eos_id == 0


def test_truncated_tokenizer_file_is_refused_naming_it(built, tmp_path, capsys):
    truncated = tmp_path / "tokenizer.json"
    whole = (built.dir / "tokenizer.json").read_text()
    truncated.write_text(whole[: len(whole) // 2])  # a copy cut short (between characters: JSON's fault, not UTF-8's)
    out = tmp_path / "shards"
    assert (
        cli.main(
            [
                "data",
                "data=text_files",
                f"data.text_files.paths=[{built.root}/corpus/*.txt]",
                f"data.dir={out}",
                f"data.val_fraction={VAL_FRACTION}",
                f"data.tokenizer={truncated}",
            ]
        )
        == 2
    )  # was a bare Exception
    [said] = capsys.readouterr().err.splitlines()
    assert said.startswith(
        f"keel data: config error: data.tokenizer: {truncated} is not a tokenizer.json the "
        "tokenizers library can read (EOF while parsing"
    )  # serde's reason, with its position
    assert said.endswith("); give a complete tokenizer.json, or null to train a BPE on the corpus")
    assert not out.exists()


def test_empty_glob_is_refused_naming_it(tmp_path, capsys):
    write_corpus(tmp_path / "corpus")
    glob_ = f"{tmp_path}/nothing/*.txt"
    paths = f"data.text_files.paths=[{tmp_path}/corpus/*.txt,{glob_}]"
    assert cli.main(["data", "data=text_files", paths, f"data.dir={tmp_path}/out"]) == 2
    err = capsys.readouterr().err
    assert glob_ in err and "no files match" in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_blank_corpus_is_refused(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(" \n\n")
    with pytest.raises(ConfigError, match="corpus is empty"):
        prepare(config(tmp_path / "out", corpus=tmp_path / "corpus"))


def test_split_without_documents_is_refused(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("a single document, shorter than data.text_files.doc_chars\n")
    # which split the one document lands in depends on its path's hash; the other one is empty either way
    empty = r"the (train|val) split got none of the 1 document\(s\).*a smaller data.text_files.doc_chars"
    with pytest.raises(ConfigError, match=empty):
        prepare(config(tmp_path / "out", corpus=tmp_path / "corpus"))


def test_split_shorter_than_one_sequence_is_refused(built):
    with pytest.raises(ConfigError, match=r"val: its \d+ tokens make no sequence of model.seq_len \+ 1 = 20001"):
        prepare(config(built.dir, "model.seq_len=20000", corpus=built.root / "corpus"))


def test_binary_and_non_utf8_files_are_skipped_and_named(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    (corpus / "random.txt").write_bytes(random.Random(1).randbytes(20_000))
    (corpus / "latin1.txt").write_bytes(LATIN1_TEXT.encode("latin-1"))
    (corpus / "nul.txt").write_bytes(b"text with a NUL\0 byte\n" * 50)
    manifest = prepare(config(tmp_path / "shards", corpus=corpus))
    skipped = [str(corpus / name) for name in ("latin1.txt", "nul.txt", "random.txt")]  # in glob order
    assert (
        f"keel data: skipped 3 binary or non-utf-8 file(s): {', '.join(skipped)} (a NUL, or more than 1% of the "
        "characters undecodable); files in another encoding are read with data.encoding=CODEC (e.g. latin-1, "
        "cp1252)\n"
    ) in capsys.readouterr().out
    assert manifest["skipped_files"] == {"binary_or_undecodable": 3, "first": skipped}
    assert manifest["documents"]["train"] + manifest["documents"]["val"] == DOCUMENTS
    val_text = (tmp_path / "shards" / "val_docs.jsonl").read_text()
    assert "\ufffd" not in val_text

    only_binary = tmp_path / "binary"
    only_binary.mkdir()
    for k in range(7):
        (only_binary / f"{k}.txt").write_bytes(random.Random(k).randbytes(5_000))
    shown = ", ".join(str(only_binary / f"{k}.txt") for k in range(5))
    with pytest.raises(
        ConfigError,
        match=re.escape(f"corpus is empty: no non-blank text in files matching {only_binary}/*.txt")
        + ".*"
        + re.escape(f"; skipped 7 binary or non-utf-8 file(s): {shown}, ... (2 more)"),
    ):
        prepare(config(tmp_path / "shards2", corpus=only_binary))


def test_data_encoding_decodes_the_corpus_and_is_a_build_setting(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    texts = write_corpus(corpus)
    (corpus / "latin1.txt").write_bytes(LATIN1_TEXT.encode("latin-1"))
    (tmp_path / "records.jsonl").write_bytes(
        json.dumps({"text": "crème brûlée"}, ensure_ascii=False).encode("latin-1") + b"\n"
    )
    cfg = config(
        tmp_path / "shards", "data.encoding=LATIN-1", f"data.text_files.paths=[{corpus}/latin1.txt,{tmp_path}/*.jsonl]"
    )
    assert dict(read_documents(cfg.data)) == {
        str(corpus / "latin1.txt"): LATIN1_TEXT,
        f"{tmp_path}/records.jsonl:1": "crème brûlée",
    }
    cfg = config(tmp_path / "shards", "data.encoding=latin-1", corpus=corpus)
    manifest = prepare(cfg)  # one encoding for every file: write_corpus's UTF-8 ones decode too, into mojibake
    assert manifest["skipped_files"]["binary_or_undecodable"] == 0  # (latin-1 maps every byte to a character)
    assert manifest["settings"]["encoding"] == "iso8859-1"  # the codec's own name: any spelling of it matches
    held_out = [json.loads(line) for line in (tmp_path / "shards" / "val_docs.jsonl").read_text().splitlines()]
    assert held_out
    for doc in held_out:
        expected = LATIN1_TEXT if doc["id"].endswith("latin1.txt") else texts[doc["id"]].encode().decode("latin-1")
        assert doc["text"] == expected
    assert prepare(config(tmp_path / "shards", "data.encoding=iso-8859-1", corpus=corpus)) == manifest
    with pytest.raises(ConfigError, match=r"other data settings \(data.encoding: 'iso8859-1' -> 'utf-8'\)"):
        prepare(config(tmp_path / "shards", corpus=corpus))
    for wrong in ("no-such-codec", "base64"):  # unknown, or a codec that is not a text encoding
        with pytest.raises(ConfigError, match=rf"data.encoding: '{wrong}' is not a text codec Python knows"):
            config(tmp_path / "shards", f"data.encoding={wrong}")


def test_truncated_or_corrupt_shard_is_refused_at_start_up(built, tmp_path):
    cfg = copy_of(built, tmp_path)
    chunk = next((tmp_path / "shards" / "train").glob("chunk-*.bin"))
    original = chunk.read_bytes()
    chunk.write_bytes(original[:-100])
    with pytest.raises(ConfigError, match=r"train/chunk-.*\.bin is truncated or missing \(.* of its .* bytes\)"):
        open_dataset(cfg)
    chunk.write_bytes(original[:-2] + bytes([original[-2] ^ 1, original[-1]]))
    with pytest.raises(ConfigError, match=r"is corrupt \(its sha256 is not the one in manifest.json\): rebuild"):
        open_dataset(cfg)
    open_dataset(config(tmp_path / "shards", "data.verify_checksums=false"))  # sizes only: the flip goes unseen
    chunk.unlink()
    with pytest.raises(ConfigError, match=r"truncated or missing \(missing\)"):
        open_dataset(cfg)
