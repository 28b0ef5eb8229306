"""Loaders (lm-eval `custom_dataset`) of local benchmark files: the original releases' files for the bundled
`keel_<task>` YAMLs (layout in docs/evaluation.md), and `jsonl` also for the copies of lm-eval's own tasks that
`keel eval-data fetch` writes (keel.evaluation.offline). Each returns the documents in the schema of the Hugging
Face dataset that lm-eval's own task reads, so the YAMLs keep lm-eval's doc_to_text/choice/target verbatim.

The directory is the task metadata's `data_dir` (TaskManager(metadata=...): eval.data_dir in training, or
`--metadata data_dir=DIR` on `keel eval`); the YAML's dataset_kwargs name the files in it.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable
from pathlib import Path

from keel.errors import ConfigError

OBQA_CHOICE = re.compile(r"\(([A-D])\) (.*?)(?= \([A-D]\) |$)")
HELLASWAG_LINES = 6  # context, label, four endings


WHERE = "eval.data_dir=DIR in training, --metadata data_dir=DIR on `keel eval`"


def _path(data_dir: str | None, name: str) -> Path:
    if not data_dir:
        raise ConfigError(
            f"data_dir: this task reads local files ({name}, ...) and no directory is set: {WHERE} "
            "(layouts: docs/evaluation.md). lm-eval's own task names (arc_easy, ...) can read the "
            "Hugging Face hub instead"
        )
    path = Path(data_dir) / name
    if not path.is_file():
        raise ConfigError(
            f"data_dir: {path} not found; {WHERE} must name a directory in the layout the task "
            "reads (docs/evaluation.md)"
        )
    return path


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _dataset(data_dir: str | None, files: dict[str, str], read: Callable[[Path], list[dict]]):
    import datasets

    return datasets.DatasetDict(
        {split: datasets.Dataset.from_list(read(_path(data_dir, name))) for split, name in files.items()}
    )


def _arc(path: Path) -> list[dict]:
    # AI2's nested original -> allenai/ai2_arc's flat schema
    return [
        {
            "id": row["id"],
            "question": row["question"]["stem"],
            "choices": {
                "text": [c["text"] for c in row["question"]["choices"]],
                "label": [c["label"] for c in row["question"]["choices"]],
            },
            "answerKey": row["answerKey"],
        }
        for row in _jsonl(path)
    ]


def _boolq(path: Path) -> list[dict]:
    # SuperGLUE packaging stores "true"/"false" strings; aps/super_glue has 0 = False, 1 = True
    return [{**row, "label": int(str(row["label"]).lower() == "true")} for row in _jsonl(path)]


def _hellaswag(path: Path) -> list[dict]:
    # 6 lines per example, already cleaned the way lm-eval's hellaswag process_docs cleans the original
    lines = path.read_text(encoding="utf-8").splitlines()
    return [
        {"query": lines[i], "label": int(lines[i + 1]), "choices": lines[i + 2 : i + HELLASWAG_LINES]}
        for i in range(0, len(lines) - HELLASWAG_LINES + 1, HELLASWAG_LINES)
    ]


def _openbookqa(path: Path) -> list[dict]:
    # OBQA Main TSV -> allenai/openbookqa's "main" schema
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    docs = []
    for row in rows:
        labels, texts = zip(*OBQA_CHOICE.findall(row["Choices"]))
        docs.append(
            {
                "id": row["ID"],
                "question_stem": row["Question Stem"],
                "choices": {"text": list(texts), "label": list(labels)},
                "answerKey": row["Answer Key"],
            }
        )
    return docs


def arc(data_dir: str | None = None, files: dict[str, str] | None = None, **_):
    return _dataset(data_dir, files, _arc)


def boolq(data_dir: str | None = None, files: dict[str, str] | None = None, **_):
    return _dataset(data_dir, files, _boolq)


def hellaswag(data_dir: str | None = None, files: dict[str, str] | None = None, **_):
    return _dataset(data_dir, files, _hellaswag)


def openbookqa(data_dir: str | None = None, files: dict[str, str] | None = None, **_):
    return _dataset(data_dir, files, _openbookqa)


def jsonl(data_dir: str | None = None, files: dict[str, str] | None = None, **_):
    """Files already in the hub dataset's schema (gsm8k, lambada_openai) or read as is (winogrande)."""
    return _dataset(data_dir, files, _jsonl)


def piqa(data_dir: str | None = None, files: dict[str, str] | None = None, labels: str | None = None, **_):
    """PIQA's labels live in a separate file, one 0/1 per line, aligned with the questions."""
    label_values = _path(data_dir, labels).read_text().split()

    def read(path: Path) -> list[dict]:
        rows = _jsonl(path)
        if len(rows) != len(label_values):
            raise ValueError(f"{path}: {len(rows)} questions but {len(label_values)} labels in {labels}")
        return [{**row, "label": int(label)} for row, label in zip(rows, label_values)]

    return _dataset(data_dir, files, read)
