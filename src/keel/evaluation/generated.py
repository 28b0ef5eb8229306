"""Tasks generated from the training corpus's held-out documents (`<data.dir>/val_docs.jsonl`, written by
`keel data`): downstream signal that a small model trained for minutes can already show.

    keel_next_line   4-way multiple choice: given the preceding lines of a held-out file, pick the true next
                     line; the 3 distractors are lines of about its length from *other* held-out files, so
                     gold line and distractors come from the same distribution of lines (chance is exactly
                     25%) and only the context (indentation, names in scope, the statement under way) tells
                     them apart.
    keel_last_token  LAMBADA-style: predict the identifier that ends a line, one that already occurs in the
                     preceding lines, so it is recoverable from context (chance ~0: open vocabulary).

`generate_tasks(corpus_dir)` writes one jsonl per task under `<corpus_dir>/eval_tasks/v1/`, deterministically
(fixed seed, documents in val_docs.jsonl order), and rewrites them only when val_docs.jsonl is newer. The
task YAMLs load them through `load_next_line` / `load_last_token` (lm-eval `custom_dataset`).
"""

from __future__ import annotations

import bisect
import json
import keyword
import os
import random
import re
from pathlib import Path

from keel.checkpoint import read_checkpoint
from keel.data.shards import VAL_DOCS

TASKS_SUBDIR = "eval_tasks/v1"  # bump when the generator changes: files of an older one are not reused
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


def generate_tasks(corpus_dir: str | os.PathLike) -> dict[str, Path]:
    """Write (if missing or older than val_docs.jsonl) and return {task name: jsonl path} for the generated tasks."""
    corpus = Path(corpus_dir)
    source = corpus / VAL_DOCS
    if not source.is_file():
        raise FileNotFoundError(f"no {VAL_DOCS} in {corpus}: run `keel data` for this data.dir first")
    out_dir = corpus / TASKS_SUBDIR
    paths = {name: out_dir / f"{name}.jsonl" for name in BUILDERS}
    if all(p.is_file() and p.stat().st_mtime >= source.stat().st_mtime for p in paths.values()):
        return paths
    with open(source, encoding="utf-8") as f:
        docs = [json.loads(line)["text"].splitlines() for line in f if line.strip()]
    if len(docs) < 2:
        raise ValueError(f"{source}: the generated tasks need at least 2 held-out documents, found {len(docs)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, build in BUILDERS.items():
        examples = build(docs, random.Random(f"{SEED}:{name}"))
        # Atomic: every rank of a multi-process run may generate at once; readers never see a partial file.
        tmp = paths[name].with_name(f".{paths[name].name}.tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(example) + "\n" for example in examples), encoding="utf-8")
        os.replace(tmp, paths[name])
    return paths


def _corpus_dir(corpus_dir: str | None, checkpoint: str | None) -> str:
    """The task metadata's corpus_dir, else the data.dir a checkpoint was trained on (as `keel eval
    --model_args checkpoint=PATH` passes it), else the default data.dir."""
    if corpus_dir:
        return corpus_dir
    if checkpoint:  # a file or a sharded directory; its weights are not read here (the adapter loads them)
        return read_checkpoint(checkpoint, weights=False)["keel"]["config"]["data"]["dir"]
    from keel.config import DataConfig

    return DataConfig().dir


def _load(name: str, corpus_dir: str | None, checkpoint: str | None):
    import datasets

    path = generate_tasks(_corpus_dir(corpus_dir, checkpoint))[name]
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


# lm-eval calls custom_dataset(**task metadata, **dataset_kwargs): the metadata carries TaskManager(metadata=...)
# entries (corpus_dir) and, under lm-eval's command line, the --model_args (checkpoint), plus keys we ignore.
def load_next_line(corpus_dir: str | None = None, checkpoint: str | None = None, **_):
    return _load("keel_next_line", corpus_dir, checkpoint)


def load_last_token(corpus_dir: str | None = None, checkpoint: str | None = None, **_):
    return _load("keel_last_token", corpus_dir, checkpoint)
