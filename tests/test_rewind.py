"""callbacks.stability.rewind: a spike made on purpose by poisoned batches (the steps that train on global batches
20-22 of the data stream run at 300x the LR) is detected, the run goes back to its last checkpoint before the onset,
skips the batches through the spike plus a margin and goes on, ending near the run that never saw the poison; the
rewound run is, bit for bit, a fresh run given the same skip list, and a crash, a preemption or a kill -9 around the
rewind resumes to the same weights."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from keel import training
from keel.callbacks.stability import StabilityMonitor
from keel.checkpoint.layout import LAST
from keel.checkpoint.read import read_checkpoint
from keel.config import load_config
from keel.errors import ConfigError
from keel.training import train
from keeltest import QUIET_TRAINER, TINY_MODEL
from keeltest.runs import NO_EXTRAS, events, scalars, tiny_config

POISONED = (20, 21, 22)  # global batches of the data stream (the clean run trains on batch i at step i)
REWOUND_TO = 15  # the newest checkpoint (every 5 steps) at least rewind_steps_before_onset=5 before the onset
LR_BUMP = 300.0
RUN = [
    "trainer.max_steps=40",
    "trainer.checkpoint_every_n_steps=5",
    "trainer.keep_last_k=3",
    "trainer.val_every_n_steps=40",
    "trainer.val_batches=4",
    "optim.lr=3e-3",
    "optim.warmup_steps=5",
    "callbacks.stability.spike_patience=3",
    "callbacks.stability.rewind_steps_before_onset=5",
    "callbacks.stability.rewind_skip_steps=2",
    "callbacks.grad_norms.enabled=false",
    "callbacks.layer_importance.enabled=false",
    "callbacks.throughput.enabled=false",
]
MARGIN = 0.1  # nats: the rewound run's final held-out loss is this close to the clean run's


def fingerprint(batch: torch.Tensor) -> str:
    return hashlib.sha1(batch.cpu().numpy().tobytes()).hexdigest()


class Poison(Callback):
    """Records the batch each step trains on (the last timeline's, by step), its global batch index in the data
    stream and the LR it was given; a step on a poisoned batch runs at LR_BUMP x its LR, after the stability monitor
    has recorded it. The poison is in the data: on every rank alike, and never again once skipped."""

    def __init__(self, poisoned=()) -> None:
        self.poisoned = set(poisoned)
        self.seen: dict[int, str] = {}
        self.index: dict[int, int] = {}
        self.lrs: dict[int, float] = {}
        self.hit = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        position = trainer.datamodule.position  # it has counted this batch
        self.seen[trainer.global_step] = fingerprint(batch)
        self.index[trainer.global_step] = (position.micro_batches - 1) // position.grad_accum
        self.hit = self.index[trainer.global_step] in self.poisoned

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs[trainer.global_step] = optimizer.param_groups[0]["lr"]
        if self.hit:
            for group in optimizer.param_groups:
                group["lr"] *= LR_BUMP


class SkipFromStart(Callback):
    """A fresh run given a skip list: the global batch ranges a rewind recorded."""

    def __init__(self, ranges) -> None:
        self.ranges = ranges

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.datamodule.skip(self.ranges)


class CrashAfterRewind(Callback):
    """A crash at a step of the timeline after the rewind (the same step before it passes)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, StabilityMonitor))
        if monitor.rewinds and trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(run_dir / "checkpoints" / LAST)["state_dict"]


def assert_same_weights(a: Path, b: Path) -> None:
    first, second = weights(a), weights(b)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


def rewinds(run: Path) -> list[dict]:
    return json.loads((run / "stability.json").read_text())["rewinds"]


def same_records(first: list[dict], second: list[dict]) -> bool:
    """The same rewinds, in runs in other directories (the checkpoint's path aside)."""
    return [{**r, "checkpoint": Path(r["checkpoint"]).name} for r in first] == [
        {**r, "checkpoint": Path(r["checkpoint"]).name} for r in second
    ]


def val_loss(run_dir: Path) -> float:
    losses = scalars(run_dir, "val/loss")  # one validation, at the end
    return losses[max(losses)]


@pytest.fixture(scope="module")
def clean(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("clean") / "run"
    recorder = Poison()
    train(tiny_config(tiny_data, run, *RUN), [recorder])
    return run, recorder


@pytest.fixture(scope="module")
def rewound(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("rewound") / "run"
    recorder = Poison(POISONED)
    cfg = tiny_config(tiny_data, run, *RUN)
    trainer = train(cfg, [recorder])
    assert training.failure_exit_code(cfg, trainer) == 0
    return run, recorder


def test_a_poisoned_spike_is_rewound_skipped_and_ends_near_the_clean_run(tiny_data, clean, rewound, tmp_path, capsys):
    run, recorder = rewound
    report = json.loads((run / "stability.json").read_text())
    assert not report["failed"] and len(report["rewinds"]) == 1
    record = report["rewinds"][0]
    # the spike's onset is at or after the first poisoned step; the newest checkpoint 5 or more steps before it
    assert record["kind"] == "spike" and POISONED[0] <= record["onset"] <= record["detected_step"]
    assert record["rewound_to"] == REWOUND_TO and record["checkpoint"].endswith(f"step{REWOUND_TO:06d}.ckpt")
    # every batch from the checkpoint's step through the detection, plus rewind_skip_steps=2, is skipped: numbered
    # as the loader draws them (the clean run trained on global batch i at step i)
    discarded = record["detected_step"] + 1 - REWOUND_TO
    skipped = discarded + 2
    assert record["discarded_steps"] == discarded and record["skipped_steps"] == skipped
    assert record["skipped_batches"] == [REWOUND_TO, REWOUND_TO + skipped]
    assert record["skipped_tokens"] == skipped * 4 * 32
    # the surviving timeline: the clean run's batches up to the checkpoint, then theirs from the end of the skip on
    clean_seen, seen = clean[1].seen, recorder.seen
    assert [seen[s] for s in range(REWOUND_TO)] == [clean_seen[s] for s in range(REWOUND_TO)]
    assert [seen[s] for s in range(REWOUND_TO, 40 - skipped)] == [
        clean_seen[s + skipped] for s in range(REWOUND_TO, 40 - skipped)
    ]
    assert recorder.index == {s: s if s < REWOUND_TO else s + skipped for s in range(40)}
    # every later checkpoint holds the record (a resume from it knows the skip list)
    states = read_checkpoint(run / "checkpoints" / LAST, weights=False)["callbacks"]
    assert next(state for key, state in states.items() if key.startswith("StabilityMonitor"))["rewinds"] == [record]
    assert abs(val_loss(run) - val_loss(clean[0])) < MARGIN
    # in TensorBoard: the count and the event text
    assert scalars(run, "stability/rewinds")[39] == 1.0
    texts = [e.tensor_proto.string_val[0].decode() for e in events(run).Tensors("stability/events/text_summary")]
    assert any("REWIND (spike" in text for text in texts)

    # without recovery the same poison ends the run: a failure (exit 1), or, trained through, far worse
    plain = tmp_path / "plain"
    cfg = tiny_config(tiny_data, plain, *RUN, "callbacks.stability.rewind=false")
    assert training.failure_exit_code(cfg, train(cfg, [Poison(POISONED)])) == 1
    assert json.loads((plain / "stability.json").read_text())["kind"] == "spike"
    through = tmp_path / "through"
    train(
        tiny_config(
            tiny_data, through, *RUN, "callbacks.stability.rewind=false", "callbacks.stability.stop_on_failure=false"
        ),
        [Poison(POISONED)],
    )
    assert "training goes on (callbacks.stability.stop_on_failure=false)" in capsys.readouterr().err
    assert val_loss(through) > val_loss(clean[0]) + 5 * MARGIN


def test_the_rewound_run_is_a_fresh_run_given_its_skip_list(tiny_data, rewound, tmp_path):
    run, recorder = rewound
    ranges = [record["skipped_batches"] for record in json.loads((run / "stability.json").read_text())["rewinds"]]
    fresh = tmp_path / "fresh"
    fresh_recorder = Poison(recorder.poisoned)
    train(tiny_config(tiny_data, fresh, *RUN), [fresh_recorder, SkipFromStart(ranges)])
    assert fresh_recorder.seen == recorder.seen
    assert_same_weights(fresh, run)


@pytest.mark.parametrize("crash_at", [17, 22], ids=["before the rewound run's first checkpoint", "after it"])
def test_a_crash_after_the_rewind_resumes_bit_for_bit(tiny_data, rewound, tmp_path, crash_at):
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config(tiny_data, run, *RUN), [Poison(POISONED), CrashAfterRewind(crash_at)])
    saved = read_checkpoint(run / "checkpoints" / LAST, weights=False)
    assert saved["global_step"] == crash_at  # the single-process crash save, with the rewind in its state
    cfg = tiny_config(tiny_data, run, *RUN, "resume=auto")
    assert training.failure_exit_code(cfg, train(cfg, [Poison(POISONED)])) == 0
    assert_same_weights(run, rewound[0])
    assert same_records(rewinds(run), rewinds(rewound[0]))


class SignalAt(Callback):
    """SIGTERM (a preemption) to this process at the start of a step of its first fit."""

    def __init__(self, step: int) -> None:
        self.step, self.fits = step, 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.fits += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if (self.fits, trainer.global_step) == (1, self.step):
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_preemption_as_the_run_rewinds_stops_after_the_rewound_runs_first_step(tiny_data, rewound, tmp_path):
    detected = rewinds(rewound[0])[0]["detected_step"]
    run = tmp_path / "run"
    with pytest.raises(training.Interrupted) as stopped:
        train(tiny_config(tiny_data, run, *RUN), [Poison(POISONED), SignalAt(detected)])
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert str(stopped.value).startswith(f"SIGTERM: saved step {REWOUND_TO + 1} to ")
    states = read_checkpoint(run / "checkpoints" / LAST, weights=False)["callbacks"]
    saved = next(state for key, state in states.items() if key.startswith("StabilityMonitor"))["rewinds"]
    assert same_records(saved, rewinds(rewound[0]))
    train(tiny_config(tiny_data, run, *RUN, "resume=auto"), [Poison(POISONED)])
    assert_same_weights(run, rewound[0])


@pytest.mark.parametrize(
    "setting, why",
    [
        ("trainer.checkpoint_every_n_steps=30", "no kept checkpoint is from step"),
        ("callbacks.stability.max_rewinds=0", "0 rewind(s) already (callbacks.stability.max_rewinds=0)"),
    ],
)
def test_a_spike_with_nothing_to_rewind_to_fails_as_before(tiny_data, tmp_path, setting, why):
    run = tmp_path / "run"
    cfg = tiny_config(tiny_data, run, *RUN, setting)
    assert training.failure_exit_code(cfg, train(cfg, [Poison(POISONED)])) == 1
    report = json.loads((run / "stability.json").read_text())
    assert report["failed"] and report["kind"] == "spike" and report["rewinds"] == []
    assert f"not rewound: {why}" in report["message"]


def test_the_lr_is_scaled_for_a_while_after_a_rewind(tiny_data, rewound, tmp_path):
    run = tmp_path / "run"
    recorder = Poison(POISONED)
    train(
        tiny_config(
            tiny_data, run, *RUN, "callbacks.stability.rewind_lr_scale=0.5", "callbacks.stability.rewind_lr_steps=3"
        ),
        [recorder],
    )
    unscaled = rewound[1].lrs
    after = range(REWOUND_TO, REWOUND_TO + 5)
    assert [recorder.lrs[s] for s in after] == pytest.approx(
        [unscaled[s] * (0.5 if s < REWOUND_TO + 3 else 1) for s in after]
    )
    assert recorder.lrs[39] == unscaled[39]  # the schedule follows the optimizer steps taken


@pytest.mark.parametrize(
    "setting, message",
    [
        ("callbacks.stability.rewind_lr_scale=0", "callbacks.stability.rewind_lr_scale: must be in (0, 1]"),
        ("callbacks.stability.max_rewinds=-1", "callbacks.stability.max_rewinds: must be >= 0"),
        ("callbacks.stability.rewind_skip_steps=-5", "callbacks.stability.rewind_skip_steps: must be >= 0"),
    ],
)
def test_bad_rewind_settings_are_refused_naming_the_key(setting, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("]", r"\]")):
        load_config(overrides=[*TINY_MODEL, setting])


# ------------------------------------------------------------------------ real processes (make test-extended)

LAUNCHER = """
import json, os, signal, sys
from lightning.pytorch.callbacks import Callback
from keel import cli, training
from test_rewind import Poison

class Kill(Callback):  # kill -9 after step S of this process's fit F (F=2: the fit after the rewind)
    def __init__(self, fit, step):
        self.fit, self.step, self.fits = fit, step, 0
    def on_train_start(self, trainer, pl_module):
        self.fits += 1
    def on_train_batch_end(self, trainer, *args):
        if (self.fits, trainer.global_step - 1) == (self.fit, self.step):
            os.kill(os.getpid(), signal.SIGKILL)

extra = [Poison(json.loads(os.environ["KEEL_TEST_POISON"]))]
if "KEEL_TEST_KILL" in os.environ:
    extra.append(Kill(*map(int, os.environ["KEEL_TEST_KILL"].split(":"))))
configured = training.build_callbacks
training.build_callbacks = lambda cfg, dataset: [*configured(cfg, dataset), *extra]
sys.exit(cli.main(sys.argv[1:]))
"""


def launch(tiny_data, run: Path, poisoned, *overrides: str, kill: str | None = None) -> subprocess.CompletedProcess:
    """`keel pretrain` of RUN in a subprocess (Lightning starts any other rank by re-running it), poisoned."""
    run.parent.mkdir(parents=True, exist_ok=True)
    script = run.parent / "launch.py"
    script.write_text(LAUNCHER)
    tests = str(Path(__file__).parent)
    env = {
        **os.environ,
        "KEEL_TEST_POISON": json.dumps(list(poisoned)),
        "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
    }
    if kill:
        env["KEEL_TEST_KILL"] = kill
    command = [
        sys.executable,
        str(script),
        "pretrain",
        *TINY_MODEL,
        *QUIET_TRAINER,
        *NO_EXTRAS,
        *tiny_data,
        *RUN,
        f"run.dir={run}",
        *overrides,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.extended
@pytest.mark.parametrize(
    "kill",
    ["1:23", "1:24", "2:15", "2:20"],
    ids=[
        "before the detection",
        "after it, before the rewind",
        "as the rewound run starts",
        "after its first checkpoint",
    ],
)
def test_kill_9_around_a_rewind_resumes_bit_for_bit(tiny_data, rewound, tmp_path, kill):
    run = tmp_path / "run"
    killed = launch(tiny_data, run, POISONED, kill=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    done = launch(tiny_data, run, POISONED)  # the same command: resume=auto
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_weights(run, rewound[0])
    assert same_records(rewinds(run), rewinds(rewound[0]))


@pytest.mark.extended
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_processes_survive_the_spike_near_the_clean_run(tiny_data, tmp_path, strategy):
    """Both ranks rewind together (under FSDP to a sharded checkpoint), skip the same global batches, and the run
    ends within MARGIN of the clean 2-process run; without recovery it fails."""
    launched = [f"trainer={strategy}", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.micro_batch_size=2"]
    runs = {name: tmp_path / name / "run" for name in ("clean", "rewound", "plain")}
    for name, poison, extra in (
        ("clean", (), ()),
        ("rewound", POISONED, ()),
        ("plain", POISONED, ("callbacks.stability.rewind=false",)),
    ):
        done = launch(tiny_data, runs[name], poison, *launched, *extra)
        assert done.returncode == (1 if name == "plain" else 0), done.stderr[-3000:]
    (record,) = rewinds(runs["rewound"])
    assert record["rewound_to"] == REWOUND_TO
    assert (runs["rewound"] / "checkpoints" / LAST).is_dir() == (strategy == "fsdp")
    assert record["skipped_batches"] == [REWOUND_TO, REWOUND_TO + record["skipped_steps"]]
    assert abs(val_loss(runs["rewound"]) - val_loss(runs["clean"])) < MARGIN
