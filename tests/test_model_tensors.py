"""A model converted or moved after its first call (compilation/model_tensors.py): refused by name
where its compiled code would read the new storage as the old dtype, served where only addresses
changed, CUDA graphs captured again then."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import compileattn as ca
from compileattn.compilation import module_watch
from compileattn.compilation.decorator import RecompileError
from compileattn.compilation.model_tensors import ModelTensors
from compileattn.testing import assert_matches_eager
from test_replay import Setup

CONFIG = ca.CompileConfig(piece_compiler="inductor", compile_workers=0, compile_sizes=(), compile_kernels_ahead=False)


class Lookup(nn.Module):
    """Token ids in, an embedding gather and a bias out: Inductor reads both tensors in its own
    kernel, and no argument changes dtype with the model."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, ids):
        return self.embed(ids) * 2 + self.bias


def _compiled(how: str):
    """The model and a compiled callable of it: the class decorated, or a function closing over it."""
    if how == "class":
        model = ca.compile(type("CompiledLookup", (Lookup,), {}), dynamic_arg_dims={"ids": 0}, config=CONFIG)()
        return model, model
    model = Lookup()
    return model, ca.compile(lambda ids: model(ids), dynamic_arg_dims={"ids": 0}, config=CONFIG)


@pytest.mark.parametrize("how", ["class", "closure"])
@pytest.mark.parametrize("convert", [lambda m: m.double(), lambda m: m.to(torch.bfloat16)], ids=["double", "to_bf16"])
def test_a_model_converted_after_its_first_call_is_refused_by_name(how, convert):
    model, fn = _compiled(how)
    ids = torch.tensor([1, 5, 7, 2])
    with torch.no_grad():
        torch.testing.assert_close(fn(ids), Lookup.forward(model, ids))
        convert(model)
        with pytest.raises(RecompileError, match=r"Lookup's parameter bias \(and 1 more\) was torch\.float32 "
                                                 r"\(8,\) on cpu at the first call and is torch\.(float64|bfloat16)"):
            fn(ids)
        model.float()  # back as compiled, in new storage: served
        torch.testing.assert_close(fn(ids), Lookup.forward(model, ids))


def test_a_model_passed_as_an_argument_is_watched_too():
    model = Lookup()
    fn = ca.compile(lambda m, ids: m(ids), dynamic_arg_dims={"ids": 0}, config=CONFIG)
    ids = torch.tensor([1, 5, 7, 2])
    with torch.no_grad():
        fn(model, ids)
        model.double()
        with pytest.raises(RecompileError, match=r"parameter bias \(and 1 more\)"):
            fn(model, ids)


def test_watched_at_its_first_and_last_parameter_or_else_buffers():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert [(table, name) for _, table, name, _ in ModelTensors([model])._watched] == \
        [("_parameters", "weight"), ("_parameters", "bias")]
    buffers_only = nn.BatchNorm1d(2, affine=False)
    assert [(table, name) for _, table, name, _ in ModelTensors([buffers_only])._watched] == \
        [("_buffers", "running_mean"), ("_buffers", "num_batches_tracked")]
    tensors = ModelTensors([model, model])  # one model, once
    generation = module_watch.generation
    model[0].weight.data = torch.zeros(2, 2)  # moved, same layout: graph steps are told to compare
    tensors.check()
    assert module_watch.generation == generation + 1
    tensors.check()  # watched at the new address from then on
    assert module_watch.generation == generation + 1


def test_every_parameter_moved_drops_the_cuda_graphs_and_is_served(simulated_graphs):
    """``p.data = new`` for every parameter (a weight sync): the graphs read the old tensors, so the
    next graph step captures them again, on the direct path as on the ordinary."""
    s = Setup()
    s.warm(4)
    with ca.counters.expect(full_graph_direct_steps=1):
        s.step(s.decode(4))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for a, b in zip(s.model.parameters(), s.eager.parameters()):
            a.data = a.data + 0.05 * torch.randn(a.shape, generator=generator)
            b.data = a.data.clone()
        with ca.counters.expect(parameter_recaptures=1, full_graph_direct_steps=0):
            assert_matches_eager(s.eager, s.fn, s.builder, s.caches, s.decode(4), s.inputs, pad_to=4)
        for direct in (0, 1):
            with ca.counters.expect(cudagraph_captures=0, full_graph_direct_steps=direct):
                assert_matches_eager(s.eager, s.fn, s.builder, s.caches, s.decode(4), s.inputs, pad_to=4)
