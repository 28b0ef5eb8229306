"""Strategy, device and precision combinations that cannot work, refused at start-up with what to do instead."""

from __future__ import annotations

import pytest
import torch

from keel.cli import main as cli_main
from keeltest import QUIET_TRAINER, TINY_MODEL


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer=fsdp", "trainer.accelerator=cpu"],
            "FSDP shards over >= 2 processes; on CPU use trainer.devices=2 or trainer=cpu",
        ),
        (["trainer.accelerator=gpu"], "trainer.accelerator=gpu: no CUDA GPU is visible; use trainer=cpu"),
        (
            ["trainer.strategy=single", "trainer.devices=2"],
            "runs one process, not trainer.devices x trainer.num_nodes = 2",
        ),
        (
            ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=16-mixed"],
            "fp16 loss scaling does not work on FSDP shards; use trainer.precision=bf16-mixed",
        ),
        (["trainer.num_nodes=2"], "start one launcher per node with torchrun or srun"),
        (
            ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.hsdp=true"],
            "trainer.hsdp: shards within each node and replicates across nodes: it needs trainer.strategy=fsdp "
            "(trainer=fsdp) and trainer.num_nodes > 1 (got strategy fsdp, 1 node(s))",
        ),
        (["trainer.strategy=zero3"], "trainer.strategy: unknown strategy 'zero3'; allowed: auto, single, ddp, fsdp"),
    ],
)
def test_bad_combinations_say_what_to_do(tiny_data, tmp_path, monkeypatch, capsys, overrides, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for launcher_variable in ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "NODE_RANK"):
        monkeypatch.delenv(launcher_variable, raising=False)
    argv = ["pretrain", *TINY_MODEL, *QUIET_TRAINER, *tiny_data, f"run.dir={tmp_path}", *overrides]
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err
