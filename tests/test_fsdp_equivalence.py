"""FSDP2 and HSDP in-process (gloo, CPU processes) against one process on the same global batches: losses, gradient
norms under sharding, clipping and updates."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from keel.callbacks.grad_norms import GradNormMonitor
from keel.model import KeelLM, next_token_loss
from keel.parallel import deferred_gradient_reduction, parallelize
from keeltest.distributed import CLIP, LR, STEPS, WORLD, _batches, _join, _tiny_cfg


def _plain_head_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """The loss from the full logits, whatever model.loss_chunk says."""
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def _train(model, batches, reduce_loss, loss_fn=_plain_head_loss, accumulate=None) -> dict:
    """AdamW steps with global-norm clipping, as in training; the loss and gradient norms seen at each step.
    accumulate: each step's batch as two micro-batches, the first's backward within accumulate() (Lightning's
    block_backward_sync), as training with trainer.grad_accum=2 runs it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    monitor = GradNormMonitor()
    monitor.on_fit_start(None, SimpleNamespace(model=model))  # it only reads pl_module.model
    losses, clip_norms, grad_norms = [], [], []
    for batch in batches:
        if accumulate is None:
            loss = loss_fn(model, batch)
            loss.backward()
        else:
            first, last = batch.chunk(2)
            with accumulate():
                first_loss = loss_fn(model, first) / 2
                first_loss.backward()
            last_loss = loss_fn(model, last) / 2
            last_loss.backward()
            loss = first_loss + last_loss  # the step's loss (both halves' grads are gone): for the comparison
        grad_norms.append(monitor.norms())
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        clip_norms.append((total.full_tensor() if isinstance(total, DTensor) else total).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(reduce_loss(loss.detach()))
    return {"loss": losses, "clip_norm": clip_norms, "grad_norms": grad_norms}


def _fsdp_worker(rank: int, port: int, out: str) -> None:
    mesh, batches, global_mean = _join(rank, port, WORLD)
    results = {}
    for checkpointing in ("false", "true"):  # activation checkpointing recomputes on the gathered block
        cfg = _tiny_cfg("trainer.precision=32-true", f"trainer.activation_checkpointing={checkpointing}")
        torch.manual_seed(0)
        with torch.device("meta") if rank > 0 else nullcontext():  # rank 0's weights reach rank 1 (training does so)
            model = KeelLM(cfg.model)
        parallelize(model, cfg.trainer, mesh)
        results[checkpointing] = _train(model, batches, global_mean)
    for tied in ("false", "true"):  # the meta-device build: bit for bit the weights and RoPE tables of an eager one
        cfg = _tiny_cfg("trainer.precision=32-true", f"model.tie_embeddings={tied}")
        torch.manual_seed(0)
        eager = KeelLM(cfg.model)
        torch.manual_seed(0)
        with torch.device("meta") if rank > 0 else nullcontext():
            model = KeelLM(cfg.model)
        parallelize(model, cfg.trainer, mesh)
        full = {
            name: t.full_tensor() if isinstance(t, DTensor) else t
            for name, t in model.state_dict(keep_vars=False).items()
        }
        results[f"meta_build_tied_{tied}"] = {
            "same_weights": full.keys() == eager.state_dict().keys()
            and all(torch.equal(full[name], t) for name, t in eager.state_dict().items()),
            "same_rope": torch.equal(model.rope_cos, eager.rope_cos) and torch.equal(model.rope_sin, eager.rope_sin),
            "tied": model.head.weight is model.embed.weight,
        }
    # two micro-batches per step: the first's gradients reduced with the second's (trainer.reduce_every_micro_batch
    # false: no communication until the last; true: reduce-scattered each time), as if reduced every time
    for reduce_scatter in (False, True):
        cfg = _tiny_cfg("trainer.precision=32-true")
        torch.manual_seed(0)
        model = KeelLM(cfg.model)
        parallelize(model, cfg.trainer, mesh)
        results[f"accumulated_reduce_scatter_{reduce_scatter}"] = _train(
            model,
            batches,
            global_mean,
            accumulate=lambda model=model, reduce_scatter=reduce_scatter: deferred_gradient_reduction(
                model, reduce_scatter
            ),
        )
    # the chunked loss head (3 chunks per rank: 4 x 32 tokens) on the sharded head weight, against the plain head
    cfg = _tiny_cfg("trainer.precision=32-true", "model.loss_chunk=48")
    torch.manual_seed(0)
    model = KeelLM(cfg.model)
    parallelize(model, cfg.trainer, mesh)
    assert isinstance(model.head.weight, DTensor)
    results["chunked"] = _train(model, batches, global_mean, next_token_loss)
    results["local"] = sum(p.to_local().numel() for p in model.parameters())
    results["total"] = sum(p.numel() for p in model.parameters())

    # bf16-mixed: blocks compute with bf16 copies, yet receive the fp32 residual stream
    cfg = _tiny_cfg("trainer.precision=bf16-mixed")
    model = KeelLM(cfg.model)
    parallelize(model, cfg.trainer, mesh)
    seen = results["bf16_seen"] = []
    model.blocks[1].register_forward_pre_hook(
        lambda block, args: seen.append((args[0].dtype, block.ffn.branch.up.weight.dtype))
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batches[0, :, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), batches[0, :, 1:].flatten()).backward()
    results["bf16_grad_dtypes"] = {p.grad.dtype for p in model.parameters()}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_fsdp_matches_one_process_on_the_same_global_batches(tmp_path):
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    mp.spawn(_fsdp_worker, args=(find_free_network_port(), str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    torch.manual_seed(0)
    reference = _train(KeelLM(_tiny_cfg().model), _batches(), lambda loss: loss.item())
    assert all(norm > CLIP for norm in reference["clip_norm"])  # clipping acted
    # activation checkpointing off, on; the chunked loss head; two micro-batches a step, reduced once or twice
    for run in ("false", "true", "chunked", "accumulated_reduce_scatter_False", "accumulated_reduce_scatter_True"):
        fsdp = ranks[0][run]
        assert fsdp["loss"] == pytest.approx(reference["loss"], rel=1e-5), run
        assert fsdp["clip_norm"] == pytest.approx(reference["clip_norm"], rel=1e-5)
        for step in range(STEPS):  # the grad-norm callback's DTensor-aware norms
            assert fsdp["grad_norms"][step].keys() == reference["grad_norms"][step].keys()
            assert fsdp["grad_norms"][step] == pytest.approx(reference["grad_norms"][step], rel=1e-5)
        assert ranks[1][run] == fsdp  # every rank saw the same global values
    # each rank holds about half of every parameter (dim 0 split; odd sizes round up on rank 0)
    assert sum(r["local"] for r in ranks) == ranks[0]["total"]
    assert all(abs(r["local"] / r["total"] - 1 / WORLD) < 0.02 for r in ranks)
    for tied in (False, True):  # rank 1 built on the meta device holds exactly the eager build's model
        assert [r[f"meta_build_tied_{str(tied).lower()}"] for r in ranks] == [
            {"same_weights": True, "same_rope": True, "tied": tied}
        ] * WORLD
    assert ranks[0]["bf16_seen"] == [(torch.float32, torch.bfloat16)]  # fp32 stream in, bf16 weights gathered
    assert ranks[0]["bf16_grad_dtypes"] == {torch.float32}  # reduced and kept in fp32


HSDP_NODES, HSDP_DEVICES = 2, 2


def _hsdp_worker(rank: int, port: int, out: str) -> None:
    """trainer.hsdp: 2 "nodes" x 2 processes, each parameter sharded within a node and replicated across."""
    lightnings, batches, global_mean = _join(rank, port, HSDP_NODES * HSDP_DEVICES)
    cfg = _tiny_cfg(
        "trainer.precision=32-true",
        "trainer.strategy=fsdp",
        "trainer.hsdp=true",
        f"trainer.num_nodes={HSDP_NODES}",
        f"trainer.devices={HSDP_DEVICES}",
    )
    torch.manual_seed(0)
    with torch.device("meta") if rank > 0 else nullcontext():
        model = KeelLM(cfg.model)
    parallelize(model, cfg.trainer, lightnings)
    weight = model.blocks[0].attn.branch.qkv.weight
    results = _train(model, batches, global_mean)
    results["placements"] = [(type(p).__name__, getattr(p, "dim", None)) for p in weight.placements]
    results["local_rows"] = (weight.to_local().shape[0], weight.shape[0])
    for reduce_scatter in (False, True):  # two micro-batches a step: nothing, or the all-reduce alone, deferred
        torch.manual_seed(0)
        with torch.device("meta") if rank > 0 else nullcontext():
            model = KeelLM(cfg.model)
        parallelize(model, cfg.trainer, lightnings)
        results[f"accumulated_reduce_scatter_{reduce_scatter}"] = _train(
            model,
            batches,
            global_mean,
            accumulate=lambda model=model, reduce_scatter=reduce_scatter: deferred_gradient_reduction(
                model, reduce_scatter
            ),
        )
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.extended
def test_hsdp_matches_one_process_on_the_same_global_batches(tmp_path):
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    mp.spawn(_hsdp_worker, args=(find_free_network_port(), str(tmp_path)), nprocs=HSDP_NODES * HSDP_DEVICES)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(HSDP_NODES * HSDP_DEVICES)]
    torch.manual_seed(0)
    reference = _train(KeelLM(_tiny_cfg().model), _batches(), lambda loss: loss.item())
    hsdp = ranks[0]
    assert hsdp["placements"] == [("Replicate", None), ("Shard", 0)]  # replicated over nodes, sharded within one
    rows, total = hsdp["local_rows"]
    assert rows == total // HSDP_DEVICES  # half of each parameter per process: a node's 2 processes share it
    assert hsdp["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert hsdp["clip_norm"] == pytest.approx(reference["clip_norm"], rel=1e-5)  # no double count of replicas
    for step in range(STEPS):
        assert hsdp["grad_norms"][step] == pytest.approx(reference["grad_norms"][step], rel=1e-5)
    assert all(r["loss"] == hsdp["loss"] and r["clip_norm"] == hsdp["clip_norm"] for r in ranks)
    for reduce_scatter in (False, True):
        accumulated = hsdp[f"accumulated_reduce_scatter_{reduce_scatter}"]
        assert accumulated["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert accumulated["clip_norm"] == pytest.approx(reference["clip_norm"], rel=1e-5)
