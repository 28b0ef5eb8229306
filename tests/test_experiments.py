"""The experiment commands end to end on seconds-long runs: maxlr, sweep (emit, run, collect), redundancy."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from keel.cli import main as cli_main
from keel.config import load_config
from keel.errors import ConfigError
from keel.experiments.axes import non_embedding_params, resolve_alpha, width_for_budget
from keel.experiments.hold import WARMUP_HOLD, fit
from keel.experiments.maxlr import main as maxlr_main
from keel.experiments.maxlr_report import hold_steps, judge, ramp_name
from keel.experiments.origins import origins_table
from keel.experiments.paper import init_sensitivity
from keel.experiments.records import already_trained
from keel.experiments.resolution import resolution_tables
from keel.experiments.roles import MAXLR_GRIDS
from keel.experiments.stats import paired, sign_test
from keel.experiments.sweep import lr_optima
from keel.experiments.trends import plot_ratios, plot_transfer, ratios, transfer, trend
from keel.model import KeelLM
from keeltest import QUIET_TRAINER, TINY_MODEL

ROOT = Path(__file__).parents[1]

QUICK = [
    *TINY_MODEL,
    *QUIET_TRAINER,
    "eval.enabled=false",
    "callbacks.layer_importance.enabled=false",
    "callbacks.grad_norms.enabled=false",
]


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_alpha_expressions_resolve():
    L = 16
    expected = {"1": 1, "sqrt(L)": 4, "L/2": 8, "L": 16, "2L": 32, "2*L": 32, "L**0.5": 4, "0.5": 0.5, "3e-1": 0.3}
    assert {expr: resolve_alpha(expr, L) for expr in expected} == pytest.approx(expected)
    for bad in ("x", "__import__('os')", "L - L", "sqrt(L, 2)", "L/0"):
        with pytest.raises(ConfigError, match="alpha"):
            resolve_alpha(bad, L)


def test_width_at_fixed_params_keeps_the_budget():
    base = load_config(overrides=["model.depth=8", "model.width=128", "model.n_heads=4"]).model
    budget = non_embedding_params(base)
    lm = KeelLM(base)
    assert budget == lm.num_params(embeddings=False) - lm.head.weight.numel()  # embedding and head excluded
    widths = {d: width_for_budget(base, d, budget) for d in (2, 4, 8, 16, 32)}
    assert widths[8] == 128
    assert list(widths.values()) == sorted(widths.values(), reverse=True)  # deeper = narrower
    for depth, width in widths.items():
        assert width % 8 == 0
        params = non_embedding_params(
            load_config(overrides=[f"model.depth={depth}", f"model.width={width}", "model.n_heads=4"]).model
        )
        assert abs(params / budget - 1) < 0.1, (depth, width, params, budget)


def ramp_curve(losses: list[float], every: int = 20, start: float = 1e-3, per_decade: int = 161) -> list:
    """A held-out curve as stability.json records it: (step, LR of that step on the exponential ramp, loss)."""
    return [
        (every * (i + 1) - 1, start * 10 ** ((every * (i + 1) - 1) / per_decade), loss) for i, loss in enumerate(losses)
    ]


UNIGRAM = 6.7
CRITERION = {"unigram": UNIGRAM, "margin": 0.5, "spike_margin": 1.0, "patience": 40}


def test_maxlr_a_plateau_is_no_failure_and_the_optimum_is_its_own_column():
    """A fast learner that flattens and wanders (the stagnation verdict's victims) tolerates the whole ramp."""
    curve = ramp_curve([7.4, 6.7, 6.2, 5.8, 5.65, 5.6, 5.62, 5.59, 5.66, 5.7, 5.64, 5.75, 5.8, 5.7])
    verdict = judge(curve, **CRITERION)
    assert verdict.failure is None and verdict.max_tolerable_lr is None and verdict.resolved
    assert (verdict.best_heldout, verdict.loss_optimal_lr) == (5.59, curve[7][1])
    # a brief excursion above the bar that comes back within the patience is no failure either
    spiky = ramp_curve([7.4, 6.5, 6.0, 5.6, 6.9, 5.7, 5.65])
    assert judge(spiky, **CRITERION).failure is None


def test_maxlr_a_collapse_of_a_weak_learner_is_caught():
    """Post-LN at 64 x 32 as in the issue: best 6.14, a collapse to 8.2, then flat at 6.85 above the unigram loss.
    A bar relative to the best alone (7.14) calls 6.85 a recovery; the unigram cap does not."""
    curve = ramp_curve([7.5, 6.6, 6.3, 6.14, 6.2, 8.2, 6.85, 6.86, 6.84, 6.85])
    verdict = judge(curve, **CRITERION)
    assert verdict.failure == "divergence" and verdict.onset_step == curve[5][0]
    assert verdict.max_tolerable_lr == curve[4][1] and verdict.heldout_at_max_lr == 6.2 and verdict.resolved
    assert verdict.above_best_at_max_lr == pytest.approx(6.2 - 6.14)  # sustained, 0.06 nat above its best
    assert verdict.leaves_unigram_lr == curve[5][1]
    assert judge(curve, **CRITERION, relative_only=True).failure is None
    # a model that never got 0.5 nat below the unigram loss is judged relative to its best only: not resolved
    weak = judge(ramp_curve([7.5, 6.6, 6.4, 6.3, 7.9, 8.0, 8.1]), **CRITERION)
    assert weak.failure == "divergence" and not weak.resolved


def test_maxlr_nonfinite_and_open_excursions_fail():
    verdict = judge(ramp_curve([7.4, 6.2, 5.8]), **CRITERION, nonfinite=(70, 0.0025))  # evaluations to step 59
    assert (verdict.failure, verdict.onset_step, verdict.max_tolerable_lr) == ("nonfinite", 70, 0.0025)
    assert (verdict.heldout_at_max_lr, verdict.best_heldout, verdict.resolved) == (5.8, 5.8, True)
    # above the bar when the probe ended (the run's own stop, or the end of the ramp): it never came back
    ended = judge(ramp_curve([7.4, 6.2, 5.8, 5.7, 7.0]), **CRITERION)
    assert ended.failure == "divergence" and ended.max_tolerable_lr == ramp_curve([0] * 4)[3][1]
    # a divergence that began before the non-finite step keeps its own onset
    both = judge(ramp_curve([7.4, 6.2, 5.8, 5.7, 7.0, 7.5]), **CRITERION, nonfinite=(130, 0.0065))
    assert both.failure == "divergence" and both.onset_step == 99


def test_the_hold_is_the_steps_between_x_and_four_thirds_x_and_its_fit_recovers_a_power_law():
    linear = OmegaConf.create({"schedule": "linear_warmup", "lr": 0.4, "warmup_steps": 4000})
    geometric = OmegaConf.create({"schedule": "exp_warmup", "lr": 3.0, "warmup_steps": 560, "min_lr_ratio": 1e-3 / 3})
    assert hold_steps(linear, 0.06) == pytest.approx(200)  # 0.02 more LR at 1e-4 per step
    assert hold_steps(geometric, 0.06) == pytest.approx(hold_steps(geometric, 0.2)) == pytest.approx(20.1, abs=0.05)
    assert ramp_name(linear) == "linear from 0, 0.0001 per step"
    assert ramp_name(geometric) == "geometric from 0.001, 161 steps per decade"
    # max LR = 0.5 h^-0.4, two seeds a few percent apart at each of three holds: the exponent and the 5,000-step
    # warm-up's value come back, their intervals around them
    points = [(h, 0.5 * h**-0.4 * wobble) for h in (20, 200, 800) for wobble in (0.97, 1.03)]
    result = fit(points)
    assert result["exponent low"] < -0.4 < result["exponent high"] and result["exponent high"] < 0
    assert result["value low"] < 0.5 * WARMUP_HOLD**-0.4 < result["value high"]
    assert result["value"] == pytest.approx(0.5 * WARMUP_HOLD**-0.4, rel=0.01)
    flat = fit([(h, 0.1 * wobble) for h in (20, 200, 800) for wobble in (0.9, 1.1)])
    assert flat["exponent low"] < 0 < flat["exponent high"]  # no dependence: the interval holds 0
    assert fit([(20, 0.1), (20, 0.2), (20, 0.15)]) is None  # one hold says nothing about the hold


def test_maxlr_detects_a_forced_divergence(tiny_data, tmp_path, capsys):
    out = tmp_path / "maxlr"
    peak = 20.0  # absurd for AdamW: every run must fail on the way up
    argv = [
        "maxlr",
        "--schemes",
        "preln,keel",
        "--depths",
        "2",
        "--steps",
        "24",
        "--peak-lr",
        str(peak),
        "--ramp",
        "linear",
        "--eval-every",
        "4",
        "--out",
        str(out),
        *QUICK,
        *tiny_data,
        "callbacks.stability.spike_patience=4",
        "--variant",
        "keel-nogain=model.scheme=keel,model.out_norm_gain=false",
    ]
    assert cli_main(argv) == 0
    rows = read_csv(out / "maxlr.csv")
    assert [r["row"] for r in rows] == ["preln", "keel", "keel-nogain"]
    for r in rows[:2]:
        assert r["failure"] in ("nonfinite", "divergence") and r["stop"] in ("nonfinite", "spike")
        assert 0 < float(r["max_tolerable_lr"]) < peak
        assert int(r["steps"]) < 24  # stopped at the failure
        stability = json.loads((out / f"{r['scheme']}-d2-s1337" / "stability.json").read_text())
        assert stability["max_tolerable_lr"] >= float(r["max_tolerable_lr"])  # the report's bar is never looser
        curve = read_csv(out / f"{r['scheme']}-d2-s1337" / "loss_lr.csv")
        assert float(curve[0]["lr"]) == pytest.approx(peak / 24)  # linear ramp from 0: step 0 runs at peak/steps
        assert r["resolved"] == "False"  # a 2-block model after a few steps is nowhere near unigram - 1 nat
    assert "| preln | 2 |" in (out / "maxlr.md").read_text()
    assert (out / "maxlr.png").stat().st_size > 0 and (out / "maxlr_seeds.png").stat().st_size > 0
    assert json.loads((out / "preln-d2-s1337" / "maxlr_time.json").read_text())["cpu_s"] > 0
    mtime = (out / "preln-d2-s1337" / "stability.json").stat().st_mtime
    assert cli_main(argv) == 0  # rerun: both probes are finished, nothing is trained again
    assert (out / "preln-d2-s1337" / "stability.json").stat().st_mtime == mtime
    # any loss is low enough (a forced divergence takes the held-out loss past 100 nats) ...
    assert cli_main(["maxlr", "collect", str(out), "--margin=-1e9"]) == 0
    for r in read_csv(out / "maxlr.csv"):  # ... but a max LR needs a held-out evaluation before the failure
        assert r["resolved"] == str(r["heldout_at_max_lr"] != "")
    report = (out / "maxlr.md").read_text()
    assert "preln vs " not in report and "| 16 | keel vs preln |" not in report  # the one default pair present:
    pair = next(line for line in report.splitlines() if "| keel vs preln |" in line)
    assert pair.startswith("| 2 | keel vs preln | 1 |"), pair  # both resolved now: one seed compared

    # `keel paper-report` puts the grids of a `make paper` directory side by side and lists the missing ones
    shutil.copytree(out, tmp_path / "paper" / "table1-d16")
    assert cli_main(["paper-report", str(tmp_path / "paper")]) == 0
    paper = (tmp_path / "paper" / "report.md").read_text()
    assert "## Table 1, 16 blocks x 64 (table1-d16; linear from 0, 0.833 per step)" in paper  # the ramp named
    assert "| keel vs preln |" in paper and "| keel vs preln (best + 0.5) |" in paper
    others = ", ".join(grid for grid in MAXLR_GRIDS if grid != "table1-d16")  # every other max-LR grid, in order
    assert f"Not (yet) run: {others}, " in paper and "table1-d64, depth-d16" in others
    row = next(line for line in paper.splitlines() if line.startswith("| keel | "))
    assert row.count("/") >= 2  # a cell per seed: max LR / loss-optimal LR (best held-out)
    # a no-gain grid is reported beside its Table 1 grid's keel rows, with the seed-by-seed comparison
    shutil.copytree(out, tmp_path / "paper" / "nogain-d16")
    assert cli_main(["paper-report", str(tmp_path / "paper")]) == 0
    paper = (tmp_path / "paper" / "report.md").read_text()
    section = paper.split("## Keel without its outer norms' gains, 16 x 64 (nogain-d16 beside table1-d16's keel rows)")[
        1
    ]
    assert "| keel | " in section and "| keel-nogain | " in section and "| keel-nogain vs keel |" in section
    # a truncated stability.json is named (it was JSONDecodeError's traceback), as is a missing directory
    stability = tmp_path / "paper" / "nogain-d16" / "keel-d2-s1337" / "stability.json"
    stability.write_text(stability.read_text()[:20])
    capsys.readouterr()
    assert cli_main(["paper-report", str(tmp_path / "paper")]) == 2
    assert capsys.readouterr().err.startswith(
        f"keel paper-report: config error: {stability} cannot be read (truncated?): "
    )
    assert cli_main(["paper-report", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err == (
        f"keel paper-report: config error: paper-report: {tmp_path / 'none'} is not a "
        "directory; give the DIR `make paper` wrote (PAPER_OUT, by default runs/paper)\n"
    )


def test_maxlr_stops_a_probe_not_learned_by_learn_by_lr(tiny_data, tmp_path):
    """A 2-block model is nowhere near 0.5 nat below the unigram loss after a dozen steps: with --learn-by-lr at half
    the peak, the probe stops at the first evaluation from the step the ramp reaches it (step 11: LR 12/24 of the
    peak), is never judged, and counts as finished on a rerun; the emitted commands carry the option."""
    out = tmp_path / "maxlr"
    argv = [
        "maxlr",
        "--schemes",
        "keel",
        "--depths",
        "2",
        "--steps",
        "24",
        "--peak-lr",
        "0.02",
        "--ramp",
        "linear",
        "--eval-every",
        "4",
        "--learn-by-lr",
        "0.01",
        "--out",
        str(out),
        *QUICK,
        *tiny_data,
    ]
    assert cli_main(argv) == 0
    stability = json.loads((out / "keel-d2-s1337" / "stability.json").read_text())
    assert (stability["kind"], stability["step"], stability["steps"]) == ("unlearned", 11, 12)
    assert stability["max_lr_seen"] == pytest.approx(0.01)
    [row] = read_csv(out / "maxlr.csv")
    assert (row["stop"], row["resolved"], row["max_tolerable_lr"]) == ("unlearned", "False", "")
    assert "a probe not learned by LR 0.01 stopped" in json.loads((out / "sweep.json").read_text())["protocol"]
    mtime = (out / "keel-d2-s1337" / "stability.json").stat().st_mtime
    assert cli_main(argv) == 0  # finished: not trained again
    assert (out / "keel-d2-s1337" / "stability.json").stat().st_mtime == mtime
    assert cli_main([*argv, "--emit", "commands"]) == 0
    assert "--learn-by-lr 0.01" in (out / "commands.sh").read_text()
    with pytest.raises(ConfigError, match=r"--learn-by-lr 0.03: must be > 0 and at most --peak-lr 0.02"):
        maxlr_main([*argv[1:], "--learn-by-lr", "0.03"])


def test_a_resumed_probe_counts_the_cost_of_its_earlier_sessions(tiny_data, tmp_path):
    """RunTime rides in the checkpoints: the session that resumes a run starts from the CPU and wall seconds the
    earlier one had spent by its last checkpoint, and adds its own."""
    from keel.experiments.timing import RunTime
    from keel.training import train
    from keeltest.runs import tiny_config

    run = tmp_path / "probe"
    first = RunTime()
    train(tiny_config(tiny_data, run, "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=4"), [first])
    spent = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["callbacks"]["ProbeCost"]
    assert spent["cpu_s"] > 0 and spent["wall_s"] > 0
    second = RunTime()
    train(tiny_config(tiny_data, run, "trainer.max_steps=8", "resume=auto"), [second])
    assert second.earlier == {"cpu_s": spent["cpu_s"], "wall_s": spent["wall_s"]}
    assert second.earlier_made_by == spent["made_by"]  # what made the first session, carried over
    total = second.state_dict()
    assert total["cpu_s"] > spent["cpu_s"] and total["wall_s"] > spent["wall_s"]


def test_maxlr_grid_variants_emit_and_paper_scale_config(tmp_path, capsys):
    out = tmp_path / "g"
    grid = [
        "maxlr",
        "--schemes",
        "keel,preln",
        "--alphas",
        "1,L",
        "--seeds",
        "1,2",
        "--out",
        str(out),
        "--variant",
        "noinner=model.scheme=keel,model.keel_inner_norm=false",
    ]
    assert cli_main([*grid, "--steps", "10", "--eval-every", "20"]) == 2  # no held-out loss would be measured
    assert capsys.readouterr().err == (
        "keel maxlr: config error: --steps 10: must be at least --eval-every 20, or no held-out loss is measured\n"
    )
    assert cli_main([*grid, "--emit", "commands"]) == 0
    commands = (out / "commands.sh").read_text().splitlines()
    names = [c.split("--only ")[-1] for c in commands]
    assert names == [f"{row}-d16-s{seed}" for seed in (1, 2) for row in ("keel-a1", "keel-aL", "preln", "noinner")]
    assert all(c.startswith("keel maxlr --schemes keel,preln --seeds 1,2 --alphas 1,L ") for c in commands)
    capsys.readouterr()
    assert cli_main([*grid, "--only", "noinner-d16-s2", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# keel maxlr run noinner-d16-s2\n")
    cfg = yaml.safe_load(printed)
    assert cfg["model"]["keel_inner_norm"] is False and cfg["model"]["width"] == 64  # the miniature
    assert (cfg["run"]["seed"], cfg["callbacks"]["stability"]["signal"], cfg["optim"]["schedule"]) == (
        2,
        "val",
        "exp_warmup",
    )
    assert cli_main(["maxlr", "model=paper_d64", "--schemes", "keel", "--print-config"]) == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert (model["depth"], model["width"], model["n_heads"], model["n_kv_heads"], model["seq_len"]) == (
        64,
        1024,
        16,
        8,
        2048,
    )
    assert cli_main(["maxlr", "--depths", "48", "model.width=32", "--schemes", "keel", "--print-config"]) == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert (model["depth"], model["width"], model["n_heads"]) == (48, 32, 4)  # a model key: no miniature
    assert cli_main(["maxlr", "--schemes", "preln", "model.init=normal", "--print-config"]) == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert (model["init"], model["width"]) == ("normal", 64)  # the shared init for all: still the miniature
    for bad, named in (
        (["--variant", "noinner"], "--variant"),
        (["--only", "nope"], "--only"),
        (["--start-lr", "5"], "--start-lr"),
        (["--peak-lr", "0"], "--peak-lr"),
        (["--ramp", "linear", "--peak-lr", "0"], "--peak-lr"),
        (["--ramp", "linear", "--start-lr", "1e-4"], "a linear ramp starts at 0"),
    ):
        with pytest.raises(ConfigError, match=named):
            maxlr_main(["--out", str(out), *bad])
    # a linear ramp has no start LR to compare with: any positive peak is a valid ramp (0 -> peak)
    assert cli_main(["maxlr", "--schemes", "keel", "--ramp", "linear", "--peak-lr", "0.0005", "--print-config"]) == 0
    optim = yaml.safe_load(capsys.readouterr().out)["optim"]
    assert (optim["schedule"], optim["lr"], optim["warmup_steps"]) == ("linear_warmup", 0.0005, 560)


def test_sign_test_is_the_exact_binomial():
    assert sign_test(5, 0) == pytest.approx(2 / 32) and sign_test(0, 5) == pytest.approx(2 / 32)
    assert sign_test(4, 1) == pytest.approx(2 * 6 / 32) and sign_test(3, 2) == 1.0 and sign_test(0, 0) == 1.0


def test_a_paired_comparison_is_per_seed_and_gives_no_verdict_below_three_seeds():
    a = {1: 0.12, 2: 0.10, 3: 0.09, 4: 0.2}
    b = {1: 0.06, 2: 0.08, 3: 0.10, 5: 0.3}  # seed 4 and 5 have no partner
    comparison = paired(a, b)
    assert comparison.ratios == pytest.approx((2.0, 1.25, 0.9))
    assert comparison.median_ratio == pytest.approx(1.25)  # the median of the ratios, not 0.10 / 0.08 by chance
    assert (comparison.higher, comparison.lower, comparison.verdict) == (2, 1, "higher in 2, lower in 1 of 3")
    # Wilcoxon's exact test: the log ratios' ranks 3 (+), 2 (+), 1 (-): W- = 1 of the 8 equally likely sign patterns
    # give W- <= 1 twice (W- = 0, 1), two-sided 4/8
    assert comparison.signed_rank_p == pytest.approx(0.5)
    assert comparison.cells()["verdict"] == "higher in 2, lower in 1 of 3"
    five = paired({seed: 2.0 + seed / 10 for seed in range(5)}, dict.fromkeys(range(5), 1.0))
    assert five.verdict == "higher in 5 of 5" and five.sign_p == five.signed_rank_p == pytest.approx(2 / 32)
    assert five.t_p < five.sign_p  # consistent ratios: the t-test on the logs is the sharper
    assert paired({1: 2.0, 2: 0.5}, {1: 1.0, 2: 1.0}).verdict == "n = 2, no verdict"


def test_an_lr_sweep_names_the_lr_to_train_with_from_the_seeds_mean_curve():
    def row(lr: float, seed: int, width: int = 64, best: float = 0.013, steps: int = 1000) -> dict:
        loss = 4.0 + 0.1 * math.log2(lr / best) ** 2 + 0.01 * seed  # a parabola in log2 LR, its vertex at `best`
        return {"scheme": "keel", "depth": 8, "width": width, "alpha": 16.0, "seed": seed, "lr": lr,
                "val_loss": loss, "val_step": steps - 1, "max_steps": steps}  # fmt: skip

    lrs = (0.0025, 0.005, 0.01, 0.02, 0.04)
    rows = [row(lr, seed) for lr in lrs for seed in (1, 2, 3)]
    rows += [row(lr, 1, width=256, best=0.1) for lr in lrs]  # another group: best at the sweep's top
    rows.append(row(0.08, 1, steps=2000) | {"val_step": 499})  # unfinished: left out
    assert lr_optima(rows) == [
        "keel 8 x 64: optimum LR 0.013, over 5 LRs x 3 seed(s): train with optim.lr=0.013",
        "keel 8 x 256: optimum LR >= 0.04 (its highest: extend above), over 5 LRs x 1 seed(s): train with "
        "optim.lr=0.04",
    ]
    assert lr_optima([row(lr, 1) for lr in lrs[:2]]) == []  # two LRs: no optimum


def test_sweep_emits_commands_and_slurm(tmp_path, capsys):
    grid = ["--schemes", "keel,preln", "--depths", "4", "--alphas", "sqrt(L),2L", "trainer.max_steps=7"]
    assert cli_main(["sweep", *grid, "--emit", "commands", "--out", str(tmp_path / "c")]) == 0
    commands = (tmp_path / "c" / "commands.sh").read_text().splitlines()
    assert len(commands) == 3  # keel x 2 alphas, preln once: alpha is Keel's
    assert all(c.startswith("keel pretrain trainer.max_steps=7 model.scheme=") for c in commands)
    assert "model.keel_alpha=2.8284271247461903" in commands[0] and "model.keel_alpha=16.0" in commands[1]
    assert "keel_alpha" not in commands[2] and f"run.dir={tmp_path / 'c'}/preln-d4" in commands[2]
    assert cli_main(["sweep", *grid, "--emit", "slurm", "--sbatch=--gres=gpu:8", "--out", str(tmp_path / "s")]) == 0
    script = (tmp_path / "s" / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-2" in script and "#SBATCH --gres=gpu:8" in script
    assert script.count("'keel pretrain ") == 3
    manifest = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [r["axes"].get("alpha") for r in manifest["runs"]] == ["sqrt(L)", "2L", None]
    deeper = [
        "sweep",
        "--depths",
        "2,4,8",
        "--fixed-params",
        "--emit",
        "commands",
        "--out",
        str(tmp_path / "w"),
        "model.depth=4",
        "model.width=64",
        "model.n_heads=4",
    ]
    assert cli_main(deeper) == 0
    widths = [c.split("model.width=")[-1].split()[0] for c in (tmp_path / "w" / "commands.sh").read_text().splitlines()]
    assert widths == ["88", "64", "48"]  # deeper = narrower, at ~ the depth-4 width-64 parameter count
    # a key of the swept scheme alone, beside another configured scheme: checked against the swept one
    rule = ["sweep", "--schemes", "preln", "--depths", "4,16", "--emit", "commands", "--out", str(tmp_path / "r")]
    assert cli_main([*rule, "model.branch_base_depth=4"]) == 0
    assert "model.branch_base_depth=4" in (tmp_path / "r" / "commands.sh").read_text()


def test_a_sweep_over_some_seeds_adds_its_runs_to_the_grids_listing(tmp_path, capsys):
    """Two runs of one grid, a seed each (docs/lr-transfer.md's first pass), list both; a grid of other overrides
    in the same directory replaces the listing and says which runs it no longer lists."""
    out = tmp_path / "g"

    def sweep(seeds: str, *overrides: str) -> list[str]:
        argv = ["sweep", "--lrs", "0.01,0.02", "--seeds", seeds, "--emit", "commands", "--out", str(out)]
        assert cli_main([*argv, "trainer.max_steps=7", *overrides]) == 0
        return [run["name"] for run in json.loads((out / "sweep.json").read_text())["runs"]]

    assert sweep("2") == ["lr0.01-s2", "lr0.02-s2"]
    assert sweep("1,2") == ["lr0.01-s2", "lr0.02-s2", "lr0.01-s1", "lr0.02-s1"]
    capsys.readouterr()
    assert sweep("1") == ["lr0.01-s2", "lr0.02-s2", "lr0.01-s1", "lr0.02-s1"]
    assert "also lists 2 run(s) of this grid beyond this command's (lr0.01-s2, lr0.02-s2)" in capsys.readouterr().out
    assert sweep("1", "model.depth=2") == ["lr0.01-s1", "lr0.02-s1"]
    assert "it now lists this one, without lr0.01-s2, lr0.02-s2" in capsys.readouterr().out


def sweep_argv(out: Path, tiny_data: list[str]) -> list[str]:
    return [
        "sweep",
        "--schemes",
        "preln",
        "--lrs",
        "1e-3,3e-3",
        "--out",
        str(out),
        *QUICK,
        *tiny_data,
        "trainer.max_steps=6",
        "trainer.val_every_n_steps=6",
        "trainer.val_batches=2",
    ]


@pytest.fixture(scope="module")
def sweep_dir(tiny_data, tmp_path_factory) -> Path:
    """A 2-run grid (two learning rates) trained here, then collected."""
    out = tmp_path_factory.mktemp("sweep")
    assert cli_main(sweep_argv(out, tiny_data)) == 0
    return out


def test_sweep_runs_and_collects_a_grid(sweep_dir):
    rows = read_csv(sweep_dir / "sweep.csv")
    assert [r["run"] for r in rows] == ["preln-lr1e-3", "preln-lr3e-3"]
    assert [float(r["lr"]) for r in rows] == [1e-3, 3e-3]
    for r in rows:
        assert int(r["val_step"]) == 5 and 0 < float(r["val_loss"]) < math.log(512) + 1
        assert r["failed"] == "False" and r["max_tolerable_lr"] == ""  # stability.json read, no failure
    assert (sweep_dir / "sweep_val_loss_vs_lr.png").stat().st_size > 0
    (sweep_dir / "sweep.csv").unlink()
    assert cli_main(["sweep", "collect", str(sweep_dir)]) == 0  # collect alone rebuilds it
    assert read_csv(sweep_dir / "sweep.csv") == rows


def test_every_run_record_says_what_made_it_and_the_report_flags_a_grid_that_mixes_commits(sweep_dir, tmp_path):
    """keel.provenance in the time records and redundancy rows; keel paper-report's origins table per grid, with the
    CPU time of its timed runs."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    made = json.loads((sweep_dir / "preln-lr1e-3" / "sweep_time.json").read_text())["made_by"]
    assert len(made) == 1 and made[0]["commit"] == head and made[0]["threads"] == 1  # the tests' trainer.threads
    assert made[0]["torch"] and made[0]["cpu"] and isinstance(made[0]["dirty"], bool)
    out = tmp_path / "paper"
    shutil.copytree(sweep_dir, out / "lr-d16", ignore=shutil.ignore_patterns("checkpoints"))
    cpu_s = [
        json.loads((out / "lr-d16" / run / "sweep_time.json").read_text())["cpu_s"]
        for run in ("preln-lr1e-3", "preln-lr3e-3")
    ]
    assert origins_table(out) == [
        {
            "grid": "lr-d16",
            "runs": 2,
            "commits": head[:10],
            "torch": made[0]["torch"],
            "threads": "1",
            "flag": "2 made on changed code" if made[0]["dirty"] else "-",
            "timed": "2 of 2",
            "CPU-min per run": f"{min(cpu_s) / 60:.1f}-{max(cpu_s) / 60:.1f}",
            "CPU-hours (timed)": f"{sum(cpu_s) / 3600:.2f}",
        }
    ]
    # one run made by other code, one that does not say (recorded before runs said what made them)
    record = out / "lr-d16" / "preln-lr1e-3" / "sweep_time.json"
    record.write_text(json.dumps({"cpu_s": 1.0, "wall_s": 1.0, "made_by": [{**made[0], "commit": "0" * 40}]}))
    (out / "lr-d16" / "preln-lr3e-3" / "sweep_time.json").write_text(json.dumps({"cpu_s": 1.0, "wall_s": 1.0}))
    (row,) = origins_table(out)
    assert row["commits"] == "0000000000 (1), unrecorded (1)" and row["flag"].startswith("mixes commits")
    assert (row["timed"], row["CPU-min per run"], row["CPU-hours (timed)"]) == ("2 of 2", "0.0-0.0", "0.00")
    (out / "lr-d16" / "preln-lr3e-3" / "sweep_time.json").unlink()  # a run without a time record: not timed
    (row,) = origins_table(out)
    assert row["timed"] == "1 of 2" and row["commits"] == "0000000000 (1), unrecorded (1)"


def test_a_run_resumed_on_other_code_keeps_both_sessions_provenance():
    from keel.experiments.timing import RunTime
    from keel.provenance import made_by

    earlier = {**made_by(1), "commit": "0" * 40}
    timer = RunTime()
    timer.load_state_dict({"cpu_s": 1.0, "wall_s": 2.0, "made_by": [earlier]})
    timer.on_fit_start(None, None)
    assert timer.state_dict()["made_by"] == [earlier, made_by(torch.get_num_threads())]
    timer.load_state_dict({"cpu_s": 1.0, "wall_s": 2.0})  # a checkpoint from before runs recorded it
    assert timer.state_dict()["made_by"] == [made_by(torch.get_num_threads())]


def test_a_rerun_sweep_trains_only_what_its_records_do_not_show_finished(sweep_dir, tiny_data, tmp_path, capsys):
    """The committed records of a grid (no checkpoints) are enough for a rerun to skip its finished runs; a run
    whose stability.json stops short of max_steps trains again. Each trained run leaves its cost."""
    out = tmp_path / "records"
    shutil.copytree(sweep_dir, out, ignore=shutil.ignore_patterns("checkpoints"))
    for run in ("preln-lr1e-3", "preln-lr3e-3"):
        assert json.loads((sweep_dir / run / "sweep_time.json").read_text())["cpu_s"] > 0
    short = out / "preln-lr3e-3" / "stability.json"
    short.write_text(json.dumps({**json.loads(short.read_text()), "steps": 4}))
    kept = (out / "preln-lr1e-3" / "stability.json").read_bytes()
    capsys.readouterr()
    assert cli_main(sweep_argv(out, tiny_data)) == 0
    printed = capsys.readouterr().out
    assert "run 1/2: preln-lr1e-3: finished before, skipped" in printed
    assert "run 2/2: preln-lr3e-3: done" in printed
    assert not (out / "preln-lr1e-3" / "checkpoints").exists()
    assert (out / "preln-lr1e-3" / "stability.json").read_bytes() == kept
    assert (out / "preln-lr3e-3" / "checkpoints").is_dir()
    assert json.loads(short.read_text())["steps"] == 6


def test_redundancy_rows_per_block_and_zeroed_block_costs_nothing(sweep_dir, tmp_path, capsys):
    checkpoint = torch.load(sweep_dir / "preln-lr3e-3" / "checkpoints" / "last.ckpt", weights_only=True)
    for name in ("blocks.1.attn.branch.out.weight", "blocks.1.ffn.branch.down.weight"):  # block 1 = identity
        checkpoint["state_dict"][f"model.{name}"].zero_()
    zeroed = tmp_path / "zeroed.ckpt"
    torch.save(checkpoint, zeroed)
    out = tmp_path / "red"
    other = sweep_dir / "preln-lr1e-3" / "checkpoints" / "last.ckpt"
    argv = ["redundancy", f"checkpoint={zeroed}", "--checkpoint", str(other), "--batches", "2", "--out", str(out)]
    assert cli_main(argv) == 0
    rows = read_csv(out / "redundancy.csv")
    assert {r["commit"] for r in rows} == {
        json.loads((sweep_dir / "preln-lr1e-3" / "sweep_time.json").read_text())["made_by"][0]["commit"]
    }  # what made the rows, as what made the runs
    assert [(r["path"], int(r["block"])) for r in rows] == [
        (str(zeroed), 0),
        (str(zeroed), 1),
        (str(other), 0),
        (str(other), 1),
    ]
    assert float(rows[1]["ppl_increase"]) == pytest.approx(0.0, abs=1e-6)
    assert abs(float(rows[0]["ppl_increase"])) > 1e-3
    assert (out / "redundancy.png").stat().st_size > 0
    # --append: the zeroed checkpoint's rows stay (its file gone, as a committed record's), `other` measured again
    # replaces its own rows, a new one adds its; without --append the table holds only what was measured
    zeroed.unlink()
    third = sweep_dir / "preln-lr3e-3" / "checkpoints" / "last.ckpt"
    assert cli_main(["redundancy", str(other), str(third), "--batches", "2", "--out", str(out), "--append"]) == 0
    appended = read_csv(out / "redundancy.csv")
    assert appended[:2] == rows[:2]
    assert [(r["path"], int(r["block"])) for r in appended[2:]] == [
        (str(other), 0),
        (str(other), 1),
        (str(third), 0),
        (str(third), 1),
    ]
    assert [r["loss_increase"] for r in appended[2:4]] == [r["loss_increase"] for r in rows[2:]]  # deterministic
    assert cli_main(["redundancy", str(third), "--batches", "2", "--out", str(out)]) == 0
    assert [r["path"] for r in read_csv(out / "redundancy.csv")] == [str(third)] * 2
    (out / "redundancy.csv").write_text("step,loss\n1,2\n")
    capsys.readouterr()
    assert cli_main(["redundancy", str(third), "--batches", "2", "--out", str(out), "--append"]) == 2
    err = capsys.readouterr().err
    assert "redundancy --append: " in err and "redundancy.csv is not a redundancy.csv" in err
    assert (out / "redundancy.csv").read_text() == "step,loss\n1,2\n"  # refused before anything is written


def test_the_ratio_trend_counts_the_seeds_where_one_or_neither_learned(tmp_path):
    """Where one scheme or neither resolves there is no ratio, but the report counts each case and the plot marks
    the seeds where only Keel learned; a point's grids are read together."""

    def row(scheme, seed, lr):
        return {
            "row": scheme,
            "seed": seed,
            "depth": 16,
            "width": 32,
            "resolved": lr is not None,
            "failure": "divergence",
            "max_tolerable_lr": lr,
            "loss_optimal_lr": 0.01,
            "init": "gpt2" if scheme == "preln" else "normal",
        }

    rows = [
        row("keel", 1, 0.2),
        row("preln", 1, 0.4),
        row("keel", 2, 0.1),
        row("preln", 2, None),
        row("keel", 3, None),
        row("preln", 3, 0.3),
        row("keel", 4, None),
        row("preln", 4, None),
        *[
            {**row(scheme, seed, None), "resolved": True, "failure": None, "max_lr_seen": 0.1}  # ran the ramp
            for scheme, seed in (("keel", 5), ("preln", 5), ("keel", 6))
        ],
        row("preln", 6, 0.05),
    ]
    # seeds 3-4: Keel unresolved, 5: two lower bounds, nothing to plot; 6: Keel's peak over Pre-LN's limit, a bound
    assert ratios(rows) == [0.5, None, 2.0]
    gentle = [{**row("postln", 1, 0.02), "init": "normal"}]  # a point's second grid (Post-LN's slope) is read too
    table, points = trend(
        {"depth-d16": rows, "gentle-d16": gentle}, {16: (("depth-d16", "gentle-d16"), 16, 32)}, "blocks"
    )
    assert table[0]["keel / preln (per seed)"] == (  # each seed once; a peak reached unbroken is a lower bound
        "0.5, >=2; Pre-LN unresolved in 1; Keel unresolved in 1; neither resolved in 1; "
        "neither broke by the ramp's end in 1"
    )
    assert (table[0]["grid"], table[0]["postln max LR"]) == ("depth-d16, gentle-d16", "0.02 (1/1)")
    assert table[0]["keel max LR"] == "0.1 (4/6, 2 unbroken by the ramp's end)"
    plot_ratios(points, {32: [None, None]}, [], tmp_path / "ratio.png")  # a panel with no ratio at all draws too
    assert (tmp_path / "ratio.png").stat().st_size > 0


def test_the_transfer_table_says_how_far_each_lr_moves_over_the_widths(tmp_path):
    """sp's grids (the width trend) beside mup's: per width the seeds' loss-optimal LR, and max / min of the medians;
    a width with no run is a dash and is not counted."""

    def row(width, seed, optimal, max_lr):
        return {
            "row": "keel",
            "seed": seed,
            "depth": 16,
            "width": width,
            "resolved": max_lr is not None,
            "failure": "divergence",
            "max_tolerable_lr": max_lr,
            "loss_optimal_lr": optimal,
            "init": "normal",
        }

    grids = {
        "depth-d16": [row(32, 1, 0.04, 0.3), row(32, 2, 0.02, 0.3)],
        "width-w256": [row(256, 1, 0.0075, 0.015)],
        "mup-width-w32": [row(32, 1, 0.01, 0.1)],
        "mup-width-w128": [row(128, 1, 0.012, None)],
    }
    table, points = transfer(grids)
    assert [entry["width"] for entry in table] == [32, 64, 128, 256, "max / min over widths"]
    assert table[0]["keel sp loss-optimal LR"] == "0.03 [0.02-0.04] (2 seeds)"
    assert table[1]["keel sp loss-optimal LR"] == "-"
    assert table[2]["keel mup max LR"] == "- (0/1 resolved)"
    moves = table[-1]
    assert moves["keel sp loss-optimal LR"] == "4x (2 widths)"  # median 0.03 at 32 over 0.0075 at 256
    assert moves["keel mup loss-optimal LR"] == "1.2x (2 widths)"
    assert moves["keel mup max LR"] == moves["preln sp loss-optimal LR"] == "-"
    assert points["keel", "mup"] == {32: [0.01], 64: [], 128: [0.012], 256: []}
    plot_transfer(points, tmp_path / "transfer.png")
    assert (tmp_path / "transfer.png").stat().st_size > 0


def test_the_init_table_sets_each_schemes_recipe_beside_the_shared_init():
    """Only schemes whose init differs between the two trees are compared; Keel's rows (the same runs) are not."""

    def row(scheme, seed, lr, init, best):
        return {
            "row": scheme,
            "seed": seed,
            "depth": 16,
            "width": 128,
            "resolved": lr is not None,
            "failure": "divergence",
            "max_tolerable_lr": lr,
            "loss_optimal_lr": 0.01,
            "init": init,
            "best_heldout": best,
        }

    own = [row("keel", 1, 0.17, "normal", 5.6), row("preln", 1, 0.17, "gpt2", 5.9), row("preln", 2, 0.1, "gpt2", 6.1)]
    shared = [
        row("keel", 1, 0.17, "normal", 5.6),
        row("preln", 1, None, "normal", 6.3),
        row("preln", 2, None, "normal", 6.4),
    ]
    (entry,) = init_sensitivity({"width-w128": own}, {"width-w128": shared, "depth-d16": shared})
    assert entry == {
        "grid": "width-w128",
        "blocks x width": "16 x 128",
        "scheme": "preln",
        "own init": "gpt2",
        "own: learned": "2/2",
        "own: max LR median": "0.135",
        "own: best held-out median": "6",
        "shared init": "normal",
        "shared: learned": "0/2",
        "shared: max LR median": "-",
        "shared: best held-out median": "6.35",
    }


def test_the_resolution_sets_each_seeds_perturbed_max_lrs_beside_its_table1_value():
    """Per seed: Table 1's max LR, the perturbed rows' and max / min over them, only where every one is measured (a
    ramp run unbroken is a bound, a run missing no value); per scheme the spread's median and max over seeds."""

    def row(label, seed, lr, failure="divergence"):
        scheme = label.split("-")[0]
        return {"row": label, "scheme": scheme, "seed": seed, "resolved": lr is not None, "failure": failure} | (
            {"max_tolerable_lr": lr} if failure else {"max_lr_seen": lr}
        )

    table1 = [row("keel", 1, 0.12), row("keel", 2, 0.1), row("keel", 3, 0.2), row("preln", 1, 0.08)]
    perturbed = [
        *(row(f"keel-{name}", 1, lr) for name, lr in (("threads2", 0.15), ("ulp", 0.1))),
        *(row(f"keel-{name}", 2, lr) for name, lr in (("threads2", 0.1), ("ulp", 0.11))),
        row("keel-threads2", 3, 0.4, failure=None),
        row("keel-ulp", 3, 0.2),
        row("preln-threads2", 1, None),
    ]
    seeds, summary = resolution_tables(table1, perturbed)
    assert [(r["scheme"], r["seed"], r["Table 1"], r["2 threads"], r["init_std + 1 ulp"]) for r in seeds] == [
        ("keel", 1, "0.12", "0.15", "0.1"),
        ("keel", 2, "0.1", "0.1", "0.11"),
        ("keel", 3, "0.2", ">= 0.4", "0.2"),
        ("preln", 1, "0.08", "n.r.", ""),
    ]
    assert [r["spread (max / min)"] for r in seeds] == ["1.5", "1.1", "-", "-"]
    assert summary == [
        {"scheme": "keel", "seeds with a spread": "2/3", "spread median": "1.3", "spread max": "1.5"},
        {"scheme": "preln", "seeds with a spread": "0/1", "spread median": "-", "spread max": "-"},
    ]


def test_a_record_that_claims_more_steps_than_its_checkpoint_holds_is_not_finished(tiny_run, tmp_path):
    """A stability.json of every step beside a last checkpoint of fewer (another run's record, or edited) was
    'finished before, skipped': now the run trains on from its checkpoint. Records alone (committed, no
    checkpoints) are still believed."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run / "checkpoints", run / "checkpoints")  # step 30
    record = {"steps": 40, "failed": False}
    (run / "stability.json").write_text(json.dumps(record))
    cfg = load_config(overrides=["trainer.max_steps=40"])
    assert not already_trained(run, cfg)
    (run / "stability.json").write_text(json.dumps({**record, "steps": 30}))
    assert already_trained(run, load_config(overrides=["trainer.max_steps=30"]))
    shutil.rmtree(run / "checkpoints")
    (run / "stability.json").write_text(json.dumps(record))
    assert already_trained(run, cfg)
