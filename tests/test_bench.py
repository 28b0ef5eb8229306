"""`keel bench` end to end on seconds-long configs: the printed table and the JSON fields; the peak FLOP/s table it
shares with the throughput callback. No timing assertions: the figures are benchmark output (docs/bench.md), not
test thresholds."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics

import pytest
import torch

from keel.cli import main as cli_main
from keel.config import ModelConfig
from keel.flops import device_peak_flops, flops_per_token
from keel.model import KeelLM
from keel.ops.chunked_ce import DEFAULT_CHUNK

TINY = [
    "--depth",
    "2",
    "--width",
    "32",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--vocab",
    "512",
    "--batch",
    "4",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--repeats",
    "2",
    "--threads",
    "1",
]
TINY_FLOPS = flops_per_token(ModelConfig(depth=2, width=32, n_heads=2, seq_len=32, vocab_size=512))


def run_bench(tmp_path, capsys, *argv: str) -> tuple[dict, str]:
    """`keel bench` at TINY dims: (its JSON, what it printed). It sets the process's thread count, which the
    callers' one_thread fixture puts back."""
    out = tmp_path / "bench.json"
    assert cli_main(["bench", *TINY, "--json", str(out), *argv]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_schemes_side_by_side(one_thread, tmp_path, capsys):
    result, printed = run_bench(tmp_path, capsys, "--schemes", "keel,preln", "--compile", "off")
    keel, preln = result["rows"]
    assert (keel["label"], preln["label"]) == ("step:keel t1", "step:preln t1")
    assert "variant" in printed and "tokens/s" in printed and all(row["label"] in printed for row in result["rows"])
    assert result["flops_per_token"] == TINY_FLOPS
    peaks = result["peak_flops_repeats"]  # measured in each round: MFU pairs a round's step with its peak
    assert result["peak_flops_source"].startswith("measured each round") and len(peaks) == 2 and min(peaks) > 0
    assert result["peak_flops"] == pytest.approx(statistics.median(peaks))
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and len(row["tokens_per_s_repeats"]) == 2
        assert row["flops_per_token"] == TINY_FLOPS
        assert row["flops_per_s"] == pytest.approx(row["tokens_per_s"] * TINY_FLOPS)
        per_round = [t * TINY_FLOPS / p for t, p in zip(row["tokens_per_s_repeats"], peaks)]
        assert row["mfu"] == pytest.approx(statistics.median(per_round))
        assert row["peak_memory_bytes"] > 0 and row["compile"] is False and row["threads"] == 1
        assert row["loss_chunk"] == DEFAULT_CHUNK["cpu"]  # no --loss-chunk: the device default
    assert keel["reference"] == "step:preln t1" and keel["ratio"] > 0 and len(keel["ratio_repeats"]) == 2
    assert preln["reference"] is None and preln["ratio"] is None


def test_loss_heads_side_by_side(one_thread, tmp_path, capsys):
    result, printed = run_bench(tmp_path, capsys, "--schemes", "keel,preln", "--loss-chunk", "0,16")
    rows = {row["label"]: row for row in result["rows"]}
    # a chunked head against its scheme's plain head; the plain heads Keel against Pre-LN
    assert {label: row["reference"] for label, row in rows.items()} == {
        "step:keel t1 lc0": "step:preln t1 lc0",
        "step:keel t1 lc16": "step:keel t1 lc0",
        "step:preln t1 lc0": None,
        "step:preln t1 lc16": "step:preln t1 lc0",
    }
    assert [row["loss_chunk"] for row in rows.values()] == [0, 16, 0, 16]
    assert all(row["peak_memory_bytes"] > 0 and label in printed for label, row in rows.items())
    assert cli_main(["bench", "--loss-chunk", "-1"]) == 2
    assert "--loss-chunk needs at least one value, each >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["keel", "preln", "deepnorm"])
def test_each_stacked_member_trains_as_its_own_model_would(one_thread, scheme):
    """MembersStep: member k is the model of seed k trained alone on member k's batches - same losses, same weights
    - with its own gradient-norm clipping (the clip acts: below every member's norm)."""
    from keel.bench.step import MembersStep
    from keel.config import OptimConfig
    from keel.lit import make_optimizer
    from keel.model import next_token_loss

    cfg = ModelConfig(scheme=scheme, depth=3, width=32, n_heads=2, seq_len=16, vocab_size=128)
    members, steps = 3, 5
    stacked = MembersStep(lambda: KeelLM(cfg), torch.randint(128, (members, 2, 17)))
    stacked_losses = torch.stack([stacked() for _ in range(steps)])  # (steps, members)
    clip = OptimConfig().grad_clip
    for k in range(members):
        torch.manual_seed(k)
        model = KeelLM(cfg)
        optimizer = make_optimizer(model, OptimConfig())
        losses, norms = [], []
        for _ in range(steps):
            loss = next_token_loss(model, stacked.batch[k])
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert min(norms) > clip
        assert stacked_losses[:, k].tolist() == pytest.approx(losses, rel=1e-5)
        for name, param in model.named_parameters():
            # as a whole: AdamW normalizes each element's update, so an element whose gradient is ~0 (a token no
            # batch holds) can move by a visible fraction of a step on a rounding difference of its gradient
            difference = (stacked.params[name][k] - param.detach()).norm() / param.detach().norm()
            assert difference < 1e-4, name


def test_members_rows_against_the_single_model(one_thread, tmp_path, capsys):
    result, printed = run_bench(tmp_path, capsys, "--schemes", "keel", "--members", "1,3")
    single, stacked = result["rows"]
    assert (single["label"], stacked["label"]) == ("step:keel t1", "step:keel t1 m3")
    assert stacked["reference"] == "step:keel t1" and stacked["ratio"] > 0 and stacked["members"] == 3
    # tokens/s counts all three members' tokens: a stacked step is 3 batches
    assert stacked["step_s"] == pytest.approx(3 * 4 * 32 / stacked["tokens_per_s"])
    assert cli_main(["bench", "--members", "1,3", "--compile", "on"]) == 2
    assert "--members above 1 runs eager: give --compile off" in capsys.readouterr().err


def test_app_and_loader_rows(one_thread, tiny_data, tmp_path, capsys):
    result, printed = run_bench(
        tmp_path,
        capsys,
        "--schemes",
        "keel",
        "--app",
        "--loader-workers",
        "0",
        "--peak-flops",
        "1e9",
        "eval.enabled=false",
        "trainer.progress_bar=false",
        *tiny_data,
    )
    step, app, loader = result["rows"]
    assert (step["label"], app["label"], loader["label"]) == ("step:keel t1", "app:keel t1 w0", "loader w0")
    assert result["peak_flops"] == 1e9 and result["peak_flops_source"] == "--peak-flops"
    assert result["peak_flops_repeats"] == [1e9, 1e9] and app["mfu"] == pytest.approx(app["flops_per_s"] / 1e9)
    assert app["reference"] == loader["reference"] == "step:keel t1"
    for row in (app, loader):
        assert row["tokens_per_s"] > 0 and row["ratio"] > 0 and row["loader_workers"] == 0
    assert app["flops_per_token"] == TINY_FLOPS and loader["flops_per_token"] is None and loader["mfu"] is None
    assert "app:keel t1 w0" in printed and "loader w0" in printed


@pytest.mark.skipif(importlib.util.find_spec("litgpt") is not None, reason="litgpt is installed here")
def test_missing_peer_says_how_to_install_it(capsys):
    assert cli_main(["bench", "--peer", "litgpt"]) == 2
    assert "pip install --no-deps litgpt" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H200", torch.bfloat16, 989e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),  # before the plain H100 row
        ("NVIDIA H100 80GB HBM3", torch.float32, 67e12),
        ("NVIDIA L40", torch.bfloat16, 181e12),  # not the L4's row
        ("NVIDIA L4", torch.float16, 121e12),
        ("NVIDIA B200", torch.float32, None),  # no fp32 figure: measured instead
        ("Some Future GPU", torch.bfloat16, None),
    ],
)
def test_peak_flops_come_from_one_table(monkeypatch, name, dtype, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_flops(torch.device("cuda"), dtype) == peak
    assert device_peak_flops(torch.device("cuda"), dtype, override=5e12) == 5e12
    assert device_peak_flops(torch.device("cpu"), dtype) is None


def test_the_cpu_peak_probe_is_sized_to_the_cpus_speed():
    """A CPU without fast bf16 (~1 GFLOP/s, AVX2 only) gets small probe matmuls, not minutes of 2048^3 ones; a
    fast one the full 2048 (the size a 256^3 matmul's time predicts to take <= 0.5 s)."""
    from keel.devices import MATMUL_SIZE, probe_size

    seconds_at_256 = lambda flops: 2 * 256**3 / flops  # noqa: E731
    assert probe_size(seconds_at_256(1e9)) == 512  # 0.27 s each: 10 repeats in ~3 s
    assert probe_size(seconds_at_256(47e9)) == MATMUL_SIZE  # this project's fp32 rate: 0.37 s each
    assert probe_size(1.0) == 256  # never below the first size


def test_a_bench_too_big_for_this_machine_is_refused_before_any_model_is_built(monkeypatch, capsys):
    """`--depth 100000 --width 4096` once ran the machine out of memory: bench had no memory check."""
    built = []
    monkeypatch.setattr(KeelLM, "__init__", lambda *args: built.append(args))
    assert cli_main(["bench", "--depth", "100000", "--width", "4096", "--device", "cpu", "--threads", "1,2"]) == 2
    assert re.fullmatch(
        r"keel bench: config error: keel bench --depth 100000 --width 4096 --batch 8 x --seq-len 256, "
        r"4 model\(s\) held at once needs about [\d.]+ GiB \([\d,]+ parameters: weights, gradients and "
        r"AdamW state, per model; plus activations\), more than the "
        r"[\d.]+ GiB available here; lower them, or bench fewer --schemes, --loss-chunk, "
        r"--compile or --threads values at once",
        capsys.readouterr().err.strip(),
    )
    assert not built
