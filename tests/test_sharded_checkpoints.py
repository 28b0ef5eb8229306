"""Sharded (FSDP) checkpoints: consolidation, broken checkpoints refused, the commit surviving a crash between
renames, and a resume under another split of the same global batch."""

from __future__ import annotations

import os

import pytest
import torch

from keel.checkpoint.layout import LAST, SHARDED_META, previous_path, staging_path
from keel.checkpoint.read import load_model, read_checkpoint
from keel.checkpoint.resume import check_training_state, resolve_resume
from keel.checkpoint.write import commit_dir
from keel.cli import main as cli_main
from keel.errors import ConfigError
from keeltest.distributed import _sharded_checkpoint, _tiny_cfg


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # _sharded_checkpoint saves in one process
def test_consolidate_and_broken_sharded_checkpoints(tmp_path, capsys):
    sharded = tmp_path / "last.ckpt"
    model, cfg = _sharded_checkpoint(sharded)
    out = tmp_path / "model.ckpt"
    assert cli_main(["consolidate", str(sharded), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    for path in (out, sharded):  # load_model reads either
        loaded, loaded_cfg, _ = load_model(path)
        assert loaded_cfg == cfg
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    meta = read_checkpoint(sharded, weights=False)
    assert "state_dict" not in meta and meta["global_step"] == 3

    with pytest.raises(ConfigError, match="is a sharded .FSDP. checkpoint; resume it with trainer=fsdp"):
        check_training_state(cfg.trainer, sharded, meta)
    with pytest.raises(ConfigError, match="holds model weights only"):
        check_training_state(cfg.trainer, out, read_checkpoint(out))
    assert cli_main(["consolidate", str(out), str(tmp_path / "again.ckpt")]) == 2
    assert "not a sharded checkpoint directory" in capsys.readouterr().err

    (sharded / SHARDED_META).write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="is not a torch.save zip file"):
        read_checkpoint(sharded, weights=False)
    shard = next(sharded.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ConfigError, match=f"corrupt: shard file {shard.name} is missing or truncated"):
        read_checkpoint(sharded)
    for name in (SHARDED_META, ".metadata"):  # one of the two missing: a save was interrupted
        kept = (sharded / name).read_bytes()
        (sharded / name).unlink()
        with pytest.raises(ConfigError, match=rf"incomplete sharded checkpoint \(no {name}\)"):
            read_checkpoint(sharded)
        (sharded / name).write_bytes(kept)
    for name in (SHARDED_META, ".metadata"):
        (sharded / name).unlink()
    with pytest.raises(ConfigError, match="is not a checkpoint: it has no .metadata nor meta.pt"):
        read_checkpoint(sharded)


def test_sharded_commit_survives_a_crash_between_renames(tmp_path, monkeypatch):
    cfg = _tiny_cfg(f"run.dir={tmp_path}", "resume=auto")
    last = tmp_path / "checkpoints" / LAST
    for step, path in ((1, last), (2, staging_path(last))):
        path.mkdir(parents=True)
        torch.save({"step": step}, path / SHARDED_META)

    replace = os.replace
    calls = []

    def crash_on_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("killed")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second_rename)
    with pytest.raises(OSError, match="killed"):
        commit_dir(staging_path(last), last)
    monkeypatch.undo()
    assert not last.exists() and resolve_resume(cfg) == str(previous_path(last))  # the old one, intact
    assert torch.load(previous_path(last) / SHARDED_META) == {"step": 1}

    commit_dir(staging_path(last), last)  # the next save
    assert resolve_resume(cfg) == str(last) and torch.load(last / SHARDED_META) == {"step": 2}
    assert sorted(p.name for p in last.parent.iterdir()) == [LAST]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # _sharded_checkpoint saves in one process
def test_resume_allows_another_split_of_the_global_batch_only(tmp_path):
    sharded = tmp_path / "last.ckpt"
    _sharded_checkpoint(sharded, "trainer=fsdp", "trainer.devices=2", "trainer.micro_batch_size=4")
    meta = read_checkpoint(sharded, weights=False)
    for split in (
        ["trainer.devices=4", "trainer.micro_batch_size=2"],
        ["trainer.devices=1", "trainer.micro_batch_size=4", "trainer.grad_accum=2"],
        ["trainer.devices=2", "trainer.num_nodes=2", "trainer.micro_batch_size=2"],
    ):
        check_training_state(_tiny_cfg("trainer=fsdp", *split).trainer, sharded, meta)  # 8 sequences per step
    with pytest.raises(
        ConfigError,
        match=r"trained with 2 process\(es\) x 4 sequences x 1 micro-batch\(es\) = 8 "
        r"sequences per step; this config has 4 process\(es\) x 4 sequences x 1 micro-batch\(es\) = 16",
    ):
        check_training_state(
            _tiny_cfg("trainer=fsdp", "trainer.devices=4", "trainer.micro_batch_size=4").trainer, sharded, meta
        )
