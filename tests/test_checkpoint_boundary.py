"""A sharded checkpoint's directory is a boundary (docs/failures.md): a `.metadata` naming a shard file outside it -
another run's, by `../`, by an absolute path or through a symlink - is refused by every reader, in one line naming
the entry and the directory, before a byte of that file is read."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import load as dcp_load

from keel.checkpoint.layout import DCP_METADATA, LAST
from keel.checkpoint.read import read_checkpoint
from keel.checkpoint.safe import read_dcp_metadata
from keel.cli import main as cli_main
from keel.dirlock import LOCK
from keel.errors import ConfigError
from keel.training import train
from keeltest.distributed import _sharded_checkpoint
from keeltest.runs import tiny_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # _sharded_checkpoint, dcp_load

ENTRY = "state_dict.model.embed.weight"  # the entry whose shard file .metadata is made to name elsewhere
SHARD = "__0_0.distcp"  # the one shard file of a checkpoint saved by one process


def rename_shard(path: Path, name, entry: str = ENTRY) -> None:
    """Re-pickle path's .metadata with `entry` read from the file `name`, at the same offset."""
    metadata = read_dcp_metadata(path)
    next(info for index, info in metadata.storage_data.items() if index.fqn == entry).relative_path = name
    (path / DCP_METADATA).write_bytes(pickle.dumps(metadata))


def up_and_over(path: Path, other_shard: Path) -> str:
    return f"../{other_shard.parent.name}/{other_shard.name}"


def absolute(path: Path, other_shard: Path) -> str:
    return str(other_shard)  # a file large enough for every offset: the truncation check does not catch it


def symlink(path: Path, other_shard: Path) -> str:
    (path / "__1_0.distcp").symlink_to(other_shard)  # a name in the directory, leading out of it
    return "__1_0.distcp"


@dataclass
class Escaped:
    path: Path  # a run's real sharded last.ckpt, ENTRY read from another checkpoint's shard file
    name: str  # what its .metadata names for ENTRY
    other_shard: Path  # where that leads

    def refused(self, err: str) -> None:
        expected = (
            f"checkpoint: {self.path}/{DCP_METADATA} refused: it must name shard files in {self.path} itself, "
            f"but its entry {ENTRY} is read from {self.name!r}, which leads to {self.other_shard}; do not use "
            "this checkpoint"
        )
        assert any(expected in line for line in err.splitlines()), err  # in one line


@pytest.fixture(params=[up_and_over, absolute, symlink], ids=["../other.ckpt", "absolute path", "symlink"])
def escaped(request, tmp_path) -> Escaped:
    """run/checkpoints/last.ckpt, ENTRY read from the shard of other.ckpt beside it (a model of the same shapes):
    torch's own reader is shown to load the other's weights silently."""
    path, other = tmp_path / "run" / "checkpoints" / LAST, tmp_path / "run" / "checkpoints" / "other.ckpt"
    own, _ = _sharded_checkpoint(path)
    theirs, _ = _sharded_checkpoint(other)
    name = request.param(path, other / SHARD)
    rename_shard(path, name)
    loaded = {"state_dict": {"model.embed.weight": torch.empty_like(own.embed.weight)}}
    dcp_load(loaded, checkpoint_id=path, no_dist=True)  # torch's FileSystemReader
    assert torch.equal(loaded["state_dict"]["model.embed.weight"], theirs.embed.weight)
    assert not torch.equal(theirs.embed.weight, own.embed.weight)
    return Escaped(path, name, (other / SHARD).resolve())


# Each reader of a sharded checkpoint, given the run's last.ckpt (and a new run dir, for train): what it said


def _raised(call) -> str:
    with pytest.raises(ConfigError) as err:
        call()
    return str(err.value)


def _cli(request, *argv: str) -> str:
    assert cli_main(list(argv)) == 2
    err = request.getfixturevalue("capsys").readouterr().err  # the test's own, capturing from its start
    assert err.splitlines()[-1].startswith(f"keel {argv[0]}: config error: "), err  # it ends with the refusal
    return err  # (keel eval's stderr also has lm-eval's log lines before it)


def _train(request, run: Path, *overrides: str) -> str:
    return _raised(lambda: train(tiny_config(request.getfixturevalue("tiny_data"), run, *overrides)))


def _fsdp_load(path: Path) -> None:
    from keel.strategy import FSDP2Strategy

    FSDP2Strategy(data_parallel_size=1, tensor_parallel_size=1, save_distributed_checkpoint=True).load_checkpoint(path)


def _new_run(path: Path) -> Path:
    return path.parents[2] / "new"


READERS = {
    "read_checkpoint": lambda path, request: _raised(lambda: read_checkpoint(path)),
    "read_checkpoint without weights": lambda path, request: _raised(lambda: read_checkpoint(path, weights=False)),
    "keel consolidate": lambda path, request: _cli(request, "consolidate", str(path), str(path.parent / "one.ckpt")),
    "keel eval": lambda path, request: _cli(
        request, "eval", "--model_args", f"checkpoint={path}", "--tasks", "keel_next_line", "--device", "cpu"
    ),
    "keel generate": lambda path, request: _cli(request, "generate", f"checkpoint={path}", "--prompt", "def "),
    "keel export": lambda path, request: _cli(
        request, "export", f"checkpoint={path}", "--out", str(path.parent / "hf")
    ),
    "resume=PATH": lambda path, request: _train(request, _new_run(path), f"resume={path}"),
    "init_from=PATH": lambda path, request: _train(request, _new_run(path), f"init_from={path}"),
    "resume=auto": lambda path, request: _train(request, path.parents[1], "resume=auto"),
    "FSDP strategy's load_checkpoint": lambda path, request: _raised(lambda: _fsdp_load(path)),
}


def tree(root: Path) -> dict[str, int | None]:
    """Every path under root, with its mtime if a file; not the run dirs' lock files, which train takes before it
    reads a checkpoint and leaves, released and empty (tests/test_run_dir.py)."""
    return {
        str(path.relative_to(root)): None if path.is_dir() else path.lstat().st_mtime_ns
        for path in root.rglob("*")
        if path.name != LOCK
    }


def refused_writing_nothing(escaped: Escaped, reader: str, request, tmp_path: Path) -> None:
    _new_run(escaped.path).mkdir()
    before = tree(tmp_path)
    escaped.refused(READERS[reader](escaped.path, request))
    assert tree(tmp_path) == before  # no consolidated file, no export, no checkpoint, event file or config.yaml


@pytest.mark.parametrize("reader", [name for name in READERS if name != "keel eval"])
def test_every_reader_refuses_a_shard_file_outside_the_checkpoint(escaped, reader, request, tmp_path, capsys):
    refused_writing_nothing(escaped, reader, request, tmp_path)


@pytest.mark.parametrize("escaped", [up_and_over], ids=["../other.ckpt"], indirect=True)
def test_keel_eval_refuses_a_shard_file_outside_the_checkpoint(escaped, request, tmp_path, capsys):
    """One escape only: lm-eval takes some 15 s to start, and the check it reaches is the one tested above."""
    refused_writing_nothing(escaped, "keel eval", request, tmp_path)


def test_shard_names_that_stay_in_the_directory_are_read(tmp_path):
    path = tmp_path / "step000004.ckpt"
    model, _ = _sharded_checkpoint(path)
    (path / "sub").mkdir()
    rename_shard(path, f"sub/../{SHARD}")
    (path / "__1_0.distcp").symlink_to(SHARD)  # a link, to the file beside it
    rename_shard(path, "__1_0.distcp", "state_dict.model.head.weight")
    (tmp_path / "latest").symlink_to(path)  # the checkpoint itself reached through a link
    for given in (path, tmp_path / "latest"):
        weights = read_checkpoint(given)["state_dict"]
        assert all(torch.equal(weights[f"model.{k}"], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", [None, "loop.distcp"], ids=["not a path", "a symlink loop"])
def test_a_shard_name_that_is_no_file_name_is_refused(tmp_path, name):
    path = tmp_path / "last.ckpt"
    _sharded_checkpoint(path)
    (path / "loop.distcp").symlink_to("loop.distcp")
    rename_shard(path, name)
    with pytest.raises(ConfigError) as err:
        read_checkpoint(path)
    assert (
        f"refused: it must name shard files in {path} itself, but its entry {ENTRY} is read from {name!r}, "
        "which is no file name (" in str(err.value)
    )
