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
