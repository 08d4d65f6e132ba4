"""ALiBi (FlashAttention's ``alibi_slopes``): head h adds ``-slope[h] * |query position - key
position|`` to its logits, after scale and softcap. The kernel matrix (test_kernel_matrix.py) runs
it on every backend against the float64 oracle, with GQA, windows and softcap; this file checks
the slopes, the argument checks, the bias in closed form, and FlashAttention-2's pass-through.
"""
from __future__ import annotations

import math

import pytest
import torch
from fake_flash import RecordingFA2Extension

import compileattn
from compileattn import AttentionSpec, alibi_slopes
from compileattn.backends.base import PersistentBuffers, StepShape, StepTensors

CUDA = torch.cuda.is_available()


def test_standard_slopes():
    """The ALiBi paper's geometric slopes; between powers of two, every other slope of the next."""
    assert alibi_slopes(8) == tuple(2.0 ** -i for i in range(1, 9))
    assert alibi_slopes(1) == (2.0 ** -8,)
    twelve = alibi_slopes(12)
    assert twelve[:8] == alibi_slopes(8) and twelve[8:] == tuple(2.0 ** -(j + 0.5) for j in range(4))
    assert len(alibi_slopes(40)) == 40 and alibi_slopes(40)[:32] == alibi_slopes(32)
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)


def test_standard_slopes_take_the_head_count_by_the_int_rule():
    """argtypes' rule: numpy's integers are ints (head counts come from configs and arrays), a
    bool or a float never is (``alibi_slopes(True)`` gave one head's slopes)."""
    import numpy as np

    assert alibi_slopes(np.int64(12)) == alibi_slopes(12)
    for bad in (True, 8.0):
        with pytest.raises(TypeError, match="^num_heads must be an int"):
            alibi_slopes(bad)


def test_spec_takes_slopes_as_a_hashable_tuple():
    spec = AttentionSpec(4, 2, 64, alibi_slopes=[0.5, 0.25, 0.125, 1])
    assert spec.alibi_slopes == (0.5, 0.25, 0.125, 1.0) and hash(spec) == hash(AttentionSpec(
        4, 2, 64, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 1.0])))
    with pytest.raises(ValueError, match="alibi_slopes has 3 values, expected 4"):
        AttentionSpec(4, 2, 64, alibi_slopes=(0.5, 0.25, 0.125))
    with pytest.raises(ValueError, match="finite"):
        AttentionSpec(4, 2, 64, alibi_slopes=(0.5, 0.25, math.inf, 0.1))
    with pytest.raises(TypeError, match="alibi_slopes must hold floats"):
        AttentionSpec(4, 2, 64, alibi_slopes=(0.5, True, 0.1, 0.1))
    with pytest.raises(TypeError, match="sequence"):
        AttentionSpec(4, 2, 64, alibi_slopes=0.5)


def _uniform_logits_case(device, dtype, causal):
    """q = 0 makes every logit 0, so the weights are ALiBi's alone: exp(-slope * |i - j|), a
    closed form that shares nothing with the kernels or the oracles."""
    h, kvh, d, n = 4, 2, 64, 37
    slopes = (0.5, 0.25, 0.0, 2.0)
    v = torch.randn(n, kvh, d, generator=torch.Generator().manual_seed(0))
    q = torch.zeros(2, h, d)
    want = torch.empty(2, h, d, dtype=torch.float64)
    for row, qpos in enumerate((n - 2, n - 1)):  # two queries at the end of one sequence
        for head in range(h):
            keys = range(qpos + 1) if causal else range(n)
            w = torch.tensor([math.exp(-slopes[head] * abs(qpos - p)) for p in keys], dtype=torch.float64)
            want[row, head] = (w / w.sum()) @ v[list(keys), head // 2].double()
    cast = dict(dtype=dtype, device=device)
    cu = lambda *x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    args = (q.to(**cast), v.to(**cast), v.to(**cast), cu(0, 2), cu(0, n))
    return args, torch.tensor(slopes, device=device), want


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("causal", [True, False])
def test_bias_is_minus_slope_times_distance(backend, causal):
    if CUDA and backend == "triton":
        dtype, device = torch.bfloat16, "cuda"
    else:
        dtype, device = torch.float32, "cpu"
    (q, k, v, cu_q, cu_k), slopes, want = _uniform_logits_case(device, dtype, causal)
    out = compileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=causal, alibi_slopes=slopes, backend=backend)
    torch.testing.assert_close(out.double().cpu(), want, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


@pytest.mark.parametrize("slopes,error,match", [
    (torch.ones(4, dtype=torch.float64), TypeError, "alibi_slopes must be float32"),
    (torch.ones(3), ValueError, r"alibi_slopes must have shape \(4,\)"),
    (torch.ones(2, 4), ValueError, r"alibi_slopes must have shape \(4,\)"),
    ([1.0] * 4, TypeError, "alibi_slopes must be a float32 tensor"),
])
def test_varlen_refuses_bad_slopes(slopes, error, match):
    q = torch.randn(3, 4, 64)
    k = torch.randn(3, 2, 64)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(error, match=match):
        compileattn.flash_attn_varlen_func(q, k, k, cu, cu, alibi_slopes=slopes, backend="reference")


def test_flash_attention_2_gets_the_slopes(monkeypatch):
    """FlashAttention-2 takes ALiBi itself (``alibi_slopes``, the 10th argument of ``varlen_fwd``):
    the public path passes the caller's tensor, a prepared call a persistent tensor of the spec's
    slopes (a CUDA graph reads it by address)."""
    from compileattn.backends import flash_fa2

    ext = RecordingFA2Extension()
    monkeypatch.setattr(flash_fa2, "load", lambda: (ext, "2.7.4"))
    be = flash_fa2.FA2Backend("cuda")
    q = torch.randn(2, 4, 64)
    cache = torch.randn(3, 256, 2, 64)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    used = torch.tensor([5, 9], dtype=torch.int32)
    table = torch.tensor([[0], [2]], dtype=torch.int32)
    slopes = torch.tensor(alibi_slopes(4))
    be.varlen_attention(q, cache, cache, torch.empty_like(q), cu, None, used, table, 1, 9, 0.125, True, -1, 0.0,
                        slopes)
    assert ext.calls[-1][9] is slopes
    spec = AttentionSpec(4, 2, 64, alibi_slopes=alibi_slopes(4))
    buffers = PersistentBuffers(torch.device("cpu"))
    attend = be.prepare_attend(StepShape(2, 2, 256, 1, True), StepTensors(cu, used, table, torch.zeros(2).long()),
                               spec, torch.float16, cache, cache, buffers)
    attend(q, torch.empty_like(q))
    bound = ext.calls[-1][9]
    assert bound.dtype == torch.float32 and bound.tolist() == list(spec.alibi_slopes)
    assert bound is buffers.constant(spec.alibi_slopes)
    be.prepare_attend(StepShape(2, 2, 256, 1, True), StepTensors(cu, used, table, torch.zeros(2).long()),
                      AttentionSpec(4, 2, 64), torch.float16, cache, cache, buffers)(q, torch.empty_like(q))
    assert ext.calls[-1][9] is None


def test_flash_attention_4_refuses_alibi_with_its_reason(monkeypatch):
    """FA4 has no alibi_slopes; the refusal is what the selector logs when it falls back."""
    import fa4_sm90

    from compileattn.backends import flash_fa4

    monkeypatch.setattr(flash_fa4, "load", fa4_sm90.faked_interface)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    be = flash_fa4.FA4Backend("cuda")
    spec = AttentionSpec(8, 2, 128, alibi_slopes=alibi_slopes(8))
    assert "no ALiBi" in be.unsupported_reason(spec, torch.bfloat16, torch.device("cuda", 0), 16)
    assert be.unsupported_reason(AttentionSpec(8, 2, 128), torch.bfloat16, torch.device("cuda", 0), 16) is None
