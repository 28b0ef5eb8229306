"""The numerics guard: the first STEPS steps of Table 1's linear probe (grid linear-d16, Keel and Pre-LN, seed 1),
replayed on the data tests' corpus and held to the training loss of each step and the held-out loss of each
evaluation committed in RECORD, with what made them. tests/test_numerics_guard.py compares them; `make
numerics-guard` (this module with --write) regenerates RECORD after a change meant to move the numerics - and then
the committed records a verdict rests on must be rerun, or shown to survive (docs/experiments.md, "Set-up").
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from keel.artifacts import read_scalars
from keel.experiments import maxlr
from keel.experiments.grids import SETTINGS
from keel.experiments.maxlr_report import unigram_loss
from keel.experiments.paper_run import command
from keel.experiments.records import LOSS_LR
from keel.provenance import made_by
from keeltest.data import write_corpus

RECORD = Path(__file__).resolve().parents[1] / "numerics_guard.json"
GRID = "linear-d16"  # Table 1's protocol at its own size: 16 blocks x 64, LR 0 -> 0.4 linearly over 4,000 steps
SCHEMES = ("keel", "preln")
SEED = 1
STEPS = 30  # of the ramp's 4,000: LR 1e-4 at the first step, 3e-3 at the last; the held-out loss every 5
# The largest loss difference (nats; any step's training or held-out loss, either scheme) taken for the same numerics
# where the machine differs from the one that made RECORD, between the drifts measured here (docs/experiments.md,
# "Set-up"): none with 2 threads against 1, 4.8e-7 with model.init_std one float32 ulp higher; model.norm_eps 1e-5 ->
# 1e-6, a real change: 3.4e-3 for Keel, 8.2e-3 for Pre-LN.
TOLERANCE = 3e-4
REAL_CHANGE = {"norm_eps": 1e-6}  # replayed for Keel by measure(): it must move the losses by more than TOLERANCE
REGENERATE = "make numerics-guard"


@contextmanager
def chdir(path: Path) -> Iterator[None]:  # contextlib.chdir from Python 3.11
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def data_overrides(root: Path) -> list[str]:
    """The data.* overrides that select build_data(root)'s shards. The corpus is globbed by a relative path (from
    root): a document's id, which decides its split, is then the same wherever the build lies, and so are the
    shards."""
    return [
        "data=text_files",
        "data.text_files.paths=[corpus/*.txt]",
        f"data.dir={root / 'shards'}",
        "data.vocab_size=300",
        "data.val_fraction=0.2",
        "data.prepare_workers=1",
    ]


def build_data(root: Path) -> list[str]:
    """keeltest.data's corpus of random words, built by `keel data` under root; data_overrides(root)."""
    from keel.data.preparation import main as data_main

    write_corpus(root / "corpus")
    overrides = data_overrides(root)
    with chdir(root):
        if data_main(overrides) != 0:
            raise RuntimeError(f"keel data {' '.join(overrides)} failed")
    return overrides


def protocol(root: Path, data: list[str], scheme: str):
    """The probe's args and config as `keel paper-run linear-d16` builds them (only seed SEED), cut to STEPS steps:
    the ramp's slope and every other setting stay the protocol's."""
    argv = command(GRID, {**SETTINGS, "PAPER_OUT": str(root / "out"), "SEEDS": str(SEED), "TREND_SEEDS": str(SEED)})
    args = maxlr.build_parser().parse_intermixed_args([*argv[1:], *data])
    maxlr.check_protocol(args)
    runs = maxlr.build_grid(args)
    name = f"{scheme}-d{maxlr.MINIATURE_DEPTH}-s{SEED}"
    (cfg,) = maxlr.run_configs(args, [run for run in runs if run.name == name], Path(args.out))
    cfg.callbacks.stability.learn_by_step = maxlr.step_reaching(cfg, args.learn_by_lr)  # the whole ramp's
    cfg.trainer.max_steps = STEPS
    return argparse.Namespace(**{**vars(args), "learn_by_lr": None}), cfg


def replay(root: Path, data: list[str], schemes=SCHEMES, **changes: float) -> dict[str, dict]:
    """Each scheme's probe trained under root: {scheme: {"lr": [...], "loss": [...], "val_step": [...],
    "val_loss": [...]}}: each step's LR and training loss, each evaluation's step and held-out loss. changes:
    model.KEY=value set on the config (keys that would otherwise drop the miniature, e.g. norm_eps)."""
    out = {}
    for scheme in schemes:
        args, cfg = protocol(root, data, scheme)
        for key, value in changes.items():
            setattr(cfg.model, key, value)
        maxlr.probe(cfg, args, unigram_loss(cfg))
        with open(Path(cfg.run.dir) / LOSS_LR) as f:
            rows = list(csv.DictReader(f))
        held_out = read_scalars(Path(cfg.run.dir))["val/loss"]
        out[scheme] = {key: [float(row[key]) for row in rows] for key in ("lr", "loss")}
        out[scheme] |= {"val_step": [step for step, _ in held_out], "val_loss": [loss for _, loss in held_out]}
    return out


LOSSES = ("loss", "val_loss")


def drift(a: dict[str, dict], b: dict[str, dict]) -> float:
    """The largest difference of a training or held-out loss between two replays of the same schemes (inf if their
    schemes or steps differ)."""
    steps = {scheme: (len(probe["loss"]), probe["val_step"]) for scheme, probe in a.items()}
    if steps != {scheme: (len(probe["loss"]), probe["val_step"]) for scheme, probe in b.items()}:
        return float("inf")
    return max(abs(x - y) for s in a for key in LOSSES for x, y in zip(a[s][key], b[s][key]))


def first_differences(a: dict[str, dict], b: dict[str, dict]) -> dict[str, int | None]:
    """Per scheme of both, the first step whose training loss differs (None: none does)."""
    return {
        scheme: next((i for i, (x, y) in enumerate(zip(a[scheme]["loss"], b[scheme]["loss"])) if x != y), None)
        for scheme in sorted(a.keys() & b.keys())
    }


def machine() -> dict:
    """What the exact comparison needs to match: keel.provenance's record (the protocol's 1 thread), the instruction
    set torch's kernels use (the CPU's model name alone can be as vague as "AMD EPYC") and the tokenizers version
    (it trains the corpus's tokenizer: another version can split the text otherwise)."""
    import torch

    return {
        **made_by(1),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "tokenizers": metadata.version("tokenizers"),
    }


EXACT_KEYS = ("torch", "tokenizers", "cpu", "cpu_capability")


def machine_differences(record: dict) -> dict[str, tuple]:
    """What of EXACT_KEYS differs between the machine that made the record and this one: (the record's, here)."""
    here, made = machine(), record["made_by"]
    return {key: (made.get(key), here[key]) for key in EXACT_KEYS if made.get(key) != here[key]}


def measure(root: Path, write: bool) -> dict:
    """The probes replayed under root: RECORD's content (write), or what the test compares - the probes and Keel's
    with REAL_CHANGE."""
    data = build_data(root)
    probes = replay(root / "probes", data)
    if write:
        return {"grid": GRID, "seed": SEED, "steps": STEPS, "made_by": machine(), "probes": probes}
    return {"probes": probes, "changed": replay(root / "changed", data, ("keel",), **REAL_CHANGE)}


def main(argv: list[str] | None = None) -> int:
    """In a process of its own, as the test runs it: a test session's earlier tests leave torch's state behind (e.g.
    torch.compile's caches, whose limits send a frame compiled too often back to eager mode)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help=f"regenerate {RECORD.name} on this machine")
    action.add_argument("--measure", type=Path, metavar="JSON", help="write what the test compares to JSON")
    parser.add_argument("--dir", default="runs/numerics-guard", help="where the probes train (replaced)")
    args = parser.parse_args(argv)
    root = Path(args.dir).resolve()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    before = json.loads(RECORD.read_text())["probes"] if args.write and RECORD.is_file() else None
    result = measure(root, args.write)
    path = RECORD if args.write else args.measure
    path.write_text(json.dumps(result, indent=1) + "\n")
    moved = "" if before is None else f"; the losses moved by up to {drift(before, result['probes']):.3g} nats"
    print(f"wrote {path}: {', '.join(result['probes'])}, {STEPS} steps{moved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
