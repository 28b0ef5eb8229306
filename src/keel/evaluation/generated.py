"""The lm-eval loaders of the tasks generated from the training corpus (keel.data.generated_tasks builds them): the
task YAMLs under tasks/generated/ call `load_next_line` / `load_last_token` with the task metadata."""

from __future__ import annotations

from pathlib import Path

from keel.checkpoint.payload import read_payload
from keel.checkpoint.read import read_checkpoint
from keel.data.generated_tasks import read_tasks


def _corpus_dir(corpus_dir: str | None, checkpoint: str | None) -> str:
    """The task metadata's corpus_dir, else the data.dir a checkpoint was trained on (as `keel eval
    --model_args checkpoint=PATH` passes it), else the default data.dir."""
    if corpus_dir:
        return corpus_dir
    if checkpoint:  # a file, a sharded or an exported directory; its weights are not read here (the adapter loads them)
        saved = read_checkpoint(checkpoint, weights=False)
        data_dir = read_payload(saved).config["data"]["dir"]
        if saved.get("exported") and "://" not in data_dir and not Path(data_dir).is_dir():  # export cut the path
            raise FileNotFoundError(
                f"{checkpoint} is an exported model, which records its training data.dir without the path it had "
                f"on the machine that trained it ({data_dir!r}): pass that data.dir as --metadata "
                f'\'{{"corpus_dir": "DIR"}}\' (its val_docs.jsonl holds the generated tasks\' documents)'
            )
        return data_dir
    from keel.config import DataConfig

    return DataConfig().dir


def _load(name: str, corpus_dir: str | None, checkpoint: str | None, tasks_dir: str | None):
    import datasets

    rows = read_tasks(_corpus_dir(corpus_dir, checkpoint), tasks_dir)[name]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


# lm-eval calls custom_dataset(**task metadata, **dataset_kwargs): the metadata carries TaskManager(metadata=...)
# entries (corpus_dir, tasks_dir) and, under lm-eval's command line, the --model_args (checkpoint), plus keys we
# ignore.
def load_next_line(corpus_dir: str | None = None, checkpoint: str | None = None, tasks_dir: str | None = None, **_):
    return _load("keel_next_line", corpus_dir, checkpoint, tasks_dir)


def load_last_token(corpus_dir: str | None = None, checkpoint: str | None = None, tasks_dir: str | None = None, **_):
    return _load("keel_last_token", corpus_dir, checkpoint, tasks_dir)
