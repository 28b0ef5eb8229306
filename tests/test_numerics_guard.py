"""The numerics guard (keeltest.numerics): the first steps of Table 1's linear probe, Keel and Pre-LN, replayed and
held to the committed training and held-out losses - bit for bit on the machine and torch that made them, else within a
measured tolerance - so that a change that moves the numerics fails here, and the test of that tolerance against a
real change of the numerics."""

from __future__ import annotations

import json

import pytest

from keel.experiments.maxlr import MINIATURE_DEPTH
from keel.schedule import lr_factor
from keeltest import numerics


@pytest.fixture(scope="module")
def guard(tmp_path_factory):
    root = tmp_path_factory.mktemp("numerics-guard")
    data = numerics.build_data(root)
    return root, data, numerics.replay(root, data)


def test_losses_match_the_committed_values(guard):
    record = json.loads(numerics.RECORD.read_text())
    committed, replayed = record["probes"], guard[2]
    moved = numerics.drift(committed, replayed)
    if numerics.same_machine(record):
        matches, how = replayed == committed, "bit for bit (the machine and torch that made them)"
    else:
        matches, how = moved <= numerics.TOLERANCE, f"within {numerics.TOLERANCE:g} nats (another machine or torch)"
    assert matches, (
        f"the numerics moved: the first {numerics.STEPS} steps of {numerics.GRID}'s probes (seed {numerics.SEED}) "
        f"no longer give the committed training and held-out losses {how}: largest difference {moved:.3g} nats, "
        f"first differing step per scheme {numerics.first_differences(committed, replayed)}; committed by "
        f"{record['made_by']}. If "
        f"the change is meant to move the numerics, regenerate the values with `{numerics.REGENERATE}` and commit "
        "them, then rerun the committed records a verdict rests on (docs/experiments.md) or show that their verdicts "
        "survive; else revert the change."
    )


def test_the_probe_runs_the_protocols_ramp(guard):
    """Cut to its first steps, the probe still climbs Table 1's slope: each step's LR is the whole ramp's."""
    root, data, replayed = guard
    args, cfg = numerics.protocol(root, data, "keel")
    assert (args.ramp, args.peak_lr, args.steps, cfg.model.depth, cfg.model.width) == ("linear", 0.4, 4000, 16, 64)
    assert cfg.trainer.threads == 1 and MINIATURE_DEPTH == 16
    expected = [args.peak_lr * lr_factor(step, cfg.optim, args.steps) for step in range(numerics.STEPS)]
    evaluations = list(range(args.eval_every - 1, numerics.STEPS, args.eval_every))  # 0-based: after steps 5, 10, ...
    for scheme in numerics.SCHEMES:
        assert replayed[scheme]["lr"] == pytest.approx(expected, rel=1e-12)
        assert replayed[scheme]["val_step"] == evaluations


def test_a_real_numerics_change_exceeds_the_tolerance(guard):
    """model.norm_eps 1e-5 -> 1e-6 moves Keel's losses by more than the tolerance: it is not so loose that a change
    of the numerics passes."""
    root, data, replayed = guard
    changed = numerics.replay(root / "norm-eps", data, schemes=("keel",), norm_eps=1e-6)
    assert numerics.drift({"keel": replayed["keel"]}, changed) > numerics.TOLERANCE
