"""``compileattn.flash_attn_with_kvcache``: FlashAttention's decode entry point.

Checked against the float64 oracle (tests/naive.py) over each sequence's cached keys plus the
appended ones: contiguous and paged caches (shuffled pages, page sizes that do and do not divide
the lengths), with and without an append, one and several query tokens (chunked prefill, and more
queries than keys), causal or not, GQA/MQA, windows, softcap, ALiBi, an fp8 cache; that the append
writes exactly the new rows and nothing else; the argument checks (each names its argument, and
no kernel runs first); the entry under ``torch.compile``; on the GPU the compiled kernels and a
decode step captured in a CUDA graph that replays with new lengths.
"""
from __future__ import annotations

import dataclasses
import random

import naive
import pytest
import torch

import compileattn
from compileattn.backends import selector
from compileattn.kv_cache import FP8_E4M3_MAX
from compileattn.testing import warm_up_for_capture

CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(CUDA, reason="interpreter tests (the GPU runs the compiled kernels)")
FP8 = torch.float8_e4m3fn


@dataclasses.dataclass
class Setup:
    """One call's inputs and what the oracle needs: each sequence's logical cache contents."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    cache_seqlens: object  # int32 tensor, int or None
    block_table: torch.Tensor | None
    lens: list[int]
    logical_k: list[torch.Tensor]  # per sequence: its whole cache region (capacity rows), float64
    logical_v: list[torch.Tensor]
    page: int
    scales: tuple | None  # fp8: (k_scale, v_scale) tensors


def make_setup(*, batch=3, seqlen_q=1, heads=(8, 2), d=64, lens=(9, 20, 0), new=1, page=None, capacity=40,
               dtype=torch.float32, device="cpu", seed=0, fp8=False, lens_as="tensor") -> Setup:
    """``page`` None: a contiguous (batch + 1, capacity, kvh, d) cache; else a paged one whose
    pages are shuffled (and one spare page of garbage every table row points at past its end)."""
    g = torch.Generator().manual_seed(seed)
    h, kvh = heads
    lens = list(lens)[:batch]
    scales = None
    if fp8:
        scales = (torch.tensor([0.02] * kvh, device=device), torch.tensor([0.01] * kvh, device=device))
    logical_k = [torch.randn(capacity, kvh, d, generator=g) for _ in range(batch)]
    logical_v = [torch.randn(capacity, kvh, d, generator=g) for _ in range(batch)]
    store_dtype = FP8 if fp8 else dtype
    garbage_value = 400.0 if fp8 else 1e4  # large and finite in the cache's dtype (e4m3 tops out at 448)

    def store(x, scale):
        if scale is None:
            return x.to(dtype)
        return (x / scale.cpu().view(1, -1, 1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)

    k_rows = [store(x, scales[0] if fp8 else None) for x in logical_k]
    v_rows = [store(x, scales[1] if fp8 else None) for x in logical_v]
    if page is None:
        garbage = garbage_value * torch.ones(1, capacity, kvh, d)
        k_cache = torch.cat([torch.stack(k_rows), garbage.to(store_dtype)])
        v_cache = torch.cat([torch.stack(v_rows), garbage.to(store_dtype)])
        table = None
    else:
        per_seq = -(-capacity // page)
        num_blocks = batch * per_seq + 1
        order = torch.randperm(num_blocks, generator=g).tolist()
        spare = order[-1]
        rows = [order[b * per_seq:(b + 1) * per_seq] for b in range(batch)]
        k_cache = torch.full((num_blocks, page, kvh, d), garbage_value).to(store_dtype)
        v_cache = torch.full((num_blocks, page, kvh, d), garbage_value).to(store_dtype)
        for b in range(batch):
            for p in range(capacity):
                k_cache[rows[b][p // page], p % page] = k_rows[b][p]
                v_cache[rows[b][p // page], p % page] = v_rows[b][p]
        table = torch.tensor([r + [spare] for r in rows], dtype=torch.int32)
    q = (2 * torch.randn(batch, seqlen_q, h, d, generator=g)).to(dtype)
    k = v = None
    if new:
        k = torch.randn(batch, new, kvh, d, generator=g).to(dtype)
        v = torch.randn(batch, new, kvh, d, generator=g).to(dtype)
    if lens_as == "tensor":
        seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    elif lens_as == "int":
        assert len(set(lens)) == 1
        seqlens = lens[0]
    else:
        seqlens = None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return Setup(to(q), to(k_cache), to(v_cache), to(k), to(v), seqlens, to(table), lens,
                 [dequant(r, scales[0] if fp8 else None) for r in k_rows],
                 [dequant(r, scales[1] if fp8 else None) for r in v_rows], page or capacity, scales)


def dequant(rows, scale):
    return rows.double() if scale is None else rows.double() * scale.cpu().double().view(1, -1, 1)


def quantize_new(x, scale):
    return x.double() if scale is None else dequant(
        (x.float().cpu() / scale.cpu().view(1, -1, 1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8), scale)


def expected(s: Setup, *, causal, window=-1, softcap=0.0, alibi=None, scale=None):
    d = s.q.shape[-1]
    outs, keys = [], []
    for b, n in enumerate(s.lens):
        k_all, v_all = s.logical_k[b][:n], s.logical_v[b][:n]
        if s.k is not None:
            k_all = torch.cat([k_all, quantize_new(s.k[b].cpu(), s.scales and s.scales[0])])
            v_all = torch.cat([v_all, quantize_new(s.v[b].cpu(), s.scales and s.scales[1])])
        keys.append(k_all)
        outs.append(naive.attend(s.q[b].cpu(), k_all, v_all, scale=scale or d ** -0.5, causal=causal,
                                 window_left=window, softcap=softcap, alibi_slopes=alibi))
    return torch.stack(outs), keys


def cache_rows(s: Setup, k_cache, b, positions):
    """Dequantized rows of sequence b's ``positions`` in ``k_cache`` (float64, on the CPU)."""
    k_cache = k_cache.cpu()
    if s.block_table is None:
        rows = k_cache[b, positions]
    else:
        table = s.block_table.cpu()[b]
        rows = torch.stack([k_cache[int(table[p // s.page]), p % s.page] for p in positions])
    return dequant(rows, s.scales and s.scales[0].cpu())


def run(s: Setup, backend, **kw):
    return compileattn.flash_attn_with_kvcache(s.q, s.k_cache, s.v_cache, s.k, s.v, cache_seqlens=s.cache_seqlens,
                                               block_table=s.block_table, backend=backend,
                                               k_scale=s.scales and s.scales[0], v_scale=s.scales and s.scales[1],
                                               **kw)


#: (name, setup kwargs, call kwargs): the reference against the oracle.
CASES = [
    ("contig-decode-append", dict(), dict(causal=True)),
    ("contig-decode-no-append", dict(new=0), dict(causal=True)),
    ("contig-chunk-append", dict(seqlen_q=3, new=3), dict(causal=True)),
    ("contig-more-queries-than-keys", dict(seqlen_q=4, new=2, lens=(0, 1, 7)), dict(causal=True)),
    ("contig-full-cache", dict(new=0, lens=(40, 40, 40), lens_as="none"), dict(causal=False)),
    ("contig-int-seqlens", dict(new=2, lens=(11, 11, 11), lens_as="int"), dict(causal=True)),
    ("paged16-decode-append", dict(page=16), dict(causal=True)),
    ("paged5-chunk-noncausal", dict(page=5, seqlen_q=2, new=2, heads=(4, 4)), dict(causal=False)),
    ("paged16-mqa-window", dict(page=16, heads=(4, 1), new=3, seqlen_q=3), dict(causal=True, window_size=(6, -1))),
    ("paged7-alibi-softcap", dict(page=7, new=1), dict(causal=True, softcap=10.0, alibi=True)),
    ("contig-alibi-window-noncausal", dict(seqlen_q=2, new=2), dict(causal=False, window_size=(5, -1), alibi=True)),
    ("paged16-causal-as-window", dict(page=16, seqlen_q=2, new=1), dict(window_size=(-1, 0))),
    ("paged16-fp8", dict(page=16, fp8=True, new=2, seqlen_q=2), dict(causal=True)),
    ("contig-fp8-decode", dict(fp8=True), dict(causal=True)),
]


def _call_kwargs(kw, heads):
    kw = dict(kw)
    alibi = None
    if kw.pop("alibi", False):
        alibi = compileattn.alibi_slopes(heads)
        kw["alibi_slopes"] = torch.tensor(alibi)
    window = kw.get("window_size", (-1, -1))
    causal = kw.get("causal", False) or window[1] == 0
    return kw, dict(causal=causal, window=window[0], softcap=kw.get("softcap", 0.0), alibi=alibi)


@pytest.mark.parametrize("name,setup,call", CASES, ids=[c[0] for c in CASES])
def test_reference_against_the_oracle(name, setup, call):
    s = make_setup(**setup)
    k_before, v_before = s.k_cache.clone(), s.v_cache.clone()
    kw, oracle_kw = _call_kwargs(call, s.q.shape[2])
    out = run(s, "reference", **kw)
    want, _ = expected(s, **oracle_kw)
    torch.testing.assert_close(out.double(), want, atol=1e-5 if not setup.get("fp8") else 1e-4, rtol=1e-5)
    _check_append(s, k_before, v_before)


def _check_append(s: Setup, k_before, v_before):
    """The new rows landed at cache_seqlens .. + seqlen_new of each sequence; nothing else changed."""
    changed_k = (k_before.view(torch.uint8) != s.k_cache.view(torch.uint8)).any(dim=-1).any(dim=-1)
    if s.k is None:
        assert not changed_k.any()
        assert torch.equal(v_before.view(torch.uint8), s.v_cache.view(torch.uint8))
        return
    new = s.k.shape[1]
    touched = set()
    for b, n in enumerate(s.lens):
        positions = list(range(n, n + new))
        got = cache_rows(s, s.k_cache, b, positions)
        torch.testing.assert_close(got, quantize_new(s.k[b].cpu(), s.scales and s.scales[0]), atol=0, rtol=0)
        for p in positions:
            touched.add((b, p) if s.block_table is None else (int(s.block_table[b, p // s.page]), p % s.page))
    assert {tuple(i) for i in changed_k.nonzero().tolist()} <= touched


def test_output_into_a_strided_out():
    s = make_setup(seqlen_q=2, new=2, page=16)
    buf = torch.full((3, 2, 8, 2, 64), 5.0)
    out = buf[..., 1, :]  # not contiguous
    result = run(s, "reference", out=out, causal=True)
    assert result is out
    want, _ = expected(s, causal=True)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert (buf[..., 0, :] == 5.0).all()


#: The Triton kernels under the interpreter: the decode kernel over a contiguous cache seen as
#: pages of a whole sequence, the unified kernel for chunks, an fp8 cache, ALiBi with a window.
TRITON_CASES = [
    ("contig-decode-append", dict(), dict(causal=True)),
    ("paged16-chunk-append", dict(page=16, seqlen_q=3, new=3), dict(causal=True)),
    ("paged16-fp8-decode", dict(page=16, fp8=True, new=1), dict(causal=True)),
    ("contig-alibi-window", dict(new=2, seqlen_q=2), dict(causal=True, window_size=(5, -1), alibi=True)),
]


@cpu_only
@pytest.mark.parametrize("name,setup,call", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_against_the_oracle(name, setup, call):
    s = make_setup(dtype=torch.float16, **setup)
    k_before, v_before = s.k_cache.clone(), s.v_cache.clone()
    kw, oracle_kw = _call_kwargs(call, s.q.shape[2])
    out = run(s, "triton", **kw)
    want, _ = expected(s, **oracle_kw)
    torch.testing.assert_close(out.double(), want, atol=3e-3, rtol=1e-2)
    _check_append(s, k_before, v_before)


def test_compiled_equals_eager():
    """The entry traces into one graph (validate=False reads no device tensor) whose ops' fakes and
    declared mutations carry the append: compiled output and cache equal eager's."""
    s1, s2 = make_setup(page=16, new=2, seqlen_q=2), make_setup(page=16, new=2, seqlen_q=2)

    def step(q, k_cache, v_cache, k, v, lens, table):
        return compileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table,
                                                   causal=True, backend="reference", validate=False)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    want = step(s1.q, s1.k_cache, s1.v_cache, s1.k, s1.v, s1.cache_seqlens, s1.block_table)
    got = compiled(s2.q, s2.k_cache, s2.v_cache, s2.k, s2.v, s2.cache_seqlens, s2.block_table)
    torch.testing.assert_close(got, want)
    assert torch.equal(s1.k_cache, s2.k_cache) and torch.equal(s1.v_cache, s2.v_cache)


# ---------------------------------------------------------------------------------------------
# argument checks


class KernelRan(AssertionError):
    pass


@pytest.fixture
def no_kernels(monkeypatch):
    def ran(*args, **kwargs):
        raise KernelRan("a kernel ran before the input was rejected")

    for name in ("run_varlen", "run_write"):
        monkeypatch.setattr(selector, name, ran)


def _bad(**changes):
    s = make_setup(page=16, new=1)
    args = dict(q=s.q, k_cache=s.k_cache, v_cache=s.v_cache, k=s.k, v=s.v, cache_seqlens=s.cache_seqlens,
                block_table=s.block_table)
    args.update(changes)
    return args


BAD = [
    (dict(q=torch.randn(3, 8, 64)), ValueError, r"^q must be \(batch, seqlen_q"),
    (dict(q=torch.randn(3, 1, 8, 64).double()), TypeError, "^q has dtype"),
    (dict(q=[1.0]), TypeError, "^q must be a tensor"),
    (dict(q=torch.randn(3, 1, 8, 48)), ValueError, "head_dim=48"),
    (dict(q=torch.randn(3, 1, 5, 64)), ValueError, "q has 5 heads, not a multiple of the 2 kv heads"),
    (dict(q=torch.randn(3, 1, 0, 64)), ValueError, "q has 0 heads, not a multiple of the 2 kv heads"),
    (dict(q=torch.randn(3, 0, 8, 64)), ValueError, "^q has seqlen_q 0"),
    (dict(k_cache=torch.randn(10, 16, 0, 64), v_cache=torch.randn(10, 16, 0, 64)), ValueError,
     "q has 8 heads, not a multiple of the 0 kv heads"),
    (dict(k_cache=torch.randn(10, 0, 2, 64), v_cache=torch.randn(10, 0, 2, 64)), ValueError,
     "^k_cache has 0 tokens per block"),
    (dict(k_cache=torch.randn(10, 16, 2, 64).half()), TypeError, "^k_cache has dtype"),
    (dict(v_cache=torch.randn(9, 16, 2, 64)), ValueError, "^k_cache .* and v_cache .* must agree"),
    (dict(k_cache=torch.randn(10, 16, 2, 128)[..., :64], v_cache=torch.randn(10, 16, 2, 128)[..., :64]), ValueError,
     "^k_cache must be contiguous"),
    (dict(k=None), ValueError, "^k and v must be given together"),
    (dict(k=torch.randn(3, 1, 2, 64).half()), TypeError, "^k has dtype"),
    (dict(k=torch.randn(2, 1, 2, 64), v=torch.randn(2, 1, 2, 64)), ValueError, r"^k must be \(batch=3"),
    (dict(v=torch.randn(3, 2, 2, 64)), ValueError, "^k shape .* and v shape .* disagree"),
    (dict(cache_seqlens=None), ValueError, "^cache_seqlens is required with k/v"),
    (dict(cache_seqlens=torch.tensor([1, 2, 3])), TypeError, "^cache_seqlens must be int32"),
    (dict(cache_seqlens=torch.tensor([1, 2], dtype=torch.int32)), ValueError, "^cache_seqlens has 2 entries"),
    (dict(cache_seqlens=2.0), TypeError, "^cache_seqlens must be an int"),
    (dict(cache_seqlens=-1), ValueError, "^cache_seqlens must be >= 0"),
    (dict(cache_seqlens=torch.tensor([1, -2, 3], dtype=torch.int32)), ValueError, r"^cache_seqlens\[1\] = -2"),
    (dict(cache_seqlens=torch.tensor([1, 64, 3], dtype=torch.int32)), ValueError,
     r"^cache_seqlens\[1\] = 64 plus the 1 new tokens of k/v exceed the 64 tokens"),
    (dict(block_table=torch.zeros(3, 3)), TypeError, "^block_table must be int32"),
    (dict(block_table=torch.zeros(2, 3, dtype=torch.int32)), ValueError, "^block_table has 2 rows"),
    (dict(block_table=torch.full((3, 3), 99, dtype=torch.int32)), ValueError, "^block_table row 0 has an entry"),
    (dict(block_table=torch.zeros(3, 3, dtype=torch.int32), cache_seqlens=torch.tensor([9, 9, 0], dtype=torch.int32)),
     ValueError, "^new token 0 of sequence 0 and new token 0 of sequence 1 would both be written to row 9 of block 0"),
    (dict(block_table=torch.tensor([[0, 1, 2], [0, 3, 4], [5, 6, 7]], dtype=torch.int32),
          cache_seqlens=torch.tensor([9, 0, 3], dtype=torch.int32)), ValueError,
     r"^new token 0 of sequence 1 would be written to row 0 of block 0, which sequence\(s\) \[0\] read as context"),
    (dict(block_table=None, k_cache=torch.randn(2, 40, 2, 64), v_cache=torch.randn(2, 40, 2, 64)), ValueError,
     "^k_cache holds 2 sequences for a batch of 3"),
    (dict(alibi_slopes=torch.ones(8, dtype=torch.float64)), TypeError, "^alibi_slopes must be float32"),
    (dict(alibi_slopes=torch.ones(2)), ValueError, r"^alibi_slopes must have shape \(8,\)"),
    (dict(window_size=(3, 2)), ValueError, "^window_size right=2"),
    (dict(window_size=(-2, -1)), ValueError, "^window_size left must be -1 or >= 0"),
    (dict(softcap=-1.0), ValueError, "^softcap must be a finite float >= 0"),
    (dict(out=torch.empty(3, 1, 8, 32)), ValueError, "^out must have q's shape"),
    (dict(k_scale=torch.ones(2), v_scale=torch.ones(2)), ValueError, "^k_scale/v_scale apply to float8_e4m3fn"),
    (dict(rotary_cos=torch.ones(64, 32), rotary_sin=torch.zeros(64, 32)), ValueError, "^rotary_cos is not supported"),
    (dict(rotary_sin=torch.zeros(64, 32)), ValueError, "^rotary_sin is not supported"),
    (dict(cache_batch_idx=torch.arange(3, dtype=torch.int32)), ValueError, "^cache_batch_idx is not supported"),
    (dict(cache_leftpad=torch.zeros(3, dtype=torch.int32)), ValueError, "^cache_leftpad is not supported"),
    (dict(return_softmax_lse=True), ValueError, "^return_softmax_lse=True is not supported"),
    (dict(return_softmax_lse="yes"), TypeError, "^return_softmax_lse must be a bool"),
    (dict(num_splits=-1), ValueError, r"^num_splits must be >= 0"),
    (dict(num_splits=2.0), TypeError, r"^num_splits must be an int"),
    (dict(rotary_interleaved=None), TypeError, "^rotary_interleaved must be a bool"),
    # Checks a later one (the append's, with a message of its own) would otherwise have stood in
    # for: each case leaves check_kvcache_args' own check as the only one naming the argument.
    (dict(k=None, v=None, k_cache=torch.randn(10, 16, 2, 128), v_cache=torch.randn(10, 16, 2, 128)), ValueError,
     "^k_cache head_dim 128 differs from q head_dim 64"),
    (dict(block_table=torch.zeros(3, 0, dtype=torch.int32)), ValueError, "^block_table needs at least one column"),
    (dict(k_cache=[1.0]), TypeError, "^k_cache must be a tensor"),
    (dict(v_cache=[1.0]), TypeError, "^v_cache must be a tensor"),
    (dict(k=[1.0]), TypeError, "^k must be a tensor"),
    (dict(v=[1.0]), TypeError, "^v must be a tensor"),
    (dict(out=[1.0]), TypeError, "^out must be a tensor"),
    (dict(k=None, v=None, k_scale=torch.ones(2), v_scale=torch.ones(2)), ValueError,
     "^k_scale/v_scale apply to float8_e4m3fn caches only"),
]


@pytest.mark.parametrize("changes,error,match", BAD, ids=[f"{i}-{next(iter(c[0]))}" for i, c in enumerate(BAD)])
def test_bad_arguments_are_named_before_any_kernel(no_kernels, changes, error, match):
    args = _bad(**changes)
    k_before = args["k_cache"].clone() if isinstance(args["k_cache"], torch.Tensor) else None
    with pytest.raises(error, match=match):
        compileattn.flash_attn_with_kvcache(**args)
    if k_before is not None:
        assert torch.equal(args["k_cache"], k_before)


def test_arguments_bind_in_flash_attns_positions():
    """A call written for flash-attn, positionally, means what it meant there: flash-attn's
    ``(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
    cache_leftpad, block_table, softmax_scale, causal, ...)``. Bound in another order, an int
    ``cache_seqlens`` was taken for ``softmax_scale`` and every cached token attended, unscaled."""
    s = make_setup(page=16, new=1)
    want = compileattn.flash_attn_with_kvcache(s.q, s.k_cache.clone(), s.v_cache.clone(), s.k, s.v,
                                               cache_seqlens=s.cache_seqlens, block_table=s.block_table,
                                               softmax_scale=0.5, causal=True, num_splits=4)
    got = compileattn.flash_attn_with_kvcache(s.q, s.k_cache, s.v_cache, s.k, s.v, None, None, s.cache_seqlens, None,
                                              None, s.block_table, 0.5, True)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("cache_seqlens", [64, 2 ** 40])
def test_an_int_cache_seqlens_past_the_cache_is_named_without_validate_too(no_kernels, cache_seqlens, validate):
    """An int is on the host: checking it against the cache's capacity costs no device read, so
    ``validate=False`` checks it as well (unchecked, the append's positions were clamped into the
    table and landed on other rows; past int32, torch.full's overflow error named nothing)."""
    args = _bad(cache_seqlens=cache_seqlens)
    k_before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=rf"^cache_seqlens={cache_seqlens} plus the 1 new tokens of k/v exceed the "
                                         r"64 tokens each sequence can hold \(4 blocks x 16\)"):
        compileattn.flash_attn_with_kvcache(**args, validate=validate)
    assert torch.equal(args["k_cache"], k_before)


def _past_int32(**over):
    """One sequence whose block table holds 2**31 + 2**13 tokens: 2**18 + 1 columns of 2**13-row
    pages, all page 0 (4 MiB of cache, where distinct pages would take 512 GiB)."""
    page, d = 2 ** 13, 64
    args = dict(q=torch.randn(1, 1, 1, d), k_cache=torch.zeros(1, page, 1, d), v_cache=torch.zeros(1, page, 1, d),
                block_table=torch.zeros(1, 2 ** 18 + 1, dtype=torch.int32))
    args.update(over)
    return args


NEW = dict(k=torch.randn(1, 1, 1, 64), v=torch.randn(1, 1, 1, 64))
PAST_INT32 = [
    (dict(cache_seqlens=2 ** 31), True, r"cache_seqlens=2147483648 plus the 0 new tokens of k/v"),
    (dict(cache_seqlens=2 ** 31 - 1, **NEW), True, r"cache_seqlens=2147483647 plus the 1 new tokens of k/v"),
    (dict(cache_seqlens=2 ** 31 - 1, **NEW), False, r"cache_seqlens=2147483647 plus the 1 new tokens of k/v"),
    (dict(cache_seqlens=None), False, r"cache_seqlens=None \(the whole cache, 262145 blocks x 8192\)"),
    (dict(cache_seqlens=torch.tensor([2 ** 31 - 1], dtype=torch.int32), **NEW), True,
     r"cache_seqlens\[0\] = 2147483647 plus the 1 new tokens of k/v"),
]


@pytest.mark.parametrize("changes,validate,name", PAST_INT32, ids=["int", "int+new", "int+new-novalidate", "None",
                                                                     "tensor+new"])
def test_token_counts_past_int32_are_refused_by_name(no_kernels, changes, validate, name):
    """The entry passes ``cache_seqlens`` (an int or None made into an int32 tensor) plus the new
    tokens to the kernels as int32 key lengths. In a cache that holds more than 2**31 - 1 tokens a
    count past int32 passes the capacity check; unchecked, an int fails in torch.full naming
    nothing and a tensor's sum with the new tokens wraps to a negative length. An int is checked on
    the host, ``validate=False`` too; a tensor's entries are read under ``validate=True``."""
    args = _past_int32(**changes)
    with pytest.raises(ValueError, match=rf"^{name} must be at most 2147483647 \(2\*\*31 - 1\), got \d+: token "
                                         r"counts are int32 in cache_seqlens"):
        compileattn.flash_attn_with_kvcache(**args, validate=validate)
    assert not args["k_cache"].any()


def test_out_sharing_memory_with_q_or_a_cache_is_named(no_kernels):
    """The attention reads q and the caches while it writes out: an out in their memory would be
    written before some of its reads."""
    args = _bad()
    with pytest.raises(ValueError, match="^out shares memory with q"):
        compileattn.flash_attn_with_kvcache(**args, out=args["q"])
    q_shape = args["q"].shape
    with pytest.raises(ValueError, match="^out shares memory with v_cache"):
        compileattn.flash_attn_with_kvcache(**args, out=args["v_cache"].view(-1)[: q_shape.numel()].view(q_shape))


def test_one_tensor_as_both_caches_is_refused(no_kernels):
    """k_cache is v_cache: the appended values would land over the keys and be read as keys."""
    args = _bad()
    with pytest.raises(ValueError, match="^v_cache shares memory with k_cache"):
        compileattn.flash_attn_with_kvcache(**{**args, "v_cache": args["k_cache"]})


def test_cache_seqlens_takes_a_numpy_integer():
    """A numpy integer is an int, as at every public entry (argtypes): the same result as the int."""
    np = pytest.importorskip("numpy")
    s1, s2 = make_setup(page=16), make_setup(page=16)
    kw = dict(block_table=s1.block_table, causal=True, backend="reference")
    want = compileattn.flash_attn_with_kvcache(s1.q, s1.k_cache, s1.v_cache, cache_seqlens=5, **kw)
    got = compileattn.flash_attn_with_kvcache(s2.q, s2.k_cache, s2.v_cache, cache_seqlens=np.int64(5), **kw)
    torch.testing.assert_close(got, want)


def test_fp8_cache_needs_its_scales(no_kernels):
    s = make_setup(page=16, fp8=True)
    with pytest.raises(ValueError, match="^k_scale is required"):
        compileattn.flash_attn_with_kvcache(s.q, s.k_cache, s.v_cache, s.k, s.v, cache_seqlens=s.cache_seqlens,
                                            block_table=s.block_table)


@pytest.mark.parametrize("new,validate", [(0, True), (1, False)])
def test_fp8_cache_needs_its_scales_without_an_append_or_validate_too(no_kernels, new, validate):
    """The structural check names the missing scale itself: with no k/v there is no append for the
    write's check to refuse it, and ``validate=False`` skips that check."""
    s = make_setup(page=16, fp8=True, new=new)
    with pytest.raises(ValueError, match=r"^k_scale is required with torch\.float8_e4m3fn caches"):
        compileattn.flash_attn_with_kvcache(s.q, s.k_cache, s.v_cache, s.k, s.v, cache_seqlens=s.cache_seqlens,
                                            block_table=s.block_table, validate=validate)


@pytest.mark.parametrize("name", ["k_cache", "v_cache", "k", "v", "out"])
def test_a_tensor_on_another_device_than_q_is_named(no_kernels, name):
    """(The meta device stands in for a second one: it has no kernels to run either.)"""
    args = _bad()
    other = (args["q"] if name == "out" else args[name]).to("meta")
    k_before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=f"^{name} is on meta, but q is on cpu"):
        compileattn.flash_attn_with_kvcache(**{**args, name: other})
    assert torch.equal(args["k_cache"], k_before)


# ---------------------------------------------------------------------------------------------
# GPU


GPU_CASES = [
    ("contig-decode-append", dict(capacity=3000, lens=(2999, 17, 1500)), dict(causal=True)),
    ("paged16-decode-append", dict(page=16, capacity=3000, lens=(2999, 17, 1500)), dict(causal=True)),
    ("paged16-chunk-alibi", dict(page=16, capacity=700, lens=(600, 0, 100), seqlen_q=64, new=64),
     dict(causal=True, alibi=True)),
    ("paged16-fp8-decode", dict(page=16, capacity=2000, lens=(1999, 5, 300), fp8=True), dict(causal=True)),
]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", "flash", "auto"])
@pytest.mark.parametrize("name,setup,call", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_cuda_against_the_reference(name, setup, call, backend):
    """bf16, compiled kernels, against the reference backend on a copy of the same inputs (flash
    falls back to Triton where FlashAttention refuses: ALiBi, fp8, some page sizes)."""
    if backend == "flash":
        try:
            selector.get_backend("flash", "cuda")
        except ImportError as exc:
            pytest.skip(f"no FlashAttention here: {exc}")
    s = make_setup(dtype=torch.bfloat16, device="cuda", heads=(64, 8), d=128, **setup)
    ref = dataclasses.replace(s, k_cache=s.k_cache.clone(), v_cache=s.v_cache.clone())
    kw, _ = _call_kwargs(call, 64)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"].cuda()
    got = run(s, backend, **kw)
    want = run(ref, "reference", **kw)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(s.k_cache.float(), ref.k_cache.float(), atol=2 ** -9, rtol=2 ** -3)


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cuda_graph_replays_with_new_cache_seqlens(paged):
    """What a serving engine does with flash_attn_with_kvcache: capture one decode step (append
    and attention, validate=False: no host sync) and replay it with new lengths, queries and K/V."""
    batch, capacity = 4, 2048
    s = make_setup(batch=batch, dtype=torch.bfloat16, device="cuda", heads=(64, 8), d=128, capacity=capacity,
                   lens=(100, 2000, 7, 1024), page=16 if paged else None)
    lens = s.cache_seqlens.clone()
    q, k, v = s.q.clone(), s.k.clone(), s.v.clone()
    out = torch.empty_like(q)

    def step():
        compileattn.flash_attn_with_kvcache(q, s.k_cache, s.v_cache, k, v, cache_seqlens=lens,
                                            block_table=s.block_table, causal=True, out=out, backend="triton",
                                            validate=False)

    warm_up_for_capture(step)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rng = random.Random(0)
    for _ in range(3):
        new_lens = [rng.randrange(0, capacity - 1) for _ in range(batch)]
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        ref_k, ref_v = s.k_cache.clone(), s.v_cache.clone()
        want = compileattn.flash_attn_with_kvcache(q, ref_k, ref_v, k, v, cache_seqlens=lens.clone(),
                                                   block_table=s.block_table, causal=True, backend="reference")
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
        assert torch.equal(s.k_cache, ref_k) and torch.equal(s.v_cache, ref_v)


def test_compiled_with_dynamic_shapes_traces_into_one_graph():
    """``dynamic=True`` makes Python floats symbolic, the entry points' defaults included
    (softcap=0.0): the softmax numbers' check must trace (``math.isfinite`` of a symbolic float
    broke the graph, an error under ``fullgraph=True``)."""
    def step(q, k_cache, v_cache, k, v, lens, table, scale):
        return compileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table,
                                                   softmax_scale=scale, causal=True, backend="reference",
                                                   validate=False)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k):
        return compileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend="reference",
                                                  validate=False)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    for seqlen_q in (2, 3):
        s1, s2 = make_setup(page=16, new=seqlen_q, seqlen_q=seqlen_q), make_setup(page=16, new=seqlen_q, seqlen_q=seqlen_q)
        want = step(s1.q, s1.k_cache, s1.v_cache, s1.k, s1.v, s1.cache_seqlens, s1.block_table, 0.1)
        got = compiled(s2.q, s2.k_cache, s2.v_cache, s2.k, s2.v, s2.cache_seqlens, s2.block_table, 0.1)
        torch.testing.assert_close(got, want)
        assert torch.equal(s1.k_cache, s2.k_cache)
    compiled_varlen = torch.compile(varlen, fullgraph=True, backend="aot_eager", dynamic=True)
    for lens_q, lens_k in (([1, 4], [5, 6]), ([2, 3, 1], [2, 8, 4])):
        q, k, v = torch.randn(sum(lens_q), 8, 64), torch.randn(sum(lens_k), 2, 64), torch.randn(sum(lens_k), 2, 64)
        args = (q, k, v, naive.cu_seqlens(lens_q), naive.cu_seqlens(lens_k), max(lens_q), max(lens_k))
        torch.testing.assert_close(compiled_varlen(*args), varlen(*args))
