"""fp8 (float8_e4m3fn) KV caches: the write quantizes, every kernel dequantizes, and the result
stays within the documented distance of the bf16 result.

- The cache record: a quantized cache needs the queries' dtype and positive scales (per layer or
  per KV head); an unquantized one refuses scales.
- The write: every writer (torch masked, torch capturable, Triton) stores exactly
  ``round(clamp(x / scale, +-448))`` per KV head, skips slot -1.
- Attention: the reference over an fp8 cache equals the float64 oracle (tests/naive.py) over the
  dequantized values; Triton (under the interpreter here, compiled on the GPU) equals the
  reference, for decode (split-KV) and mixed steps, per-layer and per-head scales.
- Accuracy: against the same step over the bf16 cache the data was quantized from, the
  norm-relative error stays below ``FP8_REL_ERROR_BOUND`` (kv_cache.py says how it was set).
- GPU: the same against the compiled kernels, and a decode step captured in a CUDA graph replays
  with new metadata over an fp8 cache.
"""
from __future__ import annotations

import naive
import pytest
import torch

import compileattn
from compileattn import (
    AttentionMetadataBuilder, AttentionSpec, KVCache, SequenceStep, allocate_kv_caches, fp8_scale,
    set_forward_context,
)
from compileattn.backends.kv_write import write_kv_masked, write_kv_padded
from compileattn.backends.reference import ReferenceBackend
from compileattn.kv_cache import FP8_E4M3_MAX, FP8_REL_ERROR_BOUND
from compileattn.testing import AttentionBlock
from compileattn.testing import warm_up_for_capture

FP8 = torch.float8_e4m3fn
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
cpu_only = pytest.mark.skipif(CUDA, reason="interpreter tests (the GPU runs the compiled kernels)")


def stored(x: torch.Tensor, scale) -> torch.Tensor:
    """The fp8 value of (tokens, kv_heads, d) rows, restated: x / scale per head, saturated, RNE."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(-1)
    s = s.expand(x.shape[1]).view(1, -1, 1)
    return (x.float() / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)


def dequantized(x8: torch.Tensor, scale) -> torch.Tensor:
    s = torch.as_tensor(scale, dtype=torch.float64).reshape(-1).expand(x8.shape[1]).view(1, -1, 1)
    return x8.cpu().double() * s


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# the cache record


def test_quantized_cache_needs_the_query_dtype_and_positive_scales():
    spec = AttentionSpec(4, 2, 64)
    z = lambda dtype: torch.zeros(3, 16, 2, 64, dtype=dtype)  # noqa: E731
    with pytest.raises(ValueError, match="query_dtype is required"):
        KVCache(z(FP8), z(FP8), spec, k_scale=0.1, v_scale=0.1)
    with pytest.raises(TypeError, match="query_dtype"):
        KVCache(z(FP8), z(FP8), spec, query_dtype=FP8)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="k_scale"):
            KVCache(z(FP8), z(FP8), spec, k_scale=bad, query_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="v_scale has 3 values, expected 2"):
        KVCache(z(FP8), z(FP8), spec, v_scale=[0.1, 0.2, 0.3], query_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn caches only"):
        KVCache(z(torch.float16), z(torch.float16), spec, k_scale=0.5)
    with pytest.raises(TypeError, match="query_dtype"):
        KVCache(z(torch.float16), z(torch.float16), spec, query_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        KVCache(z(torch.float8_e5m2), z(torch.float8_e5m2), spec, query_dtype=torch.bfloat16)
    cache = KVCache(z(FP8), z(FP8), spec, k_scale=[0.5, 0.25], v_scale=2.0, query_dtype=torch.float16)
    assert cache.quantized and cache.dtype == FP8 and cache.query_dtype == torch.float16
    assert cache.scales.tolist() == [[0.5, 0.25], [2.0, 2.0]] and cache.scales.dtype == torch.float32
    plain = KVCache(z(torch.float16), z(torch.float16), spec)
    assert not plain.quantized and plain.query_dtype == torch.float16 and plain.kv_scales is None


def test_a_per_layer_scale_may_be_any_real_scalar():
    np = pytest.importorskip("numpy")
    spec = AttentionSpec(4, 2, 64)
    z = torch.zeros(3, 16, 2, 64, dtype=FP8)
    amax = torch.tensor([[3.0, -8.96], [1.0, 2.0]])
    # A 0-dim tensor was read as a sequence of one scale: refused for two KV heads ("has 1 values").
    cache = KVCache(z, z.clone(), spec, k_scale=amax.abs().max() / FP8_E4M3_MAX, v_scale=np.float32(0.5),
                    query_dtype=torch.bfloat16)
    torch.testing.assert_close(cache.scales, torch.tensor([[0.02, 0.02], [0.5, 0.5]]))
    assert KVCache(z, z.clone(), spec, k_scale=torch.tensor([0.5, 0.25]), query_dtype=torch.bfloat16
                   ).scales.tolist() == [[0.5, 0.25], [1.0, 1.0]]  # one per head, as before
    with pytest.raises(ValueError, match="k_scale"):
        KVCache(z, z.clone(), spec, k_scale=torch.tensor(0.0), query_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="k_scale"):
        KVCache(z, z.clone(), spec, k_scale=True, query_dtype=torch.bfloat16)


def test_allocate_quantized_caches_with_per_layer_scales():
    specs = {"a": AttentionSpec(4, 2, 64), "b": AttentionSpec(4, 1, 64)}
    caches = allocate_kv_caches(specs, 4, 16, torch.bfloat16, kv_cache_dtype=FP8, k_scale={"a": 0.5, "b": 0.25},
                                v_scale=0.125)
    assert caches["a"].dtype == FP8 and caches["a"].query_dtype == torch.bfloat16
    assert caches["a"].scales.tolist() == [[0.5, 0.5], [0.125, 0.125]]
    assert caches["b"].scales.tolist() == [[0.25], [0.125]]
    with pytest.raises(ValueError, match="k_scale has no entry for layer 'b'"):
        allocate_kv_caches(specs, 4, 16, torch.bfloat16, kv_cache_dtype=FP8, k_scale={"a": 0.5})
    assert fp8_scale(448.0) == 1.0
    with pytest.raises(ValueError, match="amax"):
        fp8_scale(0.0)


# ---------------------------------------------------------------------------------------------
# the write


def _write_inputs(dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    key = (3 * torch.randn(6, 2, 64, generator=g)).to(dtype).to(device)
    value = torch.randn(6, 2, 64, generator=g).to(dtype).to(device)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-6])  # saturates both ways, zero, subnormal
    slots = torch.tensor([5, -1, 17, 0, -1, 30], device=device)
    k_scale = torch.tensor([0.02, 0.05], device=device)
    v_scale = torch.tensor([0.01, 0.01], device=device)
    return key, value, slots, k_scale, v_scale


def _expected_caches(key, value, slots, k_scale, v_scale, shape):
    kc, vc = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kc.view(-1, *shape[2:])[s] = stored(key[t:t + 1].cpu(), k_scale.cpu())[0]
            vc.view(-1, *shape[2:])[s] = stored(value[t:t + 1].cpu(), v_scale.cpu())[0]
    return kc, vc


@pytest.mark.parametrize("writer", [write_kv_masked, write_kv_padded], ids=["masked", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_torch_writers_quantize(writer, dtype):
    key, value, slots, ks, vs = _write_inputs(dtype)
    shape = (4, 8, 2, 64)
    kc, vc = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    writer(key, value, kc, vc, slots, ks, vs)
    want_k, want_v = _expected_caches(key, value, slots, ks, vs, shape)
    assert torch.equal(bits(kc), bits(want_k)) and torch.equal(bits(vc), bits(want_v))
    assert kc.view(-1, 2, 64)[5, 0, :2].float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("indexed", [True, False], ids=["step-indexed", "masked"])
def test_prepared_torch_writer_quantizes(indexed):
    """The call table's torch writer, both forms: the CUDA one (indices refreshed once per step,
    padding after the real tokens repeats token 0's write) and the CPU one (masked)."""
    from compileattn.backends.kv_write import StepWriteIndices, prepare_torch_write

    key, value, _, ks, vs = _write_inputs(torch.bfloat16)
    shape = (4, 8, 2, 64)
    builder = AttentionMetadataBuilder(block_size=8, num_blocks=4, max_num_tokens=6, max_blocks_per_seq=4)
    md = builder.build([SequenceStep(1, 4, [0]), SequenceStep(3, 13, [3, 2])], pad_to=6)  # slots 4, 21..23, -1, -1
    indices = StepWriteIndices(md.num_tokens, md.tensors, md.selector.buffers) if indexed else None
    if indices is not None:
        indices.refresh()
    kc, vc = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    prepare_torch_write(kc, vc, indices, md.slot_mapping, (ks, vs))(key, value)
    want_k, want_v = _expected_caches(key, value, md.slot_mapping, ks, vs, shape)
    assert torch.equal(bits(kc), bits(want_k)) and torch.equal(bits(vc), bits(want_v))
    assert int(bits(kc).view(-1, 2, 64).any(-1).any(-1).sum()) == 4  # the padding wrote nothing new


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_write_quantizes_like_the_torch_writer(dtype):
    key, value, slots, ks, vs = _write_inputs(dtype)
    shape = (4, 8, 2, 64)
    kc, vc = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    compileattn.write_kv_cache(key, value, kc, vc, slots, k_scale=ks, v_scale=vs, backend="triton")
    want_k, want_v = _expected_caches(key, value, slots, ks, vs, shape)
    assert torch.equal(bits(kc), bits(want_k)) and torch.equal(bits(vc), bits(want_v))


@pytest.mark.parametrize("writer", ["torch", "triton"])
def test_a_nan_is_stored_as_nan_by_every_writer(writer):
    """Triton's clamp dropped NaN (a finite value in the cache, a finite output where the rows
    that see it must be NaN, as with the torch writer)."""
    key, value, slots, ks, vs = _write_inputs(torch.float32, DEVICE)
    key[0, 1, 5] = value[2, 0, 7] = float("nan")
    shape = (4, 8, 2, 64)
    kc, vc = torch.zeros(shape, dtype=FP8, device=DEVICE), torch.zeros(shape, dtype=FP8, device=DEVICE)
    if writer == "torch":
        write_kv_masked(key, value, kc, vc, slots, ks, vs)
    else:
        compileattn.write_kv_cache(key, value, kc, vc, slots, k_scale=ks, v_scale=vs, backend="triton")
    want_k, want_v = _expected_caches(key, value, slots, ks, vs, shape)
    assert torch.isnan(want_k.float()).sum() == 1 and torch.isnan(want_v.float()).sum() == 1
    assert torch.equal(bits(kc).cpu(), bits(want_k)) and torch.equal(bits(vc).cpu(), bits(want_v))


@pytest.mark.cuda
def test_cuda_a_nan_in_an_fp8_cache_reaches_the_rows_that_attend_to_it():
    """(Triton's interpreter reads e4m3's NaN as 480, so this runs on the GPU only.)"""
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    kc = torch.zeros(4, 16, 2, 64, dtype=FP8, device="cuda")
    vc = torch.zeros_like(kc)
    k = torch.randn(2, 1, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    v[0, 0, 1, 3] = float("nan")
    scales = torch.ones(2, device="cuda")
    out = compileattn.flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32, device="cuda"),
        block_table=torch.tensor([[1], [2]], dtype=torch.int32, device="cuda"), k_scale=scales, v_scale=scales,
        backend="triton")
    assert torch.isnan(vc.float()).sum() == 1
    # V's NaN element (KV head 1, dim 3) reaches dim 3 of KV head 1's query heads (2, 3), nothing else
    assert torch.isnan(out[0, 0, 2:, 3]).all() and int(torch.isnan(out).sum()) == 2


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(), ValueError, "k_scale is required"),
    (dict(k_scale=torch.ones(2)), ValueError, "v_scale is required"),
    (dict(k_scale=torch.ones(3), v_scale=torch.ones(2)), ValueError, r"k_scale must have shape \(2,\)"),
    (dict(k_scale=torch.ones(2, dtype=torch.float64), v_scale=torch.ones(2)), TypeError, "k_scale must be float32"),
    (dict(k_scale=[1.0, 1.0], v_scale=torch.ones(2)), TypeError, "k_scale must be a float32 tensor"),
])
def test_write_into_fp8_refuses_bad_scales(kwargs, error, match):
    key, value, slots, _, _ = _write_inputs(torch.float16)
    kc, vc = torch.zeros(4, 8, 2, 64, dtype=FP8), torch.zeros(4, 8, 2, 64, dtype=FP8)
    with pytest.raises(error, match=match):
        compileattn.write_kv_cache(key, value, kc, vc, slots, **kwargs)
    assert not bits(kc).any()


def test_scales_with_an_unquantized_cache_are_refused():
    key, value, slots, ks, vs = _write_inputs(torch.float16)
    kc, vc = torch.zeros(4, 8, 2, 64, dtype=torch.float16), torch.zeros(4, 8, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="float8_e4m3fn caches only"):
        compileattn.write_kv_cache(key, value, kc, vc, slots, k_scale=ks, v_scale=vs)


# ---------------------------------------------------------------------------------------------
# attention over a quantized cache


class Step:
    """One layer's step over an fp8 cache: each sequence's context already stored (quantized),
    its new tokens written by the op. ``full_k[i]``/``full_v[i]``: every key and value of
    sequence i as the fp8 cache holds them, dequantized in float64 (the oracle's input)."""

    def __init__(self, spec, dtype, lens, k_scale, v_scale, block_size=16, pad=2, seed=0, device=DEVICE):
        g = torch.Generator().manual_seed(seed)
        kvh, d = spec.num_kv_heads, spec.head_dim
        need = [-(-(q + c) // block_size) for q, c in lens]
        self.num_blocks = sum(need) + 2
        perm = torch.randperm(self.num_blocks, generator=g).tolist()
        tables, i = [], 0
        for n in need:
            tables.append(perm[i:i + n])
            i += n
        self.seqs = [SequenceStep(q, c, t) for (q, c), t in zip(lens, tables)]
        self.lens, self.spec, self.dtype, self.block_size = lens, spec, dtype, block_size
        self.k_scale, self.v_scale = k_scale, v_scale
        kc = torch.zeros(self.num_blocks, block_size, kvh, d, dtype=FP8)
        vc = torch.zeros_like(kc)
        tokens = sum(q for q, _ in lens)
        self.num_tokens = tokens + pad
        self.q = (2 * torch.randn(self.num_tokens, spec.num_heads, d, generator=g)).to(dtype)
        self.k = torch.randn(self.num_tokens, kvh, d, generator=g).to(dtype)
        self.v = torch.randn(self.num_tokens, kvh, d, generator=g).to(dtype)
        self.full_k, self.full_v, start = [], [], 0
        for (ql, c), t in zip(lens, tables):
            ctx_k = stored(torch.randn(c, kvh, d, generator=g), k_scale)
            ctx_v = stored(torch.randn(c, kvh, d, generator=g), v_scale)
            slots = [t[p // block_size] * block_size + p % block_size for p in range(c)]
            kc.view(-1, kvh, d)[slots] = ctx_k
            vc.view(-1, kvh, d)[slots] = ctx_v
            new_k = stored(self.k[start:start + ql].float(), k_scale)
            new_v = stored(self.v[start:start + ql].float(), v_scale)
            self.full_k.append(dequantized(torch.cat([ctx_k, new_k]), k_scale))
            self.full_v.append(dequantized(torch.cat([ctx_v, new_v]), v_scale))
            start += ql
        self.kc, self.vc = kc.to(device), vc.to(device)
        self.q, self.k, self.v = self.q.to(device), self.k.to(device), self.v.to(device)
        self.device = device

    def cache(self) -> KVCache:
        return KVCache(self.kc.clone(), self.vc.clone(), self.spec, k_scale=self.k_scale, v_scale=self.v_scale,
                       query_dtype=self.dtype)

    def run(self, backend, cache=None):
        cache = cache or self.cache()
        b = AttentionMetadataBuilder(block_size=self.block_size, num_blocks=self.num_blocks,
                                     max_num_tokens=self.num_tokens, max_blocks_per_seq=self.num_blocks,
                                     device=self.device, backend=backend)
        md = b.build(self.seqs, pad_to=self.num_tokens)
        out = torch.full_like(self.q, 7.0)
        with set_forward_context(md, {"l": cache}):
            torch.ops.compileattn.attention(self.q, self.k, self.v, out, "l")
        return out, cache

    def oracle(self) -> torch.Tensor:
        outs, start = [], 0
        for (ql, _), k, v in zip(self.lens, self.full_k, self.full_v):
            outs.append(naive.attend(self.q[start:start + ql].cpu(), k, v, scale=self.spec.scale,
                                     window_left=self.spec.sliding_window, softcap=self.spec.softcap,
                                     alibi_slopes=self.spec.alibi_slopes))
            start += ql
        return torch.cat(outs)


DECODE = [(1, 40), (1, 0), (1, 97), (1, 16)]
MIXED = [(1, 40), (7, 0), (5, 23), (1, 3)]
#: (k_scale, v_scale): per layer, and per KV head.
SCALES = [(0.02, 0.01), ([0.02, 0.005], [0.01, 0.03])]


@pytest.mark.parametrize("scales", SCALES, ids=["per-layer", "per-head"])
@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
def test_reference_over_fp8_equals_the_oracle_over_dequantized_values(lens, scales):
    spec = AttentionSpec(4, 2, 64, sliding_window=30, alibi_slopes=compileattn.alibi_slopes(4))
    step = Step(spec, torch.float32, lens, *scales, device="cpu")
    out, cache = step.run("reference")
    real = sum(q for q, _ in lens)
    torch.testing.assert_close(out[:real].double(), step.oracle(), atol=1e-5, rtol=1e-5)
    assert (out[real:] == 0).all()
    for i, ((ql, c), seq) in enumerate(zip(lens, step.seqs)):  # the step's own tokens, quantized by the write
        slots = [seq.block_table[p // 16] * 16 + p % 16 for p in range(c, c + ql)]
        got = dequantized(cache.key_cache.view(-1, 2, 64)[slots], scales[0])
        torch.testing.assert_close(got, step.full_k[i][c:], atol=0, rtol=0)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
def test_triton_over_fp8_equals_the_reference(lens, dtype):
    """Under the interpreter the decode kernel splits the keys (it assumes 4 SMs), so this covers
    the V scale through the in-kernel merge as well."""
    spec = AttentionSpec(8, 2, 64, softcap=20.0)
    step = Step(spec, dtype, lens, *SCALES[1], device="cpu")
    want, ref_cache = step.run("reference")
    got, cache = step.run("triton")
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(bits(cache.key_cache), bits(ref_cache.key_cache))
    assert torch.equal(bits(cache.value_cache), bits(ref_cache.value_cache))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("context", [1, 17, 1000, 4096])
def test_fp8_stays_within_the_documented_distance_of_bf16(context):
    """The same decode step over a bf16 cache and over its fp8 quantization (scales from the
    data's amax): the outputs' norm-relative distance stays below FP8_REL_ERROR_BOUND."""
    spec = AttentionSpec(8, 2, 128)
    g = torch.Generator().manual_seed(context)
    batch, bs = 3, 16
    per_seq = -(-context // bs)
    nb = batch * per_seq
    k_all = torch.randn(nb * bs, 2, 128, generator=g)
    v_all = torch.randn(nb * bs, 2, 128, generator=g)
    ks, vs = fp8_scale(float(k_all.abs().max())), fp8_scale(float(v_all.abs().max()))
    steps = [SequenceStep(1, context - 1, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)]
    q, k, v = (torch.randn(batch, h, 128, generator=g).bfloat16() for h in (8, 2, 2))
    caches = {
        "bf16": KVCache(k_all.bfloat16().view(nb, bs, 2, 128), v_all.bfloat16().view(nb, bs, 2, 128), spec),
        "fp8": KVCache(stored(k_all, ks).view(nb, bs, 2, 128), stored(v_all, vs).view(nb, bs, 2, 128), spec,
                       k_scale=ks, v_scale=vs, query_dtype=torch.bfloat16),
    }
    outs = {}
    for name, cache in caches.items():
        md = AttentionMetadataBuilder(block_size=bs, num_blocks=nb, max_num_tokens=batch, max_blocks_per_seq=per_seq,
                                      backend="reference").build(steps)
        outs[name] = torch.empty(batch, 8, 128, dtype=torch.bfloat16)
        with set_forward_context(md, {"l": cache}):
            torch.ops.compileattn.attention(q, k, v, outs[name], "l")
    err = _rel(outs["fp8"], outs["bf16"])
    assert 0.005 < err < FP8_REL_ERROR_BOUND, err  # > 0.005: the fp8 path did quantize


def test_varlen_entry_reads_fp8_kv_with_scales():
    spec = AttentionSpec(4, 2, 64)
    step = Step(spec, torch.float16, [(1, 30), (3, 9)], *SCALES[1], device="cpu")
    cache = step.cache()
    b = AttentionMetadataBuilder(block_size=16, num_blocks=step.num_blocks, max_num_tokens=step.num_tokens,
                                 max_blocks_per_seq=step.num_blocks, backend="reference")
    md = b.build(step.seqs, pad_to=step.num_tokens)
    real = 4
    compileattn.write_kv_cache(step.k[:real], step.v[:real], cache.key_cache, cache.value_cache,
                               md.slot_mapping[:real], k_scale=cache.scales[0], v_scale=cache.scales[1])
    out = compileattn.flash_attn_varlen_func(
        step.q[:real], cache.key_cache, cache.value_cache, md.query_start_loc[:3], None, causal=True,
        block_table=md.block_table[:2], seqused_k=md.seq_lens[:2], k_scale=cache.scales[0], v_scale=cache.scales[1])
    torch.testing.assert_close(out.double(), step.oracle(), atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="k_scale is required"):
        compileattn.flash_attn_varlen_func(step.q[:real], cache.key_cache, cache.value_cache, md.query_start_loc[:3],
                                           None, block_table=md.block_table[:2], seqused_k=md.seq_lens[:2])
    with pytest.raises(TypeError, match="v has dtype"):
        compileattn.flash_attn_varlen_func(step.q[:real], cache.key_cache, cache.value_cache.half(),
                                           md.query_start_loc[:3], None, block_table=md.block_table[:2],
                                           seqused_k=md.seq_lens[:2], k_scale=cache.scales[0], v_scale=cache.scales[1])


def test_queries_must_match_the_caches_query_dtype():
    spec = AttentionSpec(4, 2, 64)
    step = Step(spec, torch.float16, DECODE, *SCALES[0], device="cpu")
    b = AttentionMetadataBuilder(block_size=16, num_blocks=step.num_blocks, max_num_tokens=step.num_tokens,
                                 max_blocks_per_seq=step.num_blocks, backend="reference")
    md = b.build(step.seqs, pad_to=step.num_tokens)
    out = torch.empty(step.num_tokens, 4, 64, dtype=torch.float32)
    with set_forward_context(md, {"l": step.cache()}):
        with pytest.raises(TypeError, match="takes torch.float16 queries"):
            torch.ops.compileattn.attention(step.q.float(), step.k.float(), step.v.float(), out, "l")


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lens", [DECODE, MIXED, [(1, 3000), (1, 1), (1, 700)]], ids=["decode", "mixed", "long"])
@pytest.mark.parametrize("scales", SCALES, ids=["per-layer", "per-head"])
def test_cuda_triton_over_fp8(lens, dtype, scales):
    """Compiled kernels: Triton equals the reference on the same fp8 cache, and its write stores
    the reference writer's bytes up to one fp8 step (GPU fp32 division may round a tie apart)."""
    spec = AttentionSpec(16, 2, 128, sliding_window=500, alibi_slopes=compileattn.alibi_slopes(16))
    step = Step(spec, dtype, lens, *scales, device="cuda")
    want, ref_cache = step.run("reference")
    got, cache = step.run("triton")
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for a, b in ((cache.key_cache, ref_cache.key_cache), (cache.value_cache, ref_cache.value_cache)):
        torch.testing.assert_close(a.float(), b.float(), atol=2 ** -9, rtol=2 ** -3)


@pytest.mark.cuda
def test_cuda_graph_replays_fp8_decode_with_new_metadata():
    """A decode step over an fp8 cache captured once replays for other lengths and block tables
    (the scales and the ALiBi slopes are device tensors the graph reads, as are the metadata
    buffers)."""
    spec = AttentionSpec(32, 8, 128, alibi_slopes=compileattn.alibi_slopes(32))
    steps = [Step(spec, torch.bfloat16, lens, 0.02, 0.01, device="cuda", seed=i, pad=4)
             for i, lens in enumerate([[(1, 900), (1, 5), (1, 2500), (1, 1)], [(1, 3000), (1, 7), (1, 64), (1, 9)]])]
    nb = max(s.num_blocks for s in steps)
    n = steps[0].num_tokens
    b = AttentionMetadataBuilder(block_size=16, num_blocks=nb, max_num_tokens=n, max_blocks_per_seq=nb,
                                 device="cuda", backend="triton")
    cache = KVCache(torch.zeros(nb, 16, 8, 128, dtype=FP8, device="cuda"),
                    torch.zeros(nb, 16, 8, 128, dtype=FP8, device="cuda"), spec, k_scale=0.02, v_scale=0.01,
                    query_dtype=torch.bfloat16)
    q, k, v = (torch.empty_like(getattr(steps[0], x)) for x in ("q", "k", "v"))
    out = torch.empty_like(q)

    def load(step):
        bits(cache.key_cache[: step.num_blocks]).copy_(bits(step.kc))
        bits(cache.value_cache[: step.num_blocks]).copy_(bits(step.vc))
        for x, name in ((q, "q"), (k, "k"), (v, "v")):
            x.copy_(getattr(step, name))

    def forward(md):
        with set_forward_context(md, {"l": cache}):
            torch.ops.compileattn.attention(q, k, v, out, "l")

    load(steps[0])
    md = b.build(steps[0].seqs, pad_to=n)
    warm_up_for_capture(lambda: forward(md))  # compile, bind
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(md)
    for step in steps:
        load(step)
        b.build(step.seqs, pad_to=n)
        graph.replay()
        torch.cuda.synchronize()
        want, _ = step.run("reference")
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_cuda_fp8_within_the_documented_distance_of_bf16_on_triton():
    """The accuracy bound on the compiled Triton path at a serving shape (GQA 64/8, context 4096)."""
    spec = AttentionSpec(64, 8, 128)
    batch, bs, context = 4, 16, 4096
    per_seq = context // bs
    nb = batch * per_seq
    g = torch.Generator(device="cuda").manual_seed(0)
    k_all = torch.randn(nb * bs, 8, 128, generator=g, device="cuda")
    v_all = torch.randn(nb * bs, 8, 128, generator=g, device="cuda")
    ks, vs = fp8_scale(float(k_all.abs().max())), fp8_scale(float(v_all.abs().max()))
    steps = [SequenceStep(1, context - 1, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)]
    q, k, v = (torch.randn(batch, h, 128, generator=g, device="cuda").bfloat16() for h in (64, 8, 8))
    caches = {
        "bf16": KVCache(k_all.bfloat16().view(nb, bs, 8, 128), v_all.bfloat16().view(nb, bs, 8, 128), spec),
        "fp8": KVCache(stored(k_all, ks).view(nb, bs, 8, 128), stored(v_all, vs).view(nb, bs, 8, 128), spec,
                       k_scale=ks, v_scale=vs, query_dtype=torch.bfloat16),
    }
    outs = {}
    for name, cache in caches.items():
        md = AttentionMetadataBuilder(block_size=bs, num_blocks=nb, max_num_tokens=batch, max_blocks_per_seq=per_seq,
                                      device="cuda", backend="triton").build(steps)
        outs[name] = torch.empty(batch, 64, 128, dtype=torch.bfloat16, device="cuda")
        with set_forward_context(md, {"l": cache}):
            torch.ops.compileattn.attention(q, k, v, outs[name], "l")
    assert 0.005 < _rel(outs["fp8"], outs["bf16"]) < FP8_REL_ERROR_BOUND


def test_reference_backend_reads_scales_not_values():
    """Guard against a vacuous pass: doubling the scales changes the reference's answer."""
    spec = AttentionSpec(4, 2, 64)
    step = Step(spec, torch.float32, DECODE, 0.02, 0.01, device="cpu")
    a, _ = step.run(ReferenceBackend())
    cache = KVCache(step.kc.clone(), step.vc.clone(), spec, k_scale=0.04, v_scale=0.02, query_dtype=torch.float32)
    b, _ = step.run(ReferenceBackend(), cache)
    assert not torch.allclose(a, b)


def test_compiled_model_over_fp8_caches_equals_eager():
    """A model compiled with the compileattn backend over an fp8 cache (and ALiBi): the KV write
    the pass moves into the piece before attention quantizes as the eager op does, and the
    runtime's per-step checks accept caches whose storage dtype is not the model's."""
    spec = AttentionSpec(4, 2, 64, alibi_slopes=compileattn.alibi_slopes(4))

    torch.manual_seed(0)
    model = AttentionBlock(spec, hidden=256)
    caches = allocate_kv_caches({"block.attn": spec}, 16, 16, torch.float32, kv_cache_dtype=FP8, k_scale=0.02,
                                v_scale=0.01)
    cache = caches["block.attn"]
    bits(cache.key_cache).copy_(stored(torch.randn(16 * 16, 2, 64), 0.02).view(16, 16, 2, 64).view(torch.uint8))
    bits(cache.value_cache).copy_(stored(torch.randn(16 * 16, 2, 64), 0.01).view(16, 16, 2, 64).view(torch.uint8))
    builder = AttentionMetadataBuilder(block_size=16, num_blocks=16, max_num_tokens=16, max_blocks_per_seq=4,
                                       backend="reference")
    md = builder.build([SequenceStep(1, 20, [3, 9]), SequenceStep(6, 0, [4])], pad_to=8)
    x = torch.randn(8, 256)
    before = (cache.key_cache.clone(), cache.value_cache.clone())
    with set_forward_context(md, caches):
        want = model(x)
    after_eager = (cache.key_cache.clone(), cache.value_cache.clone())
    cache.key_cache.copy_(before[0])
    cache.value_cache.copy_(before[1])
    compiled = torch.compile(model, backend="compileattn", options={"piece_compiler": "aot_eager"}, fullgraph=True)
    with set_forward_context(md, caches), torch.no_grad():
        got = compiled(x)
    torch.testing.assert_close(got, want)
    assert torch.equal(bits(cache.key_cache), bits(after_eager[0]))
    assert torch.equal(bits(cache.value_cache), bits(after_eager[1]))
    assert not torch.equal(bits(after_eager[0]), bits(before[0]))  # the step did write
