"""keel.experiments.trained (the trained-model tables of `keel paper-report`) on synthetic grids: run directories as
`keel sweep` lays them out (its own sweep.json), each with a config.yaml from the project's config writer, an
eval_history.json from the in-loop evaluation's writer and a stability.json from the monitor's; every expected number
is computed here from the synthetic inputs (numpy's interpolation for the loss levels)."""

from __future__ import annotations

import json
import random
import shutil
import statistics
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from keel.artifacts import STABILITY
from keel.callbacks.downstream_eval import DownstreamEval
from keel.callbacks.stability import Failure, StabilityMonitor
from keel.cli import main as cli_main
from keel.config import load_config
from keel.experiments.lr_transfer import optimum
from keel.experiments.lr_transfer import sections as lr_transfer_sections
from keel.experiments.records import SWEEP_TIME
from keel.experiments.stats import apart, direction, fmt, spread
from keel.experiments.summary import table3_rows
from keel.experiments.tables import write_table
from keel.experiments.trained import (
    LOSS,
    PAIR,
    TrainedGrid,
    layer_profile,
    layer_use,
    load_trained,
    lr_table,
    matched_gaps,
    middle_pairs,
    profile_pairs,
    read_redundancy,
    section8_profile,
    tuned_depth,
)
from keel.rundir import write_config

STEPS = 600  # evaluations every 200 steps: at steps 199, 399, 599 (0-based)
EVAL = ["eval.every_n_steps=200", "trainer.val_every_n_steps=100", f"trainer.max_steps={STEPS}"]
# final held-out loss by design (before a +-0.02 seed noise): Keel falls with LR, Pre-LN is U-shaped
LR_GRID = {"keel": [5.0, 4.9, 4.8, 4.7], "preln": [5.2, 5.0, 5.1, 5.4]}
LRS = [0.005, 0.01, 0.02, 0.04]
DEPTH_GRID = {16: "tuned-depth-d16", 64: "lr-d64"}  # Table 3's grids at width 32 (64 blocks: the LR sweep's)
# the depth grids: Keel's gap to Pre-LN at its best LR grows from ~0.1 (16 blocks) to ~0.3 (64)
TUNED = {
    16: {"keel": [5.1, 5.0, 5.05], "preln": [5.2, 5.1, 5.15]},
    64: {"keel": [5.0, 4.9, 4.95], "preln": [5.3, 5.25, 5.2]},
}
TUNED_LRS = [0.005, 0.01, 0.02]
METRICS = ["keel_next_line acc_mutual_info", "keel_next_line acc", "keel_next_line acc_norm", "keel_last_token acc"]


def trajectory(rng: random.Random, final: float) -> list[dict]:
    """Three evaluations with a strictly falling held-out loss and random scores."""
    return [
        {
            "step": step,
            "val_loss": final + 0.5 * (2 - i) + rng.uniform(0, 0.1),
            "wall_s": 1.0,
            "scores": {
                "keel_next_line": {
                    "acc_mutual_info": rng.uniform(0.25, 0.7),
                    "acc": rng.uniform(0.2, 0.6),
                    "acc_norm": rng.uniform(0.2, 0.6),
                },
                "keel_last_token": {"perplexity": rng.uniform(10, 100), "acc": rng.uniform(0, 0.3)},
            },
        }
        for i, step in enumerate((199, 399, 599))
    ]


def make_grid(
    out: Path,
    name: str,
    lrs: list[float],
    depth: int,
    width: int,
    finals: dict,
    rng: random.Random,
    failed: set[str] = frozenset(),
    unfinished: set[str] = frozenset(),
) -> dict[str, list[dict]]:
    """A `keel sweep` grid (keel, preln x lrs x seeds 1-3) with every run's records; its evaluations by run name."""
    overrides = [f"model.depth={depth}", f"model.width={width}", *EVAL]
    assert (
        cli_main(
            [
                "sweep",
                "--emit",
                "commands",
                "--schemes",
                "keel,preln",
                "--lrs",
                ",".join(map(str, lrs)),
                "--seeds",
                "1,2,3",
                "--out",
                str(out / name),
                *overrides,
            ]
        )
        == 0
    )
    histories, base = {}, load_config(None, overrides)
    for run in json.loads((out / name / "sweep.json").read_text())["runs"]:  # the runs' configs, as keel sweep's
        axes = run["axes"]
        cfg = replace(
            base,
            model=replace(base.model, scheme=axes["scheme"]),
            optim=replace(base.optim, lr=float(axes["lr"])),
            run=replace(base.run, seed=int(axes["seed"]), dir=str(out / name / run["name"])),
        )
        Path(cfg.run.dir).mkdir()
        write_config(cfg, None)
        evaluations = trajectory(rng, finals[cfg.model.scheme][lrs.index(cfg.optim.lr)] + rng.uniform(-0.02, 0.02))
        if run["name"] in unfinished:
            evaluations = evaluations[:-1]
        histories[run["name"]] = evaluations
        callback = DownstreamEval(cfg)
        callback.primary = {"keel_next_line": ("acc_mutual_info", True), "keel_last_token": ("perplexity", False)}
        callback.history = evaluations
        callback._write_history(SimpleNamespace(is_global_zero=True))
        monitor = StabilityMonitor(run_dir=cfg.run.dir)
        if run["name"] in failed:
            monitor.failure = Failure("spike", 300, 320, cfg.optim.lr, cfg.optim.lr, 7.0, "synthetic")
        (Path(cfg.run.dir) / STABILITY).write_text(json.dumps(monitor.summary(STEPS)))
    return histories


def final(evaluations: list[dict], metric: str) -> float:
    if metric == LOSS:
        return evaluations[-1]["val_loss"]
    task, name = metric.split(" ")
    return evaluations[-1]["scores"][task][name]


def score(evaluation: dict, metric: str) -> float:
    task, name = metric.split(" ")
    return evaluation["scores"][task][name]


def redundancy_rows(grid: Path, increases: dict[str, list[float]]) -> list[dict]:
    """keel redundancy's rows (keel.experiments.redundancy.measure) for the final checkpoint of each run named."""
    return [
        {
            "checkpoint": f"{name}/last ({name.split('-')[0]}, depth {len(values)})",
            "path": str(grid / name / "checkpoints" / "last.ckpt"),
            "scheme": name.split("-")[0],
            "depth": len(values),
            "block": block,
            "val_tokens": 16384,
            "ppl_base": 100.0,
            "ppl_removed": 100.0 + increase,
            "ppl_increase": increase,
            "loss_increase": increase,
        }
        for name, values in increases.items()
        for block, increase in enumerate(values)
    ]


@pytest.fixture(scope="module")
def paper(tmp_path_factory):
    """A paper directory with lr-d16 (one run stopped short, one flagged by the monitor, seed 1 timed), its
    redundancy.csv, and Table 3's depth grids (tuned-depth-d16, and lr-d64 for 64 blocks); the evaluations written,
    by grid and run."""
    out = tmp_path_factory.mktemp("paper")
    rng = random.Random(0)
    histories = {
        "lr-d16": make_grid(
            out, "lr-d16", LRS, 16, 64, LR_GRID, rng, failed={"keel-lr0.01-s2"}, unfinished={"preln-lr0.02-s3"}
        )
    }
    for name in histories["lr-d16"]:  # seed 1 timed (keel sweep's sweep_time.json), 900 CPU-s each
        if name.endswith("-s1"):
            (out / "lr-d16" / name / SWEEP_TIME).write_text(json.dumps({"cpu_s": 900.0, "wall_s": 950.0}))
    for depth, finals in TUNED.items():
        histories[DEPTH_GRID[depth]] = make_grid(out, DEPTH_GRID[depth], TUNED_LRS, depth, 32, finals, rng)
    # keel redundancy's rows (keel.experiments.redundancy.measure) over every final checkpoint of lr-d16 and one more
    increases = {name: [rng.uniform(-0.01, 0.5) for _ in range(16)] for name in [*histories["lr-d16"], "elsewhere"]}
    write_table(redundancy_rows(out / "lr-d16", increases), out / "lr-d16" / "redundancy" / "redundancy.csv")
    grids, missing = load_trained(out)
    return SimpleNamespace(out=out, histories=histories, increases=increases, grids=grids, missing=missing)


def test_the_cells_statistics_and_verdicts():
    values = [4.0, 5.5, 4.25]
    assert spread(values) == (
        f"{statistics.mean(values):.3g} ± {statistics.stdev(values):.3g} [{min(values):.3g}, {max(values):.3g}] n=3"
    )
    assert spread([4.0]) == "4 ± - [4, 4] n=1" and spread([]) == "-"
    assert apart([1, 2], [2.5, 3]) == "yes" and apart([3, 4], [1, 2]) == "yes" and apart([1, 3], [2, 4]) == "no"
    assert apart([1], [2, 3]) == "-"  # one seed has no range to be apart
    assert [direction(v) for v in ([1, 2, 2], [3, 1], [1, 1], [1, 3, 2], [1])] == [
        "rises",
        "falls",
        "flat",
        "not monotone",
        "-",
    ]


def test_the_lr_table_has_every_scheme_and_lr_over_the_finished_seeds(paper):
    grids, missing = paper.grids, paper.missing
    assert set(grids) == {"lr-d16", "lr-d64", "tuned-depth-d16"}
    assert missing == ["tuned-depth-d256"]
    grid, histories = grids["lr-d16"], paper.histories["lr-d16"]
    assert (len(grid.runs), grid.listed) == (23, 24)  # preln-lr0.02-s3 stopped before its last step
    table, verdicts = lr_table(grid.runs)
    assert [(r["scheme"], r["peak LR"]) for r in table] == [(s, fmt(lr)) for s in ("keel", "preln") for lr in LRS]
    for row in table:
        lr = LRS[[fmt(lr) for lr in LRS].index(row["peak LR"])]
        names = [
            f"{row['scheme']}-lr{lr}-s{seed}"
            for seed in (1, 2, 3)
            if f"{row['scheme']}-lr{lr}-s{seed}" != "preln-lr0.02-s3"
        ]
        for metric in (LOSS, *METRICS):
            assert row[metric] == spread([final(histories[name], metric) for name in names]), (row, metric)
        assert row["stability failures"] == ("1/3" if (row["scheme"], lr) == ("keel", 0.01) else f"0/{len(names)}")
        assert row["init"] == {"keel": "normal", "preln": "gpt2"}[row["scheme"]]  # each scheme's own recipe
    assert "keel_last_token perplexity" not in table[0]  # the metrics with a stated chance level only
    keel, preln = verdicts
    assert keel[LOSS].startswith("falls: ") and preln[LOSS].startswith("not monotone: ")
    means = [
        statistics.mean(
            final(histories[f"preln-lr{lr}-s{s}"], LOSS) for s in (1, 2, 3) if f"preln-lr{lr}-s{s}" != "preln-lr0.02-s3"
        )
        for lr in LRS
    ]
    assert preln[LOSS] == "not monotone: " + ", ".join(fmt(m) for m in means)


def test_tasks_are_compared_at_common_loss_levels_along_each_runs_trajectory(paper):
    grid, histories = paper.grids["lr-d16"], paper.histories["lr-d16"]
    table = matched_gaps(grid.runs)
    assert [(r["metric"], r["peak LR"]) for r in table] == [(m, fmt(lr)) for m in METRICS for lr in LRS]
    for row in table:
        lr = LRS[[fmt(lr) for lr in LRS].index(row["peak LR"])]
        runs = {
            s: [histories[n] for n in histories if n.startswith(f"{s}-lr{lr}-") and n != "preln-lr0.02-s3"]
            for s in ("keel", "preln")
        }
        every = runs["keel"] + runs["preln"]
        # the losses fall: a run's first evaluation is its highest; the levels every run passes through
        levels = np.linspace(min(e[0]["val_loss"] for e in every), max(e[-1]["val_loss"] for e in every), 3)
        assert row[f"{LOSS} levels"] == ", ".join(fmt(x) for x in levels)
        for i, level in enumerate(levels, 1):
            at = {
                s: [
                    float(
                        np.interp(level, [e["val_loss"] for e in h][::-1], [score(e, row["metric"]) for e in h][::-1])
                    )
                    for h in runs[s]
                ]
                for s in runs
            }
            separate = min(at["keel"]) > max(at["preln"]) or max(at["keel"]) < min(at["preln"])
            assert row[f"level {i}: keel - preln (sd keel / preln; seeds apart)"] == (
                f"{fmt(statistics.mean(at['keel']) - statistics.mean(at['preln']))} "
                f"({fmt(statistics.stdev(at['keel']))} / {fmt(statistics.stdev(at['preln']))}; "
                f"{'yes' if separate else 'no'})"
            ), (row, i)
        assert row["chance"] == ("~0" if row["metric"] == "keel_last_token acc" else "0.25")


def test_layer_use_reports_the_first_and_last_block_apart_from_the_middle(paper):
    grid = paper.grids["lr-d16"]
    increases, unknown = read_redundancy(paper.out / "lr-d16" / "redundancy" / "redundancy.csv", grid.runs)
    assert unknown == 2  # the checkpoint of no run of the grid, and that of the unfinished run
    table = layer_use(grid.runs, increases)
    assert len(table) == 8
    for row in table:
        lr = LRS[[fmt(lr) for lr in LRS].index(row["peak LR"])]
        seeds = [
            paper.increases[f"{row['scheme']}-lr{lr}-s{s}"]
            for s in (1, 2, 3)
            if f"{row['scheme']}-lr{lr}-s{s}" != "preln-lr0.02-s3"
        ]
        assert row["first block (0)"] == spread([v[0] for v in seeds])
        assert row["middle blocks (1-14), mean"] == spread([sum(v[1:15]) / 14 for v in seeds])
        assert row["last block (15)"] == spread([v[15] for v in seeds])


# Section 8's profile by design, per LR of lr-d16 (shallow blocks 1-7, deep 8-14): each part's removal cost per
# scheme, every block drawn within +-20% of it. 0.005: Pre-LN's shallow blocks the cheaper, Keel flat (the paper's
# direction); 0.01: Pre-LN's shallow the dearer, Keel's the cheaper (the reverse); 0.04: both with cheap shallow
# blocks, Keel's the more so (neither). 0.02: Pre-LN has 2 finished seeds and Keel's seed 1 costs nothing.
PROFILE = {
    0.005: {"keel": (0.03, 0.03), "preln": (0.01, 0.04)},
    0.01: {"keel": (0.01, 0.03), "preln": (0.04, 0.01)},
    0.02: {"keel": (0.02, 0.03), "preln": (0.01, 0.03)},
    0.04: {"keel": (0.002, 0.04), "preln": (0.01, 0.03)},
}
VERDICTS = {0.005: "the paper's direction", 0.01: "the reverse", 0.02: "n = 1, no verdict", 0.04: "neither"}


def designed_increases(names: list[str], rng: random.Random) -> dict[str, list[float]]:
    """Per run, the loss increase of each of 16 blocks removed, by PROFILE; block 0 costs 5 nat, the last block
    50 for Keel (its deep half would otherwise be the dearer everywhere) and 0.5 for Pre-LN."""
    increases = {}
    for name in names:
        scheme, lr, seed = name.split("-")
        shallow, deep = PROFILE[float(lr.removeprefix("lr"))][scheme]
        interior = [rng.uniform(0.8, 1.2) * (shallow if block <= 7 else deep) for block in range(1, 15)]
        if name == "keel-lr0.02-s1":
            interior = [0.0] * 14
        increases[name] = [5.0, *interior, 50.0 if scheme == "keel" else 0.5]
    return increases


@pytest.fixture(scope="module")
def profile(paper, tmp_path_factory):
    """lr-d16's runs with a redundancy.csv of designed profiles (its expected ratios per run, by name)."""
    out = tmp_path_factory.mktemp("profile")
    shutil.copytree(paper.out / "lr-d16", out / "lr-d16", ignore=shutil.ignore_patterns("redundancy"))
    increases = designed_increases(list(paper.histories["lr-d16"]), random.Random(1))
    write_table(redundancy_rows(out / "lr-d16", increases), out / "lr-d16" / "redundancy" / "redundancy.csv")
    ratios = {
        name: float(np.mean(v[1:8]) / np.mean(v[8:15])) if np.mean(v[1:8]) > 0 else None
        for name, v in increases.items()
    }
    grids, _ = load_trained(out)
    return SimpleNamespace(out=out, increases=increases, ratios=ratios, runs=grids["lr-d16"].runs)


def finished(scheme: str, lr: float) -> list[int]:
    return [s for s in (1, 2, 3) if f"{scheme}-lr{lr}-s{s}" != "preln-lr0.02-s3"]


def two_sided_tests(ratios: list[float]) -> tuple[str, str, str]:
    """The sign, exact signed-rank and t-test p-values of log ratios against 0, from scipy."""
    logs = np.log(ratios)
    sign = stats.binomtest(int((logs > 0).sum()), len(logs)).pvalue
    return fmt(sign), fmt(stats.wilcoxon(logs, method="exact").pvalue), fmt(stats.ttest_1samp(logs, 0).pvalue)


def test_the_profile_compares_the_interior_halves_per_run_and_scheme(profile):
    """Each run's shallow / deep from its rows (block 0 and the last block left out), and per scheme whether the
    shallow blocks cost less, seed by seed, with the tests of the log ratios."""
    increases, _ = read_redundancy(profile.out / "lr-d16" / "redundancy" / "redundancy.csv", profile.runs)
    table = layer_profile(profile.runs, increases)
    assert [(r["scheme"], r["peak LR"]) for r in table] == [(s, fmt(lr)) for s in ("keel", "preln") for lr in LRS]
    for row in table:
        lr = LRS[[fmt(lr) for lr in LRS].index(row["peak LR"])]
        names = {s: f"{row['scheme']}-lr{lr}-s{s}" for s in finished(row["scheme"], lr)}
        ratios = {s: profile.ratios[n] for s, n in names.items()}
        assert row["shallow / deep per seed"] == ", ".join(f"s{s}: {fmt(v)}" for s, v in ratios.items())
        assert row["shallow blocks (1-7), mean"] == spread(
            [float(np.mean(profile.increases[n][1:8])) for n in names.values()]
        )
        assert row["deep blocks (8-14), mean"] == spread(
            [float(np.mean(profile.increases[n][8:15])) for n in names.values()]
        )
        shallow, deep = PROFILE[lr][row["scheme"]]
        known = [v for v in ratios.values() if v is not None]
        if len(known) < 3:
            assert row["shallow cost vs deep"] == f"n = {len(known)}, no verdict"
        elif shallow != deep:
            assert all((v < 1) == (shallow < deep) for v in known)  # the design's direction in every seed
            assert row["shallow cost vs deep"] == ("lower in 3 of 3" if shallow < deep else "higher in 3 of 3")
            assert (row["sign p"], row["signed-rank p"], row["t p (log ratio)"]) == two_sided_tests(known)
    (keel_0_02,) = [r for r in table if (r["scheme"], r["peak LR"]) == ("keel", fmt(0.02))]
    assert "s1: -" in keel_0_02["shallow / deep per seed"]  # a run whose blocks cost nothing has no ratio


def test_the_profile_verdict_pairs_keel_with_preln_seed_by_seed(profile):
    """Keel's shallow / deep over Pre-LN's of the same seed: the paper's direction, the reverse, neither, or no
    verdict below 3 paired seeds, as designed; the last block's cost (Keel's 100x Pre-LN's) does not enter."""
    increases, _ = read_redundancy(profile.out / "lr-d16" / "redundancy" / "redundancy.csv", profile.runs)
    pairs = profile_pairs(profile.runs, increases)
    assert [r["peak LR"] for r in pairs] == [fmt(lr) for lr in LRS]
    for row in pairs:
        lr = LRS[[fmt(lr) for lr in LRS].index(row["peak LR"])]
        assert row["verdict"] == VERDICTS[lr]
        seeds = [
            s
            for s in finished("preln", lr)
            if profile.ratios[f"keel-lr{lr}-s{s}"] and profile.ratios[f"preln-lr{lr}-s{s}"]
        ]
        keel = [profile.ratios[f"keel-lr{lr}-s{s}"] for s in seeds]
        preln = [profile.ratios[f"preln-lr{lr}-s{s}"] for s in seeds]
        assert row["seeds paired"] == str(len(seeds))
        assert row["keel / preln of shallow / deep per seed"] == ", ".join(fmt(k / p) for k, p in zip(keel, preln))
        flatter = sum(abs(np.log(k)) < abs(np.log(p)) for k, p in zip(keel, preln))
        assert row["keel flatter"] == f"{flatter} of {len(seeds)}"
        if len(seeds) >= 3:
            assert (row["sign p"], row["signed-rank p"], row["t p (log ratio)"]) == two_sided_tests(
                [k / p for k, p in zip(keel, preln)]
            )
    assert [r["keel flatter"] for r in pairs if r["peak LR"] == fmt(0.005)] == ["3 of 3"]  # Keel flat by design


def test_the_middle_blocks_are_compared_seed_by_seed(profile):
    increases, _ = read_redundancy(profile.out / "lr-d16" / "redundancy" / "redundancy.csv", profile.runs)
    table = middle_pairs(profile.runs, increases)
    for row in table:
        lr = LRS[[fmt(lr) for lr in LRS].index(row["peak LR"])]
        middle = {
            (scheme, s): float(np.mean(profile.increases[f"{scheme}-lr{lr}-s{s}"][1:15]))
            for scheme in ("keel", "preln")
            for s in finished(scheme, lr)
        }
        seeds = [s for s in finished("preln", lr) if middle["keel", s] > 0]
        ratios = [middle["keel", s] / middle["preln", s] for s in seeds]
        assert row["keel / preln per seed"] == ", ".join(fmt(r) for r in ratios)
        assert row["median"] == fmt(statistics.median(ratios))
        if len(seeds) < 3:
            assert row["keel's middle blocks cost"] == f"n = {len(seeds)}, no verdict"
        else:
            assert row["keel's middle blocks cost"] in ("higher in 3 of 3", "lower in 3 of 3")
            assert row["keel's middle blocks cost"].startswith("higher" if min(ratios) > 1 else "lower")
            assert (row["sign p"], row["signed-rank p"], row["t p (log ratio)"]) == two_sided_tests(ratios)
    # Keel's middle blocks cost 0.03 at 0.005 against Pre-LN's 0.025 on average: higher; at 0.04 0.021 against 0.02
    assert table[0]["keel's middle blocks cost"] == "higher in 3 of 3"
    assert [r["keel's middle blocks cost"] for r in table if r["peak LR"] == fmt(0.02)] == ["n = 1, no verdict"]


def test_section8_profile_gives_each_grids_verdicts_and_the_report_prints_them(profile):
    grids, _ = load_trained(profile.out)
    (row,) = section8_profile(profile.out, grids)
    assert row["grid"] == "lr-d16" and row["size"] == "16 blocks x 64"
    assert "shallow blocks (1-7) against deep blocks (8-14)" in row["split"]
    assert row["verdict"] == (
        f"the paper's direction at LR {fmt(0.005)}; the reverse at LR {fmt(0.01)}; n = 1, no verdict at LR "
        f"{fmt(0.02)}; neither at LR {fmt(0.04)}"
    )
    assert row["verdict, thirds"] == row["verdict"]  # blocks 1-4 against 11-14: the same design
    assert row["seeds paired per LR"] == ", ".join(f"{fmt(lr)}: {1 if lr == 0.02 else 3}" for lr in LRS)
    assert cli_main(["paper-report", str(profile.out)]) == 0
    report = (profile.out / "report.md").read_text()
    assert f"**Section 8's profile at 16 blocks x 64 (lr-d16): {row['verdict']}.**" in report
    assert f"(shallow blocks (1-4) against deep blocks (11-14)): {row['verdict, thirds']}." in report
    assert "](layer_profile_lr-d16.png)" in report and (profile.out / "layer_profile_lr-d16.png").stat().st_size > 0


def test_each_scheme_at_its_own_best_lr_per_depth_and_the_gap_against_depth(paper):
    grids = paper.grids
    sweeps, gaps, trend = tuned_depth({g: grids[g].runs for g in DEPTH_GRID.values()})
    best = {}
    for depth in TUNED:
        histories = paper.histories[DEPTH_GRID[depth]]
        for scheme in ("keel", "preln"):
            means = [
                statistics.mean(final(histories[f"{scheme}-lr{lr}-s{s}"], LOSS) for s in (1, 2, 3)) for lr in TUNED_LRS
            ]
            best[depth, scheme] = TUNED_LRS[means.index(min(means))]
            (row,) = [r for r in sweeps if (r["blocks"], r["scheme"]) == (depth, scheme)]
            assert row["best LR"] == fmt(best[depth, scheme])
            assert row["mean final held-out loss per LR"] == ", ".join(
                f"{fmt(lr)}: {fmt(m)}" for lr, m in zip(TUNED_LRS, means)
            )
            assert row["best at the sweep's edge"] == ("no" if best[depth, scheme] == 0.01 else "yes")
        for metric in (LOSS, *METRICS):
            values = {
                s: [final(histories[f"{s}-lr{best[depth, s]}-s{seed}"], metric) for seed in (1, 2, 3)]
                for s in ("keel", "preln")
            }
            (row,) = [r for r in gaps if (r["blocks"], r["metric"]) == (depth, metric)]
            assert (row["keel LR"], row["preln LR"]) == (fmt(best[depth, "keel"]), fmt(best[depth, "preln"]))
            assert row["keel"] == spread(values["keel"]) and row["preln"] == spread(values["preln"])
            assert row["keel - preln"] == fmt(statistics.mean(values["keel"]) - statistics.mean(values["preln"]))
            assert row["seeds apart"] == (
                "yes"
                if min(values["keel"]) > max(values["preln"]) or max(values["keel"]) < min(values["preln"])
                else "no"
            )
    assert (best[64, "keel"], best[64, "preln"]) == (0.01, 0.02)  # as designed: Pre-LN's best at the edge at 64
    (loss,) = [r for r in trend if r["metric"] == LOSS]
    assert loss["its size with depth"] == "grows"  # ~0.1 at 16 blocks, ~0.3 at 64, both negative


def test_a_depth_joins_the_gap_trend_once_every_cell_has_three_seeds(paper):
    """One seed short in any cell of a depth's sweep (here Pre-LN's worst LR at 64 blocks, not its best) and that
    depth's gap is still tabulated but leaves the trend: with one depth left there is no size to move."""
    runs = {g: paper.grids[g].runs for g in DEPTH_GRID.values()}
    short = [r for r in runs[DEPTH_GRID[64]] if r.name != "preln-lr0.005-s3"]
    assert len(short) == len(runs[DEPTH_GRID[64]]) - 1
    _, gaps, trend = tuned_depth(runs | {DEPTH_GRID[64]: short})
    assert {r["blocks"] for r in gaps} == {16, 64}
    (loss,) = [r for r in trend if r["metric"] == LOSS]
    assert loss["gap by depth"].startswith("16: ") and "64" not in loss["gap by depth"]
    assert loss["its size with depth"] == "-"


def test_the_summary_says_how_many_runs_of_a_depth_grid_still_running_are_in(paper):
    """A depth grid committed part-way (its finished runs' records, session by session, as 256 blocks' are): its
    Summary row counts its finished runs of those listed, and a gap from fewer than 3 paired seeds says its n."""
    whole = table3_rows(paper.grids)
    grid = paper.grids[DEPTH_GRID[16]]
    seed_one = [r for r in grid.runs if r.seed == 1]
    part = table3_rows({**paper.grids, DEPTH_GRID[16]: TrainedGrid(seed_one, grid.listed)})
    (row,) = [r for r in part if r["claim (section)"].startswith("Keel better") and r["blocks x width"] == "16 x 32"]
    assert row["seeds"] == f"1 ({len(seed_one)} of {grid.listed} runs finished)" and len(seed_one) == 6
    assert row["figure"].endswith("Keel above in 0, below in 0 of 4")  # one seed a side has no range to be apart
    assert (row["verdict"], row["paired test"]) == ("n = 1, no verdict", "-")
    (whole16,) = [
        r for r in whole if r["claim (section)"].startswith("Keel better") and r["blocks x width"] == "16 x 32"
    ]
    assert whole16["seeds"] == "3"  # a complete grid: no count
    trend, whole_trend = part[-1]["figure"], whole[-1]["figure"]
    assert "16: " in trend and trend.split("16: ")[1].split(",")[0].endswith(" (n = 1)")
    assert "(n = " not in whole_trend


def test_paper_report_has_the_trained_sections_for_the_grids_present(paper):
    assert cli_main(["paper-report", str(paper.out)]) == 0
    report = (paper.out / "report.md").read_text()
    assert (
        "## Table 2, the LR sweep at 16 blocks x 64 (lr-d16; 23 of 24 runs finished, 2.0 CPU-hours over the 8 timed)"
    ) in report
    for heading in (
        "## Section 9, loss against tasks at 16 blocks x 64 (lr-d16)",
        "## Section 8, layer use at 16 blocks x 64 (lr-d16) (2 checkpoints of unfinished or unknown runs left out)",
        "## Table 3, depth at width 32, each scheme at its own best LR",
    ):
        assert heading in report
    # lr-d64 (Table 3's 64-block point) has its Table 2 too, and no redundancy.csv yet: the report says how to make it
    assert "## Table 2, the LR sweep at 64 blocks x 32 (lr-d64; 18 of 18 runs finished, none timed)" in report
    assert "tuned-depth-d16: 18 of 18 runs finished, none timed; lr-d64: 18 of 18 runs finished, none timed." in report
    assert (
        "Section 8 at 64 blocks x 32: no lr-d64/redundancy/redundancy.csv yet (make paper-redundancy-lr-d64)." in report
    )
    assert "tuned-depth-d256." in report.split("\n")[2]  # the "Not (yet) run" line ends with them
    for plot in ("loss_vs_tasks_lr-d16.png", "layer_use_lr-d16.png"):
        assert f"]({plot})" in report and (paper.out / plot).stat().st_size > 0


def test_the_lr_optimum_against_depth_is_each_seeds_parabola_vertex(paper):
    text = "\n".join(lr_transfer_sections(paper.out))
    assert "## The LR optimum against depth, complete runs" in text
    for depth, grid in DEPTH_GRID.items():
        for scheme in PAIR:
            seeds = {}
            for name, evaluations in paper.histories[grid].items():
                if name.startswith(f"{scheme}-"):
                    lr, seed = name.split("-lr")[1].split("-s")
                    seeds.setdefault(int(seed), []).append((float(lr), evaluations[-1]["val_loss"]))
            cells = ", ".join(f"s{seed}: {optimum(points).cell()}" for seed, points in sorted(seeds.items()))
            steps = next(iter(paper.histories[grid].values()))[-1]["step"] + 1  # a finished run's last evaluation
            label = f"| {scheme}, {depth} x 32, {steps} steps ({grid})"
            row = next(line for line in text.splitlines() if line.startswith(label))
            assert f"| {cells} |" in row


def test_a_truncated_eval_history_is_named(paper, capsys):
    history = paper.out / "tuned-depth-d16" / "keel-lr0.01-s1" / "eval_history.json"
    text = history.read_text()
    history.write_text(text[:30])
    try:
        assert cli_main(["paper-report", str(paper.out)]) == 2
    finally:
        history.write_text(text)
    assert capsys.readouterr().err.startswith(
        f"keel paper-report: config error: {history} cannot be read (truncated?): "
    )


def test_table_3_with_one_scheme_finished_has_no_empty_gap_table(paper, tmp_path):
    """Early in a tuned grid only one scheme may have finished runs: its sweep is shown, and no empty gap table."""
    shutil.copytree(
        paper.out / "tuned-depth-d16", tmp_path / "tuned-depth-d16", ignore=shutil.ignore_patterns("preln-*")
    )
    assert cli_main(["paper-report", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    start = report.index("## Table 3, depth at width 32")
    table_3 = report[start : report.index("\n## ", start)]  # up to the next section ("What made the records")
    assert "| 16 | tuned-depth-d16 | keel |" in table_3 and "| preln |" not in table_3
    assert "|  |" not in table_3
