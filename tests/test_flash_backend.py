"""The ``flash`` backend: FlashAttention-4 on the GPU against the reference, CUDA-graph replay,
fallback with one logged reason; and, everywhere, the capturable torch KV writer, FA4's argument
layout check, its refusals (with a faked FA4 and GPU) and the fallback chain.

GPU tests need ``flash_attn.cute`` (FA4): on the GPU machine ``source .device/flash-attn-4.sh``
first (see ``../shared/device/pack-flash-attn-4``). Each distinct FA4 kernel configuration is
JIT-compiled on first use, so the GPU matrix below is chosen to need few of them (page sizes 16 and
64 share a kernel; 128 uses the TMA one).
"""
from __future__ import annotations

import logging
import random
import types

import fa4_sm90
from fake_flash import RecordingFA2Extension
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compileattn import set_forward_context
from compileattn.backends import flash_fa4, selector
from compileattn.backends.base import AttentionBackend
from compileattn.backends.kv_write import write_kv_masked, write_kv_padded
from compileattn.kv_cache import AttentionSpec, KVCache, allocate_kv_caches
from compileattn.metadata import AttentionMetadataBuilder, SequenceStep


def _flash_importable() -> bool:
    try:
        selector.get_backend("flash", "cuda")
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# Everywhere (CPU): the capturable torch writer, the argument-layout check, refusals, fallback.
# --------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.data())
def test_padded_writer_matches_masked_writer(n, data):
    """Slot -1 anywhere (including every slot) writes nothing; real slots get their token's rows."""
    num_blocks, bs = 4, 4
    real = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    chosen = data.draw(st.permutations(list(range(num_blocks * bs))))[:n]
    slots = torch.tensor([s if r else -1 for s, r in zip(chosen, real)], dtype=torch.int64)
    g = torch.Generator().manual_seed(n)
    key, value = torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    kc, vc = torch.randn(num_blocks, bs, 2, 8, generator=g), torch.randn(num_blocks, bs, 2, 8, generator=g)
    want_k, want_v = kc.clone(), vc.clone()
    write_kv_masked(key, value, want_k, want_v, slots)
    write_kv_padded(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("num_pad", [0, 1, 5])
def test_step_indexed_writer_matches_masked_writer(num_pad):
    """The CUDA torch writer of a builder-made step: indices refreshed once per step (padding after
    the real tokens repeats token 0's write), two index_copy_ per layer; the masked writer's cache."""
    from compileattn.backends.kv_write import StepWriteIndices, prepare_torch_write

    bs = 4
    builder = AttentionMetadataBuilder(block_size=bs, num_blocks=16, max_num_tokens=32, max_blocks_per_seq=4)
    g = torch.Generator().manual_seed(num_pad)
    kc, vc = torch.randn(16, bs, 2, 8, generator=g), torch.randn(16, bs, 2, 8, generator=g)
    indices = None
    for seqs in ([SequenceStep(1, 6, [3, 9]), SequenceStep(1, 0, [5]), SequenceStep(5, 2, [0, 12])],
                 [SequenceStep(2, 0, [7]), SequenceStep(4, 1, [1, 2]), SequenceStep(1, 3, [4])]):
        md = builder.build(seqs, pad_to=7 + num_pad)
        if indices is None:  # made once per step shape, refreshed every step
            indices = StepWriteIndices(md.num_tokens, md.tensors, md.selector.buffers)
        indices.refresh()
        key, value = torch.randn(md.num_tokens, 2, 8, generator=g), torch.randn(md.num_tokens, 2, 8, generator=g)
        want_k, want_v = kc.clone(), vc.clone()
        write_kv_masked(key, value, want_k, want_v, md.slot_mapping)
        prepare_torch_write(kc, vc, indices, md.slot_mapping)(key, value)
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


def _faked_fa4(arch: int) -> flash_fa4.FA4Backend:
    """An FA4Backend over a stand-in of FA4's tile choice, on a GPU of ``arch`` (no FA4, no GPU)."""
    backend = flash_fa4.FA4Backend.__new__(flash_fa4.FA4Backend)
    backend.device_type = "cuda"
    backend.fa = fa4_sm90.faked_interface()
    backend._arch = {0: arch}
    return backend


# (head_dim, causal, window, block_size) -> refused? On SM90 the row-wave page loader overruns
# tiles its wave does not divide (hd 80/96 non-causal: tile 144; hd 160: tile 112).
SM90_PAGED = [
    (96, False, -1, 16, True), (96, False, -1, 256, True), (96, True, -1, 16, False), (96, False, 64, 16, False),
    (80, False, -1, 64, True), (80, True, -1, 64, False), (160, True, -1, 16, True), (160, False, 64, 16, False),
    (64, False, -1, 16, False), (128, False, -1, 16, False), (192, False, -1, 16, False), (256, False, -1, 16, False),
    (96, False, -1, 144, False),  # the page is the tile: TMA loads
    (96, False, -1, 0, False),  # contiguous K/V
]


@pytest.mark.parametrize("head_dim,causal,window,block_size,refused", SM90_PAGED)
def test_fa4_refuses_exactly_the_sm90_paged_loader_overruns(head_dim, causal, window, block_size, refused):
    backend = _faked_fa4(90)
    spec = AttentionSpec(8, 2, head_dim, sliding_window=window, causal=causal)
    reason = backend.unsupported_reason(spec, torch.bfloat16, torch.device("cuda", 0), block_size)
    assert (reason is not None) == refused, reason
    assert refused == fa4_sm90.paged_loader_overruns(head_dim, causal, window, block_size)
    if refused:
        assert "wrong results for paged KV" in reason


@pytest.mark.parametrize("dtype,arch,head_dim,reason", [
    (torch.float32, 90, 128, "float16/bfloat16 only"),
    (torch.bfloat16, 80, 128, "paged KV only on SM90"),
    (torch.bfloat16, 120, 128, "paged KV only on SM90"),
    (torch.bfloat16, 100, 192, "head_dim <= 128 or 256"),
])
def test_fa4_refusals_by_dtype_arch_and_head_dim(dtype, arch, head_dim, reason):
    backend = _faked_fa4(arch)
    got = backend.unsupported_reason(AttentionSpec(8, 2, head_dim), dtype, torch.device("cuda", 0), 16)
    assert got is not None and reason in got
    if dtype == torch.bfloat16 and arch in (90, 100):
        assert backend.unsupported_reason(AttentionSpec(8, 2, 128), dtype, torch.device("cuda", 0), 16) is None


def test_fa4_refuses_paged_kv_when_its_tile_choice_is_unknown():
    backend = _faked_fa4(90)
    backend.fa = types.SimpleNamespace()  # another FA4 version: no _tile_size_fwd_sm90
    reason = backend.unsupported_reason(AttentionSpec(8, 2, 128), torch.bfloat16, torch.device("cuda", 0), 16)
    assert reason is not None and "cannot tell which K/V tile" in reason
    assert backend.unsupported_reason(AttentionSpec(8, 2, 128), torch.bfloat16, torch.device("cuda", 0), 0) is None


def _fa4_entry_on_two_gpus(monkeypatch, archs: dict[int, int]):
    """A stand-in for FA4's ``_flash_attn_fwd`` on a host whose CUDA device ``i`` is SM ``archs[i]``
    (current device faked, no GPU): like FA4 it compiles per arch into ``compile_cache`` and calls
    the kernel with the argument tuple of ``ARG_LAYOUTS``. Returns (entry, the current device as a
    one-item list, kernel calls as (arch, args))."""
    current, calls = [0], []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: divmod(archs[current[0] if device is None else device], 10))

    def kernel_for(arch):
        def kernel(*args):
            calls.append((arch, args))
        return kernel

    def _flash_attn_fwd(q, k, v, cu_seqlens_q=None, seqused_k=None, max_seqlen_q=None, page_table=None,
                        softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
                        window_size_right=None, num_splits=1, out=None):
        arch = archs[current[0]]
        role = {"q": q, "k": k, "v": v, "out": out, "cu_q": cu_seqlens_q, "used_k": seqused_k,
                "table": page_table, "max_q": max_seqlen_q, "const": softmax_scale, None: None}
        args = tuple(role[r] for r in flash_fa4.ARG_LAYOUTS[arch // 10])
        key = (arch, q.dtype, max_seqlen_q)
        if key not in _flash_attn_fwd.compile_cache:
            _flash_attn_fwd.compile_cache[key] = kernel_for(arch)
        _flash_attn_fwd.compile_cache[key](*args)

    _flash_attn_fwd.compile_cache = {}
    monkeypatch.setattr(flash_fa4, "load", lambda: types.SimpleNamespace(_flash_attn_fwd=_flash_attn_fwd))
    return _flash_attn_fwd, current, calls


def test_fa4_templates_are_per_arch_and_hold_no_tensors(monkeypatch):
    """A process driving an SM90 and an SM100 GPU learns a template per arch (each calls its own
    arch's kernel with its own layout), and the templates keep no tensor: not the learning step's
    metadata buffers (each step binds its own), nor the learning call's scratch."""
    from compileattn.backends.base import PersistentBuffers, StepShape, StepTensors

    _, current, calls = _fa4_entry_on_two_gpus(monkeypatch, {0: 90, 1: 100})
    backend = flash_fa4.FA4Backend("cuda")
    spec, shape = AttentionSpec(8, 2, 128), StepShape(2, 2, 16, 1, True)
    cache = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)

    def step():
        return StepTensors(torch.arange(3, dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32),
                           torch.tensor([[0], [2]], dtype=torch.int32), torch.zeros(2, dtype=torch.int64))

    for device, arch in ((0, 90), (1, 100)):
        current[0] = device
        tensors = step()
        attend = backend.prepare_attend(shape, tensors, spec, torch.bfloat16, cache, cache,
                                        PersistentBuffers(torch.device("cpu")))
        calls.clear()
        attend(q, torch.empty_like(q))
        (called_arch, args), = calls
        assert called_arch == arch and len(args) == len(flash_fa4.ARG_LAYOUTS[arch // 10])
        assert args[6] is tensors.query_start_loc and args[9] is tensors.seq_lens and args[10] is tensors.block_table
    templates = [t for t in backend._templates.values() if t is not None]
    assert len(templates) == 2
    assert not [a for t in templates for a in t.tail if isinstance(a, torch.Tensor)]


def _fa2_visible(args: tuple, seq: int, lq: int, lk: int) -> torch.Tensor:
    """(lq, lk) bool: the keys each query row of sequence ``seq`` sees in FlashAttention-2 given
    these ``varlen_fwd`` arguments. Its window handling restated from flash-attn 2.6-2.8
    (``csrc/flash_attn/flash_api.cpp``: ``mha_varlen_fwd``, ``set_params_fprop``; ``src/mask.h``)."""
    max_q, max_k, causal, left, right, alibi = args[10], args[11], args[15], args[16], args[17], args[9]
    if max_q == 1 and alibi is None:
        causal = False
    if causal:
        right = 0
    left = -1 if left >= max_k else left
    right = -1 if right >= max_k else right
    is_causal = left < 0 and right == 0
    if left < 0 and right >= 0:
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    local = (left >= 0 or right >= 0) and not is_causal
    row = torch.arange(lq).unsqueeze(1)
    col = torch.arange(lk).unsqueeze(0)
    if is_causal:
        return col < torch.clamp(row + 1 + lk - lq, max=lk)
    if local:
        return ((col < torch.clamp(row + 1 + lk - lq + right, max=lk))
                & (col >= torch.clamp(row + lk - lq - left, min=0)))
    return torch.ones(lq, lk, dtype=torch.bool)


@pytest.mark.parametrize("causal,window,lens", [
    # more queries than max_seqlen_k + 1: the first rows sit far left of the last keys
    (False, 2, [(6, 4), (3, 3)]), (False, 1, [(8, 2)]),
    (False, 2, [(3, 5), (1, 4)]),
    (False, 0, [(4, 4)]),
    (False, -1, [(6, 4), (2, 3)]),
    (True, 2, [(3, 5), (2, 2)]),
    (True, -1, [(6, 4), (3, 5)]),
    (True, 1, [(1, 4), (1, 2)]),  # decode: FlashAttention-2 drops causal for one query
])
def test_fa2_window_arguments_mask_what_the_reference_does(monkeypatch, causal, window, lens):
    """The window FlashAttention-2 derives from the arguments the backend passes hides exactly the
    keys the reference hides: with a uniform softmax (zero queries) over one-hot values, a
    reference output entry is positive where its row sees that key."""
    from compileattn.backends import flash_fa2
    from compileattn.backends.reference import ReferenceBackend

    ext = RecordingFA2Extension()
    monkeypatch.setattr(flash_fa2, "load", lambda: (ext, "2.7.4"))
    backend = flash_fa2.FA2Backend("cuda")
    cu_q = torch.tensor([0] + [sum(q for q, _ in lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(k for _, k in lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    d = 8
    q = torch.zeros(int(cu_q[-1]), 1, d)
    k = torch.zeros(int(cu_k[-1]), 1, d)
    v = torch.zeros_like(k)
    for i, (_, lk) in enumerate(lens):
        v[int(cu_k[i]) + torch.arange(lk), 0, torch.arange(lk)] = 1.0
    args = (cu_q, cu_k, None, None, max(q for q, _ in lens), max(k for _, k in lens), 1.0, causal, window, 0.0)
    backend.varlen_attention(q, k, v, torch.empty_like(q), *args)
    sent = ext.calls[-1]
    assert sent[17] == (0 if causal else -1)
    want = torch.zeros_like(q)
    ReferenceBackend("cpu").varlen_attention(q, k, v, want, *args)
    for i, (lq, lk) in enumerate(lens):
        sees = want[int(cu_q[i]): int(cu_q[i + 1]), 0, :lk] > 0
        assert torch.equal(_fa2_visible(sent, i, lq, lk), sees), (i, _fa2_visible(sent, i, lq, lk), sees)


class _Unsupported(AttentionBackend):
    name = "fake-unsupported"

    def unsupported_reason(self, spec, dtype, device, block_size, cache_dtype=None):
        return "fake-unsupported runs nothing"


def test_fallback_chain_logs_one_reason(caplog, monkeypatch):
    """A backend that cannot run a configuration hands it on, logging its reason exactly once."""
    monkeypatch.setattr(selector, "_logged", set())
    caplog.set_level(logging.INFO, logger="compileattn")
    fake = _Unsupported("cpu")
    spec = AttentionSpec(4, 2, 32)
    chosen = {selector.choose(fake, spec, torch.float32, torch.device("cpu"), 16, "cpu") for _ in range(3)}
    assert len(chosen) == 1 and fake not in chosen
    assert next(iter(chosen)).name == "triton"  # next in FALLBACK_ORDER; runs under TRITON_INTERPRET=1
    mine = [r for r in caplog.records if "fake-unsupported" in r.getMessage()]
    assert len(mine) == 1, [r.getMessage() for r in mine]
    assert "fake-unsupported runs nothing" in mine[0].getMessage()


@pytest.mark.skipif(_flash_importable(), reason="FlashAttention is importable here")
def test_flash_import_error_says_why():
    """Without FlashAttention the backend refuses to exist, naming both packages it tried."""
    with pytest.raises(ImportError, match="FlashAttention-4") as info:
        selector.get_backend("flash", "cuda")
    assert "FlashAttention-2" in str(info.value)


# --------------------------------------------------------------------------------------------
# GPU: FlashAttention-4 against the reference.
# --------------------------------------------------------------------------------------------

def _fa4_backend():
    pytest.importorskip("flash_attn.cute", reason="FlashAttention-4 (flash_attn.cute) is not installed")
    backend = selector.get_backend("flash", "cuda")
    assert isinstance(backend, flash_fa4.FA4Backend)
    spec = AttentionSpec(8, 2, 128)
    reason = backend.unsupported_reason(spec, torch.bfloat16, torch.device("cuda"), 16)
    if reason is not None:
        pytest.skip(reason)
    return backend


def _layer_forward(md, cache, q, k, v, out):
    """One layer of one step through the unified op (the selector's KV write, then attention);
    returns the step's call table."""
    with set_forward_context(md, {"l0": cache}) as ctx:
        torch.ops.compileattn.attention(q, k, v, out, "l0")
    return ctx.table


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
        self.steps = steps
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
        ref_builder = AttentionMetadataBuilder(block_size=self.block_size, num_blocks=self.num_blocks,
                                               max_num_tokens=self.builder.max_num_tokens,
                                               max_blocks_per_seq=self.max_blocks, device="cuda", backend="reference")
        _layer_forward(ref_builder.build(self.steps, pad_to=self.md.num_tokens), ref, self.q, self.k, self.v, out)
        return out, ref.key_cache, ref.value_cache

    def run(self, out=None):
        out = torch.full_like(self.q, float("nan")) if out is None else out
        self.table = _layer_forward(self.md, self.cache, self.q, self.k, self.v, out)
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
    assert case.table.backends["l0"] is case.backend
    assert case.table.attend["l0"].__name__ == "attend", "the direct FA4 call is not in use"
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
def test_direct_call_equals_fa4_entry_bitwise():
    """The prepared call launches the very kernel FA4's entry launches, with the same arguments."""
    case = _Case(_fa4_backend(), torch.bfloat16, (8, 2), 16, MIXED, seed=5)
    want = case.reference()
    direct = case.run()
    case.check(direct, want)
    public = torch.full_like(direct, float("nan"))
    md, spec = case.md, case.spec
    case.backend.fwd_public(case.q, case.cache.key_cache, case.cache.value_cache, public, md.query_start_loc,
                            md.seq_lens, md.block_table, md.max_query_len, spec.scale, spec.causal,
                            spec.sliding_window, spec.softcap)
    n = md.num_actual_tokens
    assert torch.equal(direct[:n], public[:n])


@pytest.mark.cuda
@pytest.mark.parametrize("kv_writer", ["torch", "triton"])
def test_cuda_graph_replay_with_new_metadata(kv_writer, monkeypatch):
    """Captured once, replayed with new lengths, block tables and padding: still the reference."""
    backend = _fa4_backend()
    if kv_writer == "torch":
        monkeypatch.setattr(selector, "_triton_writes", lambda *a: False)
    size = 8
    case = _Case(backend, torch.bfloat16, (8, 2), 16, DECODE, pad_to=size, max_len=320, max_seqs=size)
    static_q, static_k, static_v = case.q.clone(), case.k.clone(), case.v.clone()
    out = torch.zeros_like(static_q)
    for _ in range(2):  # warm up: learn and compile outside the capture
        _layer_forward(case.md, case.cache, static_q, static_k, static_v, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        table = _layer_forward(case.md, case.cache, static_q, static_k, static_v, out)
    assert (table.write["l0"].__qualname__ == "prepare_torch_write.<locals>.write_indexed") == (kv_writer == "torch")
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
    _fa4_backend()
    monkeypatch.setattr(selector, "_logged", set())
    caplog.set_level(logging.INFO, logger="compileattn")
    spec = AttentionSpec(8, 2, 128)
    cache = allocate_kv_caches({"l0": spec}, 8, 16, torch.float32, "cuda")["l0"]
    cache.key_cache.normal_(), cache.value_cache.normal_()
    steps = [SequenceStep(1, 20, [2, 5]), SequenceStep(3, 0, [1])]
    q = torch.randn(5, 8, 128, device="cuda")
    k, v = torch.randn(5, 2, 128, device="cuda"), torch.randn(5, 2, 128, device="cuda")
    outs = {}
    for name in ("flash", "reference"):
        builder = AttentionMetadataBuilder(block_size=16, num_blocks=8, max_num_tokens=16, max_blocks_per_seq=4,
                                           device="cuda", backend=name)
        c = KVCache(cache.key_cache.clone(), cache.value_cache.clone(), spec)
        outs[name] = torch.empty_like(q)
        table = _layer_forward(builder.build(steps, pad_to=5), c, q, k, v, outs[name])
        if name == "flash":
            assert table.backends["l0"].name == "triton"
    mine = [r for r in caplog.records if "attention backend flash cannot run" in r.getMessage()]
    assert len(mine) == 1 and "float16/bfloat16" in mine[0].getMessage()
    torch.testing.assert_close(outs["flash"], outs["reference"], atol=5e-3, rtol=5e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_public_varlen_op(paged):
    """compileattn.flash_attn_varlen_func(backend="flash") through FA4's public entry."""
    import compileattn

    _fa4_backend()
    torch.manual_seed(7)
    lens_q, lens_k = [1, 5, 12], [40, 5, 70]
    h, kvh, d, bs = 8, 2, 128, 16
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.bfloat16)
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
