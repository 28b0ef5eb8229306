"""The steps `keel bench` times: the LightningModule's own training step run without a Trainer (TrainStep), and
K models of one shape trained as one (MembersStep, `--members`)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch

from keel.config import OptimConfig
from keel.devices import reset_peak_resident, resident_bytes, synchronize
from keel.lit import KeelLitModule, drop_nonfinite_update, make_optimizer
from keel.model import KeelLM


class Step:
    """A training step on a fixed batch (`__call__`, subclasses) and its measurements. Its gradients stay from
    one step to the next, freed at the start of the next one, as Lightning leaves them."""

    batch: torch.Tensor  # (..., B, T + 1) token ids
    optimizer: torch.optim.Optimizer

    def __call__(self) -> torch.Tensor:
        raise NotImplementedError

    def held_bytes(self) -> int:
        """Bytes held between steps: what the optimizer updates (every parameter here), their gradients and the
        optimizer's state."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        tensors = [*params, *(p.grad for p in params if p.grad is not None)]
        tensors += [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def peak_memory(self) -> int | None:
        """What is held between steps + the most one step adds on top (activations, temporaries; gradients where
        none were held): CUDA's max allocated; on CPU the peak RSS (VmHWM) over the step, an approximation
        (allocator caching)."""
        device = self.batch.device
        synchronize(device)
        held = self.held_bytes()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
            self()
            synchronize(device)
            return held + torch.cuda.max_memory_allocated(device) - start
        start = reset_peak_resident()
        if start is None:
            return None
        self()
        return held + resident_bytes(peak=True) - start

    @property
    def tokens_per_step(self) -> int:
        """Tokens one call trains on."""
        return self.batch[..., 1:].numel()

    def timed(self, steps: int) -> float:
        """Tokens/s over `steps` steps."""
        synchronize(self.batch.device)
        start = time.perf_counter()
        for _ in range(steps):
            self()
        synchronize(self.batch.device)
        return steps * self.tokens_per_step / (time.perf_counter() - start)


class TrainStep(Step):
    """One optimizer step of a KeelLitModule, its hooks called in the order Lightning's automatic optimization
    calls them in `keel pretrain` (no loss scaling): gradients zeroed, for each of `micro_batches` micro-batches (the
    same batch each time) training_step under the precision's autocast and backward of its share of the loss (as
    Lightning divides it by trainer.grad_accum), then the module's gradient norms and non-finite skip, its clipping,
    the AdamW step and the LR schedule. The module is the trained one (keel.lit): no Trainer, logger or callback runs
    here."""

    def __init__(self, module: KeelLitModule, batch: torch.Tensor, micro_batches: int = 1) -> None:
        # training_step logs its loss: without a Trainer, Lightning drops the value with this warning
        warnings.filterwarnings("ignore", message="You are trying to `self.log\\(\\)` but the `self.trainer`")
        self.module, self.batch = module.to(batch.device), batch
        module.configure_model()  # the trainer config's activation checkpointing and compile
        optimizers = module.configure_optimizers()
        self.optimizer, self.scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
        self.bf16 = module.cfg.trainer.precision == "bf16-mixed"
        self.micro_batches = micro_batches

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * super().tokens_per_step

    def __call__(self) -> torch.Tensor:
        """One optimizer step; its loss (the micro-batches' mean)."""
        module = self.module
        self.optimizer.zero_grad()
        losses = []
        for _ in range(self.micro_batches):
            with torch.autocast(self.batch.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                loss = module.training_step(self.batch, 0)
            module.backward(loss / self.micro_batches)
            losses.append(loss.detach())
        module.measure_grad_norms()
        drop_nonfinite_update(self.optimizer, module.global_grad_norm)
        module.configure_gradient_clipping(self.optimizer, module.cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return torch.stack(losses).mean()


class MembersStep(Step):
    """K models of one shape trained as one, a way of training `keel pretrain` does not have (`keel bench
    --members`): each parameter stacked along a leading member axis (torch.func.stack_module_state), the unchanged
    KeelLM run on each member's slice by torch.func.vmap over functional_call, so every op does the work of all
    members at once; each member has its own init (seed k), its own batch batch[k] and its own global-norm
    clipping. The optimizer is make_optimizer's AdamW, its groups over the stacked tensors."""

    def __init__(self, build: Callable[[], KeelLM], batch: torch.Tensor, bf16: bool = False) -> None:
        from torch.func import functional_call, stack_module_state, vmap

        # CPU attention has no vmap batching rule: torch runs it member by member, as the benchmark measures
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
        models = []
        for seed in range(batch.shape[0]):
            torch.manual_seed(seed)
            models.append(build().to(batch.device))
        params, buffers = stack_module_state(models)
        self.optim = OptimConfig()
        self.optimizer = make_optimizer(models[0], self.optim)
        name = {id(p): n for n, p in models[0].named_parameters()}
        for group in self.optimizer.param_groups:  # no step taken yet: no state to move
            group["params"] = [params[name[id(p)]] for p in group["params"]]
        template = models[0].to("meta")

        def loss(member_params, member_buffers, batch):
            return functional_call(
                template, (member_params, member_buffers), (batch[:, :-1],), {"targets": batch[:, 1:]}
            )

        self.params, self.buffers, self.loss = params, buffers, vmap(loss)
        self.batch, self.bf16 = batch, bf16

    def __call__(self) -> torch.Tensor:
        """One step of every member; their losses (members,)."""
        self.optimizer.zero_grad()
        with torch.autocast(self.batch.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            losses = self.loss(self.params, self.buffers, self.batch)  # (members,)
        losses.sum().backward()  # the members share no parameter: each gets its own loss's gradient
        if self.optim.grad_clip:
            grads = [p.grad for p in self.params.values()]
            norms = torch.stack([g.flatten(1).square().sum(1) for g in grads]).sum(0).sqrt()  # (members,)
            scale = (self.optim.grad_clip / (norms + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(scale.view(-1, *[1] * (g.ndim - 1)))
        self.optimizer.step()
        return losses.detach()
