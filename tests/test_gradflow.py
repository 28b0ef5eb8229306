"""`keel gradflow`: the CLI runs, prints the documented JSON, and draws a PNG."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from keel.cli import main
from keel.config import Config, ModelConfig, to_dict
from keel.gradflow import measure_model
from keel.model import KeelLM
from keel.parallel import apply_activation_checkpointing

ROW_FIELDS = {
    "index",
    "block",
    "kind",
    "act_grad",
    "input_rms",
    "rel_act_grad",
    "weight_grad",
    "gain_grad",
    "output_rms",
    "input_top_share",
}
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


def _checkpoint_with_compounding_gains(path) -> str:
    """A Keel model whose every Norm_out gain weights its last channel 1.3 and the others 1, saved as a checkpoint.
    With alpha = L each sublayer is nearly x -> gain * x / rms(x), so over its 30 such sublayers that channel gains
    1.3^30 ~ 3e3 over the others: the stream must collapse onto it and the gradient reaching the bottom must
    shrink; with the gains flattened neither may happen."""
    torch.manual_seed(0)
    cfg = ModelConfig(scheme="keel", depth=16, width=32, n_heads=2, seq_len=8, vocab_size=32)
    model = KeelLM(cfg)
    with torch.no_grad():
        for block in model.blocks[1:]:
            for sub in (block.attn, block.ffn):
                sub.norm_out.weight.fill_(1.0)[-1] = 1.3
    checkpoint = {
        "keel": {"config": to_dict(Config(model=cfg)), "tokenizer_json": None},
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
    }
    torch.save(checkpoint, path)
    return str(path)


def test_checkpoint_with_compounding_gains_collapses_and_flattening_undoes_it(capsys, tmp_path):
    ckpt = _checkpoint_with_compounding_gains(tmp_path / "gains.ckpt")
    results = {}
    for extra in ([], ["--flatten-gains"]):
        assert main(["gradflow", "--checkpoint", ckpt, "--batch", "4", *extra]) == 0
        ((name, result),) = json.loads(capsys.readouterr().out)["schemes"].items()
        results[name] = result
    trained, flat = results["keel"], results["keel (gains flattened)"]
    assert trained["config"]["depth"] == 16 and trained["config"]["seq_len"] == 8  # the checkpoint's model
    assert trained["sublayers"][-1]["input_top_share"] > 0.99  # one channel of 32 carries the stream
    assert max(row["input_top_share"] for row in flat["sublayers"]) < 0.1  # spread over the channels, as at init
    assert trained["summary"]["rel_act_grad_bottom_top"] < 0.2  # measured 0.09
    assert 0.5 < flat["summary"]["rel_act_grad_bottom_top"] < 2  # measured 1.02


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint", "x.ckpt", "--depth", "4"], "--depth: the checkpoint's model is measured as it is"),
        (["--flatten-gains"], "--flatten-gains needs --checkpoint"),
    ],
)
def test_checkpoint_options_are_refused_where_they_cannot_apply(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["gradflow", *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


# Peak RSS from VmHWM: ru_maxrss would count the forking pytest process's own memory (it survives exec)
GRADFLOW_PEAK = """
import re, sys
from keel import cli
code = cli.main(["gradflow", *sys.argv[1:]])
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024, file=sys.stderr)
sys.exit(code)
"""


def test_a_deep_measurement_says_its_time_and_progress_and_stays_within_its_memory_estimate():
    """`--depth 100000 --width 8` ran for more than 15 minutes without a word, its memory past the estimate (at
    10,000 blocks: 1.99 GiB measured, 1.2 estimated before the process itself was counted)."""
    from keel import memory

    argv = ["--depth", "1000", "--width", "8", "--seq-len", "8", "--batch", "1"]
    done = subprocess.run(
        [sys.executable, "-c", GRADFLOW_PEAK, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["schemes"]["keel"]["config"]["depth"] == 1000
    *said, peak = done.stderr.splitlines()
    assert re.fullmatch(
        r"keel gradflow: keel, 1,000 blocks: about [\d.]+ min \(extrapolated from 256 blocks\), about "
        r"[\d.]+ GiB",
        said[0],
    ), said
    progress = [re.sub(r", \d+ s$", "", line) for line in said[1:]]
    assert progress == [
        "keel gradflow: building 1,000 blocks",
        *(f"keel gradflow: forward {n:,} of 1,000 blocks" for n in range(100, 1001, 100)),
        *(f"keel gradflow: backward {n:,} of 1,000 blocks" for n in range(100, 1001, 100)),
    ]
    cfg = ModelConfig(depth=1000, width=8, n_heads=4, seq_len=8, vocab_size=256)
    assert int(peak) <= memory.measurement_bytes(cfg, 1)
