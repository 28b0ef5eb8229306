"""What `keel pretrain` tells before and while it trains: --help, the model summary and run plan, a progress
bar over optimizer steps, and trainer.threads kept in every process of a DDP run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from keel.callbacks.progress import StepProgressBar
from keel.cli import main as cli_main
from keel.config import load_config
from keel.config.model import formulas
from keel.devices import set_threads
from keel.model import KeelLM
from keel.summary import run_summary
from keel.training import train
from keeltest import QUIET_TRAINER, TINY_MODEL
from keeltest.runs import tiny_config


def test_help_lists_the_config_groups_and_print_config_shows_the_new_keys(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["pretrain", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "model     paper_d128, paper_d256, paper_d512, paper_d64, tiny*" in out
    assert "trainer   cpu*, ddp, fsdp, gpu" in out and "eval      generated*, none, standard" in out
    assert "keel pretrain --print-config [overrides]` prints every key" in out
    assert (
        cli_main(
            [
                "pretrain",
                "--print-config",
                "init_from=runs/a/checkpoints/last.ckpt",
                "trainer.loggers=[csv,tensorboard]",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "init_from: runs/a/checkpoints/last.ckpt" in printed and "  loggers:\n  - csv\n  - tensorboard\n" in printed


@pytest.mark.parametrize(
    ("scheme", "alpha", "init"),
    [
        ("keel", "1 (2 sublayers), 8 (6 sublayers)", "normal"),
        ("preln", "1 (8 sublayers)", "gpt2"),
        ("deepnorm", "1.682 (8 sublayers)", "xavier"),
    ],
)
def test_summary_states_the_model_and_the_plan(scheme, alpha, init):
    cfg = load_config(
        overrides=[
            "model.depth=4",
            "model.width=64",
            "model.seq_len=64",
            "model.vocab_size=1000",
            f"model.scheme={scheme}",
            "trainer.max_steps=50",
            "trainer.micro_batch_size=2",
            "trainer.grad_accum=3",
        ]
    )
    model = KeelLM(cfg.model)
    lines = run_summary(cfg, model).splitlines()
    params, embedding = model.num_params(), 1000 * 64
    tokens = 50 * 2 * 3 * 64
    assert lines[0].startswith(f"model       {scheme}: depth 4 blocks (L = 8 sublayers), width 64")
    assert lines[1] == f"parameters  {params:,} ({params - embedding:,} non-embedding)"
    assert lines[2] == f"alpha       {alpha}"
    assert lines[3] == "sublayers   " + ", ".join(f"{formula} ({n})" for formula, n in formulas(cfg.model))
    assert lines[4].startswith(f"init        {init} ({scheme}'s own recipe, model.init=auto): ")
    assert lines[6].startswith(
        f"steps       50 x 384 tokens = {tokens:,} tokens ({tokens / params:.3g} tokens/parameter"
    )
    assert "precision 32-true, strategy single, world size 1" in lines[8]
    assert lines[8].endswith("torch.compile per block (compiled during the first steps)")  # trainer=cpu's default


def test_progress_bar_counts_optimizer_steps(tiny_data, tmp_path, capsys, monkeypatch):
    """Piped, a line per step (of 3 here); on a terminal, a bar."""
    run = tmp_path / "run"
    trainer = train(
        tiny_config(
            tiny_data,
            run,
            "trainer.max_steps=3",
            "trainer.grad_accum=2",
            "trainer.val_every_n_steps=3",
            "trainer.val_batches=1",
            "trainer.progress_bar=true",
        )
    )
    assert isinstance(trainer.progress_bar_callback, StepProgressBar)
    out = capsys.readouterr().out
    steps = [line.split(",")[0] for line in out.splitlines() if line.startswith("step ")]
    assert steps == ["step 1/3 (33%)", "step 2/3 (66%)", "step 3/3 (100%)"]  # 6 micro-batches, 3 steps
    assert out.count("parameters  57,536 (41,152 non-embedding)") == 1 and "start       fresh initialization" in out

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    trainer = train(
        tiny_config(
            tiny_data,
            run,
            "trainer.max_steps=5",
            "trainer.grad_accum=2",
            "trainer.val_every_n_steps=3",
            "trainer.val_batches=1",
            "trainer.progress_bar=true",
            "resume=auto",
        )
    )
    bar = trainer.progress_bar_callback.train_progress_bar
    # a resumed run's rate and ETA count its own steps only, from the end of its first (which restores, or compiles)
    assert (bar.initial, bar.n, bar.total) == (4, 5, 5)
    out = capsys.readouterr().out
    assert f"start       resuming {run / 'checkpoints' / 'last.ckpt'}" in out
    assert "step: 100%" in out and "/10" not in out


LAUNCHER = """
import json, os, sys, torch
from lightning.pytorch.callbacks import Callback
from keel import cli, training

class RecordThreads(Callback):  # once the launcher has started every rank
    def on_train_start(self, trainer, *args):
        with open(os.path.join(sys.argv[-1].split("=", 1)[1], f"threads{trainer.global_rank}.json"), "w") as f:
            json.dump(torch.get_num_threads(), f)

configured = training.build_callbacks
training.build_callbacks = lambda cfg, dataset: [*configured(cfg, dataset), RecordThreads()]
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.extended
@pytest.mark.slow
def test_threads_hold_in_every_ddp_process_and_rank_zero_alone_prints(tiny_data, tmp_path):
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    run = tmp_path / "run"
    run.mkdir()
    # without OMP_NUM_THREADS (Lightning resets threads then), and without what an in-process distributed run
    # or a SLURM test may have left (a launcher that finds a rank or master address set joins that job instead)
    launched = (
        "OMP_NUM_THREADS",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "NODE_RANK",
        "GROUP_RANK",
        "LOCAL_WORLD_SIZE",
    )
    env = {k: v for k, v in os.environ.items() if k not in launched and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    args = [
        *TINY_MODEL,
        *QUIET_TRAINER,
        *tiny_data,
        "eval.enabled=false",
        "trainer.accelerator=cpu",
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.threads=3",
        "trainer.max_steps=1",
        "trainer.val_batches=1",
        f"run.dir={run}",
    ]
    args.remove("trainer.threads=1")
    done = subprocess.run(
        [sys.executable, str(launcher), "pretrain", *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [json.loads((run / f"threads{rank}.json").read_text()) for rank in (0, 1)] == [3, 3]
    assert done.stdout.count("parameters  ") == 1
    assert "strategy ddp, world size 2, 3 intra-op thread(s) per process" in done.stdout


@pytest.mark.parametrize(
    ("trainer", "cores", "expected"),
    [
        (["trainer=gpu", "trainer.devices=8"], 64, 6),  # 8 GPU ranks and their 16 loader workers share 64 cores
        (["trainer=gpu", "trainer.devices=8", "data.loader_workers=0"], 64, 8),
        (["trainer=gpu"], 64, 62),
        (["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "data.loader_workers=1"], 7, 2),
        (["trainer=gpu", "trainer.devices=8"], 4, 1),
    ],
)
def test_automatic_threads_share_the_node_among_its_processes(trainer, cores, expected, monkeypatch, one_thread):
    """trainer.threads=0: (cores - every process's loader workers) / processes per node, GPU ranks too (torchrun's
    default of 1 is overridden, so it must not become every core in every rank); data.loader_workers=auto is 2 per
    GPU rank."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    set_threads(load_config(overrides=[*trainer, "trainer.threads=0"]))
    assert torch.get_num_threads() == expected and os.environ["OMP_NUM_THREADS"] == str(expected)


def test_dataclass_defaults_are_the_default_yamls():
    """Config() and the composed default config (conf/config.yaml's group choices) agree key for key: a default
    lives in one place as far as anyone can tell."""
    from dataclasses import asdict

    from keel.config import Config, to_dict

    assert to_dict(load_config()) == asdict(Config())


def test_compile_on_gpu_without_a_c_compiler_is_refused(monkeypatch, tmp_path):
    """Triton builds its GPU kernels' launchers with a C compiler ($CC, gcc or clang): without one a GPU run with
    trainer.compile=true is refused at start-up (decided from the config and the environment: no GPU needed)."""
    from keel.errors import ConfigError
    from keel.trainer_checks import check_trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no gcc, no clang
    monkeypatch.delenv("CC", raising=False)
    gpu = load_config(overrides=["trainer=gpu", "trainer.compile=true"]).trainer
    with pytest.raises(
        ConfigError,
        match=r"^trainer.compile=true: torch.compile on GPU builds Triton kernels.*\(no "
        r"\$CC, and neither gcc nor clang on PATH\); install one .* or set trainer.compile=false$",
    ):
        check_trainer(gpu)
    monkeypatch.setenv("CC", "keel-test-no-such-cc")
    with pytest.raises(ConfigError, match=r"\(\$CC=keel-test-no-such-cc is not a program\)"):
        check_trainer(gpu)
    check_trainer(load_config(overrides=["trainer=gpu", "trainer.compile=false"]).trainer)  # no compile: no check
    compiler = tmp_path / "gcc"
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    monkeypatch.delenv("CC")
    check_trainer(gpu)  # gcc on PATH


# one task of `sbatch --nodes=2 --ntasks-per-node=8` as srun starts it: the 4th on the second node
SLURM_TASK = {
    "SLURM_JOB_NAME": "keel",
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "16",
    "SLURM_NTASKS_PER_NODE": "8",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_LOCALID": "3",
    "SLURM_PROCID": "11",
}


def test_one_gpu_bound_per_slurm_task_is_refused_naming_the_layout(monkeypatch):
    """`--gpus-per-task=1` leaves each task one visible GPU, where each process looks for the GPU of its local rank
    among all of its node's: refused in one line that names the layout to submit with; the same task seeing its
    node's 8 GPUs passes; outside SLURM, too few GPUs are refused with the plain count."""
    from keel.errors import ConfigError
    from keel.trainer_checks import check_trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for variable, value in {**SLURM_TASK, "SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "3"}.items():
        monkeypatch.setenv(variable, value)
    trainer = load_config(
        overrides=["trainer=fsdp", "trainer.devices=8", "trainer.num_nodes=2", "trainer.compile=false"]
    ).trainer
    with pytest.raises(ConfigError) as refused:
        check_trainer(trainer)
    assert str(refused.value) == (
        "trainer.devices=8: this SLURM task sees 1 CUDA GPU(s), and each process takes the GPU of its local rank among "
        "all of its node's; submit with --gpus-per-node=8 --ntasks-per-node=8, without --gpus-per-task or --gpu-bind "
        "(which leave each task only its own GPU)"
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    check_trainer(trainer)
    for variable in SLURM_TASK:
        monkeypatch.delenv(variable)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"^trainer.devices=8: only 1 CUDA GPU\(s\) visible on this node; "):
        check_trainer(trainer)


def fake_nvidia_smi(directory, body: str) -> None:
    smi = directory / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)


def test_the_driver_version_comes_from_pynvml_else_nvidia_smi_else_unknown(monkeypatch, tmp_path):
    from keel.summary import nvidia_driver_version

    def no_library():
        raise RuntimeError("NVML Shared Library Not Found")  # as pynvml's NVMLError where no driver is installed

    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlSystemGetDriverVersion=lambda: b"580.65.06"
    )  # bytes from older pynvml
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert nvidia_driver_version() == "580.65.06"
    monkeypatch.setattr(nvml, "nvmlInit", no_library)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nvidia-smi either
    assert nvidia_driver_version() == "unknown"
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    fake_nvidia_smi(
        tmp_path,
        '[ "$*" = "--query-gpu=driver_version --format=csv,noheader" ] || exit 2\necho 550.54.15\necho 550.54.15',
    )  # one line per GPU
    assert nvidia_driver_version() == "550.54.15"
    fake_nvidia_smi(
        tmp_path, "echo 'NVIDIA-SMI has failed because it could not communicate with the driver' >&2\nexit 9"
    )
    assert nvidia_driver_version() == "unknown"


def test_a_gpu_runs_summary_names_torchs_cuda_build_and_the_driver(monkeypatch, tmp_path):
    """After the hardware line, a GPU run (trainer=gpu names its accelerator: no GPU needed to plan it) says which
    CUDA torch was built for and which driver runs it; a CPU run's summary has no such line."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    fake_nvidia_smi(tmp_path, "echo 550.54.15")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    shape = ["model.depth=2", "model.width=32", "model.n_heads=2", "model.seq_len=32", "model.vocab_size=300"]
    model = KeelLM(load_config(overrides=shape).model)
    gpu = run_summary(load_config(overrides=[*shape, "trainer=gpu"]), model).splitlines()
    assert gpu[8].startswith("hardware    gpu, precision bf16-mixed")
    assert (
        gpu[9] == f"cuda        torch {torch.__version__} built for CUDA {torch.version.cuda}, NVIDIA driver 550.54.15"
    )
    cpu = run_summary(load_config(overrides=shape), model).splitlines()
    assert cpu[8].startswith("hardware    cpu") and not any(line.startswith("cuda ") for line in cpu)
    assert gpu[10:] == cpu[9:]  # then the run directory, checkpoints, validation and TensorBoard lines, alike


def test_auto_on_a_machine_whose_driver_torch_cannot_use_is_refused(monkeypatch, tmp_path):
    """A driver older than the torch build needs makes torch see no GPU (it only warns): trainer.accelerator=auto
    (trainer=ddp, fsdp) would then train on the CPU for hours. With an NVIDIA driver loaded and no GPU usable, auto is
    refused naming the driver and the two ways out; a machine without the driver, or accelerator=cpu, runs."""
    import keel.trainer_checks as trainer_checks
    from keel.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC\n")
    monkeypatch.setattr(trainer_checks, "NVIDIA_DRIVER", driver)
    fsdp = load_config(overrides=["trainer=fsdp", "trainer.devices=2"]).trainer
    with pytest.raises(
        ConfigError,
        match=r"^trainer.accelerator=auto: torch .* sees no GPU, yet this machine has an "
        r"NVIDIA driver loaded \(NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05 .*\); install "
        r"the torch build the driver supports .* or set trainer.accelerator=cpu to train on the CPU$",
    ):
        trainer_checks.check_trainer(fsdp)
    cpu = ["trainer=fsdp", "trainer.devices=2", "trainer.compile=false"]
    trainer_checks.check_trainer(load_config(overrides=[*cpu, "trainer.accelerator=cpu"]).trainer)
    monkeypatch.setattr(trainer_checks, "NVIDIA_DRIVER", tmp_path / "absent")
    trainer_checks.check_trainer(fsdp)


@pytest.mark.parametrize("nodes, preset", [(2, None), (1, None), (2, "/scratch/triton")])
def test_several_nodes_compile_into_each_node_s_own_disk(monkeypatch, nodes, preset):
    """Several nodes: Triton's cache in each node's temporary directory, not the shared home's ~/.triton; one node,
    or a TRITON_CACHE_DIR the user set: left as it is."""
    import tempfile

    from keel.training import node_local_compile_cache

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    if preset:
        monkeypatch.setenv("TRITON_CACHE_DIR", preset)
    node_local_compile_cache(load_config(overrides=["trainer=ddp", f"trainer.num_nodes={nodes}"]))
    cache = os.environ.get("TRITON_CACHE_DIR")
    if preset or nodes == 1:
        assert cache == preset
    else:
        assert os.path.dirname(cache) == tempfile.gettempdir() and os.path.basename(cache).startswith("keel-triton-")
