"""Hostile checkpoints (docs/failures.md): a pickled payload in a sharded checkpoint's metadata or byte entries,
in a single file or in meta.pt, is refused by every reader before torch unpickles it."""

from __future__ import annotations

import io
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import MetadataIndex

from keel.checkpoint.layout import DCP_METADATA, LAST
from keel.checkpoint.read import read_checkpoint
from keel.checkpoint.safe import read_dcp_metadata
from keel.cli import main as cli_main
from keel.errors import ConfigError
from keel.training import train
from keeltest.distributed import _sharded_checkpoint
from keeltest.runs import tiny_config


class Payload:
    """Unpickled, it writes a marker file: the stand-in for any code a hostile checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


POISONED_ENTRY = "optimizer_0.param_groups.0.lr"  # a byte entry (a pickle) of every FSDP checkpoint


def poison_metadata(path: Path, payload: Payload) -> str:
    (path / DCP_METADATA).write_bytes(pickle.dumps(payload))
    with pytest.raises(Exception):  # noqa: B017 - torch's own reader runs it (then fails on what it returned)
        FileSystemReader(path).read_metadata()
    return f"{DCP_METADATA} refused"


def poison_byte_entry(path: Path, payload: Payload) -> str:
    """Point POISONED_ENTRY at the payload, torch.save'd at the end of its .distcp file; .metadata stays clean
    (re-pickled with the entry's new offset and length)."""
    metadata = read_dcp_metadata(path)
    info = metadata.storage_data[MetadataIndex(POISONED_ENTRY)]
    shard, saved = path / info.relative_path, io.BytesIO()
    torch.save(payload, saved)
    info.offset, info.length = shard.stat().st_size, len(saved.getvalue())
    with open(shard, "ab") as f:
        f.write(saved.getvalue())
    (path / DCP_METADATA).write_bytes(pickle.dumps(metadata))
    # torch's own load of the optimizer's param_groups, as the FSDP strategy's resume does, runs it
    dcp_load(
        {"optimizer_0": {"param_groups": [{"lr": 0.0}]}},
        checkpoint_id=path,
        no_dist=True,
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    return f"{info.relative_path} refused: its entry {POISONED_ENTRY}"


@dataclass
class Hostile:
    path: Path  # a real sharded checkpoint with a payload inside
    marker: Path  # the file the payload writes
    refusal: str  # what the message says after the checkpoint's path

    def refused(self, err: str, path: Path | None = None) -> None:
        assert any(
            f"{path or self.path}/{self.refusal}" in line and "builtins.exec" in line for line in err.splitlines()
        ), err  # in one line
        assert not self.marker.exists(), "the payload ran"


@pytest.fixture(params=[poison_metadata, poison_byte_entry], ids=["in .metadata", "in a byte entry"])
def hostile_checkpoint(request, tmp_path) -> Hostile:
    """A real sharded checkpoint whose .metadata, or one of whose byte entries, torch would unpickle into a
    payload: shown to run under torch's own reader, then its marker is removed."""
    path, marker = tmp_path / "downloaded.ckpt", tmp_path / "payload-ran"
    _sharded_checkpoint(path)
    refusal = request.param(path, Payload(marker))
    assert marker.read_text() == "ran"  # the payload is live
    marker.unlink()
    return Hostile(path, marker, refusal)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_payload_in_sharded_checkpoint_is_refused_by_read_consolidate_eval_generate_and_export(
    hostile_checkpoint, tmp_path, capsys
):
    path = hostile_checkpoint.path
    for weights in (True, False):
        with pytest.raises(ConfigError) as err:
            read_checkpoint(path, weights=weights)
        hostile_checkpoint.refused(str(err.value))
    assert cli_main(["consolidate", str(path), str(tmp_path / "out.ckpt")]) == 2
    hostile_checkpoint.refused(capsys.readouterr().err)
    assert not (tmp_path / "out.ckpt").exists()
    assert cli_main(["eval", "--model_args", f"checkpoint={path}", "--tasks", "keel_next_line", "--device", "cpu"]) == 2
    hostile_checkpoint.refused(capsys.readouterr().err)
    assert cli_main(["generate", f"checkpoint={path}", "--prompt", "def "]) == 2
    hostile_checkpoint.refused(capsys.readouterr().err)
    assert cli_main(["export", f"checkpoint={path}", "--out", str(tmp_path / "hf")]) == 2
    hostile_checkpoint.refused(capsys.readouterr().err)
    assert not (tmp_path / "hf").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_payload_in_sharded_checkpoint_is_refused_on_resume_and_init_from(hostile_checkpoint, tiny_data, tmp_path):
    path = hostile_checkpoint.path
    for source in (f"resume={path}", f"init_from={path}"):
        with pytest.raises(ConfigError) as err:
            train(tiny_config(tiny_data, tmp_path / "run", source))
        hostile_checkpoint.refused(str(err.value))
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before training
    run = tmp_path / "auto"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(path, run / "checkpoints" / LAST)  # resume=auto finds a directory last.ckpt
    with pytest.raises(ConfigError) as err:
        train(tiny_config(tiny_data, run, "resume=auto"))
    hostile_checkpoint.refused(str(err.value), run / "checkpoints" / LAST)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_fsdp_strategy_checks_the_checkpoint_before_torch_loads_it(hostile_checkpoint):
    from keel.strategy import FSDP2Strategy

    strategy = FSDP2Strategy(data_parallel_size=1, tensor_parallel_size=1, save_distributed_checkpoint=True)
    with pytest.raises(ConfigError) as err:
        strategy.load_checkpoint(hostile_checkpoint.path)
    hostile_checkpoint.refused(str(err.value))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_metadata_of_another_type_is_refused(tmp_path):
    path = tmp_path / "odd.ckpt"
    _sharded_checkpoint(path)
    (path / DCP_METADATA).write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(ConfigError, match="holds a dict, not a checkpoint index"):
        read_checkpoint(path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_payload_in_a_single_file_or_meta_pt_is_refused_naming_it_not_with_torchs_advice(tmp_path, capsys):
    """They were refused, but as "corrupt or truncated?" with torch's advice that weights_only=False "will likely
    succeed": the unsafe retry."""
    marker = tmp_path / "payload-ran"
    single, sharded = tmp_path / "downloaded.ckpt", tmp_path / "sharded.ckpt"
    torch.save({"keel": {}, "state_dict": {}, "hook": Payload(marker)}, single)
    _sharded_checkpoint(sharded)
    torch.save({"keel": {}, "hook": Payload(marker)}, sharded / "meta.pt")
    for path, file in ((single, single), (sharded, sharded / "meta.pt")):
        for weights in (True, False):
            with pytest.raises(ConfigError) as err:
                read_checkpoint(path, weights=weights)
            assert str(err.value) == (
                f"checkpoint: {file} refused: it refers to builtins.exec, which a checkpoint "
                "never holds; it may have been made to run code when loaded: do not use this "
                "checkpoint"
            )
        assert cli_main(["generate", f"checkpoint={path}"]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "weights_only=False" not in err and "refers to builtins.exec" in err
    assert not marker.exists()
