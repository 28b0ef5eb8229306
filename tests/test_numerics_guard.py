"""The numerics guard (keeltest.numerics): the first steps of Table 1's linear probe, Keel and Pre-LN, replayed and
held to the committed training and held-out losses - bit for bit on the machine and torch that made them, else within a
measured tolerance - so that a change that moves the numerics fails here, and the test of that tolerance against a
real change of the numerics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel.experiments.maxlr import MINIATURE_DEPTH
from keel.schedule import lr_factor
from keeltest import numerics

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """keeltest.numerics --measure, in a process of its own (keeltest.numerics.main says why)."""
    root = tmp_path_factory.mktemp("numerics-guard")
    path = os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-m", "keeltest.numerics", "--measure", str(root / "measured.json"), "--dir", str(root)],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((root / "measured.json").read_text())


def test_losses_match_the_committed_values(measured):
    record = json.loads(numerics.RECORD.read_text())
    committed, replayed = record["probes"], measured["probes"]
    moved = numerics.drift(committed, replayed)
    differences = numerics.machine_differences(record)
    if not differences:
        matches, how = replayed == committed, "bit for bit (the machine, torch and tokenizers that made them)"
    else:
        here = ", ".join(f"{key} {made} there, {now} here" for key, (made, now) in differences.items())
        matches, how = moved <= numerics.TOLERANCE, f"within {numerics.TOLERANCE:g} nats (another machine: {here})"
    assert matches, (
        f"the numerics moved: the first {numerics.STEPS} steps of {numerics.GRID}'s probes (seed {numerics.SEED}) "
        f"no longer give the committed training and held-out losses {how}: largest difference {moved:.3g} nats, "
        f"first differing step per scheme {numerics.first_differences(committed, replayed)}; committed by "
        f"{record['made_by']}. If "
        f"the change is meant to move the numerics, regenerate the values with `{numerics.REGENERATE}` and commit "
        "them, then rerun the committed records a verdict rests on (docs/experiments.md) or show that their verdicts "
        "survive; else revert the change."
    )


def test_the_probe_runs_the_protocols_ramp(measured, tmp_path):
    """Cut to its first steps, the probe still climbs Table 1's slope: each step's LR is the whole ramp's, the
    held-out loss is measured every --eval-every steps."""
    args, cfg = numerics.protocol(tmp_path, numerics.data_overrides(tmp_path), "keel")
    assert (args.ramp, args.peak_lr, args.steps, cfg.model.depth, cfg.model.width) == ("linear", 0.4, 4000, 16, 64)
    assert cfg.trainer.threads == 1 and MINIATURE_DEPTH == 16 and cfg.trainer.max_steps == numerics.STEPS
    expected = [args.peak_lr * lr_factor(step, cfg.optim, args.steps) for step in range(numerics.STEPS)]
    evaluations = list(range(args.eval_every - 1, numerics.STEPS, args.eval_every))  # 0-based: after steps 5, 10, ...
    for scheme in numerics.SCHEMES:
        assert measured["probes"][scheme]["lr"] == pytest.approx(expected, rel=1e-12)
        assert measured["probes"][scheme]["val_step"] == evaluations


def test_a_real_numerics_change_exceeds_the_tolerance(measured):
    """model.norm_eps 1e-5 -> 1e-6 (numerics.REAL_CHANGE) moves Keel's losses by more than the tolerance: it is not
    so loose that a change of the numerics passes."""
    unchanged = {"keel": measured["probes"]["keel"]}
    assert numerics.drift(unchanged, measured["changed"]) > numerics.TOLERANCE
