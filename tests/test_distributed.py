"""Distributed training on CPU (gloo, 2 processes): FSDP2 against one process and against DDP, gradient
norms under sharding, sharded checkpoints (atomic, exact resume, consolidation) and the strategy
combinations refused.

`keel pretrain` runs go through subprocesses: Lightning starts the other rank by re-running the command.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import nullcontext
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from keel.callbacks.grad_norms import GradNormMonitor
from keel.checkpoint import (
    LAST,
    SHARDED_META,
    check_resumable,
    commit_dir,
    load_model,
    previous_path,
    read_checkpoint,
    resolve_resume,
    staging_path,
)
from keel.checkpoint import main as consolidate
from keel.cli import main as cli_main
from keel.config import load_config, to_dict
from keel.errors import ConfigError
from keel.model import KeelLM, next_token_loss
from keel.parallel import parallelize

from conftest import QUIET_TRAINER, TINY_MODEL
from test_pretrain import scalars

WORLD = 2
STEPS = 4  # optimizer steps of the in-process comparison
GLOBAL_BATCH = 8  # sequences per step, split evenly over the ranks
LR, CLIP = 1e-2, 0.05  # CLIP below the gradient norm, so that clipping acts on every step


# ------------------------------------------------------------------ FSDP2 in-process against one process


def _tiny_cfg(*extra: str):
    return load_config(overrides=[*TINY_MODEL, "trainer.accelerator=cpu", "trainer.compile=false", *extra])


def _batches() -> torch.Tensor:
    """(STEPS, GLOBAL_BATCH, seq_len + 1) token ids, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 512, (STEPS, GLOBAL_BATCH, 33), generator=generator)


def _plain_head_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """The loss from the full logits, whatever model.loss_chunk says."""
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def _train(model, batches, reduce_loss, loss_fn=_plain_head_loss) -> dict:
    """AdamW steps with global-norm clipping, as in training; the loss and gradient norms seen at each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    monitor = GradNormMonitor()
    monitor.on_fit_start(None, SimpleNamespace(model=model))  # it only reads pl_module.model
    losses, clip_norms, grad_norms = [], [], []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        grad_norms.append(monitor.norms())
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        clip_norms.append((total.full_tensor() if isinstance(total, DTensor) else total).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(reduce_loss(loss.detach()))
    return {"loss": losses, "clip_norm": clip_norms, "grad_norms": grad_norms}


def _join(rank: int, port: int, world: int):
    """This worker in a gloo group of `world`: the mesh Lightning's FSDP strategy builds, this rank's share of each
    global batch, and the full batch's loss from each rank's (the mean of equal shares)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    per_rank = GLOBAL_BATCH // world

    def global_mean(loss: torch.Tensor) -> float:
        dist.all_reduce(loss)
        return loss.item() / world

    return mesh, _batches()[:, rank * per_rank : (rank + 1) * per_rank], global_mean


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
        full = {name: t.full_tensor() if isinstance(t, DTensor) else t
                for name, t in model.state_dict(keep_vars=False).items()}
        results[f"meta_build_tied_{tied}"] = {
            "same_weights": full.keys() == eager.state_dict().keys()
            and all(torch.equal(full[name], t) for name, t in eager.state_dict().items()),
            "same_rope": torch.equal(model.rope_cos, eager.rope_cos) and torch.equal(model.rope_sin, eager.rope_sin),
            "tied": model.head.weight is model.embed.weight}
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
    model.blocks[1].register_forward_pre_hook(lambda block, args: seen.append((args[0].dtype, block.ffn.branch.up.weight.dtype)))
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
    for run in ("false", "true", "chunked"):  # activation checkpointing off, on; the chunked loss head
        fsdp = ranks[0][run]
        assert fsdp["loss"] == pytest.approx(reference["loss"], rel=1e-5)
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
            {"same_weights": True, "same_rope": True, "tied": tied}] * WORLD
    assert ranks[0]["bf16_seen"] == [(torch.float32, torch.bfloat16)]  # fp32 stream in, bf16 weights gathered
    assert ranks[0]["bf16_grad_dtypes"] == {torch.float32}  # reduced and kept in fp32


HSDP_NODES, HSDP_DEVICES = 2, 2


def _hsdp_worker(rank: int, port: int, out: str) -> None:
    """trainer.hsdp: 2 "nodes" x 2 processes, each parameter sharded within a node and replicated across."""
    lightnings, batches, global_mean = _join(rank, port, HSDP_NODES * HSDP_DEVICES)
    cfg = _tiny_cfg("trainer.precision=32-true", "trainer.strategy=fsdp", "trainer.hsdp=true",
                    f"trainer.num_nodes={HSDP_NODES}", f"trainer.devices={HSDP_DEVICES}")
    torch.manual_seed(0)
    with torch.device("meta") if rank > 0 else nullcontext():
        model = KeelLM(cfg.model)
    parallelize(model, cfg.trainer, lightnings)
    weight = model.blocks[0].attn.branch.qkv.weight
    results = _train(model, batches, global_mean)
    results["placements"] = [(type(p).__name__, getattr(p, "dim", None)) for p in weight.placements]
    results["local_rows"] = (weight.to_local().shape[0], weight.shape[0])
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


# ------------------------------------------------------------------------------ sharded checkpoint files


def _sharded_checkpoint(path: Path, *overrides: str):
    """A sharded checkpoint laid out as the FSDP strategy writes it (one process standing in for the ranks): the
    weights and the optimizer state as tensors, the optimizer's param_groups as byte entries (pickles)."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    cfg = _tiny_cfg(*overrides)
    model = KeelLM(cfg.model)
    optimizer = get_optimizer_state_dict(model, torch.optim.AdamW(model.parameters()))
    save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "optimizer_0": optimizer},
         checkpoint_id=path, no_dist=True)
    torch.save({"keel": {"config": to_dict(cfg), "tokenizer_json": None}, "global_step": 3}, path / SHARDED_META)
    return model, cfg


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # _sharded_checkpoint saves in one process
def test_consolidate_and_broken_sharded_checkpoints(tmp_path, capsys):
    sharded = tmp_path / "last.ckpt"
    model, cfg = _sharded_checkpoint(sharded)
    out = tmp_path / "model.ckpt"
    assert cli_main(["consolidate", str(sharded), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    for path in (out, sharded):  # load_model reads either
        loaded, loaded_cfg, _ = load_model(path)
        assert loaded_cfg == cfg
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    meta = read_checkpoint(sharded, weights=False)
    assert "state_dict" not in meta and meta["global_step"] == 3

    with pytest.raises(ConfigError, match="is a sharded .FSDP. checkpoint; resume it with trainer=fsdp"):
        check_resumable(cfg.trainer, sharded, meta)
    with pytest.raises(ConfigError, match="holds model weights only"):
        check_resumable(cfg.trainer, out, read_checkpoint(out))
    assert cli_main(["consolidate", str(out), str(tmp_path / "again.ckpt")]) == 2
    assert "not a sharded checkpoint directory" in capsys.readouterr().err

    (sharded / SHARDED_META).write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="is not a torch.save zip file"):
        read_checkpoint(sharded, weights=False)
    shard = next(sharded.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ConfigError, match=f"corrupt: shard file {shard.name} is missing or truncated"):
        read_checkpoint(sharded)
    for name in (SHARDED_META, ".metadata"):  # one of the two missing: a save was interrupted
        kept = (sharded / name).read_bytes()
        (sharded / name).unlink()
        with pytest.raises(ConfigError, match=rf"incomplete sharded checkpoint \(no {name}\)"):
            read_checkpoint(sharded)
        (sharded / name).write_bytes(kept)
    for name in (SHARDED_META, ".metadata"):
        (sharded / name).unlink()
    with pytest.raises(ConfigError, match="is not a checkpoint: it has no .metadata nor meta.pt"):
        read_checkpoint(sharded)


def test_sharded_commit_survives_a_crash_between_renames(tmp_path, monkeypatch):
    cfg = _tiny_cfg(f"run.dir={tmp_path}", "resume=auto")
    last = tmp_path / "checkpoints" / LAST
    for step, path in ((1, last), (2, staging_path(last))):
        path.mkdir(parents=True)
        torch.save({"step": step}, path / SHARDED_META)

    replace = os.replace
    calls = []

    def crash_on_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("killed")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second_rename)
    with pytest.raises(OSError, match="killed"):
        commit_dir(staging_path(last), last)
    monkeypatch.undo()
    assert not last.exists() and resolve_resume(cfg) == str(previous_path(last))  # the old one, intact
    assert torch.load(previous_path(last) / SHARDED_META) == {"step": 1}

    commit_dir(staging_path(last), last)  # the next save
    assert resolve_resume(cfg) == str(last) and torch.load(last / SHARDED_META) == {"step": 2}
    assert sorted(p.name for p in last.parent.iterdir()) == [LAST]


# ------------------------------------------------------------------------------- refused combinations


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer=fsdp", "trainer.accelerator=cpu"],
         "FSDP shards over >= 2 processes; on CPU use trainer.devices=2 or trainer=cpu"),
        (["trainer.accelerator=gpu"], "trainer.accelerator=gpu: no CUDA GPU is visible; use trainer=cpu"),
        (["trainer.strategy=single", "trainer.devices=2"], "runs one process, not trainer.devices x trainer.num_nodes = 2"),
        (["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=16-mixed"],
         "fp16 loss scaling does not work on FSDP shards; use trainer.precision=bf16-mixed"),
        (["trainer.num_nodes=2"], "start one launcher per node with torchrun or srun"),
        (["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.hsdp=true"],
         "trainer.hsdp: shards within each node and replicates across nodes: it needs trainer.strategy=fsdp "
         "(trainer=fsdp) and trainer.num_nodes > 1 (got strategy fsdp, 1 node(s))"),
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


# ---------------------------------------------------- `keel pretrain` with 2 processes: FSDP, DDP, resume

LAUNCHER = '''
import os, signal, sys
from pathlib import Path
import torch
from lightning.pytorch.callbacks import Callback
from keel import cli, training

class Record(Callback):  # the sequences this rank trains on, with the step each is for
    def __init__(self):
        self.seen = []
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.global_step, batch.clone()))
        path = Path(os.environ["KEEL_TEST_RECORD"] + f"-rank{trainer.global_rank}.pt")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.seen, path)

class Crash(Callback):  # a killed run: every rank stops before the step given
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == int(os.environ["KEEL_TEST_CRASH_AT"]):
            raise RuntimeError("simulated crash")

class Interrupt(Callback):  # Ctrl-C reaching rank 0 alone: the others must stop after the same step
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == int(os.environ["KEEL_TEST_INTERRUPT_AT"]) and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGINT)

extra = [Record()] if "KEEL_TEST_RECORD" in os.environ else []
extra += [Crash()] if "KEEL_TEST_CRASH_AT" in os.environ else []
extra += [Interrupt()] if "KEEL_TEST_INTERRUPT_AT" in os.environ else []
if extra:
    configured = training.build_callbacks
    training.build_callbacks = lambda cfg, dataset: [*configured(cfg, dataset), *extra]
sys.exit(cli.main(sys.argv[1:]))
'''
RUN = [*TINY_MODEL, *QUIET_TRAINER, "eval.enabled=false", "trainer.accelerator=cpu", "trainer.devices=2",
       "trainer.max_steps=8", "trainer.checkpoint_every_n_steps=4", "trainer.val_every_n_steps=4",
       "trainer.val_batches=2", "optim.warmup_steps=2", f"optim.grad_clip={CLIP}", "callbacks.grad_norms.every_n_steps=1"]


def _command(tiny_data, run_dir: Path, strategy: str, overrides=(), launcher=(sys.executable,)) -> list[str]:
    script = run_dir.parent / "launch.py"
    script.write_text(LAUNCHER)
    return [*launcher, str(script), "pretrain", f"trainer={strategy}", *RUN, *tiny_data, f"run.dir={run_dir}",
            *overrides]


def _env(run_dir: Path, attempt: str, crash_at: int | None = None) -> dict[str, str]:
    crash = {"KEEL_TEST_CRASH_AT": str(crash_at)} if crash_at is not None else {}
    return {**os.environ, "KEEL_TEST_RECORD": str(run_dir.parent / "seen" / attempt), **crash}


def pretrain(tiny_data, run_dir: Path, strategy: str, crash_at: int | None = None, overrides=(),
             attempt: str = "run") -> None:
    """`keel pretrain trainer=<strategy>` on 2 CPU processes (unless overrides say otherwise), Lightning launching
    the others (it re-runs the command, so every rank gets the recording and crash callbacks); each rank's
    batches are saved under the name `attempt` (seen())."""
    cmd = _command(tiny_data, run_dir, strategy, overrides)
    done = subprocess.run(cmd, env=_env(run_dir, attempt, crash_at), capture_output=True, text=True, timeout=900)
    if crash_at is None:
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        assert done.returncode != 0 and "simulated crash" in done.stderr, done.stderr[-3000:]


def seen(run_dir: Path, attempt: str = "run") -> list[tuple[int, tuple[int, ...]]]:
    """(step, token ids) of every sequence any rank trained on in one launch of pretrain()."""
    records = []
    for path in sorted((run_dir.parent / "seen").glob(f"{attempt}-rank*.pt")):
        records += [(step, tuple(row.tolist())) for step, batch in torch.load(path) for row in batch]
    return records


@pytest.fixture(scope="module")
def straight_runs(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted 8-step runs under FSDP and DDP, on the same data."""
    runs = {strategy: tmp_path_factory.mktemp(strategy) / "run" for strategy in ("fsdp", "ddp")}
    for strategy, run_dir in runs.items():
        pretrain(tiny_data, run_dir, strategy)
    return runs


@pytest.mark.slow
def test_fsdp_trains_like_ddp(straight_runs, tmp_path):
    fsdp, ddp = straight_runs["fsdp"], straight_runs["ddp"]
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
        assert sorted(p.name for p in (checkpoints / name).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                          SHARDED_META]
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
def test_resume_after_crash_matches_uninterrupted(tiny_data, straight_runs, tmp_path, strategy):
    run = tmp_path / "run"
    pretrain(tiny_data, run, strategy, crash_at=6)
    assert read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"] == 4
    pretrain(tiny_data, run, strategy)  # resume=auto: from step 4, replaying steps 4 and 5
    resumed, straight = scalars(run, "train/loss"), scalars(straight_runs[strategy], "train/loss")
    assert sorted(resumed) == list(range(8))
    assert resumed == straight  # bit for bit, every step
    assert scalars(run, "grad/global") == scalars(straight_runs[strategy], "grad/global")


@pytest.mark.extended
@pytest.mark.slow
def test_ctrl_c_on_rank_zero_stops_every_rank_after_the_same_step_and_resumes_exactly(tiny_data, straight_runs,
                                                                                    tmp_path):
    run = tmp_path / "run"
    launcher = run.parent / "launch.py"
    launcher.write_text(LAUNCHER)
    cmd = [sys.executable, str(launcher), "pretrain", "trainer=ddp", *RUN, *tiny_data, f"run.dir={run}"]
    done = subprocess.run(cmd, env={**os.environ, "KEEL_TEST_INTERRUPT_AT": "5"}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 130 and "interrupted: saved step 6 to " in done.stderr, done.stderr[-3000:]
    assert read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"] == 6
    pretrain(tiny_data, run, "ddp")  # resume=auto
    assert scalars(run, "train/loss") == scalars(straight_runs["ddp"], "train/loss")


@pytest.mark.extended
def test_init_from_under_fsdp_reaches_every_shard(tiny_data, tiny_run, tmp_path):
    """Only rank 0 builds the model for real and loads init_from; rank 1, built on the meta device, gets its
    shards from rank 0. After one step at a negligible LR the sharded checkpoint - rank 1's shards included -
    holds the source's weights."""
    source = tiny_run / "checkpoints" / LAST
    run = tmp_path / "run"
    pretrain(tiny_data, run, "fsdp", overrides=[f"init_from={source}", "trainer.max_steps=1", "optim.lr=1e-12",
                                                "optim.warmup_steps=1", "trainer.val_every_n_steps=1"])
    expected, _, _ = load_model(source)
    continued, _, _ = load_model(run / "checkpoints" / LAST)
    torch.testing.assert_close(continued.state_dict(), expected.state_dict(), rtol=0, atol=1e-9)


# ------------------------------------------------------------- two nodes: two torchrun launchers on loopback


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.extended), "fsdp",
                                      pytest.param("hsdp", marks=pytest.mark.extended)])
def test_two_nodes_train_like_one(tiny_data, straight_runs, tmp_path, strategy):
    """One process per "node", each node started by its own torchrun (static rendezvous on 127.0.0.1), as on a
    cluster: the same losses and sequences as one node running 2 processes. hsdp: trainer=fsdp trainer.hsdp=true,
    each node's one process holding whole parameters, replicated across the nodes (sharded checkpoints written)."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    run, port = tmp_path / "run", find_free_network_port()
    nodes = []
    trainer = "fsdp" if strategy == "hsdp" else strategy
    overrides = ["trainer.devices=1", "trainer.num_nodes=2", *(["trainer.hsdp=true"] if strategy == "hsdp" else [])]
    for node_rank in range(2):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                    f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}"]
        cmd = _command(tiny_data, run, trainer, overrides, launcher=torchrun)
        nodes.append(subprocess.Popen(cmd, env=_env(run, "run"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    errors = [node.communicate(timeout=900)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(error[-3000:] for error in errors)
    straight = straight_runs[trainer]
    assert sorted(seen(run)) == sorted(seen(straight))  # every rank, every step, the same sequences
    for tag in ("train/loss", "grad/global", "val/loss"):  # HSDP: all-reduced gradients, not reduce-scattered
        assert scalars(run, tag) == (scalars(straight, tag) if strategy != "hsdp"
                                     else pytest.approx(scalars(straight, tag), rel=1e-5)), tag
    if strategy == "hsdp":
        assert (run / "checkpoints" / LAST / ".metadata").is_file()


# ------------------------------------------------------------------ elastic resume: another number of processes

ELASTIC = {  # the straight runs' global batch of 8 sequences, split another way
    "ddp": ["trainer.devices=1", "trainer.grad_accum=2"],  # a single-file checkpoint: 2 processes -> 1
    "fsdp": ["trainer.devices=4", "trainer.micro_batch_size=2"],  # a sharded one, re-sharded: 2 processes -> 4
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.extended), "fsdp"])
def test_elastic_resume_continues_the_sample_stream(tiny_data, straight_runs, tmp_path, strategy):
    run = tmp_path / "run"
    pretrain(tiny_data, run, strategy, crash_at=6, attempt="before")  # checkpoint at step 4, on 2 processes
    pretrain(tiny_data, run, strategy, overrides=ELASTIC[strategy], attempt="after")
    before = [(step, sequence) for step, sequence in seen(run, "before") if step < 4]  # steps 4, 5 are redone
    after, straight = seen(run, "after"), seen(straight_runs[strategy])
    processes = int(ELASTIC[strategy][0].split("=")[1])
    assert len(list((tmp_path / "seen").glob("after-rank*.pt"))) == processes
    assert {step for step, _ in after} == {4, 5, 6, 7}  # resumed from step 4
    for step in range(8):  # each step trains on the uninterrupted run's global batch, sequence for sequence
        ours = sorted(sequence for s, sequence in before + after if s == step)
        assert len(ours) == 8 and ours == sorted(sequence for s, sequence in straight if s == step), step
    resumed, uninterrupted = scalars(run, "grad/global"), scalars(straight_runs[strategy], "grad/global")
    assert sorted(resumed) == list(range(8))
    # the global gradient is the same sum in another order: equal to float rounding (bit-equal for DDP here)
    assert [resumed[s] for s in range(4, 8)] == pytest.approx([uninterrupted[s] for s in range(4, 8)], rel=1e-5)
    # validation at the configured steps, though a step is now another number of Lightning batches
    assert scalars(run, "val/loss").keys() == scalars(straight_runs[strategy], "val/loss").keys() == {3, 7}


# ------------------------------------------------------------------------------------------------------ SLURM


def _sbatch_example() -> tuple[dict[str, str], list[str]]:
    """docs/distributed.md's sbatch script: its #SBATCH options and the overrides of its srun line."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    script = doc[doc.index("    #!/bin/bash"):].split("\n\n")[0]
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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # _sharded_checkpoint saves in one process
def test_resume_allows_another_split_of_the_global_batch_only(tmp_path):
    sharded = tmp_path / "last.ckpt"
    _sharded_checkpoint(sharded, "trainer=fsdp", "trainer.devices=2", "trainer.micro_batch_size=4")
    meta = read_checkpoint(sharded, weights=False)
    for split in (["trainer.devices=4", "trainer.micro_batch_size=2"],
                  ["trainer.devices=1", "trainer.micro_batch_size=4", "trainer.grad_accum=2"],
                  ["trainer.devices=2", "trainer.num_nodes=2", "trainer.micro_batch_size=2"]):
        check_resumable(_tiny_cfg("trainer=fsdp", *split).trainer, sharded, meta)  # 8 sequences per step
    with pytest.raises(ConfigError, match=r"trained with 2 process\(es\) x 4 sequences x 1 micro-batch\(es\) = 8 "
                       r"sequences per step; this config has 4 process\(es\) x 4 sequences x 1 micro-batch\(es\) = 16"):
        check_resumable(_tiny_cfg("trainer=fsdp", "trainer.devices=4", "trainer.micro_batch_size=4").trainer, sharded, meta)
