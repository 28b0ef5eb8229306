"""A non-finite update is dropped by the LightningModule itself (training behaviour, not a monitor's): with the
stability callback off the step leaves weights and optimizer state as they were and training goes on; with it on,
the same, and the callback records the step. A run resumed across such a step ends where the run straight through
does."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from keel.training import train
from keeltest.runs import tiny_config

INF_STEP = 3
SIX_STEPS = [
    "trainer.max_steps=6",
    "trainer.val_every_n_steps=6",
    "trainer.val_batches=1",
    "optim.grad_clip=0",
    "optim.schedule=linear_warmup",  # an LR that does not depend on max_steps
    "callbacks.grad_norms.enabled=false",
    "callbacks.layer_importance.enabled=false",
    "callbacks.throughput.enabled=false",
]


def config(tiny_data, run_dir: Path, *extra: str):
    return tiny_config(tiny_data, run_dir, *SIX_STEPS, *extra)


class InfGradientAt(Callback):
    """After the backward of the given step, one parameter's gradient holds an inf: a finite loss whose update would
    ruin the weights (without clipping, the inf reaches the update)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.step:
            next(pl_module.model.parameters()).grad.view(-1)[0] = math.inf


class StepEffects(Callback):
    """Whether each optimizer step changed the weights, and the optimizer's state (moments and step count)."""

    def __init__(self) -> None:
        self.weights_changed: dict[int, bool] = {}
        self.state_changed: dict[int, bool] = {}

    @staticmethod
    def _snapshot(trainer, pl_module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        optimizer = trainer.optimizers[0]
        state = [t for p in pl_module.model.parameters() for t in optimizer.state.get(p, {}).values()]
        return [p.detach().clone() for p in pl_module.model.parameters()], copy.deepcopy(state)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._before = self._snapshot(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        (weights, state), (weights_before, state_before) = self._snapshot(trainer, pl_module), self._before
        step = trainer.global_step - 1
        self.weights_changed[step] = any(not torch.equal(a, b) for a, b in zip(weights, weights_before))
        self.state_changed[step] = len(state) != len(state_before) or any(
            not torch.equal(a, b) for a, b in zip(state, state_before)
        )


@pytest.mark.parametrize("monitor", [False, True], ids=["stability off", "stability on"])
def test_a_nonfinite_update_is_dropped_with_or_without_the_stability_monitor(tiny_data, tmp_path, monitor):
    run = tmp_path / "run"
    effects = StepEffects()
    trainer = train(
        config(tiny_data, run, f"callbacks.stability.enabled={str(monitor).lower()}"),
        extra_callbacks=[InfGradientAt(INF_STEP), effects],
    )
    assert trainer.global_step == 6  # training went on
    assert not effects.weights_changed[INF_STEP] and not effects.state_changed[INF_STEP]  # the step was dropped
    others = [step for step in range(1, 6) if step != INF_STEP]  # (step 0 creates the optimizer state)
    assert all(effects.weights_changed[step] and effects.state_changed[step] for step in others)
    module, optimizer = trainer.lightning_module, trainer.optimizers[0]
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert all(optimizer.state[p]["step"] == 5 for p in module.parameters())  # 6 steps, one update dropped
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 6  # the schedule advanced at the dropped step too
    monitors = [cb for cb in trainer.callbacks if type(cb).__name__ == "StabilityMonitor"]
    assert len(monitors) == monitor
    if monitor:
        assert monitors[0].counts["nonfinite_steps"] == 1 and monitors[0].failure is None
        report = json.loads((run / "stability.json").read_text())
        assert report["nonfinite_steps"] == 1 and report["failed"] is False


def test_a_resume_across_a_dropped_update_ends_where_the_run_straight_through_does(tiny_data, tmp_path):
    straight = train(
        config(tiny_data, tmp_path / "straight", "callbacks.stability.enabled=false"),
        extra_callbacks=[InfGradientAt(INF_STEP)],
    )
    stopped = tmp_path / "stopped"
    train(
        config(
            tiny_data,
            stopped,
            "callbacks.stability.enabled=false",
            "trainer.max_steps=4",
            "trainer.checkpoint_every_n_steps=4",
        ),
        extra_callbacks=[InfGradientAt(INF_STEP)],
    )
    resumed = train(config(tiny_data, stopped, "callbacks.stability.enabled=false"))
    assert resumed.global_step == straight.global_step == 6
    for a, b in zip(straight.lightning_module.parameters(), resumed.lightning_module.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
