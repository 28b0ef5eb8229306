"""Extreme depth and the tools for it: 1,024 blocks forward and backward, activation checkpointing, compiled
checkpointed blocks keeping names and gradients."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from keel.model import KeelLM
from keel.parallel import apply_activation_checkpointing, compile_blocks
from keeltest.model import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def loss_and_grads(model: KeelLM, idx: torch.Tensor):
    loss = F.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_depth_1024_forward_backward():
    torch.manual_seed(0)
    cfg = tiny(depth=1024)  # L = 2048 sublayers, alpha = 2048
    loss, grads = loss_and_grads(KeelLM(cfg), torch.randint(64, (2, 16)))
    assert loss.isfinite() and abs(float(loss) - math.log(64)) < 0.5
    assert all(g is not None and g.isfinite().all() for g in grads.values())


@pytest.mark.parametrize("scheme", ["keel", "hybridnorm"])
def test_activation_checkpointing_gives_the_same_gradients_and_state_dict(scheme):
    cfg = tiny(scheme=scheme, init="unit")
    idx = torch.randint(64, (2, 16))
    torch.manual_seed(0)
    plain = KeelLM(cfg)
    torch.manual_seed(0)
    checkpointed = KeelLM(cfg)
    apply_activation_checkpointing(checkpointed)
    loss, grads = loss_and_grads(plain, idx)
    ckpt_loss, ckpt_grads = loss_and_grads(checkpointed, idx)
    torch.testing.assert_close(ckpt_loss, loss)
    assert ckpt_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, msg=name)
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(checkpointed.state_dict())
    checkpointed.load_state_dict(plain.state_dict())


def test_compiled_checkpointed_blocks_keep_names_and_gradients():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    plain = KeelLM(tiny(depth=2, init="unit"))
    compiled = copy.deepcopy(plain)
    apply_activation_checkpointing(compiled)
    compile_blocks(compiled)  # in place and lazy: nothing is compiled until the first call
    assert compiled.state_dict().keys() == plain.state_dict().keys()
    compiled.load_state_dict(plain.state_dict())

    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model)
    for block in model.blocks:  # as compile_blocks, with a backend that needs no C++ toolchain
        block.compile(backend="eager", dynamic=False)
    counters.clear()
    idx = torch.randint(64, (2, 16))
    _, compiled_grads = loss_and_grads(model, idx)
    assert counters["frames"]["ok"] >= 1  # dynamo traced the checkpointed forward rather than skipping it
    for name, grad in loss_and_grads(plain, idx)[1].items():
        torch.testing.assert_close(compiled_grads[name], grad, msg=name)
