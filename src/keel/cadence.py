"""When a step-cadenced action runs. Steps are 0-based optimizer-step indices, the x-axis Lightning uses for
`train/loss`; an action "every n steps" runs at steps n-1, 2n-1, ... so that it lands on the same steps as
Lightning's own logging. Torch-free: the training step, the callbacks and the experiments' runners share it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


def due(step: int, every: int) -> bool:
    """Whether an action with cadence `every` (0 = never) runs at `step`."""
    return every > 0 and (step + 1) % every == 0


def finished_step(trainer: Trainer) -> int | None:
    """In on_train_batch_end: the index of the optimizer step this micro-batch completed, or None while
    gradients are still being accumulated (the same test Lightning's own ThroughputMonitor uses)."""
    if trainer.fit_loop._should_accumulate():
        return None
    return trainer.global_step - 1
