"""Training's side of the shards: open_dataset checks them against the config, token_loader streams a split,
KeelDataModule hands both loaders to Lightning."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

from keel.config import Config, DataConfig, resolve_accelerator
from keel.data.shards import (
    MANIFEST,
    MANIFEST_KEYS,
    REBUILD,
    SPLITS,
    TOKENIZER,
    checksummed_chunks,
    corrupt_chunk,
    data_path,
    first_corrupt,
    sha256,
    storage,
    tokens_per_chunk,
    verify_shards,
)
from keel.errors import ConfigError


@dataclass
class DatasetInfo:
    dir: str
    tokenizer_path: str
    tokenizer_json: str
    vocab_size: int
    eos_id: int
    manifest: dict
    manifest_sha256: str  # identifies the build: a checkpoint's loader position refers to these shards only
    chunk_tokens: dict[str, list[int]]  # per split, the tokens of each litdata chunk (its index)


def open_dataset(cfg: Config) -> DatasetInfo:
    """The shards at cfg.data.dir, checked against the config; a ConfigError says what to run when they don't fit."""
    data = cfg.data
    fs = storage(data.dir)
    manifest_path = data_path(data.dir, MANIFEST)
    if not fs.exists(manifest_path):
        why = " (it has no manifest.json: an interrupted `keel data`?)" if fs.exists(data_path(data.dir)) else ""
        raise ConfigError(
            f"no shards at {data.dir}{why}: run `keel data` (or `make data`) with the same data.* settings"
        )
    try:
        manifest_bytes = fs.cat_file(manifest_path)
        manifest = json.loads(manifest_bytes)
        if missing := [key for key in MANIFEST_KEYS if key not in manifest]:
            raise ValueError(f"no {', '.join(missing)}")
    except ValueError as err:
        raise ConfigError(f"{data.dir}/{MANIFEST} is corrupt ({err}): {REBUILD}") from None
    tokenizer_path = data_path(data.dir, TOKENIZER)
    raw = fs.cat_file(tokenizer_path) if fs.exists(tokenizer_path) else b""
    if sha256(raw) != manifest["tokenizer_sha256"]:
        raise ConfigError(
            f"{data.dir}/{TOKENIZER} is missing or is not the one the shards were encoded with: {REBUILD}"
        )
    chunk_tokens = {split: tokens_per_chunk(fs, data.dir, split) for split in SPLITS}  # raises without an index
    # several processes hash their shares once joined (verify_checksums_shared), not every rank the whole corpus
    verify_shards(fs, data, manifest, checksums=cfg.trainer.world_size == 1)

    built_with = manifest["settings"].get("tokenizer")
    if data.tokenizer is not None:
        if os.path.isfile(data.tokenizer):
            same = sha256(Path(data.tokenizer).read_bytes()) == manifest["tokenizer_sha256"]
        else:  # a hub name, compared by name so that training needs no network
            same = data.tokenizer == built_with
        if not same:
            raise ConfigError(
                f"data.tokenizer={data.tokenizer!r} is not the tokenizer the shards at {data.dir} were built with "
                f"({built_with or 'a BPE trained by keel data'}): run `keel data --force` with this data.tokenizer, "
                "or point data.dir elsewhere"
            )
    if cfg.model.vocab_size < manifest["vocab_size"]:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {manifest['vocab_size']} tokens "
            f"({tokenizer_path}): set model.vocab_size >= {manifest['vocab_size']}"
        )
    return DatasetInfo(
        dir=data.dir,
        tokenizer_path=tokenizer_path,
        tokenizer_json=raw.decode(),
        vocab_size=manifest["vocab_size"],
        eos_id=manifest["eos_id"],
        manifest=manifest,
        manifest_sha256=sha256(manifest_bytes),
        chunk_tokens=chunk_tokens,
    )


def verify_checksums_shared(cfg: Config, manifest: dict, local_rank: int, device: torch.device) -> None:
    """Under several processes, once they are joined: the ranks of each node hash a disjoint share of the chunks
    (every chunk once per node, which may have its own copy of data.dir), then agree on the first corrupt one with
    one all-reduce, so that every rank refuses it by name."""
    fs = storage(cfg.data.dir)
    chunks = checksummed_chunks(fs, cfg.data, manifest)
    if not chunks:  # the same on every rank: the same config and manifest
        return
    bad = first_corrupt(fs, cfg.data, chunks, local_rank, cfg.trainer.devices)
    first = torch.tensor(len(chunks) if bad is None else bad, device=device)
    torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MIN)
    if first.item() < len(chunks):
        raise corrupt_chunk(cfg.data, chunks[first.item()])


def batches_per_rank(cfg: Config, chunk_tokens: list[int]) -> tuple[int, int]:
    """(sequences, micro-batches per rank) of a split, as litdata deals it out with drop_last: sequences of
    model.seq_len + 1 tokens that never cross a chunk boundary, whole micro-batches only, the same number of them on
    every rank (the rest is unused)."""
    sequences = sum(tokens // (cfg.model.seq_len + 1) for tokens in chunk_tokens)
    return sequences, sequences // cfg.trainer.micro_batch_size // cfg.trainer.world_size


def check_splits_fit(cfg: Config, chunk_tokens: dict[str, list[int]]) -> None:
    """Before any process starts or any model is built: every rank must get trainer.val_batches validation
    batches and one optimizer step (trainer.grad_accum) of training batches. Otherwise litdata gives a rank no
    batch at all (every rank then fails when training starts) or fewer (validation would silently run on fewer
    than trainer.val_batches)."""
    t = cfg.trainer
    larger = {
        "val": "a larger validation split (data.val_fraction",
        "train": "more training text (data.text_files.paths, data.max_chars",
    }
    for split, key in (("val", "val_batches"), ("train", "grad_accum")):
        needed = getattr(t, key)
        sequences, batches = batches_per_rank(cfg, chunk_tokens[split])
        if batches >= needed:
            continue
        lower = f"lower trainer.{key} to {batches} or less, " if batches else ""
        raise ConfigError(
            f"trainer.{key}={needed}: {cfg.data.dir}/{split} holds {sequences:,} sequence(s) of model.seq_len + 1 = "
            f"{cfg.model.seq_len + 1:,} tokens, {sequences // t.world_size:,} per rank over {t.world_size} process(es) "
            f"(trainer.devices={t.devices} x trainer.num_nodes={t.num_nodes}): {batches} batch(es) of "
            f"trainer.micro_batch_size={t.micro_batch_size} per rank, fewer than the {needed} trainer.{key} asks for; "
            f"{lower}use fewer processes or a smaller trainer.micro_batch_size, {larger[split]}, then `keel data "
            "--force`), or a larger data set (e.g. data=fineweb_edu)"
        )


def _stack_long(sequences: list[np.ndarray]) -> torch.Tensor:
    # Shards hold uint16 (or int32) ids; embeddings and cross-entropy want int64.
    return torch.from_numpy(np.stack(sequences).astype(np.int64))


@dataclass
class DataPosition:
    """Where a rank is in the training data stream, counted across epochs: the micro-batches it has drawn (trained
    on or skipped), and the ranges of global batches to skip (a rewind's, callbacks.stability.rewind). Global
    batch g is micro-batches g x grad_accum ... (g + 1) x grad_accum - 1 of every rank: the same g on every rank."""

    grad_accum: int
    micro_batches: int = 0
    skips: list[tuple[int, int]] = field(default_factory=list)  # [first, end) global batch indices

    @property
    def global_batch(self) -> int:
        """The index of the global batch the next micro-batch belongs to."""
        return self.micro_batches // self.grad_accum

    def skipped(self) -> bool:
        return any(first <= self.global_batch < end for first, end in self.skips)


class _ResumableLoader(StreamingDataLoader):
    """A StreamingDataLoader whose epochs after a resumed one start afresh, and that drops the global batches its
    `position` says to skip (drawn and counted, never yielded).

    litdata clears its `restore` flag only when an epoch runs into StopIteration, but Lightning stops after
    len(loader) batches; the flag would stay set and every later epoch would replay from the restored position.
    """

    _resumed_epoch_begun = False

    def __init__(
        self, dataset: StreamingDataset, data: DataConfig, position: DataPosition | None = None, **kwargs
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.data = data
        self.position = position

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self._resumed_epoch_begun:
            self.restore = self._resumed_epoch_begun = False
        try:
            for batch in super().__iter__():
                self._resumed_epoch_begun = self.restore
                if self.position is not None:
                    skip = self.position.skipped()
                    self.position.micro_batches += 1
                    if skip:
                        continue
                yield batch
        except FileNotFoundError:  # litdata's ChunkWaitTimeoutError among them: say which shard went, if one did
            try:
                verify_shards(storage(self.data.dir), self.data, {})  # sizes only: quick
            except ConfigError as gone:
                raise ConfigError(
                    f"while training: {gone}. The shards changed under the run: restore them to "
                    "continue from its checkpoint, or rebuild them and start a new run.dir"
                ) from None
            raise


def token_loader(cfg: Config, split: str, shuffle: bool, position: DataPosition | None = None) -> StreamingDataLoader:
    """(micro_batch_size, seq_len + 1) int64 batches of consecutive tokens from one split of cfg.data.dir; with a
    `position`, counted there and without the global batches it skips."""
    dataset = StreamingDataset(
        data_path(cfg.data.dir, split),
        item_loader=TokensLoader(block_size=cfg.model.seq_len + 1),
        shuffle=shuffle,
        seed=cfg.run.seed,
        drop_last=True,  # the same number of batches on every rank
        # Explicit: litdata's default (None) reads LITDATA_ITEM_SHUFFLE_WINDOW or else 256, which makes ~32 steps
        # of micro-batch 8 in a row come from one stretch of a chunk.
        item_shuffle_window=cfg.data.shuffle_window,
        cache_dir=cfg.data.cache_dir,  # where chunks of an object-store data.dir are downloaded to
    )
    loader = _ResumableLoader(
        dataset,
        cfg.data,
        position,
        batch_size=cfg.trainer.micro_batch_size,
        num_workers=cfg.data.loader_workers,
        collate_fn=_stack_long,
        # page-locked batches: their copy to the GPU runs without a staging copy, and asynchronously
        pin_memory=resolve_accelerator(cfg.trainer) == "gpu",
    )
    if len(loader) == 0:
        raise ConfigError(
            f"{cfg.data.dir}/{split}: {len(dataset)} sequence(s) of model.seq_len + 1 = {cfg.model.seq_len + 1} tokens "
            f"per device, fewer than one batch of trainer.micro_batch_size={cfg.trainer.micro_batch_size}; "
            "use more text, a larger data.val_fraction, or a smaller model.seq_len or trainer.micro_batch_size"
        )
    return loader


class KeelDataModule(LightningDataModule):
    """Batches (micro_batch_size, seq_len + 1) of int64 token ids from the shards `keel data` built; the
    LightningModule takes inputs [:, :-1] and targets [:, 1:].

    Lightning re-iterates the train loader every epoch (reshuffled), so runs longer than an epoch cycle
    through the data. The loader's position needs nothing here: a StreamingDataLoader is stateful, so
    Lightning's fit loop saves it in every checkpoint (`loops.fit_loop.state_dict.combined_loader`) and
    restores it on resume. This module's own state is the identity of the shards that position refers to and the
    count of micro-batches drawn (`DataPosition`: what a rewind's skipped batches are numbered by).
    """

    def __init__(self, cfg: Config, info: DatasetInfo | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        # fail before the Trainer starts when the shards don't fit; `info`: already opened (and verified)
        self.info = info if info is not None else open_dataset(cfg)
        self.position = DataPosition(cfg.trainer.grad_accum)

    def skip(self, ranges: list[tuple[int, int]]) -> None:
        """Skip these [first, end) ranges of global batches from now on (those already drawn are unaffected)."""
        self.position.skips = [tuple(r) for r in ranges]

    def setup(self, stage: str) -> None:
        if self.cfg.trainer.world_size > 1:
            verify_checksums_shared(
                self.cfg, self.info.manifest, self.trainer.local_rank, self.trainer.strategy.root_device
            )

    def train_dataloader(self) -> StreamingDataLoader:
        return token_loader(self.cfg, "train", shuffle=True, position=self.position)

    def val_dataloader(self) -> StreamingDataLoader:
        return token_loader(self.cfg, "val", shuffle=False)

    def state_dict(self) -> dict:
        return {
            "manifest_sha256": self.info.manifest_sha256,
            "micro_batches": self.position.micro_batches,
            "grad_accum": self.position.grad_accum,
        }

    def load_state_dict(self, state: dict) -> None:
        # an elastic resume at another grad_accum counts the same global batches in its own micro-batches (a
        # checkpoint from before the count: counted from this resume on)
        saved, accum = state.get("micro_batches", 0), state.get("grad_accum", self.position.grad_accum)
        self.position.micro_batches = saved // accum * self.position.grad_accum + saved % accum
