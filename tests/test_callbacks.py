"""The training callbacks: gradient norms against a manual computation (computed once per step, and clipping
with them as torch clips), forced NaNs and a learning-rate blow-up caught and handled as configured, every
TensorBoard tag written, layer importance of an identity block, their options checked at load time and their run
order."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import keel.tensor_norms
from keel.callbacks.grad_norms import GradNormMonitor
from keel.config import ModelConfig, load_config
from keel.errors import ConfigError
from keel.layer_skip import skip_losses
from keel.lit import KeelLitModule, make_optimizer
from keel.model import KeelLM, next_token_loss
from keel.schedule import lr_factor
from keel.training import build_callbacks, train
from keeltest import TINY_MODEL
from keeltest.runs import NO_EXTRAS, NaNLossAt, events, tiny_config

# Every callback at a cadence the short runs below reach.
BUSY_CALLBACKS = [
    "callbacks.grad_norms.every_n_steps=2",
    "callbacks.grad_norms.heatmap_every_n_steps=6",
    "callbacks.grad_norms.activation_every_n_steps=3",
    "callbacks.layer_importance.every_n_steps=6",
    "callbacks.throughput.window=3",
]


def test_grad_norms_match_manual_computation():
    torch.manual_seed(0)
    cfg = ModelConfig(depth=3, width=32, n_heads=2, seq_len=16, vocab_size=64)
    model = KeelLM(cfg)
    tokens = torch.randint(cfg.vocab_size, (2, cfg.seq_len + 1))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    monitor = GradNormMonitor()
    monitor.on_fit_start(None, SimpleNamespace(model=model))
    norms = monitor.norms()

    def manual(params) -> float:
        return math.sqrt(sum(p.grad.double().square().sum().item() for p in params))

    for b, block in enumerate(model.blocks):
        for kind in ("attn", "ffn"):
            sub = getattr(block, kind)
            assert norms[f"grad/{kind}/block_{b:03d}"] == pytest.approx(manual(sub.branch.parameters()), rel=1e-5)
            gains = [m.weight for m in (sub.norm_in, sub.norm_out) if m is not None]
            assert norms[f"grad/gain/{kind}/block_{b:03d}"] == pytest.approx(manual(gains), rel=1e-5)
    assert norms["grad/embed"] == pytest.approx(manual([model.embed.weight]), rel=1e-5)
    assert norms["grad/head"] == pytest.approx(manual([model.head.weight]), rel=1e-5)
    assert norms["grad/global"] == pytest.approx(manual(model.parameters()), rel=1e-5)
    # the norm clipping sees
    clipped_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert norms["grad/global"] == pytest.approx(clipped_norm.item(), rel=1e-5)
    # Keel's alpha = 1 block 0 takes far larger weight gradients than the highway blocks (docs/schemes.md)
    assert norms["grad/attn/block_000"] > 5 * norms["grad/attn/block_002"]


def test_nonfinite_step_is_skipped_and_every_tag_is_logged(tiny_data, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(
        tiny_data, run, "trainer.max_steps=12", "trainer.val_every_n_steps=6", "trainer.val_batches=1", *BUSY_CALLBACKS
    )
    trainer = train(cfg, extra_callbacks=[NaNLossAt(4)])
    assert trainer.global_step == 12  # skip: the run goes on
    optimizer = trainer.optimizers[0]
    assert all(optimizer.state[p]["step"] == 11 for p in trainer.lightning_module.parameters())  # one update dropped
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())

    acc = events(run)
    scalars = set(acc.Tags()["scalars"])
    depth = cfg.model.depth
    expected = {
        "train/loss",
        "train/tokens",
        "val/loss",
        "val/ppl",
        "lr/matrices",
        "lr/gains",
        "grad/global",
        "grad/embed",
        "grad/head",
        "grad/ratio/bottom_top",
        "grad/ratio/middle_top",
        "grad/ratio/block0_top",
        "grad/act/ratio/bottom_top",
        "grad/act/ratio/middle_top",
        "stability/nonfinite_steps",
        "stability/spikes",
        "stability/stagnations",
        "stability/failed",
        "stability/loss_excess",
        "perf/tokens_per_s",
        "perf/tokens_per_s_per_device",
        "perf/flops_per_token",
        "perf/flops_per_s",
        "perf/data_wait_frac",
        "perf/step_ms",
        "importance/base_loss",
        "time/grad_norms_ms",
        "time/grad_act_ms",
        "time/stability_ms",
        "time/throughput_ms",
        "time/layer_importance_ms",
    }
    for b in range(depth):
        expected |= {f"importance/block_{b:03d}"}
        for kind in ("attn", "ffn"):
            expected |= {f"grad/{prefix}{kind}/block_{b:03d}" for prefix in ("", "gain/", "act/")}
    assert expected <= scalars, expected - scalars
    assert set(acc.Tags()["images"]) == {"grad/heatmap/branch_weights", "importance/heatmap"}
    assert [e.value for e in acc.Scalars("stability/nonfinite_steps")][-1] == 1
    event_text = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("stability/events/text_summary")]
    assert any("step 4: non-finite" in text for text in event_text)
    assert json.loads((run / "stability.json").read_text())["failed"] is False


def test_nonfinite_step_stops_the_run_when_configured(tiny_data, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(
        tiny_data, run, "trainer.max_steps=20", "callbacks.stability.on_nonfinite=stop", "optim.warmup_steps=10"
    )
    trainer = train(cfg, extra_callbacks=[NaNLossAt(3)])
    assert trainer.global_step == 4  # stopped after the failing step, whose update was dropped
    report = json.loads((run / "stability.json").read_text())
    assert report["failed"] and report["kind"] == "nonfinite" and report["step"] == 3
    assert report["max_tolerable_lr"] == pytest.approx(
        cfg.optim.lr * lr_factor(1, cfg.optim, 20)
    )  # update 2 made step 3 fail
    assert (run / "checkpoints" / "last.ckpt").exists()


def test_learning_rate_blow_up_is_detected_and_stops(tiny_data, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(
        tiny_data,
        run,
        "trainer.max_steps=80",
        "optim.lr=50",
        "optim.warmup_steps=20",
        "optim.schedule=exp_warmup",
        "optim.min_lr_ratio=1e-4",  # 5e-3 -> 50: sustained at first
        "callbacks.stability.stop_on_failure=true",
        "callbacks.stability.spike_patience=5",
        "callbacks.grad_norms.enabled=false",
        "callbacks.layer_importance.enabled=false",
    )
    trainer = train(cfg)
    monitor = next(cb for cb in trainer.callbacks if type(cb).__name__ == "StabilityMonitor")
    failure = monitor.failure
    assert failure is not None and trainer.global_step == failure.detected_step + 1 < 80
    assert failure.kind in ("nonfinite", "spike") and failure.step > 2
    expected = cfg.optim.lr * lr_factor(failure.step - 2, cfg.optim, 80)  # the update before the one that failed
    assert monitor.max_tolerable_lr == pytest.approx(expected) and monitor.max_tolerable_lr < cfg.optim.lr
    assert json.loads((run / "stability.json").read_text())["max_tolerable_lr"] == pytest.approx(expected)


def test_held_out_signal_judges_validation_and_reports_the_onset(tiny_data, tmp_path):
    """signal=val: stagnation judged on the held-out loss of each validation (steps 2, 5, 8 with validation every
    3 steps). An improvement threshold no loss can meet makes the first evaluation the last improvement: the
    failure is found at step 8, its onset is step 3, and the max tolerable LR is that of step 2 (the last good
    evaluation), the detection's LR that of step 8. A resumed run stays stopped."""
    run = tmp_path / "run"
    stability = [
        "trainer.val_every_n_steps=3",
        "trainer.val_batches=2",
        "optim.schedule=exp_warmup",
        "optim.min_lr_ratio=0.01",
        "optim.warmup_steps=20",
        "callbacks.stability.signal=val",
        "callbacks.stability.stagnation_window=6",
        "callbacks.stability.stagnation_min_delta=100",
        "callbacks.stability.stop_on_failure=true",
        "callbacks.grad_norms.enabled=false",
        "callbacks.layer_importance.enabled=false",
    ]
    cfg = tiny_config(tiny_data, run, "trainer.max_steps=20", *stability)
    trainer = train(cfg)
    assert trainer.global_step == 9
    report = json.loads((run / "stability.json").read_text())
    lr = [cfg.optim.lr * lr_factor(step, cfg.optim, 20) for step in range(20)]
    assert (report["kind"], report["step"], report["detected_step"]) == ("stagnation", 3, 8)
    assert report["max_tolerable_lr"] == pytest.approx(lr[2]) and report["detected_lr"] == pytest.approx(lr[8])
    assert report["signal"] == "val" and [p[0] for p in report["heldout"]] == [2, 5, 8]
    assert [p[1] for p in report["heldout"]] == pytest.approx([lr[2], lr[5], lr[8]])
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("val/loss")] == pytest.approx([p[2] for p in report["heldout"]])
    again = train(tiny_config(tiny_data, run, "trainer.max_steps=20", "resume=auto", *stability))
    assert again.global_step == 9  # resumed after the failure: stopped at once
    assert json.loads((run / "stability.json").read_text())["heldout"] == report["heldout"]
    plateau = train(
        tiny_config(
            tiny_data,
            tmp_path / "plateau",
            "trainer.max_steps=12",
            *stability,
            "callbacks.stability.stagnation_below=0.5",
        )
    )  # a level the model never reaches
    assert plateau.global_step == 12  # not judged on its plateau: no stagnation, the run goes on
    assert not json.loads((tmp_path / "plateau" / "stability.json").read_text())["failed"]


def test_a_run_not_learned_by_learn_by_step_fails_and_stays_stopped(tiny_data, tmp_path):
    """learn_by_step=5 with validation every 3 steps: a ceiling no tiny model gets 0.5 below (1.0) stops the run at
    the first evaluation from step 5 on, with no max tolerable LR; one it is below from the start (100) never does."""
    learn = [
        "trainer.val_every_n_steps=3",
        "trainer.val_batches=2",
        "callbacks.stability.signal=val",
        "callbacks.stability.learn_by_step=5",
        "callbacks.stability.stop_on_failure=true",
        "callbacks.grad_norms.enabled=false",
        "callbacks.layer_importance.enabled=false",
    ]
    run = tmp_path / "run"
    trainer = train(
        tiny_config(tiny_data, run, "trainer.max_steps=20", *learn, "callbacks.stability.spike_ceiling=1.0")
    )
    assert trainer.global_step == 6
    report = json.loads((run / "stability.json").read_text())
    assert (report["kind"], report["step"], report["max_tolerable_lr"]) == ("unlearned", 5, None)
    assert report["message"].startswith("val loss at best ") and "not yet 0.5 below 1.000" in report["message"]
    again = train(
        tiny_config(
            tiny_data, run, "trainer.max_steps=20", "resume=auto", *learn, "callbacks.stability.spike_ceiling=1.0"
        )
    )
    assert again.global_step == 6  # resumed after it: stopped at once
    learned = train(
        tiny_config(
            tiny_data, tmp_path / "learned", "trainer.max_steps=9", *learn, "callbacks.stability.spike_ceiling=100"
        )
    )
    assert learned.global_step == 9
    assert not json.loads((tmp_path / "learned" / "stability.json").read_text())["failed"]


def test_exponential_warmup_is_geometric_then_constant():
    optim = load_config(
        overrides=["optim.schedule=exp_warmup", "optim.min_lr_ratio=0.001", "optim.warmup_steps=31"]
    ).optim
    factors = [lr_factor(step, optim, 100) for step in range(40)]
    assert factors[0] == pytest.approx(0.001) and factors[30] == pytest.approx(1.0)
    ratios = [b / a for a, b in zip(factors[:30], factors[1:31])]
    assert ratios == pytest.approx([1000 ** (1 / 30)] * 30)  # the same factor every step: steps per decade fixed
    assert factors[31:] == [1.0] * 9


def test_layer_importance_is_zero_for_an_identity_block():
    torch.manual_seed(0)
    cfg = ModelConfig(depth=4, width=32, n_heads=2, seq_len=16, vocab_size=64, init="unit")
    model = KeelLM(cfg).eval()
    with torch.no_grad():  # block 2 adds nothing: Norm_out(alpha * x) = x for its unit-rms, unit-gain input
        model.blocks[2].attn.branch.out.weight.zero_()
        model.blocks[2].ffn.branch.down.weight.zero_()
    batch = torch.randint(cfg.vocab_size, (4, cfg.seq_len + 1))
    base, *skipped = skip_losses(model, batch, [0, 1, 2, 3]).tolist()
    increases = [loss - base for loss in skipped]
    assert abs(increases[2]) < 1e-5
    assert all(abs(increases[b]) > 1e-3 for b in (0, 1, 3))
    assert all(block.__class__.__name__ == "Block" for block in model.blocks)  # restored


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.compile=true", "callbacks.grad_norms.activation_every_n_steps=5"],
            "callbacks.grad_norms.activation_every_n_steps: the activation-gradient profile (keel.gradflow) needs",
        ),
        (
            ["trainer=fsdp", "callbacks.grad_norms.activation_every_n_steps=5"],
            "callbacks.grad_norms.activation_every_n_steps: the activation-gradient profile (keel.gradflow) needs",
        ),
        (
            ["trainer.val_every_n_steps=30", "eval.every_n_steps=40"],
            "eval.every_n_steps: must be a multiple of trainer.val_every_n_steps=30, got 40",
        ),
        (["callbacks.stability.on_nonfinite=ignore"], "callbacks.stability.on_nonfinite: allowed: skip, stop"),
        (["callbacks.throughput.window=1"], "callbacks.throughput.window: must be >= 2"),
        (
            ["callbacks.stability.learn_by_step=100"],
            "callbacks.stability.learn_by_step: needs callbacks.stability.spike_ceiling (the loss of a model that has",
        ),
    ],
)
def test_callback_options_are_checked_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=overrides)


def test_a_disabled_callback_is_not_checked_against_the_rest():
    cfg = load_config(
        overrides=[
            "trainer.compile=true",
            "callbacks.grad_norms.activation_every_n_steps=5",
            "callbacks.grad_norms.enabled=false",
            "trainer.val_every_n_steps=30",
            "eval.every_n_steps=40",
            "eval.enabled=false",
        ]
    )
    assert cfg.callbacks.grad_norms.activation_every_n_steps == 5


def test_callbacks_run_fixed_first_then_by_priority(tmp_path):
    cfg = load_config(overrides=[*NO_EXTRAS, f"run.dir={tmp_path}"])
    assert [type(cb).__name__ for cb in build_callbacks(cfg, None)] == [
        "RunCheckpoint",
        "GracefulInterrupt",
        "LearningRateMonitor",
        "StepProgressBar",
        "GradNormMonitor",
        "StabilityMonitor",
        "LayerImportance",
        "ThroughputMonitor",  # throughput last
    ]
    cfg = load_config(
        overrides=[
            *NO_EXTRAS,
            f"run.dir={tmp_path}",
            "trainer.progress_bar=false",
            "callbacks.stability.enabled=false",
            "callbacks.layer_importance.enabled=false",
        ]
    )
    assert [type(cb).__name__ for cb in build_callbacks(cfg, None)][3:] == ["GradNormMonitor", "ThroughputMonitor"]


def test_gradient_norms_are_computed_once_per_step(tiny_data, tmp_path, monkeypatch):
    """Grad-norm logging (every step here), the stability check and clipping share one computation per step."""
    calls = []
    full_norms = keel.tensor_norms.full_norms
    monkeypatch.setattr(
        keel.tensor_norms, "full_norms", lambda tensors: calls.append(len(tensors)) or full_norms(tensors)
    )
    cfg = tiny_config(
        tiny_data,
        tmp_path / "run",
        "trainer.max_steps=4",
        "trainer.grad_accum=2",
        "callbacks.grad_norms.every_n_steps=1",
        "optim.grad_clip=0.5",
    )
    train(cfg)
    assert len(calls) == 4 and set(calls) == {len(list(KeelLM(cfg.model).parameters()))}
    grad_global = [event.value for event in events(tmp_path / "run").Scalars("grad/global")]
    assert len(grad_global) == 4 and all(math.isfinite(v) and v > 0 for v in grad_global)


def test_clipping_folded_into_fused_adamw_matches_the_separate_pass():
    """configure_gradient_clipping hands the clip to the fused AdamW step (its grad_scale) instead of scaling every
    gradient first (clip_grads_with_norm_ by the shared norm, as keel did before): over several steps the weights,
    the AdamW moments and the clipped gradients the step leaves equal the separate pass's - bit for bit while the
    norm is below the threshold (a division by 1), within fp32 rounding once the clip acts."""
    cfg = load_config(overrides=TINY_MODEL)
    modules, optimizers = [], []
    for _ in range(2):
        torch.manual_seed(0)
        modules.append(KeelLitModule(cfg))
        optimizers.append(make_optimizer(modules[-1].model, cfg.optim))
    folded, separate = modules
    generator = torch.Generator().manual_seed(0)
    for step, clip in enumerate([1e3, 1e3, 0.05, 0.05, 0.05, 0.05]):  # the clip acts from the third step on
        batch = torch.randint(cfg.model.vocab_size, (2, cfg.model.seq_len + 1), generator=generator)
        for module, optimizer in zip(modules, optimizers):
            optimizer.zero_grad()
            next_token_loss(module.model, batch).backward()
            module.measure_grad_norms()  # as its optimizer_step does after backward
        assert (folded.global_grad_norm > clip) == (step >= 2)
        norms = folded.grad_norms.clone()
        folded.configure_gradient_clipping(optimizers[0], gradient_clip_val=clip)
        torch.nn.utils.clip_grads_with_norm_(list(separate.model.parameters()), clip, separate.global_grad_norm)
        for optimizer in optimizers:
            optimizer.step()
        assert torch.equal(folded.grad_norms, norms)  # what the monitors read stays the unclipped norms
        exact = step < 2
        for (name, p), q in zip(folded.model.named_parameters(), separate.model.parameters()):
            state, expected = optimizers[0].state[p], optimizers[1].state[q]
            for actual, wanted in (
                (p, q),
                (p.grad, q.grad),
                (state["exp_avg"], expected["exp_avg"]),
                (state["exp_avg_sq"], expected["exp_avg_sq"]),
                (state["step"], expected["step"]),
            ):
                torch.testing.assert_close(
                    actual, wanted, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-7, msg=f"step {step}: {name}"
                )
