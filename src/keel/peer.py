"""The peer of `keel bench --peer litgpt`: litgpt's GPT at Keel's dims and layout, its loss and its compile, and
how to install litgpt beside Keel (docs/bench.md, "Peer: litgpt")."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

PEER_RECIPE = """\
litgpt is not importable here. It pins older huggingface_hub and psutil than Keel's environment has, so give it a
throwaway venv that also sees Keel's packages (docs/bench.md, "Peer: litgpt"):
    python -m venv /tmp/peer
    echo "import site; site.addsitedir('<Keel's .venv site-packages>')" > /tmp/peer/lib/python3.*/site-packages/keel.pth
    /tmp/peer/bin/pip install --no-deps litgpt psutil 'jsonargparse[signatures]<=4.41' docstring_parser \\
        typeshed_client 'huggingface_hub<1.4' safetensors
    /tmp/peer/bin/python -m keel.cli bench --peer litgpt ..."""


def litgpt_model(args: argparse.Namespace) -> nn.Module:
    """litgpt's GPT at Keel's dims and layout: Pre-LN RMSNorm, full RoPE, GELU MLP of 4x width, no biases."""
    from litgpt import GPT, Config

    cfg = Config(
        block_size=args.seq_len, vocab_size=args.vocab, padded_vocab_size=args.vocab, n_layer=args.depth,
        n_embd=args.width, n_head=args.heads, n_query_groups=args.heads, rotary_percentage=1.0,
        parallel_residual=False, bias=False, norm_class_name="RMSNorm", norm_eps=1e-5, mlp_class_name="GptNeoxMLP",
        intermediate_size=4 * args.width,
    )
    return GPT(cfg)


def logits_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """litgpt's GPT returns logits: the plain head's loss over them, as litgpt's own pretraining computes it."""
    return F.cross_entropy(model(batch[:, :-1]).float().flatten(0, 1), batch[:, 1:].flatten())


def compile_litgpt_blocks(model: nn.Module) -> None:
    """Block by block, as keel.parallel.compile_blocks does for KeelLM."""
    for block in model.transformer.h:
        block.compile(dynamic=False)
