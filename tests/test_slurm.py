"""docs/distributed.md's SLURM example: warned before its time limit and requeued, and each task finding its place."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.config import load_config


def _sbatch_example() -> tuple[dict[str, str], list[str]]:
    """docs/distributed.md's sbatch script: its #SBATCH options and the overrides of its srun line."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    script = doc[doc.index("    #!/bin/bash") :].split("\n\n")[0]
    options = dict(line.split()[1].lstrip("-").partition("=")[::2] for line in script.splitlines() if "#SBATCH" in line)
    srun = next(line.split() for line in script.splitlines() if line.strip().startswith("srun"))
    return options, srun[srun.index("pretrain") + 1 :]


def test_slurm_example_is_warned_before_its_time_limit_and_requeued():
    """The inline script runs srun in the foreground, with no trap: its USR1 goes to srun's tasks (no `B:`, which
    would signal the batch shell alone and end it), with docs/slurm/pretrain.sbatch's lead; --requeue lets rank 0
    requeue it."""
    options, _ = _sbatch_example()
    pretrain_sbatch = (Path(__file__).resolve().parents[1] / "docs" / "slurm" / "pretrain.sbatch").read_text()
    lead = pretrain_sbatch.split("#SBATCH --signal=B:USR1@", 1)[1].split()[0]
    assert options["signal"] == f"USR1@{lead}" and "requeue" in options


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_slurm_example_task_finds_its_place(monkeypatch, tmp_path, strategy):
    from keel.training import build_trainer

    options, overrides = _sbatch_example()
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    node, local = nodes - 1, 3  # the 4th task on the last node, as srun starts it
    for variable in ("TORCHELASTIC_RUN_ID", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.setenv(variable, "")  # recorded, so restored afterwards: Lightning's SLURMEnvironment sets
        monkeypatch.delenv(variable)  # MASTER_ADDR / MASTER_PORT itself, and later runs must not rendezvous at gpu07
    monkeypatch.setenv("SLURM_JOB_NAME", options["job-name"])  # not "bash": a batch job, not an interactive shell
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_NODELIST", "gpu[07-08]")
    monkeypatch.setenv("SLURM_NTASKS", str(nodes * per_node))
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", str(per_node))
    monkeypatch.setenv("SLURM_NODEID", str(node))
    monkeypatch.setenv("SLURM_LOCALID", str(local))
    monkeypatch.setenv("SLURM_PROCID", str(node * per_node + local))
    # the example's trainer on CPU (no GPUs here), same devices and nodes
    overrides = [o.replace("trainer=fsdp", f"trainer={strategy}") for o in overrides if not o.startswith("run.dir=")]
    cfg = load_config(overrides=[*overrides, "trainer.accelerator=cpu", f"run.dir={tmp_path}"])
    assert (cfg.trainer.devices, cfg.trainer.num_nodes) == (per_node, nodes)
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as pytorch_rank_zero
    from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero

    for rank_zero in (fabric_rank_zero, pytorch_rank_zero, utilities_rank_zero):  # the strategy sets them to rank 11
        monkeypatch.setattr(rank_zero, "rank", rank_zero.rank)
    trainer = build_trainer(cfg, callbacks=[])
    environment = trainer.strategy.cluster_environment
    assert type(environment).__name__ == "SLURMEnvironment" and not environment.auto_requeue  # GracefulInterrupt's
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank) == (node * per_node + local, local, node)
    assert trainer.world_size == nodes * per_node
    assert environment.main_address == "gpu07"  # the first host of the allocation, for every task
