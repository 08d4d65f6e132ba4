"""The count of module registrations that tells CUDA-graph steps to compare the parameters
(compilation/module_watch.py): what bumps it and what does not."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from compileattn.compilation import module_watch


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3))


def _bumps(change) -> bool:
    module_watch.start()
    block = _Block()
    before = module_watch.generation
    change(block)
    return module_watch.generation != before


@pytest.mark.parametrize("change", [
    lambda b: setattr(b.lin, "weight", nn.Parameter(torch.zeros(3, 3))),
    lambda b: b.lin.register_parameter("bias", nn.Parameter(torch.zeros(3))),
    lambda b: setattr(b, "scale", torch.zeros(3)),
    lambda b: b.register_buffer("scale", torch.zeros(3)),
    lambda b: setattr(b, "lin", nn.Linear(3, 3)),
    lambda b: b.load_state_dict({k: v.clone() for k, v in b.state_dict().items()}, assign=True),
], ids=["parameter attribute", "register_parameter", "buffer attribute", "register_buffer", "submodule",
        "load_state_dict assign"])
def test_a_registration_bumps_the_generation(change):
    assert _bumps(change)


def _copy_in_place(b):
    with torch.no_grad():
        b.lin.weight.copy_(torch.zeros(3, 3))


def _assign_data(b):
    b.lin.weight.data = torch.zeros(3, 3)


@pytest.mark.parametrize("change", [
    _copy_in_place,
    lambda b: b.load_state_dict({k: v.clone() for k, v in b.state_dict().items()}),
    _assign_data,  # moves the parameter, unseen: the documented limit
    lambda b: b.double(),  # likewise (assigns .data)
], ids=["copy_", "load_state_dict", ".data", ".double()"])
def test_what_registers_nothing_leaves_the_generation(change):
    assert not _bumps(change)


def test_the_hooks_hold_no_module():
    module_watch.start()
    block = _Block()
    block.lin.weight = nn.Parameter(torch.zeros(3, 3))
    ref = weakref.ref(block)
    del block
    gc.collect()
    assert ref() is None
