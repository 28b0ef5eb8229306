"""`keel data`: one pass over data.source spooled to local disk and split, a tokenizer, the shards of each split
(encoded in a seeded document order by worker processes, in litdata's TokensLoader layout), val_docs.jsonl, the
downstream tasks generated from it (eval_tasks/), and the manifest. A build holds a lock on data.dir, is staged in
<data.dir>/.keel-build and moved into place once whole: a build that fails or is interrupted is removed and leaves
data.dir as it was.

    keel data [--config FILE] [--force] [key=value ...]
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import os
import posixpath
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import numpy as np
from tokenizers import Tokenizer

from keel.config import Config, DataConfig, load_config
from keel.data.generated_tasks import TASKS_SUBDIR, build_tasks, task_files, write_tasks
from keel.data.shard_writing import SpanEncoder, write_shards
from keel.data.shards import (
    MANIFEST,
    PUBLISHING,
    SPLITS,
    STAGING,
    TOKENIZER,
    VAL_DOCS,
    chunk_digests,
    data_path,
    refuse_foreign_files,
    require_sequences,
    sha256,
    storage,
    tokens_per_chunk,
    writing,
)
from keel.data.sources import SOURCES
from keel.data.sources.base import MAX_UNDECODABLE, SkippedFiles
from keel.data.spooling import remove_stale_spools, spool_corpus, spool_prefix
from keel.data.tokenizer import eos_id_of, load_tokenizer, train_tokenizer
from keel.dirlock import DirLock
from keel.errors import ConfigError

# data.* keys that shape every build, whatever the source (each adds its section's and Source.settings)
COMMON_SETTINGS = ("source", "max_chars", "val_fraction", "seed", "shuffle_documents", "tokenizer")
Result = TypeVar("Result")


class DataDirLock(DirLock):
    """One build per local data.dir at a time, taken only to build: an up-to-date data.dir is read, never written."""

    key = "data.dir"
    clash = "Two builds in one data.dir would replace each other's files"
    command = "data"


def build_settings(data: DataConfig) -> dict[str, Any]:
    """The data.* values that determine what `keel data` builds: recorded in the manifest, compared on re-runs; the
    keys of data.source's own section under their names in it."""
    keys = [*COMMON_SETTINGS, *SOURCES[data.source].settings]
    if data.tokenizer is None:
        keys.append("vocab_size")  # shapes only a tokenizer trained here
    settings = {key: getattr(data, key) for key in keys} | asdict(data.source_config)
    if "encoding" in settings:  # by its canonical name: "UTF8" and "utf-8" are one setting
        settings["encoding"] = codecs.lookup(data.encoding).name
    return settings


def _in_a_thread(function: Callable[..., Result], *args: Any) -> Result:
    """function(*args), run in a daemon thread that the main thread waits for. Python runs a signal's handler in the
    main thread between bytecodes, and the tokenizers library trains a BPE in Rust for minutes without coming back:
    called directly, it held Ctrl-C until it was done. A wait can be interrupted; after Ctrl-C the thread is left to
    end with the process."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = function(*args)
        except BaseException as err:  # noqa: BLE001 - raised again in the main thread
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _existing_build(cfg: Config, fs: fsspec.AbstractFileSystem, force: bool) -> dict | None:
    """The manifest of a complete build at data.dir that matches the config; None if one must be built."""
    data = cfg.data
    try:
        manifest = json.loads(fs.cat_file(data_path(data.dir, MANIFEST)))
    except (OSError, ValueError):  # absent or unreadable: nothing complete is there
        return None
    complete = all(fs.exists(data_path(data.dir, name)) for name in (TOKENIZER, "train/index.json", "val/index.json"))
    if force or not complete:
        return None
    settings, built = build_settings(data), manifest.get("settings", {})
    if "encoding" in settings:  # builds made before data.encoding existed read UTF-8
        built = {"encoding": "utf-8", **built}
    # builds made before data.hf.* recorded data.hf_dataset, data.hf_name, data.hf_split
    built = {key.removeprefix("hf_"): value for key, value in built.items()}
    changed = sorted(key for key in set(settings) | set(built) if settings.get(key) != built.get(key))
    own = {f.name for f in fields(data.source_config)}
    changes = [
        f"data.{data.source + '.' if key in own else ''}{key}: {built.get(key)!r} -> {settings.get(key)!r}"
        for key in changed
    ]
    other_tokenizer = not {"tokenizer", "vocab_size"}.isdisjoint(changed)
    if data.tokenizer and os.path.isfile(data.tokenizer):
        if sha256(Path(data.tokenizer).read_bytes()) != manifest.get("tokenizer_sha256"):
            changes.append(f"the contents of {data.tokenizer}")
            other_tokenizer = True
    if changes:
        built_with = "another tokenizer" if other_tokenizer else "other data settings"
        raise ConfigError(
            f"{data.dir} already holds shards built with {built_with} ({'; '.join(changes)}): "
            "pass --force to rebuild them, or choose another data.dir"
        )
    require_sequences(fs, data.dir, cfg.model.seq_len)
    return manifest


def _up_to_date(cfg: Config, fs: fsspec.AbstractFileSystem, force: bool) -> dict | None:
    if (manifest := _existing_build(cfg, fs, force)) is not None:
        print(
            f"keel data: {cfg.data.dir} is up to date ({manifest['tokens']['train']:,} train / "
            f"{manifest['tokens']['val']:,} val tokens); nothing to do (--force rebuilds)"
        )
    return manifest


def prepare(cfg: Config, force: bool = False) -> dict:
    """Build the tokenizer, shards, val_docs.jsonl, generated tasks and manifest at cfg.data.dir unless already there;
    the manifest."""
    data = cfg.data
    fs = storage(data.dir)
    if (manifest := _up_to_date(cfg, fs, force)) is not None:
        return manifest
    given = load_tokenizer(data.tokenizer) if data.tokenizer else None  # before reading: fail fast
    refuse_foreign_files(fs, data.dir)  # before any work or lock file: a build would replace them
    # an object store has no lock: two builds into one remote data.dir are not prevented
    with contextlib.nullcontext() if "://" in data.dir else DataDirLock(data.dir):
        if (manifest := _up_to_date(cfg, fs, force)) is not None:  # built meanwhile by the lock's last holder
            return manifest
        staging = data_path(data.dir, STAGING)
        if fs.exists(staging):  # left by a build killed before it could remove it (the lock says none is running)
            fs.rm(staging, recursive=True)
        try:
            try:
                manifest = _build(cfg, fs, staging, given)
            except KeyboardInterrupt:
                raise KeyboardInterrupt(
                    f"interrupted: the unfinished build was removed; {data.dir} holds what it held before"
                ) from None
            _publish(fs, staging, data.dir)  # interrupted, it leaves an unfinished build: the next run rebuilds it
        finally:
            if fs.exists(staging):
                fs.rm(staging, recursive=True)
    documents, tokens = manifest["documents"], manifest["tokens"]
    print(
        f"keel data: wrote {data.dir}: {documents['train']:,} train / {documents['val']:,} val documents, "
        f"{tokens['train']:,} / {tokens['val']:,} tokens, vocabulary {manifest['vocab_size']}; "
        + ", ".join(f"{key[:-2]} {seconds:.1f} s" for key, seconds in manifest["timings"].items())
    )
    return manifest


def _build(cfg: Config, fs: fsspec.AbstractFileSystem, staging: str, given: tuple[Tokenizer, bytes] | None) -> dict:
    """A whole build in `staging`, its manifest written last; the manifest."""
    data, source = cfg.data, SOURCES[cfg.data.source]
    start = time.perf_counter()
    timings = {}
    with writing(staging):
        fs.makedirs(staging, exist_ok=True)
    remove_stale_spools()
    with tempfile.TemporaryDirectory(prefix=spool_prefix()) as workdir:
        print(f"keel data: reading {source.describe(data)}")
        skipped = SkippedFiles(data.encoding)
        spools = spool_corpus(data, workdir, skipped)
        timings["read_s"] = time.perf_counter() - start
        if skipped.count:
            print(
                f"keel data: skipped {skipped} (a NUL, or more than {MAX_UNDECODABLE:.0%} of the characters "
                "undecodable); files in another encoding are read with data.encoding=CODEC (e.g. latin-1, cp1252)"
            )

        mark = time.perf_counter()
        if given is None:
            print(
                f"keel data: training a {data.vocab_size}-token byte-level BPE on {spools['train'].chars:,} characters",
                flush=True,
            )
            tokenizer = _in_a_thread(train_tokenizer, spools["train"].texts(), data.vocab_size)
            tokenizer_bytes = tokenizer.to_str().encode()
        else:
            tokenizer, tokenizer_bytes = given
        eos_id, vocab_size = eos_id_of(tokenizer), tokenizer.get_vocab_size()
        with writing(data_path(staging, TOKENIZER)):
            fs.pipe_file(data_path(staging, TOKENIZER), tokenizer_bytes)
        timings["tokenizer_s"] = time.perf_counter() - mark

        dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)
        encoder = SpanEncoder(tokenizer, eos_id, dtype)
        for split in SPLITS:
            mark = time.perf_counter()
            write_shards(data, fs, spools[split], split, encoder, staging, workdir)
            timings[f"{split}_shards_s"] = time.perf_counter() - mark
        with writing(data_path(staging, VAL_DOCS)):
            fs.put_file(spools["val"].path, data_path(staging, VAL_DOCS))
        mark = time.perf_counter()
        _write_eval_tasks(fs, staging, spools["val"].path)
        timings["eval_tasks_s"] = time.perf_counter() - mark

    require_sequences(fs, staging, cfg.model.seq_len)
    timings["total_s"] = time.perf_counter() - start
    manifest = {
        "source": {"kind": data.source, "description": source.describe(data)},
        "settings": build_settings(data),
        "documents": {split: spools[split].documents for split in SPLITS},
        "chars": {split: spools[split].chars for split in SPLITS},
        "tokens": {split: sum(tokens_per_chunk(fs, staging, split)) for split in SPLITS},
        "skipped_files": {"binary_or_undecodable": skipped.count, "first": skipped.first},
        "chunk_sha256": {split: chunk_digests(fs, staging, split) for split in SPLITS},
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "eos_token": tokenizer.id_to_token(eos_id),
        "dtype": dtype.name,
        "tokenizer_sha256": sha256(tokenizer_bytes),
        "timings": {key: round(seconds, 2) for key, seconds in timings.items()},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "keel_version": metadata.version("keel"),
    }
    with writing(data_path(staging, MANIFEST)):
        fs.pipe_file(data_path(staging, MANIFEST), json.dumps(manifest, indent=2).encode())
    return manifest


def _write_eval_tasks(fs: fsspec.AbstractFileSystem, staging: str, val_docs: str) -> None:
    """The generated downstream tasks (keel.data.generated_tasks), built from the held-out documents beside the
    shards, so that training reads them where the data is (an object store or a read-only mount too)."""
    with open(val_docs, encoding="utf-8") as f:
        try:
            tasks = build_tasks(f)
        except ValueError as err:  # too few held-out documents: the shards are still usable
            print(f"keel data: no generated evaluation tasks: {err}")
            return
    with writing(data_path(staging, TASKS_SUBDIR)):
        write_tasks(fs, staging, tasks)


def _publish(fs: fsspec.AbstractFileSystem, staging: str, data_dir: str) -> None:
    """Moves a whole staged build into data.dir. The old manifest goes first, so data.dir reads as an unfinished build
    until the new one, moved last, marks it complete. Locally every move is a rename on one filesystem: no space
    is needed, and the earlier build is kept until here. Interrupted, the PUBLISHING mark says what is there is
    keel's to replace."""
    refuse_foreign_files(fs, data_dir)  # again: the build took a while
    with writing(data_path(data_dir, PUBLISHING)):
        fs.pipe_file(data_path(data_dir, PUBLISHING), b"")
    if fs.exists(data_path(data_dir, MANIFEST)):
        fs.rm_file(data_path(data_dir, MANIFEST))
    for name in (TOKENIZER, VAL_DOCS, *SPLITS, MANIFEST):
        source, target = data_path(staging, name), data_path(data_dir, name)
        if fs.exists(target):
            fs.rm(target, recursive=True)
        if "://" in data_dir and fs.isdir(source):  # an object store has no directory to rename: each object of the
            for path in fs.ls(source, detail=False):  # split (a flat folder) is copied, then deleted
                fs.mv(path, f"{target}/{posixpath.basename(path)}")
        else:
            fs.mv(source, target)
    # the generated tasks file by file: nothing else under eval_tasks/ (a file of the user's) is removed
    for source, target in zip(task_files(staging).values(), task_files(data_dir).values()):
        if fs.exists(source):
            fs.makedirs(posixpath.dirname(target), exist_ok=True)
            fs.mv(source, target)
    fs.rm_file(data_path(data_dir, PUBLISHING))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keel data", description="Build tokenized litdata shards from data.source.")
    parser.add_argument("--config", help="YAML merged over conf/config.yaml (data.* and model.seq_len matter here)")
    parser.add_argument("--force", action="store_true", help="rebuild even if data.dir already holds shards")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="e.g. data=text_files 'data.text_files.paths=[docs/*.md]'"
    )
    args = parser.parse_intermixed_args(argv)  # options may follow overrides: `keel data $ARGS --force`
    # Past a file size limit (ulimit -f) the kernel kills the writer with SIGXFSZ, without a word; ignored, the
    # write fails with EFBIG instead, which is reported like a full disk. Shard writers inherit it.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    prepare(load_config(args.config, args.overrides), force=args.force)
    return 0
