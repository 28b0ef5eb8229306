"""data.source=hf: a Hugging Face hub dataset, streamed (nothing is downloaded in full)."""

from __future__ import annotations

from collections.abc import Iterator

from keel.data.sources.base import DataSettings, SkippedFiles, Source, text_of
from keel.errors import ConfigError


class HuggingFace(Source):
    name = "hf"
    settings = ("hf_dataset", "hf_name", "hf_split", "text_field")

    def documents(self, data: DataSettings, skipped: SkippedFiles) -> Iterator[tuple[str, str]]:
        try:
            import datasets
        except ImportError:
            raise ConfigError("data.source=hf needs the `datasets` package: pip install -e '.[hf]'") from None
        try:
            stream = datasets.load_dataset(data.hf_dataset, name=data.hf_name, split=data.hf_split, streaming=True)
        except Exception as err:  # hub unreachable, unknown dataset / config / split: all end up here
            raise ConfigError(
                f"data.hf_dataset: cannot stream {data.hf_dataset!r} (data.hf_name={data.hf_name!r}, "
                f"data.hf_split={data.hf_split!r}) from the Hugging Face hub: {err}. Check the names and the network, "
                "or use data.source=text_files on a local copy"
            ) from err
        for index, record in enumerate(stream):
            text = text_of(record, data.text_field, f"record {index}")
            yield f"{data.hf_dataset}/{data.hf_name}/{data.hf_split}:{index}", text

    def describe(self, data: DataSettings) -> str:
        return (f"Hugging Face dataset {data.hf_dataset} (name {data.hf_name}, split {data.hf_split}, "
                f"field {data.text_field!r})")
