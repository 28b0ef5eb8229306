"""Every refusal in Keel's own words, and nothing left behind (issue 42, items 3 and 4): each case exits with status 2
and one line `keel <command>: config error: ...` naming the bad thing - not torch's, argparse's or YAML's text - and
writes nothing; a refused start removes what it made, a killed `keel data`'s spool is removed by the next build."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from keel.checkpoint.layout import LAST
from keel.cli import main as cli_main
from keel.data.preparation import main as data_main
from keel.data.spooling import SPOOL
from keel.dirlock import LOCK
from keel.errors import ConfigError
from keel.training import train
from keeltest import QUIET_TRAINER, TINY_MODEL


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root, with a file's contents: what "writes nothing" compares."""
    return {str(path.relative_to(root)): None if path.is_dir() else path.read_bytes() for path in root.rglob("*")}


def refused(capsys, argv: list[str]) -> str:
    """`keel ARGV`'s one line, asserted to be the last on stderr (keel eval logs lm-eval's lines before it)."""
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.splitlines()[-1].startswith(f"keel {argv[0]}: config error: "), err
    # in one pytest process, lm-eval's log handler can still hold an earlier test's closed capture stream: logging
    # then reports its own write error, which is no output of keel's
    own = re.sub(r"--- Logging error ---\n.*?\nArguments: [^\n]*\n", "", err, flags=re.S)
    assert "Traceback" not in own and "weights_only=False" not in err and "invalid <lambda>" not in err, err
    return err.splitlines()[-1]


def config(tiny_data, run: Path, *overrides: str):
    from keel.config import load_config

    return load_config(
        overrides=[
            *TINY_MODEL,
            *QUIET_TRAINER,
            *tiny_data,
            "eval.enabled=false",
            "trainer.max_steps=2",
            f"run.dir={run}",
            *overrides,
        ]
    )


# ----------------------------------------------------------------------------------- checkpoints (item 3)


def protocol_4_zip(path: Path) -> Path:
    """A torch.save zip whose pickle uses protocol 4, which torch's weights-only unpickler does not read."""
    torch.save({"keel": {}}, path)
    with zipfile.ZipFile(path) as original:
        entries = {name: original.read(name) for name in original.namelist()}
    pkl = next(name for name in entries if name.endswith("data.pkl"))
    entries[pkl] = pickle.dumps({"keel": {}}, protocol=4)
    with zipfile.ZipFile(path, "w") as rewritten:
        for name, data in entries.items():
            rewritten.writestr(name, data)
    return path


READERS = {  # each command that reads a checkpoint, with its arguments after the checkpoint's path
    "generate": lambda path, out: ["generate", str(path), "--prompt", "def "],
    "export": lambda path, out: ["export", str(path), "--out", str(out / "hf")],
    "gradflow": lambda path, out: ["gradflow", "--checkpoint", str(path), "--plot", str(out / "flow.png")],
    "redundancy": lambda path, out: ["redundancy", str(path), "--out", str(out / "redundancy")],
}


def test_a_file_that_is_no_torch_zip_is_refused_in_keels_words_by_every_reader(tiny_data, tmp_path, capsys):
    """A bare pickle given to `keel eval` ended in torch's page of advice, "Re-running torch.load with weights_only
    set to False will likely succeed"; torch's pre-1.6 format, read mapped, in its note on mmap."""
    files, out = tmp_path / "files", tmp_path / "out"
    files.mkdir()
    out.mkdir()
    bare, legacy = files / "bare.ckpt", files / "legacy.ckpt"
    bare.write_bytes(pickle.dumps({"keel": {}, "state_dict": {}}, protocol=4))
    torch.save({"keel": {}, "state_dict": {}}, legacy, _use_new_zipfile_serialization=False)
    before = tree(tmp_path)
    for path in (bare, legacy):
        said = (
            f"checkpoint: {path} is not a torch.save zip file (a bare pickle, an old torch format, or corrupt); "
            "use a checkpoint a keel run wrote"
        )
        for command, argv in READERS.items():
            assert refused(capsys, argv(path, out)) == f"keel {command}: config error: {said}"
        if path == bare:  # keel eval, where it was seen (lm-eval's start-up is slow: once)
            assert (
                refused(
                    capsys,
                    [
                        "eval",
                        "--model_args",
                        f"checkpoint={path}",
                        "--tasks",
                        "keel_next_line",
                        "--device",
                        "cpu",
                        "--output_path",
                        str(out / "eval"),
                    ],
                )
                == f"keel eval: config error: {said}"
            )
        for overrides in ([f"init_from={path}"], [f"resume={path}"]):
            with pytest.raises(ConfigError) as err:
                train(config(tiny_data, tmp_path / "run", *overrides))
            assert str(err.value) == said
    assert tree(tmp_path) == before  # no run dir, export, plot or table
    # a zip torch's weights-only unpickler refuses without naming a global: its reason, not its advice
    capsys.readouterr()
    with pytest.raises(ConfigError) as err:
        train(config(tiny_data, tmp_path / "run", f"resume={protocol_4_zip(files / 'protocol4.ckpt')}"))
    assert str(err.value) == (
        f"checkpoint: {files / 'protocol4.ckpt'} cannot be read (corrupt or truncated?): "
        "torch.load(weights_only=True) refused it (Unsupported operand 149)"
    )
    assert capsys.readouterr().err == ""  # nor torch's warning asking to report the pickle protocol


def test_an_empty_checkpoint_is_refused_with_advice_that_fits_the_command(tmp_path, capsys):
    """`keel generate` of a zero-byte file advised `resume=PATH ... or resume=null`, keys of `keel pretrain`."""
    empty = tmp_path / "empty.ckpt"
    empty.touch()
    for argv in (["generate", str(empty)], ["export", str(empty), "--out", str(tmp_path / "hf")]):
        assert refused(capsys, argv) == (
            f"keel {argv[0]}: config error: checkpoint: {empty} is empty (0 bytes: an "
            "interrupted copy or save?); use another checkpoint"
        )
    assert [path.name for path in tmp_path.iterdir()] == ["empty.ckpt"]


def test_an_exports_invalid_config_is_refused_naming_its_config_json(tiny_run, tiny_data, tmp_path, capsys):
    """config.json edited to `width: -32` was refused as "model.width: must be >= 1", which under init_from read as
    the user's own model.width=32."""
    export = tmp_path / "export"
    assert cli_main(["export", str(tiny_run / "checkpoints" / LAST), "--out", str(export)]) == 0
    capsys.readouterr()
    settings = json.loads((export / "config.json").read_text())
    settings["keel"]["model"]["width"] = -32
    (export / "config.json").write_text(json.dumps(settings))
    before = tree(tmp_path)
    said = (
        f"checkpoint: {export / 'config.json'} holds an invalid keel config (model.width: must be >= 1, got -32); "
        "it was edited: export the checkpoint it came from again"
    )
    assert refused(capsys, ["generate", str(export)]) == f"keel generate: config error: {said}"
    with pytest.raises(ConfigError) as err:
        train(config(tiny_data, tmp_path / "run", f"init_from={export}"))  # TINY_MODEL: model.width=32
    assert str(err.value) == said
    assert tree(tmp_path) == before


# ---------------------------------------------------------------------------------- command lines (item 3)


def test_bad_comma_separated_option_values_are_one_line_naming_the_option_and_the_item(tmp_path, capsys):
    """`keel bench --members -1,abc` answered with argparse's usage and "invalid <lambda> value"."""
    for argv, said in [
        (["bench", "--members=-1,abc"], "argument --members: 'abc' in '-1,abc' is not an integer"),
        (
            ["bench", "--members", "-1,abc"],
            "argument --members: expected one argument (a value that starts with '-' goes after '=': --members=VALUE)",
        ),
        (["bench", "--members=-1"], "--members needs at least one value, each >= 1; got -1"),
        (["bench", "--threads=0,2"], "--threads needs at least one value, each >= 1; got 0,2"),
        (
            ["bench", "--loss-chunk=16,-1"],
            "--loss-chunk needs at least one value, each >= 0 (0 = plain head); got 16,-1",
        ),
        (["bench", "--compile=of"], "argument --compile: expected on or off, got 'of'"),
        (
            ["sweep", "--depths=4,x", "--out", str(tmp_path / "sweep"), "--emit", "commands"],
            "argument --depths: 'x' in '4,x' is not an integer",
        ),
    ]:
        help_ = f"`keel {argv[0]} --help` lists the options"
        assert refused(capsys, argv) == f"keel {argv[0]}: config error: {said}; {help_}"
    assert not any(tmp_path.iterdir())


def test_a_missing_config_file_is_named_not_read_as_yaml(tmp_path, capsys):
    """`--config FILE` of no file was worded "cannot parse YAML: [Errno 2] ..."."""
    missing = tmp_path / "missing.yaml"
    for command in ("pretrain", "data"):
        assert (
            refused(capsys, [command, "--config", str(missing)])
            == f"keel {command}: config error: config: {missing} does not exist: give a YAML file"
        )
    assert (
        refused(capsys, ["pretrain", "--config", str(tmp_path)])
        == f"keel pretrain: config error: config: {tmp_path} is a directory, not a YAML file"
    )
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------ leftovers (item 4)


def test_a_refused_start_removes_the_run_dir_it_made_and_keeps_one_that_was_there(tiny_run, tiny_data, tmp_path):
    """A start refused after the run dir's lock was taken (init_from of another model, a split too small for the
    ranks) left a run dir holding only `.keel.lock`."""
    another_model = f"init_from={tiny_run / 'checkpoints' / LAST}", "model.width=64"
    too_many_ranks = "trainer.devices=2", "trainer.val_batches=1000"
    made = tmp_path / "new" / "runs" / "run"  # and its parents
    for overrides, said in (
        (another_model, "init_from: the checkpoint holds a different model"),
        (too_many_ranks, "trainer.val_batches=1000: "),
    ):
        with pytest.raises(ConfigError, match=said):
            train(config(tiny_data, made, *overrides))
        assert not any(tmp_path.iterdir())
    kept = tmp_path / "kept"  # a run dir made beforehand, with something in it
    (kept / "notes").mkdir(parents=True)
    (kept / "notes" / "plan.txt").write_text("run 2")
    before = tree(tmp_path)
    with pytest.raises(ConfigError, match="init_from: the checkpoint holds a different model"):
        train(config(tiny_data, kept, *another_model))
    assert tree(tmp_path) == before  # as it was: no lock file either
    (kept / LOCK).write_text("")  # an earlier run's lock, released: not this start's to remove
    before = tree(tmp_path)
    with pytest.raises(ConfigError, match="init_from: the checkpoint holds a different model"):
        train(config(tiny_data, kept, *another_model))
    assert tree(tmp_path) == before


KILLED_WHILE_BUILDING = """
import sys
import keel.data.preparation as preparation

spool_corpus = preparation.spool_corpus

def spool_then_wait(*args):
    spools = spool_corpus(*args)
    print("spooled", flush=True)
    sys.stdin.read()  # until killed
    return spools

preparation.spool_corpus = spool_then_wait
sys.exit(preparation.main(sys.argv[1:]))
"""


def test_keel_data_removes_the_spools_of_killed_builds_only(tiny_data, tmp_path, monkeypatch, capsys):
    """`keel data` killed with -9 left its spool (`keel-data-*`, 13 MB) in the temp dir, and reruns kept it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    overrides = [item for item in tiny_data if not item.startswith("data.dir=")] + [f"data.dir={tmp_path / 'data'}"]
    build = subprocess.Popen(
        [sys.executable, "-c", KILLED_WHILE_BUILDING, *overrides],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    try:
        assert "spooled" in (line.strip() for line in build.stdout)  # (its earlier lines say what it reads)
    finally:
        build.send_signal(signal.SIGKILL)
        build.wait()
    (left,) = tmp.iterdir()
    assert left.name.startswith(f"{SPOOL}{build.pid}-{socket.gethostname()}-") and (left / "train.jsonl").is_file()
    running = tmp / f"{SPOOL}{os.getpid()}-{socket.gethostname()}-abc123"  # a live process's: a concurrent build
    unknown = tmp / f"{SPOOL}q1w2e3r4"  # named before the owner's pid was part of the name
    for spool in (running, unknown):
        spool.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    assert data_main([*overrides, "--force"]) == 0
    assert (
        f"keel data: removed the spool(s) of keel data processes no longer running: {left}\n" in capsys.readouterr().out
    )
    assert sorted(tmp.iterdir()) == sorted([running, unknown])  # and the rerun's own spool removed when done


def test_a_paper_report_of_a_directory_without_runs_is_refused_writing_nothing(tmp_path, capsys):
    """It wrote a report of 12 "not (yet) run" grids and exited 0."""
    paper = tmp_path / "paper"
    (paper / "table1-d16").mkdir(parents=True)  # a grid started, none of its runs yet
    (paper / "table1-d16" / "manifest.json").write_text("{}")
    before = tree(tmp_path)
    assert refused(capsys, ["paper-report", str(paper)]) == (
        f"keel paper-report: config error: paper-report: no grid has run under {paper} (no run directory "
        f"{paper}/GRID/RUN); run them first (make paper PAPER_OUT={paper}); nothing was written"
    )
    assert tree(tmp_path) == before
