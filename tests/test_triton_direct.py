"""The direct Triton launch (backends/triton/direct.py): it may skip ``JITFunction.run`` only for
arguments whose specialization it has seen compiled, and must go back through ``run`` whenever a
free argument's specialization (dtype, 16-byte alignment, an int's ==1 / %16) or the device
changes, or a launch hook is active. CPU: a stand-in JIT function records which path each call
took; the GPU test runs the real kernels both ways, eagerly and under CUDA-graph capture."""
from __future__ import annotations

import os
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


class _CountingVariants(dict):
    """A DirectKernel's variants, counting lookups (each keyed launch looks its key up once)."""

    lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)


def test_the_last_launchs_arguments_serve_only_equal_free_values():
    """A launch with the last launch's free values (a tensor's dtype, device type and address; an
    int's value) reuses its argument tuple without building a key; anything else is keyed again."""
    jit, active = _StandInJit(), _Active()
    launch = _kernel(jit, active)
    launch.variants = _CountingVariants()
    base = torch.zeros(64, dtype=torch.float16)
    launch(base, 32)  # compiled through run
    launch(base, 32)  # keyed: the variant is known
    assert launch.variants.lookups == 2
    launch(base, 32)  # the same values: reused
    assert launch.variants.lookups == 2
    launch(base.view(torch.int16), 32)  # the same address, another dtype: keyed, and through run
    assert launch.variants.lookups == 3 and len(jit.runs) == 2
    launch(base, 48)  # another int: keyed (the variant of 32), then reused
    launch(base, 48)
    assert launch.variants.lookups == 4
    assert [a[9:11] for a in jit.launches] == [(base.data_ptr(), 32)] * 2 + [(base.data_ptr(), 48)] * 2


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


@pytest.fixture
def no_awaiting():
    direct._awaiting.clear()
    direct.set_ahead_wait(None)
    yield
    direct._awaiting.clear()
    direct.set_ahead_wait(None)


def _spec_of(kernel, target):
    return {"name": kernel.jit.__name__, "expected": kernel.expected, "fixed": kernel.args[1].dtype}


def test_awaiting_specs_once_per_distinct_variant(no_awaiting, monkeypatch):
    """Two layers' calls with equal specs (one variant) give one spec, a third with another
    expectation its own; the calls no longer await, and a launched call is not asked."""
    monkeypatch.setattr(direct.DirectKernel, "ahead_spec", _spec_of)
    jit, active = _StandInJit(), _Active()
    calls = [_kernel(jit, active, args=(None, torch.zeros(16, dtype=torch.float16)), free=(0,)) for _ in range(4)]
    for call in calls[:3]:
        call.expect(torch.float16)
    calls[2].expect(torch.float32)
    calls[3].expect(torch.bfloat16)
    calls[3](torch.zeros(16, dtype=torch.bfloat16))  # launched: not compiled ahead
    assert direct.has_awaiting()
    specs = direct.awaiting_specs("target")
    assert sorted(str(s["expected"]) for s in specs) == ["(torch.float16,)", "(torch.float32,)"]
    assert not direct.has_awaiting() and direct.awaiting_specs("target") == []


def test_a_spec_that_cannot_be_computed_is_left_to_the_first_launch(no_awaiting, monkeypatch, caplog):
    def failing(kernel, target):
        raise KeyError("unknown option")

    monkeypatch.setattr(direct.DirectKernel, "ahead_spec", failing)
    jit, active = _StandInJit(), _Active()
    launch = _kernel(jit, active)
    launch.expect(torch.float16, 32)
    with caplog.at_level("DEBUG", logger="compileattn"):
        assert direct.awaiting_specs("target") == []
    assert "kernel: no spec to compile ahead (KeyError" in caplog.text
    launch(torch.zeros(16, dtype=torch.float16), 32)
    assert len(jit.runs) == 1


def test_the_first_launch_waits_for_the_compiles_ahead_once(no_awaiting):
    jit, active = _StandInJit(), _Active()
    events = []
    direct.set_ahead_wait(lambda: events.append("waited"))
    first, second = _kernel(jit, active), _kernel(jit, active)
    first(torch.zeros(16, dtype=torch.float16), 32)
    assert events == ["waited"] and len(jit.runs) == 1
    first(torch.zeros(16, dtype=torch.float16), 32)  # known variant: direct, no wait
    second(torch.zeros(16, dtype=torch.float16), 32)  # another call's first launch: the wait is spent
    assert events == ["waited"]


def test_expect_checks_its_arity():
    jit, active = _StandInJit(), _Active()
    with pytest.raises(TypeError, match="kernel: expect takes 2 values, got 1"):
        _kernel(jit, active).expect(torch.float16)


_AHEAD_CHECK = r"""
import sys, types
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import compiler
from triton.runtime import driver, jit as triton_jit
from compileattn.backends.triton import decode, direct, launch
from compileattn.backends.triton.config import decode_config
from compileattn.compilation import kernel_warmup

target = GPUTarget("cuda", 90, 32)

class Active:  # what JITFunction.run asks of the driver, on a machine without a GPU
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return target

# a prepared decode call (GQA 8/2, head dim 128, bf16, page 16, one split) on CPU tensors
cfg = decode_config(4, 128, torch.bfloat16, 16)
dl = launch.DecodeLaunch(cfg, 2, 8, 2, 128, 16, torch.bfloat16, launch.Softmax(0.088, 0.0, -1), 1,
                         launch.FreshScratch("cpu"))
kc = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)
cu_q, lens, table = torch.arange(3, dtype=torch.int32), torch.ones(2, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32)
tail = dl._tail(kc, cu_q, lens, table, (1024, 128), (1024, 128), None, None)
call = direct.DirectKernel(decode.decode_kernel, dl.kwargs, (None, kc, kc, None, *tail), (0, 3), Active())
call.expect(torch.bfloat16, torch.bfloat16)
# This process's Triton read its ptxas version earlier, from another ptxas than the compile
# processes will find (torch points TRITON_PTXAS_PATH at its own once Inductor compiles): the key
# of every compile here carries that version.
from triton import knobs
from triton.backends.nvidia.compiler import get_ptxas_version
knobs.nvidia.mock_ptx_version = "ptxas read earlier, from another binary"
get_ptxas_version.cache_clear()
get_ptxas_version(target.arch)
knobs.nvidia.mock_ptx_version = None
(spec,) = direct.awaiting_specs(target)

# 1. what JITFunction.run would compile for those arguments is exactly the spec
seen = {}
def record(self, key, signature, device, constexprs, options, attrs, warmup):
    seen.update(signature=signature, constexprs=constexprs, attrs=attrs, options=dict(options.__dict__))
    return types.SimpleNamespace()
driver.set_active(Active())
triton_jit.JITFunction._do_compile = record
args = list(call.args); args[0] = args[3] = triton_jit.MockTensor(torch.bfloat16)
decode.decode_kernel.run(*args, **dict(call.kwargs, warmup=True))
for key in ("signature", "constexprs", "attrs", "options"):
    assert seen[key] == spec[key], (key, seen[key], spec[key])

# 2. a compile process puts it in Triton's disk cache: compiling it here then generates no IR
assert kernel_warmup.launch([spec]) == 1
direct.wait_for_ahead()
def no_ir(*a, **k): raise AssertionError("compiled again: not in the cache")
compiler.ASTSource.make_ir = no_ir
kernel = compiler.compile(compiler.ASTSource(decode.decode_kernel, spec["signature"], spec["constexprs"],
                                             spec["attrs"]), target=target, options=spec["options"])
assert kernel.metadata.name.startswith("decode_kernel")
print("AHEAD OK")
"""


@pytest.mark.slow
def test_a_variant_compiled_ahead_is_what_run_would_compile_and_lands_in_the_disk_cache(tmp_path):
    """No GPU needed: Triton compiles sm_90 code on the CPU box (it ships ptxas). With Triton's
    driver stood in, ``JITFunction.run`` hands ``_do_compile`` exactly the spec ``ahead_spec``
    computed; a compile process (importing no torch) puts that variant in Triton's disk cache, so
    compiling it again here finds it there, also when this process keys its compiles on a ptxas
    version read earlier from another ptxas."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=os.pathsep.join(
        [str(__import__("pathlib").Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _AHEAD_CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "AHEAD OK" in proc.stdout, proc.stderr[-3000:]


def test_the_compile_process_imports_no_torch(tmp_path):
    """The compile script's stand-in packages let it import the kernel modules without compileattn's
    ``__init__`` (torch: seconds on the H200 host)."""
    import subprocess
    import sys

    from compileattn.compilation import kernel_warmup

    code = (f"import runpy, sys; runpy.run_path({str(kernel_warmup._SCRIPT)!r}, run_name='not_main')['_stand_in_packages']();"
            "import compileattn.backends.triton.decode as d; print(d.decode_kernel.__class__.__name__, "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_cuda_compiled_ahead_variant_is_the_one_launched(kind, no_awaiting, monkeypatch, tmp_path, caplog):
    """The real kernels: the prepared calls' expected variants, compiled ahead in other processes,
    are exactly what the layer's launches use (each first launch finds its variant in Triton's
    disk cache: no IR is generated here), and the output matches the reference backend's."""
    from compileattn import AttentionSpec, KVCache, set_forward_context
    from compileattn.backends.reference import ReferenceBackend
    from triton.compiler import compiler
    from test_triton_backend import TOL, builder, make_case, run_forward, triton_backend

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a fresh cache, here and in the compile processes
    for jit in _triton_kernels():
        monkeypatch.setattr(jit, "device_caches", type(jit.device_caches)(jit.create_binder))

    spec = AttentionSpec(16, 4, 128)
    lens = [(1, 900), (1, 5), (1, 2500)] if kind == "decode" else [(1, 500), (20, 30), (11, 0)]
    case = make_case(spec, torch.float16, 16, lens, device="cuda")
    md = builder(case, 16, triton_backend("cuda")).build(case["seqs"])
    cache = KVCache(case["kc"].clone(), case["vc"].clone(), spec)
    caches = {"l0": cache}
    out = torch.full_like(case["q"], 7.0)
    with set_forward_context(md, caches):
        assert direct.has_awaiting()
        from compileattn.compilation import kernel_warmup

        triton_env = lambda: {k: v for k, v in os.environ.items() if k.startswith(("TRITON", "LLVM", "MLIR"))}  # noqa: E731
        env_at_start = triton_env()  # what the compile processes inherit
        with caplog.at_level("DEBUG", logger="compileattn"):
            assert kernel_warmup.start() >= 2  # the KV write and the attention
            direct.wait_for_ahead()
        cached = sorted(p.name for p in tmp_path.glob("*/*"))
        with monkeypatch.context() as patch:
            patch.setattr(compiler.ASTSource, "make_ir", _compiled_here)
            try:
                torch.ops.compileattn.attention(case["q"], case["k"], case["v"], out, "l0")
            except AssertionError as exc:
                from triton import knobs

                from triton.backends.nvidia import compiler as nvidia

                raise AssertionError(f"{exc}; Triton's cache dir here {knobs.cache.dir}, in the compile processes "
                                     f"{tmp_path}, holding {cached}; Triton's environment then {env_at_start}, now "
                                     f"{triton_env()}; ptxas versions cached here "
                                     f"{nvidia.get_ptxas_version.cache_info()} (sm90: "
                                     f"{nvidia.get_ptxas_version(90)!r}), ptxas {knobs.nvidia.ptxas.path}; "
                                     f"log: {caplog.text}; compiled ahead: {_cached_variants(tmp_path)}") from None
        torch.cuda.synchronize()
    want, _, _ = run_forward(ReferenceBackend(), spec, case, 16)
    atol, rtol = TOL[torch.float16]
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)


def _compiled_here(src, target, options, *rest, **kwargs):
    raise AssertionError(f"a first launch generated IR: its variant was not compiled ahead; "
                         f"{_variant(src, target, options)}")


def _variant(src, target, options) -> str:
    """What a launch's Triton cache key is made of beside the source: which variant it was (its
    constexprs and specialised arguments) and its compile options."""
    return (f"launched {src.fn.__name__} constants {dict(src.constants)} attrs {dict(src.attrs)} "
            f"signature {dict(src.signature)} target {target} options {vars(options)}")


def _cached_variants(cache_dir) -> str:
    """The metadata of every kernel the compile processes left in Triton's cache (options, target,
    name), to set beside a launch's own (``_variant``)."""
    import json

    found = []
    for meta in sorted(cache_dir.glob("*/*.json")):
        if meta.name.startswith("__grp__"):
            continue
        data = json.loads(meta.read_text())
        found.append(f"{meta.parent.name[:12]}/{meta.name}: {data}")
    return "; ".join(found)


def _triton_kernels():
    from compileattn.backends.triton import decode, kv_write, unified

    return decode.decode_kernel, decode.combine_kernel, kv_write.kv_write_kernel, unified.unified_kernel


def _add_one(x):
    return x + 1


def test_only_a_cold_first_call_compiles_kernels_ahead(tmp_path, monkeypatch):
    """A warm start finds the attention kernels in Triton's disk cache (the cold run left them
    there): compiling them ahead is for the cold path, and only with ``compile_kernels_ahead``."""
    import compileattn as ca
    from compileattn.compilation import kernel_warmup

    calls = []
    monkeypatch.setattr(kernel_warmup, "start", lambda: calls.append("start") or 0)

    def first_call(cache="a", **config):
        compiled = ca.compile(_add_one, dynamic_arg_dims={"x": 0},
                              config=ca.CompileConfig(cache_dir=str(tmp_path / cache), piece_compiler="eager",
                                                      **config))
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
        return compiled.compile_stats["path"]

    assert first_call() == "cold" and calls == ["start"] * 2  # before Dynamo, and the backend's (no-op then)
    assert first_call() == "warm" and calls == ["start"] * 2
    assert first_call("b", compile_kernels_ahead=False) == "cold" and calls == ["start"] * 2


def test_awaiting_specs_past_the_limit_stay_awaiting(no_awaiting, monkeypatch):
    monkeypatch.setattr(direct.DirectKernel, "ahead_spec", _spec_of)
    jit, active = _StandInJit(), _Active()
    calls = [_kernel(jit, active, args=(None, torch.zeros(16, dtype=dtype)), free=(0,))
             for dtype in (torch.float16, torch.float32, torch.bfloat16)]
    for call in calls:
        call.expect(call.args[1].dtype)
    assert len(direct.awaiting_specs("target", limit=2)) == 2
    assert direct.has_awaiting() and len(direct.awaiting_specs("target")) == 1


def test_compiling_ahead_never_fails_the_first_call(no_awaiting, monkeypatch, caplog):
    """Whatever goes wrong while starting the compiles ahead leaves the kernels to their first
    launch; without a prepared Triton call (its module never imported) nothing is started."""
    import sys
    import types

    from compileattn import context
    from compileattn.compilation import kernel_warmup

    monkeypatch.setattr(context, "_current", types.SimpleNamespace(
        metadata=types.SimpleNamespace(device=torch.device("cuda", 0))))
    monkeypatch.setattr(direct, "has_awaiting", lambda: True)
    monkeypatch.setattr("compileattn.backends.triton._mode.interpreting", lambda: False)

    def broken(*a, **k):
        raise RuntimeError("no driver")

    monkeypatch.setattr(direct, "awaiting_specs", broken)
    monkeypatch.setattr(kernel_warmup, "_settle_cache_dir", lambda device: None)
    with caplog.at_level("DEBUG", logger="compileattn"):
        assert kernel_warmup.start() == 0
    assert "not compiled ahead" in caplog.text
    monkeypatch.delitem(sys.modules, "compileattn.backends.triton.direct")
    assert kernel_warmup.start() == 0


def test_the_cache_dir_is_settled_before_the_compile_processes_start(monkeypatch):
    """With ``TRITON_CACHE_DIR`` unset, Inductor sets it when it builds its first kernel, after
    the compile processes started: set it first, to the same directory, so both sides agree."""
    from compileattn import _torch_compat
    from compileattn.compilation import kernel_warmup

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    kernel_warmup._settle_cache_dir(torch.device("cuda", 1))
    assert os.environ["TRITON_CACHE_DIR"] == _torch_compat.inductor_triton_cache_dir(1) is not None
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    kernel_warmup._settle_cache_dir(torch.device("cuda", 0))
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"


def test_torch_compiles_backend_compiles_kernels_ahead_too(monkeypatch):
    import compileattn as ca
    from compileattn.compilation import kernel_warmup

    calls = []
    monkeypatch.setattr(kernel_warmup, "start", lambda: calls.append("start") or 0)
    for ahead in (True, False):
        torch._dynamo.reset()
        compiled = torch.compile(_add_one, backend="compileattn", dynamic=False,
                                 options={"piece_compiler": "eager", "compile_kernels_ahead": ahead})
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert calls == ["start"]


# A compile process whose compiling process ends (killed, or exiting before the first launch)
# compiles for nobody: it must not run on for the rest of its compile, or for good if stuck.
_AHEAD_ORPHANED = r"""
import os, signal, sys, time
from compileattn.compilation import kernel_warmup
marker = sys.argv[1]
assert kernel_warmup.launch([{"module": "slow_ahead_kernel", "name": "kernel"}]) == 1
deadline = time.monotonic() + 60
while not os.path.exists(marker) and time.monotonic() < deadline:
    time.sleep(0.02)
print(open(marker).read(), flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(0)  # no wait for the compile (an exit through atexit would do the same)
"""


@pytest.mark.parametrize("end", ["kill", "exit"])
def test_a_compile_process_ends_with_the_compiling_process(tmp_path, end):
    import subprocess
    import sys
    from pathlib import Path

    from processes import assert_all_end

    marker = tmp_path / "pid"
    # the "kernel module": importing it is a compile that takes a minute
    (tmp_path / "slow_ahead_kernel.py").write_text(
        f"import os, time\nopen({str(marker) + '.tmp'!r}, 'w').write(str(os.getpid()))\n"
        f"os.rename({str(marker) + '.tmp'!r}, {str(marker)!r})\ntime.sleep(60)\n")
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, str(tmp_path)]))
    proc = subprocess.run([sys.executable, "-c", _AHEAD_ORPHANED, str(marker), end], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.stdout.strip().isdigit(), proc.stderr[-3000:]
    pid = int(proc.stdout)
    assert_all_end([pid], 5, f"the compile process still runs after the compiling process's {end}")
