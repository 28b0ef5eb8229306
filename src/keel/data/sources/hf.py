"""data.source=hf: a Hugging Face hub dataset, streamed (nothing is downloaded in full)."""

from __future__ import annotations

from collections.abc import Iterator

from keel.config import DataConfig
from keel.data.sources.base import SkippedFiles, Source, text_of
from keel.errors import ConfigError


class HuggingFace(Source):
    name = "hf"

    def documents(self, data: DataConfig, skipped: SkippedFiles) -> Iterator[tuple[str, str]]:
        hf = data.hf
        try:
            import datasets
        except ImportError:
            raise ConfigError("data.source=hf needs the `datasets` package: pip install -e '.[hf]'") from None
        try:
            stream = datasets.load_dataset(hf.dataset, name=hf.name, split=hf.split, streaming=True)
        except Exception as err:  # hub unreachable, unknown dataset / config / split: all end up here
            raise ConfigError(
                f"data.hf.dataset: cannot stream {hf.dataset!r} (data.hf.name={hf.name!r}, "
                f"data.hf.split={hf.split!r}) from the Hugging Face hub: {err}. Check the names and the network, "
                "or use data.source=text_files on a local copy"
            ) from err
        for index, record in enumerate(stream):
            text = text_of(record, "data.hf.text_field", hf.text_field, f"record {index}")
            yield f"{hf.dataset}/{hf.name}/{hf.split}:{index}", text

    def describe(self, data: DataConfig) -> str:
        hf = data.hf
        return f"Hugging Face dataset {hf.dataset} (name {hf.name}, split {hf.split}, field {hf.text_field!r})"
