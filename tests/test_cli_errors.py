"""Careless hands (docs/failures.md): malformed overrides and config files, paths that are no checkpoint, evaluation
without its tasks, consolidation onto its own input, optimizer values torch would refuse: each a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keel.checkpoint.layout import LAST
from keel.checkpoint.read import read_checkpoint
from keel.cli import main as cli_main
from keel.errors import ConfigError
from keel.training import train
from keeltest.distributed import _sharded_checkpoint
from keeltest.runs import CrashAtStep, tiny_config


def test_malformed_override_is_a_clear_error(capsys):
    assert cli_main(["pretrain", "--print-config", "model.depth=[2"]) == 2
    err = capsys.readouterr().err
    assert "override 'model.depth=[2': cannot parse its value as YAML" in err and "Traceback" not in err


def test_a_directory_that_is_no_checkpoint_is_called_so_with_the_checkpoint_meant(tiny_run, tmp_path, capsys):
    last = tiny_run / "checkpoints" / LAST
    for directory in (tiny_run, tiny_run / "checkpoints"):
        assert cli_main(["generate", f"checkpoint={directory}", "--prompt", "def "]) == 2
        assert capsys.readouterr().err == (
            f"keel generate: config error: checkpoint: {directory} is not a checkpoint: "
            f"it has no .metadata nor meta.pt; did you mean {last}?\n"
        )
    assert cli_main(["consolidate", str(tmp_path), str(tmp_path / "out.ckpt")]) == 2
    assert capsys.readouterr().err == (
        f"keel consolidate: config error: checkpoint: {tmp_path} is not a checkpoint: "
        "it has no .metadata nor meta.pt (a checkpoint is a .ckpt file or an FSDP "
        "checkpoint directory holding both)\n"
    )
    assert not (tmp_path / "out.ckpt").exists() and read_checkpoint(last, weights=False)["global_step"] == 30


def test_compare_of_a_run_without_validation_says_so(tiny_data, tmp_path, capsys):
    short, empty = tmp_path / "short", tmp_path / "empty"
    with pytest.raises(RuntimeError, match="simulated crash"):  # killed before its first validation: train/loss only
        train(tiny_config(tiny_data, short, "trainer.max_steps=4", "trainer.val_every_n_steps=4"), [CrashAtStep(2)])
    capsys.readouterr()  # (the crash's message)
    (empty / "tb").mkdir(parents=True)  # no events at all
    for run in (short, empty):
        assert cli_main(["compare", str(run), "--out", str(tmp_path / "compare.png")]) == 2
        assert capsys.readouterr().err == (
            f"keel compare: config error: compare: {run} has nothing to compare: its tb/ events hold no val/loss or "
            "eval/ scalars (validation runs every trainer.val_every_n_steps steps: a run stopped before the first "
            "has none)\n"
        )
    assert not (tmp_path / "compare.png").exists()
    assert read_checkpoint(short / "checkpoints" / LAST, weights=False)["global_step"] == 2  # the run is untouched


def test_a_config_file_whose_top_level_is_a_list_is_a_clear_error(tmp_path, capsys):
    listed = tmp_path / "list.yaml"
    listed.write_text("- optim.lr: 0.001\n- trainer.max_steps: 10\n")
    refusal = (
        f"config error: {listed}: its top level is a list; a config file maps keys to settings "
        "(e.g. a line `optim:`, then `  lr: 0.001`)\n"
    )
    for command in (
        ["pretrain", "--print-config", "--config", str(listed)],
        ["pretrain", f"model={listed}"],
        ["data", "--config", str(listed), f"data.dir={tmp_path / 'data'}"],
    ):
        assert cli_main(command) == 2  # was ListConfig.pop()'s TypeError
        assert capsys.readouterr() == ("", f"keel {command[0]}: {refusal}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.yaml"]  # nothing written


def test_empty_checkpoint_says_why(tiny_data, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / LAST).write_bytes(b"")
    with pytest.raises(ConfigError, match=r"last.ckpt is empty \(0 bytes: an interrupted copy or save\?\)"):
        train(tiny_config(tiny_data, run, "resume=auto"))
    torch.save({"keel": {}}, run / "truncated.ckpt")
    (run / "truncated.ckpt").write_bytes((run / "truncated.ckpt").read_bytes()[:40])
    with pytest.raises(ConfigError, match=r"cannot be read \(corrupt or truncated\?\): \S"):
        read_checkpoint(run / "truncated.ckpt")


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("eval") / "run"
    train(tiny_config(tiny_data, run, "trainer.max_steps=1"))
    return run / "checkpoints" / LAST


def test_eval_unknown_task_and_missing_task_data_are_clear_errors(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    from lm_eval.tasks import TaskManager

    common = ["eval", "--model_args", f"checkpoint={tiny_checkpoint}", "--device", "cpu", "--limit", "2"]
    indexed = []  # lm-eval's index of every task took minutes before it said a name was unknown
    with monkeypatch.context() as patched:
        patched.setattr(TaskManager, "__init__", lambda *args, **kwargs: indexed.append(args))
        assert cli_main([*common, "--tasks", "keel_next_line,no_such_task"]) == 2
    err = capsys.readouterr().err
    assert "--tasks: Tasks not found: no_such_task; `keel eval ls tasks` lists the known ones" in err
    assert not indexed
    metadata = json.dumps({"data_dir": str(tmp_path)})
    assert cli_main([*common, "--tasks", "keel_arc_easy", "--metadata", metadata]) == 2
    err = capsys.readouterr().err
    assert f"config error: data_dir: {tmp_path}/arc/ARC-Easy-Dev.jsonl not found" in err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_consolidate_refuses_an_existing_output_one_under_a_file_and_its_own_input(tmp_path, capsys):
    """Given another run's resumable step000005.ckpt as output, consolidate replaced it with weights only."""
    sharded, taken, blocker = tmp_path / "last.ckpt", tmp_path / "step000005.ckpt", tmp_path / "notes.txt"
    _sharded_checkpoint(sharded)
    torch.save({"optimizer_states": [], "global_step": 5}, taken)
    blocker.write_text("mine")
    before = taken.read_bytes()
    for output, said in (
        (taken, f"{taken} already exists; choose a new output path (nothing is overwritten)"),
        (sharded, f"{sharded} already exists; choose a new output path (nothing is overwritten)"),
        (
            blocker / "out.ckpt",
            f"cannot write {blocker / 'out.ckpt'}: {blocker} is a file, not a directory; choose another output path",
        ),
    ):
        assert cli_main(["consolidate", str(sharded), str(output)]) == 2
        assert capsys.readouterr().err == f"keel consolidate: config error: consolidate: {said}\n"
    assert taken.read_bytes() == before and blocker.read_text() == "mine"
    assert read_checkpoint(sharded)["global_step"] == 3  # the input, untouched


OPTIMIZER_VALUES = """
import sys
from keel import cli
codes = [cli.main(["pretrain", override]) for override in sys.argv[1:]]
print(codes, "torch" in sys.modules)
"""


def test_optimizer_values_torch_would_refuse_are_config_errors_naming_the_key_before_torch_loads():
    """optim.beta1=1.5 and optim.eps=-1 ended in torch's ValueError traceback once the model was built (~45 s)."""
    done = subprocess.run(
        [sys.executable, "-c", OPTIMIZER_VALUES, "optim.beta1=1.5", "optim.beta2=-0.1", "optim.eps=-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout == "[2, 2, 2] False\n"  # refused, and torch was never imported
    assert done.stderr.splitlines() == [
        "keel pretrain: config error: optim.beta1: must be in [0, 1), got 1.5",
        "keel pretrain: config error: optim.beta2: must be in [0, 1), got -0.1",
        "keel pretrain: config error: optim.eps: must be > 0, got -1.0",
    ]


def test_overrides_after_config_are_overrides(tmp_path, capsys):
    """`keel pretrain --config F run.dir=X`: the override after --config was refused as an unrecognized argument."""
    config = tmp_path / "f.yaml"
    config.write_text("trainer:\n  max_steps: 3\n")
    argv = ["pretrain", "optim.lr=0.01", "--config", str(config), f"run.dir={tmp_path / 'x'}", "--print-config"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert f"dir: {tmp_path / 'x'}\n" in out and "max_steps: 3\n" in out and "lr: 0.01\n" in out
