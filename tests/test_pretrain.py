"""The training application end to end on CPU: config errors, TensorBoard scalars, exact resume,
atomic and validated checkpoints."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from keel.checkpoint.layout import LAST
from keel.checkpoint.read import load_model
from keel.checkpoint.write import AtomicCheckpointIO
from keel.cli import main as cli_main
from keel.config import load_config
from keel.errors import ConfigError
from keel.training import train
from keeltest.runs import EIGHT_STEP_RUN, CrashAtStep, scalars, tiny_config


def test_cli_config_errors_name_the_key(capsys):
    assert cli_main(["pretrain", "--print-config", "model.dept=4"]) == 2
    assert "model.dept: unknown config key; did you mean model.depth" in capsys.readouterr().err
    # a value of the wrong type: the type the key takes in Keel's words (not OmegaConf's), null where allowed
    for override, said in (
        ("model.depth=two", "model.depth: 'two' is not a whole number (e.g. model.depth=16)"),
        ("trainer.gpu_memory_gib=abc", "trainer.gpu_memory_gib: 'abc' is not a number or null"),
        ("run.overwrite=maybe", "run.overwrite: 'maybe' is not true or false (e.g. run.overwrite=false)"),
    ):
        assert cli_main(["pretrain", "--print-config", override]) == 2
        assert capsys.readouterr().err == f"keel pretrain: config error: {said}\n"
    assert cli_main(["pretrain", "--print-config", "trainer=nope"]) == 2
    assert "available: " in capsys.readouterr().err
    assert cli_main(["pretrain", "--print-config", "model.depth=3", "model=paper_d64"]) == 0
    printed = capsys.readouterr().out
    assert "depth: 3" in printed and "width: 1024" in printed


# `keel pretrain ARGS` in a fresh interpreter: its exit code, then which of torch and Lightning it imported
PRETRAIN_IMPORTS = """import sys, keel.cli
code = keel.cli.main(['pretrain', *sys.argv[1:]])
print(code, sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'lightning'}))
"""


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["model.depth=-1"], "model.depth: must be >= 1, got -1"),
        (["model.sheme=keel"], "model.sheme: unknown config key; did you mean model.scheme"),
        (["optim.lr=abc"], "optim.lr: 'abc' is not a number (e.g. optim.lr=0.003)"),
        (
            ["trainer=fsdp", "optim.lr=-1"],
            "optim.lr: must be > 0, got -1.0",
        ),  # compile: auto is resolved after the check
        (["--print-config", "model.depth=3"], None),
    ],
)
def test_the_config_is_checked_before_torch_and_lightning_load(args, error):
    """A config error costs no torch and Lightning start-up (~8 s and ~950 MB of RSS on the loaded 2-core dev
    machine, against ~0.3 s and ~23 MB without): keel pretrain composes and checks the config, and prints it, with
    neither imported; training imports them (keel.training)."""
    run = subprocess.run([sys.executable, "-c", PRETRAIN_IMPORTS, *args], capture_output=True, text=True, timeout=120)
    assert run.stdout.splitlines()[-1] == f"{0 if error is None else 2} []", run.stderr
    if error is not None:
        assert f"keel pretrain: config error: {error}" in run.stderr


def test_fp16_with_clipping_is_refused_at_load_time(capsys):
    """fp16 loss scaling cannot unscale a fused AdamW's gradients before clipping: refused with the two ways on,
    before any work (Lightning raised at the first step); without clipping it loads."""
    assert cli_main(["pretrain", "--print-config", "trainer.precision=16-mixed"]) == 2
    err = capsys.readouterr().err
    assert "trainer.precision: 16-mixed" in err and "bf16-mixed" in err and "optim.grad_clip=0" in err
    assert cli_main(["pretrain", "--print-config", "trainer.precision=16-mixed", "optim.grad_clip=0"]) == 0


def test_a_run_ends_with_a_validation_of_its_final_model(tiny_data, tmp_path):
    """max_steps not a multiple of val_every_n_steps: validated at step 5 and at the last, step 7; the last
    checkpoint records the final one (the model card's held-out loss)."""
    run = tmp_path / "run"
    train(tiny_config(tiny_data, run, "trainer.max_steps=7", "trainer.val_every_n_steps=5", "trainer.val_batches=1"))
    val = scalars(run, "val/loss")
    assert sorted(val) == [4, 6] and sorted(scalars(run, "train/loss")) == list(range(7))
    heldout = torch.load(run / "checkpoints" / LAST, weights_only=True)["keel"]["heldout"]
    assert heldout["step"] == 7 and heldout["loss"] == pytest.approx(val[6], rel=1e-6)


def test_a_checkpoint_of_a_validated_step_holds_that_steps_held_out_loss(tiny_data, tmp_path):
    """Checkpoints and validations both every 4 steps: each checkpoint is written after its step's validation,
    so step000004 holds step 4's held-out loss and the last checkpoint the final step's (it held step 4's)."""
    run = tmp_path / "run"
    train(tiny_config(tiny_data, run, *EIGHT_STEP_RUN))
    val = scalars(run, "val/loss")
    for name, step in (("step000004.ckpt", 4), ("step000008.ckpt", 8), (LAST, 8)):
        heldout = torch.load(run / "checkpoints" / name, weights_only=True)["keel"]["heldout"]
        assert heldout["step"] == step and heldout["loss"] == pytest.approx(val[step - 1], rel=1e-6), name


def test_training_logs_scalars_and_learns(tiny_data, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(
        tiny_data,
        run,
        "trainer.max_steps=60",
        "trainer.val_every_n_steps=30",
        "trainer.val_batches=4",
        "optim.warmup_steps=5",
    )
    train(cfg)
    losses = scalars(run, "train/loss")
    assert sorted(losses) == list(range(60))
    val = scalars(run, "val/loss")
    assert sorted(val) == [29, 59] and val[59] < val[29]
    ppl = scalars(run, "val/ppl")
    assert ppl[59] == pytest.approx(torch.tensor(val[59]).exp().item(), rel=1e-4)
    tokens = scalars(run, "train/tokens")
    assert tokens[59] == 60 * 4 * 32
    lr = scalars(run, "lr/matrices")
    assert lr[0] == pytest.approx(cfg.optim.lr / 5) and lr[59] < lr[10]
    model, saved_cfg, tokenizer_json = load_model(run / "checkpoints" / LAST)
    assert saved_cfg == cfg and '"model"' in tokenizer_json and not model.training


def test_resume_after_crash_continues_exactly(tiny_data, tmp_path):
    steps = [
        "trainer.max_steps=8",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.val_every_n_steps=4",
        "trainer.val_batches=2",
    ]
    straight = tmp_path / "straight"
    train(tiny_config(tiny_data, straight, *steps))

    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config(tiny_data, crashed, *steps), extra_callbacks=[CrashAtStep(6)])
    assert (crashed / "checkpoints" / LAST).exists()
    train(tiny_config(tiny_data, crashed, *steps, "resume=auto"))

    expected, resumed = scalars(straight, "train/loss"), scalars(crashed, "train/loss")
    assert sorted(resumed) == list(range(8))
    assert resumed == expected  # bit for bit, every step, the replayed steps 5-6 included
    assert scalars(crashed, "val/loss") == scalars(straight, "val/loss")


def test_extending_a_finished_run_logs_the_steps_an_uninterrupted_one_does(tiny_data, tmp_path):
    steps = ["trainer.val_every_n_steps=4", "trainer.val_batches=1", "trainer.checkpoint_every_n_steps=100"]
    train(tiny_config(tiny_data, tmp_path / "straight", "trainer.max_steps=6", *steps))
    train(tiny_config(tiny_data, tmp_path / "extended", "trainer.max_steps=4", *steps))  # ends in validation
    train(tiny_config(tiny_data, tmp_path / "extended", "trainer.max_steps=6", *steps))
    assert scalars(tmp_path / "extended", "train/loss") == scalars(tmp_path / "straight", "train/loss")


def test_resume_refuses_other_model_batch_layout_and_corrupt_checkpoint(tiny_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(tiny_data, run, "trainer.max_steps=2", "trainer.val_every_n_steps=2", "trainer.val_batches=1"))
    with pytest.raises(ConfigError, match=r"model.depth: checkpoint 2 != config 3"):
        train(tiny_config(tiny_data, run, "trainer.max_steps=4", "resume=auto", "model.depth=3"))
    with pytest.raises(
        ConfigError,
        match=r"1 process\(es\) x 4 sequences x 1 micro-batch\(es\) = 4 sequences per "
        r"step; this config has 1 process\(es\) x 4 sequences x 2 micro-batch\(es\) = 8",
    ):
        train(tiny_config(tiny_data, run, "trainer.max_steps=4", "resume=auto", "trainer.grad_accum=2"))
    (run / "checkpoints" / LAST).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="is not a torch.save zip file"):
        train(tiny_config(tiny_data, run, "trainer.max_steps=4", "resume=auto"))
    with pytest.raises(ConfigError, match="no checkpoint at"):
        train(tiny_config(tiny_data, run, "resume=/nonexistent.ckpt"))


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, path)

    def crash_mid_write(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_mid_write)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_the_default_cpu_trainer_compiles_and_trains_as_eager_does(tiny_data, tmp_path):
    """trainer=cpu compiles the blocks by default (docs/bench.md: faster, compile time included). A compiled run
    trains the same model as an eager one - equal losses to fp32 rounding over its steps and validation - and its
    checkpoint loads into a plain model (no compile wrapper in the state_dict keys)."""
    assert load_config().trainer.compile
    losses = {}
    for compiled in (False, True):
        run = tmp_path / f"compile-{compiled}"
        train(
            tiny_config(
                tiny_data,
                run,
                f"trainer.compile={str(compiled).lower()}",
                "trainer.max_steps=4",
                "trainer.val_every_n_steps=4",
                "trainer.val_batches=2",
                "optim.warmup_steps=2",
            )
        )
        losses[compiled] = [scalars(run, "train/loss")[step] for step in range(4)] + [scalars(run, "val/loss")[3]]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
    model, _, _ = load_model(tmp_path / "compile-True" / "checkpoints" / LAST)
    assert not any("_orig_mod" in key for key in model.state_dict())
