"""`keel gradflow`: the CLI runs, prints the documented JSON, and draws a PNG."""

from __future__ import annotations

import json

import pytest
import torch

from keel.cli import main
from keel.gradflow import measure_model
from keel.model import KeelLM, ModelConfig
from keel.parallel import apply_activation_checkpointing

ROW_FIELDS = {"index", "block", "kind", "act_grad", "input_rms", "rel_act_grad", "weight_grad", "gain_grad", "output_rms"}
RATIOS = [f"{q}_{where}_top" for q in ("act_grad", "rel_act_grad", "weight_grad") for where in ("bottom", "middle")]
SMALL = ["--depth", "4", "--width", "32", "--heads", "2", "--seq-len", "8", "--batch", "2", "--vocab", "32"]


pytestmark = pytest.mark.usefixtures("one_thread")


def run(capsys, *args: str) -> dict:
    assert main(["gradflow", *SMALL, *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_documented_fields(capsys):
    out = run(capsys, "--scheme", "keel,postln,hybridnorm_star", "--init", "unit", "--alpha", "4")
    assert out["options"]["depth"] == 4 and out["options"]["alpha"] == 4
    assert list(out["schemes"]) == ["keel", "postln", "hybridnorm_star"]
    for scheme, result in out["schemes"].items():
        assert result["config"]["scheme"] == scheme and result["config"]["init"] == "unit"
        rows = result["sublayers"]
        assert [row["index"] for row in rows] == list(range(8))
        assert [row["kind"] for row in rows[:2]] == ["attn", "ffn"]
        for row in rows:
            assert set(row) == ROW_FIELDS
            assert row["rel_act_grad"] == pytest.approx(row["act_grad"] * row["input_rms"])
            assert row["act_grad"] > 0 and row["weight_grad"] > 0 and row["output_rms"] > 0
        summary = result["summary"]
        assert summary["bottom_block"] == (1 if scheme == "keel" else 0) and summary["top_block"] == 3
        assert all(summary[key] > 0 for key in RATIOS + ["weight_grad_block0_top"])
        assert result["loss"] > 0
    assert out["schemes"]["keel"]["config"]["keel_alpha"] == 4


def test_detach_branches_leaves_only_the_skip_path(capsys):
    out = run(capsys, "--scheme", "preln,postln", "--init", "unit", "--detach-branches")
    assert out["options"]["detach_branches"] is True
    assert out["schemes"]["preln"]["summary"]["act_grad_bottom_top"] == pytest.approx(1.0, abs=1e-6)
    assert out["schemes"]["postln"]["summary"]["rel_act_grad_bottom_top"] < 0.5
    # with detached branch inputs the Pre-LN input norms get no gradient
    assert all(row["gain_grad"] == 0 for row in out["schemes"]["preln"]["sublayers"])


def test_plot_writes_a_png(capsys, tmp_path):
    path = tmp_path / "flow.png"
    run(capsys, "--scheme", "keel,preln", "--plot", str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_scheme_is_a_config_error(capsys):
    assert main(["gradflow", *SMALL, "--scheme", "keel,resnet"]) == 2
    assert "model.scheme" in capsys.readouterr().err


def test_measure_model_leaves_parameter_grads_alone():
    cfg = ModelConfig(depth=2, width=32, n_heads=2, seq_len=8, vocab_size=32)
    model = KeelLM(cfg)
    idx = torch.randint(32, (2, 8))
    result = measure_model(model, idx, idx.roll(-1, 1))
    assert len(result["sublayers"]) == 4
    assert all(p.grad is None for p in model.parameters())
    assert not model.blocks[0].attn._forward_pre_hooks  # hooks removed


def test_measure_model_works_under_activation_checkpointing():
    torch.manual_seed(0)
    cfg = ModelConfig(depth=3, width=32, n_heads=2, seq_len=8, vocab_size=32, init="unit")
    plain, checkpointed = KeelLM(cfg), KeelLM(cfg)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed)
    idx = torch.randint(32, (2, 8))
    expected, got = (measure_model(m, idx, idx.roll(-1, 1))["sublayers"] for m in (plain, checkpointed))
    for want, row in zip(expected, got):
        for field in ROW_FIELDS - {"kind"}:
            assert row[field] == pytest.approx(want[field], rel=1e-5), field
