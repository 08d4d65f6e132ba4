"""Transformers' hub-kernel wrappers (the ``kernels`` package) stepped around while decoder layers
are traced as regions (``compileattn/hf/kernel_wrappers.py``): torch reuses the layer's trace, the
answers are the wrapped model's, and a kernelized instance keeps its wrapper."""
from __future__ import annotations

import contextlib
import logging
import types

import pytest
import torch
from torch import nn

import compileattn as ca
from compileattn.hf import kernel_wrappers
from test_regions import Block, _stack, _stack_inputs, _steps, forced_regions, subgraphs  # noqa: F401

# Declared in the test extra (a skip here fails a CPU run); the GPU image's transformers 5.17 does
# not pull it in, and there this module alone is skipped.
kernels = pytest.importorskip("kernels")
use_kernel_forward_from_hub, use_kernelized_func = kernels.use_kernel_forward_from_hub, kernels.use_kernelized_func


@contextlib.contextmanager
def _refused_reuses():
    """The region reuses torch refused in the block, as its hierarchical-compile log says them (the
    counts of regions and subgraphs do not tell: it traces a refused layer again and keeps one
    subgraph of equal ones)."""
    logger = logging.getLogger("torch._dynamo.variables.invoke_subgraph.__hierarchical_compile")
    refused: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: refused.append(record.getMessage()) if "not eligible" in record.getMessage() else None
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield refused
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@use_kernel_forward_from_hub("compileattn_test_twice")
def hub_twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


@use_kernelized_func(hub_twice)
class HubBlock(Block):
    """A block whose forward carries the ``kernels`` package's hub-function wrapper, as
    transformers' attention classes do where ``kernels`` is installed: the wrapper sets a global
    around the forward, a side effect for which torch 2.13 reuses no region."""

    def forward(self, x):
        return hub_twice(super().forward(x))


def test_layers_behind_a_hub_kernel_wrapper_share_one_region():
    """The wrapper is stepped around for the trace (``hf/kernel_wrappers.py``): one traced layer for
    all three, the same answers as the eager (wrapped) model, the wrapper back on the class after."""
    wrapper = HubBlock.__dict__["forward"]
    eager, compiled = _stack([1.0] * 3, HubBlock)
    with _refused_reuses() as refused, ca.counters.expect(dynamo_graphs=1, regions_inlined=3, **subgraphs(1)):
        _steps(eager, compiled, _stack_inputs)
    assert refused == []  # with the wrapper, torch 2.13 traced every layer again: 2 refusals
    assert compiled.forward.compile_stats["regions"] == "on: HubBlock x3"
    assert HubBlock.__dict__["forward"] is wrapper and kernel_wrappers.unwrappable_classes(eager) == [HubBlock]


@use_kernelized_func(hub_twice)
class Twice(nn.Module):
    def forward(self, x):
        return hub_twice(x)


class TwiceAgain(Twice):
    """Inherits the wrapper: the class holding it is the one stepped around."""


def test_a_kernelized_instance_keeps_the_hub_wrapper():
    """``kernels.kernelize`` gives an instance's function wrapper a forward of its own, which only
    the hub wrapper routes to: such a class is not stepped around (its layers are traced one by one)."""
    kernelized, plain = Twice(), TwiceAgain()
    (function,) = vars(kernelized)["_kernel_funcs"].values()
    function.forward = types.MethodType(lambda self, x: 3 * x, function)  # what kernelize sets
    x = torch.randn(4)
    assert torch.equal(kernelized(x), 3 * x) and torch.equal(plain(x), 2 * x)  # the wrapper routes to it
    assert kernel_wrappers.unwrappable_classes(nn.Sequential(plain)) == [Twice]
    wrapper = Twice.__dict__["forward"]
    with kernel_wrappers.original_forwards(nn.Sequential(plain)):
        assert Twice.forward is wrapper.__wrapped__ and torch.equal(plain(x), 2 * x)
    assert Twice.__dict__["forward"] is wrapper
    assert kernel_wrappers.unwrappable_classes(nn.Sequential(plain, kernelized)) == []
    other_version = TwiceAgain()
    del vars(other_version)["_kernel_funcs"]  # a kernels version whose routing is not known: kept
    assert kernel_wrappers.unwrappable_classes(nn.Sequential(plain, other_version)) == []
    with pytest.raises(ZeroDivisionError), kernel_wrappers.original_forwards(nn.Sequential(plain)):
        1 / 0
    assert Twice.__dict__["forward"] is wrapper
