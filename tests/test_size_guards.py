"""What a compile assumed of the dynamic sizes (compilation/size_guards.py, piecewise.assume_guards).

Two assumptions reproduce on the CPU: a branch of the trace on a dynamic size, and Inductor's C++
summation, which drops its accuracy helper when the sum has at most 4096 terms and guards on that
(``s <= 4096``): the same kind of guard as the GPU's 32-bit indexing (``tokens * vocab <= 2**31 -
1``), whose crossing wraps indices. Each path must keep the guard: the decorator checks it per call
(also after a warm start), a worker's dynamic-shape compile and a compile-cache entry bring it back
into Dynamo's ShapeEnv, so that ``torch.compile`` recompiles rather than run past it.
"""
from __future__ import annotations

import pytest
import torch

import compileattn as ca
from compileattn import counters
from compileattn.compilation import compile_pool
from compileattn.compilation.backend import compileattn_backend
from compileattn.compilation.decorator import RecompileError
from compileattn.compilation.size_guards import SizeGuards, UncheckableGuard
from compileattn.compilation.size_reads import SizeRead

#: Inductor's C++ summation keeps its accuracy helper off up to this many terms, and guards on it.
CPU_SUM_CHUNK = 4096


def branchy(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > 100:
        return x * 3
    return x + 1


def column_sums(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum(0)


def assert_sums_close(out: torch.Tensor, sums, x: torch.Tensor) -> None:
    """Compare ``out`` with ``sums(x)`` in fp64, each column within a bound of its own summation error.

    ``sums`` must be a positive-weighted sum over dim 0, so that ``sums(|x|)`` is the sum of the terms'
    magnitudes. A float32 sum of n terms in another order (Inductor's chunked C++ loop against ATen's)
    can differ by up to about ``log2(n) * eps * sum(|terms|)``: a relative tolerance alone fails on a
    column whose sum happens to be near zero (CI saw 0.1719 vs 0.1719 at rtol 1e-4 on 4096 rows).
    """
    expected = sums(x.double())
    bound = 16 * torch.finfo(torch.float32).eps * sums(x.double().abs())
    error = (out.double() - expected).abs()
    assert bool((error <= bound + 1e-6).all()), f"sums off by {error.tolist()}, bounds {bound.tolist()}"


def test_a_call_past_a_traced_branch_is_refused_not_answered_from_the_other_branch():
    f = ca.compile(dynamic_arg_dims={"x": 0}, config=ca.CompileConfig(piece_compiler="eager", compile_workers=0))(
        lambda x: branchy(x))
    for n in (8, 100, 1, 37):
        x = torch.randn(n, 4)
        assert torch.equal(f(x), branchy(x))
    with pytest.raises(RecompileError, match=r"argument 'x' has x\.size\(0\) = 101, but the compiled code assumes "
                                             r"x\.size\(0\) <= 100"):
        f(torch.randn(101, 4))


def test_a_compile_whose_guards_cannot_be_checked_is_refused_once_for_good(monkeypatch):
    """A later call raises the same refusal at once: tracing and compiling again would only fail again."""
    reads = []

    def uncheckable(cls, shape_env, dynamic, strided=None):
        reads.append(dynamic)
        raise UncheckableGuard("the compile assumed s9 <= 7, of s9, which is not a dynamic dim of an argument")

    monkeypatch.setattr(SizeGuards, "from_shape_env", classmethod(uncheckable))
    f = ca.compile(dynamic_arg_dims={"x": 0}, config=ca.CompileConfig(piece_compiler="eager", compile_workers=0))(
        lambda x: branchy(x))
    for _ in range(3):
        with pytest.raises(UncheckableGuard, match=r"assumed s9 <= 7.*torch\.compile\(backend='compileattn'\)"):
            f(torch.randn(8, 4))
    assert reads == [{"x": (0,)}]


def test_inductor_guards_are_checked_by_the_decorator_and_kept_by_its_warm_start(tmp_path, caplog):
    config = ca.CompileConfig(compile_workers=0, compile_sizes=(), cache_dir=str(tmp_path))
    cold = ca.compile(dynamic_arg_dims={"x": 0}, config=config)(column_sums)
    x = torch.randn(8, 4)
    assert_sums_close(cold(x), column_sums, x)
    assert cold.compile_stats["path"] == "cold"
    warm = ca.compile(dynamic_arg_dims={"x": 0}, config=config)(column_sums)
    assert_sums_close(warm(x), column_sums, x)
    assert warm.compile_stats["path"] == "warm"
    for f in (cold, warm):
        x = torch.randn(CPU_SUM_CHUNK, 4)
        assert_sums_close(f(x), column_sums, x)
        with pytest.raises(RecompileError, match=rf"x\.size\(0\) = {CPU_SUM_CHUNK + 1}, but the compiled code "
                                                 rf"assumes x\.size\(0\) <= {CPU_SUM_CHUNK}"):
            f(torch.randn(CPU_SUM_CHUNK + 1, 4))


class _CountingBackend:
    """The compileattn backend, counting Dynamo's compiles (a recompile is a second one)."""

    def __init__(self, **options):
        self.options = options
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.calls += 1
        return compileattn_backend(gm, example_inputs, options=self.options)


def _compiled_column_sums(backend):
    compiled = torch.compile(column_sums, backend=backend, fullgraph=True)

    def call(n: int) -> torch.Tensor:
        x = torch.randn(n, 4)
        torch._dynamo.mark_dynamic(x, 0)
        out = compiled(x)
        assert_sums_close(out, column_sums, x)
        return out

    return call


def test_a_workers_dynamic_compile_brings_its_guards_back(monkeypatch):
    """Compiled in a worker (``COMPILE_UNSTARTED_HERE`` off: the compiling process leaves the
    dynamic-shape compile to it), the piece's guard joins Dynamo's ShapeEnv: a call past it makes
    Dynamo compile again instead of running the piece there."""
    monkeypatch.setattr(compile_pool, "COMPILE_UNSTARTED_HERE", False)
    torch._dynamo.reset()
    backend = _CountingBackend(compile_sizes=(2,), compile_workers=1, background_static_compiles=False)
    call = _compiled_column_sums(backend)
    try:
        with counters.expect(dynamic_compiles_in_workers=1, static_compiles_in_workers=1):
            call(8)
    finally:
        compile_pool.release()
    call(CPU_SUM_CHUNK)
    assert backend.calls == 1
    call(CPU_SUM_CHUNK + 1)
    assert backend.calls == 2, "the worker's guard did not reach Dynamo: the piece ran past it"


def test_a_cached_dynamic_piece_brings_its_guards_back(tmp_path):
    """Loaded from the compile cache by a later compile (Dynamo reset), the piece's guard joins
    Dynamo's ShapeEnv as if it had been compiled there."""
    options = {"compile_sizes": (), "compile_workers": 0, "cache_dir": str(tmp_path)}
    torch._dynamo.reset()
    _compiled_column_sums(_CountingBackend(**options))(8)
    torch._dynamo.reset()
    backend = _CountingBackend(**options)
    call = _compiled_column_sums(backend)
    with counters.expect(cache_hits=1, backend_compiles=0):
        call(8)
    call(CPU_SUM_CHUNK + 1)
    assert backend.calls == 2, "the cached piece's guard did not reach Dynamo: the piece ran past it"


_lib = torch.library.Library("compileattn_size_guards", "DEF")
_lib.define("boundary(Tensor x) -> Tensor")
_lib.impl("boundary", lambda x: x.clone(), "CompositeExplicitAutograd")
torch.library.register_fake("compileattn_size_guards::boundary")(lambda x: torch.empty_like(x))


def two_pieces(x: torch.Tensor) -> torch.Tensor:
    y = (x * 2).sum(0)
    z = torch.ops.compileattn_size_guards.boundary(x)
    return y + (z * 3).sum(0)


def test_a_cached_piece_keeps_the_guards_an_earlier_piece_made(tmp_path):
    """The second piece's compile adds no guard of its own: the first piece's ``s <= 4096`` already
    let it decide statically. Its cache entry must still carry that guard, or a later compile whose
    first call has 5000 rows (the first piece then compiled afresh, without it) would load code
    that assumed it."""
    options = {"compile_sizes": (), "compile_workers": 0, "splitting_ops": ("compileattn_size_guards::boundary",)}

    def compile_and_call(n: int) -> None:
        compiled = torch.compile(two_pieces, backend=_CountingBackend(**options, cache_dir=str(tmp_path)),
                                 fullgraph=True)
        x = torch.randn(n, 4)
        torch._dynamo.mark_dynamic(x, 0)
        assert_sums_close(compiled(x), two_pieces, x)

    torch._dynamo.reset()
    with counters.expect(backend_compiles=2, cache_hits=0):
        compile_and_call(8)
    torch._dynamo.reset()
    with counters.expect(cache_hits=0, cache_misses=2):
        compile_and_call(CPU_SUM_CHUNK + 1000)


def test_size_guards_check_each_argument_where_the_call_passes_it():
    guards = SizeGuards(symbols=(("s0", "x", SizeRead("shape", 0)), ("s1", "rest[0]", SizeRead("shape", 1))),
                        equal=(("s0", "kw['z']", SizeRead("shape", 0)),), guards=("s0 <= 100", "(s1 % 2) == 0"))
    check = guards.checker({"x": 0, "rest[0]": 1, "kw['z']": "z"}, {})
    assert check((torch.empty(5), torch.empty(3, 4)), {"z": torch.empty(5)})
    assert not check((torch.empty(5), torch.empty(3, 3)), {"z": torch.empty(5)})
    assert not check((torch.empty(5), torch.empty(3, 4)), {"z": torch.empty(6)})
    assert not check((torch.empty(101), torch.empty(3, 4)), {"z": torch.empty(101)})
    call = {"x": torch.empty(5), "rest[0]": torch.empty(2, 3), "kw['z']": torch.empty(5)}
    assert guards.explain(call.__getitem__) == (
        "rest[0]", "has rest[0].size(1) = 3, but the compiled code assumes (rest[0].size(1) % 2) == 0 (a guard of "
                   "the first call's trace or compile)")
    call.update({"rest[0]": torch.empty(2, 4), "kw['z']": torch.empty(6)})
    assert guards.explain(call.__getitem__)[0] == "kw['z']"
    assert not SizeGuards() and SizeGuards().checker({}, {})((), {})


def test_size_guards_read_strides_where_a_symbol_was_made_for_one():
    """A padded row's stride is a symbol of its own, which Dynamo may guard or share with a size."""
    guards = SizeGuards(symbols=(("s0", "x", SizeRead("shape", 0)), ("s7", "x", SizeRead("stride", 0))),
                        equal=(("s0", "y", SizeRead("stride", 1)),), guards=("s7 != 8",))
    check = guards.checker({"x": 0, "y": 1}, {})
    padded = torch.empty(5, 16)[:, :8]
    assert check((padded, torch.empty(4, 5).t()), {})
    assert not check((torch.empty(5, 8), torch.empty(4, 5).t()), {})
    assert not check((padded, torch.empty(4, 6).t()), {})
    assert guards.explain({"x": padded, "y": torch.empty(4, 6).t()}.__getitem__) == (
        "y", "has y.stride(1) = 6, but the compiled code assumes it equals x.size(0) (5), as on the first call")


@pytest.mark.cuda
def test_cuda_a_call_past_inductors_32_bit_indexing_is_refused_or_recompiled():
    """On the GPU Inductor indexes a kernel in 32 bits where its buffers fit at the traced size and
    guards ``numel <= 2**31 - 1``; past it the indices would wrap. The decorator refuses such a call,
    naming the assumption; ``torch.compile`` with the backend recompiles and answers right."""
    width = 2 ** 20  # 2049 rows: 2,148,532,224 elements, past 2**31 - 1

    def body(x):
        return torch.relu(x) * 2 + 1

    f = ca.compile(dynamic_arg_dims={"x": 0}, config=ca.CompileConfig(compile_workers=0, compile_sizes=()))(
        lambda x: body(x))
    small = torch.randn(8, width, dtype=torch.float16, device="cuda")
    assert torch.equal(f(small), body(small))
    big = torch.randn(2049, width, dtype=torch.float16, device="cuda")
    with pytest.raises(RecompileError, match=r"assumes 1048576\*x\.size\(0\) <= 2147483647"):
        f(big)
    torch._dynamo.reset()
    backend = _CountingBackend(compile_workers=0, compile_sizes=())
    g = torch.compile(body, backend=backend, fullgraph=True)
    torch._dynamo.mark_dynamic(small, 0)
    assert torch.equal(g(small), body(small))
    torch._dynamo.mark_dynamic(big, 0)
    out = g(big)
    assert backend.calls == 2 and torch.equal(out, body(big))


def three_quarters(x: torch.Tensor) -> torch.Tensor:
    if int(x.shape[0] * 0.75) > 5:
        return x * 3
    return x + 1


def test_a_guard_torch_prints_with_math_functions_is_checked_too():
    f = ca.compile(dynamic_arg_dims={"x": 0}, config=ca.CompileConfig(piece_compiler="eager", compile_workers=0))(
        lambda x: three_quarters(x))
    for n in (8, 9, 8):
        x = torch.randn(n, 2)
        assert torch.equal(f(x), three_quarters(x))
    with pytest.raises(RecompileError, match="argument 'x' has x.size"):
        f(torch.randn(6, 2))


def test_guards_that_do_not_all_hold_are_not_assumed_at_all():
    """A cached piece's guards are assumed only if every one holds at this compile's sizes:
    assuming one that does not would record its negation in Dynamo's ShapeEnv."""
    from compileattn import _torch_compat
    from compileattn.compilation import piecewise

    seen = {}

    def backend(gm, example_inputs):
        shape_env = _torch_compat.tracing_shape_env()
        values = [_torch_compat.node_example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
        (s,) = {v.shape[0].node.expr for v in values if isinstance(v, torch.Tensor)}
        before = len(shape_env.guards)
        seen["refused"] = piecewise.assume_guards((s <= 100, s <= 4))
        seen["added"] = len(shape_env.guards) - before
        seen["assumed"] = piecewise.assume_guards((s <= 100,))
        seen["then"] = len(shape_env.guards) - before
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: x * 2, backend=backend, dynamic=True)(torch.randn(8))
    assert "does not hold" in seen["refused"] and seen["added"] == 0
    assert seen["assumed"] is None and seen["then"] == 1


def test_dynamic_arg_dims_cannot_name_the_extra_arguments():
    """``*args`` and ``**kwargs`` collect other arguments: their dims cannot be named (they used to be
    accepted and left static)."""
    for name, fn in (("rest", lambda x, *rest: x), ("extra", lambda x, **extra: x)):
        with pytest.raises(ValueError, match=f"'{name}' collects"):
            ca.compile(dynamic_arg_dims={name: 0})(fn)
