"""A model converted or moved after its first call (compilation/model_tensors.py): refused by name
where its compiled code would read the new storage as the old dtype, served where only addresses
changed, CUDA graphs captured again then."""
from __future__ import annotations

import dataclasses

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


class Stack(nn.Module):
    """Three linears: converting the middle one moves neither the first nor the last parameter,
    the two tensors the per-call look reads."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


@pytest.mark.parametrize("change,was", [
    (lambda m: m.layers[1].double(), r"layers\.1\.weight \(and 1 more\) was torch\.float32 \(8, 8\) on cpu at the "
                                     r"first call and is torch\.float64"),
    (lambda m: m.layers[1].weight.set_(m.layers[1].weight.detach().t().contiguous().t()),
     r"layers\.1\.weight was .* with strides \(8, 1\) at the first call and is .* with strides \(1, 8\) now"),
    (lambda m: m.layers[1].weight.t_(),
     r"layers\.1\.weight was .* with strides \(8, 1\) at the first call and is .* with strides \(1, 8\) now"),
], ids=["double", "set_ column-major", "t_"])
def test_a_change_of_part_of_a_model_is_refused_by_name(change, was):
    """A change of the middle layer moves neither watched tensor and registers nothing, so the
    per-call look alone would miss it: ``Module._apply`` (``model.layers[1].double()``) and
    ``nn.Parameter``'s in-place methods that change storage or layout (``set_``, ``t_``) are
    counted (module_watch.py), so the next call compares. Unrefused, Inductor's code read the
    middle weight in its old dtype or order, or failed inside its ``assert_size_stride``."""
    model = Stack()
    fn = ca.compile(lambda x: model(x), dynamic_arg_dims={"x": 0}, config=CONFIG)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(2):  # the second call settles the count the compile itself moved
            torch.testing.assert_close(fn(x), Stack.forward(model, x))
        change(model)
        with pytest.raises(RecompileError, match=rf"Stack's parameter {was}"):
            fn(x)


def test_a_part_converted_back_is_served_from_its_new_storage():
    """``model.layers[1].double()`` then ``.float()``: the layout it was compiled for, in new
    storage, which the compiled code reads where it is now."""
    model = Stack()
    fn = ca.compile(lambda x: model(x), dynamic_arg_dims={"x": 0}, config=CONFIG)
    x = torch.randn(4, 8)
    with torch.no_grad():
        fn(x)
        model.layers[1].double()
        with pytest.raises(RecompileError):
            fn(x)
        model.layers[1].float()
        torch.testing.assert_close(fn(x), Stack.forward(model, x))


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


class Scaled(nn.Module):
    """A submodule of its own, replaceable: its parameter's layout, or its class, may change."""

    def __init__(self, dtype=torch.float32, act: type = nn.ReLU):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 3.0, dtype=dtype))
        self.act = act()

    def forward(self, x):
        return self.act(x * self.w - 1.0)


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.scaled = Scaled()

    def forward(self, x):
        return self.scaled(x)


X = torch.tensor([[1.0, -1.0, 1.0, -1.0], [0.5, 2.0, -3.0, 0.0]])  # (tokens, 4): dim 0 dynamic


@pytest.mark.parametrize("replacement, refused", [
    (lambda: Scaled(torch.float64), r"Holder's parameter scaled\.w was torch\.float32 \(4,\) on cpu at the first "
                                    r"call and is torch\.float64 \(4,\) on cpu now"),
    (lambda: Scaled(act=nn.GELU), r"Holder's submodule scaled\.act was a ReLU at the first call and is a GELU now"),
])
def test_a_submodule_replaced_after_the_first_call_is_refused_by_name(replacement, refused):
    """The watched parameter was the old submodule's (held weakly, unchanged): the new float64 one
    was read as float32, and a GELU in the ReLU's place was never traced; neither raised."""
    model = Holder()
    fn = ca.compile(lambda x: model(x), dynamic_arg_dims={"x": 0}, config=CONFIG)
    with torch.no_grad():
        torch.testing.assert_close(fn(X), model(X))
        model.scaled = replacement()
        with pytest.raises(RecompileError, match=refused):
            fn(X)


def test_a_submodule_replaced_by_one_alike_is_served_with_its_tensors():
    model = Holder()
    fn = ca.compile(lambda x: model(x), dynamic_arg_dims={"x": 0}, config=CONFIG)
    with torch.no_grad():
        fn(X)
        model.scaled = Scaled()
        model.scaled.w.fill_(5.0)
        torch.testing.assert_close(fn(X), model(X))
        nn.Linear(2, 2)  # any module made anywhere registers: the next call compares once, and serves
        torch.testing.assert_close(fn(X), model(X))


def _tie_weight(model):
    model.layers[2].weight = model.layers[0].weight


def _tie_module(model):
    model.layers[2] = model.layers[0]


@pytest.mark.parametrize("tie, refused", [
    (_tie_weight, r"Stack's tie of parameter layers\.2\.weight was to layers\.0\.weight at the first call and is "
                  r"absent now"),
    (_tie_module, r"Stack's submodule layers\.2 \(and 2 more\) was absent at the first call and is a Linear now"),
])
def test_layers_untied_after_the_first_call_are_refused_by_name(tie, refused):
    """Dynamo passes a tensor the model reaches under two names as one graph input: untied, the
    second name's own tensor of the same layout would never be read."""
    model = Stack()
    tie(model)
    fn = ca.compile(lambda x: model(x), dynamic_arg_dims={"x": 0}, config=CONFIG)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), Stack.forward(model, x))
        model.layers[2] = nn.Linear(8, 8)
        with pytest.raises(RecompileError, match=refused):
            fn(x)


GLOBAL_MODEL = None


def _through_the_global(x):
    return GLOBAL_MODEL(x)


def test_a_model_read_from_a_module_global_is_watched(monkeypatch):
    """The script layout: ``model = ...`` at module level, the decorated step reads it."""
    monkeypatch.setattr(__import__(__name__), "GLOBAL_MODEL", Holder())
    fn = ca.compile(_through_the_global, dynamic_arg_dims={"x": 0}, config=CONFIG)
    with torch.no_grad():
        torch.testing.assert_close(fn(X), GLOBAL_MODEL(X))
        GLOBAL_MODEL.double()
        with pytest.raises(RecompileError, match="Holder's parameter scaled.w was torch.float32"):
            fn(X)


def test_an_attribute_named_like_a_module_global_does_not_watch_the_global(monkeypatch):
    """``self.GLOBAL_MODEL(x)`` names an attribute, not the module global of that name: converting
    the global must not refuse calls of a model that never reads it."""
    monkeypatch.setattr(__import__(__name__), "GLOBAL_MODEL", Holder())

    class Runner(nn.Module):
        def __init__(self):
            super().__init__()
            self.GLOBAL_MODEL = Holder()

        def forward(self, x):
            return self.GLOBAL_MODEL(x)

    runner = ca.compile(Runner, dynamic_arg_dims={"x": 0}, config=CONFIG)()
    with torch.no_grad():
        runner(X)
        GLOBAL_MODEL.double()
        torch.testing.assert_close(runner(X), runner.GLOBAL_MODEL(X))


class _Stepper:
    """Not a module: a runner object whose decorated method calls the model it holds."""

    def __init__(self, model):
        self.model = model

    @ca.compile(dynamic_arg_dims={"x": 0}, config=CONFIG)
    def step(self, x):
        return self.model(x)


def _held(how: str, model: nn.Module):
    """A compiled callable reaching ``model`` through something that is not itself a module."""
    if how == "plain_instance":
        stepper = _Stepper(model)
        return stepper, stepper.step
    if how == "bound_method":
        forward = model.forward
        return None, ca.compile(lambda x: forward(x), dynamic_arg_dims={"x": 0}, config=CONFIG)

    def inner(x):
        return model(x)

    return None, ca.compile(lambda x: inner(x), dynamic_arg_dims={"x": 0}, config=CONFIG)


@pytest.mark.parametrize("how", ["plain_instance", "bound_method", "closed_over_function"])
def test_a_model_reached_through_an_object_a_method_or_a_function_is_watched(how):
    """A runner's ``self.model``, a closed-over ``model.forward`` or a helper closing over the
    model: none was found among the models to watch, so converting the model after the first call
    ran the float32 code over float64 storage (values ~1e20, no error)."""
    model = Holder()
    keep, fn = _held(how, model)
    with torch.no_grad():
        torch.testing.assert_close(fn(X), model(X))
        model.double()
        with pytest.raises(RecompileError, match="Holder's parameter scaled.w was torch.float32"):
            fn(X)
    del keep


class Projected(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * 2


@pytest.mark.parametrize("size_asserts", [True, False])
def test_a_parameter_given_other_strides_after_the_first_call_is_refused_by_name(size_asserts):
    """Column-major storage of the same shape (``w.data = w.t().contiguous().t()``) compared equal:
    Inductor's code then failed on its own stride assertion, or without it (``size_asserts``
    off) read the weight transposed, no error. Strides of size-1 dims are free, as for Inductor."""
    config = dataclasses.replace(CONFIG, inductor_options={"size_asserts": size_asserts})
    model = Projected()
    fn = ca.compile(lambda x: model(x), dynamic_arg_dims={"x": 0}, config=config)
    with torch.no_grad():
        torch.testing.assert_close(fn(X), model(X))
        weight = model.lin.weight
        weight.data = weight.data.t().contiguous().t()
        with pytest.raises(RecompileError, match=r"Projected's parameter lin\.weight was torch\.float32 \(4, 4\) on "
                                                 r"cpu with strides \(4, 1\) at the first call and is torch\.float32 "
                                                 r"\(4, 4\) on cpu with strides \(1, 4\) now"):
            fn(X)
        weight.data = weight.data.contiguous()
        torch.testing.assert_close(fn(X), model(X))
        bias = model.lin.bias
        bias.data = torch.empty(4, 2)[:, 0].copy_(bias.data)  # a size > 1 dim's stride: refused too
        with pytest.raises(RecompileError, match=r"parameter lin\.bias"):
            fn(X)
    assert ModelTensors._tensors_of(nn.Linear(1, 1)) == ModelTensors._tensors_of(
        _with_data(nn.Linear(1, 1), torch.empty(3, 4)[:1, :1]))  # a size-1 dim's stride is free


class Mixed(nn.Module):
    """Reads a square buffer in an Inductor kernel of its own making."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mix", torch.linspace(-1.0, 1.0, 16).reshape(4, 4))

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.mix.sum(0) + 1


@pytest.mark.parametrize("change, refused", [
    (lambda b: b.double(), r"was torch\.float32 \(4, 4\) on cpu at the first call and is torch\.float64 \(4, 4\)"),
    (lambda b: b.half(), r"was .* and is torch\.float16 \(4, 4\) on cpu now"),
    (lambda b: b.t(), r"was .* with strides \(4, 1\) at the first call and is .* with strides \(1, 4\) now"),
    (lambda b: b[:2], r"was .* and is torch\.float32 \(2, 4\) on cpu now"),
], ids=["double", "half", "transposed", "fewer rows"])
def test_a_buffer_given_another_layout_through_data_is_refused_by_name(change, refused):
    """``buffer.data = other`` registers nothing and leaves the parameters where they were (buffers
    are plain tensors: module_watch.py), and steps without CUDA graphs compare no address: every
    call compares the buffers' layouts. Without it Inductor's kernel read the float64 or float16
    buffer as float32 (a wrong answer, no error), and the transposed or shorter one failed inside
    its code (``assert_size_stride``)."""
    model = Mixed()
    fn = ca.compile(lambda x: model(x), dynamic_arg_dims={"x": 0}, config=CONFIG)
    with torch.no_grad():
        for _ in range(2):  # the second call settles the count the compile itself moved
            torch.testing.assert_close(fn(X), Mixed.forward(model, X))
        model.mix.data = change(model.mix.data)
        with pytest.raises(RecompileError, match=r"Mixed's buffer mix " + refused):
            fn(X)
        model.mix.data = torch.linspace(1.0, -1.0, 16).reshape(4, 4)  # the first layout, new storage: served
        torch.testing.assert_close(fn(X), Mixed.forward(model, X))


class Plain(nn.Module):
    """Reads a square tensor held in a plain attribute (not a buffer) in an Inductor kernel."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mix = torch.linspace(-1.0, 1.0, 16).reshape(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.mix.sum(0) + 1


_PLAIN = torch.linspace(-1.0, 1.0, 16).reshape(4, 4)


@pytest.mark.parametrize("where", ["attribute", "closure", "global"])
@pytest.mark.parametrize("how", ["rebound", "data"])
@pytest.mark.parametrize("change, refused", [
    (lambda t: t.double(), r"was torch\.float32 \(4, 4\) on cpu at the first call and is torch\.float64 \(4, 4\)"),
    (lambda t: t.t(), r"was .* with strides \(4, 1\) at the first call and is .* with strides \(1, 4\) now"),
    (lambda t: t[:2], r"was .* and is torch\.float32 \(2, 4\) on cpu now"),
], ids=["double", "transposed", "fewer rows"])
def test_a_plain_tensor_given_another_layout_is_refused_by_name(where, how, change, refused):
    """A tensor in a plain module attribute, a closure variable or a global is a graph input that
    Dynamo's code reads at every call, compiled for the first call's layout: given another (rebound,
    or through ``.data``), Inductor's kernel read float64 as float32 (a wrong answer, no error) and
    the transposed or shorter one failed inside its code (``assert_size_stride``). Every call compares
    their layouts, as the buffers'; one of the first layout is served."""
    global _PLAIN
    _PLAIN = torch.linspace(-1.0, 1.0, 16).reshape(4, 4)
    model = Plain()
    held = torch.linspace(-1.0, 1.0, 16).reshape(4, 4)
    if where == "attribute":
        fn, name = (lambda x: model(x)), "Plain's attribute 'mix'"
    elif where == "closure":
        fn, name = (lambda x: torch.relu(model.lin(x)) * held.sum(0) + 1), "closure variable 'held'"
    else:
        fn, name = (lambda x: torch.relu(model.lin(x)) * _PLAIN.sum(0) + 1), "global '_PLAIN'"

    def put(t):
        nonlocal held
        global _PLAIN
        if how == "data":
            {"attribute": model.mix, "closure": held, "global": _PLAIN}[where].data = t
        elif where == "attribute":
            model.mix = t
        elif where == "closure":
            held = t
        else:
            _PLAIN = t

    compiled = ca.compile(fn, dynamic_arg_dims={"x": 0}, config=CONFIG)
    with torch.no_grad():
        torch.testing.assert_close(compiled(X), fn(X))
        put(change({"attribute": model.mix, "closure": held, "global": _PLAIN}[where]))
        if where == "global" and how == "rebound":  # test_a_global_rebound_is_refused
            refused = "holds another tensor than at the first call"
        with pytest.raises(RecompileError, match=f"{name} " + refused):
            compiled(X)
        if not (where == "global" and how == "rebound"):
            put(torch.linspace(1.0, -1.0, 16).reshape(4, 4))  # the first layout: served with the new values
            torch.testing.assert_close(compiled(X), fn(X))


def test_a_global_rebound_is_refused():
    """Dynamo's ahead-of-time code runs with its own copy of the module globals: a global tensor
    rebound, even to one of the same layout, was not seen (the first call's values, no error). An
    item of a global list is read through the shared list: served."""
    global _PLAIN
    _PLAIN = torch.ones(4)
    items = [torch.ones(4)]
    globals()["_ITEMS"] = items
    fn = eval("lambda x: x * _PLAIN + _ITEMS[0]", globals())
    compiled = ca.compile(fn, dynamic_arg_dims={"x": 0}, config=CONFIG)
    with torch.no_grad():
        torch.testing.assert_close(compiled(X), fn(X))
        items[0] = torch.full((4,), 2.0)
        torch.testing.assert_close(compiled(X), fn(X))
        _PLAIN = torch.full((4,), 3.0)
        with pytest.raises(RecompileError, match=r"global '_PLAIN' holds another tensor than at the first call, "
                                                 r"which the compiled code keeps reading"):
            compiled(X)


def _with_data(module: nn.Module, data: torch.Tensor) -> nn.Module:
    module.weight.data = data
    return module


def _rebindable(how: str, model: nn.Module):
    """A compiled callable and a function putting another model where its code looks ``model`` up."""
    if how == "runner_attribute":
        stepper = _Stepper(model)
        return stepper.step, lambda other: setattr(stepper, "model", other)

    def put(other):
        nonlocal model
        model = other

    return ca.compile(lambda x: model(x), dynamic_arg_dims={"x": 0}, config=CONFIG), put


@pytest.mark.parametrize("how", ["closure_variable", "runner_attribute"])
def test_another_model_put_where_the_compiled_code_looks_it_up_is_compared_with_the_first(how):
    """``model = load(...)`` again in the function that made the compiled closure, or a runner's
    ``self.model = ...``: Dynamo's code looks the model up at every call and ran the float32 code
    over the new float64 model (~1e20), while the watch looked at the first model. One alike is
    served with its own weights."""
    fn, put = _rebindable(how, Holder())
    with torch.no_grad():
        fn(X)
        alike = Holder()
        alike.scaled.w.fill_(-2.0)
        put(alike)
        torch.testing.assert_close(fn(X), alike(X))
        put(Holder().double())
        with pytest.raises(RecompileError, match=r"holds another model than at the first call: Holder's parameter "
                                                 r"scaled\.w was torch\.float32 \(4,\) on cpu at the first call and "
                                                 r"is torch\.float64"):
            fn(X)
        put(None)
        with pytest.raises(RecompileError, match=r"held a Holder at the first call and holds a NoneType now"):
            fn(X)
        put(alike)
        torch.testing.assert_close(fn(X), alike(X))


def test_an_untied_model_put_where_a_tied_one_was_is_refused():
    """The compiled code reads the first model's tied weight once, under its first name: a model
    put in its place whose layers have weights of their own would run with one of them twice."""
    tied = Stack()
    _tie_weight(tied)
    fn, put = _rebindable("closure_variable", tied)
    x = torch.randn(4, 8)
    with torch.no_grad():
        fn(x)
        put(Stack())
        with pytest.raises(RecompileError, match=r"holds another model than at the first call: Stack's tie of "
                                                 r"parameter layers\.2\.weight was to layers\.0\.weight"):
            fn(x)


def test_attention_layer_ids_are_left_out_of_the_per_call_layouts():
    """Each attention layer holds its id in a plain attribute (``layer_ids.py``): compared per call
    with the other plain tensors, a 32-layer model's would cost ~16 µs a call, for tensors whose
    values the compile bakes in. A plain tensor beside them is compared."""
    from compileattn.compilation.reach import other_tensors, tensors_reached
    from compileattn.models.opt import OPTConfig, OPTForCausalLM

    model = OPTForCausalLM(OPTConfig.tiny(), seed=0)
    model.scale = torch.ones(3)
    others = other_tensors(tensors_reached([model], None))
    assert sum("layer_id" in where for where, _ in others) == 2
    assert [record[0] for record in ModelTensors([model], (), others)._other_layouts] == \
        ["OPTForCausalLM's attribute 'scale'"]
