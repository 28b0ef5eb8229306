"""Work shared among processes (gloo, CPU): the shards' sha256 hashed once per node, the in-loop downstream
evaluation split among DDP ranks, and litdata's chunks dealt out over two nodes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from keel.config import load_config
from keel.errors import ConfigError
from keeltest import QUIET_TRAINER, TINY_MODEL
from keeltest.distributed import end_worker

WORLD = 2


def _shards_copy(tiny_data, tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of the tiny shards (to damage) and the data.* overrides that select it."""
    source = Path(next(o for o in tiny_data if o.startswith("data.dir=")).split("=", 1)[1])
    copy = tmp_path / "shards"
    shutil.copytree(source, copy)
    return copy, [*tiny_data, f"data.dir={copy}"]


def _verify_worker(rank: int, port: int, data: list[str], out: str) -> None:
    """Verify the shards as the data module does, then again after rank 0 damaged the val chunk (rank 1's share)."""
    from keel.data import shards
    from keel.data.loading import open_dataset, verify_checksums_shared

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    hashed = []
    original = shards._file_sha256

    def counting(fs, path):
        hashed.append("/".join(Path(path).parts[-2:]))
        return original(fs, path)

    shards._file_sha256 = counting
    cfg = load_config(
        overrides=[*TINY_MODEL, *data, "trainer=ddp", "trainer.accelerator=cpu", f"trainer.devices={WORLD}"]
    )
    dataset = open_dataset(cfg)  # sizes only: the processes hash once joined
    result = {"at_open": list(hashed)}
    for attempt in ("intact", "damaged"):
        if attempt == "damaged":
            dist.barrier()
            if rank == 0:
                chunk = Path(cfg.data.dir) / "val" / "chunk-0-0.bin"
                original_bytes = chunk.read_bytes()
                chunk.write_bytes(original_bytes[:-1] + bytes([original_bytes[-1] ^ 1]))
            dist.barrier()
        try:
            verify_checksums_shared(cfg, dataset.manifest, rank, torch.device("cpu"))
            result[attempt] = None
        except ConfigError as err:
            result[attempt] = str(err)
        result.setdefault("hashed", list(hashed))  # by the intact verification
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_ranks_of_a_node_hash_disjoint_shares_and_all_refuse_a_corrupt_chunk(tiny_data, tmp_path):
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    shards, data = _shards_copy(tiny_data, tmp_path)
    mp.spawn(_verify_worker, args=(find_free_network_port(), data, str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    assert [r["at_open"] for r in ranks] == [[], []]  # open_dataset hashed nothing under 2 processes
    assert [r["hashed"] for r in ranks] == [["train/chunk-0-0.bin"], ["val/chunk-0-0.bin"]]  # one chunk each
    assert [r["intact"] for r in ranks] == [None, None]
    for r in ranks:  # the val chunk, hashed by rank 1 alone: rank 0 refuses it too, by name
        assert f"{shards}/val/chunk-0-0.bin is corrupt (its sha256 is not the one in manifest.json)" in r["damaged"]


@pytest.mark.extended
@pytest.mark.slow
def test_pretrain_on_two_processes_refuses_a_corrupt_chunk(tiny_data, tmp_path):
    shards, data = _shards_copy(tiny_data, tmp_path)
    chunk = shards / "train" / "chunk-0-0.bin"
    original = chunk.read_bytes()
    chunk.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    cmd = [
        sys.executable,
        "-m",
        "keel.cli",
        "pretrain",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        f"trainer.devices={WORLD}",
        *TINY_MODEL,
        *QUIET_TRAINER,
        *data,
        "eval.enabled=false",
        "trainer.max_steps=1",
        "trainer.val_batches=1",
        f"run.dir={tmp_path / 'run'}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{shards}/train/chunk-0-0.bin is corrupt" in done.stderr


# ------------------------------------------------------------------------- in-loop evaluation shared among ranks

EVAL_TASKS = ["keel_next_line", "keel_last_token"]
EVAL_LIMIT = 16


def _eval_model(data_dir: str):
    from keel.model import KeelLM

    torch.manual_seed(0)
    cfg = load_config(overrides=[*TINY_MODEL, f"data.dir={data_dir}"])
    return KeelLM(cfg.model).eval(), (Path(data_dir) / "tokenizer.json").read_text()


def _scores(distributed: bool, data_dir: str) -> tuple[dict, int]:
    """The tasks' metrics and how many requests this process scored."""
    from keel.evaluation import KeelEvalLM, load_tasks, run_tasks

    model, tokenizer_json = _eval_model(data_dir)
    lm = KeelEvalLM(model=model, tokenizer_json=tokenizer_json, batch_size=8, distributed=distributed)
    scored = []
    score = lm._score
    lm._score = lambda pieces, disable_tqdm: scored.append(len(pieces)) or score(pieces, disable_tqdm)
    tasks = load_tasks(EVAL_TASKS, corpus_dir=data_dir)
    return run_tasks(lm, tasks, limit=EVAL_LIMIT), sum(scored)


def _eval_worker(rank: int, port: int, data_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.save(_scores(True, data_dir), Path(out) / f"eval{rank}.pt")
    end_worker()


def test_evaluation_under_ddp_splits_the_requests_and_gives_one_process_metrics(tiny_data, tmp_path):
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    data_dir = next(o for o in tiny_data if o.startswith("data.dir=")).split("=", 1)[1]
    alone, requests = _scores(False, data_dir)
    mp.spawn(_eval_worker, args=(find_free_network_port(), data_dir, str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"eval{rank}.pt") for rank in range(WORLD)]
    assert requests > 0
    for metrics, scored in ranks:
        assert metrics.keys() == alone.keys() == set(EVAL_TASKS)
        for task in EVAL_TASKS:  # every rank gets the metrics over all the documents
            assert metrics[task] == pytest.approx(alone[task], rel=1e-6), task
        assert abs(scored - requests / WORLD) <= 0.1 * requests  # about half the requests each
    assert sum(scored for _, scored in ranks) >= requests  # padded to as many on every rank, never fewer


@pytest.mark.extended
@pytest.mark.slow
def test_in_loop_evaluation_of_a_ddp_run_scores_like_one_process(tiny_data, tmp_path):
    """`keel pretrain trainer=ddp` on 2 processes with the downstream callback: its last evaluation (after the last
    step) has the scores one process gives the final checkpoint."""
    import json

    from keel.checkpoint.layout import LAST
    from keel.evaluation import KeelEvalLM, load_tasks, run_tasks
    from keeltest.distributed import pretrain

    run = tmp_path / "run"
    pretrain(
        tiny_data,
        run,
        "ddp",
        overrides=["eval.enabled=true", "eval.every_n_steps=4", f"eval.limit={EVAL_LIMIT}", "eval.batch_size=8"],
    )
    history = json.loads((run / "eval_history.json").read_text())["evaluations"]
    assert [e["step"] for e in history] == [3, 7]
    data_dir = next(o for o in tiny_data if o.startswith("data.dir=")).split("=", 1)[1]
    lm = KeelEvalLM(checkpoint=str(run / "checkpoints" / LAST), device="cpu", batch_size=8)
    alone = run_tasks(lm, load_tasks(EVAL_TASKS, corpus_dir=data_dir), limit=EVAL_LIMIT)
    for task in EVAL_TASKS:
        assert history[-1]["scores"][task] == pytest.approx(alone[task], rel=1e-5), task


# ----------------------------------------------------------------- two nodes of two processes: litdata's node split

NODES_LAUNCHER = """
import os, sys
from pathlib import Path
import torch
from lightning.pytorch.callbacks import Callback
from keel import cli, training

class Record(Callback):  # this rank's sequences, and the node count litdata dealt them out by
    def __init__(self):
        self.seen = []
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(batch.clone())
        nodes = trainer.train_dataloader.dataset.distributed_env.num_nodes
        torch.save({"nodes": nodes, "seen": torch.cat(self.seen)},
                   Path(os.environ["KEEL_TEST_RECORD"]) / f"rank{trainer.global_rank}.pt")

configured = training.build_callbacks
training.build_callbacks = lambda cfg, dataset: [*configured(cfg, dataset), Record()]
sys.exit(cli.main(sys.argv[1:]))
"""
STEPS = 4


@pytest.mark.extended
@pytest.mark.slow
def test_two_nodes_of_two_processes_read_disjoint_sequences(tiny_data, tmp_path):
    """Two torchrun "nodes" on 127.0.0.1 with 2 processes each: litdata deals the chunks out over 2 nodes (its
    num_nodes > 1 branch, which on CPU it takes only when told the node count) and the 4 ranks train on
    disjoint sequences."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    launcher, record = tmp_path / "launch.py", tmp_path / "seen"
    launcher.write_text(NODES_LAUNCHER)
    record.mkdir()
    port, nodes = find_free_network_port(), []
    for node_rank in range(2):
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=2",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
        ]
        cmd = [
            *torchrun,
            str(launcher),
            "pretrain",
            "trainer=ddp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.num_nodes=2",
            *TINY_MODEL,
            *QUIET_TRAINER,
            *tiny_data,
            "eval.enabled=false",
            "trainer.micro_batch_size=1",  # 4 validation sequences in all: the tiny val split may hold ~15
            f"trainer.max_steps={STEPS}",
            f"trainer.val_every_n_steps={STEPS}",
            "trainer.val_batches=1",
            f"trainer.checkpoint_every_n_steps={STEPS}",
            f"run.dir={tmp_path / 'run'}",
        ]
        nodes.append(
            subprocess.Popen(
                cmd,
                env={**os.environ, "KEEL_TEST_RECORD": str(record)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    errors = [node.communicate(timeout=900)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(error[-3000:] for error in errors)
    ranks = [torch.load(record / f"rank{rank}.pt") for rank in range(2 * WORLD)]
    assert [r["nodes"] for r in ranks] == [2] * 4
    sequences = [{tuple(row.tolist()) for row in r["seen"]} for r in ranks]
    assert [len(s) for s in sequences] == [STEPS] * 4  # one sequence a step, none twice
    assert len(set().union(*sequences)) == 4 * STEPS  # no sequence on two ranks
