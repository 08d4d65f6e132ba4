"""The ``flash`` backend: FlashAttention-4 on the GPU against the reference, CUDA-graph replay,
fallback with one logged reason; and, everywhere, its torch KV writer and the fallback chain.

GPU tests need ``flash_attn.cute`` (FA4): on the GPU machine ``source .device/flash-attn-4.sh``
first (see ``../shared/device/pack-flash-attn-4``). Each distinct FA4 kernel configuration is
JIT-compiled on first use, so the GPU matrix below is chosen to need few of them (page sizes 16 and
64 share a kernel; 128 uses the TMA one).
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

try:  # only the CPU property test needs it; the GPU tests must not depend on it
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

from compileattn.backends import flash as flash_mod
from compileattn.backends import flash_fa4, registry
from compileattn.backends.base import AttentionBackend
from compileattn.backends.reference import ReferenceBackend
from compileattn.kv_cache import AttentionSpec, KVCache, allocate_kv_caches
from compileattn.metadata import AttentionMetadataBuilder, SequenceStep


def _flash_importable() -> bool:
    try:
        flash_mod._load_impl("auto")
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# Everywhere (CPU): KV writers, the argument-layout check, the fallback chain, the import error.
# --------------------------------------------------------------------------------------------

def _reference_write(key, value, kc, vc, slots):
    kc, vc = kc.clone(), vc.clone()
    ReferenceBackend().write_kv_cache(key, value, kc, vc, slots)
    return kc, vc


def _write_kv_any_case(n, data):
    num_blocks, bs = 4, 4
    slots_pool = list(range(num_blocks * bs))
    real = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    chosen = data.draw(st.permutations(slots_pool))[:n]
    slots = torch.tensor([s if r else -1 for s, r in zip(chosen, real)], dtype=torch.int64)
    g = torch.Generator().manual_seed(n)
    key, value = torch.randn(n + 1, 2, 8, generator=g), torch.randn(n + 1, 2, 8, generator=g)
    kc, vc = torch.randn(num_blocks, bs, 2, 8, generator=g), torch.randn(num_blocks, bs, 2, 8, generator=g)
    want_k, want_v = _reference_write(key, value, kc, vc, slots)
    flash_mod.write_kv_any(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


if given is not None:
    @settings(max_examples=40, deadline=None)
    @given(st.integers(1, 12), st.data())
    def test_write_kv_any_matches_reference(n, data):
        """Slot -1 anywhere (including every slot) writes nothing; real slots get their token's rows."""
        _write_kv_any_case(n, data)
else:  # pragma: no cover
    @pytest.mark.skip(reason="hypothesis is not installed")
    def test_write_kv_any_matches_reference():
        pass


@pytest.mark.parametrize("num_pad", [0, 1, 5])
def test_step_write_indices_match_reference(num_pad):
    """The once-per-step indices (builder layout: padding last) give the reference's cache."""
    bs = 4
    builder = AttentionMetadataBuilder(block_size=bs, num_blocks=16, max_num_tokens=32, max_blocks_per_seq=4)
    seqs = [SequenceStep(1, 6, [3, 9]), SequenceStep(1, 0, [5]), SequenceStep(5, 2, [0, 12])]
    md = builder.build(seqs, pad_to=7 + num_pad)
    n = md.num_tokens
    dst, src = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    flash_mod.step_write_indices(md.slot_mapping, md.num_actual_tokens, dst, src)
    g = torch.Generator().manual_seed(num_pad)
    key, value = torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    kc, vc = torch.randn(16, bs, 2, 8, generator=g), torch.randn(16, bs, 2, 8, generator=g)
    want_k, want_v = _reference_write(key, value, kc, vc, md.slot_mapping)
    flash_mod.write_kv_torch(key, value, kc, vc, dst, src)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_match_layout_accepts_fa4_call_and_names_mismatch():
    """The layout check accepts exactly our tensors in their slots and says which slot is off."""
    t = {name: torch.zeros(3, 4) for name in ("q", "k", "v", "out")}
    t.update(cu_q=torch.zeros(3, dtype=torch.int32), used_k=torch.zeros(2, dtype=torch.int32),
             table=torch.zeros(2, 5, dtype=torch.int32), max_q=7)
    layout = flash_fa4.ARG_LAYOUTS[10]
    args = [t[r] if r in t and r != "max_q" else (7 if r == "max_q" else (0.5 if r == "const" else None))
            for r in layout]
    args[0] = t["q"].detach()  # FA4 passes detached views: same memory, other object
    assert flash_fa4.match_layout(tuple(args), layout, t) is None
    wrong = list(args)
    wrong[6] = t["cu_q"].clone()  # a copy FA4 made is not our persistent buffer
    assert "cu_q" in flash_fa4.match_layout(tuple(wrong), layout, t)
    extra = list(args)
    extra[layout.index(None, 14)] = torch.zeros(1)  # e.g. scheduler tensors for > 256 sequences
    assert "expected None" in flash_fa4.match_layout(tuple(extra), layout, t)
    assert "arguments" in flash_fa4.match_layout(tuple(args[:-1]), layout, t)


class _Unsupported(AttentionBackend):
    name = "fake-unsupported"

    def unsupported_reason(self, spec, dtype, device, block_size):
        return "fake-unsupported runs nothing"


def test_fallback_chain_logs_one_reason(caplog, monkeypatch):
    """A backend that cannot run a configuration hands it on, logging its reason exactly once."""
    monkeypatch.setattr(registry, "_logged", set())
    caplog.set_level(logging.INFO, logger="compileattn")
    fake = _Unsupported("cpu")
    spec = AttentionSpec(4, 2, 32)
    chosen = {registry.resolve(fake, c) for c in
              (allocate_kv_caches({"l": spec}, 4, 16, torch.float32)["l"] for _ in range(3))}
    assert len(chosen) == 1 and fake not in chosen  # reference, or triton under TRITON_INTERPRET=1
    assert next(iter(chosen)).unsupported_reason(spec, torch.float32, torch.device("cpu"), 16) is None
    mine = [r for r in caplog.records if "fake-unsupported" in r.getMessage()]
    assert len(mine) == 1, [r.getMessage() for r in mine]
    assert "fake-unsupported runs nothing" in mine[0].getMessage()


@pytest.mark.skipif(_flash_importable(), reason="FlashAttention is importable here")
def test_flash_import_error_says_why():
    """Without FlashAttention the backend refuses to exist, naming both packages it tried."""
    with pytest.raises(ImportError, match="FlashAttention-4") as info:
        flash_mod.FlashBackend("cuda")
    assert "FlashAttention-2" in str(info.value)


# --------------------------------------------------------------------------------------------
# GPU: FlashAttention-4 against the reference.
# --------------------------------------------------------------------------------------------

def _fa4_backend(**kw):
    pytest.importorskip("flash_attn.cute", reason="FlashAttention-4 (flash_attn.cute) is not installed")
    backend = flash_mod.FlashBackend("cuda", impl="fa4", **kw)
    spec = AttentionSpec(8, 2, 128)
    reason = backend.unsupported_reason(spec, torch.bfloat16, torch.device("cuda"), 16)
    if reason is not None:
        pytest.skip(reason)
    return backend


TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}

MIXED = [(1, 37), (1, 200), (1, 0), (17, 0), (9, 50), (3, 120)]  # (query_len, context_len), decodes first
DECODE = [(1, 37), (1, 200), (1, 1), (1, 95), (1, 16)]


class _Case:
    """One layer, one step: caches filled with random history, a builder, a step's q/k/v."""

    def __init__(self, backend, dtype, heads, block_size, seqs, pad=3, window=-1, softcap=0.0, seed=0,
                 max_num_tokens=64, max_len=None, max_seqs=None, pad_to=None):
        self.dtype, self.block_size = dtype, block_size
        h, kvh = heads
        self.spec = AttentionSpec(h, kvh, 128, sliding_window=window, softcap=softcap)
        max_len = max_len or max(q + c for q, c in seqs)
        self.max_blocks = -(-max_len // block_size) + 1
        self.num_blocks = (max_seqs or len(seqs)) * self.max_blocks + 2
        torch.manual_seed(seed)
        self.cache = allocate_kv_caches({"l0": self.spec}, self.num_blocks, block_size, dtype, "cuda")["l0"]
        self.cache.key_cache.normal_()
        self.cache.value_cache.normal_()
        self.builder = AttentionMetadataBuilder(
            block_size=block_size, num_blocks=self.num_blocks, max_num_tokens=max_num_tokens,
            max_blocks_per_seq=self.max_blocks, device="cuda", backend=backend)
        self.backend = backend
        self.new_step(seqs, pad, seed, pad_to)

    def new_step(self, seqs, pad, seed, pad_to=None):
        rng = random.Random(seed)
        blocks = list(range(self.num_blocks))
        rng.shuffle(blocks)
        steps = []
        for q, c in seqs:
            need = -(-(q + c) // self.block_size)
            steps.append(SequenceStep(q, c, [blocks.pop() for _ in range(need)]))
        total = sum(q for q, _ in seqs)
        self.md = self.builder.build(steps, pad_to=pad_to if pad_to is not None else total + pad)
        t = self.md.num_tokens
        g = torch.Generator(device="cuda").manual_seed(seed)
        h, kvh, d = self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        self.q = torch.randn(t, h, d, device="cuda", dtype=self.dtype, generator=g)
        self.k = torch.randn(t, kvh, d, device="cuda", dtype=self.dtype, generator=g)
        self.v = torch.randn(t, kvh, d, device="cuda", dtype=self.dtype, generator=g)

    def reference(self):
        """(output, key_cache, value_cache) of the reference backend on copies of the caches."""
        ref = KVCache(self.cache.key_cache.clone(), self.cache.value_cache.clone(), self.spec)
        out = torch.full_like(self.q, float("nan"))
        ReferenceBackend("cuda").forward(self.q, self.k, self.v, out, ref, self.md)
        return out, ref.key_cache, ref.value_cache

    def run(self, out=None):
        out = torch.full_like(self.q, float("nan")) if out is None else out
        self.backend.forward(self.q, self.k, self.v, out, self.cache, self.md)
        return out

    def check(self, out, want):
        want_out, want_k, want_v = want
        torch.cuda.synchronize()
        assert torch.equal(self.cache.key_cache, want_k) and torch.equal(self.cache.value_cache, want_v)
        tol = TOL[self.dtype]
        torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
        pad = slice(self.md.num_actual_tokens, self.md.num_tokens)
        assert torch.count_nonzero(out[pad]) == 0  # padding rows attend to nothing


CASES = [  # (dtype, (heads, kv_heads), block_size, seqs): few distinct FA4 kernels, see module doc
    (torch.bfloat16, (8, 2), 16, MIXED),
    (torch.bfloat16, (8, 2), 16, DECODE),
    (torch.bfloat16, (8, 2), 64, MIXED),
    (torch.bfloat16, (8, 2), 128, MIXED),
    (torch.bfloat16, (8, 2), 128, DECODE),
    (torch.float16, (8, 2), 16, MIXED),
    (torch.float16, (8, 2), 64, DECODE),
    (torch.bfloat16, (8, 1), 16, MIXED),  # MQA
    (torch.bfloat16, (8, 1), 16, DECODE),
    (torch.bfloat16, (4, 4), 16, MIXED),  # MHA: no GQA packing
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,heads,block_size,seqs", CASES,
                         ids=[f"{str(c[0])[6:]}-{c[1][0]}x{c[1][1]}-bs{c[2]}-{'decode' if c[3] is DECODE else 'mixed'}"
                              for c in CASES])
def test_flash_matches_reference(dtype, heads, block_size, seqs, caplog):
    caplog.set_level(logging.WARNING, logger="compileattn")
    case = _Case(_fa4_backend(), dtype, heads, block_size, seqs)
    want = case.reference()
    case.check(case.run(), want)  # first call: learned through FA4's entry
    case.new_step(seqs, pad=1, seed=1)  # a new step binds the learned kernel to new metadata
    want = case.reference()
    case.check(case.run(), want)
    fn, _ = case.backend.prepared_call(case.md, case.cache)
    assert getattr(fn, "__func__", None) is not flash_fa4.FA4Impl.fwd_public, "direct FA4 call not in use"
    assert not [r for r in caplog.records if "direct call unavailable" in r.getMessage()]


@pytest.mark.cuda
@pytest.mark.parametrize("window,softcap", [(32, 0.0), (-1, 20.0)], ids=["window32", "softcap20"])
def test_flash_window_and_softcap(window, softcap):
    case = _Case(_fa4_backend(), torch.bfloat16, (8, 2), 16, MIXED, window=window, softcap=softcap)
    want = case.reference()
    case.check(case.run(), want)
    case.new_step(MIXED, pad=2, seed=3)
    want = case.reference()
    case.check(case.run(), want)


@pytest.mark.cuda
def test_call_modes_agree_bitwise():
    """The direct calls launch the very kernel FA4's entry launches, with the same arguments."""
    outs = {}
    for mode in ("public", "compiled"):
        case = _Case(_fa4_backend(call_mode=mode), torch.bfloat16, (8, 2), 16, MIXED, seed=5)
        want = case.reference()
        case.run()  # learns; writing the same K/V again leaves the caches as they are
        outs[mode] = case.run()
        case.check(outs[mode], want)
    assert torch.equal(outs["compiled"], outs["public"])


@pytest.mark.cuda
@pytest.mark.parametrize("kv_writer", ["torch", "auto"])
def test_cuda_graph_replay_with_new_metadata(kv_writer):
    """Captured once, replayed with new lengths, block tables and padding: still the reference."""
    backend = _fa4_backend(kv_writer=kv_writer)
    size = 8
    case = _Case(backend, torch.bfloat16, (8, 2), 16, DECODE, pad_to=size, max_len=320, max_seqs=size)
    static_q, static_k, static_v = case.q.clone(), case.k.clone(), case.v.clone()
    out = torch.zeros_like(static_q)
    for _ in range(2):  # warm up: learn and compile outside the capture
        backend.forward(static_q, static_k, static_v, out, case.cache, case.md)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(static_q, static_k, static_v, out, case.cache, case.md)
    rounds = [[(1, 300), (1, 7), (1, 64), (1, 65), (1, 1), (1, 150), (1, 33), (1, 2)],
              [(1, 5), (1, 180)],
              [(1, 128), (1, 17), (1, 96), (1, 250), (1, 3)]]
    for seed, seqs in enumerate(rounds, start=10):
        case.new_step(seqs, pad=0, seed=seed, pad_to=size)  # rewrites the persistent buffers
        assert case.md.num_tokens == size
        static_q.copy_(case.q), static_k.copy_(case.k), static_v.copy_(case.v)
        want = case.reference()
        out.fill_(float("nan"))
        graph.replay()
        case.check(out, want)


@pytest.mark.cuda
def test_unsupported_dtype_falls_back_with_one_log(caplog, monkeypatch):
    """float32 is not FA4's: the layer runs on the next backend, with one logged reason."""
    pytest.importorskip("flash_attn.cute", reason="FlashAttention-4 (flash_attn.cute) is not installed")
    monkeypatch.setattr(registry, "_logged", set())
    caplog.set_level(logging.INFO, logger="compileattn")
    flash = registry.get_backend("flash", "cuda")
    spec = AttentionSpec(8, 2, 128)
    caches = [allocate_kv_caches({"l": spec}, 8, 16, torch.float32, "cuda")["l"] for _ in range(2)]
    chosen = {registry.resolve(flash, c) for c in caches}
    assert len(chosen) == 1 and flash not in chosen
    mine = [r for r in caplog.records if "attention backend flash cannot run" in r.getMessage()]
    assert len(mine) == 1 and "float16/bfloat16" in mine[0].getMessage()
    # and the chosen backend really runs the layer
    builder = AttentionMetadataBuilder(block_size=16, num_blocks=8, max_num_tokens=16, max_blocks_per_seq=4,
                                       device="cuda", backend=flash)
    md = builder.build([SequenceStep(1, 20, [2, 5]), SequenceStep(3, 0, [1])], pad_to=5)
    q = torch.randn(5, 8, 128, device="cuda")
    k, v = torch.randn(5, 2, 128, device="cuda"), torch.randn(5, 2, 128, device="cuda")
    ref = KVCache(caches[0].key_cache.clone(), caches[0].value_cache.clone(), spec)
    want, out = torch.empty_like(q), torch.empty_like(q)
    ReferenceBackend("cuda").forward(q, k, v, want, ref, md)
    chosen.pop().forward(q, k, v, out, caches[0], md)
    torch.testing.assert_close(out, want, atol=5e-3, rtol=5e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_public_varlen_op(paged):
    """compileattn.flash_attn_varlen_func(backend="flash") through FA4's public entry."""
    import compileattn

    _fa4_backend()
    torch.manual_seed(7)
    lens_q, lens_k = [1, 5, 12], [40, 5, 70]
    h, kvh, d, bs = 8, 2, 128, 16
    q = torch.randn(sum(lens_q) + 2, h, d, device="cuda", dtype=torch.bfloat16)  # 2 rows past the last seq
    cu_q = torch.tensor([0, 1, 6, 18], dtype=torch.int32, device="cuda")
    used_k = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    if paged:
        k = torch.randn(20, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = torch.randperm(20, device="cuda")[:15].view(3, 5).to(torch.int32)
        kw = dict(block_table=table, seqused_k=used_k)
        cu_k = None
    else:
        k = torch.randn(sum(lens_k), kvh, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu_k = torch.tensor([0, 40, 45, 115], dtype=torch.int32, device="cuda")
        kw = {}
    args = (q, k, v, cu_q, cu_k, 12, 70)
    got = compileattn.flash_attn_varlen_func(*args, causal=True, backend="flash", **kw)
    want = compileattn.flash_attn_varlen_func(*args, causal=True, backend="reference", **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
