"""``.data =`` and same-class submodule replacements after capture, on the direct path and the
ordinary one (compilation/replay.py, dispatch.py, model_tensors.py).

A CUDA graph reads its inputs where, and as, they were at capture. ``t.data = other`` keeps the
tensor object (so no registration hook runs and ``t._version`` stays) but gives it other storage,
or, for ``w.data = w.t()`` of a square ``w``, the same address with other strides. After one, a
step must return what eager returns or raise; never the captured graph's answer from the old
memory or layout. With CUDA graphs simulated on the CPU a replay re-runs the captured forward on
the captured tensors, so a stale replay shows as a mismatch with eager.
"""
from __future__ import annotations

import pytest
import torch

import compileattn as ca
from compileattn.compilation import module_watch
from compileattn.compilation.cudagraph import CudaGraphAddressError
from compileattn.compilation.decorator import RecompileError
from compileattn.models.opt import OPTConfig, OPTForCausalLM
from compileattn.testing import PersistentInputs, assert_matches_eager

from test_replay import Scaled, Setup


class Mixed(OPTForCausalLM):
    """Reads a square buffer (``mix.data = mix.t()`` keeps its address)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        n = self.config.hidden_size
        self.register_buffer("mix", torch.randn(n, n, generator=torch.Generator().manual_seed(3)) / n ** 0.5)

    def forward(self, input_ids, positions):
        return super().forward(input_ids, positions) @ self.mix


def _setup(cls, direct):
    s = Setup(cls, direct=direct)
    s.eager = cls(OPTConfig.tiny(), seed=0)
    s.warm(4)
    with ca.counters.expect(full_graph_direct_steps=int(direct)):
        s.step(s.decode(4))
    return s


def _served_right_or_refused(s, refused=(CudaGraphAddressError, RecompileError)):
    """Two steps, each matching eager or raising one of ``refused``; returns what each did."""
    did = []
    with torch.no_grad():
        for _ in range(2):
            try:
                assert_matches_eager(s.eager, s.fn, s.builder, s.caches, s.decode(4), s.inputs, pad_to=4)
                did.append("served")
            except refused as exc:
                did.append(type(exc).__name__)
    return did


DIRECT = pytest.mark.parametrize("direct", [True, False], ids=["direct", "ordinary"])


# (a) ``buffer.data = other`` of the same layout ------------------------------------------------

@DIRECT
def test_buffer_data_assigned_is_refused_as_a_replaced_buffer_is(simulated_graphs, direct):
    s = _setup(Scaled, direct)
    for model in (s.model, s.eager):
        model.scale.data = torch.linspace(2.0, -1.0, model.config.hidden_size)
    with ca.counters.expect(full_graph_direct_steps=0):
        assert _served_right_or_refused(s) == ["CudaGraphAddressError"] * 2


def _write_buffers_table(model, new):
    model._buffers["scale"] = new  # no registration hook runs


def _set_storage(model, new):
    with torch.no_grad():
        model.scale.set_(new)  # the same tensor object, other storage, and no ``.data`` assignment


@DIRECT
@pytest.mark.parametrize("move", [_write_buffers_table, _set_storage], ids=["_buffers", "set_"])
def test_buffer_moved_unregistered_is_refused_as_a_replaced_buffer_is(simulated_graphs, direct, move):
    """No hook sees these: the direct path compares the graph's buffers itself, as the ordinary
    path does (``ModelTensors.buffers``)."""
    s = _setup(Scaled, direct)
    for model in (s.model, s.eager):
        move(model, torch.linspace(2.0, -1.0, model.config.hidden_size))
    with ca.counters.expect(full_graph_direct_steps=0):
        assert _served_right_or_refused(s) == ["CudaGraphAddressError"] * 2


def test_buffer_compared_per_direct_step_is_the_graphs(simulated_graphs):
    s = _setup(Scaled, True)
    learned = s.fn._site.direct.learned[4]  # noqa: SLF001
    assert [(read(), shape, stride) for read, _, shape, stride in learned.others] == [
        (s.model.scale, s.model.scale.shape, (1,))]
    plain = _setup(OPTForCausalLM, True)  # no buffer: nothing compared
    assert plain.fn._site.direct.learned[4].others == ()  # noqa: SLF001


@pytest.mark.parametrize("cls", [Scaled, OPTForCausalLM])
def test_strides_compared_per_ordinary_step_are_the_buffers(simulated_graphs, cls):
    """The dispatcher compares the strides of the graph inputs Dynamo's code gathers (the buffer),
    not those of the call's arguments (token ids, positions: Dynamo's guards' and argcheck's) nor
    of parameters (the count's)."""
    s = _setup(cls, False)
    [dispatcher] = s.fn._site.runtimes  # noqa: SLF001
    with_strides = {dispatcher._input_names[i] for _, entries in dispatcher._captured_at.items()  # noqa: SLF001
                    for i, _, stride in entries if stride is not None}
    assert len(with_strides) == (cls is Scaled) and all("scale" in name for name in with_strides), with_strides


# (a) ``param.data = other`` of the same layout, a parameter neither first nor last ---------------

@DIRECT
def test_middle_parameter_data_assigned_is_captured_again(simulated_graphs, direct):
    s = _setup(OPTForCausalLM, direct)
    new = torch.randn(64, 64, generator=torch.Generator().manual_seed(5)) * 0.2
    for model in (s.model, s.eager):
        model.model.layers[0].self_attn.out_proj.weight.data = new.clone()  # counted: module_watch.py
    with ca.counters.expect(parameter_recaptures=1, full_graph_direct_steps=0):
        assert _served_right_or_refused(s) == ["served"] * 2


def _set_other_storage(w, new):
    w.set_(new)


def _restride(w, new):
    w.as_strided_(w.shape, (1, w.shape[0]))  # the square weight read transposed, at the same address


@DIRECT
@pytest.mark.parametrize("change, did", [(_set_other_storage, ["served"] * 2), (_restride, ["RecompileError"] * 2)],
                         ids=["set_", "as_strided_"])
def test_middle_parameter_changed_in_place_is_captured_again_or_refused(simulated_graphs, direct, change, did):
    """Neither a registration nor a ``.data`` assignment, and not the first or last parameter: the
    graphs replayed the old storage or layout (a wrong answer, no error) until ``nn.Parameter``'s
    in-place methods that change them were counted too (module_watch.py)."""
    s = _setup(OPTForCausalLM, direct)
    new = torch.randn(64, 64, generator=torch.Generator().manual_seed(5)) * 0.2
    with torch.no_grad():
        for model in (s.model, s.eager):
            change(model.model.layers[0].self_attn.out_proj.weight, new.clone())
    with ca.counters.expect(parameter_recaptures=int(did[0] == "served"), full_graph_direct_steps=0):
        assert _served_right_or_refused(s) == did


# (b) same address, other strides --------------------------------------------------------------

@DIRECT
def test_square_parameter_transposed_through_data(simulated_graphs, direct):
    s = _setup(OPTForCausalLM, direct)
    for model in (s.model, s.eager):
        w = model.model.layers[0].self_attn.out_proj.weight
        ptr = w.data_ptr()
        w.data = w.t()
        assert w.data_ptr() == ptr and w.stride() == (1, 64)
    assert _served_right_or_refused(s) == ["RecompileError"] * 2  # the layout compared: model_tensors.py


@DIRECT
def test_square_buffer_transposed_through_data(simulated_graphs, direct):
    """A buffer is a plain tensor: nothing counts its ``.data`` assignment (module_watch.py); every
    call compares its strides (model_tensors.py), before the graph steps would (with its address)."""
    s = _setup(Mixed, direct)
    generation = module_watch.generation
    for model in (s.model, s.eager):
        ptr = model.mix.data_ptr()
        model.mix.data = model.mix.t()
        assert model.mix.data_ptr() == ptr
    assert module_watch.generation == generation
    with ca.counters.expect(full_graph_direct_steps=0):
        assert _served_right_or_refused(s) == ["RecompileError"] * 2


class Summed(OPTForCausalLM):
    """Reads a buffer of rows through their sum (``rows.data = rows[:2]`` keeps address and strides)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("rows", torch.linspace(0.1, 0.4, 4 * self.config.hidden_size).reshape(4, -1))

    def forward(self, input_ids, positions):
        return super().forward(input_ids, positions) * self.rows.sum(0)


@DIRECT
def test_buffer_reshaped_at_the_same_address_and_strides(simulated_graphs, direct):
    """Fewer rows of the same buffer: same address, same strides, another shape; the graphs summed
    four rows. Every call compares the shape (model_tensors.py), as the graph steps do."""
    s = _setup(Summed, direct)
    for model in (s.model, s.eager):
        ptr, stride = model.rows.data_ptr(), model.rows.stride()
        model.rows.data = model.rows[:2]
        assert (model.rows.data_ptr(), model.rows.stride()) == (ptr, stride)
    with ca.counters.expect(full_graph_direct_steps=0):
        assert _served_right_or_refused(s) == ["RecompileError"] * 2


# (c) a submodule replaced by one of the same class, other Python attribute values --------------

class Gain(torch.nn.Module):
    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, x):
        return x * self.alpha


class Gained(OPTForCausalLM):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = Gain(2.0)

    def forward(self, input_ids, positions):
        return self.gain(super().forward(input_ids, positions))


@DIRECT
def test_submodule_of_the_same_class_replaced_serves_the_traced_values(simulated_graphs, direct):
    """A documented limit of every compile that skips Dynamo's guards (model_tensors.py), pinned on
    both paths alike: a replaced ``gain`` of the same class and tensor layouts is served with the
    trace's ``alpha`` (2.0, what ``s.eager`` still holds), not the new one. (Was a strict xfail: the
    conftest fails a run on any skip or xfail of a test not marked cuda.) Should this start to
    fail because a step refuses or follows the new value, turn it round."""
    s = _setup(Gained, direct)
    s.model.gain = Gain(3.0)
    assert _served_right_or_refused(s, refused=()) == ["served"] * 2


# through torch.compile (no decorator): Dynamo's code passes the tensor object, the dispatcher
# compares parameters only after a count moved -------------------------------------------------

def test_middle_parameter_data_assigned_through_torch_compile_is_captured_again(simulated_graphs):
    model = OPTForCausalLM(OPTConfig.tiny(), seed=0)
    s = Setup()
    compiled = torch.compile(model, backend="compileattn", fullgraph=True,
                             options=dict(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=[1, 2, 4, 8],
                                          piece_compiler="eager"))
    inputs = PersistentInputs(model.config.vocab_size, 16, positions=(1, 40), mark_dynamic=True)

    def step():
        with torch.no_grad():
            assert_matches_eager(model, compiled, s.builder, s.caches, s.decode(4), inputs, pad_to=4)

    for _ in range(3):
        step()
    new = torch.randn(64, 64, generator=torch.Generator().manual_seed(5)) * 0.2
    model.model.layers[0].self_attn.out_proj.weight.data = new
    with ca.counters.expect(parameter_recaptures=1):
        step()
        step()


@DIRECT
@pytest.mark.parametrize("change", [lambda t: t.view(torch.int32), lambda t: t.double()], ids=["int32 view", "double"])
def test_closure_tensor_given_another_dtype_through_data(simulated_graphs, direct, change):
    """A closure tensor is a graph input compared per graph step by address, shape and strides
    only: ``held.data = held.view(torch.int32)`` keeps all three, and the graph (on the direct path
    too) replayed with it, reading its bits as float32. Every call compares its dtype too
    (``model_tensors.py``), refused by name before any step runs, as a float64 one is (which the
    graph step refused only as a moved graph input)."""
    s = Setup(direct=direct)
    model, held = s.model, torch.linspace(0.0, 1.0, 8)

    def forward(input_ids, positions):
        return model(input_ids, positions) + held.sum()

    s.fn = ca.compile(forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=s.config)
    s.warm(4)
    with ca.counters.expect(full_graph_direct_steps=int(direct)):
        s.step(s.decode(4))
    held.data = change(held.data)
    with pytest.raises(RecompileError, match=r"closure variable 'held' was torch\.float32 \(8,\) on cpu at the first "
                                             r"call and is torch\.(int32|float64) \(8,\) on cpu now"):
        s.step(s.decode(4))


def test_a_parameter_data_assignment_counts_as_a_registration():
    module_watch.start()
    p = torch.nn.Parameter(torch.zeros(3))
    generation = module_watch.generation
    p.data = torch.ones(3)
    assert module_watch.generation == generation + 1
    assert isinstance(p, torch.nn.Parameter) and torch.equal(p, torch.ones(3))
    p.grad, p.some_attribute = None, 1  # other attributes: assigned as before, not counted
    assert p.some_attribute == 1 and module_watch.generation == generation + 1
    with pytest.raises(TypeError):
        p.data = 1  # refused by torch as before, and counted (harmless: one comparison more)
    assert module_watch.generation == generation + 2


def test_plain_tensors_are_left_alone():
    """Only ``nn.Parameter`` has the counting ``__setattr__``: a plain tensor's attribute assignments,
    ``.data`` included (a buffer's: the graph steps compare those), run torch's own, uncounted."""
    module_watch.start()
    assert "__setattr__" not in torch.Tensor.__dict__ and torch.Tensor.__setattr__ is object.__setattr__
    assert getattr(torch.nn.Parameter.__dict__.get("__setattr__"), "counts_for_module_watch", False)
    t, b = torch.zeros(3), torch.nn.Buffer(torch.zeros(3))
    assert type(b) is torch.Tensor  # torch 2.13's Buffer makes a plain tensor
    generation = module_watch.generation
    t.data, b.data = torch.ones(3), torch.ones(3)
    t.some_attribute, t.grad = 1, None
    assert module_watch.generation == generation and t.some_attribute == 1 and torch.equal(b, torch.ones(3))


def test_parameter_subclasses_are_counted():
    module_watch.start()
    lazy = torch.nn.LazyLinear(4)
    assert isinstance(lazy.weight, torch.nn.parameter.UninitializedParameter)
    generation = module_watch.generation
    lazy(torch.zeros(2, 3))  # materialize() assigns .data, then turns the class into Parameter
    assert module_watch.generation > generation
    assert type(lazy.weight) is torch.nn.Parameter and lazy.weight.shape == (4, 3)

    class Tagged(torch.nn.Parameter):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)

    p = Tagged(torch.zeros(2))
    generation = module_watch.generation
    p.data = torch.ones(2)
    assert module_watch.generation == generation + 1 and type(p) is Tagged and torch.equal(p, torch.ones(2))


def test_parameters_pickle_and_copy_as_before():
    import copy
    import io
    import pickle

    module_watch.start()
    p = torch.nn.Parameter(torch.arange(3.0), requires_grad=False)
    p.tag = "w"
    for q in (copy.deepcopy(p), copy.copy(p), pickle.loads(pickle.dumps(p)), torch.load(_saved(p), weights_only=False)):
        assert type(q) is torch.nn.Parameter and torch.equal(q, p) and not q.requires_grad
    assert [getattr(q, "tag", None) for q in (copy.copy(p), pickle.loads(pickle.dumps(p)))] == ["w", "w"]
    assert not hasattr(copy.deepcopy(p), "tag")  # Parameter.__deepcopy__ never copied the __dict__
    model = torch.nn.Linear(3, 2)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    assert type(restored.weight) is torch.nn.Parameter and torch.equal(restored.weight, model.weight)
    assert type(copy.deepcopy(model).weight) is torch.nn.Parameter


def _saved(obj):
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer
