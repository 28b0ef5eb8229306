"""`make gpu-check DEVICE=cpu`: the GPU acceptance script (keel.gpu_check) end to end at tiny sizes on CPU, so that
it runs when a GPU is first available. Its figures are reports, not test thresholds; its checks are asserted."""

from __future__ import annotations

import json
import subprocess

import pytest

from keel.cli import main as cli_main
from keeltest import REPO


def test_make_target_runs_the_script():
    dry = subprocess.run(["make", "-n", "gpu-check", "DEVICE=cpu"], cwd=REPO, capture_output=True, text=True)
    assert dry.returncode == 0 and "keel gpu-check --device cpu --out out/gpu-check-cpu" in dry.stdout


@pytest.mark.extended
@pytest.mark.slow
def test_gpu_check_passes_on_cpu(tmp_path, capsys):
    out = tmp_path / "gpu-check"  # its own data too, as `make gpu-check DEVICE=cpu` builds it
    assert cli_main(["gpu-check", "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads((out / "gpu_check.json").read_text())
    printed = capsys.readouterr().out
    assert result["torch_below_floor"] is None and "keel declares; a failure here may be" not in printed
    assert result["ok"] and list(result["sections"]) == [
        "bench",
        "pretrain",
        "depth",
        "paper",
        "callbacks",
        "multi",
        "fsdp",
        "checkpoint",
        "precision",
    ]
    assert "PASS" in printed and "[ok] pretrain" in printed and "deepest fitting: 8 blocks" in printed
    bench = next(iter(result["sections"]["bench"]["configs"].values()))
    assert bench["keel"]["tokens_per_s"] > 0 and bench["keel"]["mfu"] > 0 and bench["preln"]["ratio"] is None
    runs = result["sections"]["pretrain"]["runs"]
    assert list(runs) == ["trainer=cpu", "trainer=fsdp devices=2"]
    assert all(all(run["checks"].values()) and len(run["loss_resumed"]) == 5 for run in runs.values())
    # FSDP against one process: on equal batches, GPU only
    (gap,) = result["sections"]["pretrain"]["thresholds"].values()
    assert gap["ok"] and gap["skipped"].startswith("cpu: FSDP needs 2 processes")
    assert [t["depth"] for t in result["sections"]["depth"]["tried"]] == [2, 4, 8]
    assert all(check["ok"] for check in result["sections"]["precision"]["checks"].values())
    paper = result["sections"]["paper"]["paper_runs"]
    # on a GPU, an eager twin too; the recipe's shape accumulates micro-batches (2 on CPU)
    assert list(paper) == ["activation checkpointing off", "activation checkpointing on", "the recipe's shape"]
    assert paper["the recipe's shape"]["shape"].startswith("4 sequences x 2 micro-batch(es)")
    for run in paper.values():  # the same model and batches: checkpointing recomputes, it changes no value
        assert run["ok"] and run["loss_last"] < run["loss_first"] and run["tokens_per_s"] > 0
        assert run["sdpa"] == ["_scaled_dot_product_flash_attention_for_cpu"] and run["checkpoint_bytes"] > 0
    timed = result["sections"]["callbacks"]["callback_runs"]  # every variant trained and was timed
    assert list(timed) == [
        "all on",
        "grad_norms off",  # each configurable callback by its name (keel.config.callbacks.CALLBACKS)
        "layer_importance off",
        "stability off",
        "throughput off",
        "progress bar off",
        "all off",
    ]
    assert all(run["ok"] and run["step_ms"] > 0 for run in timed.values()) and timed["all on"]["cost_ms"] == 0
    multi = result["sections"]["multi"]  # 2 CPU processes stand for the GPUs
    assert multi["devices"] == 2 and list(multi["checks"]) == [
        "every run ran",
        "fsdp x 2 = ddp x 2 (rel 1e-04)",
        "1 device = ddp x 2 (rel 1e-04)",
        "fsdp resumed = fsdp x 2 (rel 1e-05)",
        "ddp in-loop evaluation written",
        "non-finite: exit 1, every rank",
    ]
    assert all(multi["checks"].values()) and all(len(norms) == 10 for norms in multi["global_grad_norms"].values())
    # the GPU-only thresholds are said to be skipped on CPU, not faked
    assert result["sections"]["paper"]["thresholds"] == {
        label: {"ok": True, "skipped": "cpu"}
        for label in (
            "MFU, compiled, checkpointing off",
            "MFU, the recipe's shape",
            "peak memory, compiled, checkpointing off",
            "peak memory, eager, checkpointing off",
            "peak memory, compiled, checkpointing on",
            "peak memory, the recipe's shape",
        )
    }
    assert "[skipped] MFU, compiled, checkpointing off: cpu" in printed
    fsdp = result["sections"]["fsdp"]  # bf16 FSDP on 2 CPU processes with the in-loop evaluation
    assert fsdp["devices"] == 2 and all(fsdp["checks"].values()) and list(fsdp["fsdp_runs"]) == ["fsdp x 2"]
    assert fsdp["fsdp_runs"]["fsdp x 2"]["tokens_per_s_per_device"] > 0 and not fsdp["errors"]
    assert [row.get("skipped", "").split(" ")[0] for row in fsdp["thresholds"].values()] == ["cpu", "cpu"]
    saves = result["sections"]["checkpoint"]  # sharded saves on 2 CPU processes, sync and in the background
    assert all(saves["checks"].values()) and list(saves["saves"]) == ["sync", "async"] and not saves["errors"]
    for save in saves["saves"].values():
        assert save["bytes"] > 0 and save["total_s"] >= save["blocking_s"] > 0
    assert paper["activation checkpointing on"]["loss_last"] == pytest.approx(
        paper["activation checkpointing off"]["loss_last"], rel=1e-3
    )


def test_unknown_section_and_missing_gpu_are_refused(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["gpu-check", "--device", "cuda"]) == 2
    assert "no CUDA GPU is visible; run `make gpu-check DEVICE=cpu`" in capsys.readouterr().err
    assert cli_main(["gpu-check", "--device", "cpu", "--sections", "bench,speed"]) == 2
    assert (
        "--sections: unknown speed; allowed: bench, pretrain, depth, paper, callbacks, multi, fsdp, checkpoint, "
        "precision" in capsys.readouterr().err
    )


def test_thresholds_fail_when_missed_and_say_their_bound():
    """A figure below its floor fails its row (and with it the section), printed with the figure, the bound and
    the bound's source; a GPU-only row on CPU is skipped, not passed on a made-up figure."""
    import torch

    from keel.gpu_check.paper import MFU_FLOOR, memory_threshold, mfu_threshold
    from keel.gpu_check.report import table

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    low, high = mfu_threshold({"mfu": MFU_FLOOR - 0.01}, cuda), mfu_threshold({"mfu": MFU_FLOOR + 0.01}, cuda)
    assert (low["ok"], high["ok"]) == (False, True) and mfu_threshold({"mfu": 0.5}, cpu) == {
        "ok": True,
        "skipped": "cpu",
    }
    estimate = 10 * 2**30
    within, over = (
        {"peak_memory_bytes": int(estimate * r), "allocated_estimate_bytes": estimate} for r in (1.09, 1.11)
    )
    assert memory_threshold(within, cuda)["ok"] and not memory_threshold(over, cuda)["ok"]
    section = {"ok": False, "seconds": 1.0, "thresholds": {"MFU": low, "memory": memory_threshold(over, cuda)}}
    printed = table({"device_name": "H200", "torch": "2", "seconds": 1.0, "ok": False, "sections": {"paper": section}})
    assert (
        f"[FAIL] MFU: {MFU_FLOOR - 0.01:.1%} (threshold >= {MFU_FLOOR:.0%}: a floor, this project's choice" in printed
    )
    assert "[FAIL] memory: 11,366 MB = 1.11 x the estimate 10,240 MB (threshold within 10%, above or below" in printed
    # both ways: an estimate well above the peak fails too (auto would recompute blocks that fit)
    above, below = (
        {"peak_memory_bytes": int(estimate * r), "allocated_estimate_bytes": estimate} for r in (0.91, 0.89)
    )
    assert memory_threshold(above, cuda)["ok"] and not memory_threshold(below, cuda)["ok"]


def test_a_torch_below_keels_floor_is_said_before_the_results():
    import tomllib

    from keel.gpu_check.cli import torch_floor
    from keel.gpu_check.report import table

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={torch_floor()}" in declared  # read from the installed metadata
    printed = table(
        {
            "device_name": "H200",
            "torch": "2.11.0+cu130",
            "torch_below_floor": "2.13",
            "seconds": 1.0,
            "ok": True,
            "sections": {},
        }
    ).splitlines()
    assert printed[1] == (
        "warning: torch 2.11.0+cu130 is below the torch>=2.13 keel declares; a failure here may be "
        "that torch's, not keel's"
    )
