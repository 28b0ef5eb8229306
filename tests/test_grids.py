"""The paper's grids as data (keel.experiments.grids): the Makefile runs exactly them, the report reads every one,
each grid's runs are what its data says, and docs/grids.md's table is the data's."""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from keel.artifacts import STABILITY
from keel.callbacks.stability import StabilityMonitor
from keel.cli import main as cli_main
from keel.config import load_config
from keel.experiments import paper_run, roles
from keel.experiments.grids import GRIDS, PERTURBATIONS, SETTINGS
from keel.rundir import write_config

REPO = Path(__file__).resolve().parents[1]


def dry_run(capsys, *argv: str) -> list[list[str]]:
    """The commands `keel paper-run ... --dry-run` prints, as argv lists after `keel`."""
    assert cli_main(["paper-run", "--dry-run", *argv]) == 0
    return [shlex.split(line)[1:] for line in capsys.readouterr().out.splitlines()]


def make_runs(*argv: str) -> list[str]:
    """The grids `make -n TARGET...` would run (through `keel paper-run GRID`) and its reports, in order."""
    keel = f"{sys.executable} -m keel.cli"
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", *argv, f"KEEL={keel}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    runs = []
    for line in out.splitlines():
        if line.startswith(keel):
            words = shlex.split(line.removeprefix(keel))
            if words[0] == "paper-run":  # paper-run OPTIONS GRID [-- ARGS]
                runs.append(words[words.index("--") - 1] if "--" in words else words[-1])
            elif words[0] == "paper-report":
                runs.append(words[0])
    return runs


def test_make_runs_every_grid_and_the_report_reads_every_one():
    paper, trained = paper_run.grid_set("paper"), paper_run.grid_set("paper-trained")
    transfer = paper_run.grid_set("paper-transfer")
    assert make_runs("paper", "paper-trained") == [*paper, "paper-report", *trained, "paper-report"]
    assert make_runs("paper-transfer") == [*transfer, "paper-report"]
    assert [*paper, *trained, *transfer] == list(GRIDS)  # each grid once, in the table's order
    assert make_runs("paper-linear") == [*paper_run.grid_set("paper-linear"), "paper-report"]
    assert make_runs("paper", "PAPER_SCALE=1") == ["table1-d16", "table1-d64"]  # for a cluster, no report
    # what keel paper-report reads: every max-LR grid, the 1,024-block sweeps, the trained models and their layer use
    read = {
        *roles.MAXLR_GRIDS,
        *roles.DEEP_RUNS,
        *roles.LR_GRIDS,
        *roles.TUNED_GRIDS,
        *(f"redundancy-{grid}" for grid in roles.LR_GRIDS),
        *roles.TRANSFER_GRIDS,
        *roles.DEPTH_RULE_GRIDS,
        *roles.SHORT_DEPTH_GRIDS,
    }
    assert read == set(GRIDS)
    role_grids = [
        *roles.TABLE1,
        *roles.RAMP_CHECK,
        *(g for pair in roles.NOGAIN_PAIRS for g in pair),
        *(g for pair in roles.RESOLUTION_PAIRS for g in pair),
        *(
            g
            for axis in (
                roles.DEPTH_TREND,
                roles.WIDTH_TREND,
                roles.BATCH_POINT,
                roles.LINEAR_DEPTH_TREND,
                roles.LINEAR_SLOW_DEPTH_TREND,
                roles.LINEAR_WIDTH_TREND,
                roles.MUP_WIDTH_TREND,
            )
            for names, _, _ in axis.values()
            for g in names
        ),
        *(g for names in roles.HOLD_GRIDS.values() for g in names),
    ]
    assert set(role_grids) <= set(roles.MAXLR_GRIDS) and set(roles.DEPTH_GRIDS) <= {*roles.LR_GRIDS, *roles.TUNED_GRIDS}
    assert all(GRIDS[g].point == point for point, names in roles.HOLD_GRIDS.items() for g in names)


def test_the_makefile_forwards_every_setting_and_only_those_given(tmp_path):
    text = (REPO / "Makefile").read_text()
    names = re.search(r"PAPER_SETTINGS := ((?:.*\\\n)*.*)", text).group(1).replace("\\\n", " ").split()
    assert names == list(SETTINGS)
    keel = f"{sys.executable} -m keel.cli"
    out = subprocess.run(
        [
            "make",
            "-n",
            "--no-print-directory",
            "paper-hybridnorm",
            f"KEEL={keel}",
            "TREND_SEEDS=4,5",
            f"PAPER_OUT={tmp_path}",
            "ARGS=data=fineweb_edu --steps 100",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[-1] == (
        f"{keel} paper-run --out {tmp_path} --set 'TREND_SEEDS=4,5' hybridnorm -- data=fineweb_edu --steps 100"
    )


# one seed and one LR: the size of a grid's runs does not depend on them, and each run's config takes a while
ONE_RUN_PER_ROW = [f"--set={key}={value.split(',')[0]}" for key, value in SETTINGS.items()]


def one_scheme(args: list[str]) -> list[str]:
    """A grid's arguments with its first scheme alone (the size of its runs does not depend on the scheme either),
    without the --only selections that name the others."""
    kept = []
    for word in args:
        if kept and kept[-1] == "--only":
            kept.pop()
        elif kept and kept[-1] == "--schemes":
            kept.append(word.split(",")[0])
        else:
            kept.append(word)
    return kept


@pytest.mark.parametrize("name", [name for name, grid in GRIDS.items() if grid.command != "redundancy"])
def test_each_grids_runs_are_the_size_its_data_says(name, tmp_path, capsys):
    (argv,) = dry_run(capsys, name, "--out", str(tmp_path), *ONE_RUN_PER_ROW)
    command, args = argv[0], one_scheme(argv[1:])
    if command == "maxlr":
        assert cli_main(["maxlr", *args, "--print-config"]) == 0
        configs = [
            yaml.safe_load(doc) for doc in re.split(r"^# keel maxlr run .*$", capsys.readouterr().out, flags=re.M)[1:]
        ]
        sizes = {(c["model"]["depth"], c["model"]["width"]) for c in configs}
    else:  # keel sweep writes one `keel pretrain` per run
        assert cli_main(["sweep", *args, "--emit", "commands"]) == 0
        commands = (tmp_path / name / "commands.sh").read_text().splitlines()
        configs = [load_config(overrides=shlex.split(line)[2:]).model for line in commands]
        sizes = {(m.depth, m.width) for m in configs}
    assert configs and sizes == {GRIDS[name].point}


def print_configs(capsys, name: str, out: Path) -> dict[str, dict]:
    """Each run of a max-LR grid (one seed) and its resolved config, as `keel maxlr --print-config` prints them."""
    (argv,) = dry_run(capsys, name, "--out", str(out), "--set=SEEDS=1", "--set=TREND_SEEDS=1")
    assert cli_main([*argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    names = re.findall(r"^# keel maxlr run (.*)$", printed, flags=re.M)
    return dict(zip(names, map(yaml.safe_load, re.split(r"^# keel maxlr run .*$", printed, flags=re.M)[1:])))


@pytest.mark.parametrize("table1, perturbed", roles.RESOLUTION_PAIRS)
def test_a_resolution_grids_runs_are_table1s_probes_with_one_change_each(table1, perturbed, tmp_path, capsys):
    """Each run is its Table 1 probe (scheme, seed, size, protocol) with one of the PERTURBATIONS and nothing else;
    the init's is one float32 ulp."""
    probes, runs = print_configs(capsys, table1, tmp_path), print_configs(capsys, perturbed, tmp_path)
    assert len(runs) == 2 * len(PERTURBATIONS)
    for name, cfg in runs.items():
        scheme, change, size_and_seed = name.split("-", 2)
        probe = copy.deepcopy(probes[f"{scheme}-{size_and_seed}"])  # compared with each change
        path, value = PERTURBATIONS[change].split("=")
        group, key = path.split(".")
        assert cfg[group].pop(key) == yaml.safe_load(value) != probe[group].pop(key)
        if key == "init_std":
            assert np.float32(value) == np.nextafter(np.float32(0.02), np.float32(1))
        assert {**cfg, "run": {**cfg["run"], "dir": None}} == {**probe, "run": {**probe["run"], "dir": None}}


def test_settings_scale_and_args_change_only_what_they_name(tmp_path, capsys):
    (linear,) = dry_run(capsys, "linear-d16", "--set", "SEEDS=7", "--set", "TREND_SEEDS=8,9", "--", "data=x")
    assert linear[:7] == ["maxlr", "--out", "runs/paper/linear-d16", "--seeds", "7", "--ramp", "linear"]
    only = [linear[i + 1] for i, word in enumerate(linear) if word == "--only"]
    assert only == [
        "keel-d16-s7",
        "preln-d16-s7",
        "postln-d16-s8",
        "postln-d16-s9",
        "deepnorm-d16-s8",
        "deepnorm-d16-s9",
        "mixln-d16-s8",
        "mixln-d16-s9",
    ]
    assert linear[-1] == "data=x"
    miniature, paper = (
        dry_run(capsys, "table1-d64", *scale)[0]
        for scale in ([], ["--paper-scale", "--sbatch=--gres=gpu:8", "--sbatch=--time=1:00:00"])
    )
    assert miniature[miniature.index("--seeds") + 2 :] == [
        "--depths",
        "64",
        "model.width=32",
        "model.n_heads=4",
        "model.seq_len=128",
        "trainer.micro_batch_size=8",
        "trainer.threads=1",
    ]
    assert paper[paper.index("--seeds") + 2 :] == [
        "--emit",
        "slurm",
        "--sbatch=--gres=gpu:8",
        "--sbatch=--time=1:00:00",
        "--depths",
        "256",
        "model=paper_d64",
        "trainer=gpu",
    ]
    assert dry_run(capsys, "linear-d16", "--paper-scale") == dry_run(capsys, "linear-d16")  # not a scaled grid
    for argv, message in (
        (["--set", "SEED=1", "ramp-2x"], "--set 'SEED=1': expected NAME=VALUE with NAME one of"),
        (["--sbatch=--x", "table1-d16"], "--sbatch: only at paper scale"),
        (["tabel1-d16"], "config error: unknown grid tabel1-d16; did you mean table1-d16 or "),
        ([], "config error: no grid given; the grids: linear-d16,"),
    ):
        assert cli_main(["paper-run", *argv]) == 2
        assert message in capsys.readouterr().err


def test_a_redundancy_grid_measures_its_grids_final_checkpoints(tmp_path, capsys):
    """Only finished runs' last.ckpt: not one with no checkpoint, nor one still training (its last.ckpt is from the
    middle of its schedule), nor a directory without a run's config, nor a run with rows in the table already (a
    rerun of make paper-trained measures none twice); with none left, paper-run says so and goes on."""
    steps = {
        "preln-lr0.01-s1": 2000,
        "keel-lr0.01-s1": 2000,
        "keel-lr0.02-s1": 2000,
        "training": 1500,
        "no-checkpoint": 2000,
    }
    for run, done in steps.items():
        cfg = load_config(None, ["trainer.max_steps=2000", f"run.dir={tmp_path / 'lr-d16' / run}"])
        Path(cfg.run.dir).mkdir(parents=True)
        write_config(cfg, None)
        (Path(cfg.run.dir) / STABILITY).write_text(json.dumps(StabilityMonitor(run_dir=cfg.run.dir).summary(done)))
        if run != "no-checkpoint":
            (Path(cfg.run.dir) / "checkpoints").mkdir()
            (Path(cfg.run.dir) / "checkpoints" / "last.ckpt").touch()
    (tmp_path / "lr-d16" / "stray" / "checkpoints").mkdir(parents=True)
    (tmp_path / "lr-d16" / "stray" / "checkpoints" / "last.ckpt").touch()
    table = tmp_path / "lr-d16" / "redundancy" / "redundancy.csv"
    table.parent.mkdir()
    columns = "checkpoint,path,scheme,depth,block,val_tokens,ppl_base,ppl_removed,ppl_increase,loss_increase"
    table.write_text(f"{columns}\nx,elsewhere/lr-d16/keel-lr0.02-s1/checkpoints/last.ckpt,keel,16,0,8,2,3,1,0.4\n")
    (argv,) = dry_run(capsys, "redundancy-lr-d16", "--out", str(tmp_path))
    assert argv == [
        "redundancy",
        f"{tmp_path}/lr-d16/keel-lr0.01-s1/checkpoints/last.ckpt",
        f"{tmp_path}/lr-d16/preln-lr0.01-s1/checkpoints/last.ckpt",
        "--append",
        "--out",
        f"{tmp_path}/lr-d16/redundancy",
    ]
    table.write_text(
        table.read_text()
        + "".join(
            f"x,runs/paper/lr-d16/{run}/checkpoints/last.ckpt,keel,16,0,8,2,3,1,0.4\n"
            for run in ("keel-lr0.01-s1", "preln-lr0.01-s1")
        )
    )
    before = table.read_text()
    assert cli_main(["paper-run", "redundancy-lr-d16", "--out", str(tmp_path)]) == 0  # measures nothing: no torch
    assert capsys.readouterr().out == (
        f"keel paper-run redundancy-lr-d16: nothing to measure: every finished run of "
        f"{tmp_path}/lr-d16 has its rows in {tmp_path}/lr-d16/redundancy/redundancy.csv "
        "(`make paper-lr-d16` trains the others)\n"
    )
    assert table.read_text() == before
    table.write_text("run,loss\nkeel-lr0.01-s1,0.4\n")  # another tool's table in its place
    assert cli_main(["paper-run", "redundancy-lr-d16", "--out", str(tmp_path)]) == 2
    assert (
        f"{table} is not a redundancy.csv (columns run, loss; expected block, checkpoint, commit, cpu, depth, dirty, "
        "keel, loss_increase, path, ppl_base, ppl_increase, ppl_removed, scheme, threads, torch, val_tokens); move it "
        "aside"
    ) in capsys.readouterr().err


def test_paper_run_runs_the_grids_command_into_its_directory(tmp_path, capsys):
    # --emit commands (an ARGS option) stops short of training: the grid's runs are listed where make would run them
    assert (
        cli_main(
            ["paper-run", "hybridnorm", "--out", str(tmp_path), "--set", "TREND_SEEDS=1,2", "--", "--emit", "commands"]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith(f"keel maxlr --out {tmp_path}/hybridnorm --schemes hybridnorm ")
    runs = [run["name"] for run in json.loads((tmp_path / "hybridnorm" / "sweep.json").read_text())["runs"]]
    assert runs == [
        "hybridnorm-d16-s1",
        "hybridnorm-megatron-d16-s1",
        "hybridnorm-d16-s2",
        "hybridnorm-megatron-d16-s2",
    ]
    assert (tmp_path / "hybridnorm" / "commands.sh").read_text().count("keel maxlr") == 4


def test_the_docs_table_of_the_grids_is_the_data():
    docs = (REPO / "docs" / "grids.md").read_text()
    table = docs.split("<!-- keel paper-run --table -->\n")[1].split("\n<!-- end of keel paper-run --table -->")[0]
    assert table == paper_run.table()
