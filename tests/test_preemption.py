"""Preemption and time limits (docs/distributed.md): SIGTERM and SIGUSR1 stop a run with a checkpoint on every rank
(saved in the background too, waited for before the requeue) and it resumes exactly, a SLURM job is requeued, a requeued
job takes over its own stale run-dir lock, and one checkpoint event writes the state once (last.ckpt links the
step-numbered checkpoint)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.callbacks import checkpointing
from keel.callbacks.interrupt import requeue_slurm_job
from keel.checkpoint.layout import LAST, previous_path, staging_path
from keel.checkpoint.read import read_checkpoint
from keel.checkpoint.write import AtomicCheckpointIO, link_checkpoint
from keel.config import load_config
from keel.dirlock import LOCK
from keel.errors import ConfigError
from keel.rundir import RunDirLock
from keel.training import train
from keeltest import QUIET_TRAINER, REPO, TINY_MODEL
from keeltest.distributed import RUN
from keeltest.runs import CrashAtStep, scalars, tiny_config

STEPS = [
    "trainer.max_steps=8",
    "trainer.checkpoint_every_n_steps=4",
    "trainer.val_every_n_steps=4",
    "trainer.val_batches=2",
]

# `keel pretrain ARGS` whose steps take at least 0.3 s and leave a mark as they start, so that a test can signal it
# mid-run; KEEL_TEST_SIGNAL=NAME:RANK:STEP makes that rank signal itself as that step starts instead.
LAUNCH = """
import os, signal, sys, time
from pathlib import Path
from lightning.pytorch.callbacks import Callback
from keel import cli, training

class Pace(Callback):
    def on_train_batch_start(self, trainer, *args):
        Path(os.environ["KEEL_TEST_MARKS"], f"step{trainer.global_step}").touch()
        name, rank, step = (os.environ.get("KEEL_TEST_SIGNAL") or "::").split(":")
        if name and (trainer.global_rank, trainer.global_step) == (int(rank), int(step)):
            os.kill(os.getpid(), getattr(signal, name))
        time.sleep(0.3)

configured = training.build_callbacks
training.build_callbacks = lambda cfg, dataset: [*configured(cfg, dataset), Pace()]
sys.exit(cli.main(sys.argv[1:]))
"""

FAKE_SCONTROL = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
"""


def launch(tmp_path: Path, argv: list[str], **env: str) -> subprocess.Popen:
    script, marks = tmp_path / "launch.py", tmp_path / "marks"
    script.write_text(LAUNCH)
    marks.mkdir(exist_ok=True)
    environment = {**os.environ, "KEEL_TEST_MARKS": str(marks), **env}
    return subprocess.Popen(
        [sys.executable, str(script), "pretrain", *argv],
        env=environment,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def fake_scontrol(tmp_path: Path) -> tuple[str, Path]:
    """A PATH whose scontrol records its arguments (one line per call) in the returned file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}", bin_dir / "calls"


# ------------------------------------------------------------------ one process: SIGTERM, SIGUSR1 from outside


@pytest.mark.parametrize("signal_name", ["SIGTERM", pytest.param("SIGUSR1", marks=pytest.mark.extended)])
def test_a_signal_mid_run_saves_the_step_and_the_same_command_resumes_exactly(tiny_data, tmp_path, signal_name):
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(tiny_config(tiny_data, straight, *STEPS))
    argv = [*TINY_MODEL, *QUIET_TRAINER, "eval.enabled=false", *tiny_data, *STEPS, f"run.dir={run}"]
    path, calls = fake_scontrol(tmp_path)
    slurm = {"SLURM_JOB_ID": "4242", "PATH": path} if signal_name == "SIGUSR1" else {}  # a batch job's variables
    process = launch(tmp_path, argv, **slurm)
    deadline = time.monotonic() + 300
    while not (tmp_path / "marks" / "step2").exists():  # steps 0 and 1 done: signal it as a preemption would
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.05)
    process.send_signal(getattr(signal, signal_name))
    _, stderr = process.communicate(timeout=300)
    signum = getattr(signal, signal_name)
    assert process.returncode == 128 + signum, stderr[-3000:]
    step = read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"]
    assert 2 <= step < 8  # after the step in progress, not at the end
    said = f"saved step {step} to {run / 'checkpoints' / LAST}; re-run the same command to continue (resume=auto)"
    assert said in stderr.splitlines()[-1]
    if signal_name == "SIGUSR1":
        assert calls.read_text() == "requeue 4242\n"  # once, after the save
        assert "keel pretrain: requeued SLURM job 4242 (scontrol requeue 4242)" in stderr
    else:
        assert not calls.exists()

    again = launch(tmp_path, argv, **slurm)  # the same command (a requeued job's next start)
    out, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr[-3000:]
    assert f"start       resuming {run / 'checkpoints' / LAST}" in out
    assert scalars(run, "train/loss") == scalars(straight, "train/loss")  # bit for bit, every step
    validated, expected = scalars(run, "val/loss"), scalars(straight, "val/loss")
    assert {step: validated[step] for step in expected} == expected  # plus the stopped run's final validation


def test_requeue_says_what_to_do_without_scontrol_or_when_it_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    requeue_slurm_job()
    assert capsys.readouterr().err == (
        "keel pretrain: SLURM job 77: no scontrol on PATH to requeue it; run "
        "`scontrol requeue 77` where there is one (or submit the same sbatch script "
        "again)\n"
    )
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho 'Requested operation not supported on this job' >&2\nexit 1\n")
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    requeue_slurm_job()
    assert capsys.readouterr().err.startswith(
        "keel pretrain: scontrol requeue 70_7 failed (Requested operation not "
        "supported on this job): submit the job with sbatch --requeue"
    )
    monkeypatch.delenv("SLURM_JOB_ID")
    requeue_slurm_job()  # not a SLURM job: nothing to requeue
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------ two processes: one rank signalled, all of them save


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])  # trainer.async_checkpoint
def test_sigusr1_on_one_fsdp_rank_saves_a_sharded_checkpoint_requeues_once_and_resumes_exactly(
    tiny_data, tmp_path, background
):
    argv = ["trainer=fsdp", *RUN, *tiny_data, f"trainer.async_checkpoint={str(background).lower()}"]
    path, calls = fake_scontrol(tmp_path)
    slurm = {"SLURM_JOB_ID": "4242", "PATH": path}
    straight = launch(tmp_path, [*argv, f"run.dir={tmp_path / 'straight'}"], **slurm)
    assert straight.wait(timeout=900) == 0, straight.communicate()[1][-3000:]

    run = tmp_path / "run"
    stopped = launch(tmp_path, [*argv, f"run.dir={run}"], KEEL_TEST_SIGNAL="SIGUSR1:1:5", **slurm)  # rank 1 alone
    _, stderr = stopped.communicate(timeout=900)
    assert stopped.returncode == 128 + signal.SIGUSR1, stderr[-3000:]
    assert f"saved step 6 to {run / 'checkpoints' / LAST}" in stderr  # step 5 done, on both ranks
    assert calls.read_text() == "requeue 4242\n"  # by rank 0, once
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [LAST, "step000004.ckpt", "step000006.ckpt"]
    for name in (p.name for p in (checkpoints / LAST).iterdir()):  # the step's shards, linked: written once
        assert (checkpoints / LAST / name).stat().st_ino == (checkpoints / "step000006.ckpt" / name).stat().st_ino
    assert read_checkpoint(checkpoints / LAST, weights=False)["global_step"] == 6

    again = launch(tmp_path, [*argv, f"run.dir={run}"], **slurm)
    assert again.wait(timeout=900) == 0, again.communicate()[1][-3000:]
    assert scalars(run, "train/loss") == scalars(tmp_path / "straight", "train/loss")


# ------------------------------------------------------------------------- one write per checkpoint event


def count_writes(monkeypatch) -> tuple[list[str], list[int]]:
    """The paths AtomicCheckpointIO writes, and the steps whose weights are checked for finiteness."""
    writes, checks = [], []
    save, finite = AtomicCheckpointIO.save_checkpoint, checkpointing.weights_finite

    def counted_save(self, checkpoint, path, storage_options=None):
        writes.append(Path(path).name)
        return save(self, checkpoint, path, storage_options)

    def counted_check(trainer):
        checks.append(trainer.global_step)
        return finite(trainer)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", counted_save)
    monkeypatch.setattr(checkpointing, "weights_finite", counted_check)
    return writes, checks


@pytest.mark.parametrize("keep_last_k, hard_links", [(1, True), (0, True), (1, False)])
def test_a_checkpoint_event_writes_the_state_once(tiny_data, tmp_path, monkeypatch, capsys, keep_last_k, hard_links):
    writes, checks = count_writes(monkeypatch)
    if not hard_links:  # a filesystem without them: last.ckpt is written in full, and that is said once

        def no_hard_links(*args):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))

        monkeypatch.setattr(os, "link", no_hard_links)
    run = tmp_path / "run"
    every = [
        "trainer.max_steps=6",
        "trainer.checkpoint_every_n_steps=2",
        "trainer.val_every_n_steps=6",
        "trainer.val_batches=1",
    ]
    train(tiny_config(tiny_data, run, *every, f"trainer.keep_last_k={keep_last_k}"))
    assert checks == [2, 4, 6]  # one finiteness check per event
    checkpoints = run / "checkpoints"
    if not hard_links:
        assert writes == ["step000002.ckpt", LAST, "step000004.ckpt", LAST, "step000006.ckpt", LAST]
        assert capsys.readouterr().err.count("cannot hard-link") == 1
    elif keep_last_k:
        assert writes == ["step000002.ckpt", "step000004.ckpt", "step000006.ckpt"]
        assert (checkpoints / LAST).stat().st_ino == (checkpoints / "step000006.ckpt").stat().st_ino
    else:
        assert writes == [LAST, LAST, LAST]
    assert sorted(p.name for p in checkpoints.iterdir()) == [LAST, *(["step000006.ckpt"] if keep_last_k else [])]
    assert read_checkpoint(checkpoints / LAST, weights=False)["global_step"] == 6


def test_last_ckpt_outlives_the_step_checkpoint_it_links_and_resumes_exactly(tiny_data, tmp_path):
    steps = [*STEPS, "trainer.checkpoint_every_n_steps=2", "trainer.keep_last_k=1"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(tiny_config(tiny_data, straight, *steps))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config(tiny_data, run, *steps), [CrashAtStep(7)])
    checkpoints = run / "checkpoints"
    # 2, 4, 6 pruned; 7, the last completed step, saved as the exception ended the run
    assert sorted(p.name for p in checkpoints.iterdir()) == [LAST, "step000007.ckpt"]
    (checkpoints / "step000007.ckpt").unlink()  # as a later prune would
    assert read_checkpoint(checkpoints / LAST, weights=False)["global_step"] == 7
    train(tiny_config(tiny_data, run, *steps))  # resume=auto
    assert scalars(run, "train/loss") == scalars(straight, "train/loss")


def test_linking_a_sharded_checkpoint_replaces_last_whole_and_survives_its_source(tmp_path):
    last = tmp_path / LAST
    for step in (2, 4):
        source = tmp_path / f"step{step:06d}.ckpt"
        source.mkdir()
        for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"):
            (source / name).write_text(f"{name} of step {step}")
        link_checkpoint(source, last)
        assert (last / "meta.pt").read_text() == f"meta.pt of step {step}"
        assert (last / "meta.pt").stat().st_ino == (source / "meta.pt").stat().st_ino  # linked, not copied
    for name in ("step000002.ckpt", "step000004.ckpt"):  # pruned
        for file in (tmp_path / name).iterdir():
            file.unlink()
        (tmp_path / name).rmdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LAST]  # no staging or previous copy left
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert (last / "__1_0.distcp").read_text() == "__1_0.distcp of step 4"
    assert not staging_path(last).exists() and not previous_path(last).exists()


# ----------------------------------------------------------------------- the run-dir lock of a requeued job


def holder_file(run_dir: Path, **holder) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK).write_text(json.dumps({"since": "2026-12-01 10:00:00 UTC", **holder}))


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def flock_fails(monkeypatch, err: OSError) -> None:
    def flock(fd, operation):
        raise err

    monkeypatch.setattr(fcntl, "flock", flock)


@pytest.mark.parametrize("flock_error", [BlockingIOError(errno.EAGAIN, "held"), OSError(errno.ENOLCK, "no locks")])
def test_a_requeued_job_takes_over_its_previous_runs_lock(tmp_path, monkeypatch, capsys, flock_error):
    """flock still held (a dead node's lease on a shared filesystem) or not supported there: a holder on another host
    that is this SLURM job takes over; another job's is refused; a dead process on this host is taken over."""
    flock_fails(monkeypatch, flock_error)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    run = tmp_path / "run"
    holder_file(run, pid=123, host="gpu07", slurm_job="4242")
    with RunDirLock(run):
        assert json.loads((run / LOCK).read_text())["slurm_job"] == "4242"
        assert json.loads((run / LOCK).read_text())["host"] == socket.gethostname()
    err = capsys.readouterr().err
    assert (
        f"keel pretrain: run.dir={run}: a previous process (pid 123 on gpu07) "
        f"{'' if flock_error.errno == errno.ENOLCK else 'still holds its lock, but '}it is SLURM job 4242's "
        "previous run (requeued here); taken over"
    ) in err
    assert ("does not support flock" in err) == (flock_error.errno == errno.ENOLCK)
    assert (run / LOCK).read_text() == ""  # released

    holder_file(run, pid=123, host="gpu07", slurm_job="4100")  # another job, running elsewhere
    with pytest.raises(ConfigError, match="in use by another keel process: pid 123 on host gpu07"):
        RunDirLock(run).acquire()
    holder_file(run, pid=dead_pid(), host=socket.gethostname())
    with RunDirLock(run):
        pass
    assert "its process is no longer running; taken over" in capsys.readouterr().err
    holder_file(run, pid=os.getppid(), host=socket.gethostname())  # alive, here
    with pytest.raises(ConfigError, match=f"in use by another keel process: pid {os.getppid()}") as refused:
        RunDirLock(run).acquire()
    assert (f"delete {run / LOCK}" in str(refused.value)) == (flock_error.errno == errno.ENOLCK)


# ------------------------------------------------------------------------------------------ the sbatch example

SBATCH = REPO / "docs" / "slurm" / "pretrain.sbatch"


def test_the_sbatch_example_warns_requeues_and_resumes_the_paper_recipe():
    """The shipped script's exact command on its 2 x 8 GPUs trains recipe=paper as the recipe states it: its budget,
    schedule and 256 sequences of 2,048 tokens per step (2 micro-batches of 8 on each of 16 processes)."""
    script = SBATCH.read_text()
    options = [line.split(maxsplit=1)[1] for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "--signal=B:USR1@300" in options and "--requeue" in options
    command = script[script.index("\nsrun ") + 1 :].split("&\n")[0].replace("\\\n", " ").split()
    overrides = command[command.index("pretrain") + 1 :]
    assert "resume=auto" in overrides
    cfg = load_config(overrides=[*overrides, "trainer.accelerator=gpu"])
    assert (cfg.trainer.strategy, cfg.trainer.devices, cfg.trainer.num_nodes) == ("fsdp", 8, 2)
    assert (cfg.model, cfg.data.dir) == (load_config(overrides=["model=paper_d64"]).model, "data/fineweb_edu")
    recipe = load_config(overrides=["recipe=paper"])
    assert (cfg.trainer.max_steps, cfg.optim) == (recipe.trainer.max_steps, recipe.optim)
    assert (cfg.trainer.global_batch, cfg.trainer.grad_accum, cfg.model.seq_len) == (256, 2, 2048)
    per_node = {option.split("=")[0]: option.split("=")[1] for option in options if "=" in option}
    assert per_node["--ntasks-per-node"] == per_node["--gpus-per-node"] == "8" and per_node["--nodes"] == "2"


FAKE_SRUN = """#!/bin/sh
# srun as far as the script sees it: passes a signal on to its task, whose exit status (128 + signal) it returns
trap 'echo USR1 >> "$(dirname "$0")/srun.log"; exit 138' USR1
trap 'echo TERM >> "$(dirname "$0")/srun.log"; exit 143' TERM
echo started >> "$(dirname "$0")/srun.log"
while :; do sleep 0.1; done
"""


@pytest.mark.parametrize("signum, status", [(signal.SIGUSR1, 138), (signal.SIGTERM, 143)])
def test_the_sbatch_script_passes_the_signal_to_srun_and_exits_with_its_status(tmp_path, signum, status):
    """USR1 (--signal=B:USR1@300) and a preemption's TERM reach the batch shell: each is passed to srun, and the
    shell waits for srun's end (its save) rather than ending first."""
    (tmp_path / "srun").write_text(FAKE_SRUN)
    (tmp_path / "srun").chmod(0o755)
    shell = subprocess.Popen(["bash", str(SBATCH)], env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    log = tmp_path / "srun.log"
    deadline = time.monotonic() + 60
    while not log.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)  # the traps are set right after srun starts
    shell.send_signal(signum)
    assert shell.wait(timeout=60) == status
    assert log.read_text() == f"started\n{signal.Signals(signum).name.removeprefix('SIG')}\n"
