"""The data's config (`data.*`): what `keel data` builds and how training reads it, and one section per source
(`data.<source>.*`, the keys of that source alone). keel.data.sources maps each source's name to the code that
reads it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from keel.errors import require


def _is_text_codec(name: str) -> bool:
    try:  # (not b"": that is "" whatever the name)
        b"a".decode(name, errors="replace")  # LookupError for unknown names and for codecs of bytes (base64, zlib)
    except (LookupError, UnicodeError):  # UnicodeError: the codec "undefined"
        return False
    return True


class SourceConfig:
    """A source's own keys, `data.<name>.*`: a dataclass subclass, and a field of DataConfig named after it."""

    def check(self) -> None:
        """Checks that hold only when data.source selects this source; none by default."""


@dataclass
class StdlibConfig(SourceConfig):
    """data.source=stdlib: the running Python's standard library .py files (no keys of its own)."""


@dataclass
class TextFilesConfig(SourceConfig):
    """data.source=text_files: local files matched by globs."""

    paths: list[str] = field(default_factory=list)  # globs of .txt/.md/.py/.jsonl/.parquet files (`**` allowed)
    text_field: str = "text"  # the .jsonl field / .parquet column holding the text
    # cut longer plain-text files (not .py), and .jsonl records on lines of 4 MiB or more, into documents of ~this
    # size; 0 = never
    doc_chars: int = 4000

    def __post_init__(self) -> None:
        require(self.doc_chars >= 0, "data.text_files.doc_chars", "must be >= 0 (0 = one document per plain-text file)")

    def check(self) -> None:
        require(bool(self.paths), "data.text_files.paths", "data.source=text_files needs at least one glob in it")


@dataclass
class HFConfig(SourceConfig):
    """data.source=hf: a Hugging Face hub dataset, streamed."""

    dataset: str = "HuggingFaceFW/fineweb-edu"
    name: str | None = "sample-10BT"
    split: str = "train"
    text_field: str = "text"  # the column holding the text


@dataclass
class DataConfig:
    source: str = "stdlib"  # which source reads the corpus: one of SOURCES, configured by its section below
    dir: str = "data/stdlib"  # shard directory (local path or an object-store URL litdata supports)
    encoding: str = "utf-8"  # the codec plain-text, .py and .jsonl files are decoded with (stdlib, text_files)
    max_chars: int = 0  # stop reading the source after this many characters; 0 = all
    tokenizer: str | None = None  # tokenizer.json path or hub name; null = train a byte-level BPE
    vocab_size: int = 4096  # for the trained BPE
    val_fraction: float = 0.02  # held-out documents
    seed: int = 0  # which documents are held out, and the order `keel data` writes them in
    shuffle_documents: bool = True  # write documents in a seeded random order, so each chunk samples the corpus
    shuffle_window: int = 0  # training reads: 0 = a full permutation of each chunk's sequences; N = litdata's
    # windowed shuffle (aligned blocks of N consecutive sequences), only for object stores where locality pays
    verify_checksums: bool = True  # at start-up, local shards against the manifest's sha256 (its cost: docs/data.md)
    cache_dir: str | None = None  # object-store data.dir: local chunk cache; null = litdata's (~/.lightning/chunks)
    prepare_workers: int = 2  # processes for `keel data`
    # DataLoader workers while training (0: in the main process); auto: GPU_LOADER_WORKERS on GPUs (the next batches
    # read while the GPU computes, into pinned memory), 0 on CPU, whose step is far slower than reading; resolved at
    # load time (keel.config.Config), so config.yaml holds the number
    loader_workers: int | str = "auto"
    chunk_bytes: str = "16MB"
    # each source's own keys, data.<source>.*: read when data.source names it (adding a source: its section here)
    stdlib: StdlibConfig = field(default_factory=StdlibConfig)
    text_files: TextFilesConfig = field(default_factory=TextFilesConfig)
    hf: HFConfig = field(default_factory=HFConfig)

    def __post_init__(self) -> None:
        require(self.source in SOURCES, "data.source", f"unknown source {self.source!r}; allowed: {', '.join(SOURCES)}")
        require(0 < self.val_fraction < 1, "data.val_fraction", "must be in (0, 1)")
        require(
            self.shuffle_window >= 0,
            "data.shuffle_window",
            "must be >= 0 (0 = full permutation of each chunk; N = windows of N consecutive sequences)",
        )
        require(
            _is_text_codec(self.encoding),
            "data.encoding",
            f"{self.encoding!r} is not a text codec Python knows; use one such as utf-8, latin-1, cp1252, utf-16",
        )
        require(self.vocab_size >= 260, "data.vocab_size", "must be >= 260 (256 bytes + special tokens)")
        require(
            self.loader_workers == "auto" or (isinstance(self.loader_workers, int) and self.loader_workers >= 0),
            "data.loader_workers",
            f"must be auto or >= 0 workers; got {self.loader_workers!r}",
        )
        require(self.prepare_workers >= 1, "data.prepare_workers", f"must be >= 1; got {self.prepare_workers}")
        self.source_config.check()

    @property
    def source_config(self) -> SourceConfig:
        """The section of data.source: its own keys."""
        return getattr(self, self.source)


# data.source's allowed values: the names of DataConfig's source sections, in their order
SOURCES = tuple(
    f.name
    for f in fields(DataConfig)
    if isinstance(f.default_factory, type) and issubclass(f.default_factory, SourceConfig)
)
# data.<key> -> the source sections' keys it became: an old spelling is refused naming them (keel.config.loading),
# and a config saved with it (a checkpoint's, a run's config.yaml) is read with its value moved there
MOVED_KEYS = {
    "paths": [("text_files", "paths")],
    "doc_chars": [("text_files", "doc_chars")],
    "text_field": [("text_files", "text_field"), ("hf", "text_field")],
    "hf_dataset": [("hf", "dataset")],
    "hf_name": [("hf", "name")],
    "hf_split": [("hf", "split")],
}


def new_spelling(key: str) -> str:
    """What data.<key>, a key of MOVED_KEYS, is spelled now, e.g. `data.text_files.paths`."""
    return " or ".join(f"data.{section}.{new}" for section, new in MOVED_KEYS[key])


def with_sections(saved: dict) -> dict:
    """A data config saved before each source had its section, with the keys that moved put in their sections."""
    moved = {key: value for key, value in saved.items() if key in MOVED_KEYS}
    data = {key: value for key, value in saved.items() if key not in moved}
    for key, value in moved.items():
        for section, new in MOVED_KEYS[key]:
            data[section] = {**data.get(section, {}), new: value}
    return data
