"""The direct Triton launch (backends/triton/direct.py): it may skip ``JITFunction.run`` only for
arguments whose specialization it has seen compiled, and must go back through ``run`` whenever a
free argument's specialization (dtype, 16-byte alignment, an int's ==1 / %16) or the device
changes, or a launch hook is active. CPU: a stand-in JIT function records which path each call
took; the GPU test runs the real kernels both ways, eagerly and under CUDA-graph capture."""
from __future__ import annotations

import types

import pytest
import torch

from compileattn.backends.triton import direct


class _Param:
    def __init__(self, name, default=None):
        self.name, self.default = name, default


class _StandInJit:
    """``kernel(a_ptr, n, BLOCK: constexpr = 4, FLAG: constexpr = False)``."""

    __name__ = "kernel"

    def __init__(self):
        self.params = [_Param("a_ptr"), _Param("n"), _Param("BLOCK", 4), _Param("FLAG", False)]
        self.runs = []
        self.launches = []

    def run(self, *args, grid, warmup, **constexprs):
        self.runs.append((args, grid, constexprs))
        jit = self

        def launcher(*launch_args):
            jit.launches.append(launch_args)
        return types.SimpleNamespace(run=launcher, function=f"fn{len(self.runs)}", packed_metadata="meta")


class _Active:
    device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


def _kernel(jit, active, args=(None, None), free=(0, 1)):
    return direct.DirectKernel(jit, dict(grid=(3, 2), warmup=False, BLOCK=8, num_warps=4), args, free, active)


def test_second_call_with_the_same_specialization_launches_directly():
    jit, active = _StandInJit(), _Active()
    launch = _kernel(jit, active)
    a = torch.zeros(16, dtype=torch.float16)
    launch(a, 32)
    launch(a, 48)  # 48 % 16 == 0 like 32: same kernel
    assert len(jit.runs) == 1 and jit.runs[0][0] == (a, 32)  # run gets the tensor itself
    # the launcher gets every argument, a tensor as its address, then the constexprs
    assert jit.launches == [(3, 2, 1, 1000, "fn1", "meta", None, None, None, a.data_ptr(), 48, 8, False)]


def test_fixed_tensors_are_passed_by_address_and_kept_alive():
    jit, active = _StandInJit(), _Active()
    fixed = torch.zeros(16, dtype=torch.float16)
    launch = _kernel(jit, active, args=(None, fixed), free=(0,))
    assert launch.args[1] is fixed
    a = torch.zeros(16, dtype=torch.float16)
    launch(a)
    launch(a)
    assert jit.runs[0][0] == (a, fixed)
    assert jit.launches[0][9:11] == (a.data_ptr(), fixed.data_ptr())


def test_a_slow_first_launch_is_logged_at_debug(monkeypatch, caplog):
    """A variant's first launch that compiles (or loads from disk) shows in a cold start's DEBUG
    log; a fast one (found in memory) does not."""
    jit, active = _StandInJit(), _Active()
    launch = _kernel(jit, active)
    a = torch.zeros(16, dtype=torch.float16)
    ticks = iter([10.0, 10.0 + 2 * direct.COMPILE_LOG_S, 20.0, 20.0 + direct.COMPILE_LOG_S / 10])
    monkeypatch.setattr(direct.time, "perf_counter", lambda: next(ticks))
    with caplog.at_level("DEBUG", logger="compileattn"):
        launch(a, 32)  # slow: logged
        launch(a[1:], 32)  # another variant, fast: not logged
    messages = [r.getMessage() for r in caplog.records if r.name == "compileattn"]
    assert messages == ["triton kernel: a new variant's first launch took 0.002 s (compiled, or loaded from "
                        "Triton's cache)"]


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_mod16", "int_one"])
def test_a_new_specialization_goes_through_run(change):
    jit, active = _StandInJit(), _Active()
    launch = _kernel(jit, active)
    base = torch.zeros(64, dtype=torch.float16)
    launch(base, 32)
    args = {"misaligned": (base[1:], 32), "dtype": (base.to(torch.float32), 32), "int_mod16": (base, 33),
            "int_one": (base, 1)}[change]
    launch(*args)
    assert len(jit.runs) == 2 and jit.launches == []
    launch(*args)  # now known: direct
    assert len(jit.runs) == 2 and len(jit.launches) == 1


def test_scratch_free_kernel_launches_through_the_c_entry(monkeypatch):
    """Triton 3.6's ``CudaLauncher.__call__`` only allocates scratch and calls ``launch``: with no
    scratch the direct path calls ``launch`` itself, with what ``__call__`` would pass."""
    calls = []
    launcher = types.SimpleNamespace(global_scratch_size=0, profile_scratch_size=0, launch_cooperative_grid=False,
                                     launch_pdl=True, launch=lambda *a: calls.append(a))
    kernel = types.SimpleNamespace(run=launcher, function="fn", packed_metadata="meta")
    monkeypatch.setattr(direct, "_LAUNCHER_CHECKED", True)
    call, prefix = direct._variant(kernel)
    call(3, 2, 1, 1000, *prefix, "a", 32)
    assert calls == [(3, 2, 1, 1000, "fn", False, True, None, None, "meta", None, None, None, "a", 32)]
    launcher.global_scratch_size = 128  # needs scratch: through the launcher's own __call__
    assert direct._variant(kernel)[0] is launcher


def test_active_launch_hook_goes_through_run(monkeypatch):
    jit, active = _StandInJit(), _Active()
    launch = _kernel(jit, active)
    a = torch.zeros(16, dtype=torch.float16)
    launch(a, 32)
    monkeypatch.setattr(direct, "_hooks_active", lambda: True)
    launch(a, 32)
    launch(a, 32)
    assert len(jit.runs) == 3 and jit.launches == []


def test_bad_arguments_raise_naming_the_kernel():
    jit, active = _StandInJit(), _Active()
    with pytest.raises(TypeError, match="kernel: 5 positional arguments for 4 parameters"):
        _kernel(jit, active, args=(None,) * 5)
    launch = _kernel(jit, active)
    with pytest.raises(TypeError, match="kernel: argument 1 must be a tensor or an int, got float"):
        launch(torch.zeros(16), 2.5)


def test_hooks_of_this_triton_are_read():
    assert direct._hooks_active() is False


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_cuda_direct_launch_follows_a_misaligned_query(kind):
    """The real kernels: aligned query (compiles, then launches directly), the same values in a
    query 2 bytes off 16-byte alignment (a new specialization: through ``run``), then aligned
    again (direct): every output equals the first."""
    from compileattn import AttentionSpec, KVCache
    from test_triton_backend import builder, layer_forward, make_case, triton_backend

    spec = AttentionSpec(16, 4, 128)
    lens = [(1, 900), (1, 5), (1, 2500)] if kind == "decode" else [(1, 500), (20, 30), (11, 0)]
    case = make_case(spec, torch.float16, 16, lens, device="cuda")
    md = builder(case, 16, triton_backend("cuda")).build(case["seqs"])
    cache = KVCache(case["kc"].clone(), case["vc"].clone(), spec)
    q = case["q"]
    storage = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    misaligned = storage[1:].view(q.shape).copy_(q)
    assert misaligned.data_ptr() % 16 != 0 and misaligned.is_contiguous()
    outs = []
    for query in (q, q, misaligned, q):
        out = torch.full_like(q, 7.0)
        layer_forward(md, cache, query, case["k"], case["v"], out)
        outs.append(out)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=0, rtol=0)


# -- compiling ahead of the first launch (compilation/kernel_warmup.py) ------------------------------


class _WarmupJit(_StandInJit):
    """Records warm-up compiles apart from launches' ``run`` calls."""

    def __init__(self):
        super().__init__()
        self.warmups = []

    def run(self, *args, grid, warmup, **constexprs):
        if warmup:
            self.warmups.append(args)
            return types.SimpleNamespace(run="launcher")
        return super().run(*args, grid=grid, warmup=warmup, **constexprs)


@pytest.fixture
def no_awaiting():
    direct._awaiting.clear()
    yield
    direct._awaiting.clear()


def test_expected_variant_is_compiled_ahead_once_per_distinct_variant(no_awaiting):
    """Two prepared calls of one kernel with equal specializations (two layers' caches, both
    16-byte aligned) compile ahead once; the free tensor goes as Triton's MockTensor of the
    expected dtype (address 0: aligned), the fixed one as itself; the launch then takes ``run``."""
    from triton.runtime.jit import MockTensor

    jit, active = _WarmupJit(), _Active()
    layers = [_kernel(jit, active, args=(None, torch.zeros(16, dtype=torch.float16)), free=(0,)) for _ in range(2)]
    for launch in layers:
        launch.expect(torch.float16)
    assert direct.has_awaiting()
    assert direct.precompile_awaiting() == 1
    assert not direct.has_awaiting()
    (args,) = jit.warmups
    assert isinstance(args[0], MockTensor) and args[0].dtype == torch.float16 and args[1] is layers[0].args[1]
    layers[0](torch.zeros(16, dtype=torch.float16))
    assert len(jit.runs) == 1  # the first launch asks run (which finds the compiled variant)


def test_different_expected_specializations_compile_apart(no_awaiting):
    jit, active = _WarmupJit(), _Active()
    a, b = _kernel(jit, active), _kernel(jit, active)
    a.expect(torch.float16, 32)
    b.expect(torch.float16, 1)  # == 1: another variant
    assert direct.precompile_awaiting() == 2


def test_a_launched_kernel_is_not_compiled_ahead(no_awaiting):
    jit, active = _WarmupJit(), _Active()
    launch = _kernel(jit, active)
    launch.expect(torch.float16, 32)
    launch(torch.zeros(16, dtype=torch.float16), 32)
    assert not direct.has_awaiting() and direct.precompile_awaiting() == 0 and jit.warmups == []


def test_a_failed_compile_ahead_is_left_to_the_first_launch(no_awaiting, caplog):
    jit, active = _WarmupJit(), _Active()

    def failing(*args, grid, warmup, **constexprs):
        if warmup:
            raise RuntimeError("no target")
        return _StandInJit.run(jit, *args, grid=grid, warmup=warmup, **constexprs)

    jit.run = failing
    launch = _kernel(jit, active)
    launch.expect(torch.float16, 32)
    with caplog.at_level("DEBUG", logger="compileattn"):
        assert direct.precompile_awaiting() == 0
    assert "compiling ahead failed (RuntimeError: no target)" in caplog.text
    launch(torch.zeros(16, dtype=torch.float16), 32)
    assert len(jit.runs) == 1 and jit.launches == []


def test_a_first_launch_waits_for_a_compile_ahead_in_progress(no_awaiting):
    """The launch would compile the variant the background thread is making: it waits for it."""
    import threading

    jit, active = _WarmupJit(), _Active()
    events, started, release = [], threading.Event(), threading.Event()
    plain = jit.run

    def slow(*args, grid, warmup, **constexprs):
        if warmup:
            started.set()
            release.wait(10)
            events.append("compiled ahead")
        else:
            events.append("launch's run")
        return plain(*args, grid=grid, warmup=warmup, **constexprs)

    jit.run = slow
    launch = _kernel(jit, active)
    launch.expect(torch.float16, 32)
    thread = threading.Thread(target=direct.precompile_awaiting)
    thread.start()
    assert started.wait(10)
    first = threading.Thread(target=launch, args=(torch.zeros(16, dtype=torch.float16), 32))
    first.start()
    first.join(0.2)
    assert first.is_alive()  # waiting
    release.set()
    thread.join(10)
    first.join(10)
    assert events == ["compiled ahead", "launch's run"]


def test_expect_checks_its_arity():
    jit, active = _WarmupJit(), _Active()
    with pytest.raises(TypeError, match="kernel: expect takes 2 values, got 1"):
        _kernel(jit, active).expect(torch.float16)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_cuda_compiled_ahead_variant_is_the_one_launched(kind, no_awaiting):
    """The real kernels: the prepared calls' expected variants, compiled ahead, are exactly what the
    layer's launches use (Triton's in-memory caches gain no entry at the launch, where a wrong
    guess would compile another), and the output matches the reference backend's."""
    from compileattn import AttentionSpec, KVCache, set_forward_context
    from compileattn.backends.reference import ReferenceBackend
    from compileattn.backends.triton import decode, kv_write, unified
    from test_triton_backend import TOL, builder, make_case, run_forward, triton_backend

    def cached_variants() -> int:
        return sum(len(jit.device_caches[d][0]) for jit in (decode.decode_kernel, decode.combine_kernel,
                                                               kv_write.kv_write_kernel, unified.unified_kernel)
                   for d in jit.device_caches)

    spec = AttentionSpec(16, 4, 128)
    lens = [(1, 900), (1, 5), (1, 2500)] if kind == "decode" else [(1, 500), (20, 30), (11, 0)]
    case = make_case(spec, torch.float16, 16, lens, device="cuda")
    md = builder(case, 16, triton_backend("cuda")).build(case["seqs"])
    cache = KVCache(case["kc"].clone(), case["vc"].clone(), spec)
    caches = {"l0": cache}
    out = torch.full_like(case["q"], 7.0)
    with set_forward_context(md, caches):
        assert direct.has_awaiting()
        assert direct.precompile_awaiting(torch.device("cuda")) >= 2  # the KV write and the attention
        before = cached_variants()
        torch.ops.compileattn.attention(case["q"], case["k"], case["v"], out, "l0")
        torch.cuda.synchronize()
        assert cached_variants() == before
    want, _, _ = run_forward(ReferenceBackend(), spec, case, 16)
    atol, rtol = TOL[torch.float16]
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
