"""Tasks generated from the training corpus's held-out documents (`<data.dir>/val_docs.jsonl`, written by
`keel data`): downstream signal that a small model trained for minutes can already show. Built here, below both
`keel data` (which writes them beside the shards) and the evaluation's task loaders (keel.evaluation.generated).

    keel_next_line   4-way multiple choice: the true next line of a held-out file against 3 lines of about its
                     length from other files (chance exactly 25%; only the context tells them apart)
    keel_last_token  LAMBADA-style: the identifier that ends a line, one already in the preceding lines

`keel data` writes one jsonl per task under `<data.dir>/eval_tasks/v2/`, deterministically; for a data.dir built
before it did, generate_tasks writes them under a local directory it is given (training: run.dir), never into
data.dir. The task YAMLs load them through keel.evaluation.generated's `load_next_line` / `load_last_token`
(docs/evaluation.md).
"""

from __future__ import annotations

import bisect
import json
import keyword
import os
import posixpath
import random
import re
import secrets
import socket
from collections.abc import Iterable
from pathlib import Path

import fsspec

from keel.data.shards import VAL_DOCS, data_path, storage

TASKS_SUBDIR = "eval_tasks/v2"  # bump when the generator changes: files of an older one are not reused
# the held-out text the tasks are drawn from: its first documents up to this many characters - ample for EXAMPLES per
# task, and what `keel data` holds in memory to build them stays bounded whatever the size of the held-out split
SOURCE_CHARS = 2**20
EXAMPLES = 500  # per task; in-loop evaluation uses the first eval.limit of them (the order is shuffled)
SEED = 0
CONTEXT_LINES = 8
CHOICES = 4
MIN_LINE_CHARS, MAX_LINE_CHARS = 4, 80  # candidate lines: no lone brackets, no long data rows
LENGTH_NEIGHBOURS = 100  # next-line distractors come from the ~2 x 100 candidate lines closest in length
FINAL_IDENTIFIER = re.compile(r"(?<!\w)[A-Za-z_]\w{2,}$")  # a word of 3+ characters ending the line


def _is_candidate(line: str) -> bool:
    return MIN_LINE_CHARS <= len(line.strip()) <= MAX_LINE_CHARS


def _next_line_examples(docs: list[list[str]], rng: random.Random) -> list[dict]:
    # Distractors are drawn among the lines closest in length to the gold line (lengths decide much of a
    # summed log-likelihood; matched, the comparison rests on content), from other files only.
    pool = sorted((len(line.strip()), d, line) for d, lines in enumerate(docs) for line in lines if _is_candidate(line))
    lengths = [length for length, _, _ in pool]
    positions = [
        (d, i)
        for d, lines in enumerate(docs)
        for i in range(CONTEXT_LINES, len(lines))
        if _is_candidate(lines[i]) and sum(map(_is_candidate, lines[i - CONTEXT_LINES : i])) >= 2
    ]
    examples = []
    for d, i in rng.sample(positions, min(EXAMPLES, len(positions))):
        gold_line = docs[d][i]
        center = bisect.bisect_left(lengths, len(gold_line.strip()))
        span = LENGTH_NEIGHBOURS
        while True:  # widened where one file fills the neighbourhood (e.g. a codec table's identical rows)
            nearby = pool[max(0, center - span) : center + span]
            candidates = {
                line.strip(): line for _, other, line in nearby if other != d and line.strip() != gold_line.strip()
            }
            if len(candidates) >= CHOICES - 1 or span >= len(pool):
                break
            span *= 2
        distractors = rng.sample(list(candidates.values()), CHOICES - 1)  # distinct texts, in pool order
        gold = rng.randrange(CHOICES)
        choices = distractors[:gold] + [gold_line] + distractors[gold:]
        context = "\n".join(docs[d][i - CONTEXT_LINES : i]) + "\n"
        examples.append({"context": context, "choices": choices, "gold": gold})
    return examples


def _final_identifier(line: str) -> re.Match | None:
    match = FINAL_IDENTIFIER.search(line.rstrip())
    if match is None or keyword.iskeyword(match.group()) or not line[: match.start()].strip():
        return None  # a keyword, or a line that is nothing but the identifier
    return match


def _last_token_examples(docs: list[list[str]], rng: random.Random) -> list[dict]:
    examples = []
    for lines in docs:
        for i in range(1, len(lines)):
            match = _final_identifier(lines[i])
            preceding = "\n".join(lines[max(0, i - CONTEXT_LINES) : i])
            if match and re.search(rf"\b{match.group()}\b", preceding):
                context = preceding + "\n" + lines[i][: match.start()]
                examples.append({"context": context, "target": match.group()})
    return rng.sample(examples, min(EXAMPLES, len(examples)))


BUILDERS = {"keel_next_line": _next_line_examples, "keel_last_token": _last_token_examples}


def task_files(root: str) -> dict[str, str]:
    """{task name: path or URL} of the generated tasks under root: a data.dir (where `keel data` writes them) or
    the directory the loaders write them under for a data.dir built without them (training: run.dir)."""
    return {name: data_path(root, TASKS_SUBDIR, f"{name}.jsonl") for name in BUILDERS}


def build_tasks(val_docs: Iterable[str]) -> dict[str, bytes]:
    """{task name: its jsonl} from the lines of a val_docs.jsonl, its first SOURCE_CHARS characters: deterministic
    (fixed seed, documents in order)."""
    docs, chars = [], 0
    for line in val_docs:
        if chars >= SOURCE_CHARS:
            break
        if line.strip():
            text = json.loads(line)["text"][: SOURCE_CHARS - chars]
            docs.append(text.splitlines())
            chars += len(text)
    if len(docs) < 2:
        raise ValueError(f"the generated tasks need at least 2 held-out documents ({VAL_DOCS}), found {len(docs)}")
    return {
        name: "".join(json.dumps(example) + "\n" for example in build(docs, random.Random(f"{SEED}:{name}"))).encode()
        for name, build in BUILDERS.items()
    }


def write_tasks(fs: fsspec.AbstractFileSystem, root: str, tasks: dict[str, bytes]) -> dict[str, str]:
    """Write build_tasks' files under root (on fs, local or an object store); each appears whole: written under a
    name no other process or host uses, then moved into place. Returns task_files(root)."""
    paths = task_files(root)
    unique = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
    for name, content in tasks.items():
        fs.makedirs(posixpath.dirname(paths[name]), exist_ok=True)
        tmp = f"{posixpath.dirname(paths[name])}/.{name}.jsonl.{unique}.tmp"
        fs.pipe_file(tmp, content)
        fs.mv(tmp, paths[name])
    return paths


def _current(fs: fsspec.AbstractFileSystem, paths: dict[str, str], source_modified: float) -> bool:
    return all(fs.isfile(path) and fs.modified(path).timestamp() >= source_modified for path in paths.values())


def generate_tasks(corpus_dir: str | os.PathLike, tasks_dir: str | os.PathLike | None = None) -> dict[str, Path | str]:
    """{task name: local Path or object-store URL} of the generated tasks of a `keel data` directory (local or a
    URL): its own, written by `keel data` beside the shards; else those under tasks_dir (a local directory; default:
    corpus_dir itself where it is local and writable), written there if missing or older than val_docs.jsonl. An
    object-store or read-only data directory is never written: without a tasks_dir, {} (read_tasks then builds the
    tasks in memory)."""
    corpus = str(corpus_dir)
    fs = storage(corpus)
    source = data_path(corpus, VAL_DOCS)
    if not fs.isfile(source):
        raise FileNotFoundError(f"no {VAL_DOCS} in {corpus}: run `keel data` for this data.dir first")
    modified = fs.modified(source).timestamp()
    if _current(fs, own := task_files(corpus), modified):
        return {name: path if "://" in path else Path(path) for name, path in own.items()}
    if tasks_dir is None and "://" not in corpus and os.access(corpus, os.W_OK):
        tasks_dir = corpus
    if tasks_dir is None:
        return {}
    local = fsspec.filesystem("file")
    if not _current(local, task_files(str(tasks_dir)), modified):
        write_tasks(local, str(tasks_dir), _build_from(fs, source))
    return {name: Path(path) for name, path in task_files(str(tasks_dir)).items()}


def _build_from(fs: fsspec.AbstractFileSystem, val_docs: str) -> dict[str, bytes]:
    with fs.open(val_docs, "rt", encoding="utf-8") as f:
        try:
            return build_tasks(f)
        except ValueError as err:
            raise ValueError(f"{val_docs}: {err}") from None


def read_tasks(corpus_dir: str, tasks_dir: str | None = None) -> dict[str, list[dict]]:
    """{task name: its examples}, from the files generate_tasks finds or writes, else built in memory."""
    if paths := generate_tasks(corpus_dir, tasks_dir):
        contents = {}
        for name, path in paths.items():
            with fsspec.open(str(path), "rb") as f:
                contents[name] = f.read()
    else:
        contents = _build_from(storage(corpus_dir), data_path(corpus_dir, VAL_DOCS))
    return {
        name: [json.loads(line) for line in content.decode("utf-8").splitlines()] for name, content in contents.items()
    }
