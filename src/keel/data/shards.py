"""data.dir, local or an object-store URL: the files `keel data` writes there, and the checks that they are whole."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import fsspec

from keel.errors import STORAGE_FAILURES, ConfigError

if TYPE_CHECKING:
    from keel.config import DataConfig

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
VAL_DOCS = "val_docs.jsonl"
STAGING = ".keel-build"  # where `keel data` builds, to move the files into place once the build is whole
PUBLISHING = ".keel-publishing"  # present while a build is moved into place: what is there then is keel's
SPLITS = ("train", "val")
MANIFEST_KEYS = ("settings", "documents", "tokens", "vocab_size", "eos_id", "tokenizer_sha256")
REBUILD = "rebuild with `keel data --force` (same data.* settings)"


@contextlib.contextmanager
def writing(what: str) -> Iterator[None]:
    """Turns a write under it that storage refuses (a full disk, a quota, a file size limit, a read-only or
    unwritable folder) into one line naming `what` was written and what to do, instead of a bare OSError (a write's
    OSError names no file)."""
    try:
        yield
    except OSError as err:
        if err.errno not in STORAGE_FAILURES:
            raise
        problem, remedy = STORAGE_FAILURES[err.errno]
        raise ConfigError(f"{problem} writing {what}: {remedy} or choose another data.dir / TMPDIR") from None


def sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def data_path(data_dir: str, *names: str) -> str:
    """A file or split under data.dir, as fsspec and litdata want it: an absolute local path or a URL."""
    if "://" in data_dir:
        return "/".join([data_dir.rstrip("/"), *names])
    return os.path.abspath(os.path.join(data_dir, *names))


def storage(data_dir: str) -> fsspec.AbstractFileSystem:
    """The filesystem of data.dir (local, or an object store through its fsspec backend); for s3:// URLs,
    litdata's own client is first made to accept a plain-http endpoint (see _allow_http_s3_endpoint)."""
    scheme = data_dir.split("://", 1)[0] if "://" in data_dir else "file"
    endpoint = _allow_http_s3_endpoint() if scheme == "s3" else None
    try:
        fs = fsspec.core.url_to_fs(data_dir)[0]
    except ImportError as err:
        extra = " (pip install -e '.[s3]')" if scheme == "s3" else ""
        raise ConfigError(f"data.dir={data_dir}: no fsspec backend for {scheme}:// ({err}){extra}") from None
    if scheme != "file":  # fail here, naming the store, rather than in litdata's workers
        bucket = data_dir.split("://", 1)[1].split("/", 1)[0]
        try:
            found = fs.exists(f"{scheme}://{bucket}")
        except Exception as err:  # noqa: BLE001 - endpoint, network and credential errors of any backend
            raise ConfigError(
                f"data.dir={data_dir}: cannot reach the object store ({type(err).__name__}: {err}); check the "
                "endpoint and credentials (for S3: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE)"
            ) from None
        if not found:
            at = f" at {endpoint}" if endpoint else ""
            raise ConfigError(
                f"data.dir={data_dir}: bucket {bucket!r} cannot be found{at}: it does not exist, the "
                "endpoint is unreachable, or these credentials cannot see it; create it, or fix "
                "data.dir or the endpoint (AWS_ENDPOINT_URL)"
            )
    return fs


def _allow_http_s3_endpoint() -> str | None:
    """litdata (0.2.7x) moves S3 chunks through obstore, whose client it builds with fixed options that refuse
    plain http, so an http endpoint (MinIO or another S3-compatible server on a private network) fails with
    "HTTP error: builder error" while boto3 works. When the endpoint boto3 resolves (AWS_ENDPOINT_URL_S3,
    AWS_ENDPOINT_URL or the AWS config file) is http://, those options get obstore's `allow_http`; https
    endpoints and AWS itself are left exactly as litdata sets them. Returns that endpoint (None: AWS's own)."""
    import boto3
    import litdata.streaming.downloader as downloader

    endpoint = boto3.session.Session().client("s3").meta.endpoint_url or ""
    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if endpoint.startswith("http://") and isinstance(options, dict):
        options["allow_http"] = "true"
    return endpoint or None


def _is_manifest(fs: fsspec.AbstractFileSystem, data_dir: str) -> bool:
    try:
        manifest = json.loads(fs.cat_file(data_path(data_dir, MANIFEST)))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and all(key in manifest for key in MANIFEST_KEYS)


def _is_split(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether a directory holds only what litdata's writer puts there: chunk files and index files."""
    names = [os.path.basename(name.rstrip("/")) for name in fs.ls(path, detail=False)] if fs.isdir(path) else None
    return names is not None and all(re.fullmatch(r"chunk-\d+-\d+\.bin|(\d+\.)?index\.json", n) for n in names)


def refuse_foreign_files(fs: fsspec.AbstractFileSystem, data_dir: str) -> None:
    """A build replaces manifest.json, tokenizer.json, val_docs.jsonl, train/ and val/ in data.dir: refuse unless
    each that is there was written by an earlier build (a keel manifest, or a move into place that was stopped),
    and the splits hold only shards. Nothing else is ever removed: data.dir may be the user's corpus folder."""
    earlier = _is_manifest(fs, data_dir) or fs.exists(data_path(data_dir, PUBLISHING))
    foreign = [name for name in (MANIFEST, TOKENIZER, VAL_DOCS) if fs.exists(data_path(data_dir, name)) and not earlier]
    foreign += [
        f"{split}/"
        for split in SPLITS
        if fs.exists(data_path(data_dir, split)) and not _is_split(fs, data_path(data_dir, split))
    ]
    if foreign:
        raise ConfigError(
            f"data.dir={data_dir} holds {', '.join(foreign)}, which no keel build wrote (a build would "
            "replace them); nothing was changed: choose a new or empty data.dir"
        )


def tokens_per_chunk(fs: fsspec.AbstractFileSystem, data_dir: str, split: str) -> list[int]:
    index = data_path(data_dir, split, "index.json")
    if not fs.exists(index):
        raise ConfigError(f"{data_dir}/{split} has no shards: {REBUILD}")
    return [chunk["dim"] for chunk in _chunks(fs, data_dir, split)]


def _chunks(fs: fsspec.AbstractFileSystem, data_dir: str, split: str) -> list[dict]:
    return json.loads(fs.cat_file(data_path(data_dir, split, "index.json")))["chunks"]


def _file_sha256(fs: fsspec.AbstractFileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def chunk_digests(fs: fsspec.AbstractFileSystem, data_dir: str, split: str) -> dict[str, str]:
    """sha256 of each chunk file of a split, by file name."""
    return {
        chunk["filename"]: _file_sha256(fs, data_path(data_dir, split, chunk["filename"]))
        for chunk in _chunks(fs, data_dir, split)
    }


def verify_shards(fs: fsspec.AbstractFileSystem, data: DataConfig, manifest: dict, checksums: bool = True) -> None:
    """Every chunk the indexes list is there at its full size; unless checksums=False, local chunks also match the
    manifest's sha256 (data.verify_checksums; its cost: docs/data.md). A shard
    truncated or damaged after the build is refused here, at start-up, not when litdata's reader reaches it mid-run."""
    for split in SPLITS:
        for chunk in _chunks(fs, data.dir, split):
            path = data_path(data.dir, split, chunk["filename"])
            size = fs.size(path) if fs.exists(path) else None
            if size != chunk["chunk_bytes"]:
                found = "missing" if size is None else f"{size:,} of its {chunk['chunk_bytes']:,} bytes"
                raise ConfigError(
                    f"{data.dir}/{split}/{chunk['filename']} is truncated or missing ({found}): {REBUILD}"
                )
    chunks = checksummed_chunks(fs, data, manifest) if checksums else []
    if (bad := first_corrupt(fs, data, chunks)) is not None:
        raise corrupt_chunk(data, chunks[bad])


def checksummed_chunks(fs: fsspec.AbstractFileSystem, data: DataConfig, manifest: dict) -> list[tuple[str, str, str]]:
    """(split, file name, the manifest's sha256) of every chunk to hash: none unless data.verify_checksums and
    data.dir is local (an object store's chunks would all be downloaded first)."""
    checksums = manifest.get("chunk_sha256") if data.verify_checksums and "://" not in data.dir else None
    if not checksums:
        return []
    return [
        (split, chunk["filename"], checksums.get(split, {}).get(chunk["filename"]))
        for split in SPLITS
        for chunk in _chunks(fs, data.dir, split)
    ]


def first_corrupt(
    fs: fsspec.AbstractFileSystem, data: DataConfig, chunks: list[tuple[str, str, str]], share: int = 0, shares: int = 1
) -> int | None:
    """The index of the first chunk of this share (every shares-th, from the share-th on) whose sha256 is not
    the manifest's, or None."""
    for i in range(share, len(chunks), shares):
        split, name, expected = chunks[i]
        if _file_sha256(fs, data_path(data.dir, split, name)) != expected:
            return i
    return None


def corrupt_chunk(data: DataConfig, chunk: tuple[str, str, str]) -> ConfigError:
    split, name, _ = chunk
    return ConfigError(f"{data.dir}/{split}/{name} is corrupt (its sha256 is not the one in {MANIFEST}): {REBUILD}")


def require_sequences(fs: fsspec.AbstractFileSystem, data_dir: str, seq_len: int) -> None:
    """Each split must hold at least one training sequence (TokensLoader never lets one cross a chunk boundary)."""
    for split in SPLITS:
        chunks = tokens_per_chunk(fs, data_dir, split)
        if sum(tokens // (seq_len + 1) for tokens in chunks) == 0:
            raise ConfigError(
                f"{data_dir}/{split}: its {sum(chunks)} tokens make no sequence of model.seq_len + 1 = {seq_len + 1} "
                "tokens; use more text (data.text_files.paths, data.max_chars), a larger data.val_fraction, "
                "or a smaller model.seq_len"
            )
