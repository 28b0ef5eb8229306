"""`keel pretrain` on 2 CPU processes: FSDP trains like DDP, exact resume after a crash or Ctrl-C on rank 0, init_from
under FSDP, two nodes, elastic restarts (Lightning starts the other rank by re-running the command)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml

from keel.checkpoint.consolidate import main as consolidate
from keel.checkpoint.layout import LAST, SHARDED_META
from keel.checkpoint.read import load_model, read_checkpoint
from keeltest.distributed import LAUNCHER, RUN, _command, _env, pretrain, seen
from keeltest.runs import scalars


@pytest.mark.slow
def test_fsdp_trains_like_ddp(straight_run, tmp_path):
    fsdp, ddp = straight_run("fsdp"), straight_run("ddp")
    losses = scalars(fsdp, "train/loss")
    assert sorted(losses) == list(range(8))
    assert losses == pytest.approx(scalars(ddp, "train/loss"), rel=1e-5)
    for tag in ("grad/global", "grad/attn/block_001", "grad/embed", "val/loss"):
        assert scalars(fsdp, tag) == pytest.approx(scalars(ddp, tag), rel=1e-5)

    assert len(list((fsdp / "tb").glob("events.*"))) == 1  # rank 0 alone logs
    assert (fsdp / "config.yaml").is_file()
    checkpoints = fsdp / "checkpoints"
    # the step-numbered history (keep_last_k=2) beside last.ckpt; no staging or previous copy left
    assert sorted(p.name for p in checkpoints.iterdir()) == [LAST, "step000004.ckpt", "step000008.ckpt"]
    for name in (LAST, "step000004.ckpt"):
        assert sorted(p.name for p in (checkpoints / name).iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            SHARDED_META,
        ]
    out = tmp_path / "fsdp.ckpt"
    assert consolidate([str(checkpoints / LAST), str(out)]) == 0
    sharded_model, _, _ = load_model(out)
    ddp_model, _, _ = load_model(ddp / "checkpoints" / LAST)
    # equal up to float rounding: the clipping norm is summed in another order (1 ulp), which AdamW amplifies
    # to ~1e-6 on embedding rows whose gradient is near 0 (update = m / (sqrt(v) + eps))
    torch.testing.assert_close(sharded_model.state_dict(), ddp_model.state_dict(), rtol=1e-5, atol=1e-5)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_resume_after_crash_matches_uninterrupted(tiny_data, straight_run, tmp_path, strategy):
    run = tmp_path / "run"
    pretrain(tiny_data, run, strategy, crash_at=6)
    assert read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"] == 4
    pretrain(tiny_data, run, strategy)  # resume=auto: from step 4, replaying steps 4 and 5
    resumed, straight = scalars(run, "train/loss"), scalars(straight_run(strategy), "train/loss")
    assert sorted(resumed) == list(range(8))
    assert resumed == straight  # bit for bit, every step
    assert scalars(run, "grad/global") == scalars(straight_run(strategy), "grad/global")


@pytest.mark.extended
@pytest.mark.slow
def test_ctrl_c_on_rank_zero_stops_every_rank_after_the_same_step_and_resumes_exactly(
    tiny_data, straight_run, tmp_path
):
    run = tmp_path / "run"
    launcher = run.parent / "launch.py"
    launcher.write_text(LAUNCHER)
    cmd = [sys.executable, str(launcher), "pretrain", "trainer=ddp", *RUN, *tiny_data, f"run.dir={run}"]
    done = subprocess.run(
        cmd, env={**os.environ, "KEEL_TEST_INTERRUPT_AT": "5"}, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 130 and "interrupted: saved step 6 to " in done.stderr, done.stderr[-3000:]
    assert read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"] == 6
    pretrain(tiny_data, run, "ddp")  # resume=auto
    assert scalars(run, "train/loss") == scalars(straight_run("ddp"), "train/loss")


@pytest.mark.extended
def test_init_from_under_fsdp_reaches_every_shard(tiny_data, tiny_run, tmp_path):
    """Only rank 0 builds the model for real and loads init_from; rank 1, built on the meta device, gets its
    shards from rank 0. After one step at a negligible LR the sharded checkpoint - rank 1's shards included -
    holds the source's weights."""
    source = tiny_run / "checkpoints" / LAST
    run = tmp_path / "run"
    pretrain(
        tiny_data,
        run,
        "fsdp",
        overrides=[
            f"init_from={source}",
            "trainer.max_steps=1",
            "optim.lr=1e-12",
            "optim.warmup_steps=1",
            "trainer.val_every_n_steps=1",
        ],
    )
    expected, _, _ = load_model(source)
    continued, _, _ = load_model(run / "checkpoints" / LAST)
    torch.testing.assert_close(continued.state_dict(), expected.state_dict(), rtol=0, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [pytest.param("ddp", marks=pytest.mark.extended), "fsdp", pytest.param("hsdp", marks=pytest.mark.extended)],
)
def test_two_nodes_train_like_one(tiny_data, straight_run, tmp_path, strategy):
    """One process per "node", each node started by its own torchrun (static rendezvous on 127.0.0.1), as on a
    cluster: the same losses and sequences as one node running 2 processes. hsdp: trainer=fsdp trainer.hsdp=true,
    each node's one process holding whole parameters, replicated across the nodes (sharded checkpoints written)."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    run, port = tmp_path / "run", find_free_network_port()
    nodes = []
    trainer = "fsdp" if strategy == "hsdp" else strategy
    overrides = ["trainer.devices=1", "trainer.num_nodes=2", *(["trainer.hsdp=true"] if strategy == "hsdp" else [])]
    for node_rank in range(2):
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
        ]
        cmd = _command(tiny_data, run, trainer, overrides, launcher=torchrun)
        nodes.append(
            subprocess.Popen(cmd, env=_env(run, "run"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
    errors = [node.communicate(timeout=900)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(error[-3000:] for error in errors)
    straight = straight_run(trainer)
    assert sorted(seen(run)) == sorted(seen(straight))  # every rank, every step, the same sequences
    for tag in ("train/loss", "grad/global", "val/loss"):  # HSDP: all-reduced gradients, not reduce-scattered
        assert scalars(run, tag) == (
            scalars(straight, tag) if strategy != "hsdp" else pytest.approx(scalars(straight, tag), rel=1e-5)
        ), tag
    if strategy == "hsdp":
        assert (run / "checkpoints" / LAST / ".metadata").is_file()


ELASTIC = {  # the straight runs' global batch of 8 sequences, split another way
    "ddp": ["trainer.devices=1", "trainer.grad_accum=2"],  # a single-file checkpoint: 2 processes -> 1
    "fsdp": ["trainer.devices=4", "trainer.micro_batch_size=2"],  # a sharded one, re-sharded: 2 processes -> 4
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.extended), "fsdp"])
def test_elastic_resume_continues_the_sample_stream(tiny_data, straight_run, tmp_path, strategy):
    run = tmp_path / "run"
    pretrain(tiny_data, run, strategy, crash_at=6, attempt="before")  # checkpoint at step 4, on 2 processes
    pretrain(tiny_data, run, strategy, overrides=ELASTIC[strategy], attempt="after")
    before = [(step, sequence) for step, sequence in seen(run, "before") if step < 4]  # steps 4, 5 are redone
    after, straight = seen(run, "after"), seen(straight_run(strategy))
    processes = int(ELASTIC[strategy][0].split("=")[1])
    assert len(list((tmp_path / "seen").glob("after-rank*.pt"))) == processes
    assert {step for step, _ in after} == {4, 5, 6, 7}  # resumed from step 4
    for step in range(8):  # each step trains on the uninterrupted run's global batch, sequence for sequence
        ours = sorted(sequence for s, sequence in before + after if s == step)
        assert len(ours) == 8 and ours == sorted(sequence for s, sequence in straight if s == step), step
    resumed, uninterrupted = scalars(run, "grad/global"), scalars(straight_run(strategy), "grad/global")
    assert sorted(resumed) == list(range(8))
    # the global gradient is the same sum in another order: equal to float rounding (bit-equal for DDP here)
    assert [resumed[s] for s in range(4, 8)] == pytest.approx([uninterrupted[s] for s in range(4, 8)], rel=1e-5)
    # validation at the configured steps, though a step is now another number of Lightning batches
    assert scalars(run, "val/loss").keys() == scalars(straight_run(strategy), "val/loss").keys() == {3, 7}


@pytest.mark.extended
@pytest.mark.slow
def test_fsdp_deferring_the_reduction_trains_like_reducing_every_micro_batch(tiny_data, tmp_path):
    """2 processes x 2 micro-batches a step: Lightning enters the strategy's block_backward_sync for the first
    micro-batch of each step, where FSDP reduces nothing (auto, on CPU: once per step) or reduce-scatters as usual
    (true); the same sequences and, within float rounding, the same gradients at every step."""
    runs = {}
    for reduce_every in ("auto", "true"):
        runs[reduce_every] = tmp_path / reduce_every
        pretrain(
            tiny_data,
            runs[reduce_every],
            "fsdp",
            attempt=reduce_every,
            overrides=[
                "trainer.micro_batch_size=2",
                "trainer.grad_accum=2",
                f"trainer.reduce_every_micro_batch={reduce_every}",
            ],
        )
    assert yaml.safe_load((runs["auto"] / "config.yaml").read_text())["trainer"]["reduce_every_micro_batch"] is False
    assert sorted(seen(runs["auto"], "auto")) == sorted(seen(runs["true"], "true"))
    deferred, every = scalars(runs["auto"], "grad/global"), scalars(runs["true"], "grad/global")
    assert sorted(deferred) == list(range(8))
    assert [deferred[s] for s in range(8)] == pytest.approx([every[s] for s in range(8)], rel=1e-5)
