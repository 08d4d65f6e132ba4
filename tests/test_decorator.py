"""@compileattn.compile: one Dynamo compile, guard-free dispatch, loud errors instead of recompiles.

Most tests use a stand-in backend (runs Dynamo's graph as is and counts graphs), so they test the
decorator and not the piecewise backend; the tests at the end use the real backend.
"""
from __future__ import annotations

import gc
import inspect
import logging
import random
import re
import statistics
import sys
import time

import pytest
import torch
from torch import nn

import compileattn
from compileattn.compilation.decorator import CompiledFunction, RecompileError


class CountingBackend:
    """Stand-in for the compileattn backend: records each graph Dynamo hands over, runs it as is."""

    def __init__(self):
        self.example_inputs = []

    def __call__(self, gm, example_inputs):
        self.example_inputs.append(list(example_inputs))
        return gm.forward

    @property
    def graphs(self) -> int:
        return len(self.example_inputs)


class Toy(nn.Module):
    def __init__(self, hidden: int = 8):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        return self.down(h) + positions[:, None].to(h.dtype)


def compiled_toy(backend, **kw):
    """A decorated subclass of Toy (Toy itself stays eager) and an eager twin with equal weights."""
    cls = compileattn.compile(type("CompiledToy", (Toy,), {}), backend=backend, **kw)
    model = cls()
    eager = Toy()
    eager.load_state_dict(model.state_dict())
    return model, eager


def toy_inputs(n: int, hidden: int = 8, dtype=torch.float32):
    return torch.randn(n, hidden, dtype=dtype), torch.arange(n)


# -- one compile, many token counts ------------------------------------------------------------------

def test_fifty_token_counts_compile_once_and_match_eager():
    backend = CountingBackend()
    model, eager = compiled_toy(backend, dynamic_arg_dims={"x": 0, "positions": 0})
    sizes = [7] + random.Random(0).sample(range(1, 200), 49)  # the compile call needs size >= 2
    with torch.no_grad():
        for n in sizes:
            x, pos = toy_inputs(n)
            torch.testing.assert_close(model(x, pos), eager(x, pos))
    assert backend.graphs == 1
    # The token dim really was traced symbolically (a static graph would be wrong for other sizes).
    assert any(isinstance(e, torch.SymInt) for e in backend.example_inputs[0])


def test_function_decorator_with_keywords_and_dim_lists():
    backend = CountingBackend()

    @compileattn.compile(dynamic_arg_dims={"a": [0, 1], "b": -1}, backend=backend)
    def f(a, b, *, scale: float = 2.0):
        return (a * scale).sum(0) + b[0]

    for m, n in [(3, 4), (5, 2), (1, 1), (8, 9)]:
        a, b = torch.randn(m, n), torch.randn(2, n)
        torch.testing.assert_close(f(a, b), (a * 2.0).sum(0) + b[0])
        torch.testing.assert_close(f(a, b=b, scale=2.0), (a * 2.0).sum(0) + b[0])
    assert backend.graphs == 1
    assert isinstance(f, CompiledFunction) and f.__name__ == "f" and f.__wrapped__ is not None


def test_compile_stats_split_the_compile_into_dynamo_and_backend():
    slow = 0.2

    def backend(gm, example_inputs):
        time.sleep(slow)  # a backend that takes a known time
        return gm.forward

    @compileattn.compile(dynamic_arg_dims={"x": 0}, backend=backend)
    def f(x):
        return x * 2

    assert f.compile_stats == {}
    f(torch.ones(3))
    stats = f.compile_stats
    assert stats["backend_s"] >= slow and stats["dynamo_s"] > 0
    assert abs(stats["total_s"] - stats["dynamo_s"] - stats["backend_s"]) < 1e-9


def test_compile_stats_of_an_instance():
    """``model.forward.compile_stats`` (a user reads it from the instance), per instance."""
    @compileattn.compile(dynamic_arg_dims={"x": 0}, backend="eager")
    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    a, b = M(), M()
    assert a.forward.compile_stats == {}
    a(torch.ones(3))
    assert a.forward.compile_stats["total_s"] > 0 and b.forward.compile_stats == {}
    torch.testing.assert_close(a.forward(torch.ones(4)), torch.full((4,), 2.0))


def test_backend_by_name():
    @compileattn.compile(dynamic_arg_dims={"x": 0}, backend="eager")
    def f(x):
        return x.cos() + 1

    for n in (4, 2, 7):
        x = torch.randn(n)
        torch.testing.assert_close(f(x), x.cos() + 1)
    assert f.compile_stats["path"] == "cold"  # traced ahead of time, dispatching to Dynamo's code
    assert f._site.fast is not f.__wrapped__


class _Base(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_call_the_signature_rejects_names_the_function():
    """Signature.bind's bare "got an unexpected keyword argument 'extra'" said not whose."""
    @compileattn.compile(dynamic_arg_dims={"x": 0}, backend="eager")
    class CompiledBase(_Base):
        pass

    @compileattn.compile(dynamic_arg_dims={"x": 0}, backend="eager")
    def f(x):
        return x + 1

    m = CompiledBase()
    with pytest.raises(TypeError, match=r"<locals>\.CompiledBase\.forward\(\) got an unexpected keyword argument 'extra'$"):
        m(torch.ones(3), extra=1)  # the first call: nothing compiled yet
    m(torch.ones(3))
    with pytest.raises(TypeError, match=r"<locals>\.CompiledBase\.forward\(\) got an unexpected keyword argument 'extra'$"):
        m(torch.ones(3), extra=1)  # a later call, checked against the first
    with pytest.raises(TypeError, match=r"<locals>\.CompiledBase\.forward\(\) missing a required argument: 'x'$"):
        m()
    f(torch.ones(3))
    with pytest.raises(TypeError, match=r"\.f\(\) got an unexpected keyword argument 'extra'$"):
        f(torch.ones(3), extra=1)


def test_method_decorated_in_class_body_compiles_per_instance():
    backend = CountingBackend()

    class Scale(nn.Module):
        def __init__(self, factor):
            super().__init__()
            self.w = nn.Parameter(torch.full((4,), float(factor)))

        @compileattn.compile(dynamic_arg_dims={"x": 0}, backend=backend)
        def forward(self, x):
            return x * self.w

    a, b = Scale(2), Scale(3)
    with torch.no_grad():
        for n in (3, 5, 1):
            x = torch.randn(n, 4)
            torch.testing.assert_close(a(x), x * 2)
            torch.testing.assert_close(b(x), x * 3)
    assert backend.graphs == 2  # one per instance, none per call


def test_parameters_are_read_at_each_call():
    """Guards are skipped, but parameter *values* are graph inputs: an in-place weight update shows."""
    backend = CountingBackend()
    model, _ = compiled_toy(backend, dynamic_arg_dims={"x": 0, "positions": 0})
    x, pos = toy_inputs(4)
    with torch.no_grad():
        before = model(x, pos)
        model.down.bias.add_(1.0)
        torch.testing.assert_close(model(x, pos), before + 1.0)
    assert backend.graphs == 1


def test_survives_dynamo_reset():
    """Dynamo removes __compiled_fn_* from the module's globals when the code object using them
    dies; the dispatcher holds that code, so a reset (e.g. by another test or library) is harmless."""
    backend = CountingBackend()
    model, eager = compiled_toy(backend, dynamic_arg_dims={"x": 0, "positions": 0})
    with torch.no_grad():
        model(*toy_inputs(3))
        torch._dynamo.reset()
        gc.collect()
        x, pos = toy_inputs(6)
        torch.testing.assert_close(model(x, pos), eager(x, pos))
    assert backend.graphs == 1


def test_dynamic_arg_dims_inferred_from_tensor_annotations():
    backend = CountingBackend()
    model, eager = compiled_toy(backend)  # None: Tensor-annotated x and positions get dim 0
    with torch.no_grad():
        for n in (5, 2, 11):
            x, pos = toy_inputs(n)
            torch.testing.assert_close(model(x, pos), eager(x, pos))
    assert backend.graphs == 1


# -- what would have recompiled raises ---------------------------------------------------------------

RECOMPILES = {
    "dtype": (lambda x, p: (x.double(), p), "'x'", "dtype changed from torch.float32 to torch.float64"),
    "static dim": (lambda x, p: (torch.randn(x.shape[0], 9), p), "'x'", "size of static dim 1 changed from 8 to 9"),
    "ndim": (lambda x, p: (x, p[:, None]), "'positions'", "ndim changed from 1 to 2"),
    "device": (lambda x, p: (x.to("meta"), p), "'x'", "device changed from cpu to meta"),
    "non-contiguous": (lambda x, p: (torch.randn(8, x.shape[0]).t(), p), "'x'", "was contiguous on the first call, now is not"),
    "type": (lambda x, p: (x, p.tolist()), "'positions'", "was a Tensor on the first call"),
}


@pytest.mark.parametrize("case", list(RECOMPILES))
def test_changed_argument_raises_recompile_error_naming_it(case):
    change, name, what = RECOMPILES[case]
    backend = CountingBackend()
    model, _ = compiled_toy(backend, dynamic_arg_dims={"x": 0, "positions": 0})
    with torch.no_grad():
        model(*toy_inputs(4))
        with pytest.raises(RecompileError, match=rf"{name} {what}"):
            model(*change(*toy_inputs(5)))
        model(*toy_inputs(6))  # the compiled code is still in service
    assert backend.graphs == 1
    assert issubclass(RecompileError, RuntimeError)


def test_one_tensor_passed_twice_on_the_first_call_must_stay_one():
    """Dynamo traces one tensor passed for two arguments as one graph input; a later call with two
    tensors there would read the first for both."""
    f = compileattn.compile(dynamic_arg_dims={"x": 0, "y": 0},
                           config=compileattn.CompileConfig(piece_compiler="eager", compile_workers=0))(_shifted)
    a, b = torch.ones(3), torch.full((3,), 10.0)
    assert torch.equal(f(a, a), _shifted(a, a))
    with pytest.raises(RecompileError, match="argument 'y' was the same tensor as 'x' on the first call"):
        f(a, b)
    assert torch.equal(f(b, b), _shifted(b, b))
    g = compileattn.compile(dynamic_arg_dims={"x": 0, "y": 0},
                           config=compileattn.CompileConfig(piece_compiler="eager", compile_workers=0))(_shifted)
    assert torch.equal(g(a, b), _shifted(a, b))
    assert torch.equal(g(a, a), _shifted(a, a))  # two graph inputs given one tensor: read right


def _doubled_then_added(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a.mul_(2)
    return a + b


_HELD = torch.ones(3)


class _Cached(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3).requires_grad_(False)
        self.cache = [torch.ones(3)]  # a plain attribute, not a buffer

    def forward(self, x, w, c):
        return self.lin(x) + w.sum() + self.cache[0] + c


@pytest.mark.parametrize("where", ["parameter", "attribute", "global", "closure"])
def test_an_argument_that_was_a_tensor_the_trace_reads_elsewhere_must_stay_it(where):
    """Dynamo traces one tensor met as an argument and as a model's parameter (or a plain
    attribute, a global, a closure variable) as one graph input: a later call passing another tensor
    for the argument would have both places read one of them. (Dynamo's guard for it, skipped, is
    not even made between an argument and a global: torch.compile answers wrong there too.)"""
    model = _Cached()
    held = torch.full((3,), 2.0)

    def step(m, x, w, c):
        return m(x, w, c) + _HELD + held

    first = {"parameter": (model.lin.weight, "_Cached's parameter 'lin.weight'"),
             "attribute": (model.cache[0], "_Cached's attribute 'cache[0]'"),
             "global": (_HELD, "global '_HELD'"), "closure": (held, "closure variable 'held'")}
    shared, name = first[where]
    w = shared if shared.dim() == 2 else torch.zeros(3, 3)
    c = shared if shared.dim() == 1 else torch.zeros(3)
    arg = "w" if shared.dim() == 2 else "c"
    f = compileattn.compile(dynamic_arg_dims={"x": 0}, config=_eager_config())(step)
    x = torch.randn(4, 3)
    assert torch.equal(f(model, x, w, c), step(model, x, w, c))
    assert torch.equal(f(model, x[:2], w, c), step(model, x[:2], w, c))  # the same tensor again: served
    other = {"w": torch.zeros(3, 3), "c": torch.zeros(3)}
    with pytest.raises(RecompileError, match=rf"argument '{arg}' was the same tensor as {re.escape(name)} on the "
                                             rf"first call, now is another"):
        f(model, x, **{"w": w, "c": c, arg: other[arg]})


@pytest.mark.parametrize("path", ["aot", "frame"])
def test_two_tensors_on_the_first_call_stay_two_where_the_compiled_code_writes_one(path, monkeypatch):
    """Traced as two inputs, the write into ``a`` is not seen through ``b``: ``f(t, t)`` after
    ``f(a, b)`` returned 3t where eager returns 4t."""
    if path == "frame":
        from compileattn import _torch_compat

        def unavailable(*args, **kwargs):
            raise _torch_compat.AotUnsupported("the frame path in this test")

        monkeypatch.setattr(_torch_compat, "aot_compile", unavailable)
    f = compileattn.compile(dynamic_arg_dims={"a": 0, "b": 0},
                           config=compileattn.CompileConfig(piece_compiler="eager", compile_workers=0))(_doubled_then_added)
    assert torch.equal(f(torch.ones(4), torch.ones(4)), torch.full((4,), 3.0))
    t = torch.arange(4.0)
    with pytest.raises(RecompileError, match="argument 'b' is the same tensor as 'a', which the compiled code writes"):
        f(t, t)
    assert torch.equal(t, torch.arange(4.0)), "refused before anything ran"
    assert torch.equal(f(t, torch.ones(4)), torch.arange(4.0) * 2 + 1)


def _read_then_incremented(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    doubled = y * 2
    x.add_(1)
    return doubled


@pytest.mark.parametrize("path", ["aot", "frame"])
def test_a_written_tensor_may_not_come_to_share_memory_with_another_argument(path, monkeypatch):
    """Two views of one buffer are two graph inputs: Inductor's code for ``y * 2; x.add_(1)``,
    traced with distinct tensors, gave 2y + 2 where ``y`` overlaps ``x`` (eager: 2y), as
    torch.compile does. Views that do not overlap, and overlaps between tensors only read, are
    served; a write that another argument would see is refused before anything runs, on the first
    call by the compile."""
    if path == "frame":
        from compileattn import _torch_compat

        def unavailable(*args, **kwargs):
            raise _torch_compat.AotUnsupported("the frame path in this test")

        monkeypatch.setattr(_torch_compat, "aot_compile", unavailable)
    config = compileattn.CompileConfig(piece_compiler="inductor", compile_workers=0)
    f = compileattn.compile(dynamic_arg_dims={}, config=config)(_read_then_incremented)
    assert torch.equal(f(torch.zeros(4), torch.ones(4)), torch.full((4,), 2.0))
    buf = torch.arange(8.0)
    for x, y in ((buf[:4], buf[2:6]), (buf[:4], buf[:4].view(4)), (buf[3:7], buf[:4])):
        with pytest.raises(RecompileError, match=r"argument 'y' shares memory with 'x', which the compiled code "
                                                 r"writes into; on the first call they shared none"):
            f(x, y)
        assert torch.equal(buf, torch.arange(8.0)), "refused before anything ran"
    assert torch.equal(f(buf[:4], buf[4:]), torch.arange(4.0, 8.0) * 2)  # one buffer, no shared byte

    g = compileattn.compile(dynamic_arg_dims={}, config=config)(_read_then_incremented)
    buf = torch.arange(8.0)
    with pytest.raises(Exception, match=r"inputs (L\['y'\]|y) and (L\['x'\]|x) share memory and the compiled code "
                                        r"writes it \(add_\)"):
        g(buf[:4], buf[2:6])  # compiled by the pieces as two buffers, it too gave 2y + 2
    assert torch.equal(buf, torch.arange(8.0)), "refused before anything ran"

    h = compileattn.compile(dynamic_arg_dims={}, config=config)(_shifted)  # writes nothing
    buf = torch.arange(8.0)
    assert torch.equal(h(buf[:4], buf[2:6]), _shifted(buf[:4], buf[2:6]))
    assert torch.equal(h(torch.zeros(4), torch.ones(4)), torch.ones(4))


class _OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _scaled_then_applied(m: nn.Module, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w.mul_(2)
    return m(x)


@pytest.mark.parametrize("path", ["aot", "frame"])
def test_a_written_tensor_may_not_come_to_share_memory_with_a_models_parameter(path, monkeypatch):
    """Traced with a tensor of its own, ``w`` and ``m.lin.weight`` are two graph inputs: passing
    the parameter as ``w`` later, the compiled code computed ``m(x)`` from the weight before the
    write (eager: after it). Refused before anything runs, views of the parameter too; the other
    way round (the parameter on the first call, one graph input) ``held_elsewhere`` keeps it the
    parameter, and a view of it written on the first call is refused by the compile."""
    if path == "frame":
        from compileattn import _torch_compat

        def unavailable(*args, **kwargs):
            raise _torch_compat.AotUnsupported("the frame path in this test")

        monkeypatch.setattr(_torch_compat, "aot_compile", unavailable)
    config = compileattn.CompileConfig(piece_compiler="inductor", compile_workers=0)
    torch.manual_seed(0)
    m, x = _OneLinear(), torch.randn(2, 4)
    f = compileattn.compile(dynamic_arg_dims={}, config=config)(_scaled_then_applied)
    assert torch.allclose(f(m, torch.ones(4, 4), x), m(x))
    weight = m.lin.weight.clone()
    for w in (m.lin.weight, m.lin.weight.view(4, 4), m.lin.weight.detach()):
        with pytest.raises(RecompileError, match=r"argument 'w', which the compiled code writes into, shares "
                                                 r"memory with _OneLinear's parameter 'lin.weight'; on the first "
                                                 r"call it shared none"):
            f(m, w, x)
        assert torch.equal(m.lin.weight, weight), "refused before anything ran"
    assert torch.allclose(f(m, torch.ones(4, 4), x), m(x))
    m.lin.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)  # registered: looked at again
    with pytest.raises(RecompileError, match=r"shares memory with _OneLinear's parameter 'lin.weight'"):
        f(m, m.lin.weight, x)

    m = _OneLinear()
    eager = _OneLinear()
    eager.load_state_dict(m.state_dict())
    g = compileattn.compile(dynamic_arg_dims={}, config=config)(_scaled_then_applied)
    assert torch.allclose(g(m, m.lin.weight, x), _scaled_then_applied(eager, eager.lin.weight, x))
    assert torch.allclose(g(m, m.lin.weight, x), _scaled_then_applied(eager, eager.lin.weight, x))
    with pytest.raises(RecompileError, match=r"argument 'w' was the same tensor as _OneLinear's parameter "
                                             r"'lin.weight' on the first call, now is another"):
        g(m, torch.ones(4, 4), x)
    h = compileattn.compile(dynamic_arg_dims={}, config=config)(_scaled_then_applied)
    with pytest.raises(Exception, match=r"share memory and the compiled code writes it \(mul_\)"):
        h(m, m.lin.weight.view(4, 4), x)


_GLOBAL_TABLE = torch.arange(8.0)


def _incremented_then_added_to_the_global(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x + _GLOBAL_TABLE[:4]


@pytest.mark.parametrize("held", ["global", "closure"])
def test_a_written_tensor_may_not_come_to_share_memory_with_a_global_or_closure_tensor(held):
    """A tensor global or closure variable the code reads is a graph input of its own: passing it,
    or a view of it, as the written argument later, the compiled code read it as it was before the
    write (eager: after it). Refused before anything runs. A global rebound since the first call is
    refused by itself: the compiled code keeps reading the first one (``model_tensors.py``)."""
    global _GLOBAL_TABLE
    config = compileattn.CompileConfig(piece_compiler="inductor", compile_workers=0)
    if held == "global":
        _GLOBAL_TABLE = torch.arange(8.0)
        fn = _incremented_then_added_to_the_global

        def table():
            return _GLOBAL_TABLE
    else:
        closed = torch.arange(8.0)

        def fn(x: torch.Tensor) -> torch.Tensor:
            x.add_(1)
            return x + closed[:4]

        def table():
            return closed
    f = compileattn.compile(dynamic_arg_dims={}, config=config)(fn)
    assert torch.equal(f(torch.zeros(4)), torch.arange(4.0) + 1)
    for view in (table()[:4], table()[2:6]):
        with pytest.raises(RecompileError, match=rf"argument 'x', which the compiled code writes into, shares "
                                                 rf"memory with (global '_GLOBAL_TABLE'|closure variable 'closed')"):
            f(view)
        assert torch.equal(table(), torch.arange(8.0)), "refused before anything ran"
    assert torch.equal(f(torch.zeros(4)), torch.arange(4.0) + 1)
    if held == "global":
        _GLOBAL_TABLE = torch.full((8,), 100.0)  # rebound: the compiled code returned 1..4, eager 101
        with pytest.raises(RecompileError, match="global '_GLOBAL_TABLE' holds another tensor than at the first"):
            f(torch.zeros(4))


class _Staged(nn.Module):
    """Writes its result into ``out``, a view of a staging buffer it holds in a plain attribute
    and never reads (the persistent-buffer pattern: slice views of one preallocated tensor)."""

    def __init__(self):
        super().__init__()
        self.staging = torch.zeros(8)

    def forward(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out.copy_(x * 2)
        return out


def test_a_written_view_of_an_attribute_tensor_passed_so_on_the_first_call_is_served_later():
    """The written argument shared memory with the plain attribute on the first call too (the
    compile saw it and had nothing to refuse: the code never reads the attribute), so a later call
    passing the same kind of view is the first call's case, not a new sharing: served, not refused
    as "on the first call it shared none"."""
    m = _Staged()
    f = compileattn.compile(dynamic_arg_dims={}, backend="eager")(m.forward)
    x = torch.arange(4.0)
    for _ in range(3):
        out = f(m.staging[:4], x)
        assert torch.equal(out, x * 2) and torch.equal(m.staging[:4], x * 2)


def test_the_first_calls_overlaps_are_part_of_the_warm_start_key():
    """A file traced for distinct tensors must not serve a process whose first call overlaps them
    (its own first call sets the overlaps it checks later)."""
    from compileattn.compilation.argcheck import ArgChecker, overlapping_tensors, spec_of, tensor_places

    def key(x, y):
        values = {"x": x, "y": y}
        places = tensor_places(values)
        return ArgChecker(inspect.signature(_shifted), False, {n: spec_of(v, ()) for n, v in values.items()}, False,
                          places, overlapping_tensors(values, places)).key()

    buf = torch.arange(8.0)
    assert key(buf[:4], buf[2:6]) != key(buf[:4], buf[4:]) == key(torch.zeros(4), torch.ones(4))


def test_an_argument_held_elsewhere_is_part_of_the_warm_start_key():
    """A file traced with an argument that was also a model's parameter (one graph input) must not
    serve a process whose first call passes another tensor there, nor the other way round."""
    from compileattn.compilation.argcheck import ArgChecker, spec_of, tensor_places
    from compileattn.compilation.reach import held_elsewhere, tensors_reached

    def key(m, w):
        values = {"m": m, "w": w}
        places = tensor_places(values)
        specs = {n: spec_of(v, ()) for n, v in values.items()}
        return ArgChecker(inspect.signature(lambda m, w: None), False, specs, False, places,
                          held=held_elsewhere(values, places, tensors_reached([m], None))).key()

    lin = nn.Linear(2, 2).requires_grad_(False)
    assert key(lin, lin.weight) != key(lin, torch.zeros(2, 2)) == key(lin, torch.ones(2, 2))


def _shifted(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * 2 + y


def test_a_non_contiguous_static_argument_keeps_its_strides(simulated_graphs):
    """Dynamo specialises a static non-contiguous tensor's strides and a CUDA graph reads that
    layout: another layout of the same shape at the same address was replayed as the first."""
    def shifted_by_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * 2 + y.sum()

    f = compileattn.compile(dynamic_arg_dims={"x": 0}, config=compileattn.CompileConfig(
        piece_compiler="eager", compile_workers=0, cudagraph_mode="piecewise", cudagraph_capture_sizes=[8]))(
        shifted_by_sum)
    xs, buf = torch.randn(16, 4), torch.arange(64.0).reshape(8, 8)
    columns = buf[:, ::2]
    for _ in range(2):
        torch.testing.assert_close(f(xs[:8], columns), shifted_by_sum(xs[:8], columns))
    with pytest.raises(RecompileError, match=r"argument 'y' strides changed from \(8, 2\) to \(4, 1\)"):
        f(xs[:8], buf.as_strided((8, 4), (4, 1)))


def test_a_non_contiguous_dynamic_argument_keeps_the_layout_it_was_traced_with(simulated_graphs):
    """Dynamo traces a transposed ``(s0, 4)`` tensor with strides ``(1, s0)``: a CUDA graph reads
    that layout, so another layout of the same shape at the same address was answered from the
    graph captured with the first (shown with simulated graphs), and Inductor's code asserted it."""
    _check_traced_layout_is_kept("cpu")


@pytest.mark.cuda
def test_cuda_a_non_contiguous_dynamic_argument_keeps_the_layout_it_was_traced_with():
    _check_traced_layout_is_kept("cuda")


def _check_traced_layout_is_kept(device: str) -> None:
    f = compileattn.compile(dynamic_arg_dims={"x": 0}, config=compileattn.CompileConfig(
        piece_compiler="eager", compile_workers=0, cudagraph_mode="piecewise", cudagraph_capture_sizes=[8]))(_doubled)
    buf = torch.arange(64.0, device=device)
    transposed = buf[:32].view(4, 8).t()  # (8, 4), strides (1, 8)
    for _ in range(2):
        torch.testing.assert_close(f(transposed), _doubled(transposed))
    longer = torch.randn(4, 11, device=device).t()  # the same layout at another size runs
    torch.testing.assert_close(f(longer), _doubled(longer))
    rows = buf[:32].view(8, 4)  # the same shape and address, strides (4, 1)
    with pytest.raises(RecompileError, match=r"argument 'x' has shape \(8, 4\) and strides \(4, 1\), but the first "
                                             r"call's layout \(shape \(8, 4\)\) was traced with stride\(0\) = 1"):
        f(rows)


@pytest.mark.parametrize("first, later, refused", [
    # a column slice: stride(0) = size(1) * stride(1), the step a symbol of its own
    (lambda n: torch.randn(n, 16)[:, ::2], lambda n: torch.randn(n, 24)[:, ::3], None),
    (lambda n: torch.randn(n, 16)[:, ::2], lambda n: torch.randn(n, 12)[:, :8],
     r"was traced with stride\(0\) = size\(1\) \* stride\(1\)"),
    # an expanded row: stride 0
    (lambda n: torch.randn(1, 8).expand(n, 8), lambda n: torch.randn(n, 8), r"was traced with stride\(0\) = 0"),
    # a padded row: its stride a symbol, which Dynamo guarded to differ from the row length
    (lambda n: torch.randn(n, 16)[:, :8], lambda n: torch.randn(n, 12)[:, :8], None),
    (lambda n: torch.randn(n, 16)[:, :8], lambda n: torch.randn(n, 8),
     r"has x\.stride\(0\) = 8, but the compiled code assumes x\.stride\(0\) != 8"),
], ids=["column-slice", "column-slice-then-padded", "expanded-then-contiguous", "padded", "padded-then-contiguous"])
def test_strides_of_a_dynamic_argument_are_checked_as_the_trace_assumed_them(first, later, refused):
    """Inductor's code asserts the traced layout (an AssertionError blaming a fake kernel, before);
    a padded row's guard on its stride refused the compile (``UncheckableGuard``, before)."""
    f = compileattn.compile(dynamic_arg_dims={"x": 0}, config=compileattn.CompileConfig(compile_workers=0))(_doubled)
    x = first(6)
    torch.testing.assert_close(f(x), _doubled(x))
    y = later(9)
    if refused is None:
        torch.testing.assert_close(f(y), _doubled(y))
    else:
        with pytest.raises(RecompileError, match=rf"argument 'x' .*{refused}"):
            f(y)


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_one_tensor_twice_inside_containers_must_stay_one():
    def summed(xs: list, pair: tuple) -> torch.Tensor:
        return xs[0] * 2 + xs[1] + pair[0]

    f = compileattn.compile(dynamic_arg_dims={}, config=compileattn.CompileConfig(piece_compiler="eager",
                                                                                compile_workers=0))(summed)
    a, b = torch.ones(3), torch.full((3,), 10.0)
    assert torch.equal(f([a, a], (a,)), summed([a, a], (a,)))
    with pytest.raises(RecompileError, match=r"argument 'xs\[1\]' was the same tensor as 'xs\[0\]'"):
        f([a, b], (a,))
    with pytest.raises(RecompileError, match=r"argument 'pair\[0\]' was the same tensor as 'xs\[0\]'"):
        f([a, a], (b,))
    assert torch.equal(f([b, b], (b,)), summed([b, b], (b,)))


def _eager_config():
    return compileattn.CompileConfig(piece_compiler="eager", compile_workers=0)


def test_a_dict_or_kwargs_in_another_key_order_raises():
    """The trace iterated the first call's order (``d.values()``, ``**extra`` passed on): the same
    keys in another order would get the first call's order back."""
    def joined(x, d, **extra):
        return torch.cat([x, *d.values(), *extra.values()])

    f = compileattn.compile(dynamic_arg_dims={}, config=_eager_config())(joined)
    x, a, b = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    assert torch.equal(f(x, {"a": a, "b": b}, p=a, q=b), joined(x, {"a": a, "b": b}, p=a, q=b))
    with pytest.raises(RecompileError, match=r"argument 'd' key order changed from \['a', 'b'\] to \['b', 'a'\]"):
        f(x, {"b": b, "a": a}, p=a, q=b)
    with pytest.raises(RecompileError, match=r"argument 'extra' key order changed"):
        f(x, {"a": a, "b": b}, q=b, p=a)
    assert torch.equal(f(x, {"a": b, "b": a}, p=b, q=a), joined(x, {"a": b, "b": a}, p=b, q=a))


def test_dict_and_sequence_subclasses_are_checked_item_by_item():
    """An OrderedDict or a list subclass is a container: its items are checked like a dict's or a
    list's (a scalar in it was specialised; one tensor twice is one graph input), and so is its type."""
    import collections

    class Pair(list):
        pass

    def scaled(x, opts, pair):
        return x * opts["scale"] + pair[0] + pair[1]

    f = compileattn.compile(dynamic_arg_dims={}, config=_eager_config())(scaled)
    x, a, b = torch.ones(2), torch.ones(2), torch.full((2,), 10.0)
    opts = collections.OrderedDict(scale=2.0)
    assert torch.equal(f(x, opts, Pair([a, a])), scaled(x, opts, Pair([a, a])))
    with pytest.raises(RecompileError, match=r"argument 'opts' item \['scale'\]: value changed from 2.0 to 3.0"):
        f(x, collections.OrderedDict(scale=3.0), Pair([a, a]))
    with pytest.raises(RecompileError, match=r"argument 'pair\[1\]' was the same tensor as 'pair\[0\]'"):
        f(x, opts, Pair([a, b]))
    with pytest.raises(RecompileError, match="argument 'opts' type changed from OrderedDict to dict"):
        f(x, {"scale": 2.0}, Pair([a, a]))
    with pytest.raises(RecompileError, match="argument 'pair' type changed from Pair to list"):
        f(x, opts, [a, a])


class _Scaled(torch.Tensor):
    """A subclass whose ``__torch_function__`` multiplies every product by 10."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 10 if func is torch.Tensor.__mul__ else out


def test_a_tensor_subclass_is_not_a_plain_tensor_but_a_parameter_is():
    def doubled(x):
        return x * 2

    f = compileattn.compile(dynamic_arg_dims={"x": 0}, config=_eager_config())(doubled)
    x = torch.ones(3)
    assert torch.equal(f(x), doubled(x))
    with pytest.raises(RecompileError, match="argument 'x' was a Tensor on the first call, now a _Scaled"):
        f(x.as_subclass(_Scaled))
    assert torch.equal(f(nn.Parameter(torch.ones(4), requires_grad=False)), torch.full((4,), 2.0))


def test_a_negative_or_conjugate_view_is_not_the_plain_tensor_it_was_traced_as():
    """``z.conj().imag`` is a view with the negative bit set: Inductor's code reads its memory as
    is (the wrong sign, no error); Dynamo's guards, which compare the dispatch keys, would have
    recompiled."""
    def doubled(x):
        return x * 2

    f = compileattn.compile(dynamic_arg_dims={"x": 0}, config=compileattn.CompileConfig(
        piece_compiler="inductor", compile_workers=0, compile_sizes=[]))(doubled)
    z = torch.complex(torch.zeros(4), torch.ones(4))
    assert torch.equal(f(z.imag), doubled(z.imag))
    assert z.conj().imag.is_neg()
    with pytest.raises(RecompileError, match=r"argument 'x' is a negative view \(is_neg\(\)\) now"):
        f(z.conj().imag)
    assert torch.equal(f(z.conj().imag.resolve_neg()), -doubled(z.imag))
    g = compileattn.compile(dynamic_arg_dims={"x": 0}, config=_eager_config())(doubled)
    g(z)
    with pytest.raises(RecompileError, match=r"argument 'x' is a conjugate view \(is_conj\(\)\) now"):
        g(z.conj())


def test_a_model_argument_must_be_the_same_instance():
    """A module passed as an argument: the trace baked in its attributes, so another instance
    (another factor) is refused, not answered with the first one's; in-place parameter updates of
    the same instance are read per call."""
    class Scale(nn.Module):
        def __init__(self, factor):
            super().__init__()
            self.factor = factor
            self.w = nn.Parameter(torch.ones(1), requires_grad=False)

        def forward(self, x):
            return x * self.factor * self.w

    f = compileattn.compile(dynamic_arg_dims={"x": 0}, config=_eager_config())(lambda model, x: model(x))
    model = Scale(2.0)
    assert torch.equal(f(model, torch.ones(3)), torch.full((3,), 2.0))
    model.w.data.fill_(3.0)
    assert torch.equal(f(model, torch.ones(5)), torch.full((5,), 6.0))
    with pytest.raises(RecompileError, match="argument 'model' is another Scale instance than on the first call"):
        f(Scale(5.0), torch.ones(3))
    with pytest.raises(RecompileError, match=r"argument 'model' item \[0\]: is another Scale instance"):
        g = compileattn.compile(dynamic_arg_dims={"x": 0}, config=_eager_config())(lambda model, x: model[0](x))
        g([model], torch.ones(3))
        g([Scale(5.0)], torch.ones(3))


def test_a_parents_forward_called_through_the_class_runs_the_instances_own_compile():
    """``Cls.forward(self, x)`` from a subclass: each instance's compile, as ``instance.forward``
    gives, not one shared by every instance (which would run code traced with another's attributes)."""
    backend = CountingBackend()

    @compileattn.compile(dynamic_arg_dims={"x": 0}, backend=backend)
    class Base(nn.Module):
        def __init__(self, scale, act):
            super().__init__()
            self.scale, self.act = scale, act

        def forward(self, x):
            return self.act(x) * self.scale

    class Wrapped(Base):
        def forward(self, x):
            return Base.forward(self, x) + 1

    m1, m2 = Wrapped(1.0, nn.ReLU()), Wrapped(5.0, nn.Tanh())
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(m1(x), torch.relu(x) + 1)
        torch.testing.assert_close(m2(x), torch.tanh(x) * 5 + 1)
        torch.testing.assert_close(m1(torch.randn(5, 4)).shape, torch.Size([5, 4]))
    assert backend.graphs == 2


def test_changed_grad_mode_raises():
    backend = CountingBackend()
    model, _ = compiled_toy(backend, dynamic_arg_dims={"x": 0, "positions": 0})
    with torch.no_grad():
        model(*toy_inputs(4))
    with pytest.raises(RecompileError, match=r"grad mode \(torch.is_grad_enabled\(\)\) changed from False to True"):
        model(*toy_inputs(4))
    assert backend.graphs == 1


def test_non_tensor_arguments_and_defaults_are_checked_by_value():
    backend = CountingBackend()

    @compileattn.compile(dynamic_arg_dims={"x": 0}, backend=backend)
    def f(x, n: int, *, mode: str = "add"):
        return x + n if mode == "add" else x * n

    x = torch.randn(3)
    torch.testing.assert_close(f(x, 2), x + 2)
    torch.testing.assert_close(f(x, n=2, mode="add"), x + 2)  # other layout, same values: fine
    with pytest.raises(RecompileError, match=r"'n' value changed from 2 to 3"):
        f(x, 3)
    with pytest.raises(RecompileError, match=r"'n' type changed from int to float"):
        f(x, 2.0)
    with pytest.raises(RecompileError, match=r"'mode' value changed from 'add' to 'mul'"):
        f(x, 2, mode="mul")
    assert backend.graphs == 1


def test_a_float_zero_keeps_its_sign():
    """0.0 == -0.0, but the trace baked in the first call's zero: ``1 / (x * scale)`` gave +inf where
    -inf was due (torch.compile's value guard compares with == too)."""
    def reciprocal(x, scale: float):
        return 1 / (x * scale)

    f = compileattn.compile(dynamic_arg_dims={"x": 0}, config=_eager_config())(reciprocal)
    x = torch.ones(3)
    assert torch.equal(f(x, 0.0), reciprocal(x, 0.0))
    assert torch.equal(f(x, 0.0 * 5), reciprocal(x, 0.0))  # another object, the same zero
    with pytest.raises(RecompileError, match=r"'scale' value changed from 0.0 to -0.0"):
        f(x, -0.0)
    g = compileattn.compile(dynamic_arg_dims={"x": 0}, config=_eager_config())(reciprocal)
    g(x, float("nan"))
    assert g(x, float("nan")).isnan().all()  # another NaN object, equal to none: the NaN baked in serves


def test_a_numpy_array_is_checked_as_the_tensor_dynamo_traced():
    """Dynamo traces a numpy array argument as a tensor of its dtype, shape and strides: Inductor's
    code read a float64 array given later as float32 (wrong numbers, no error), and failed an
    assertion on another shape."""
    np = pytest.importorskip("numpy")

    def shifted(x, a):
        return x + torch.from_numpy(a)

    f = compileattn.compile(dynamic_arg_dims={"x": 0}, config=compileattn.CompileConfig(
        piece_compiler="inductor", compile_workers=0, compile_sizes=[]))(shifted)
    x = torch.ones(3, 4)
    assert torch.equal(f(x, np.ones(4, dtype=np.float32)), shifted(x, np.ones(4, dtype=np.float32)))
    twos = np.full(4, 2, dtype=np.float32)
    assert torch.equal(f(x, twos), shifted(x, twos))  # another array of the same layout: read per call
    with pytest.raises(RecompileError, match=r"argument 'a' dtype changed from float32 to float64"):
        f(x, np.full(4, 3, dtype=np.float64))
    with pytest.raises(RecompileError, match=r"argument 'a' shape changed from \(4,\) to \(1,\)"):
        f(x, np.full(1, 3, dtype=np.float32))
    with pytest.raises(RecompileError, match=r"argument 'a' strides changed from \(4,\) to \(8,\)"):
        f(x, np.arange(8, dtype=np.float32)[::2])


def test_a_function_argument_must_be_the_same_function():
    """The trace inlined the first call's function (Dynamo guards its identity): another one passed
    later ran the first one's code."""
    def applied(x, act):
        return act(x)

    def tripled(t):
        return t * 3

    f = compileattn.compile(dynamic_arg_dims={"x": 0}, config=_eager_config())(applied)
    x = torch.randn(4)
    assert torch.equal(f(x, torch.relu), torch.relu(x))
    assert torch.equal(f(x[:2], torch.relu), torch.relu(x[:2]))
    with pytest.raises(RecompileError, match=r"argument 'act' is another function than on the first call \(tanh, was "
                                             r"relu\)"):
        f(x, torch.tanh)
    g = compileattn.compile(dynamic_arg_dims={"x": 0}, config=_eager_config())(applied)
    assert torch.equal(g(x, tripled), x * 3)
    with pytest.raises(RecompileError, match=r"argument 'act' is another function than on the first call"):
        g(x, lambda t: t * 5)


def test_argument_left_at_a_different_default_raises():
    backend = CountingBackend()

    @compileattn.compile(dynamic_arg_dims={"x": 0}, backend=backend)
    def f(x, bias: float = 0.0):
        return x + bias

    x = torch.randn(3)
    f(x, 1.0)
    with pytest.raises(RecompileError, match=r"'bias' now left at its default \(value changed from 1.0 to 0.0\)"):
        f(x)
    assert backend.graphs == 1


def test_nested_containers_name_the_item():
    backend = CountingBackend()

    @compileattn.compile(dynamic_arg_dims={"x": 0}, backend=backend)
    def f(x, weights):
        return x.sum() * weights[1]

    x, w = torch.randn(3), [torch.randn(3), torch.randn(3)]
    f(x, w)
    with pytest.raises(RecompileError, match=r"'weights' item \[1\]: dtype changed"):
        f(x, [w[0], w[1].double()])
    with pytest.raises(RecompileError, match=r"'weights' length changed from 2 to 3"):
        f(x, w + [w[0]])


# -- guards really are skipped -----------------------------------------------------------------------

OFFSET = 1.0


def add_offset(x):
    return x + OFFSET


def test_dispatch_skips_dynamo_guards(monkeypatch):
    """A guarded torch.compile recompiles when a global it read changes; the decorator must not even
    look (the compiled code keeps the value of the first call, which is the documented limit)."""
    this_module = sys.modules[__name__]
    decorated_backend, control_backend = CountingBackend(), CountingBackend()
    decorated = compileattn.compile(add_offset, dynamic_arg_dims={"x": 0}, backend=decorated_backend)
    control = torch.compile(add_offset, fullgraph=True, backend=control_backend)
    x = torch.randn(4)
    torch._dynamo.mark_dynamic(x, 0)
    torch.testing.assert_close(decorated(x), x + 1.0)
    torch.testing.assert_close(control(x), x + 1.0)

    monkeypatch.setattr(this_module, "OFFSET", 5.0)
    torch.testing.assert_close(control(x), x + 5.0)  # guard failed -> Dynamo recompiled
    assert control_backend.graphs == 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(decorated(x), x + 1.0)  # no guard evaluated, no recompile
    assert decorated_backend.graphs == 1


def test_dispatch_overhead_is_microseconds():
    """Checking the arguments and jumping into the transformed code costs a few µs over calling
    the transformed code directly (bound generously: CI machines are slow and noisy)."""
    backend = CountingBackend()

    @compileattn.compile(dynamic_arg_dims={"x": 0, "positions": 0}, backend=backend)
    def f(x, positions, n: int):
        return x

    x, pos = toy_inputs(16)
    f(x, pos, 3)
    fast = f._site.fast

    def per_call(fn, reps=500):
        t = time.perf_counter()
        for _ in range(reps):
            fn(x, pos, 3)
        return (time.perf_counter() - t) / reps

    overhead = statistics.median(per_call(f) - per_call(fast) for _ in range(7))
    assert overhead < 30e-6, f"dispatch overhead {overhead * 1e6:.1f} µs"


def test_frame_path_when_aot_compile_is_unavailable(monkeypatch, caplog):
    """A torch without aot_compile (or a trace it rejects): torch.compile's frame evaluation with every
    guard skipped, the same argument checks, logged once at INFO with the reason; a Dynamo reset
    then raises instead of tracing again without the dynamic dims."""
    from compileattn import _torch_compat

    def unavailable(*args, **kwargs):
        raise _torch_compat.AotUnsupported("no aot_compile in this test")

    monkeypatch.setattr(_torch_compat, "aot_compile", unavailable)
    backend = CountingBackend()
    model, eager = compiled_toy(backend, dynamic_arg_dims={"x": 0, "positions": 0})
    with caplog.at_level(logging.INFO, logger="compileattn"), torch.no_grad():
        for n in (4, 1, 9):
            x, pos = toy_inputs(n)
            torch.testing.assert_close(model(x, pos), eager(x, pos))
        with pytest.raises(RecompileError, match=r"'x' dtype changed"):
            model(*toy_inputs(3, dtype=torch.float64))
    assert backend.graphs == 1 and model.forward.compile_stats["path"] == "frame"
    reasons = [r.getMessage() for r in caplog.records if "frame evaluation" in r.getMessage()]
    assert len(reasons) == 1 and "no aot_compile in this test" in reasons[0]
    torch.compiler.reset()
    with torch.no_grad(), pytest.raises(RuntimeError, match="fail_on_recompile"):
        model(*toy_inputs(5))
    assert backend.graphs == 1


# -- switches, errors, logging -----------------------------------------------------------------------

def test_env_var_disables_compilation(monkeypatch):
    monkeypatch.setenv("COMPILEATTN_DISABLE", "1")
    backend = CountingBackend()
    model, eager = compiled_toy(backend, dynamic_arg_dims={"x": 0, "positions": 0})
    with torch.no_grad():
        for n in (3, 1, 8):
            x, pos = toy_inputs(n)
            torch.testing.assert_close(model(x, pos), eager(x, pos))
    model(*toy_inputs(3))  # grad mode changed: eager has no checks either
    assert backend.graphs == 0


@pytest.mark.parametrize("value, disabled", [("false", False), ("False", False), ("off", False), ("0", False),
                                             ("true", True), ("yes", True)])
def test_env_var_reads_false_as_false(monkeypatch, value, disabled):
    """Every value but "" and "0" disabled: COMPILEATTN_DISABLE=false ran the model eagerly."""
    monkeypatch.setenv("COMPILEATTN_DISABLE", value)
    backend = CountingBackend()
    model, eager = compiled_toy(backend, dynamic_arg_dims={"x": 0, "positions": 0})
    with torch.no_grad():
        x, pos = toy_inputs(3)
        torch.testing.assert_close(model(x, pos), eager(x, pos))
    assert backend.graphs == (0 if disabled else 1)


def test_env_var_that_is_no_switch_raises(monkeypatch):
    monkeypatch.setenv("COMPILEATTN_DISABLE", "maybe")
    model, _ = compiled_toy(CountingBackend(), dynamic_arg_dims={"x": 0, "positions": 0})
    with torch.no_grad(), pytest.raises(ValueError, match="COMPILEATTN_DISABLE='maybe'"):
        model(*toy_inputs(3))


def test_config_disable_runs_eagerly():
    backend = CountingBackend()
    model, eager = compiled_toy(backend, dynamic_arg_dims={"x": 0, "positions": 0},
                                config=compileattn.CompileConfig(disable=True))
    with torch.no_grad():
        x, pos = toy_inputs(5)
        torch.testing.assert_close(model(x, pos), eager(x, pos))
    assert backend.graphs == 0


@pytest.mark.parametrize("dims, error, match", [
    ({"tokens": 0}, ValueError, r"no argument 'tokens'"),
    ({"x": "0"}, TypeError, r"dynamic_arg_dims\['x'\] must be an int"),
    ({"x": []}, TypeError, r"dynamic_arg_dims\['x'\] must be an int"),
    ([("x", 0)], TypeError, r"dynamic_arg_dims must be a dict"),
])
def test_bad_dynamic_arg_dims_raise_at_decoration(dims, error, match):
    with pytest.raises(error, match=match):
        compileattn.compile(type("T", (Toy,), {}), dynamic_arg_dims=dims, backend=CountingBackend())


@pytest.mark.parametrize("first, match", [
    (lambda: (torch.randn(1, 8), torch.arange(1)), r"'x'\]: dim 0 has size 1 on the first call"),
    (lambda: (torch.randn(3, 8), torch.tensor(0)), r"'positions'\]: dim 0 out of range"),
    (lambda: (torch.randn(3, 8), 3), r"names 'positions', but it is a int"),
])
def test_bad_first_call_raises_naming_the_argument(first, match):
    backend = CountingBackend()
    model, _ = compiled_toy(backend, dynamic_arg_dims={"x": 0, "positions": 0})
    with torch.no_grad(), pytest.raises((ValueError, TypeError), match=match):
        model(*first())
    assert backend.graphs == 0


def test_decorating_something_else_raises():
    with pytest.raises(TypeError, match="no Python forward"):
        compileattn.compile(type("NoForward", (), {}), dynamic_arg_dims={})
    with pytest.raises(TypeError, match="needs a Python function"):
        compileattn.compile(len, dynamic_arg_dims={})
    with pytest.raises(TypeError, match="config must be a CompileConfig"):
        compileattn.compile(add_offset, dynamic_arg_dims={"x": 0}, config={"piece_compiler": "eager"})


def test_compile_time_logged_at_info(caplog):
    backend = CountingBackend()
    model, _ = compiled_toy(backend, dynamic_arg_dims={"x": 0, "positions": 0})
    with caplog.at_level(logging.INFO, logger="compileattn"), torch.no_grad():
        model(*toy_inputs(4))
        model(*toy_inputs(5))
    msgs = [r.getMessage() for r in caplog.records if r.name == "compileattn" and r.levelno == logging.INFO]
    compiled = [m for m in msgs if "compiled CompiledToy.forward" in m]
    assert len(compiled) == 1 and "Dynamo" in compiled[0] and "backend" in compiled[0], msgs


def test_outer_torch_compile_inlines_the_original():
    """Inside another torch.compile trace the decorator steps aside, so the outer graph holds the
    model's ops rather than a call into an already-compiled function."""
    inner_backend, outer_backend = CountingBackend(), CountingBackend()
    model, eager = compiled_toy(inner_backend, dynamic_arg_dims={"x": 0, "positions": 0})
    outer = torch.compile(lambda x, p: model(x, p) * 2, backend=outer_backend)
    with torch.no_grad():
        x, pos = toy_inputs(4)
        torch.testing.assert_close(outer(x, pos), eager(x, pos) * 2)
    assert inner_backend.graphs == 0 and outer_backend.graphs >= 1


# -- with the real compileattn backend ---------------------------------------------------------------

@pytest.mark.parametrize("piece_compiler", ["eager", "aot_eager"])
def test_default_backend_is_compileattn(piece_compiler):
    """aot_eager: an AOTAutograd compile inside the decorator's aot_compile (torch 2.11 failed it
    building a cache entry; ``_torch_compat.aot_eager``)."""
    cls = compileattn.compile(type("CompiledToy", (Toy,), {}), dynamic_arg_dims={"x": 0, "positions": 0},
                              config=compileattn.CompileConfig(piece_compiler=piece_compiler))
    model, eager = cls(), Toy()
    eager.load_state_dict(model.state_dict())
    with compileattn.counters.expect(dynamo_graphs=1, pieces=1), torch.no_grad():
        for n in (6, 1, 13, 2):
            x, pos = toy_inputs(n)
            torch.testing.assert_close(model(x, pos), eager(x, pos))


H, KVH, D, LAYERS = 2, 1, 32, 2


class TinyAttentionModel(nn.Module):
    """Two pre-norm-free attention blocks through compileattn's Attention (the graph splits there)."""

    def __init__(self):
        super().__init__()
        from compileattn.kv_cache import AttentionSpec
        from compileattn.models.attention import Attention

        spec = AttentionSpec(H, KVH, D)
        self.qkv = nn.ModuleList(nn.Linear(H * D, (H + 2 * KVH) * D) for _ in range(LAYERS))
        self.attn = nn.ModuleList(Attention(spec, f"layers.{i}") for i in range(LAYERS))
        self.out = nn.ModuleList(nn.Linear(H * D, H * D) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for qkv, attn, out in zip(self.qkv, self.attn, self.out):
            q, k, v = qkv(x).split([H * D, KVH * D, KVH * D], dim=-1)
            x = x + out(attn(q, k, v))
        return x


def _run_attention_model(device: str, dtype: torch.dtype, steps: int):
    from compileattn import AttentionMetadataBuilder, allocate_kv_caches
    from compileattn.kv_cache import AttentionSpec
    from compileattn.testing import assert_matches_eager, random_step

    torch.manual_seed(0)
    block_size, num_blocks, max_tokens = 4, 64, 64
    config = compileattn.CompileConfig(piece_compiler="eager" if device == "cpu" else "inductor")
    cls = compileattn.compile(type("CompiledTiny", (TinyAttentionModel,), {}), dynamic_arg_dims={"x": 0},
                              config=config)
    model = cls().to(device, dtype)
    eager = TinyAttentionModel().to(device, dtype)
    eager.load_state_dict(model.state_dict())
    caches = allocate_kv_caches({f"layers.{i}": AttentionSpec(H, KVH, D) for i in range(LAYERS)},
                                num_blocks, block_size, dtype, device)
    builder = AttentionMetadataBuilder(block_size=block_size, num_blocks=num_blocks, max_num_tokens=max_tokens,
                                       max_blocks_per_seq=16, device=device, backend="reference")
    # Persistent input buffer: each step passes a view of it, as an engine does for CUDA graphs.
    buf = torch.zeros(max_tokens, H * D, device=device, dtype=dtype)

    def make_inputs(n):
        buf[:n].normal_()
        return (buf[:n],)

    pad = (lambda n: next(s for s in config.capture_sizes if s >= n)) if device == "cuda" else (lambda n: None)
    rng = random.Random(0)
    with compileattn.counters.expect(dynamo_graphs=1, pieces=LAYERS + 1), torch.no_grad():
        for i in range(steps):
            seqs = random_step(rng, num_seqs=3 if i == 0 else rng.randint(1, 6), block_size=block_size,
                               num_blocks=num_blocks, max_query_len=6, max_context_len=20)
            n = sum(s.query_len for s in seqs)
            assert_matches_eager(eager, model, builder, caches, seqs, make_inputs, pad_to=pad(n))


def test_attention_model_under_forward_context_matches_eager():
    _run_attention_model("cpu", torch.float32, steps=12)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_attention_model_cuda_graphs_match_eager(dtype):
    _run_attention_model("cuda", dtype, steps=24)


def test_a_plain_attribute_naming_a_models_buffer_is_not_an_other_tensor():
    """``reach.other_tensors`` lists what ``ModelTensors.storages`` does not cover, and every entry
    costs a read per call of a function that writes an argument: an attribute that is one of the
    model's buffers under another name (transformers' rotary ``original_inv_freq``) is covered."""
    from compileattn.compilation.reach import other_tensors, tensors_reached

    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(4))
            self.original_inv_freq = self.inv_freq
            self.table = torch.zeros(3)  # a plain tensor attribute: another tensor

    assert [where.rpartition(".")[2] for where, _ in other_tensors(tensors_reached([Rotary()], None))] == \
        ["Rotary's attribute 'table'"]
