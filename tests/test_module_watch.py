"""The count of module registrations that tells CUDA-graph steps to compare the parameters
(compilation/module_watch.py): what bumps it, what does not, and that its hooks wait for the first
graph step of the process."""
from __future__ import annotations

import gc
import os
import pathlib
import subprocess
import sys
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
    lambda b: b.double(),  # assigns .data: counted by the wrapped Module._apply
    lambda b: b.lin.to(torch.float16),  # part of a model
    lambda b: b.to("cpu"),  # moves nothing, counted all the same
    lambda b: setattr(b.lin.weight, "data", torch.zeros(3, 3)),  # nn.Parameter's counting __setattr__
    lambda b: _in_place(b.lin.weight.set_, torch.zeros(3, 3)),  # nn.Parameter's counting in-place methods
    lambda b: _in_place(b.lin.weight.as_strided_, (3, 3), (1, 3)),
    lambda b: _in_place(b.lin.weight.t_),
    lambda b: _in_place(b.lin.bias.unsqueeze_, 0),
    lambda b: torch.utils.swap_tensors(b.lin.weight, nn.Parameter(torch.zeros(3, 3))),  # the counting swap
], ids=["parameter attribute", "register_parameter", "buffer attribute", "register_buffer", "submodule",
        "load_state_dict assign", ".double()", "a submodule's .to(dtype)", ".to(same device)", "parameter .data",
        "parameter set_", "parameter as_strided_", "parameter t_", "parameter unsqueeze_", "swap_tensors"])
def test_a_registration_bumps_the_generation(change):
    assert _bumps(change)


def _in_place(method, *args):
    with torch.no_grad():
        assert method(*args) is method.__self__  # returns the tensor, as torch's own


def _copy_in_place(b):
    with torch.no_grad():
        b.lin.weight.copy_(torch.zeros(3, 3))


def _set_grad(b):
    b.lin.weight.grad = torch.zeros(3, 3)
    b.scale.some_attribute = 1


@pytest.mark.parametrize("change", [
    _copy_in_place,
    lambda b: b.load_state_dict({k: v.clone() for k, v in b.state_dict().items()}),
    _set_grad,  # attributes other than .data
    lambda b: setattr(b.scale, "data", torch.zeros(3)),  # a buffer is a plain tensor: the graph steps compare it
    lambda b: _in_place(b.scale.set_, torch.zeros(3)),  # and each decorated call its layout (model_tensors.py)
], ids=["copy_", "load_state_dict", "other tensor attributes", "buffer .data", "buffer set_"])
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


_WHEN_INSTALLED = r"""
import sys

import torch
import torch.nn.modules.module as registry
import compileattn as ca
from compileattn.compilation import module_watch
from compileattn.models.opt import OPTConfig, OPTForCausalLM
from compileattn.testing import simulated_cuda_graphs


def installed():
    return [module_watch._count_registration in hooks.values()
            for hooks in (registry._global_parameter_registration_hooks, registry._global_buffer_registration_hooks,
                          registry._global_module_registration_hooks)] + [
        getattr(torch.nn.Module._apply, "counts_for_module_watch", False),
        getattr(torch.nn.Parameter.__setattr__, "counts_for_module_watch", False),
        all(getattr(getattr(torch.nn.Parameter, name), "counts_for_module_watch", False)
            for name in module_watch.COUNTED_METHODS),
        getattr(torch._C._swap_tensor_impl, "counts_for_module_watch", False)]


def compile_and_step(decorated, **options):
    model = OPTForCausalLM(OPTConfig.tiny(), seed=0)
    caches = ca.allocate_kv_caches(model.attention_specs(), 8, 16, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=16, num_blocks=8, max_num_tokens=8, max_blocks_per_seq=2)
    config = ca.CompileConfig(piece_compiler="eager", compile_kernels_ahead=False, **options)
    if decorated:
        fn = ca.compile(lambda input_ids, positions: model(input_ids, positions),
                        dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=config)
    else:
        fn = torch.compile(model, backend="compileattn", options={"config": config})
    md = builder.build([ca.SequenceStep(1, 3, [2 * i, 2 * i + 1]) for i in range(4)], pad_to=4)
    ids, positions = torch.zeros(4, dtype=torch.long), torch.arange(4) + 3
    for t in (ids, positions):
        torch._dynamo.mark_dynamic(t, 0)
    with torch.no_grad(), ca.set_forward_context(md, caches):
        fn(ids, positions)


assert installed() == [False] * 7, "at import"
if sys.argv[1] == "decorated":
    compile_and_step(True, cudagraph_mode="none")
    assert installed() == [True] * 7, "after a decorated function's first compile"
    assert not {"__setattr__", *module_watch.COUNTED_METHODS} & set(torch.Tensor.__dict__), "torch.Tensor left alone"
else:
    compile_and_step(False, cudagraph_mode="none")
    assert installed() == [False] * 7 and not module_watch.started(), "after a step without graphs"
    with simulated_cuda_graphs():
        compile_and_step(False, cudagraph_mode="full_and_piecewise", max_capture_size=8)
    assert installed() == [True] * 7, "after the first graph step"
print("ok")
"""


@pytest.mark.parametrize("how", ["decorated", "torch.compile"])
def test_the_hooks_are_installed_by_a_decorated_compile_or_the_first_graph_step_not_before(how):
    """In a process of its own: the test's own process may have captured graphs already. A
    ``@compileattn.compile`` function's per-call look at its models reads the count from its first
    compile (``model_tensors.py``); ``torch.compile`` needs it from its first graph step."""
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _WHEN_INSTALLED, how], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
