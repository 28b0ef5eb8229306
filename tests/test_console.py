"""What a user reads: `keel pretrain` and `keel data` run as a user runs them (a subprocess, so every warning,
log record and print of Lightning, torch, litdata, tokenizers and lm-eval reaches the real stdout and stderr) say
Keel's lines - the start-up summary, the step bar, one line per in-loop evaluation, the result - and none of the
noise they used to print (issue 42), which keel.console and the fixes where it was printed keep off."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from keel.checkpoint.layout import LAST
from keel.evaluation.cli import with_defaults
from keeltest import QUIET_TRAINER, TINY_MODEL
from keeltest.distributed import LAUNCHER

# Each the text of one line the commands printed before; any line that contains one fails the test.
NOISE = [
    "GPU available: ",  # Lightning's device banner (the summary's hardware line says what the run uses)
    "TPU available: ",
    "Tip: For seamless cloud logging",  # Lightning's litlogger advertisement
    "`Trainer(limit_val_batches=1)` was configured",
    "`Trainer.fit` stopped",  # the result line says where the run ended
    "Initializing distributed: ",  # one per rank
    "distributed_backend=",
    "isinstance(treespec, LeafSpec)",  # torch's deprecation, from inside Lightning
    "Your `IterableDataset` has `__len__` defined",
    "sync_dist=True",  # Lightning's advice for val/*, already reduced over the ranks
    "inferred the following",  # litdata's data format line, per shard writer and split
    "No CUDA runtime is found",  # torch.compile's probe on a machine with a CUDA toolkit and no GPU
    "evaluations = None",  # a Spearman correlation of too few evaluations
    "Tokenizing inputs",  # lm-eval's progress bars, nested in the step bar
    "Running loglikelihood requests",
    "Restoring states from the checkpoint",  # Lightning's, on resume: the start line names the checkpoint
    "Restored all states from the checkpoint",
]
# Anything printed as a Python warning ("file.py:LINE: ..."): none is left that a Keel user could act on here
WARNING_LINE = re.compile(r"\.py:\d+: ")
BARE_BAR = re.compile(r"^\s*\d+%\|")  # a progress bar without a name: lm-eval's, building each task's requests


def keel(*argv: str, launcher: tuple[str, ...] = ("-m", "keel.cli"), env: dict | None = None):
    """`keel argv...` in a subprocess on the CPU (no GPU to be offered: Lightning says when one is not used)."""
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.run(
        [sys.executable, *launcher, *argv], capture_output=True, text=True, env=environment, timeout=600
    )


def lines(done: subprocess.CompletedProcess) -> list[str]:
    """Every line both streams showed, a progress bar's redraws (carriage returns) each its own."""
    return [line for line in re.split(r"[\r\n]", done.stdout + done.stderr) if line.strip()]


def assert_no_noise(done: subprocess.CompletedProcess) -> None:
    for line in lines(done):
        assert not any(text in line for text in NOISE), line
        assert not WARNING_LINE.search(line), line
        assert not BARE_BAR.match(line), line


def run_overrides(tiny_data, run, *extra: str) -> list[str]:
    """The tiny model for 4 steps, one validation and one in-loop evaluation (of 4 documents per task) at its end,
    the step bar on."""
    return [
        *TINY_MODEL,
        *QUIET_TRAINER,
        *tiny_data,
        "trainer.progress_bar=true",
        "trainer.max_steps=4",
        "trainer.val_every_n_steps=4",
        "trainer.val_batches=1",
        "optim.warmup_steps=1",
        "eval.every_n_steps=4",
        "eval.limit=4",
        f"run.dir={run}",
        *extra,
    ]


def test_pretrain_piped_prints_where_the_run_is_its_steps_one_eval_line_and_the_result(tiny_data, tmp_path):
    """Piped (a log file, a job's output): the summary names the run directory, the checkpoint cadence and the
    TensorBoard command; then one plain line per step group (no bar redraws or cursor moves), what the run is doing
    between steps, steps counted one way and losses at one precision. A resume says what it resumes and nothing of
    Lightning's restoring; a rerun of the finished run says in one line that it is complete."""
    run = tmp_path / "run"
    done = keel("pretrain", *run_overrides(tiny_data, run))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_no_noise(done)
    assert "\r" not in done.stdout + done.stderr and "\x1b[" not in done.stdout + done.stderr  # no bar, no cursor-up
    out = done.stdout.splitlines()
    assert out[0].startswith("model       keel: depth 2 blocks (L = 4 sublayers), width 32")
    assert f"run dir     {run} (config.yaml, checkpoints/, logs; one run per directory)" in out
    assert (
        f"checkpoints every 100 steps and at the end: {run / 'checkpoints' / LAST} (and the newest 2 "
        "step-numbered)" in out
    )
    assert f"tensorboard tensorboard --logdir {run / 'tb'}  (then http://localhost:6006)" in out
    start = out.index("start       fresh initialization (seed 1337)")
    steps = out[start + 1 : -1]
    assert [line.split(",")[0] for line in steps if line.startswith("step ")] == [
        "step 1/4 (25%)",
        "step 2/4 (50%)",
        "step 3/4 (75%)",
        "step 4/4: evaluating keel_next_line",
        "step 4/4 (100%)",
    ]
    assert re.fullmatch(r"step 2/4 \(50%\), ETA 0:00:\d\d, tokens/s [\d,]+, train/loss \d\.\d{4}", steps[1]), steps[1]
    [evaluation] = [line for line in steps if line.startswith("downstream eval: ")]
    assert re.fullmatch(
        r"downstream eval: step 4: keel_next_line acc_mutual_info \S+, keel_last_token "
        r"perplexity \S+ \(\d+\.\d s\)",
        evaluation,
    ), evaluation
    assert steps.index(evaluation) == len(steps) - 2  # after "evaluating", before the last step line
    loss = re.fullmatch(r"step 4/4 \(100%\), tokens/s [\d,]+, train/loss \d\.\d{4}, val/loss (\d\.\d{4})", steps[-1])
    assert loss, steps[-1]
    assert re.fullmatch(
        rf"end         step 4 of 4, val/loss {loss[1]} at step 4; checkpoint "
        rf"{re.escape(str(run / 'checkpoints' / LAST))} \(step 4\)",
        out[-1],
    ), out[-1]
    assert "Spearman" not in done.stdout  # one evaluation: no correlation to print

    resumed = keel("pretrain", *run_overrides(tiny_data, run, "trainer.max_steps=6", "eval.enabled=false"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_no_noise(resumed)
    out = resumed.stdout.splitlines()
    assert f"start       resuming {run / 'checkpoints' / LAST}" in out
    assert [line.split(",")[0] for line in out if line.startswith("step ")] == ["step 5/6 (83%)", "step 6/6 (100%)"]
    assert out[-1].startswith("end         step 6 of 6, val/loss ")

    again = keel("pretrain", *run_overrides(tiny_data, run, "trainer.max_steps=6", "eval.enabled=false"))
    assert again.returncode == 0 and again.stdout == "", again.stdout
    assert again.stderr == (
        f"keel pretrain: run.dir={run} is complete (step 6 of trainer.max_steps=6, val/loss "
        f"{out[-1].split()[6]} at step 6; {run / 'checkpoints' / LAST}): raise "
        "trainer.max_steps to train on, or start another run in a new run.dir\n"
    )


def test_data_prints_its_own_lines_only(tiny_data, tmp_path):
    shards = tmp_path / "shards"
    overrides = [o for o in tiny_data if not o.startswith("data.dir=")] + [
        f"data.dir={shards}",
        "data.prepare_workers=2",
    ]
    done = keel("data", *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""  # no bar either: stderr is not a terminal
    said = done.stdout.splitlines()
    assert all(line.startswith("keel data: ") for line in said), said  # no blank lines (the BPE trainer's)
    assert said[-1].startswith(f"keel data: wrote {shards}: ")


def test_keel_eval_asks_for_the_cpu_where_there_is_no_gpu(monkeypatch):
    # lm-eval's own default, cuda:0, had the keel model say on every CPU run that it fell back to the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert with_defaults(["--tasks", "keel_next_line"])[-2:] == ["--device", "cpu"]
    assert with_defaults(["--tasks", "keel_next_line", "--device", "cuda:1"]).count("--device") == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "--device" not in with_defaults(["--tasks", "keel_next_line"])


@pytest.mark.extended
def test_two_processes_say_each_line_once(tiny_data, tmp_path):
    """DDP on 2 CPU processes, one in-loop evaluation, then Ctrl-C to rank 0 after step 3: the per-rank lines
    (Lightning's, the evaluation's, the interrupted run's last) come once."""
    run = tmp_path / "run"
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    overrides = run_overrides(
        tiny_data,
        run,
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.max_steps=8",
        "trainer.val_every_n_steps=2",
        "eval.every_n_steps=2",
    )
    done = keel("pretrain", *overrides, launcher=(str(launcher),), env={"KEEL_TEST_INTERRUPT_AT": "3"})
    assert done.returncode == 130, done.stderr[-3000:]
    assert_no_noise(done)
    said = lines(done)
    assert sum(line.startswith("start       ") for line in said) == 1
    assert sum(line.startswith("downstream eval: step 2: ") for line in said) == 1
    assert sum(line.startswith("step 2/8 (25%)") for line in said) == 1  # the step lines, rank 0's alone
    [last] = [line for line in said if "re-run the same command" in line]
    assert last.startswith(f"keel pretrain: interrupted: saved step 4 to {run / 'checkpoints' / LAST}")


def test_keel_eval_outside_a_git_checkout_prints_no_git_error(tmp_path):
    """lm-eval records the working directory's git commit with `git describe`, whose 'fatal: not a git
    repository' reached the console outside a checkout."""
    done = subprocess.run(
        [sys.executable, "-c", "import keel.evaluation.cli, lm_eval.evaluator as e; print(e.get_git_commit_hash())"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path.parent)},
    )
    assert done.returncode == 0 and done.stdout == "None\n" and "fatal" not in done.stderr, done.stderr
