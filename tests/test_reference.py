"""The reference backend equals the naive oracle (tests/naive.py) on everything it promises.

The reference backend is the oracle every fast backend is tested against, so it is itself checked
against a second, independent and deliberately slow oracle, through each public door: the
flash-attn-shaped function (contiguous and paged K/V), the raw ``varlen_attention`` op, and the
per-layer ``attention`` op driven by real per-step metadata (which also writes the KV cache).
Shapes are drawn by hypothesis; a few hand-picked cases pin the corners (MHA/GQA/MQA x block
sizes 1/16/256, head dims 64/128/256, queries that see nothing, half precision).
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compileattn
import naive
from compileattn import AttentionMetadataBuilder, AttentionSpec, KVCache, SequenceStep, set_forward_context

HYPOTHESIS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: (atol, rtol) of the reference (float32 math, output cast to dtype) against float64.
TOL = {
    torch.float32: (5e-5, 5e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
}

#: (num_heads, num_kv_heads): MHA, GQA and MQA.
HEAD_LAYOUTS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
DRAWN_LAYOUTS = [(1, 1), (2, 2), (4, 4), (4, 2), (8, 2), (8, 4), (2, 1), (4, 1)]


@dataclasses.dataclass
class Case:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_lens: list[int]
    k_lens: list[int]
    block_size: int = 16
    causal: bool = True
    window_left: int = -1
    softcap: float = 0.0
    scale: float | None = None
    dtype: torch.dtype = torch.float32
    seed: int = 0

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim ** -0.5

    @property
    def window_size(self) -> tuple[int, int]:
        return (self.window_left, 0 if self.causal else -1)


def make_seqs(case: Case):
    """Per-sequence q (q_len, H, D) and k/v (k_len, KVH, D); q is scaled up so that logits are
    large enough for softcap and masking mistakes to move the result."""
    g = torch.Generator().manual_seed(case.seed)
    qs, ks, vs = [], [], []
    for lq, lk in zip(case.q_lens, case.k_lens):
        qs.append((3 * torch.randn(lq, case.num_heads, case.head_dim, generator=g)).to(case.dtype))
        ks.append(torch.randn(lk, case.num_kv_heads, case.head_dim, generator=g).to(case.dtype))
        vs.append(torch.randn(lk, case.num_kv_heads, case.head_dim, generator=g).to(case.dtype))
    return qs, ks, vs


def expected(case: Case, qs, ks, vs) -> torch.Tensor:
    return naive.attend_batch(qs, ks, vs, scale=case.softmax_scale, causal=case.causal,
                              window_left=case.window_left, softcap=case.softcap)


def assert_close(actual: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double(), want, atol=atol, rtol=rtol)


def paged_inputs(case: Case, ks, vs, extra_blocks: int = 2):
    """Caches full of noise (so reading a wrong block shows), each sequence in shuffled blocks."""
    rng = random.Random(case.seed)
    bs = case.block_size
    num_blocks = sum(-(-n // bs) for n in case.k_lens) + extra_blocks
    tables = naive.assign_blocks(case.k_lens, bs, num_blocks, rng)
    shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    g = torch.Generator().manual_seed(case.seed + 1)
    key_cache = torch.randn(shape, generator=g).to(case.dtype)
    value_cache = torch.randn(shape, generator=g).to(case.dtype)
    naive.paginate(ks, vs, tables, key_cache, value_cache)
    width = max(1, max(len(t) for t in tables))
    # Unused entries point at a real block full of noise: a kernel must stop at seqused_k.
    bt = torch.full((len(tables), width), num_blocks - 1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return key_cache, value_cache, bt, tables


def run_varlen(case: Case, qs, ks, vs, paged: bool, via_op: bool) -> torch.Tensor:
    q = torch.cat(qs)
    cu_q = naive.cu_seqlens(case.q_lens)
    out = torch.full_like(q, float("nan"))
    if paged:
        k, v, bt, _ = paged_inputs(case, ks, vs)
        cu_k, seqused = None, torch.tensor(case.k_lens, dtype=torch.int32)
    else:
        k, v = torch.cat(ks), torch.cat(vs)
        bt, cu_k, seqused = None, naive.cu_seqlens(case.k_lens), None
    if via_op:
        torch.ops.compileattn.varlen_attention(
            q, k, v, out, cu_q, cu_k, seqused, bt, max(case.q_lens), max(case.k_lens),
            case.softmax_scale, case.causal, case.window_left, case.softcap, "reference")
        return out
    result = compileattn.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(case.q_lens), max(case.k_lens), softmax_scale=case.scale,
        causal=case.causal, window_size=case.window_size, softcap=case.softcap, block_table=bt,
        seqused_k=seqused, out=out, backend="reference")
    assert result is out, "flash_attn_varlen_func must write into the out it was given"
    return out


def run_unified_op(case: Case, qs, ks, vs, ctx_lens: list[int], pad: int = 0):
    """One step through the builder, the forward context and ``compileattn::attention``: the
    cached prefix (first ctx_len tokens) is paged in beforehand, the op writes the rest."""
    spec = AttentionSpec(case.num_heads, case.num_kv_heads, case.head_dim, scale=case.scale,
                         sliding_window=case.window_left, softcap=case.softcap, causal=case.causal)
    bs = case.block_size
    num_blocks = sum(-(-n // bs) for n in case.k_lens) + 2
    tables = naive.assign_blocks(case.k_lens, bs, num_blocks, random.Random(case.seed))
    g = torch.Generator().manual_seed(case.seed + 1)
    shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    cache = KVCache(torch.randn(shape, generator=g).to(case.dtype),
                    torch.randn(shape, generator=g).to(case.dtype), spec)
    naive.paginate([k[:c] for k, c in zip(ks, ctx_lens)], [v[:c] for v, c in zip(vs, ctx_lens)],
                   tables, cache.key_cache, cache.value_cache)
    want_k, want_v = cache.key_cache.clone(), cache.value_cache.clone()
    naive.paginate(ks, vs, tables, want_k, want_v)  # what the caches must hold afterwards

    num_tokens = sum(case.q_lens) + pad
    builder = AttentionMetadataBuilder(block_size=bs, num_blocks=num_blocks, max_num_tokens=num_tokens,
                                       max_blocks_per_seq=max(len(t) for t in tables) + 1, backend="reference")
    md = builder.build([SequenceStep(lq, c, t) for lq, c, t in zip(case.q_lens, ctx_lens, tables)],
                       pad_to=num_tokens)
    g2 = torch.Generator().manual_seed(case.seed + 2)
    # Padding rows get garbage inputs: they must neither be written to the cache nor produce output.
    garbage = lambda h: torch.randn(pad, h, case.head_dim, generator=g2).to(case.dtype)  # noqa: E731
    query = torch.cat(qs + [garbage(case.num_heads)])
    key = torch.cat([k[c:] for k, c in zip(ks, ctx_lens)] + [garbage(case.num_kv_heads)])
    value = torch.cat([v[c:] for v, c in zip(vs, ctx_lens)] + [garbage(case.num_kv_heads)])
    output = torch.full_like(query, float("nan"))
    with set_forward_context(md, {"layer.0": cache}):
        torch.ops.compileattn.attention(query, key, value, output, "layer.0")
    assert torch.equal(cache.key_cache, want_k), "key cache differs from the naive write"
    assert torch.equal(cache.value_cache, want_v), "value cache differs from the naive write"
    return output


# ---------------------------------------------------------------- strategies


@st.composite
def steps(draw, allow_short_k: bool = False, max_seqs: int = 4):
    """A ragged step: (q_len, context_len) per sequence, mixing decode, prefill and chunked prefill.
    With ``allow_short_k``, a sequence may also have fewer keys than queries (contiguous K only,
    where FlashAttention allows it): its first queries see nothing."""
    kinds = ["decode", "prefill", "chunk"] + (["short_k"] if allow_short_k else [])
    seqs = []
    for kind in draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=max_seqs)):
        if kind == "decode":
            seqs.append((1, draw(st.integers(0, 40))))
        elif kind == "prefill":
            seqs.append((draw(st.integers(1, 20)), 0))
        elif kind == "chunk":
            seqs.append((draw(st.integers(2, 12)), draw(st.integers(1, 40))))
        else:
            lq = draw(st.integers(2, 8))
            seqs.append((lq, -draw(st.integers(1, lq))))  # negative context: k_len = lq + ctx < lq
    return seqs


@st.composite
def cases(draw, allow_short_k: bool = False):
    num_heads, num_kv_heads = draw(st.sampled_from(DRAWN_LAYOUTS))
    seqs = draw(steps(allow_short_k=allow_short_k))
    return Case(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([64, 128, 256])),
        q_lens=[lq for lq, _ in seqs],
        k_lens=[lq + ctx for lq, ctx in seqs],
        block_size=draw(st.sampled_from([1, 16, 256])),
        causal=draw(st.booleans()) if allow_short_k else True,
        window_left=draw(st.sampled_from([-1, -1, 0, 1, 3, 8])),
        softcap=draw(st.sampled_from([0.0, 0.0, 1.0, 5.0])),
        scale=draw(st.sampled_from([None, 0.05])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# ---------------------------------------------------------------- the oracle itself


def test_oracle_is_a_weighted_mean():
    """Sanity of the oracle on closed forms, so a shared misconception cannot hide in both."""
    k = torch.randn(5, 1, 8, dtype=torch.float64)
    v = torch.randn(5, 1, 8, dtype=torch.float64)
    q = torch.zeros(2, 2, 8, dtype=torch.float64)  # zero logits: uniform over the visible keys
    out = naive.attend(q, k, v, scale=1.0)
    torch.testing.assert_close(out[0, 1], v[:4, 0].mean(0))  # query 0 of 2 over 5 keys is at position 3
    torch.testing.assert_close(out[1, 0], v[:, 0].mean(0))
    out = naive.attend(q, k, v, scale=1.0, window_left=1)
    torch.testing.assert_close(out[1, 0], v[3:, 0].mean(0))
    out = naive.attend(torch.zeros(3, 1, 8), k[:1], v[:1], scale=1.0)  # 3 queries, 1 key
    assert torch.equal(out[:2], torch.zeros(2, 1, 8, dtype=torch.float64))
    torch.testing.assert_close(out[2, 0], v[0, 0])


# ---------------------------------------------------------------- property-based


@HYPOTHESIS
@given(case=cases(allow_short_k=True), via_op=st.booleans())
def test_contiguous_matches_naive(case, via_op):
    qs, ks, vs = make_seqs(case)
    out = run_varlen(case, qs, ks, vs, paged=False, via_op=via_op)
    assert_close(out, expected(case, qs, ks, vs), case.dtype)


@HYPOTHESIS
@given(case=cases(), via_op=st.booleans())
def test_paged_matches_naive(case, via_op):
    qs, ks, vs = make_seqs(case)
    out = run_varlen(case, qs, ks, vs, paged=True, via_op=via_op)
    assert_close(out, expected(case, qs, ks, vs), case.dtype)


@HYPOTHESIS
@given(case=cases(), pad=st.integers(0, 3))
def test_unified_attention_op_matches_naive(case, pad):
    # The builder wants decodes first (they are the leading q_len == 1 sequences).
    order = sorted(range(len(case.q_lens)), key=lambda i: case.q_lens[i] != 1)
    case.q_lens = [case.q_lens[i] for i in order]
    case.k_lens = [case.k_lens[i] for i in order]
    qs, ks, vs = make_seqs(case)
    ctx = [lk - lq for lq, lk in zip(case.q_lens, case.k_lens)]
    out = run_unified_op(case, qs, ks, vs, ctx, pad=pad)
    n = sum(case.q_lens)
    assert_close(out[:n], expected(case, qs, ks, vs), case.dtype)
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be zero"


# ---------------------------------------------------------------- explicit cases

#: decode over a long prefix, a fresh prefill, a chunked prefill over a cached prefix, another decode
MIXED = dict(q_lens=[1, 1, 7, 5], k_lens=[19, 1, 7, 21])


@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_mixed_batch_layouts_and_block_sizes(layout, block_size):
    h, kvh = HEAD_LAYOUTS[layout]
    case = Case(h, kvh, 64, block_size=block_size, seed=block_size, **MIXED)
    qs, ks, vs = make_seqs(case)
    want = expected(case, qs, ks, vs)
    assert_close(run_varlen(case, qs, ks, vs, paged=True, via_op=False), want, case.dtype)
    assert_close(run_varlen(case, qs, ks, vs, paged=False, via_op=False), want, case.dtype)
    ctx = [lk - lq for lq, lk in zip(case.q_lens, case.k_lens)]
    assert_close(run_unified_op(case, qs, ks, vs, ctx), want, case.dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims(head_dim):
    case = Case(8, 2, head_dim, seed=head_dim, **MIXED)
    qs, ks, vs = make_seqs(case)
    assert_close(run_varlen(case, qs, ks, vs, paged=True, via_op=True), expected(case, qs, ks, vs), case.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("paged", [False, True])
def test_half_precision(dtype, paged):
    case = Case(8, 2, 128, dtype=dtype, window_left=4, softcap=5.0, seed=7, **MIXED)
    qs, ks, vs = make_seqs(case)
    out = run_varlen(case, qs, ks, vs, paged=paged, via_op=False)
    assert out.dtype == dtype
    assert_close(out, expected(case, qs, ks, vs), dtype)


def test_chunked_prefill_is_bottom_right_aligned():
    """A chunk of 3 queries after 5 cached tokens: query i sees keys 0..5+i, not 0..i."""
    case = Case(2, 1, 64, q_lens=[3], k_lens=[8], seed=3)
    qs, ks, vs = make_seqs(case)
    out = run_varlen(case, qs, ks, vs, paged=True, via_op=False)
    top_left = naive.attend(qs[0], ks[0][:3], vs[0][:3], scale=case.softmax_scale)
    assert not torch.allclose(out.double(), top_left, atol=1e-3), "causal mask looks top-left aligned"
    assert_close(out, expected(case, qs, ks, vs), case.dtype)


@pytest.mark.parametrize("window_left", [0, 2, 100])
def test_sliding_window(window_left):
    case = Case(4, 2, 64, window_left=window_left, seed=window_left, **MIXED)
    qs, ks, vs = make_seqs(case)
    out = run_varlen(case, qs, ks, vs, paged=True, via_op=False)
    assert_close(out, expected(case, qs, ks, vs), case.dtype)
    if window_left == 0:  # each query sees only its own key: the output is its own value row
        want = torch.cat([v[-lq:] for v, lq in zip(vs, case.q_lens)]).repeat_interleave(2, dim=1)
        torch.testing.assert_close(out, want)


def test_softcap_changes_the_result():
    base = Case(4, 4, 64, seed=11, **MIXED)
    capped = dataclasses.replace(base, softcap=1.0)
    qs, ks, vs = make_seqs(base)
    out_base = run_varlen(base, qs, ks, vs, paged=True, via_op=False)
    out_capped = run_varlen(capped, qs, ks, vs, paged=True, via_op=False)
    assert not torch.allclose(out_base, out_capped, atol=1e-3)
    assert_close(out_capped, expected(capped, qs, ks, vs), torch.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_queries_that_see_nothing_output_zero(causal):
    """4 queries over 2 keys (contiguous K): causally, queries 0 and 1 sit before every key."""
    case = Case(2, 2, 64, q_lens=[4, 3], k_lens=[2, 0], causal=causal, seed=5)
    qs, ks, vs = make_seqs(case)
    out = run_varlen(case, qs, ks, vs, paged=False, via_op=False)
    assert_close(out, expected(case, qs, ks, vs), case.dtype)
    assert torch.equal(out[4:], torch.zeros_like(out[4:])), "a sequence with no keys must output zeros"
    if causal:
        assert torch.equal(out[:2], torch.zeros_like(out[:2]))
        assert out[2:4].abs().sum() > 0


def test_rows_past_the_last_sequence_are_an_error():
    """Checked by the public entry (a value check, like flash-attn's callers rely on): a row that
    belongs to no sequence would be left unwritten, so it is refused before any kernel runs."""
    case = Case(2, 2, 64, q_lens=[3], k_lens=[3])
    qs, ks, vs = make_seqs(case)
    q = torch.cat(qs + [torch.randn(2, 2, 64)])
    with pytest.raises(ValueError, match="cu_seqlens_q ends at 3 but the tensor holds 5 tokens"):
        compileattn.flash_attn_varlen_func(q, torch.cat(ks), torch.cat(vs), naive.cu_seqlens([3]),
                                           naive.cu_seqlens([3]), causal=True, backend="reference")


# ---------------------------------------------------------------- KV-cache write


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("via_op", [False, True])
def test_write_kv_cache_matches_naive_and_skips_padding(block_size, via_op):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, kvh, d = 8, 2, 64
    num_slots = num_blocks * block_size
    key = torch.randn(6, kvh, d, generator=g)
    value = torch.randn(6, kvh, d, generator=g)
    slots = torch.randperm(num_slots, generator=g)[:6]
    slots[[1, 4]] = -1  # padded tokens
    key_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g)
    value_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    naive.write_kv_cache(key, value, want_k, want_v, slots)
    if via_op:
        torch.ops.compileattn.write_kv_cache(key, value, key_cache, value_cache, slots, "reference")
    else:
        compileattn.write_kv_cache(key, value, key_cache, value_cache, slots, backend="reference")
    assert torch.equal(key_cache, want_k)
    assert torch.equal(value_cache, want_v)
    # The padded tokens' values appear nowhere in the cache.
    for t in (1, 4):
        assert not (key_cache.view(-1, kvh, d) == key[t]).all(-1).all(-1).any()


def test_write_kv_cache_refuses_a_short_slot_mapping():
    """A slot mapping shorter than the tokens would leave tokens unwritten: refused, by name."""
    key, value = torch.randn(4, 1, 64), torch.randn(4, 1, 64)
    key_cache, value_cache = torch.zeros(2, 4, 1, 64), torch.zeros(2, 4, 1, 64)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries for 4 tokens"):
        compileattn.write_kv_cache(key, value, key_cache, value_cache, torch.tensor([5, 0], dtype=torch.int64),
                                   backend="reference")
    assert not key_cache.any(), "nothing may be written before the check"


def test_write_kv_cache_refuses_duplicate_slots():
    key, value = torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    key_cache, value_cache = torch.zeros(2, 4, 1, 64), torch.zeros(2, 4, 1, 64)
    with pytest.raises(ValueError, match="slot_mapping writes slot 5 more than once"):
        compileattn.write_kv_cache(key, value, key_cache, value_cache, torch.tensor([5, -1, 5]),
                                   backend="reference")


@pytest.mark.parametrize("window_left", [-1, 2])
def test_right_window_zero_is_causal(window_left):
    """In FlashAttention a right window of 0 hides every later key, i.e. it is causal masking."""
    case = Case(2, 2, 64, q_lens=[5], k_lens=[5], causal=True, window_left=window_left, seed=9)
    qs, ks, vs = make_seqs(case)
    out = compileattn.flash_attn_varlen_func(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), naive.cu_seqlens([5]), naive.cu_seqlens([5]),
        causal=False, window_size=(window_left, 0), backend="reference")
    assert_close(out, expected(case, qs, ks, vs), case.dtype)
