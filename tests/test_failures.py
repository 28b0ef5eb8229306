"""Hostile files and careless hands (docs/failures.md): what is refused, what is recovered, what is reported."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import MetadataIndex

from keel.checkpoint import DCP_METADATA, LAST, AtomicCheckpointIO, read_checkpoint, read_dcp_metadata
from keel.cli import main as cli_main
from keel.config import load_config
from keel.dirlock import LOCK
from keel.errors import ConfigError
from keel.rundir import RunDirLock
from keel import training
from keel.training import Interrupted, launched_as_rank_zero, train

from conftest import QUIET_TRAINER, TINY_MODEL
from test_distributed import _sharded_checkpoint
from test_pretrain import CrashAtStep, scalars, tiny_config

STEPS = ["trainer.max_steps=8", "trainer.checkpoint_every_n_steps=4", "trainer.val_every_n_steps=4",
         "trainer.val_batches=2"]


# ------------------------------------------------------------------- no code from sharded checkpoints


class Payload:
    """Unpickled, it writes a marker file: the stand-in for any code a hostile checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


POISONED_ENTRY = "optimizer_0.param_groups.0.lr"  # a byte entry (a pickle) of every FSDP checkpoint


def poison_metadata(path: Path, payload: Payload) -> str:
    (path / DCP_METADATA).write_bytes(pickle.dumps(payload))
    with pytest.raises(Exception):  # torch's own reader runs it (then fails on what it returned)
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
    dcp_load({"optimizer_0": {"param_groups": [{"lr": 0.0}]}}, checkpoint_id=path, no_dist=True,
             planner=DefaultLoadPlanner(allow_partial_load=True))
    return f"{info.relative_path} refused: its entry {POISONED_ENTRY}"


@dataclass
class Hostile:
    path: Path  # a real sharded checkpoint with a payload inside
    marker: Path  # the file the payload writes
    refusal: str  # what the message says after the checkpoint's path

    def refused(self, err: str, path: Path | None = None) -> None:
        assert any(f"{path or self.path}/{self.refusal}" in line and "builtins.exec" in line
                   for line in err.splitlines()), err  # in one line
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
def test_payload_in_sharded_checkpoint_is_refused_by_read_consolidate_eval_generate_and_export(hostile_checkpoint,
                                                                                                tmp_path, capsys):
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
    from keel.parallel import FSDP2Strategy

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


# ------------------------------------------------------------------------------ one writer per run dir

HOLD_LOCK = """
import sys
from keel.rundir import RunDirLock
lock = RunDirLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
sys.stdin.read()
"""


def hold_lock(run_dir: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_process_on_a_run_dir_is_refused_naming_the_holder(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    holder = hold_lock(run)
    try:
        with pytest.raises(ConfigError) as err:
            train(tiny_config(tiny_data, run, *STEPS))
        message = str(err.value)
        assert f"in use by another keel process: pid {holder.pid} on host {socket.gethostname()}" in message
        assert sorted(p.name for p in run.iterdir()) == [LOCK]  # nothing written: no config.yaml, tb/, checkpoints/
    finally:
        holder.kill()  # kill -9: the kernel releases the lock, the file still names the holder
        holder.wait()
    assert json.loads((run / LOCK).read_text())["pid"] == holder.pid
    train(tiny_config(tiny_data, run, "trainer.max_steps=2"))  # a stale lock is taken over, and said
    assert f"(pid {holder.pid} on {socket.gethostname()}) ended without releasing its lock; taken over" in \
        capsys.readouterr().err
    assert (run / LOCK).read_text() == ""  # released at exit
    with RunDirLock(run):  # and free again
        pass


def test_only_the_launchers_rank_zero_takes_the_lock(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert launched_as_rank_zero()
    for env in ({"LOCAL_RANK": "1"}, {"RANK": "3"}, {"NODE_RANK": "1", "LOCAL_RANK": "0"}, {"SLURM_PROCID": "2"}):
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            assert not launched_as_rank_zero(), env


def test_unwritable_run_dir_is_refused_before_training(tiny_data, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ConfigError, match=rf"run.dir={not_a_dir}/run: cannot write there \(Not a directory\)"):
        train(tiny_config(tiny_data, not_a_dir / "run"))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "readonly"
        locked.mkdir(mode=0o555)
        with pytest.raises(ConfigError, match="cannot write there .Permission denied"):
            train(tiny_config(tiny_data, locked / "run"))


# ---------------------------------------------------- copied run dirs, checkpoint history, temp files


class FirstStep(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


def test_copied_run_dir_continues_from_its_newest_checkpoint_and_keeps_history(tiny_data, tmp_path):
    original, copy = tmp_path / "original", tmp_path / "copy"
    every = ["trainer.checkpoint_every_n_steps=2", "trainer.val_every_n_steps=2", "trainer.val_batches=1"]
    train(tiny_config(tiny_data, original, "trainer.max_steps=4", *every))
    shutil.copytree(original, copy)
    for max_steps in (6, 8):  # restarted twice in the copy: each time from where the last one ended
        first = FirstStep()
        trainer = train(tiny_config(tiny_data, copy, f"trainer.max_steps={max_steps}", *every), [first])
        assert (first.step, trainer.global_step) == (max_steps - 2, max_steps)
        names = sorted(p.name for p in (copy / "checkpoints").iterdir())
        assert names == [LAST, f"step{max_steps - 2:06d}.ckpt", f"step{max_steps:06d}.ckpt"]  # keep_last_k=2, no -v1
        assert read_checkpoint(copy / "checkpoints" / LAST, weights=False)["global_step"] == max_steps
    assert sorted(scalars(copy, "train/loss")) == list(range(8))
    assert read_checkpoint(original / "checkpoints" / LAST, weights=False)["global_step"] == 4  # left alone
    # any step-numbered checkpoint resumes, and the final state of a run is saved whatever the cadence
    back = tmp_path / "back"
    trainer = train(tiny_config(tiny_data, back, "trainer.max_steps=7", f"resume={copy}/checkpoints/step000006.ckpt",
                                "trainer.keep_last_k=1", *every))
    assert trainer.global_step == 7
    assert sorted(p.name for p in (back / "checkpoints").iterdir()) == [LAST, "step000007.ckpt"]


class NaNWeightsAt(Callback):
    """Every weight becomes NaN at the start of the given step, as after an update that diverged."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                for param in pl_module.parameters():
                    param.fill_(float("nan"))


def test_nonfinite_weights_never_replace_or_prune_the_last_finite_checkpoint(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = tiny_config(tiny_data, run, "trainer.max_steps=12", "trainer.checkpoint_every_n_steps=2",
                      "trainer.keep_last_k=1", "trainer.val_every_n_steps=12", "trainer.val_batches=1")
    trainer = train(cfg, [NaNWeightsAt(3)])  # saves at 2 (finite), then 4, 6 ... and the final one (NaN)
    assert training.failure_exit_code(cfg, trainer) == 1  # the stability monitor stopped it: `keel pretrain` exits 1
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [LAST, "nonfinite.ckpt", "step000002.ckpt"]
    for name in (LAST, "step000002.ckpt"):  # the last finite checkpoint, whole
        finite = read_checkpoint(checkpoints / name)
        assert finite["global_step"] == 2 and all(t.isfinite().all() for t in finite["state_dict"].values())
    nonfinite = read_checkpoint(checkpoints / "nonfinite.ckpt")
    assert nonfinite["global_step"] == trainer.global_step > 2
    assert not all(t.isfinite().all() for t in nonfinite["state_dict"].values())
    said = [line for line in capsys.readouterr().err.splitlines() if "the weights are not finite" in line]
    assert said and said[-1] == (
        f"keel pretrain: step {trainer.global_step}: the weights are not finite (NaN or inf): saved as "
        f"{checkpoints / 'nonfinite.ckpt'}, not as a step-numbered checkpoint nor over last.ckpt; "
        f"{checkpoints / LAST} keeps step 2, the last finite checkpoint")


@pytest.mark.parametrize("code, reason, failing", [(errno.ENOSPC, "no space left on the device", "step000008.ckpt"),
                                                   (errno.EROFS, "the file system is read-only", "step000008.ckpt"),
                                                   (errno.ENOSPC, "no space left on the device", LAST)])
def test_a_save_that_storage_refuses_is_one_line_naming_the_last_good_checkpoint(tiny_data, tmp_path, monkeypatch,
                                                                                   capsys, code, reason, failing):
    """The saves of step 8 fail as a full tmpfs makes torch's zip writer fail (its RuntimeError raised while
    handling the OSError) or as a read-only file system does; step 4's checkpoint stays the last good one. When
    only last.ckpt fails (step000008.ckpt was written), the message said it kept step 8 while it held step 4."""
    save = AtomicCheckpointIO.save_checkpoint

    def failing_save(self, checkpoint, path, storage_options=None):
        if checkpoint["global_step"] < 8 or (failing == LAST and Path(path).name != LAST):  # step000008 written
            return save(self, checkpoint, path, storage_options)
        try:
            raise OSError(code, os.strerror(code))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    def no_hard_links(*args):
        raise OSError(errno.EMLINK, os.strerror(errno.EMLINK))

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", failing_save)
    if failing == LAST:  # last.ckpt links to step000008.ckpt, unless linking fails: then it is written in full
        monkeypatch.setattr(os, "link", no_hard_links)
    run = tmp_path / "run"
    argv = ["pretrain", *TINY_MODEL, *QUIET_TRAINER, "eval.enabled=false", *tiny_data, *STEPS, "trainer.compile=false",
            "callbacks.layer_importance.enabled=false", f"run.dir={run}"]
    assert cli_main(argv) == 1
    checkpoints = run / "checkpoints"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"keel pretrain: checkpoint: cannot write {checkpoints / failing}: {reason} ({os.strerror(code)}); "
        f"{checkpoints / LAST} keeps step 4, the last finite checkpoint. Free space (or make it writable) and re-run "
        "the same command to continue from there")
    assert read_checkpoint(checkpoints / LAST, weights=False)["global_step"] == 4
    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", save)  # space again: the run continues and ends
    assert cli_main(argv) == 0 and read_checkpoint(checkpoints / LAST, weights=False)["global_step"] == 8


class DeleteTrainShards(Callback):
    """Removes the train split's chunk files once training has started (after the start-up check)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        for chunk in (self.data_dir / "train").glob("*.bin"):
            chunk.unlink()


def test_shards_deleted_while_training_are_named(tiny_data, tmp_path):
    """litdata waits for a missing chunk and then says it timed out, "not a missing object"; keel names the file."""
    data_dir = Path(next(o for o in tiny_data if o.startswith("data.dir=")).split("=", 1)[1])
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    cfg = tiny_config(tiny_data, tmp_path / "run", f"data.dir={copy}", "trainer.max_steps=4")
    chunk = sorted((copy / "train").glob("*.bin"))[0]
    with pytest.raises(ConfigError, match=rf"^while training: {copy}/train/{chunk.name} is truncated or missing "
                                          r"\(missing\): .* restore them to continue from its checkpoint"):
        train(cfg, [DeleteTrainShards(copy)])


def test_orphan_temporary_files_are_removed_at_start_up(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    (checkpoints / ".last.ckpt.partial").mkdir(parents=True)  # a killed FSDP save's staging directory
    (checkpoints / ".last.ckpt.tmp12345").write_bytes(b"half a checkpoint")  # a killed single-file save
    train(tiny_config(tiny_data, run, "trainer.max_steps=2", "trainer.keep_last_k=0"))
    assert sorted(p.name for p in checkpoints.iterdir()) == [LAST]
    assert "removed 2 temporary file(s) of interrupted checkpoint saves" in capsys.readouterr().err


# -------------------------------------------------------------------- resume with other settings


def test_resume_with_changed_optimizer_settings_is_reported_and_the_old_config_kept(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny_config(tiny_data, run, "trainer.max_steps=2"))
    old_config = (run / "config.yaml").read_text()
    capsys.readouterr()
    train(tiny_config(tiny_data, run, "trainer.max_steps=4", "optim.lr=0.001", "optim.schedule=linear_warmup"))
    err = capsys.readouterr().err
    assert "resuming at step 2 with 3 changed setting(s)" in err
    for change in ("optim.lr: 0.003 -> 0.001", "optim.schedule: 'cosine' -> 'linear_warmup'", "trainer.max_steps: 2 -> 4"):
        assert change in err
    assert (run / "config.2.yaml").read_text() == old_config
    assert "lr: 0.001" in (run / "config.yaml").read_text()
    train(tiny_config(tiny_data, run, "trainer.max_steps=4", "optim.lr=0.001", "optim.schedule=linear_warmup"))
    assert "changed setting" not in capsys.readouterr().err  # same settings: nothing to report


# ----------------------------------------------------------- interrupts and exceptions save the run


class InterruptAt(Callback):
    """Ctrl-C at a step (count times): the signal, as a terminal sends it."""

    def __init__(self, step: int, count: int = 1) -> None:
        self.step, self.count = step, count

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for _ in range(self.count):
                os.kill(os.getpid(), signal.SIGINT)


def test_sigint_saves_a_checkpoint_and_resume_matches_an_uninterrupted_run(tiny_data, tmp_path, monkeypatch,
                                                                          capsys):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    train(tiny_config(tiny_data, straight, *STEPS))
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(Interrupted, match=f"interrupted: saved step 6 to {interrupted / 'checkpoints' / LAST}"):
        train(tiny_config(tiny_data, interrupted, *STEPS), [InterruptAt(5)])  # step 5 finishes first
    assert read_checkpoint(interrupted / "checkpoints" / LAST, weights=False)["global_step"] == 6
    assert signal.getsignal(signal.SIGINT) is handler  # restored
    train(tiny_config(tiny_data, interrupted, *STEPS))  # resume=auto
    assert scalars(interrupted, "train/loss") == scalars(straight, "train/loss")

    configured = training.build_callbacks  # the command line says so and exits 130
    monkeypatch.setattr(training, "build_callbacks", lambda cfg, dataset: [*configured(cfg, dataset), InterruptAt(1)])
    argv = ["pretrain", *TINY_MODEL, *QUIET_TRAINER, "eval.enabled=false", *tiny_data, *STEPS]
    assert cli_main([*argv, f"run.dir={tmp_path / 'cli'}"]) == 130
    assert "keel pretrain: interrupted: saved step 2 to " in capsys.readouterr().err


class CrashMidStep(Callback):
    """Raises in the second micro-batch of a step: the loader is part-way into it."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 5 and batch_idx % 2:
            raise RuntimeError("simulated crash")


def test_an_exception_saves_the_last_completed_step(tiny_data, tmp_path, capsys):
    steps = [*STEPS, "trainer.checkpoint_every_n_steps=100", "trainer.grad_accum=2"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(tiny_config(tiny_data, straight, *steps))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config(tiny_data, run, *steps), [CrashMidStep()])
    assert read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"] == 5
    assert "training raised RuntimeError: saved step 5" in capsys.readouterr().err
    train(tiny_config(tiny_data, run, *steps))  # resume=auto
    assert scalars(run, "train/loss") == scalars(straight, "train/loss")


LAUNCH_SIGNALLED = """
import os, signal, sys
from lightning.pytorch.callbacks import Callback
from keel import cli, training

class Signal(Callback):  # sys.argv[1]: SIGINT twice (Ctrl-C, Ctrl-C) or SIGKILL, as step 6 is about to start
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == 6:
            for _ in range(2):
                os.kill(os.getpid(), getattr(signal, sys.argv[1]))

configured = training.build_callbacks
training.build_callbacks = lambda cfg, dataset: [*configured(cfg, dataset), Signal()]
sys.exit(cli.main(sys.argv[2:]))
"""


def signalled_run(tiny_data, run: Path, signal_name: str) -> subprocess.CompletedProcess:
    argv = ["pretrain", *TINY_MODEL, *QUIET_TRAINER, "eval.enabled=false", *tiny_data, f"run.dir={run}", *STEPS]
    return subprocess.run([sys.executable, "-c", LAUNCH_SIGNALLED, signal_name, *argv], capture_output=True,
                          text=True, timeout=600)


def test_kill_9_resumes_from_the_last_checkpoint_exactly(tiny_data, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    train(tiny_config(tiny_data, straight, *STEPS))
    assert signalled_run(tiny_data, killed, "SIGKILL").returncode == -signal.SIGKILL
    assert read_checkpoint(killed / "checkpoints" / LAST, weights=False)["global_step"] == 4  # nothing saved at 6
    train(tiny_config(tiny_data, killed, *STEPS))  # its lock died with it; resume=auto replays steps 4 and 5
    assert scalars(killed, "train/loss") == scalars(straight, "train/loss")


def test_second_sigint_exits_at_once_without_saving(tiny_data, tmp_path):
    run = tmp_path / "run"
    done = signalled_run(tiny_data, run, "SIGINT")
    assert done.returncode == 130, done.stderr[-3000:]
    assert "second interrupt: exiting now, without a checkpoint" in done.stderr
    assert read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"] == 4  # the periodic one


# --------------------------------------------------------------------------------- diverged runs fail


def test_a_diverged_run_fails_with_step_kind_and_max_lr(tiny_data, tmp_path, capsys):
    argv = ["pretrain", *TINY_MODEL, *QUIET_TRAINER, "eval.enabled=false", *tiny_data, "trainer.max_steps=40",
            "optim.lr=1e6", "optim.warmup_steps=2", "callbacks.layer_importance.enabled=false"]
    assert cli_main([*argv, f"run.dir={tmp_path / 'default'}"]) == 1
    err = capsys.readouterr().err
    # the first update (LR 5e5) already broke the model: no LR was sustained, none is reported as tolerated
    assert "keel pretrain: the run failed at step 1 (nonfinite:" in err
    assert "max tolerable LR none (it failed from the first step)" in err
    report = json.loads((tmp_path / "default" / "stability.json").read_text())
    assert report["failed"] and report["steps"] < 40 and report["max_tolerable_lr"] is None  # stopped, checkpointed
    assert read_checkpoint(tmp_path / "default" / "checkpoints" / LAST, weights=False)["global_step"] < 40

    with pytest.warns(UserWarning) as warned:
        assert cli_main([*argv, f"run.dir={tmp_path / 'on'}", "callbacks.stability.stop_on_failure=false"]) == 0
    goes_on = [w for w in warned if "training goes on (callbacks.stability.stop_on_failure=false)" in str(w.message)]
    assert len(goes_on) == 1 and "max tolerable LR" in str(goes_on[0].message)  # said once
    assert json.loads((tmp_path / "on" / "stability.json").read_text())["steps"] == 40


# ------------------------------------------------------------------------------- clear error messages


def test_malformed_override_is_a_clear_error(capsys):
    assert cli_main(["pretrain", "--print-config", "model.depth=[2"]) == 2
    err = capsys.readouterr().err
    assert "override 'model.depth=[2': cannot parse its value as YAML" in err and "Traceback" not in err


def test_a_directory_that_is_no_checkpoint_is_called_so_with_the_checkpoint_meant(tiny_run, tmp_path, capsys):
    last = tiny_run / "checkpoints" / LAST
    for directory in (tiny_run, tiny_run / "checkpoints"):
        assert cli_main(["generate", f"checkpoint={directory}", "--prompt", "def "]) == 2
        assert capsys.readouterr().err == (f"keel generate: config error: checkpoint: {directory} is not a checkpoint: "
                                           f"it has no .metadata nor meta.pt; did you mean {last}?\n")
    assert cli_main(["consolidate", str(tmp_path), str(tmp_path / "out.ckpt")]) == 2
    assert capsys.readouterr().err == (f"keel consolidate: config error: checkpoint: {tmp_path} is not a checkpoint: "
                                       "it has no .metadata nor meta.pt (a checkpoint is a .ckpt file or an FSDP "
                                       "checkpoint directory holding both)\n")
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
            "has none)\n")
    assert not (tmp_path / "compare.png").exists()
    assert read_checkpoint(short / "checkpoints" / LAST, weights=False)["global_step"] == 2  # the run is untouched


def test_a_config_file_whose_top_level_is_a_list_is_a_clear_error(tmp_path, capsys):
    listed = tmp_path / "list.yaml"
    listed.write_text("- optim.lr: 0.001\n- trainer.max_steps: 10\n")
    refusal = (f"config error: {listed}: its top level is a list; a config file maps keys to settings "
               "(e.g. a line `optim:`, then `  lr: 0.001`)\n")
    for command in (["pretrain", "--print-config", "--config", str(listed)], ["pretrain", f"model={listed}"],
                    ["data", "--config", str(listed), f"data.dir={tmp_path / 'data'}"]):
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


def test_gradflow_refuses_sizes_that_will_not_fit_unless_forced(monkeypatch, capsys):
    assert cli_main(["gradflow", "--depth", "100000"]) == 2
    err = capsys.readouterr().err
    assert "depth 100000, width 64, --seq-len 32, --batch 4 needs about" in err and "--force" in err
    monkeypatch.setattr("keel.memory.available_bytes", lambda: 1)
    assert cli_main(["gradflow", "--depth", "2"]) == 2
    assert "more than the 0.0 GiB available" in capsys.readouterr().err
    assert cli_main(["gradflow", "--depth", "2", "--force"]) == 0
    assert json.loads(capsys.readouterr().out)["schemes"]["keel"]["summary"]


def test_gradflow_counts_each_blocks_fixed_cost_at_tiny_width(monkeypatch, capsys):
    """At width 8 a block's Python objects and autograd graph (~112 KiB) outweigh its 800 parameters: 100,000
    such blocks need ~12 GiB, which an estimate of parameters and activations alone put at ~1.4 GiB; plus the
    process itself, 1 GiB."""
    monkeypatch.setattr("keel.memory.available_bytes", lambda: 8 * 2**30)
    assert cli_main(["gradflow", "--depth", "100000", "--width", "8", "--heads", "2", "--seq-len", "8",
                     "--batch", "1"]) == 2
    assert "needs about 13.0 GiB" in capsys.readouterr().err


def test_a_cpu_run_too_big_for_the_machine_is_refused_before_anything_is_allocated(tiny_data, tmp_path, monkeypatch,
                                                                                      capsys):
    monkeypatch.setattr("keel.memory.available_bytes", lambda: 2**30)  # less than a training process's own 1 GiB
    argv = ["pretrain", *TINY_MODEL, *QUIET_TRAINER, "eval.enabled=false", *tiny_data, "trainer.max_steps=2",
            "trainer.compile=false", f"run.dir={tmp_path / 'run'}"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "model.depth=2, model.width=32, trainer.micro_batch_size=4 x model.seq_len=32 in 1 process(es) needs about" in err
    assert "more than the 1.0 GiB available here" in err and "trainer.check_memory=false" in err
    assert not (tmp_path / "run").exists()  # refused before the run dir was made
    assert cli_main([*argv, "trainer.check_memory=false"]) == 0


def test_cpu_processes_beyond_the_cores_are_said(monkeypatch):
    monkeypatch.setattr(training.os, "sched_getaffinity", lambda pid: {0, 1})
    cfg = load_config(overrides=["trainer.devices=3", "trainer.check_memory=false"])
    with pytest.warns(UserWarning, match=r"trainer.devices=3 starts that many processes on 2 core\(s\)"):
        training.check_cpu_processes(cfg)


def test_compile_on_cpu_without_a_cpp_compiler_is_refused_before_training(tiny_data, tmp_path, capsys):
    """torch.compile on CPU needs a C++ compiler at the first compiled step; without one the run is refused at
    start-up, saying how to go on, instead of failing inside the first step (trainer=cpu compiles by default)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.cxx": ("keel-test-no-such-cxx",)}):  # torch's own way (a monkeypatch hides it)
        # The tiny model: with the default one's long sequences some draws of tiny_data hold fewer validation
        # sequences than the default trainer.val_batches asks for, and that refusal (check_splits_fit) came first.
        assert cli_main(["pretrain", *TINY_MODEL, *tiny_data, "trainer.val_batches=2", "trainer.compile=true",
                         f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "trainer.compile=true" in err and "keel-test-no-such-cxx" in err and "trainer.compile=false" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------- issue 34: nothing good lost, true messages


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_consolidate_refuses_an_existing_output_one_under_a_file_and_its_own_input(tmp_path, capsys):
    """Given another run's resumable step000005.ckpt as output, consolidate replaced it with weights only."""
    sharded, taken, blocker = tmp_path / "last.ckpt", tmp_path / "step000005.ckpt", tmp_path / "notes.txt"
    _sharded_checkpoint(sharded)
    torch.save({"optimizer_states": [], "global_step": 5}, taken)
    blocker.write_text("mine")
    before = taken.read_bytes()
    for output, said in ((taken, f"{taken} already exists; choose a new output path (nothing is overwritten)"),
                         (sharded, f"{sharded} already exists; choose a new output path (nothing is overwritten)"),
                         (blocker / "out.ckpt", f"cannot write {blocker / 'out.ckpt'}: {blocker} is a file, not a "
                                                "directory; choose another output path")):
        assert cli_main(["consolidate", str(sharded), str(output)]) == 2
        assert capsys.readouterr().err == f"keel consolidate: config error: consolidate: {said}\n"
    assert taken.read_bytes() == before and blocker.read_text() == "mine"
    assert read_checkpoint(sharded)["global_step"] == 3  # the input, untouched


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
            assert str(err.value) == (f"checkpoint: {file} refused: it refers to builtins.exec, which a checkpoint "
                                      "never holds; it may have been made to run code when loaded: do not use this "
                                      "checkpoint")
        assert cli_main(["generate", f"checkpoint={path}"]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "weights_only=False" not in err and "refers to builtins.exec" in err
    assert not marker.exists()


OPTIMIZER_VALUES = """
import sys
from keel import cli
codes = [cli.main(["pretrain", override]) for override in sys.argv[1:]]
print(codes, "torch" in sys.modules)
"""


def test_optimizer_values_torch_would_refuse_are_config_errors_naming_the_key_before_torch_loads():
    """optim.beta1=1.5 and optim.eps=-1 ended in torch's ValueError traceback once the model was built (~45 s)."""
    done = subprocess.run([sys.executable, "-c", OPTIMIZER_VALUES, "optim.beta1=1.5", "optim.beta2=-0.1",
                           "optim.eps=-1"], capture_output=True, text=True, timeout=120)
    assert done.stdout == "[2, 2, 2] False\n"  # refused, and torch was never imported
    assert done.stderr.splitlines() == ["keel pretrain: config error: optim.beta1: must be in [0, 1), got 1.5",
                                        "keel pretrain: config error: optim.beta2: must be in [0, 1), got -0.1",
                                        "keel pretrain: config error: optim.eps: must be > 0, got -1.0"]


def test_overrides_after_config_are_overrides(tmp_path, capsys):
    """`keel pretrain --config F run.dir=X`: the override after --config was refused as an unrecognized argument."""
    config = tmp_path / "f.yaml"
    config.write_text("trainer:\n  max_steps: 3\n")
    argv = ["pretrain", "optim.lr=0.01", "--config", str(config), f"run.dir={tmp_path / 'x'}", "--print-config"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert f"dir: {tmp_path / 'x'}\n" in out and "max_steps: 3\n" in out and "lr: 0.01\n" in out
