"""Skipping blocks: the loss when one block's output is replaced by its input (the layer-importance callback during
training, `keel.experiments.redundancy` on checkpoints)."""

from __future__ import annotations

import torch
from torch import nn

from keel.model import next_token_loss


class SkippedBlock(nn.Module):
    """Stands in for a block: returns the residual stream it is given."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return x


@torch.no_grad()
def skip_losses(model, batch: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """[loss of the full model, loss with blocks[0] skipped, ...] on a (B, T + 1) token batch."""
    losses = [next_token_loss(model, batch)]
    for b in blocks:
        block = model.blocks[b]
        model.blocks[b] = SkippedBlock()
        try:
            losses.append(next_token_loss(model, batch))
        finally:
            model.blocks[b] = block
    return torch.stack(losses)
