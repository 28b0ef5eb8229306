"""The peer of `keel bench --peer litgpt`: litgpt's GPT at Keel's dims and layout, trained by the same step as
Keel's models, and how to install litgpt beside Keel (docs/bench.md, "Peer: litgpt")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from keel.config import ModelConfig

PEER_RECIPE = """\
litgpt is not importable here. It pins older huggingface_hub and psutil than Keel's environment has, so give it a
throwaway venv that also sees Keel's packages (docs/bench.md, "Peer: litgpt"):
    python -m venv /tmp/peer
    echo "import site; site.addsitedir('<Keel's .venv site-packages>')" > /tmp/peer/lib/python3.*/site-packages/keel.pth
    /tmp/peer/bin/pip install --no-deps litgpt psutil 'jsonargparse[signatures]<=4.41' docstring_parser \\
        typeshed_client 'huggingface_hub<1.4' safetensors
    /tmp/peer/bin/python -m keel.cli bench --peer litgpt ..."""


class LitgptPeer(nn.Module):
    """litgpt's GPT at a Keel model config's dims and layout (Pre-LN RMSNorm, full RoPE, GELU MLP of 4x width, no
    biases), behind what the LightningModule's training step uses of a KeelLM: `cfg`, `blocks` (compiled one by
    one, keel.parallel.compile_blocks) and forward(idx, targets) -> the loss, from litgpt's logits and plain head
    as litgpt's own pretraining computes it."""

    def __init__(self, cfg: ModelConfig) -> None:
        from litgpt import GPT, Config

        super().__init__()
        self.cfg = cfg
        self.gpt = GPT(
            Config(
                block_size=cfg.seq_len,
                vocab_size=cfg.vocab_size,
                padded_vocab_size=cfg.vocab_size,
                n_layer=cfg.depth,
                n_embd=cfg.width,
                n_head=cfg.n_heads,
                n_query_groups=cfg.n_heads,
                rotary_percentage=1.0,
                parallel_residual=False,
                bias=False,
                norm_class_name="RMSNorm",
                norm_eps=1e-5,
                mlp_class_name="GptNeoxMLP",
                intermediate_size=4 * cfg.width,
            )
        )

    @property
    def blocks(self) -> nn.ModuleList:
        return self.gpt.transformer.h

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.gpt(idx).float().flatten(0, 1), targets.flatten())
