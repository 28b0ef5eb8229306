"""The in-loop evaluation on 2 gloo processes of an FSDP-sharded tiny model: each rank scores half of the requests,
the metrics are one process's, and every rank runs as many forwards (each gathers the shards from every rank, so a
rank that ran one more would wait forever) - with unequal numbers of batches, and generations that stop at different
steps."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lm_eval.api.instance import Instance

from keel.config import load_config
from keel.evaluation import KeelEvalLM, load_tasks, run_tasks
from keel.model import KeelLM
from keel.parallel import parallelize
from keeltest import TINY_MODEL
from keeltest.distributed import end_worker

WORLD = 2
TASKS = ["keel_next_line", "keel_last_token"]
LIMIT = 16  # documents per task: 8 per rank
TIMEOUT_S = 300  # a rank left waiting in a collective never returns: the test fails instead of hanging


def _model(data_dir: str, mesh=None) -> KeelLM:
    """The same weights in every process (rank 0's reach the others' shards under FSDP)."""
    cfg = load_config(
        overrides=[
            *TINY_MODEL,
            f"data.dir={data_dir}",
            "trainer.accelerator=cpu",
            "trainer.compile=false",
            "trainer.precision=32-true",
        ]
    )
    torch.manual_seed(0)
    model = KeelLM(cfg.model)
    if mesh is not None:
        parallelize(model, cfg.trainer, mesh)
    return model.eval()


def _scores(model: KeelLM, data_dir: str, distributed: bool) -> tuple[KeelEvalLM, dict]:
    """The adapter, and the tasks' metrics with the number of loglikelihood requests this process scored."""
    tokenizer_json = (Path(data_dir) / "tokenizer.json").read_text()
    lm = KeelEvalLM(model=model, tokenizer_json=tokenizer_json, batch_size=4, distributed=distributed)
    requests = []
    score = lm._loglikelihood_tokens
    lm._loglikelihood_tokens = lambda reqs, disable_tqdm=False: requests.append(len(reqs)) or score(reqs, True)
    metrics = run_tasks(lm, load_tasks(TASKS, corpus_dir=data_dir), limit=LIMIT, progress_bars=False)
    lm._loglikelihood_tokens = score
    return lm, {"metrics": metrics, "requests": sum(requests)}


def _uneven_requests(rank: int) -> tuple[list[Instance], list[Instance]]:
    """This rank's loglikelihood and generate_until requests: rank 0 has 3 (1 batch) and 1 generation of 2 tokens,
    rank 1 has 13 (4 batches) and 3 generations of 9 tokens."""
    scored = [
        Instance("loglikelihood", {}, (f"def f{i}(x):", f"\n    return x + {i}"), i)
        for i in range(3 if rank == 0 else 13)
    ]
    gen_kwargs = {"until": [], "max_gen_toks": 2 if rank == 0 else 9}
    generated = [
        Instance("generate_until", {}, (f"import os{i}\n", gen_kwargs), i) for i in range(1 if rank == 0 else 3)
    ]
    return scored, generated


def _worker(rank: int, port: int, data_dir: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = _model(data_dir, mesh)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    lm, result = _scores(model, data_dir, distributed=True)
    result["task_forwards"] = len(forwards)
    scored, generated = _uneven_requests(rank)
    result["loglikelihood"] = lm.loglikelihood(scored, disable_tqdm=True)
    result["generated"] = lm.generate_until(generated, disable_tqdm=True)
    result["forwards"] = len(forwards)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    end_worker()


def test_split_evaluation_of_a_sharded_model_equals_one_process(tiny_data, tmp_path):
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    data_dir = next(o for o in tiny_data if o.startswith("data.dir=")).split("=", 1)[1]
    processes = mp.start_processes(
        _worker,
        args=(find_free_network_port(), data_dir, str(tmp_path)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not processes.join(timeout=5):
        if time.monotonic() > deadline:
            for process in processes.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {TIMEOUT_S} s: a collective left waiting")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]

    alone, expected = _scores(_model(data_dir), data_dir, distributed=False)
    metrics = expected["metrics"]
    for rank, result in enumerate(ranks):
        assert result["requests"] * WORLD == expected["requests"] > 0  # half of the requests each
        assert result["metrics"].keys() == metrics.keys() == set(TASKS)
        for task in TASKS:
            assert result["metrics"][task].keys() == metrics[task].keys()
            for name, value in metrics[task].items():  # every rank has the metrics over all the documents
                assert result["metrics"][task][name] == pytest.approx(value, rel=1e-6, abs=1e-6), (rank, task, name)
        scored, generated = _uneven_requests(rank)
        for (logprob, greedy), (one_logprob, one_greedy) in zip(result["loglikelihood"], alone.loglikelihood(scored)):
            assert logprob == pytest.approx(one_logprob, rel=1e-6, abs=1e-6) and greedy == one_greedy
        assert result["generated"] == alone.generate_until(generated)
    assert ranks[0]["task_forwards"] == ranks[1]["task_forwards"] > 0
    assert ranks[0]["forwards"] == ranks[1]["forwards"]  # rank 0 ran idle forwards for rank 1's extra work
