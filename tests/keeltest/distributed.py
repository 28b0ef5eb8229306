"""Distributed tests' helpers: a gloo group joined in-process with its global batches, a sharded checkpoint
written by one process, and `keel pretrain` launched on 2 CPU processes with each rank's batches recorded.

`keel pretrain` runs go through subprocesses: Lightning starts the other rank by re-running the command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from keel.checkpoint.layout import SHARDED_META
from keel.config import load_config, to_dict
from keel.model import KeelLM
from keeltest import QUIET_TRAINER, TINY_MODEL

WORLD = 2
STEPS = 4  # optimizer steps of the in-process comparison
GLOBAL_BATCH = 8  # sequences per step, split evenly over the ranks
LR, CLIP = 1e-2, 0.05  # CLIP below the gradient norm, so that clipping acts on every step


def _tiny_cfg(*extra: str):
    return load_config(overrides=[*TINY_MODEL, "trainer.accelerator=cpu", "trainer.compile=false", *extra])


def _batches() -> torch.Tensor:
    """(STEPS, GLOBAL_BATCH, seq_len + 1) token ids, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 512, (STEPS, GLOBAL_BATCH, 33), generator=generator)


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


def end_worker() -> None:
    """End a spawned evaluation worker once its results are on disk: both ranks out of the last collective, the
    group torn down, then the process ended without the interpreter's finalization. A gloo work object still held
    at exit (lm-eval's and FSDP's last collectives) was destroyed during finalization and aborted the process about
    1 full suite in 8, after the results were written ("terminate called without an active exception"; the same
    abort as pytorch/pytorch#179291 describes); this worker has nothing left to finalize."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _sharded_checkpoint(path: Path, *overrides: str):
    """A sharded checkpoint laid out as the FSDP strategy writes it (one process standing in for the ranks): the
    weights and the optimizer state as tensors, the optimizer's param_groups as byte entries (pickles)."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    cfg = _tiny_cfg(*overrides)
    model = KeelLM(cfg.model)
    optimizer = get_optimizer_state_dict(model, torch.optim.AdamW(model.parameters()))
    save(
        {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "optimizer_0": optimizer},
        checkpoint_id=path,
        no_dist=True,
    )
    torch.save({"keel": {"config": to_dict(cfg), "tokenizer_json": None}, "global_step": 3}, path / SHARDED_META)
    return model, cfg


LAUNCHER = """
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
code = cli.main(sys.argv[1:])
if "KEEL_TEST_RECORD" in os.environ:  # whether this process left training with its process group still up
    import torch.distributed as dist
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    Path(os.environ["KEEL_TEST_RECORD"] + f"-exit-rank{rank}.txt").write_text(str(dist.is_initialized()))
sys.exit(code)
"""


RUN = [
    *TINY_MODEL,
    *QUIET_TRAINER,
    "eval.enabled=false",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.max_steps=8",
    "trainer.checkpoint_every_n_steps=4",
    "trainer.val_every_n_steps=4",
    "trainer.val_batches=2",
    "optim.warmup_steps=2",
    f"optim.grad_clip={CLIP}",
    "callbacks.grad_norms.every_n_steps=1",
]


def _command(tiny_data, run_dir: Path, strategy: str, overrides=(), launcher=(sys.executable,)) -> list[str]:
    script = run_dir.parent / "launch.py"
    script.write_text(LAUNCHER)
    return [
        *launcher,
        str(script),
        "pretrain",
        f"trainer={strategy}",
        *RUN,
        *tiny_data,
        f"run.dir={run_dir}",
        *overrides,
    ]


def _env(run_dir: Path, attempt: str, crash_at: int | None = None) -> dict[str, str]:
    crash = {"KEEL_TEST_CRASH_AT": str(crash_at)} if crash_at is not None else {}
    return {**os.environ, "KEEL_TEST_RECORD": str(run_dir.parent / "seen" / attempt), **crash}


def pretrain(
    tiny_data, run_dir: Path, strategy: str, crash_at: int | None = None, overrides=(), attempt: str = "run"
) -> None:
    """`keel pretrain trainer=<strategy>` on 2 CPU processes (unless overrides say otherwise), Lightning launching
    the others (it re-runs the command, so every rank gets the recording and crash callbacks); each rank's
    batches are saved under the name `attempt` (seen())."""
    cmd = _command(tiny_data, run_dir, strategy, overrides)
    exits = run_dir.parent / "seen"
    for stale in exits.glob(f"{attempt}-exit-rank*.txt"):
        stale.unlink()
    done = subprocess.run(cmd, env=_env(run_dir, attempt, crash_at), capture_output=True, text=True, timeout=900)
    if crash_at is None:
        assert done.returncode == 0, done.stderr[-3000:]
        # every process destroyed the process group training made (left to exit, gloo's aborts some: keel.training)
        processes = next((int(o.split("=")[1]) for o in overrides if o.startswith("trainer.devices=")), WORLD)
        left_up = {path.name: path.read_text() for path in exits.glob(f"{attempt}-exit-rank*.txt")}
        assert sorted(left_up.values()) == ["False"] * processes, left_up
    else:
        assert done.returncode != 0 and "simulated crash" in done.stderr, done.stderr[-3000:]


def seen(run_dir: Path, attempt: str = "run") -> list[tuple[int, tuple[int, ...]]]:
    """(step, token ids) of every sequence any rank trained on in one launch of pretrain()."""
    records = []
    for path in sorted((run_dir.parent / "seen").glob(f"{attempt}-rank*.pt")):
        records += [(step, tuple(row.tolist())) for step, batch in torch.load(path) for row in batch]
    return records
