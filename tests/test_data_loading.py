"""Training's side of the data: open_dataset's checks, the loaders and their exact resume across epochs, the
shared real corpora, and whether training batches are a uniform sample of the corpus."""

from __future__ import annotations

import itertools
import json
import random
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

import keel.data.spooling
from keel.checkpoint.payload import LEGACY_DATA_STATE, read_payload, write_payload
from keel.config import Config, DataConfig, load_config
from keel.data.loading import KeelDataModule, open_dataset, token_loader
from keel.data.preparation import prepare
from keel.data.sources import read_documents
from keel.data.spooling import is_validation
from keel.data.tokenizer import train_tokenizer
from keel.errors import ConfigError
from keeltest import SHARED_DATA
from keeltest.data import chunk_tokens, config, copy_of, expected_tokens


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
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    cfg = config(built.dir, "trainer.micro_batch_size=16")
    epoch = len(token_loader(cfg, "train", shuffle=True))
    steps = 2 * epoch + 5

    class Recorder(LightningModule):
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
            callbacks.append(
                ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=every, save_top_k=-1)
            )
        trainer = Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            logger=False,
            callbacks=callbacks,
            enable_checkpointing=bool(every),
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )
        trainer.fit(model, datamodule=KeelDataModule(cfg), ckpt_path=ckpt_path)
        return model.seen

    reference = fit(steps)
    assert len(reference) == steps
    for k in (10, epoch):
        first = fit(k, every=k)
        rest = fit(steps, str(tmp_path / f"step={k}.ckpt"))
        assert all(torch.equal(a, b) for a, b in zip(first + rest, reference, strict=True)), f"resume at step {k}"


def shared(relative: str) -> Path:
    path = SHARED_DATA / relative
    if not path.is_file():
        pytest.skip(f"{path} is absent (the shared corpora live in ../shared/data next to the repo)")
    return path


def test_shared_jsonl_corpus_builds_and_loads(tmp_path):
    questions = shared("gsm8k/train.jsonl")
    cfg = config(
        tmp_path / "gsm8k",
        f"data.text_files.paths=[{questions}]",
        "data.text_files.text_field=question",
        "data.max_chars=300000",
        "data.val_fraction=0.05",
        "data.vocab_size=512",
        "model.vocab_size=512",
    )
    manifest = prepare(cfg)
    assert sum(manifest["chars"].values()) == 300000
    assert manifest["documents"]["val"] > 0 and manifest["tokens"]["train"] > 50000
    assert next(iter(token_loader(cfg, "val", shuffle=False))).shape == (4, 33)


def test_single_big_plain_text_file_builds(tmp_path, capsys):
    """tinyshakespeare's one 1.1 MB file, with the default data.text_files.doc_chars and data.val_fraction: cut into
    documents that join back into it, split by their ids, and every token accounted for."""
    shakespeare = shared("tinyshakespeare/input.txt")
    val_fraction = DataConfig.val_fraction
    cfg = config(tmp_path / "out", f"data.text_files.paths=[{shakespeare}]", f"data.val_fraction={val_fraction}")
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
    share = torch.bincount(
        torch.cat([sequence_sources(b, token_source) for b in token_loader(cfg, "train", False)]),
        minlength=len(ALPHABETS),
    ).double()
    expected = BATCH * share / share.sum()
    loader = KeelDataModule(cfg).train_dataloader()
    observed = torch.stack(
        [
            torch.bincount(sequence_sources(b, token_source), minlength=len(ALPHABETS))
            for b in itertools.islice(loader, batches)
        ]
    ).double()  # (batches, sources)
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    return stats.chi2.sf(chi2, batches * (len(ALPHABETS) - 1))


@pytest.mark.parametrize(
    "shuffle_documents, shuffle_window, random_sample",
    [
        (True, 0, True),  # the defaults
        (False, 256, False),  # before: corpus order on disk and litdata's default window
        (False, 0, False),  # full permutation alone: each chunk still holds one stretch of the corpus
    ],
)
def test_training_batches_are_a_uniform_sample(
    sourced_corpus, tmp_path, monkeypatch, shuffle_documents, shuffle_window, random_sample
):
    # ~200 documents a chunk (as with litdata's default chunk size on a real corpus, not one chunk in all)
    monkeypatch.setattr(keel.data.spooling, "SPAN_CHARS", 60_000)
    monkeypatch.chdir(sourced_corpus)  # relative ids: the split, hence every figure here, is the same on each run
    cfg = config(
        tmp_path / "shards",
        f"data.shuffle_documents={shuffle_documents}",
        f"data.shuffle_window={shuffle_window}",
        "data.text_files.doc_chars=0",
        "data.chunk_bytes=16KB",
        "data.val_fraction=0.05",
        f"trainer.micro_batch_size={BATCH}",
        "data.text_files.paths=['*.txt']",
    )
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
    from keel.training import train
    from keeltest import QUIET_TRAINER, TINY_MODEL

    shards = tmp_path / "shards"
    shutil.copytree(next(o.split("=", 1)[1] for o in tiny_data if o.startswith("data.dir=")), shards)

    def run(*overrides: str) -> None:
        train(
            load_config(
                overrides=[
                    *TINY_MODEL,
                    *QUIET_TRAINER,
                    *tiny_data,
                    f"data.dir={shards}",
                    "eval.enabled=false",
                    f"run.dir={tmp_path / 'run'}",
                    "trainer.max_steps=2",
                    *overrides,
                ]
            )
        )

    run()
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=r"with data.shuffle_window=0; this config has 256"):
        run("trainer.max_steps=4", "data.shuffle_window=256")

    checkpoint = torch.load(last, weights_only=True)
    older = {**checkpoint, LEGACY_DATA_STATE: {}}  # as written before keel recorded the shards' identity
    write_payload(older, replace(read_payload(checkpoint), data_manifest_sha256=None))
    torch.save(older, last)
    with pytest.raises(ConfigError, match="built before `keel data` shuffled documents"):
        run("trainer.max_steps=4")

    torch.save(checkpoint, last)
    manifest = json.loads((shards / "manifest.json").read_text())
    (shards / "manifest.json").write_text(json.dumps({**manifest, "created": "rebuilt"}))
    with pytest.raises(ConfigError, match="are not the ones .* was trained on"):
        run("trainer.max_steps=4")
