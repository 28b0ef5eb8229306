"""Sizes and set-ups that cannot work on this machine, refused before anything is allocated: gradflow and CPU
runs too big for memory, more CPU processes than cores, torch.compile on CPU without a C++ compiler."""

from __future__ import annotations

import json

from keel import training
from keel.cli import main as cli_main
from keel.config import load_config
from keeltest import QUIET_TRAINER, TINY_MODEL


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
    assert (
        cli_main(["gradflow", "--depth", "100000", "--width", "8", "--heads", "2", "--seq-len", "8", "--batch", "1"])
        == 2
    )
    assert "needs about 13.0 GiB" in capsys.readouterr().err


def test_a_cpu_run_too_big_for_the_machine_is_refused_before_anything_is_allocated(
    tiny_data, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr("keel.memory.available_bytes", lambda: 2**30)  # less than a training process's own 1 GiB
    argv = [
        "pretrain",
        *TINY_MODEL,
        *QUIET_TRAINER,
        "eval.enabled=false",
        *tiny_data,
        "trainer.max_steps=2",
        "trainer.compile=false",
        f"run.dir={tmp_path / 'run'}",
    ]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "model.depth=2, model.width=32, trainer.micro_batch_size=4 x model.seq_len=32 in 1 process(es) needs about"
        in err
    )
    assert "more than the 1.0 GiB available here" in err and "trainer.check_memory=false" in err
    assert not (tmp_path / "run").exists()  # refused before the run dir was made
    assert cli_main([*argv, "trainer.check_memory=false"]) == 0


def test_cpu_processes_beyond_the_cores_are_said(monkeypatch, capsys):
    """In one Keel line, not as a Python warning with its source line."""
    monkeypatch.setattr(training.os, "sched_getaffinity", lambda pid: {0, 1})
    cfg = load_config(overrides=["trainer.devices=3", "trainer.check_memory=false"])
    training.check_cpu_processes(cfg)
    said = capsys.readouterr().err
    assert said.startswith("keel pretrain: trainer.devices=3 starts that many processes on 2 core(s)")


def test_compile_on_cpu_without_a_cpp_compiler_is_refused_before_training(tiny_data, tmp_path, capsys):
    """torch.compile on CPU needs a C++ compiler at the first compiled step; without one the run is refused at
    start-up, saying how to go on, instead of failing inside the first step (trainer=cpu compiles by default)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.cxx": ("keel-test-no-such-cxx",)}):  # torch's own way (a monkeypatch hides it)
        # The tiny model: with the default one's long sequences some draws of tiny_data hold fewer validation
        # sequences than the default trainer.val_batches asks for, and that refusal (check_splits_fit) came first.
        assert (
            cli_main(
                [
                    "pretrain",
                    *TINY_MODEL,
                    *tiny_data,
                    "trainer.val_batches=2",
                    "trainer.compile=true",
                    f"run.dir={tmp_path / 'run'}",
                ]
            )
            == 2
        )
    err = capsys.readouterr().err
    assert "trainer.compile=true" in err and "keel-test-no-such-cxx" in err and "trainer.compile=false" in err
    assert not (tmp_path / "run" / "checkpoints").exists()
