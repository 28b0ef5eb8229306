"""The host waits for the device only at logging steps (trainer.log_every_n_steps): a short CPU run counts, per
optimizer step, every call that would make a GPU run's host wait (a tensor read to the host, a synchronize, a
collective, a tensor made from host data), with a non-finite step among the others, whose update must still be
dropped at that very step; the steps judged late are judged before a checkpoint is saved."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import lightning.pytorch.strategies as strategies
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

from keel.config import load_config
from keel.training import train
from keeltest import QUIET_TRAINER, TINY_MODEL
from keeltest.runs import CrashAtStep, NaNLossAt, events

LOG_EVERY = 4
READS = ("item", "tolist", "__bool__", "__float__", "__int__")  # a tensor's value to the host: waits for the device


class SyncCounter(Callback):
    """Where each host wait happens: ("step", n) from optimizer step n's first batch to the next step's, "val"
    from a validation's start to the next batch (Lightning's ModelCheckpoint reads val/loss after it)."""

    def __init__(self) -> None:
        self.where: object = "start"
        self.calls: Counter = Counter()
        self.in_step = False  # in a training batch's hooks, forward, backward and optimizer step
        self.validation_modes: list[tuple[bool, bool]] = []

    def count(self, what: str) -> None:
        self.calls[(self.where, what)] += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.where, self.in_step = ("step", trainer.global_step), True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.in_step = False

    def on_validation_start(self, trainer, pl_module) -> None:
        self.where = "val"

    def on_validation_end(self, trainer, pl_module) -> None:
        self.validation_modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    def steps(self) -> dict[int, list[str]]:
        waits: dict[int, list[str]] = {}
        for (where, what), n in self.calls.items():
            if isinstance(where, tuple):
                waits.setdefault(where[1], []).extend([what] * n)
        return waits


class HostData(TorchDispatchMode):
    """Counts the tensors made from host data: aten.lift_fresh, the op behind torch.tensor(...), a Python number
    assigned into a tensor, or an index given as a Python list (`out[[0, 2]] = ...`). On a GPU each is a copy from
    the host that the host waits for: the class of wait the tensor reads above cannot see."""

    def __init__(self, counter: SyncCounter, record: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.counter, self.record, self.recorded = counter, record, []  # the ops whose names contain one of record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in self.record):
            self.recorded.append(str(func))
        if func is torch.ops.aten.lift_fresh.default and self.counter.in_step:
            self.counter.count("tensor from host data")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counter(monkeypatch) -> SyncCounter:
    counter = SyncCounter()

    def counting(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            counter.count(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in READS:
        counting(torch.Tensor, name)
    counting(torch.cuda, "synchronize")
    for name in ("reduce", "reduce_boolean_decision", "barrier", "broadcast"):
        counting(strategies.SingleDeviceStrategy, name)
    with HostData(counter):
        yield counter


def test_the_host_waits_only_at_logging_steps(tiny_data, tmp_path, counter):
    run = tmp_path / "run"
    cfg = load_config(
        overrides=[
            *TINY_MODEL,
            *QUIET_TRAINER,
            *tiny_data,
            f"run.dir={run}",
            "eval.enabled=false",
            f"trainer.log_every_n_steps={LOG_EVERY}",
            "trainer.max_steps=12",
            "trainer.grad_accum=2",
            "trainer.val_every_n_steps=6",
            "trainer.val_batches=1",
            "trainer.checkpoint_every_n_steps=12",
            "trainer.progress_bar=true",
            f"callbacks.grad_norms.every_n_steps={LOG_EVERY}",
            "callbacks.grad_norms.heatmap_every_n_steps=0",
            f"callbacks.layer_importance.every_n_steps={LOG_EVERY}",
            "callbacks.throughput.window=4",
        ]
    )
    trainer = train(cfg, extra_callbacks=[NaNLossAt(5), counter])
    waits = counter.steps()
    # the logging steps only: none at the other 9, the NaN step's included; but Lightning's first self.log, which
    # makes its metric state (value, batch size) from Python numbers, once
    assert sorted(waits) == [0, 3, 7, 11], waits
    assert waits[0] == ["tensor from host data"] * 2
    assert all(waits[step] for step in (3, 7, 11))  # (the counting sees the reads where they are)

    # the non-finite step 5 was skipped on the device (AdamW's step count: 11 updates of 12) and judged at step 7
    optimizer = trainer.optimizers[0]
    assert all(optimizer.state[p]["step"] == 11 for p in trainer.lightning_module.parameters())
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
    acc = events(run)
    assert [(e.step, e.value) for e in acc.Scalars("stability/nonfinite_steps")] == [(3, 0), (5, 1), (7, 1), (11, 1)]
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("stability/events/text_summary")]
    assert any(text.startswith("step 5: non-finite step") for text in texts)
    assert json.loads((run / "stability.json").read_text())["nonfinite_steps"] == 1
    # train/tokens and the throughput figures at logging steps; the bar shows train/loss as logged there
    assert [e.step for e in acc.Scalars("train/tokens")] == [3, 7, 11]
    assert [e.step for e in acc.Scalars("perf/step_ms")] == [3, 7, 11]
    assert [e.step for e in acc.Scalars("perf/tokens_per_s_per_device")] == [7, 11]  # once the window has filled
    last_loss = acc.Scalars("train/loss")[-1]
    assert last_loss.step == 11 and trainer.progress_bar_callback._loss == f"{last_loss.value:.4f}"
    # validation (and the in-loop evaluation in its end hook) under no_grad, not inference_mode
    assert counter.validation_modes == [(False, False), (False, False)]


def test_a_failure_between_logging_steps_is_found_at_the_next_one(tiny_data, tmp_path):
    """on_nonfinite=stop with a NaN at step 5, logging every 4: the failure is step 5's (onset and detection), the
    run stops after step 7, where it is judged, and step 5's update was dropped."""
    run = tmp_path / "run"
    cfg = load_config(
        overrides=[
            *TINY_MODEL,
            *QUIET_TRAINER,
            *tiny_data,
            f"run.dir={run}",
            "eval.enabled=false",
            f"trainer.log_every_n_steps={LOG_EVERY}",
            "trainer.max_steps=20",
            "trainer.val_batches=1",
            "callbacks.stability.on_nonfinite=stop",
            "callbacks.grad_norms.enabled=false",
            "callbacks.layer_importance.enabled=false",
        ]
    )
    trainer = train(cfg, extra_callbacks=[NaNLossAt(5)])
    assert trainer.global_step == 8
    report = json.loads((run / "stability.json").read_text())
    assert (report["kind"], report["step"], report["detected_step"]) == ("nonfinite", 5, 5)
    assert report["nonfinite_steps"] == 1
    assert all(trainer.optimizers[0].state[p]["step"] == 7 for p in trainer.lightning_module.parameters())


def test_a_checkpoint_between_logging_steps_holds_every_step_judged(tiny_data, tmp_path):
    """A crash before step 6 (logging every 4) saves a checkpoint with steps 4 and 5 still unjudged: the saved
    monitor has judged them, so the resumed run ends with the state of one that never stopped."""

    def config(run, *extra):
        return load_config(
            overrides=[
                *TINY_MODEL,
                *QUIET_TRAINER,
                *tiny_data,
                f"run.dir={run}",
                "eval.enabled=false",
                "trainer.max_steps=10",
                f"trainer.log_every_n_steps={LOG_EVERY}",
                "trainer.val_every_n_steps=10",
                "trainer.val_batches=1",
                "callbacks.grad_norms.enabled=false",
                "callbacks.layer_importance.enabled=false",
                *extra,
            ]
        )

    def monitor(trainer):
        return next(cb for cb in trainer.callbacks if type(cb).__name__ == "StabilityMonitor")

    straight = monitor(train(config(tmp_path / "straight"))).state_dict()
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(config(tmp_path / "crashed"), extra_callbacks=[CrashAtStep(6)])
    saved = torch.load(tmp_path / "crashed" / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 6
    resumed = monitor(train(config(tmp_path / "crashed", "resume=auto"))).state_dict()
    assert straight["ema"] is not None and resumed == straight


def test_processes_agree_on_a_signal_at_logging_steps_only(capsys):
    """Under several processes the stop signal's agreement (an all-reduce and a host read) runs at logging steps
    only; a signal between two of them stops every rank after the next one."""
    import signal
    from types import SimpleNamespace

    from keel.callbacks.interrupt import GracefulInterrupt

    def run(signal_at: int | None) -> tuple[list[int], GracefulInterrupt]:
        agreements = []
        trainer = SimpleNamespace(world_size=2, log_every_n_steps=LOG_EVERY, global_step=0, should_stop=False)
        trainer.strategy = SimpleNamespace(
            root_device=torch.device("cpu"), reduce=lambda t, reduce_op: agreements.append(trainer.global_step) or t
        )
        interrupt = GracefulInterrupt()
        interrupt._step = 0
        for step in range(1, 3 * LOG_EVERY + 1):  # global_step after each optimizer step
            trainer.global_step = step
            if step == signal_at:
                interrupt._handle(signal.SIGTERM, None)
            interrupt.on_train_batch_end(trainer, None, None, None, step - 1)
            if trainer.should_stop:
                break
        return agreements, interrupt

    agreements, interrupt = run(signal_at=None)
    assert agreements == [LOG_EVERY, 2 * LOG_EVERY, 3 * LOG_EVERY] and interrupt.stopped_at is None
    agreements, interrupt = run(signal_at=LOG_EVERY + 1)
    assert agreements == [LOG_EVERY, 2 * LOG_EVERY]
    assert interrupt.stopped_at == 2 * LOG_EVERY and interrupt.signal == signal.SIGTERM
    assert "SIGTERM: stopping after this step" in capsys.readouterr().err


def _sharded_norms_worker(rank: int, port: int, out: str) -> None:
    """FSDP2 gradients (one parameter without a gradient): the norms counted for host data and collectives."""
    import copy

    from keel.model import KeelLM, next_token_loss
    from keel.parallel import parallelize
    from keel.tensor_norms import grad_norms
    from keeltest.distributed import WORLD, _batches, _join, _tiny_cfg

    mesh, batches, _ = _join(rank, port, WORLD)
    cfg = _tiny_cfg("trainer.precision=32-true")
    torch.manual_seed(0)
    model = KeelLM(cfg.model)
    reference = copy.deepcopy(model)
    parallelize(model, cfg.trainer, mesh)
    next_token_loss(model, batches[0]).backward()
    next_token_loss(reference, _batches()[0]).backward()  # the global batch: the mean of the ranks' gradients
    params, expected = list(model.parameters()), [p.grad.norm() for p in reference.parameters()]
    params[1].grad, expected[1] = None, torch.tensor(0.0)
    counter = SyncCounter()
    counter.in_step = True
    ops = HostData(counter, record=("all_reduce", "all_gather", "reduce_scatter", "broadcast"))
    with ops:
        norms = grad_norms(params)
    torch.save(
        {"norms": norms, "expected": torch.stack(expected), "host data": counter.calls, "collectives": ops.recorded},
        Path(out) / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


@pytest.mark.extended
def test_sharded_gradient_norms_take_no_host_data_and_one_collective(tmp_path):
    """Under FSDP2 (2 gloo processes) the per-parameter norms, a missing gradient among them, are the full
    gradients' norms, from one all-reduce and no tensor made from host data."""
    import torch.multiprocessing as mp
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    mp.spawn(_sharded_norms_worker, args=(find_free_network_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(result["norms"], result["expected"], rtol=1e-5, atol=0)
        assert not result["host data"] and result["collectives"] == ["_c10d_functional.all_reduce.default"]
