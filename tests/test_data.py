"""keel data: shards, manifest and refusals; open_dataset's checks; the loaders' exact resume across epochs."""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from litdata.streaming.writer import BinaryWriter
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import keel.data.shard_writing
import keel.data.spooling
from keel import cli
from keel.config import Config, DataConfig, load_config
from keel.data.loading import KeelDataModule, open_dataset, token_loader
from keel.data.preparation import DataDirLock, prepare
from keel.data.spooling import SPAN_CHARS, Spool, is_validation
from keel.data.shards import MANIFEST, PUBLISHING, STAGING, TOKENIZER
from keel.data.sources import SOURCES, read_documents
from keel.data.sources.stdlib import STDLIB_EXCLUDED_DIRS
from keel.data.sources.text_files import cut_text
from keel.data.tokenizer import EOS_TOKEN, PIECE_CHARS, tokenizer_pieces, train_tokenizer
from keel.dirlock import LOCK
from keel.errors import ConfigError

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"  # ../shared/data from the repo root
WORDS = ("keel highway residual norm layer depth gradient the of and to model train token shard loader "
         "naïve café Δx → 深い 🚀").split()
DOCUMENTS = 40
LATIN1_TEXT = "déjà vu, voilà, café crème " * 100  # one document
VAL_FRACTION = 0.2


def write_corpus(folder: Path) -> dict[str, str]:
    """DOCUMENTS plain-text files of random words; {path: text}."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    texts = {}
    for i in range(DOCUMENTS):
        path = folder / f"doc{i:02d}.txt"
        text = "\n".join(" ".join(rng.choices(WORDS, k=15)) for _ in range(20)) + "\n"
        path.write_text(text, encoding="utf-8")
        texts[str(path)] = text
    return texts


def overrides_for(data_dir: Path, *overrides: str, corpus: Path | None = None) -> list[str]:
    corpus_glob = f"{corpus}/*.txt" if corpus else "unused"
    return [
        "data=text_files", f"data.paths=[{corpus_glob}]", f"data.dir={data_dir}", "data.vocab_size=300",
        f"data.val_fraction={VAL_FRACTION}", "data.prepare_workers=2", "model.seq_len=32", "model.vocab_size=300",
        "trainer.micro_batch_size=4", *overrides,
    ]


def config(data_dir: Path, *overrides: str, corpus: Path | None = None) -> Config:
    return load_config(None, overrides_for(data_dir, *overrides, corpus=corpus))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    """One build of a 40-document corpus, shared by the tests that only read it."""
    root = tmp_path_factory.mktemp("built")
    texts = write_corpus(root / "corpus")
    cfg = config(root / "shards", corpus=root / "corpus")
    return types.SimpleNamespace(root=root, dir=root / "shards", cfg=cfg, texts=texts, manifest=prepare(cfg))


def expected_tokens(data_dir: Path, texts: dict[str, str], val_fraction: float) -> dict[str, int]:
    """Per split: the tokens of its documents {id: text}, encoded one by one, plus one EOS each."""
    tokenizer = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    tokens = {"train": 0, "val": 0}
    for doc_id, text in texts.items():
        tokens["val" if is_validation(doc_id, val_fraction, 0) else "train"] += len(tokenizer.encode(text).ids) + 1
    return tokens


def chunk_tokens(data_dir: Path, split: str) -> int:
    return sum(chunk["dim"] for chunk in json.loads((data_dir / split / "index.json").read_text())["chunks"])


def copy_of(built: types.SimpleNamespace, tmp_path: Path, *overrides: str) -> Config:
    shutil.copytree(built.dir, tmp_path / "shards")
    return config(tmp_path / "shards", *overrides, corpus=built.root / "corpus")


# ------------------------------------------------------------------------------------------------------- building


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
    with pytest.raises(ConfigError, match=rf"other data settings \(data.doc_chars: {DataConfig.doc_chars} -> 100\)"):
        prepare(config(built.dir, "data.doc_chars=100", corpus=built.root / "corpus"))


def test_force_rebuilds_with_the_new_settings(built, tmp_path, capsys):
    cfg = copy_of(built, tmp_path, "data.vocab_size=280")
    overrides = ["data=text_files", f"data.paths=[{built.root}/corpus/*.txt]", f"data.dir={cfg.data.dir}",
                 "data.vocab_size=280", f"data.val_fraction={VAL_FRACTION}", "model.seq_len=32"]
    assert cli.main(["data", *overrides]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli.main(["data", "--force", *overrides]) == 0
    assert open_dataset(cfg).vocab_size == 280


def test_given_tokenizer_file_is_used_verbatim(built, tmp_path):
    tokenizer = built.dir / "tokenizer.json"
    cfg = config(tmp_path / "shards", f"data.tokenizer={tokenizer}", "data.vocab_size=999",
                 corpus=built.root / "corpus")
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
    assert cli.main(["data", "data=text_files", f"data.paths=[{built.root}/corpus/*.txt]", f"data.dir={out}",
                     f"data.val_fraction={VAL_FRACTION}", f"data.tokenizer={truncated}"]) == 2  # was a bare Exception
    [said] = capsys.readouterr().err.splitlines()
    assert said.startswith(f"keel data: config error: data.tokenizer: {truncated} is not a tokenizer.json the "
                           "tokenizers library can read (EOF while parsing")  # serde's reason, with its position
    assert said.endswith("); give a complete tokenizer.json, or null to train a BPE on the corpus")
    assert not out.exists()


def test_empty_glob_is_refused_naming_it(tmp_path, capsys):
    write_corpus(tmp_path / "corpus")
    glob_ = f"{tmp_path}/nothing/*.txt"
    paths = f"data.paths=[{tmp_path}/corpus/*.txt,{glob_}]"
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
    (tmp_path / "corpus" / "a.txt").write_text("a single document, shorter than data.doc_chars\n")
    # which split the one document lands in depends on its path's hash; the other one is empty either way
    with pytest.raises(ConfigError, match=r"the (train|val) split got none of the 1 document\(s\).*a smaller data.doc_chars"):
        prepare(config(tmp_path / "out", corpus=tmp_path / "corpus"))


def test_split_shorter_than_one_sequence_is_refused(built):
    with pytest.raises(ConfigError, match=r"val: its \d+ tokens make no sequence of model.seq_len \+ 1 = 20001"):
        prepare(config(built.dir, "model.seq_len=20000", corpus=built.root / "corpus"))


# ------------------------------------------------------------------------------------------------ reading sources


def test_jsonl_parquet_and_max_chars(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "a.jsonl").write_text('{"body": "first"}\n\n{"body": "second"}\n')
    pq.write_table(pa.table({"body": ["third", None, "fourth"]}), tmp_path / "b.parquet")
    cfg = config(tmp_path, f"data.paths=[{tmp_path}/*.jsonl,{tmp_path}/*.parquet]", "data.text_field=body")
    docs = list(read_documents(cfg.data))
    assert docs == [(f"{tmp_path}/a.jsonl:1", "first"), (f"{tmp_path}/a.jsonl:3", "second"),
                    (f"{tmp_path}/b.parquet:0", "third"), (f"{tmp_path}/b.parquet:2", "fourth")]
    cfg.data.max_chars = 8
    assert [text for _, text in read_documents(cfg.data)] == ["first", "sec"]
    cfg.data.text_field = "text"
    with pytest.raises(ConfigError, match="has no field 'text' \\(found: body\\)"):
        list(read_documents(cfg.data))


def test_cut_text_prefers_paragraph_ends_then_line_ends_then_whitespace():
    line = "word " * 19 + "word\n"  # 100 characters
    paragraph = line * 3 + "\n"  # 301 characters
    prose = paragraph * 40
    pieces = cut_text(prose, 1000)
    assert pieces == [paragraph * 3] * 13 + [paragraph]  # the paragraph end nearest to 1000 characters: 903
    assert cut_text(prose + line * 30, 1000)[:len(pieces) - 2] == pieces[:-2]  # appending changes only the last
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
    cfg = config(tmp_path, f"data.paths=[{tmp_path}/*]", "data.doc_chars=1000")
    docs = dict(read_documents(cfg.data))
    cut = [f"{tmp_path}/big.{suffix}#{k}" for suffix in ("md", "txt") for k in range(4)]
    assert sorted(docs) == sorted([*cut, f"{tmp_path}/big.py", f"{tmp_path}/small.txt"])
    assert "".join(docs[f"{tmp_path}/big.txt#{k}"] for k in range(4)) == docs[f"{tmp_path}/big.py"] == text
    cfg.data.doc_chars = 0
    assert len(list(read_documents(cfg.data))) == 4
    with pytest.raises(ConfigError, match="data.doc_chars"):
        load_config(None, ["data.doc_chars=-1"])


def test_a_file_without_line_breaks_is_cut_into_documents_and_builds(tmp_path):
    """It used to stay one document, and a corpus of it alone was refused with advice that could not help (a smaller
    data.doc_chars: lines were never split)."""
    (tmp_path / "corpus").mkdir()
    text = " ".join(random.Random(4).choices(WORDS, k=40_000))  # ~240,000 characters, one line
    (tmp_path / "corpus" / "one_line.txt").write_text(text)
    cfg = config(tmp_path / "shards", corpus=tmp_path / "corpus")
    docs = dict(read_documents(cfg.data))
    assert "".join(docs.values()) == text and len(docs) == len(cut_text(text, DataConfig.doc_chars)) > 50
    assert max(len(doc) for doc in docs.values()) <= 2 * DataConfig.doc_chars
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
    whole.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
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
    with pytest.raises(ConfigError, match="data.hf_dataset: cannot stream 'HuggingFaceFW/fineweb-edu'.*Couldn't reach"):
        prepare(cfg)


def test_data_source_names_come_from_the_registry():
    """DataConfig accepts the registered sources and refuses any other, naming them all (there is no fall-through
    to one of them); the keys a source records in the manifest are data.* keys."""
    with pytest.raises(ConfigError, match="^data.source: unknown source 'nope'; allowed: " + ", ".join(SOURCES) + "$"):
        DataConfig(source="nope")
    keys = {field.name for field in dataclasses.fields(DataConfig)}
    for name, source in SOURCES.items():
        assert source.name == name and set(source.settings) <= keys
        assert DataConfig(source=name, paths=["*.txt"]).source == name


def test_keel_data_imports_no_lightning():
    """`keel data` runs before every `make pretrain`, mostly to find nothing to do: it must not pay for importing
    Lightning (~2.7 s on the loaded 2-core dev machine), which only training's side, keel.data.loading, needs."""
    code = ("import sys, keel.cli, keel.data.preparation\n"
            "print(sorted(name for name in sys.modules if name.split('.')[0] == 'lightning'))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


# --------------------------------------------------------------------------------------------------- open_dataset


def test_missing_dir_points_to_keel_data(tmp_path):
    with pytest.raises(ConfigError, match=r"no shards at .*nowhere: run `keel data` \(or `make data`\) with the same"):
        open_dataset(config(tmp_path / "nowhere"))


def test_corrupt_manifest_is_refused(built, tmp_path):
    cfg = copy_of(built, tmp_path)
    (tmp_path / "shards" / "manifest.json").write_text('{"settings": {}}')
    with pytest.raises(ConfigError, match="manifest.json is corrupt.*--force"):
        open_dataset(cfg)


def test_vocab_smaller_than_tokenizer_is_refused(built):
    size = built.manifest["vocab_size"]
    with pytest.raises(ConfigError, match=f"model.vocab_size=100 is smaller than the tokenizer's {size} tokens"):
        open_dataset(config(built.dir, "model.vocab_size=100"))


def test_another_given_tokenizer_is_refused(built, tmp_path):
    other = tmp_path / "other.json"
    train_tokenizer(["some other text"], 260).save(str(other))
    with pytest.raises(ConfigError, match="is not the tokenizer the shards .* were built with"):
        open_dataset(config(built.dir, f"data.tokenizer={other}"))
    with pytest.raises(ConfigError, match="is not the tokenizer"):
        open_dataset(config(built.dir, "data.tokenizer=gpt2"))  # compared by name: no network needed


def test_open_dataset_describes_the_shards(built):
    info = open_dataset(built.cfg)
    assert (info.vocab_size, info.eos_id) == (built.manifest["vocab_size"], 0)
    assert Tokenizer.from_str(info.tokenizer_json).get_vocab_size() == info.vocab_size
    assert Path(info.tokenizer_path).read_text() == info.tokenizer_json


# ------------------------------------------------------------------------------------------------------- loading


def test_batches_are_int64_sequences_and_validation_is_fixed(built):
    batch = next(iter(token_loader(built.cfg, "train", shuffle=True)))
    assert batch.dtype == torch.int64 and batch.shape == (4, 33)
    assert 0 <= batch.min() and batch.max() < built.manifest["vocab_size"]
    val = token_loader(built.cfg, "val", shuffle=False)
    first, second = list(val), list(val)
    assert len(first) == len(val) > 0 and all(torch.equal(a, b) for a, b in zip(first, second))


def lightning_style(loader, batches: int) -> list[torch.Tensor]:
    """Batches as Lightning draws them: len(loader) per epoch, then a new iter() (the iterator is never exhausted)."""
    out: list[torch.Tensor] = []
    while len(out) < batches:
        out += itertools.islice(iter(loader), min(len(loader), batches - len(out)))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resume_is_exact(built, tmp_path, workers):
    """Stop after k batches, save the train loader's state (what Lightning's fit loop checkpoints), resume a fresh
    loader: the batches continue exactly, mid-epoch, at an epoch's end and in the second epoch, and later epochs
    do not replay the resumed one."""
    cfg = config(built.dir, f"data.loader_workers={workers}", "trainer.micro_batch_size=16")
    epoch = len(token_loader(cfg, "train", shuffle=True))
    total = 2 * epoch + 5
    reference = lightning_style(KeelDataModule(cfg).train_dataloader(), total)
    assert not torch.equal(reference[0], reference[epoch])  # each epoch is reshuffled
    for k in (7, epoch, epoch + 3):
        interrupted = KeelDataModule(cfg).train_dataloader()
        lightning_style(interrupted, k)
        torch.save(interrupted.state_dict(), tmp_path / "state.pt")

        resumed = KeelDataModule(cfg).train_dataloader()
        resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
        rest = lightning_style(resumed, total - k)
        assert all(torch.equal(a, b) for a, b in zip(rest, reference[k:], strict=True)), f"resume after {k} batches"


def test_trainer_resume_is_exact_and_cycles_epochs(built, tmp_path):
    """The same through Lightning: checkpoints from ModelCheckpoint, `fit(ckpt_path=...)`, max_steps > one epoch."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    cfg = config(built.dir, "trainer.micro_batch_size=16")
    epoch = len(token_loader(cfg, "train", shuffle=True))
    steps = 2 * epoch + 5

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))
            self.seen: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch.clone())
            return self.weight * batch.float().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(max_steps: int, ckpt_path: str | None = None, every: int | None = None) -> list[torch.Tensor]:
        model = Recorder()
        callbacks = []
        if every:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=every, save_top_k=-1))
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, callbacks=callbacks,
                            enable_checkpointing=bool(every), enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0)
        trainer.fit(model, datamodule=KeelDataModule(cfg), ckpt_path=ckpt_path)
        return model.seen

    reference = fit(steps)
    assert len(reference) == steps
    for k in (10, epoch):
        first = fit(k, every=k)
        rest = fit(steps, str(tmp_path / f"step={k}.ckpt"))
        assert all(torch.equal(a, b) for a, b in zip(first + rest, reference, strict=True)), f"resume at step {k}"


# ------------------------------------------------------------------------------------------- real corpora (shared)


def shared(relative: str) -> Path:
    path = SHARED_DATA / relative
    if not path.is_file():
        pytest.skip(f"{path} is absent (the shared corpora live in ../shared/data next to the repo)")
    return path


def test_shared_jsonl_corpus_builds_and_loads(tmp_path):
    questions = shared("gsm8k/train.jsonl")
    cfg = config(tmp_path / "gsm8k", f"data.paths=[{questions}]", "data.text_field=question",
                 "data.max_chars=300000", "data.val_fraction=0.05", "data.vocab_size=512", "model.vocab_size=512")
    manifest = prepare(cfg)
    assert sum(manifest["chars"].values()) == 300000
    assert manifest["documents"]["val"] > 0 and manifest["tokens"]["train"] > 50000
    assert next(iter(token_loader(cfg, "val", shuffle=False))).shape == (4, 33)


def test_single_big_plain_text_file_builds(tmp_path, capsys):
    """tinyshakespeare's one 1.1 MB file, with the default data.doc_chars and data.val_fraction: cut into documents
    that join back into it, split by their ids, and every token accounted for."""
    shakespeare = shared("tinyshakespeare/input.txt")
    val_fraction = DataConfig.val_fraction
    cfg = config(tmp_path / "out", f"data.paths=[{shakespeare}]", f"data.val_fraction={val_fraction}")
    texts = dict(read_documents(cfg.data))
    assert list(texts) == [f"{shakespeare}#{k}" for k in range(len(texts))]
    assert "".join(texts.values()) == shakespeare.read_text(encoding="utf-8")
    manifest = prepare(cfg)
    val = sum(is_validation(doc_id, val_fraction, 0) for doc_id in texts)
    assert manifest["documents"] == {"train": len(texts) - val, "val": val} and val > 0
    expected = expected_tokens(tmp_path / "out", texts, val_fraction)
    for split in ("train", "val"):
        assert manifest["tokens"][split] == expected[split] == chunk_tokens(tmp_path / "out", split) > 0
    assert prepare(cfg) == manifest and "up to date" in capsys.readouterr().out
    with capsys.disabled():
        print(f"\ntinyshakespeare: {manifest['documents']} documents, {manifest['tokens']} tokens")


@pytest.mark.slow
def test_default_stdlib_corpus(tmp_path):
    cfg = load_config(None, [f"data.dir={tmp_path}/stdlib"])
    start = time.perf_counter()
    manifest = prepare(cfg)
    print(f"stdlib corpus: {manifest['documents']}, {manifest['tokens']} tokens in {time.perf_counter() - start:.1f} s")
    assert manifest["tokens"]["train"] > 1_000_000 and manifest["vocab_size"] == cfg.data.vocab_size
    assert open_dataset(cfg).eos_id == 0


# ------------------------------------------------------------------------------ are training batches a random sample?

ALPHABETS = ("abcdef", "ghijkl", "mnopqr", "stuvwx")  # one per source: a token's characters name its source
BATCH = 8
BATCHES_DRAWN = 300


@pytest.fixture(scope="module")
def sourced_corpus(tmp_path_factory) -> Path:
    """200 short documents (~300 characters) from each of len(ALPHABETS) sources, in source order on disk."""
    folder = tmp_path_factory.mktemp("sources")
    rng = random.Random(0)
    for source, alphabet in enumerate(ALPHABETS):
        for doc in range(200):
            words = ("".join(rng.choices(alphabet, k=rng.randint(2, 7))) for _ in range(60))
            (folder / f"s{source}_{doc:03d}.txt").write_text(" ".join(words) + "\n")
    return folder


def sequence_sources(batch: torch.Tensor, token_source: torch.Tensor) -> torch.Tensor:
    """The source of each sequence in a (B, T + 1) batch: the one most of its tokens come from."""
    counts = torch.stack([(token_source[batch] == s).sum(1) for s in range(len(ALPHABETS))], 1)  # (B, sources)
    return counts.argmax(1)


def dispersion_p_value(cfg: Config, batches: int) -> float:
    """Pearson's chi-square of the sources' counts in `batches` consecutive training batches against the counts
    uniform sampling from the whole training split gives: a small p-value = batches are not a random sample."""
    from scipy import stats

    tokenizer = Tokenizer.from_file(str(Path(cfg.data.dir) / "tokenizer.json"))
    token_source = torch.full((tokenizer.get_vocab_size(),), -1)
    for token in range(tokenizer.get_vocab_size()):
        chars = set(tokenizer.decode([token]).strip())
        owners = [s for s, alphabet in enumerate(ALPHABETS) if chars and chars <= set(alphabet)]
        if len(owners) == 1:
            token_source[token] = owners[0]
    share = torch.bincount(torch.cat([sequence_sources(b, token_source) for b in token_loader(cfg, "train", False)]),
                           minlength=len(ALPHABETS)).double()
    expected = BATCH * share / share.sum()
    loader = KeelDataModule(cfg).train_dataloader()
    observed = torch.stack([torch.bincount(sequence_sources(b, token_source), minlength=len(ALPHABETS))
                            for b in itertools.islice(loader, batches)]).double()  # (batches, sources)
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    return stats.chi2.sf(chi2, batches * (len(ALPHABETS) - 1))


@pytest.mark.parametrize("shuffle_documents, shuffle_window, random_sample", [
    (True, 0, True),  # the defaults
    (False, 256, False),  # before: corpus order on disk and litdata's default window
    (False, 0, False),  # full permutation alone: each chunk still holds one stretch of the corpus
])
def test_training_batches_are_a_uniform_sample(sourced_corpus, tmp_path, monkeypatch, shuffle_documents,
                                               shuffle_window, random_sample):
    # ~200 documents a chunk (as with litdata's default chunk size on a real corpus, not one chunk in all)
    monkeypatch.setattr(keel.data.spooling, "SPAN_CHARS", 60_000)
    monkeypatch.chdir(sourced_corpus)  # relative ids: the split, hence every figure here, is the same on each run
    cfg = config(tmp_path / "shards", f"data.shuffle_documents={shuffle_documents}",
                 f"data.shuffle_window={shuffle_window}", "data.doc_chars=0", "data.chunk_bytes=16KB",
                 "data.val_fraction=0.05", f"trainer.micro_batch_size={BATCH}", "data.paths=['*.txt']")
    prepare(cfg)
    chunks = json.loads((tmp_path / "shards" / "train" / "index.json").read_text())["chunks"]
    assert len(chunks) >= 4
    p_value = dispersion_p_value(cfg, BATCHES_DRAWN)
    assert (p_value > 1e-3) if random_sample else (p_value < 1e-6), p_value


def test_each_epoch_is_a_new_permutation(built):
    cfg = built.cfg
    loader = KeelDataModule(cfg).train_dataloader()
    epochs = [[tuple(sequence.tolist()) for batch in loader for sequence in batch] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]


def test_resume_refuses_other_shards_or_read_shuffle(tiny_data, tmp_path):
    """A checkpoint's loader position refers to the shards and the read-time shuffle it was saved with."""
    from conftest import QUIET_TRAINER, TINY_MODEL

    from keel.training import train

    shards = tmp_path / "shards"
    shutil.copytree(next(o.split("=", 1)[1] for o in tiny_data if o.startswith("data.dir=")), shards)

    def run(*overrides: str) -> None:
        train(load_config(overrides=[*TINY_MODEL, *QUIET_TRAINER, *tiny_data, f"data.dir={shards}",
                                     "eval.enabled=false", f"run.dir={tmp_path / 'run'}", "trainer.max_steps=2",
                                     *overrides]))

    run()
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=r"with data.shuffle_window=0; this config has 256"):
        run("trainer.max_steps=4", "data.shuffle_window=256")

    checkpoint = torch.load(last, weights_only=True)
    older = {**checkpoint, "KeelDataModule": {}}  # as written before keel recorded the shards' identity
    torch.save(older, last)
    with pytest.raises(ConfigError, match="built before `keel data` shuffled documents"):
        run("trainer.max_steps=4")

    torch.save(checkpoint, last)
    manifest = json.loads((shards / "manifest.json").read_text())
    (shards / "manifest.json").write_text(json.dumps({**manifest, "created": "rebuilt"}))
    with pytest.raises(ConfigError, match="are not the ones .* was trained on"):
        run("trainer.max_steps=4")


# ----------------------------------------------------------------------------------------------- object storage


@pytest.fixture
def s3_bucket(monkeypatch, tmp_path) -> str:
    """An S3-compatible server (moto) on the loopback interface, over plain http like a typical MinIO, with one
    bucket; the standard AWS environment points at it. Returns the bucket's URL."""
    threaded = pytest.importorskip("moto.moto_server.threaded_moto_server",
                                   reason="moto[server] is not installed (pip install -e '.[test]')")
    import boto3

    server = threaded.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    try:
        server.start()
    except Exception as err:  # noqa: BLE001 - any failure to listen on loopback means: cannot test here
        pytest.skip(f"cannot start a loopback S3 server: {err}")
    host, port = server.get_host_and_port()
    nowhere = str(tmp_path / "none")  # no AWS config or credentials file of the machine's user
    for key, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
                       "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_CONFIG_FILE": nowhere, "AWS_SHARED_CREDENTIALS_FILE": nowhere}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    boto3.client("s3").create_bucket(Bucket="keel-shards")
    yield "s3://keel-shards"
    server.stop()


def test_s3_data_dir_builds_and_trains_like_a_local_one(s3_bucket, corpus_dir, tmp_path):
    """`keel data` writes shards, tokenizer and manifest to s3://, and training streams them through litdata's
    cache: the losses equal those of the same build on local disk."""
    import boto3
    from conftest import QUIET_TRAINER, TINY_MODEL

    from keel.training import train
    from test_pretrain import scalars

    source = ["data=text_files", f"data.paths=[{corpus_dir}/*.py]", "data.vocab_size=512", "data.prepare_workers=1",
              "data.val_fraction=0.1"]
    losses = {}
    for where, data_dir in (("local", str(tmp_path / "shards")), ("s3", f"{s3_bucket}/tiny")):
        overrides = [*TINY_MODEL, *QUIET_TRAINER, *source, f"data.dir={data_dir}",
                     f"data.cache_dir={tmp_path / 'cache'}", "eval.enabled=false", "trainer.max_steps=3",
                     f"run.dir={tmp_path / where}"]
        prepare(load_config(overrides=overrides))
        train(load_config(overrides=overrides))
        losses[where] = scalars(tmp_path / where, "train/loss")
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="keel-shards")["Contents"]}
    assert {"tiny/manifest.json", "tiny/tokenizer.json", "tiny/train/index.json", "tiny/val_docs.jsonl"} <= keys
    assert not [key for key in keys if key.startswith(f"tiny/{STAGING}/")]  # the staged build was moved into place
    assert any(path.suffix == ".bin" for path in (tmp_path / "cache").rglob("*"))  # chunks streamed, then cached
    assert len(losses["s3"]) == 3 and losses["s3"] == losses["local"]
    with pytest.raises(ConfigError, match=r"bucket 'no-such-bucket' cannot be found at http://127.0.0.1"):
        prepare(load_config(overrides=[*source, "data.dir=s3://no-such-bucket/tiny"]))


# ------------------------------------------------------------------------------------------ damaged input and shards


def test_binary_and_non_utf8_files_are_skipped_and_named(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    (corpus / "random.txt").write_bytes(random.Random(1).randbytes(20_000))
    (corpus / "latin1.txt").write_bytes(LATIN1_TEXT.encode("latin-1"))
    (corpus / "nul.txt").write_bytes(b"text with a NUL\0 byte\n" * 50)
    manifest = prepare(config(tmp_path / "shards", corpus=corpus))
    skipped = [str(corpus / name) for name in ("latin1.txt", "nul.txt", "random.txt")]  # in glob order
    assert (f"keel data: skipped 3 binary or non-utf-8 file(s): {', '.join(skipped)} (a NUL, or more than 1% of the "
            "characters undecodable); files in another encoding are read with data.encoding=CODEC (e.g. latin-1, "
            "cp1252)\n") in capsys.readouterr().out
    assert manifest["skipped_files"] == {"binary_or_undecodable": 3, "first": skipped}
    assert manifest["documents"]["train"] + manifest["documents"]["val"] == DOCUMENTS
    val_text = (tmp_path / "shards" / "val_docs.jsonl").read_text()
    assert "\ufffd" not in val_text

    only_binary = tmp_path / "binary"
    only_binary.mkdir()
    for k in range(7):
        (only_binary / f"{k}.txt").write_bytes(random.Random(k).randbytes(5_000))
    shown = ", ".join(str(only_binary / f"{k}.txt") for k in range(5))
    with pytest.raises(ConfigError, match=re.escape(f"corpus is empty: no non-blank text in files matching "
                                                    f"{only_binary}/*.txt") + ".*" + re.escape(
            f"; skipped 7 binary or non-utf-8 file(s): {shown}, ... (2 more)")):
        prepare(config(tmp_path / "shards2", corpus=only_binary))


def test_data_encoding_decodes_the_corpus_and_is_a_build_setting(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    texts = write_corpus(corpus)
    (corpus / "latin1.txt").write_bytes(LATIN1_TEXT.encode("latin-1"))
    (tmp_path / "records.jsonl").write_bytes(json.dumps({"text": "crème brûlée"}, ensure_ascii=False)
                                             .encode("latin-1") + b"\n")
    cfg = config(tmp_path / "shards", "data.encoding=LATIN-1", f"data.paths=[{corpus}/latin1.txt,{tmp_path}/*.jsonl]")
    assert dict(read_documents(cfg.data)) == {str(corpus / "latin1.txt"): LATIN1_TEXT,
                                              f"{tmp_path}/records.jsonl:1": "crème brûlée"}
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


# ------------------------------------------------------------------ full disks, Ctrl-C, two builds at once (#26)


def files_of(data_dir: Path) -> dict[str, bytes]:
    """A build's files by relative path (the lock file aside: it records who builds)."""
    return {str(path.relative_to(data_dir)): path.read_bytes() for path in sorted(data_dir.rglob("*"))
            if path.is_file() and path.name != LOCK}


def full_disk(self, raw_data, filename, compress=None):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def killed(self, span):  # as the out-of-memory killer would
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("failure, said", [
    ((BinaryWriter, "write_chunk_to_file", full_disk), "no space left on the device writing the shards in {shards}/"
     ".keel-build/train: free space or choose another data.dir / TMPDIR"),
    ((keel.data.shard_writing.SpanEncoder, "__call__", killed), "the train shard writer (worker 0 of 1) was killed by "
     "SIGKILL (the kernel's out-of-memory killer sends it: use fewer data.prepare_workers, or more memory) before it "
     "was done"),
])
def test_a_shard_writer_that_fails_or_dies_stops_the_build_and_keeps_the_earlier_one(
        built, tmp_path, monkeypatch, capsys, failure, said):
    """The forked writers inherit the failure patched in here. litdata's optimize() hung when a worker failed after
    its last input (its main process joined a worker that was joining its own idle child), and a full disk read as a
    bare OSError."""
    shards = tmp_path / "shards"
    shutil.copytree(built.dir, shards)
    before = files_of(shards)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(*failure)
    assert cli.main(["data", "--force", *overrides_for(shards, corpus=built.root / "corpus")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"keel data: config error: {said.format(shards=shards)}"]
    assert files_of(shards) == before  # the earlier build, complete
    assert not (shards / STAGING).exists() and not list((tmp_path / "tmp").iterdir())  # no staging, no spool


FORKS_MAY_WRITE_4KB = """
import os, resource, sys
from keel import cli
os.register_at_fork(after_in_child=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)))
sys.exit(cli.main(["data", *sys.argv[1:]]))
"""
KEEL_DATA = "import sys\nfrom keel import cli\nsys.exit(cli.main(['data', *sys.argv[1:]]))"


def write_at_most(size: int):
    """A subprocess's preexec_fn: files of at most `size` bytes (past it a write fails with EFBIG, SIGXFSZ ignored)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return limit


def test_writes_that_run_out_of_room_fail_in_one_line_without_hanging(built, tmp_path):
    """Real failing writes, in real processes: a file size limit (RLIMIT_FSIZE) in the shard writers alone (keel
    data itself ignores SIGXFSZ, and they inherit that), then in the whole process, where the spool is written
    first. Either way: status 2, one line naming what was being written, nothing left behind, well before the
    timeout (the shard writers' case hung before)."""
    shards, tmp = tmp_path / "shards", tmp_path / "tmp"
    tmp.mkdir()
    environment = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    overrides = overrides_for(shards, corpus=built.root / "corpus")
    cases = [
        (FORKS_MAY_WRITE_4KB, None, re.escape(f"the file is too large (past a file size limit or the file system's) writing the shards in {shards}/.keel-build/train: ")),
        (KEEL_DATA, write_at_most(16_384), re.escape(f"the file is too large (past a file size limit or the file system's) writing the spooled corpus in {tmp}/keel-data-")
         + r"\S+: "),
    ]
    for driver, preexec_fn, what in cases:
        done = subprocess.run([sys.executable, "-c", driver, *overrides], env=environment, preexec_fn=preexec_fn,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert re.fullmatch(f"keel data: config error: {what}raise the file size limit \\(ulimit -f\\) or choose "
                            "another data.dir / TMPDIR", done.stderr.splitlines()[-1])
        assert not shards.exists() and not list(tmp.iterdir())  # the data.dir it made removed, lock file and all


def interrupt_when(process: subprocess.Popen, line_starts: str) -> float:
    """Ctrl-C, as a terminal sends it (SIGINT to the whole process group), once `process` has printed a line
    starting with `line_starts`; the time it was sent."""
    for line in process.stdout:
        if line.startswith(line_starts):
            break
    else:
        pytest.fail(f"keel data ended without printing {line_starts!r}: {process.communicate()[1]}")
    time.sleep(1)  # well into what the line announces
    os.killpg(process.pid, signal.SIGINT)
    return time.monotonic()


SLOW_SHARD_WRITERS = """
import sys, time
from keel import cli
from keel.data import shard_writing
encode = shard_writing.SpanEncoder.__call__
def encode_slowly(self, span):  # holds the forked shard writers at work, to be interrupted there
    time.sleep(600)
    return encode(self, span)
shard_writing.SpanEncoder.__call__ = encode_slowly
sys.exit(cli.main(["data", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("stage", ["BPE training", "shard writing"])
def test_ctrl_c_stops_keel_data_at_once_removing_the_unfinished_build(built, tmp_path, stage):
    """Exit status 130 and one line, within seconds; the earlier build intact, no staging, no spool, no worker left.
    Before, Ctrl-C waited for the BPE training to end (a Rust call holds Python's signal handling off), and while
    shards were written litdata's handler called os._exit(0): status 0, no word, a build without a manifest."""
    shards, tmp = tmp_path / "shards", tmp_path / "tmp"
    shutil.copytree(built.dir, shards)
    before = files_of(shards)
    tmp.mkdir()
    environment = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
    if stage == "BPE training":  # ~3 MB of 200,000 distinct words: about 20 s to train 250,000 tokens on one thread
        rng = random.Random(5)
        (tmp_path / "words").mkdir()
        for number in range(20):
            (tmp_path / "words" / f"{number}.txt").write_text("\n".join(
                " ".join("".join(rng.choices(string.ascii_lowercase, k=16)) for _ in range(100)) for _ in range(100)))
        driver, overrides = KEEL_DATA, overrides_for(shards, "data.vocab_size=250000", corpus=tmp_path / "words")
        announced = "keel data: training a"
    else:
        driver, overrides = SLOW_SHARD_WRITERS, overrides_for(shards, corpus=built.root / "corpus")
        announced = "keel data: encoding the train split"
    # SIGINT as a terminal leaves it: the test suite run as a background job of a script starts with it ignored,
    # which the child would inherit (and Python then installs no KeyboardInterrupt handler)
    process = subprocess.Popen([sys.executable, "-c", driver, "--force", *overrides], env=environment,
                               start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        sent = interrupt_when(process, announced)
        stderr = process.communicate(timeout=60)[1]
        stopped_in = time.monotonic() - sent
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, stderr
    assert stderr.splitlines()[-1] == (f"keel data: interrupted: the unfinished build was removed; {shards} holds what "
                                       "it held before")
    assert stopped_in < 5
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, 0)  # no shard writer outlived it
    assert files_of(shards) == before
    assert not (shards / STAGING).exists() and not list(tmp.iterdir())


def test_a_second_build_of_a_data_dir_is_refused_naming_the_holder(built, tmp_path, capsys):
    """Two builds on one data.dir used to both say "wrote", the last silently replacing the other. The lock is
    taken to build only: an up-to-date data.dir is still read (and not written) while a build holds it."""
    shards = tmp_path / "shards"
    overrides = overrides_for(shards, corpus=built.root / "corpus")
    with DataDirLock(shards):
        assert cli.main(["data", *overrides]) == 2
        since = json.loads((shards / LOCK).read_text())["since"]
        assert capsys.readouterr().err.splitlines() == [
            f"keel data: config error: data.dir={shards} is in use by another keel process: pid {os.getpid()} on host "
            f"{socket.gethostname()} (since {since}). Two builds in one data.dir would replace each other's files; "
            "wait for it to end, stop it, or use another data.dir"]
        assert sorted(path.name for path in shards.iterdir()) == [LOCK]  # nothing written
        up_to_date = copy_of(built, tmp_path / "copy")
        with DataDirLock(up_to_date.data.dir):
            assert prepare(up_to_date) == built.manifest
    (shards / STAGING / "train").mkdir(parents=True)  # what a build killed with -9 leaves
    (shards / STAGING / "train" / "chunk-0-0.bin").write_bytes(b"partial")
    assert cli.main(["data", *overrides]) == 0
    assert not (shards / STAGING).exists() and (shards / LOCK).read_text() == ""  # released


def test_keel_data_never_removes_what_no_build_wrote(built, tmp_path, capsys):
    """`keel data data.paths=[corp/train/*.txt,corp/val/*.txt] data.dir=corp` deleted the whole corpus: publishing
    replaced train/, val/, tokenizer.json and manifest.json in data.dir whether or not keel had made them."""
    corpus = tmp_path / "corp"
    write_corpus(corpus / "train")
    write_corpus(corpus / "val")
    (corpus / TOKENIZER).write_text("{}")  # the user's own
    before = files_of(corpus)
    overrides = [*overrides_for(corpus), f"data.paths=[{corpus}/train/*.txt,{corpus}/val/*.txt]"]
    assert cli.main(["data", *overrides]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"keel data: config error: data.dir={corpus} holds tokenizer.json, train/, val/, which no keel build wrote (a "
        "build would replace them); nothing was changed: choose a new or empty data.dir"]
    assert files_of(corpus) == before and not (corpus / LOCK).exists()
    # an earlier build is replaced (--force), and one whose move into place was stopped is rebuilt; a user's file
    # inside a split is not shards
    shards = tmp_path / "shards"
    shutil.copytree(built.dir, shards)
    (shards / MANIFEST).unlink()
    (shards / PUBLISHING).write_bytes(b"")  # as an interrupted publish leaves it
    assert cli.main(["data", *overrides_for(shards, corpus=built.root / "corpus")]) == 0
    assert not (shards / PUBLISHING).exists() and json.loads((shards / MANIFEST).read_text())["tokens"]
    (shards / "val" / "notes.txt").write_text("mine")
    assert cli.main(["data", "--force", *overrides_for(shards, corpus=built.root / "corpus")]) == 2
    assert "holds val/, which no keel build wrote" in capsys.readouterr().err
    assert (shards / "val" / "notes.txt").read_text() == "mine"
