"""The Triton backend equals the reference backend: KV write, paged decode (split and not), the
unified varlen kernel (prefill, chunked prefill, mixed batches, contiguous K/V).

Without CUDA the kernels run under TRITON_INTERPRET=1, which tests/conftest.py sets before
anything imports triton (Triton's own helpers are decorated at its import). The interpreter's
bf16 tl.dot is broken, so the CPU runs fp16 and fp32; the CUDA-marked tests add bf16, CUDA-graph
capture/replay with new metadata contents, and a host-sync check of ``forward``.

Caches start as NaN everywhere except the cached context, so a kernel that touches a slot past a
sequence's length, or a stale page, poisons its output instead of passing by luck.
"""
from __future__ import annotations

import naive
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compileattn import (
    AttentionMetadataBuilder, AttentionSpec, KVCache, SequenceStep, set_forward_context,
)
from compileattn.backends.kv_write import write_kv_masked
from compileattn.backends.reference import ReferenceBackend
from compileattn.backends.triton import _mode
from compileattn.backends.triton.backend import TritonBackend
from compileattn.backends.triton.launch import DecodeLaunch
from compileattn.backends.triton.config import (
    MAX_SPLITS, MAX_SPLITS_MERGED_IN_KERNEL, PROGRAMS_PER_SM, Tuning, decode_config, fills_waves, num_splits,
    unified_config,
)
from compileattn.testing import warm_up_for_capture


def _interpreter_usable() -> bool:
    """Triton itself was imported in interpreter mode (its jit helpers are interpreted)."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return _mode.interpreting() and isinstance(standard.zeros, InterpretedFunction)


CUDA = torch.cuda.is_available()
if not CUDA:
    _mode.sync_interpreter_mode()

cpu_only = pytest.mark.skipif(CUDA, reason="interpreter tests (the GPU runs the compiled kernels)")
DEVICE = "cuda" if CUDA else "cpu"

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


# ---------------------------------------------------------------------------------------------
# case construction


def make_case(spec, dtype, block_size, lens, *, pad_to=None, device=DEVICE, seed=0):
    """Random step: ``lens`` is [(query_len, context_len)]; pages are a random permutation."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(q + c) // block_size) for q, c in lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    kvh, d = spec.num_kv_heads, spec.head_dim
    kc = torch.full((num_blocks, block_size, kvh, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    slots = [t[p // block_size] * block_size + p % block_size for (q, c), t in zip(lens, tables) for p in range(c)]
    if slots:
        kc.view(-1, kvh, d)[slots] = torch.randn(len(slots), kvh, d, generator=g)
        vc.view(-1, kvh, d)[slots] = torch.randn(len(slots), kvh, d, generator=g)
    tokens = sum(q for q, _ in lens)
    n = tokens if pad_to is None else pad_to
    q = 2 * torch.randn(n, spec.num_heads, d, generator=g)
    k = torch.randn(n, kvh, d, generator=g)
    v = torch.randn(n, kvh, d, generator=g)
    seqs = [SequenceStep(ql, c, t) for (ql, c), t in zip(lens, tables)]
    cast = dict(dtype=dtype, device=device)
    return dict(seqs=seqs, q=q.to(**cast), k=k.to(**cast), v=v.to(**cast), kc=kc.to(**cast), vc=vc.to(**cast),
                num_blocks=num_blocks, max_blocks=max(need) + 1, num_tokens=n)


def builder(case, block_size, backend, max_num_tokens=None):
    return AttentionMetadataBuilder(block_size=block_size, num_blocks=case["num_blocks"],
                                    max_num_tokens=max_num_tokens or case["num_tokens"] + 8,
                                    max_blocks_per_seq=case["max_blocks"], device=case["q"].device, backend=backend)


def layer_forward(md, cache, q, k, v, out):
    """One layer of one step through the unified op: the selector's KV write, then attention."""
    with set_forward_context(md, {"l0": cache}):
        torch.ops.compileattn.attention(q, k, v, out, "l0")


def run_forward(backend, spec, case, block_size, pad_to=None):
    md = builder(case, block_size, backend).build(case["seqs"], pad_to=pad_to)
    cache = KVCache(case["kc"].clone(), case["vc"].clone(), spec)
    out = torch.full_like(case["q"], 7.0)
    layer_forward(md, cache, case["q"], case["k"], case["v"], out)
    return out, cache, md


def triton_backend(device_type=DEVICE, **tuning) -> TritonBackend:
    be = TritonBackend(device_type)
    be.tuning = Tuning(**tuning)
    return be


def check_forward(spec, dtype, block_size, lens, *, pad_to=None, seed=0, **tuning):
    """Triton forward == reference forward (output and both caches); returns the backend and step."""
    case = make_case(spec, dtype, block_size, lens, pad_to=pad_to, seed=seed)
    be = triton_backend(**tuning)
    out, cache, md = run_forward(be, spec, case, block_size, pad_to)
    want, ref_cache, _ = run_forward(ReferenceBackend(), spec, case, block_size, pad_to)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
    torch.testing.assert_close(cache.key_cache, ref_cache.key_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(cache.value_cache, ref_cache.value_cache, atol=0, rtol=0, equal_nan=True)
    if CUDA:  # a prepared layer's second call skips JITFunction.run (backends/triton/direct.py)
        again = torch.full_like(out, 7.0)
        layer_forward(md, cache, case["q"], case["k"], case["v"], again)
        torch.testing.assert_close(again, out, atol=0, rtol=0)
    real = sum(q for q, _ in lens)
    assert torch.all(out[real:] == 0), "padding rows must be zero"
    return be, md


def decode_launch(md, spec, dtype) -> DecodeLaunch:
    """The decode launcher prepared for layers of ``spec`` with ``md``'s builder."""
    found = [launch for key, launch in md.selector.buffers._memo.items() if key[:3] == ("triton.decode", spec, dtype)]
    assert len(found) == 1, f"expected one decode launcher for {spec}, found {len(found)}"
    return found[0]


# ---------------------------------------------------------------------------------------------
# interpreter mode and pure heuristics


@cpu_only
def test_interpreter_mode_in_effect():
    assert _interpreter_usable()
    assert _mode.kernels_interpreted(), "kernels were decorated in compiled mode; the CPU tests would not run"


@cpu_only
def test_kernels_follow_mode_changes(monkeypatch):
    """Imported under one mode and used under the other: sync re-decorates, both ways."""
    from compileattn.backends.triton import decode

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    try:
        assert _mode.sync_interpreter_mode()
        assert not _mode.kernels_interpreted()
        assert type(decode.decode_kernel).__name__ == "JITFunction"
    finally:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        _mode.sync_interpreter_mode()
    assert _mode.kernels_interpreted()
    assert TritonBackend("cpu").unsupported_reason(AttentionSpec(2, 1, 32), torch.float16, "cpu", 16) is None


def test_split_heuristic_fills_one_wave():
    sms = 132
    slots = sms * PROGRAMS_PER_SM
    assert num_splits(1, 8, sms) == min(MAX_SPLITS, slots // 8)
    assert num_splits(256, 8, sms) == 1
    previous = MAX_SPLITS
    for b in (1, 2, 3, 5, 8, 16, 24, 32, 64, 128):
        s = num_splits(b, 8, sms)
        assert 1 <= s <= previous  # never more splits for a bigger batch
        assert s == 1 or b * 8 * s <= slots  # at most one wave of resident programs
        assert s == MAX_SPLITS or b * 8 * (s + 1) > slots  # and as close to one wave as allowed
        previous = s
    assert num_splits(4, 8, sms, Tuning(num_splits=5)) == 5


def test_sm_count_is_per_device(monkeypatch):
    """The multiprocessor count split-KV plans with is each device's own, asked by index or as the
    current device, in whichever order the devices are first asked."""
    from types import SimpleNamespace

    from compileattn.backends.triton import config

    sms, current = {0: 132, 1: 20}, [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(multi_processor_count=sms[index]))
    config._cuda_sm_count.cache_clear()
    try:
        assert config.sm_count("cuda") == 132
        current[0] = 1
        assert config.sm_count("cuda") == 20 and config.sm_count("cuda", None) == 20
        assert config.sm_count("cuda", 0) == 132 and config.sm_count("cuda", 1) == 20
        assert config.sm_count("cpu") == config.INTERPRETER_SM_COUNT
    finally:
        config._cuda_sm_count.cache_clear()  # no faked count outlives the test


def test_configs_are_tensor_core_shaped():
    for group in (1, 3, 8, 16, 64):
        for d in (32, 64, 80, 128, 256):
            for dtype in (torch.float16, torch.float32):
                dc = decode_config(group, d, dtype)
                assert dc.block_m >= max(16, group) and dc.block_n >= 16
                uc = unified_config(group, d, dtype)
                assert uc.block_q >= 1 and uc.block_q * group <= uc.block_m and uc.block_n >= 16
    assert decode_config(8, 128, torch.bfloat16).block_n == 64
    assert decode_config(8, 128, torch.bfloat16, page=16).tail_stages > 0  # tiles gather 4 pages
    assert decode_config(8, 128, torch.bfloat16, page=64).tail_stages == 0  # a tile is in one page
    # a grid that fills every resident slot unsplit, or tiles gathering pages, pipeline 2 stages
    # deep; a smaller grid of one-page tiles 3
    assert decode_config(8, 128, torch.bfloat16, page=64, full_waves=True).num_stages == 2
    assert decode_config(8, 128, torch.bfloat16, page=16).num_stages == 2
    assert decode_config(8, 128, torch.bfloat16, page=64).num_stages == 3
    assert fills_waves(256, 8, 132) and not fills_waves(64, 8, 132)


def test_unsupported_reasons():
    be = TritonBackend("cpu")
    spec = AttentionSpec(4, 2, 64)
    assert be.unsupported_reason(spec, torch.bfloat16, "cpu", 16) is not None
    assert be.unsupported_reason(spec, torch.float16, "meta", 16) is not None


# ---------------------------------------------------------------------------------------------
# KV write

@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kv_write_matches_reference(block_size, dtype):
    g = torch.Generator().manual_seed(1)
    kvh, d, t, nb = 3, 32, 9, 6
    # Key/value as strided views of a fused projection, the way a model hands them over.
    kv = torch.randn(t, 2 * kvh * d + 8, generator=g).to(dtype=dtype, device=DEVICE)
    key = kv[:, :kvh * d].view(t, kvh, d)
    value = kv[:, kvh * d:2 * kvh * d].view(t, kvh, d)
    slots = torch.randperm(nb * block_size, generator=g)[:t]
    slots[[2, 5]] = -1
    slots = slots.to(DEVICE)
    caches = [torch.zeros(nb, block_size, kvh, d, dtype=dtype, device=DEVICE) for _ in range(4)]
    triton_backend().write_kv_cache(key, value, caches[0], caches[1], slots)
    write_kv_masked(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# paged decode (interpreter)

DECODE_LENS = [(1, 150), (1, 0), (1, 37), (1, 97)]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("block_size,block_n", [(1, 16), (16, 16), (16, 64), (64, 32), (5, 16)])
@pytest.mark.parametrize("splits", [1, 3, 6])  # unsplit, merged in the launch, merged by the combine kernel
def test_decode_matches_reference(dtype, block_size, block_n, splits):
    spec = AttentionSpec(4, 2, 32)
    be, md = check_forward(spec, dtype, block_size, DECODE_LENS, pad_to=6, decode_block_n=block_n, num_splits=splits)
    assert md.is_uniform_decode and decode_launch(md, spec, dtype).splits == splits


@cpu_only
@pytest.mark.parametrize("tail_stages", [0, 1, 3])
def test_decode_tail_modes(tail_stages):
    """The last partial tile folded into the body loop, or in its own 1- or 3-stage loop."""
    spec = AttentionSpec(4, 2, 32)
    _, md = check_forward(spec, torch.float16, 16, DECODE_LENS, decode_block_n=32, num_splits=2,
                          decode_tail_stages=tail_stages)
    assert decode_launch(md, spec, torch.float16).kwargs["TAIL_STAGES"] == tail_stages


@cpu_only
@pytest.mark.parametrize("heads", [(4, 1), (6, 2), (2, 2)], ids=["mqa", "group3", "mha"])
def test_decode_head_layouts(heads):
    spec = AttentionSpec(heads[0], heads[1], 64)
    _, md = check_forward(spec, torch.float16, 16, [(1, 70), (1, 5)], decode_block_n=32, num_splits=2)
    assert decode_launch(md, spec, torch.float16).splits == 2


@cpu_only
def test_decode_scratch_is_per_builder():
    """One backend instance serves every builder; each builder's decode launch gets its own
    split-KV partials (a captured graph of one engine must not share them with another's)."""
    spec = AttentionSpec(4, 2, 32)
    case = make_case(spec, torch.float16, 16, DECODE_LENS)
    be = triton_backend(num_splits=2)
    launches = []
    for _ in range(2):
        md = builder(case, 16, be).build(case["seqs"])
        layer_forward(md, KVCache(case["kc"].clone(), case["vc"].clone(), spec), case["q"], case["k"], case["v"],
                      torch.empty_like(case["q"]))
        launches.append(decode_launch(md, spec, torch.float16))
    assert launches[0].o_part.data_ptr() != launches[1].o_part.data_ptr()
    assert launches[0].arrivals.data_ptr() != launches[1].arrivals.data_ptr()
    assert not any(key[0] == "decode" for key in be._launches), "a decode launch kept by the shared backend"


@cpu_only
@pytest.mark.parametrize("splits", [2, 4, 5, 32])
def test_split_merge_in_launch_or_by_combine(splits):
    """Up to MAX_SPLITS_MERGED_IN_KERNEL splits the last split of each (sequence, KV head) merges
    and resets its arrival counter, so a launch leaves the counters at zero and the next launch
    merges again; above it the combine kernel merges. Both give the reference's output, twice.
    (The interpreter runs one program after another; concurrent splits, graph replays and a
    counter buffer shared by two layer shapes: test_cuda_split_merge_under_load.)"""
    spec = AttentionSpec(4, 2, 32)
    case = make_case(spec, torch.float16, 16, DECODE_LENS)
    md = builder(case, 16, triton_backend(num_splits=splits)).build(case["seqs"])
    want, _, _ = run_forward(ReferenceBackend(), spec, case, 16)
    cache = KVCache(case["kc"].clone(), case["vc"].clone(), spec)
    in_launch = splits <= MAX_SPLITS_MERGED_IN_KERNEL
    for _ in range(2):
        out = torch.full_like(case["q"], 7.0)
        layer_forward(md, cache, case["q"], case["k"], case["v"], out)
        launch = decode_launch(md, spec, torch.float16)
        assert launch.splits == splits
        assert (launch.combine_run is None) == in_launch
        if in_launch:
            assert launch.arrivals.shape == (len(DECODE_LENS) * spec.num_kv_heads,)
            assert torch.all(launch.arrivals == 0)
        else:
            assert launch.arrivals is None
        torch.testing.assert_close(out, want, atol=TOL[torch.float16][0], rtol=TOL[torch.float16][1])


@cpu_only
def test_decode_default_heuristics_split():
    """No overrides: the CPU stand-in SM count makes a batch of one split."""
    spec = AttentionSpec(4, 2, 32)
    _, md = check_forward(spec, torch.float16, 16, [(1, 300)])
    assert decode_launch(md, spec, torch.float16).splits > 1


@cpu_only
@pytest.mark.parametrize("window,softcap", [(10, 0.0), (0, 0.0), (40, 0.0), (-1, 2.0), (17, 3.0)])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_window_softcap(window, softcap, splits):
    spec = AttentionSpec(4, 2, 32, sliding_window=window, softcap=softcap)
    check_forward(spec, torch.float32, 16, DECODE_LENS, decode_block_n=16, num_splits=splits)


@cpu_only
def test_decode_padded_head_dim():
    spec = AttentionSpec(4, 2, 80)
    check_forward(spec, torch.float16, 16, [(1, 40), (1, 3)], pad_to=3, decode_block_n=16, num_splits=2)


# ---------------------------------------------------------------------------------------------
# unified kernel (interpreter)

MIXED_LENS = [(1, 40), (1, 0), (7, 0), (13, 50), (1, 20), (18, 9)]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_mixed_batch_matches_reference(dtype, block_size):
    spec = AttentionSpec(4, 2, 32)
    be, md = check_forward(spec, dtype, block_size, MIXED_LENS, pad_to=43, unified_block_m=16, unified_block_n=16)
    assert {key[0] for key in be._launches} == {"unified"} and not md.selector.buffers._memo


@cpu_only
@pytest.mark.parametrize("heads", [(4, 1), (6, 2)], ids=["mqa", "group3"])
@pytest.mark.parametrize("block_n", [16, 32])
def test_unified_head_layouts(heads, block_n):
    spec = AttentionSpec(heads[0], heads[1], 32)
    check_forward(spec, torch.float16, 16, [(9, 30), (1, 17), (20, 0)], unified_block_m=16, unified_block_n=block_n)


@cpu_only
@pytest.mark.parametrize("window,softcap,causal", [(5, 0.0, True), (20, 2.0, True), (-1, 1.5, True),
                                                   (-1, 0.0, False), (6, 0.0, False)])
def test_unified_window_softcap_causal(window, softcap, causal):
    spec = AttentionSpec(4, 2, 32, sliding_window=window, softcap=softcap, causal=causal)
    check_forward(spec, torch.float32, 16, MIXED_LENS, unified_block_m=16, unified_block_n=16)


@cpu_only
@pytest.mark.parametrize("causal", [True, False])
def test_unified_window_edge_at_every_tile_offset(causal):
    """The window's first visible key at every offset within a 16-key tile, with a tile after it
    that is visible to every row of the query tile (the unmasked body of ``tile.attend_range``).

    ``key_ranges`` starts that body at the first tile whose keys every row may see; one key too
    early and the key just outside the last row's window is attended unmasked. The fixed windows
    above never put that key on the first slot of a tile, so only a sweep over all 16 offsets
    catches it."""
    for window in range(16, 32):  # rows 40..47 and 48..55: the last row's edge 47 - w covers 16..31
        spec = AttentionSpec(4, 2, 32, sliding_window=window, causal=causal)
        check_forward(spec, torch.float32, 16, [(16, 40)], seed=window, unified_block_m=16, unified_block_n=16)


@cpu_only
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_window_edge_at_every_tile_offset(splits):
    """The decode kernel's body is unmasked when its tiles gather several pages (page 5, 16-key
    tiles); the window's first key at every offset within a tile, as in the unified test above."""
    for window in range(16, 32):
        spec = AttentionSpec(4, 2, 32, sliding_window=window)
        _, md = check_forward(spec, torch.float32, 5, [(1, 69), (1, 50)], seed=window, decode_block_n=16,
                              num_splits=splits)
        assert decode_launch(md, spec, torch.float32).kwargs["TAIL_STAGES"] > 0, "the body must be unmasked"


@cpu_only
def test_unified_default_tiles():
    spec = AttentionSpec(4, 2, 64)
    check_forward(spec, torch.float16, 16, [(70, 60), (1, 9)], pad_to=74)


HYPOTHESIS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@cpu_only
@HYPOTHESIS
@given(data=st.data())
def test_ragged_batches_hypothesis(data):
    heads = data.draw(st.sampled_from([(2, 1), (4, 2), (4, 4), (6, 3)]))
    block_size = data.draw(st.sampled_from([1, 3, 16, 64]))
    window = data.draw(st.sampled_from([-1, -1, 0, 7, 30]))
    softcap = data.draw(st.sampled_from([0.0, 0.0, 4.0]))
    decode = data.draw(st.booleans())
    n = data.draw(st.integers(1, 3))
    qmax = 1 if decode else 12
    lens = [(data.draw(st.integers(1, qmax)), data.draw(st.integers(0, 70))) for _ in range(n)]
    pad = data.draw(st.integers(0, 2))
    spec = AttentionSpec(heads[0], heads[1], 32, sliding_window=window, softcap=softcap)
    check_forward(spec, torch.float16, block_size, lens, pad_to=sum(q for q, _ in lens) + pad,
                  seed=data.draw(st.integers(0, 2**16)), decode_block_n=16, unified_block_m=16, unified_block_n=16,
                  num_splits=data.draw(st.sampled_from([None, 1, 2, 5])))


# ---------------------------------------------------------------------------------------------
# public varlen_attention: contiguous K/V, paged decode path, rows past the last sequence


def _contiguous_case(dtype, q_lens, k_lens, kvh=2, h=4, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(q_lens), sum(k_lens)
    cast = dict(dtype=dtype, device=DEVICE)
    q = (2 * torch.randn(tq, h, d, generator=g)).to(**cast)
    k = torch.randn(tk, kvh, d, generator=g).to(**cast)
    v = torch.randn(tk, kvh, d, generator=g).to(**cast)
    cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + list(torch.tensor(k_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal,window,softcap", [(True, -1, 0.0), (False, -1, 0.0), (True, 4, 2.0)])
@pytest.mark.parametrize("use_seqused", [False, True])
def test_varlen_contiguous_matches_reference(causal, window, softcap, use_seqused):
    q_lens, k_lens = [5, 0, 12, 1], [9, 4, 12, 30]
    q, k, v, cu_q, cu_k = _contiguous_case(torch.float32, q_lens, k_lens)
    used = torch.tensor([7, 4, 12, 25], dtype=torch.int32, device=DEVICE) if use_seqused else None
    outs = []
    for be in (triton_backend(unified_block_m=16, unified_block_n=16), ReferenceBackend()):
        out = torch.full_like(q, 7.0)
        be.varlen_attention(q, k, v, out, cu_q, cu_k, used, None, max(q_lens), max(k_lens), 0.3, causal, window,
                            softcap)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], **dict(zip(("atol", "rtol"), TOL[torch.float32])))


def test_varlen_paged_decode_path_with_empty_query():
    """max_seqlen_q == 1 on a paged cache takes the decode kernel; a sequence without a query
    token (cu_seqlens_q repeats) must not disturb its neighbours."""
    spec = AttentionSpec(4, 2, 32)
    case = make_case(spec, torch.float16, 16, [(1, 60), (1, 31), (1, 7)])
    kc = torch.nan_to_num(case["kc"])
    vc = torch.nan_to_num(case["vc"])
    tables = torch.zeros(3, case["max_blocks"], dtype=torch.int32)
    for i, s in enumerate(case["seqs"]):
        tables[i, :len(s.block_table)] = torch.tensor(s.block_table)
    tables = tables.to(DEVICE)
    cu_q = torch.tensor([0, 1, 1, 2], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([60, 31, 7], dtype=torch.int32, device=DEVICE)
    q = case["q"][:2].contiguous()
    outs = []
    for be in (triton_backend(num_splits=3, decode_block_n=16), ReferenceBackend()):
        out = torch.full_like(q, 7.0)
        be.varlen_attention(q, kc, vc, out, cu_q, None, used, tables, 1, 60, 0.2, True, -1, 0.0)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], **dict(zip(("atol", "rtol"), TOL[torch.float16])))


# ---------------------------------------------------------------------------------------------
# through the compileattn::attention op


def test_attention_op_uses_triton_backend():
    import compileattn.ops  # noqa: F401  (registers the ops)

    spec = AttentionSpec(4, 2, 32)
    dtype = torch.float16
    case = make_case(spec, dtype, 16, [(1, 33), (1, 8)], pad_to=3)
    be = triton_backend(num_splits=2, decode_block_n=16)
    md = builder(case, 16, be).build(case["seqs"], pad_to=3)
    cache = KVCache(case["kc"].clone(), case["vc"].clone(), spec)
    out = torch.empty_like(case["q"])
    with set_forward_context(md, {"layer0": cache}) as ctx:
        torch.ops.compileattn.attention(case["q"], case["k"], case["v"], out, "layer0")
    assert ctx.table.backends["layer0"] is be
    want, _, _ = run_forward(ReferenceBackend(), spec, case, 16, pad_to=3)
    torch.testing.assert_close(out, want, **dict(zip(("atol", "rtol"), TOL[dtype])))


# ---------------------------------------------------------------------------------------------
# CUDA


CUDA_DTYPES = [torch.bfloat16, torch.float16]
#: (block_size, (heads, kv_heads), head_dim): every layout at page 16, pages 1 and 64 on two of them
#: (a full product would compile ~100 kernel variants on the device for little extra coverage).
CUDA_DECODE_SHAPES = ([(16, h, d) for h, d in (((8, 2), 64), ((4, 1), 128), ((16, 8), 256), ((8, 8), 80),
                                                 ((64, 8), 128))]
                      + [(bs, h, d) for bs in (1, 64) for h, d in (((64, 8), 128), ((4, 1), 128))])
CUDA_MIXED_SHAPES = ([(16, h, d) for h, d in (((8, 2), 64), ((4, 1), 128), ((16, 8), 256), ((12, 4), 96))]
                     + [(bs, (8, 2), 64) for bs in (1, 64)])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("block_size,heads,head_dim", CUDA_DECODE_SHAPES)
# None: the heuristic, which splits this small batch past MAX_SPLITS_MERGED_IN_KERNEL (combine
# kernel); 4: merged in the launch; 1: unsplit
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_cuda_decode(dtype, block_size, heads, head_dim, splits):
    spec = AttentionSpec(heads[0], heads[1], head_dim)
    lens = [(1, 700), (1, 0), (1, 33), (1, 1500), (1, 64)]
    check_forward(spec, dtype, block_size, lens, pad_to=8, num_splits=splits)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("block_size,heads,head_dim", CUDA_MIXED_SHAPES)
def test_cuda_mixed(dtype, block_size, heads, head_dim):
    spec = AttentionSpec(heads[0], heads[1], head_dim)
    lens = [(1, 300), (1, 0), (130, 0), (77, 513), (1, 20), (5, 1000)]
    check_forward(spec, dtype, block_size, lens, pad_to=224)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("window,softcap", [(100, 0.0), (-1, 30.0), (257, 10.0)])
@pytest.mark.parametrize("mixed", [False, True])
def test_cuda_window_softcap(dtype, window, softcap, mixed):
    spec = AttentionSpec(8, 2, 128, sliding_window=window, softcap=softcap)
    lens = [(1, 1000), (1, 50), (1, 300)] + ([(200, 400)] if mixed else [])
    check_forward(spec, dtype, 16, lens)


@pytest.mark.cuda
def test_cuda_forward_never_syncs():
    spec = AttentionSpec(32, 8, 128)
    for lens in ([(1, 2000), (1, 3)], [(1, 100), (50, 30)]):
        case = make_case(spec, torch.bfloat16, 16, lens, pad_to=64)
        be = triton_backend()
        md = builder(case, 16, be).build(case["seqs"], pad_to=64)
        cache = KVCache(case["kc"].clone(), case["vc"].clone(), spec)
        out = torch.empty_like(case["q"])
        layer_forward(md, cache, case["q"], case["k"], case["v"], out)  # first call binds and compiles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer_forward(md, cache, case["q"], case["k"], case["v"], out)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("kind,splits", [("decode", None), ("decode", 1), ("decode", 3), ("mixed", None)])
def test_cuda_graph_replay_with_new_metadata(dtype, block_size, kind, splits):
    """Capture a step, then change lengths and block tables in the persistent buffers (by building
    the next step's metadata) and replay: the graph must follow the new contents. Decode steps
    share the padded token count; mixed steps share token and sequence counts (what a capture
    size fixes) but not their split into queries and contexts."""
    spec = AttentionSpec(16, 4, 128)
    if kind == "decode":
        pad = 8
        steps = [[(1, 900), (1, 5), (1, 2500)], [(1, 3000), (1, 700), (1, 0), (1, 64), (1, 1)]]
    else:
        pad = 40
        steps = [[(1, 500), (20, 30), (11, 0)], [(1, 40), (5, 900), (26, 100)]]
    cases = [make_case(spec, dtype, block_size, lens, pad_to=pad, seed=i) for i, lens in enumerate(steps)]
    nb = max(c["num_blocks"] for c in cases)
    mb = max(c["max_blocks"] for c in cases)
    be = triton_backend(num_splits=splits)
    b = AttentionMetadataBuilder(block_size=block_size, num_blocks=nb, max_num_tokens=pad, max_blocks_per_seq=mb,
                                 device=DEVICE, backend=be)
    kc = torch.full((nb, block_size, spec.num_kv_heads, spec.head_dim), float("nan"), dtype=dtype, device=DEVICE)
    vc = torch.full_like(kc, float("nan"))
    cache = KVCache(kc, vc, spec)
    q, k, v = (torch.empty_like(cases[0][x]) for x in ("q", "k", "v"))
    out = torch.empty_like(q)

    def load(case):
        cache.key_cache[: case["num_blocks"]].copy_(case["kc"])
        cache.value_cache[: case["num_blocks"]].copy_(case["vc"])
        for x, t in ((q, "q"), (k, "k"), (v, "v")):
            x.copy_(case[t])

    load(cases[0])
    md = b.build(cases[0]["seqs"], pad_to=pad)
    warm_up_for_capture(lambda: layer_forward(md, cache, q, k, v, out))  # compile, bind, allocate scratch
    load(cases[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer_forward(md, cache, q, k, v, out)

    for case in cases:
        load(case)
        b.build(case["seqs"], pad_to=pad)  # new contents, same buffers
        graph.replay()
        torch.cuda.synchronize()
        ref_cache = KVCache(case["kc"].clone(), case["vc"].clone(), spec)
        ref_md = builder(case, block_size, ReferenceBackend()).build(case["seqs"], pad_to=pad)
        want = torch.empty_like(out)
        layer_forward(ref_md, ref_cache, case["q"], case["k"], case["v"], want)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
        n = case["num_blocks"]
        torch.testing.assert_close(cache.key_cache[:n], ref_cache.key_cache, atol=0, rtol=0, equal_nan=True)


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [2, 4])
def test_cuda_split_merge_under_load(splits):
    """Thousands of split programs at once (192 sequences x 8 KV heads x splits, several waves),
    two layer shapes sharing one arrival-counter buffer (same sequences x KV heads), eager and
    replayed from one graph, three times: every merge equals the reference and every counter is
    back at zero. The interpreter runs programs one after another, so only the GPU can show a
    merge that reads another split's partials before they are visible."""
    specs = {"wide": AttentionSpec(64, 8, 128), "narrow": AttentionSpec(16, 8, 64)}
    g = torch.Generator().manual_seed(3)
    lens = [(1, int(n)) for n in torch.randint(1, 2000, (192,), generator=g)]
    be = triton_backend(num_splits=splits)
    # one seed: the same page tables for both shapes (one step's metadata serves both layers)
    cases = {name: make_case(spec, torch.bfloat16, 16, lens) for name, spec in specs.items()}
    nb = max(c["num_blocks"] for c in cases.values())
    mb = max(c["max_blocks"] for c in cases.values())
    b = AttentionMetadataBuilder(block_size=16, num_blocks=nb, max_num_tokens=len(lens), max_blocks_per_seq=mb,
                                 device=DEVICE, backend=be)
    md = b.build(cases["wide"]["seqs"])
    caches, outs, wants = {}, {}, {}
    for name, spec in specs.items():
        c = cases[name]
        assert [s.block_table for s in c["seqs"]] == [s.block_table for s in cases["wide"]["seqs"]]
        caches[name] = KVCache(c["kc"].clone(), c["vc"].clone(), spec)
        outs[name] = torch.empty_like(c["q"])
        wants[name], _, _ = run_forward(ReferenceBackend(), spec, c, 16)

    def step():
        with set_forward_context(md, caches):
            for name in specs:
                c = cases[name]
                torch.ops.compileattn.attention(c["q"], c["k"], c["v"], outs[name], name)

    def check():
        torch.cuda.synchronize()
        for name in specs:
            torch.testing.assert_close(outs[name], wants[name], **dict(zip(("atol", "rtol"), TOL[torch.bfloat16])))
            launch = decode_launch(md, specs[name], torch.bfloat16)
            assert launch.splits == splits and launch.combine_run is None
            assert torch.all(launch.arrivals == 0)

    warm_up_for_capture(step, times=3)
    check()
    wide, narrow = (decode_launch(md, spec, torch.bfloat16).arrivals for spec in specs.values())
    assert wide.data_ptr() == narrow.data_ptr(), "the two layer shapes were meant to share one counter buffer"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        for name in specs:
            outs[name].fill_(float("nan"))
        graph.replay()
        check()


@pytest.mark.cuda
def test_cuda_long_context_default_split():
    """Production-like decode shape with the default heuristics: batch 2, 4096+ tokens."""
    spec = AttentionSpec(64, 8, 128)
    be, md = check_forward(spec, torch.bfloat16, 16, [(1, 4100), (1, 3000)])
    assert md.is_uniform_decode and decode_launch(md, spec, torch.bfloat16).splits > 1


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_attention_op_writes_a_key_whose_head_dim_is_strided(backend):
    """A key (or value) whose head dims are not adjacent (a transposed view) is written into the
    cache element by element, as the reference does: the Triton write kernel reads a head's dims at
    unit stride, so its prepared call makes such a key contiguous first."""
    from compileattn import AttentionMetadataBuilder, AttentionSpec, SequenceStep, allocate_kv_caches, set_forward_context

    torch.manual_seed(0)
    dtype, h, kvh, d, t = torch.float16, 4, 2, 32, 5
    spec = AttentionSpec(h, kvh, d)
    q = torch.randn(t, h, d, dtype=dtype)
    k = torch.randn(t, d, kvh, dtype=dtype).transpose(1, 2)  # (t, kvh, d), strides (d * kvh, 1, kvh)
    v = torch.randn(t, d, kvh, dtype=dtype).transpose(1, 2)
    kk, vv = k.double().repeat_interleave(h // kvh, 1), v.double().repeat_interleave(h // kvh, 1)
    scores = torch.einsum("thd,nhd->htn", q.double(), kk) * spec.scale
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("htn,nhd->thd", torch.softmax(scores, -1), vv)
    caches = allocate_kv_caches({"L": spec}, num_blocks=8, block_size=4, dtype=dtype)
    builder = AttentionMetadataBuilder(block_size=4, num_blocks=8, max_num_tokens=16, max_blocks_per_seq=4,
                                       backend=backend)
    md = builder.build([SequenceStep(t, 0, [3, 5])])
    out = torch.empty_like(q)
    with set_forward_context(md, caches):
        torch.ops.compileattn.attention(q, k, v, out, "L")
    assert torch.equal(caches["L"].key_cache[3, :4], k[:4]) and torch.equal(caches["L"].value_cache[5, 0], v[4])
    torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=2e-3)


def test_varlen_takes_tensors_torch_calls_contiguous_whose_strides_differ():
    """MQA's K and V cut from a (kv_heads, seq, head_dim) layout: both contiguous to torch, with
    strides that differ over the size-1 head dim, and an empty query with any strides. The
    entry's dense-copy fallback retried with ``contiguous()``, which returned them unchanged:
    ``RecursionError``."""
    import compileattn

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 64, generator=g).to(device)
    k = torch.randn(5, 1, 64, generator=g).to(device)
    v = torch.randn(1, 5, 64, generator=g).to(device).transpose(0, 1)
    assert k.is_contiguous() and v.is_contiguous() and k.stride() != v.stride()
    cu = torch.tensor([0, 5], dtype=torch.int32, device=device)
    want = compileattn.flash_attn_varlen_func(q, k, v, cu, cu, causal=True, backend="reference")
    got = compileattn.flash_attn_varlen_func(q, k, v, cu, cu, causal=True, backend="triton")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    empty = torch.randn(0, 4, 128, device=device)[:, :, ::2]
    none = torch.tensor([0, 0], dtype=torch.int32, device=device)
    assert compileattn.flash_attn_varlen_func(empty, k, k.clone(), none, cu, backend="triton").shape == (0, 4, 64)


def test_varlen_copies_only_the_tensors_whose_layout_the_kernels_cannot_read(monkeypatch):
    """A strided query over a dense paged cache: the query is copied, the cache (all of K and V) is not."""
    import compileattn
    from compileattn.backends.triton import backend as triton_backend

    copied = []
    real = triton_backend._dense
    monkeypatch.setattr(triton_backend, "_dense", lambda t: (copied.append(t.shape) if real(t) is not t else None)
                        or real(t))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kc = torch.randn(8, 4, 2, 64, device=device)
    vc = torch.randn(8, 4, 2, 64, device=device)
    q = torch.randn(3, 4, 128, device=device)[:, :, ::2]
    cu = torch.tensor([0, 3], dtype=torch.int32, device=device)
    table = torch.tensor([[1, 2]], dtype=torch.int32, device=device)
    used = torch.tensor([6], dtype=torch.int32, device=device)
    want = compileattn.flash_attn_varlen_func(q, kc, vc, cu, None, 3, 6, block_table=table, seqused_k=used,
                                              causal=True, backend="reference")
    got = compileattn.flash_attn_varlen_func(q, kc, vc, cu, None, 3, 6, block_table=table, seqused_k=used,
                                             causal=True, backend="triton")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert copied == [q.shape]



# ---------------------------------------------------------------------------------------------
# keys scoring -inf (an infinite k): SDPA's answer, never zeros

MINUS_INF_KEYS = 32  # the first two 16-key tiles: a whole unmasked body tile of -inf scores


@cpu_only
@pytest.mark.parametrize("kv_len", [1, 20, 32, 33, 50])
@pytest.mark.parametrize("path", ["decode", "decode-split2", "decode-split8", "decode-folded", "unified"])
def test_keys_scoring_minus_inf(path, kv_len):
    """Keys 0..31 have -inf in dim 3 and every query a positive dim 3, so they score -inf. A row
    that sees only such keys is NaN (SDPA's softmax of only -inf scores), never zeros, whichever
    tile path (masked tail, unmasked body, split partials merged in the launch or by the combine
    kernel) reads them; a row that also sees finite keys ignores them, even when a whole tile of
    them comes first (it used to be NaN from the unmasked body, zero from a masked tile)."""
    g = torch.Generator().manual_seed(5)
    q_len = 3 if path == "unified" else 1
    page, kvh, h, d = 16, 1, 2, 32
    q = torch.randn(q_len, h, d, generator=g)
    q[:, :, 3] = q[:, :, 3].abs() + 0.5
    k = torch.randn(kv_len, kvh, d, generator=g)
    v = torch.randn(kv_len, kvh, d, generator=g)
    k[:MINUS_INF_KEYS, :, 3] = float("-inf")
    pages = -(-kv_len // page)
    kc = torch.full((pages + 1, page, kvh, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    table = list(range(pages, 0, -1))  # reversed pages; page 0 unused
    for p in range(kv_len):
        kc[table[p // page], p % page] = k[p]
        vc[table[p // page], p % page] = v[p]
    tuning = {"decode": dict(num_splits=1, decode_block_n=32), "decode-split2": dict(num_splits=2, decode_block_n=16),
              "decode-split8": dict(num_splits=8, decode_block_n=16),
              "decode-folded": dict(num_splits=1, decode_block_n=16, decode_tail_stages=0),
              "unified": dict(unified_block_m=16, unified_block_n=16)}[path]
    out = torch.full_like(q, 7.0)
    triton_backend(**tuning).varlen_attention(
        q, kc, vc, out, torch.tensor([0, q_len], dtype=torch.int32), None, torch.tensor([kv_len], dtype=torch.int32),
        torch.tensor([table + [0]], dtype=torch.int32), q_len, kv_len, d ** -0.5, True, -1, 0.0)
    want = naive.attend(q, k, v, scale=d ** -0.5, causal=True)
    assert torch.equal(out.isnan(), want.isnan()), (out[:, :, 0], want[:, :, 0])
    torch.testing.assert_close(out[~want.isnan()].double(), want[~want.isnan()], atol=1e-4, rtol=1e-4)
