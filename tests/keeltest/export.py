"""The export tests' helpers: the schemes and options every export is checked under, a Keel checkpoint with
every parameter moved off its init, a fresh interpreter without Keel, and the exported model loaded by transformers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="keel export needs the hf extra: pip install 'keel[hf]'")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from keel.config import load_config, to_dict  # noqa: E402
from keel.model import KeelLM  # noqa: E402

VOCAB = 512
BASE = ["model.depth=3", "model.width=32", "model.n_heads=4", "model.seq_len=24", f"model.vocab_size={VOCAB}"]


# Every scheme and every option that changes the computation (docs/schemes.md)
VARIANTS = {
    "keel": [],
    "keel-v2-alpha-swiglu-gqa": [
        "model.keel_first_block=v2",
        "model.keel_alpha=5",
        "model.ffn=swiglu",
        "model.n_kv_heads=2",
    ],
    "keel-no-inner-norm": ["model.keel_inner_norm=false"],
    "keel-no-gain-tied": ["model.out_norm_gain=false", "model.tie_embeddings=true"],
    "preln": ["model.scheme=preln"],
    "preln-depth-rule": ["model.scheme=preln", "model.branch_base_depth=2"],  # each branch x 2/3
    "postln": ["model.scheme=postln"],
    "postln-final-norm": ["model.scheme=postln", "model.postln_final_norm=true"],
    "deepnorm": ["model.scheme=deepnorm"],
    "hybridnorm": ["model.scheme=hybridnorm"],
    "hybridnorm_star": ["model.scheme=hybridnorm_star", "model.rope_theta=500"],
    "mixln": ["model.scheme=mixln", "model.depth=4", "model.mixln_post_fraction=0.5"],
    # muP at a width (32) other than its base: logits multiplier 0.5, attention scale sqrt(16/4)/8
    "keel-mup": ["model.parametrization=mup", "model.mup_base_width=16"],
    "preln-mup-tied": [
        "model.scheme=preln",
        "model.parametrization=mup",
        "model.mup_base_width=64",
        "model.tie_embeddings=true",
    ],
}


def standalone(script: str, *args, pythonpath: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run script (python -c, its args in sys.argv[1:]) in a fresh interpreter where keel cannot be imported, as
    a user of the export has it: the exported directory must stand alone. pythonpath: packages to use before this
    environment's; check: that it succeeds."""
    prelude = "import sys\nsys.modules['keel'] = None  # any import of keel fails\n"
    env = os.environ if pythonpath is None else {**os.environ, "PYTHONPATH": str(pythonpath)}
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0 or not check, done.stderr[-4000:]
    return done


def hf_model(directory: Path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, **kwargs).eval()


def load_hf(directory: Path):
    return hf_model(directory), AutoTokenizer.from_pretrained(directory, trust_remote_code=True)


def random_checkpoint(overrides: list[str], tokenizer_json: str, path: Path) -> tuple[KeelLM, Path]:
    """A KeelLM with every parameter moved off its init (norm gains included: a wrong mapping shows), saved as
    a checkpoint the way training saves one."""
    cfg = load_config(overrides=[*BASE, *overrides])
    torch.manual_seed(0)
    model = KeelLM(cfg.model).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    state = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    torch.save(
        {"keel": {"config": to_dict(cfg), "tokenizer_json": tokenizer_json}, "state_dict": state, "global_step": 7},
        path,
    )
    return model, path
