"""Per-layer gradient norms: where the gradient goes, layer by layer, as training proceeds.

Every `every_n_steps`, in on_before_optimizer_step (after backward and AMP unscaling, before clipping): each
sublayer's branch and gain norms, the embedding, head and global norms, block ratios (bottom, middle, block 0 over
the top block, as keel.gradflow defines them) and a heatmap; optionally the activation-gradient profile
(keel.gradflow.measure_model, one extra forward and backward). The tags: docs/tensorboard.md, "Gradient norms".

The norms are those the LightningModule measures once per step (KeelLitModule.grad_norms), grouped by sublayer;
Lightning's `utilities.grad_norm` is not used: per-parameter only, and a collective per parameter on FSDP2 DTensors.
"""

from __future__ import annotations

import math
import time

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from keel.cadence import due, finished_step
from keel.callbacks.log_writing import log_scalars
from keel.callbacks.options.grad_norms import GradNormsConfig
from keel.callbacks.per_layer import Heatmap, evenly_spaced
from keel.config import Config
from keel.gradflow import bottom_middle_top, measure_model
from keel.tensor_norms import grad_norms

KINDS = ("attn", "ffn")


def block_tag(prefix: str, kind: str, block: int) -> str:
    return f"{prefix}/{kind}/block_{block:03d}"


def parameter_groups(model) -> list[tuple[str, list[torch.nn.Parameter]]]:
    """(tag, parameters) for every tagged group of a KeelLM; together they hold every parameter once."""
    groups = []
    for b, block in enumerate(model.blocks):
        for kind in KINDS:
            params = list(getattr(block, kind).parameters())
            groups.append((block_tag("grad", kind, b), [p for p in params if p.ndim >= 2]))
            groups.append((block_tag("grad/gain", kind, b), [p for p in params if p.ndim < 2]))
    groups.append(("grad/embed", [model.embed.weight]))
    if model.final_norm is not None:
        groups.append(("grad/gain/final", [model.final_norm.weight]))
    if model.head.weight is not model.embed.weight:  # tied embeddings: one matrix, reported as grad/embed
        groups.append(("grad/head", [model.head.weight]))
    grouped = {id(p) for _, params in groups for p in params}
    others = [p for p in model.parameters() if id(p) not in grouped]
    if others:
        groups.append(("grad/other", others))
    return [(tag, params) for tag, params in groups if params]


class GradNormMonitor(Callback):
    def __init__(self, config: GradNormsConfig | None = None) -> None:
        self.config = config if config is not None else GradNormsConfig()

    @classmethod
    def from_config(cls, options: GradNormsConfig, cfg: Config) -> GradNormMonitor:
        return cls(options)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After the strategy's setup: under FSDP the parameters are now the DTensors the optimizer updates.
        model = pl_module.model
        cfg = model.cfg
        groups = parameter_groups(model)
        self._tags = [tag for tag, _ in groups]
        group_of = {id(p): g for g, (_, params) in enumerate(groups) for p in params}
        self._params = list(model.parameters())  # the order of KeelLitModule.grad_norms
        self._group_of = torch.tensor([group_of[id(p)] for p in self._params])
        self._depth = cfg.depth
        self._ratio_blocks = bottom_middle_top(cfg)
        self._shown = set(evenly_spaced(cfg.depth, self.config.max_blocks))
        hidden = {
            block_tag(prefix, kind, b)
            for b in range(cfg.depth)
            if b not in self._shown
            for prefix in ("grad", "grad/gain")
            for kind in KINDS
        }
        self._logged = [tag for tag in [*self._tags, "grad/global"] if tag not in hidden]
        rows = [f"{kind} {b}" for b in range(cfg.depth) for kind in KINDS]
        self._heatmap = Heatmap("grad/heatmap/branch_weights", rows, "||grad|| of branch weights", log10=True)

    def norms(self, per_param: torch.Tensor | None = None) -> dict[str, float]:
        """Every group's gradient norm and the global one, by tag, from each parameter's gradient norm (in
        model.parameters() order; computed here if not given: a collective under FSDP, call on all ranks)."""
        if all(p.grad is None for p in self._params):
            return {}
        if per_param is None:
            per_param = grad_norms(self._params)
        squares = torch.zeros(len(self._tags), device=per_param.device)
        squares.index_add_(0, self._group_of.to(per_param.device), per_param.square())
        values = torch.cat((squares, squares.sum()[None])).sqrt().tolist()
        return dict(zip([*self._tags, "grad/global"], values))

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        step = trainer.global_step
        if not due(step, self.config.every_n_steps):
            return
        start = time.perf_counter()
        norms = self.norms(pl_module.grad_norms)
        if not norms:
            return
        blocks = [
            math.hypot(norms[block_tag("grad", "attn", b)], norms[block_tag("grad", "ffn", b)])
            for b in range(self._depth)
        ]
        bottom, middle, top = self._ratio_blocks
        ratios = {
            "grad/ratio/bottom_top": blocks[bottom] / blocks[top] if blocks[top] else math.nan,
            "grad/ratio/middle_top": blocks[middle] / blocks[top] if blocks[top] else math.nan,
            "grad/ratio/block0_top": blocks[0] / blocks[top] if blocks[top] else math.nan,
        }
        shown = {tag: norms[tag] for tag in self._logged}
        if trainer.is_global_zero:
            self._heatmap.add(step, [norms[block_tag("grad", kind, b)] for b in range(self._depth) for kind in KINDS])
            if due(step, self.config.heatmap_every_n_steps):
                self._heatmap.log(trainer, step)
        elapsed = {"time/grad_norms_ms": 1e3 * (time.perf_counter() - start)}
        log_scalars(trainer, {**shown, **ratios, **elapsed}, step)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        step = finished_step(trainer)
        if step is None or not due(step, self.config.activation_every_n_steps):
            return
        start = time.perf_counter()
        with trainer.precision_plugin.forward_context():
            flow = measure_model(pl_module.model, batch[:, :-1], batch[:, 1:])
        metrics = {
            block_tag("grad/act", row["kind"], row["block"]): row["rel_act_grad"]
            for row in flow["sublayers"]
            if row["block"] in self._shown
        }
        for ratio in ("bottom_top", "middle_top"):
            if (value := flow["summary"][f"rel_act_grad_{ratio}"]) is not None:  # None: a zero top gradient
                metrics[f"grad/act/ratio/{ratio}"] = value
        metrics["time/grad_act_ms"] = 1e3 * (time.perf_counter() - start)
        log_scalars(trainer, metrics, step)
