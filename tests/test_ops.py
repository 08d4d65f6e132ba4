"""The compileattn ops are well-formed custom ops: registered, exactly aliased, opcheck-clean.

``torch.library.opcheck`` runs each op through schema checking (undeclared mutation or aliasing),
fake-tensor propagation and AOT dispatch with dynamic shapes: the things that otherwise fail only
deep inside torch.compile. Every op is checked for fp32, fp16 and bf16 on the CPU.
"""
from __future__ import annotations

import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import compileattn  # noqa: F401  (registers torch.ops.compileattn)
import naive
from compileattn import AttentionMetadataBuilder, AttentionSpec, KVCache, SequenceStep, set_forward_context

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: opcheck's utilities for calls with float8 tensors: all but ``test_schema``, whose SchemaCheckMode
#: compares tensors with ops the CPU lacks for float8 ("mul_cpu_reduced_float" not implemented for
#: 'Float8_e4m3fn', torch 2.13). The schema's aliasing is the same as with other dtypes, where
#: ``test_schema`` runs.
FP8_OPCHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
OPS = ("write_kv_cache", "varlen_attention", "attention", "attention_by_id")
#: op -> the arguments it may write, exactly (anything else written would corrupt a compiled graph).
MUTATED = {
    "write_kv_cache": {"key_cache", "value_cache"},
    "varlen_attention": {"out"},
    "attention": {"output"},
    "attention_by_id": {"output"},
}

BLOCK_SIZE, NUM_BLOCKS, H, KVH, D = 4, 8, 4, 2, 64
#: (q_len, context_len) per sequence: two decodes, a prefill, a chunked prefill.
STEP = [(1, 5), (1, 0), (3, 0), (2, 4)]


def _step_tensors(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    tables = naive.assign_blocks([q + c for q, c in STEP], BLOCK_SIZE, NUM_BLOCKS, random.Random(seed))
    t = sum(q for q, _ in STEP)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return tables, t, rand


@pytest.mark.parametrize("name", OPS)
def test_ops_are_registered_with_exact_mutations(name):
    assert hasattr(torch.ops.compileattn, name)
    schema = getattr(torch.ops.compileattn, name).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == MUTATED[name]
    assert len(schema.returns) == 0, "results go into caller-owned out arguments, never a new tensor"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_write_kv_cache(dtype):
    tables, t, rand = _step_tensors(dtype)
    key, value = rand(t, KVH, D), rand(t, KVH, D)
    key_cache, value_cache = rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D), rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:t]
    slots[-2:] = -1  # padding
    torch.library.opcheck(torch.ops.compileattn.write_kv_cache.default,
                          (key, value, key_cache, value_cache, slots, "reference"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_write_kv_cache_quantizing(dtype):
    """Into a float8_e4m3fn cache, with the per-KV-head scales."""
    tables, t, rand = _step_tensors(dtype)
    key, value = rand(t, KVH, D), rand(t, KVH, D)
    key_cache = rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D).to(torch.float8_e4m3fn)
    value_cache = rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D).to(torch.float8_e4m3fn)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:t]
    slots[-2:] = -1
    scales = torch.tensor([0.05, 0.02]), torch.tensor([0.01, 0.03])
    torch.library.opcheck(torch.ops.compileattn.write_kv_cache.default,
                          (key, value, key_cache, value_cache, slots, "reference", *scales), test_utils=FP8_OPCHECK)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("extras", ["none", "alibi", "alibi+fp8"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_opcheck_varlen_attention(dtype, paged, extras):
    tables, t, rand = _step_tensors(dtype)
    q_lens = [q for q, _ in STEP]
    k_lens = [q + c for q, c in STEP]
    q, out = rand(t, H, D), rand(t, H, D)
    cu_q = naive.cu_seqlens(q_lens)
    if paged:
        k, v = rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D), rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D)
        width = max(len(tb) for tb in tables)
        bt = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, tb in enumerate(tables):
            bt[i, : len(tb)] = torch.tensor(tb, dtype=torch.int32)
        cu_k, seqused = None, torch.tensor(k_lens, dtype=torch.int32)
    else:
        k, v = rand(sum(k_lens), KVH, D), rand(sum(k_lens), KVH, D)
        bt, cu_k, seqused = None, naive.cu_seqlens(k_lens), None
    args = (q, k, v, out, cu_q, cu_k, seqused, bt, max(q_lens), max(k_lens), D ** -0.5, True, 3, 5.0, "reference")
    if extras != "none":
        args += (torch.tensor([0.5, 0.25, 0.125, 0.0625]),)
    if extras == "alibi+fp8":
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        args = args[:1] + (k, v) + args[3:] + (torch.tensor([0.5, 2.0]), torch.tensor([1.5, 0.25]))
    utils = FP8_OPCHECK if extras == "alibi+fp8" else ("test_schema", *FP8_OPCHECK)
    torch.library.opcheck(torch.ops.compileattn.varlen_attention.default, args, test_utils=utils)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_attention_under_forward_context(dtype):
    tables, t, rand = _step_tensors(dtype)
    spec = AttentionSpec(H, KVH, D, sliding_window=4, softcap=5.0)
    cache = KVCache(rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D), rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D), spec)
    builder = AttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_tokens=16,
                                       max_blocks_per_seq=4, backend="reference")
    md = builder.build([SequenceStep(q, c, tb) for (q, c), tb in zip(STEP, tables)], pad_to=t + 2)
    n = md.num_tokens
    args = (rand(n, H, D), rand(n, KVH, D), rand(n, KVH, D), rand(n, H, D), "layer.0")
    with set_forward_context(md, {"layer.0": cache}):
        torch.library.opcheck(torch.ops.compileattn.attention.default, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_attention_by_id_equals_attention_by_name(dtype):
    """The op a trace with regions records (compilation/regions.py): the layer named by a CPU
    layer-id tensor. Eagerly it is ``attention`` for that layer, cache write included."""
    from compileattn import layer_ids

    md, q, k, v, fresh_cache, whole, expected = _unified_op_result(dtype)
    layer_id = layer_ids.id_of("layer.0")
    assert layer_id.device.type == "cpu" and layer_ids.name_of(layer_id) == "layer.0"
    with set_forward_context(md, {"layer.0": fresh_cache()}):
        torch.library.opcheck(torch.ops.compileattn.attention_by_id.default,
                              (q, k, v, torch.empty_like(q), layer_id))
    cache, out = fresh_cache(), torch.empty_like(q)
    with set_forward_context(md, {"layer.0": cache}):
        torch.ops.compileattn.attention_by_id(q, k, v, out, layer_id)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(cache.key_cache, whole.key_cache, atol=0, rtol=0)


def test_layer_ids_are_cpu_tensors_and_bad_ones_are_named():
    from compileattn import layer_ids

    with torch.device("meta"):  # how the own models build their layers
        layer_id = layer_ids.id_of("layers.7.attn")
    assert layer_id.device.type == "cpu" and layer_id.dtype == torch.int64
    assert layer_ids.id_of("layers.7.attn").item() == layer_id.item()  # one index per name
    with pytest.raises(TypeError, match="layer_id must be a one-element int64"):
        layer_ids.name_of(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="names no layer"):
        layer_ids.name_of(torch.tensor(10**9))
    with pytest.raises(TypeError, match="layer_name must be a non-empty str"):
        layer_ids.id_of("")
    q = torch.randn(3, 2, 8)
    with pytest.raises(TypeError, match="layer_id must be a one-element int64"), FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        torch.ops.compileattn.attention_by_id(fq, fq, fq, fq, mode.from_tensor(torch.tensor([0.5])))


def _unified_op_result(dtype):
    """One padded mixed step on the reference backend and what the unified ``attention`` op makes
    of it: (metadata, q, k, v, a factory of fresh copies of the cache before the step, the cache
    after the op, the op's output)."""
    tables, t, rand = _step_tensors(dtype)
    spec = AttentionSpec(H, KVH, D)
    k0, v0 = rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D), rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D)
    builder = AttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_tokens=16,
                                       max_blocks_per_seq=4, backend="reference")
    md = builder.build([SequenceStep(q, c, tb) for (q, c), tb in zip(STEP, tables)], pad_to=t + 2)
    n = md.num_tokens
    q, k, v = rand(n, H, D), rand(n, KVH, D), rand(n, KVH, D)

    def fresh_cache():
        return KVCache(k0.clone(), v0.clone(), spec)

    whole = fresh_cache()
    expected = torch.empty(n, H, D, dtype=dtype)
    with set_forward_context(md, {"layer.0": whole}):
        torch.ops.compileattn.attention(q, k, v, expected, "layer.0")
    return md, q, k, v, fresh_cache, whole, expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_write_layer_kv_and_attend_equal_the_unified_op(dtype):
    """The two halves passes/kv_write.py splits the unified op into: opcheck each, and together they
    give what ``attention`` gives (output and cache)."""
    md, q, k, v, fresh_cache, whole, expected = _unified_op_result(dtype)
    n = md.num_tokens
    halves = fresh_cache()
    out = torch.empty(n, H, D, dtype=dtype)
    with set_forward_context(md, {"layer.0": halves}):
        torch.library.opcheck(torch.ops.compileattn.write_layer_kv.default, (k, v, "layer.0"))
        dep = torch.ops.compileattn.write_layer_kv(k, v, "layer.0")
        torch.library.opcheck(torch.ops.compileattn.attend.default, (q, out, dep, "layer.0"))
        torch.ops.compileattn.attend(q, out, dep, "layer.0")
    torch.testing.assert_close(out[: md.num_actual_tokens], expected[: md.num_actual_tokens])
    torch.testing.assert_close(halves.key_cache, whole.key_cache)
    torch.testing.assert_close(halves.value_cache, whole.value_cache)


@pytest.mark.parametrize("unified", [False, True], ids=["attend", "unified"])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "strided"])
def test_runtime_callers_equal_the_op(unified, dense):
    """The compiled runtime's per-layer callers (ops.attend_caller / attention_caller) give what
    the op gives, with strided query and output through the dense-copy path, and name a missing
    context or layer."""
    from compileattn import ops

    md, q, k, v, fresh_cache, whole, expected = _unified_op_result(torch.float32)
    n = md.num_tokens
    called = fresh_cache()
    query = q if dense else torch.empty(n, H, 2 * D)[:, :, :D].copy_(q)
    output = torch.empty(n, H, D) if dense else torch.zeros(n, H, 2 * D)[:, :, :D]
    assert query.is_contiguous() == dense and output.is_contiguous() == dense
    if unified:
        args, call = (query, k, v, output), ops.attention_caller("layer.0", 0, 1, 2, 3, dense=dense)
        missing = ops.attention_caller("layer.7", 0, 1, 2, 3, dense=dense)
    else:
        args, call = (query, output), ops.attend_caller("layer.0", 0, 1, dense=dense)
        missing = ops.attend_caller("layer.7", 0, 1, dense=dense)
    with pytest.raises(RuntimeError, match="no forward context"):
        call(*args)
    with set_forward_context(md, {"layer.0": called}):
        if not unified:
            torch.ops.compileattn.write_layer_kv(k, v, "layer.0")
        call(*args)
        with pytest.raises(ValueError, match="layer_name='layer.7'"):
            missing(*args)
    real = md.num_actual_tokens
    torch.testing.assert_close(output[:real], expected[:real])
    torch.testing.assert_close(called.key_cache, whole.key_cache)
    torch.testing.assert_close(called.value_cache, whole.value_cache)


def test_attention_without_forward_context_raises():
    q, out = torch.randn(2, H, D), torch.zeros(2, H, D)
    k = v = torch.randn(2, KVH, D)
    with pytest.raises(RuntimeError, match="forward context"):
        torch.ops.compileattn.attention(q, k, v, out, "layer.0")
    assert torch.equal(out, torch.zeros(2, H, D))


def test_attention_with_unknown_layer_names_it():
    tables, t, rand = _step_tensors(torch.float32)
    builder = AttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_tokens=16,
                                       max_blocks_per_seq=4, backend="reference")
    md = builder.build([SequenceStep(q, c, tb) for (q, c), tb in zip(STEP, tables)])
    spec = AttentionSpec(H, KVH, D)
    cache = KVCache(rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D), rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D), spec)
    with set_forward_context(md, {"layer.0": cache}):
        with pytest.raises(ValueError, match="layer_name='layer.7'.*no entry for this layer"):
            torch.ops.compileattn.attention(rand(t, H, D), rand(t, KVH, D), rand(t, KVH, D),
                                            rand(t, H, D), "layer.7")


def test_fake_attention_checks_shapes_at_trace_time():
    """The fake function runs once per trace; it is where a GQA mismatch is caught for free."""
    with FakeTensorMode():
        q, out = torch.empty(5, 6, D), torch.empty(5, 6, D)
        k = v = torch.empty(5, 4, D)
        with pytest.raises(ValueError, match="not divisible"):
            torch.ops.compileattn.attention(q, k, v, out, "layer.0")
        with pytest.raises(TypeError, match="dtypes differ"):
            torch.ops.compileattn.attention(q, k.half(), v, out, "layer.0")
        k = v = torch.empty(5, 2, D)
        assert torch.ops.compileattn.attention(q, k, v, out, "layer.0") is None


def test_write_kv_cache_backward_through_either_cache_raises():
    """Both caches are written: a backward through the value cache raises as one through the key
    cache does (the reference's index writes must not hand ``value`` a gradient)."""
    key, value = torch.randn(2, KVH, D, requires_grad=True), torch.randn(2, KVH, D, requires_grad=True)
    key_cache, value_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KVH, D), torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KVH, D)
    torch.ops.compileattn.write_kv_cache(key, value, key_cache, value_cache, torch.tensor([0, 5]), "reference")
    for cache in (key_cache, value_cache):
        with pytest.raises(RuntimeError, match="compileattn::write_kv_cache is inference-only"):
            cache.sum().backward()
    assert value.grad is None and key.grad is None


def test_eager_attention_with_grad_leaves_no_autograd_history_in_the_caches():
    """Eagerly, with grad enabled and K/V from a trained projection: the caches the op writes keep
    no autograd graph (it would chain every step's activations to the next through the caches,
    and a backward through a cache would reach the projection's weights)."""
    tables, t, rand = _step_tensors(torch.float32)
    spec = AttentionSpec(H, KVH, D)
    cache = KVCache(rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D), rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D), spec)
    builder = AttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_tokens=16,
                                       max_blocks_per_seq=4, backend="reference")
    md = builder.build([SequenceStep(q, c, tb) for (q, c), tb in zip(STEP, tables)])
    proj = torch.nn.Linear(8, (H + 2 * KVH) * D)
    q, k, v = proj(torch.randn(t, 8)).split([H * D, KVH * D, KVH * D], dim=-1)
    out = torch.empty(t, H, D)
    with set_forward_context(md, {"layer.0": cache}):
        torch.ops.compileattn.attention(q.reshape(t, H, D), k.reshape(t, KVH, D), v.reshape(t, KVH, D), out,
                                        "layer.0")
    assert out.requires_grad
    assert not cache.key_cache.requires_grad and not cache.value_cache.requires_grad
    assert cache.key_cache.grad_fn is None and cache.value_cache.grad_fn is None


def test_backward_through_varlen_attention_raises_when_only_the_alibi_slopes_require_grad():
    """Slopes held as a parameter (requires_grad by default) are an input like q/k/v: the reference
    recorded its softmax and handed them a gradient, Triton none."""
    tables, t, rand = _step_tensors(torch.float32)
    q, k, v = rand(3, H, D), rand(3, KVH, D), rand(3, KVH, D)
    cu = naive.cu_seqlens([3])
    slopes = torch.nn.Parameter(torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    for kwargs in (False, True):
        out = torch.empty(3, H, D)
        if kwargs:
            torch.ops.compileattn.varlen_attention(q, k, v, out, cu, cu, None, None, 3, 3, D ** -0.5,
                                                   backend="reference", alibi_slopes=slopes)
        else:
            torch.ops.compileattn.varlen_attention(q, k, v, out, cu, cu, None, None, 3, 3, D ** -0.5, True, -1, 0.0,
                                                   "reference", slopes)
        with pytest.raises(RuntimeError, match="compileattn::varlen_attention is inference-only"):
            out.sum().backward()
        assert slopes.grad is None



def test_kv_scales_with_a_cache_that_is_not_float8_are_refused():
    """The backend is chosen on the cache's dtype, and FlashAttention, which takes any cache in the
    queries' dtype, has no scale argument: the reference and Triton applied the scales to such a
    cache (and the write divided by them), FlashAttention's steps dropped them."""
    tables, t, rand = _step_tensors(torch.float32)
    q, k, v = rand(3, H, D), rand(3, KVH, D), rand(3, KVH, D)
    cu = naive.cu_seqlens([3])
    scales = torch.tensor([4.0, 4.0]), torch.tensor([3.0, 3.0])
    out = torch.zeros(3, H, D)
    with pytest.raises(ValueError, match="k_scale/v_scale apply to float8_e4m3fn caches only"):
        torch.ops.compileattn.varlen_attention(q, k, v, out, cu, cu, None, None, 3, 3, D ** -0.5, True, -1, 0.0,
                                               "reference", None, *scales)
    assert not out.any()
    key_cache, value_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KVH, D), torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KVH, D)
    with pytest.raises(ValueError, match="k_scale/v_scale apply to float8_e4m3fn caches only"):
        torch.ops.compileattn.write_kv_cache(k, v, key_cache, value_cache, torch.tensor([0, 1, 2]), "reference",
                                             *scales)
    assert not key_cache.any() and not value_cache.any()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_varlen_attention_refuses_k_lengths_it_has_no_source_for(backend):
    """Paged K/V take their lengths from seqused_k only (Triton read cu_seqlens_q in its place and
    answered over the wrong keys; the reference crashed), contiguous K/V their offsets from
    cu_seqlens_k."""
    dtype = torch.float16
    tables, t, rand = _step_tensors(dtype)
    q, out = rand(5, H, D), torch.zeros(5, H, D, dtype=dtype)
    k_cache, v_cache = rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D), rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D)
    cu_q, cu_k = naive.cu_seqlens([2, 3]), naive.cu_seqlens([5, 7])
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="seqused_k is required with block_table"):
        torch.ops.compileattn.varlen_attention(q, k_cache, v_cache, out, cu_q, cu_k, None, bt, 3, 7, D ** -0.5,
                                               True, -1, 0.0, backend)
    k, v = rand(12, KVH, D), rand(12, KVH, D)
    with pytest.raises(ValueError, match="cu_seqlens_k is required when K/V are not paged"):
        torch.ops.compileattn.varlen_attention(q, k, v, out, cu_q, None, naive.cu_seqlens([5])[1:].repeat(2),
                                               None, 3, 7, D ** -0.5, True, -1, 0.0, backend)
    assert not out.any()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("given", ["k_scale", "v_scale"])
def test_varlen_attention_refuses_one_kv_scale_without_the_other(backend, given):
    """Triton's kernels are scaled as a whole by whether k_scale is given: a lone v_scale was
    dropped there and applied by the reference (a lone k_scale crashed Triton)."""
    tables, t, rand = _step_tensors(torch.float16)
    q, out = rand(2, H, D), torch.zeros(2, H, D, dtype=torch.float16)
    k_cache = rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D).to(torch.float8_e4m3fn)
    v_cache = rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D).to(torch.float8_e4m3fn)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    scales = {given: torch.tensor([2.0, 4.0])}
    with pytest.raises(ValueError, match=f"k_scale and v_scale go together: got only {given}"):
        torch.ops.compileattn.varlen_attention(q, k_cache, v_cache, out, naive.cu_seqlens([1, 1]), None,
                                               torch.tensor([5, 7], dtype=torch.int32), bt, 1, 7, D ** -0.5,
                                               backend=backend, **scales)
    assert not out.any()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_ops_refuse_alibi_slopes_and_kv_scales_of_another_shape(backend):
    """One slope per query head, one scale per KV head: Triton read a single scale or slope for
    every head past the tensor's end, the reference broadcast it (two answers to one call)."""
    tables, t, rand = _step_tensors(torch.float16)
    q, out = rand(2, H, D), torch.zeros(2, H, D, dtype=torch.float16)
    k_cache = rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D).to(torch.float8_e4m3fn)
    v_cache = rand(NUM_BLOCKS, BLOCK_SIZE, KVH, D).to(torch.float8_e4m3fn)
    args = (q, k_cache, v_cache, out, naive.cu_seqlens([1, 1]), None, torch.tensor([5, 7], dtype=torch.int32),
            torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), 1, 7, D ** -0.5)
    one, per_head = torch.tensor([4.0]), torch.full((KVH,), 4.0)
    with pytest.raises(ValueError, match=r"k_scale must have shape \(2,\) \(one per KV head\), got \(1,\)"):
        torch.ops.compileattn.varlen_attention(*args, backend=backend, k_scale=one, v_scale=one)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\) \(one per query head\), got \(1,\)"):
        torch.ops.compileattn.varlen_attention(*args, backend=backend, alibi_slopes=torch.tensor([0.5]),
                                               k_scale=per_head, v_scale=per_head)
    assert not out.any()
    key = rand(2, KVH, D)
    with pytest.raises(ValueError, match=r"v_scale must have shape \(2,\) \(one per KV head\), got \(1,\)"):
        torch.ops.compileattn.write_kv_cache(key, key, k_cache, v_cache, torch.tensor([0, 1]), backend, per_head,
                                             one)
