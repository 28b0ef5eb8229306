"""model.parametrization=mup (docs/model.md#mup): muP's coordinate check (Tensor Programs V, Yang et al. 2022) for
Keel and Pre-LN, the optimizer's per-group LR scale through the schedule, mup at its base width being sp, and the
config's refusals. `pytest -s` prints the coordinate check's table."""

from __future__ import annotations

import math

import pytest
import torch

from keel.cli import main as cli_main
from keel.config import ModelConfig, load_config
from keel.errors import ConfigError
from keel.lit import make_optimizer
from keel.model import KeelLM, next_token_loss
from keel.schedule import lr_factor
from keel.training import train
from keeltest.model import fixed_batch_steps, loglog_slope
from keeltest.runs import CrashAtStep, scalars, tiny_config

WIDTHS = (32, 64, 128, 256, 512)
BASE_WIDTH = 32
STEPS, LR = 4, 1e-2
SMALL = dict(depth=2, n_heads=4, vocab_size=256, seq_len=32)
# The log-log slope of each activation's rms over WIDTHS. Under mup none may grow (slope < GROWS_NOT), and none may
# vanish faster than n^-1/2 (slope > VANISHES_NOT): muP's own finite-width terms decay so - the readout's init part
# (std-0.02 head x base/width: ~n^-1/2) and attention's init part (q.k/d of uncorrelated q, k: ~n^-1/2) - while the
# update's part is flat (pytest -s prints the slopes). A hidden LR left at sp's would give ~+1 and one scaled twice ~-1.
# Under sp the branches grow with slope ~2 and the logits ~0.9 (Adam's updates sum width coherent terms): both must
# exceed GROWS.
GROWS_NOT, VANISHES_NOT, GROWS = 0.15, -0.45, 0.5


def activation_rms(scheme: str, parametrization: str, width: int) -> dict[str, float]:
    """Each block's attention and FFN branch output, each block's output and the logits: their rms on a fixed batch
    after STEPS AdamW steps at LR on it (muP's coordinate check)."""
    torch.manual_seed(0)
    cfg = ModelConfig(scheme=scheme, width=width, parametrization=parametrization, mup_base_width=BASE_WIDTH, **SMALL)
    model = KeelLM(cfg)
    batch = fixed_batch_steps(model, STEPS, LR)
    rms: dict[str, float] = {}
    modules = {"embedding": model.embed}
    for i, block in enumerate(model.blocks):
        modules |= {
            f"block{i}.attn_branch": block.attn.branch,
            f"block{i}.ffn_branch": block.ffn.branch,
            f"block{i}.out": block,
        }
    hooks = [
        module.register_forward_hook(
            lambda module, args, out, name=name: rms.__setitem__(name, out.float().pow(2).mean().sqrt().item())
        )
        for name, module in modules.items()
    ]
    with torch.no_grad():
        rms["logits"] = model(batch[:, :-1]).pow(2).mean().sqrt().item()
    for hook in hooks:
        hook.remove()
    return rms


@pytest.mark.parametrize("scheme", ["keel", "preln"])
def test_coordinate_check_activations_are_flat_in_width_under_mup_and_grow_under_sp(scheme):
    torch.set_num_threads(1)
    slopes = {}
    for parametrization in ("sp", "mup"):
        table = [activation_rms(scheme, parametrization, width) for width in WIDTHS]
        print(f"\n{scheme} {parametrization}: activation rms after {STEPS} AdamW steps at lr {LR}")
        print(f"  {'layer':<18}" + "".join(f"{w:>9}" for w in WIDTHS) + "    slope")
        for name in table[0]:
            values = [row[name] for row in table]
            slopes[parametrization, name] = loglog_slope(WIDTHS, values)
            print(f"  {name:<18}" + "".join(f"{v:9.3g}" for v in values) + f"  {slopes[parametrization, name]:+7.3f}")
    moving = {name: s for (p, name), s in slopes.items() if p == "mup" and not VANISHES_NOT < s < GROWS_NOT}
    assert not moving, f"under mup these activations' rms still moves with width (log-log slope): {moving}"
    assert slopes["sp", "logits"] > GROWS, f"under sp the logits should grow with width: slope {slopes['sp', 'logits']}"
    assert slopes["sp", "block0.ffn_branch"] > GROWS, "under sp the FFN branch's output should grow with width"


def test_hidden_matrices_get_the_scaled_lr_at_every_step_of_the_schedule():
    cfg = load_config(
        overrides=[
            "model.depth=2",
            "model.width=64",
            "model.vocab_size=256",
            "model.seq_len=16",
            "model.parametrization=mup",
            "model.mup_base_width=16",
            "optim.warmup_steps=3",
        ]
    )
    model = KeelLM(cfg.model)
    optimizer = make_optimizer(model, cfg.optim)
    groups = {group["name"]: group for group in optimizer.param_groups}
    assert {id(p) for p in groups["hidden"]["params"]} == {id(p) for p in model.hidden_matrices()}
    assert len(groups["hidden"]["params"]) == 4 * cfg.model.depth and groups["hidden"]["lr_scale"] == 0.25
    # the embedding and the head stay at the base LR (muP for Adam: their LR does not scale with width)
    assert {id(p) for p in groups["matrices"]["params"]} == {id(model.embed.weight), id(model.head.weight)}
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg.optim, 10))
    for step in range(6):
        factor = lr_factor(step, cfg.optim, 10)
        assert groups["matrices"]["lr"] == pytest.approx(cfg.optim.lr * factor)
        assert groups["gains"]["lr"] == pytest.approx(cfg.optim.lr * factor)
        assert groups["hidden"]["lr"] == pytest.approx(cfg.optim.lr * factor * 0.25)
        optimizer.step()
        scheduler.step()


def test_a_mup_run_resumes_exactly_with_its_hidden_group(tiny_data, tmp_path):
    """The optimizer's third group (its LR, its AdamW state) survives a checkpoint: a crashed and resumed mup run
    logs the losses of an uninterrupted one, bit for bit."""
    steps = [
        "model.parametrization=mup",
        "model.mup_base_width=16",
        "trainer.max_steps=6",
        "trainer.checkpoint_every_n_steps=3",
        "trainer.val_every_n_steps=100",
    ]
    train(tiny_config(tiny_data, tmp_path / "straight", *steps))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config(tiny_data, tmp_path / "crashed", *steps), extra_callbacks=[CrashAtStep(5)])
    train(tiny_config(tiny_data, tmp_path / "crashed", *steps, "resume=auto"))
    resumed = scalars(tmp_path / "crashed", "train/loss")
    assert sorted(resumed) == list(range(6)) and resumed == scalars(tmp_path / "straight", "train/loss")


@pytest.mark.parametrize("scheme", ["keel", "preln"])
def test_mup_at_its_base_width_is_sp(scheme):
    """The same init bit for bit, the same loss (attention's scale computed another way: to rounding), and the
    hidden group at the base LR; away from the base width the multipliers are base / width."""
    losses, states = [], []
    batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    for parametrization in ("sp", "mup"):
        torch.manual_seed(0)
        model = KeelLM(
            ModelConfig(
                scheme=scheme,
                width=64,
                parametrization=parametrization,
                mup_base_width=64,
                depth=2,
                vocab_size=256,
                seq_len=16,
            )
        )
        states.append(model.state_dict())
        losses.append(next_token_loss(model, batch).item())
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    wide = ModelConfig(scheme=scheme, width=256, n_heads=4, parametrization="mup", mup_base_width=64)
    assert wide.mup_ratio == 0.25 and wide.attention_scale == pytest.approx(math.sqrt(16) / 64)
    # tuned with 4 heads at width 64 (head_dim 16), trained with 16 at width 1024 (head_dim 64): 1/head_dim from 16
    paper = ModelConfig(
        scheme=scheme, width=1024, n_heads=16, parametrization="mup", mup_base_width=64, mup_base_head_dim=16
    )
    assert paper.attention_scale == pytest.approx(math.sqrt(16) / 64)
    sp = ModelConfig(scheme=scheme, width=256)
    assert sp.mup_ratio == 1.0 and sp.attention_scale is None


def test_sp_keeps_two_optimizer_groups_sdpas_scale_and_no_multiplier():
    """sp as before mup existed (checked bit for bit against that code once: init, losses, logits, groups)."""
    model = KeelLM(ModelConfig(width=64, depth=2, vocab_size=256, seq_len=16))
    optim = load_config().optim
    groups = make_optimizer(model, optim).param_groups
    assert [group["name"] for group in groups] == ["matrices", "gains"]
    assert all(group["lr"] == optim.lr and "lr_scale" not in group for group in groups)
    assert sum(len(group["params"]) for group in groups) == len(list(model.parameters()))
    assert all(block.attn.branch.scale is None for block in model.blocks)


def test_mup_init_scales_hidden_matrices_by_the_fan_in_rule():
    stds = {}
    for parametrization in ("sp", "mup"):
        torch.manual_seed(0)
        model = KeelLM(
            ModelConfig(
                width=256,
                depth=2,
                vocab_size=256,
                seq_len=16,
                parametrization=parametrization,
                mup_base_width=64,
                init="normal",
            )
        )
        stds[parametrization] = (
            [m.std().item() for m in model.hidden_matrices()],
            model.embed.weight.std().item(),
            model.head.weight.std().item(),
        )
    for sp_std, mup_std in zip(stds["sp"][0], stds["mup"][0]):
        assert mup_std == pytest.approx(sp_std * 0.5, rel=1e-6)  # sqrt(64 / 256)
    assert stds["mup"][1:] == stds["sp"][1:]  # embedding and head unchanged


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.parametrization=mupp", "model.parametrization"),
        ("model.mup_base_width=0", "model.mup_base_width"),
        ("model.mup_base_head_dim=0", "model.mup_base_head_dim"),
        ("model.init=unit", "model.init"),
    ],
)
def test_mup_config_refusals_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(overrides=["model.parametrization=mup", override])


def test_print_config_shows_every_mup_multiplier_and_still_loads(capsys, tmp_path):
    overrides = ["model.parametrization=mup", "model.width=256", "model.mup_base_width=64", "optim.lr=0.01"]
    assert cli_main(["pretrain", "--print-config", *overrides]) == 0
    printed = capsys.readouterr().out
    # r = 64 / 256: init std x sqrt(r), hidden LR x r, logits x r, attention sqrt(64 / 4) / (256 / 4)
    for shown in ("std x 0.5 ", "LR x 0.25", "logits x 0.25", "attention scale 0.0625", "peak LR 0.0025"):
        assert shown in printed
    (tmp_path / "printed.yaml").write_text(printed)
    assert load_config(str(tmp_path / "printed.yaml")).model.mup_ratio == 0.25
