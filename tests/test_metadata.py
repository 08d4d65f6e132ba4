"""The per-step metadata builder and the forward context.

The builder is where all of a step's shape logic lives (so the per-layer op does none), and its
device tensors must stay at fixed addresses across steps (so a captured CUDA graph reads the next
step's metadata). Expected values here are computed independently: by hand for small cases, and
with the naive slot formula (tests/naive.py) for drawn ones.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compileattn
import naive
from compileattn import (AttentionMetadata, AttentionMetadataBuilder, AttentionSpec, KVCache, SequenceStep,
                         allocate_kv_caches, get_forward_context, set_forward_context)
from compileattn.backends.reference import ReferenceBackend

BS, NB = 4, 16


def builder(**over):
    kw = dict(block_size=BS, num_blocks=NB, max_num_tokens=32, max_blocks_per_seq=4, backend="reference")
    kw.update(over)
    return AttentionMetadataBuilder(**kw)


#: decode at position 5 (blocks 7, 2); prefill of 3 (block 4); chunk of 2 after 3 cached (blocks 1, 5).
SEQS = [SequenceStep(1, 5, [7, 2]), SequenceStep(3, 0, [4]), SequenceStep(2, 3, [1, 5])]


def test_slot_mapping_by_hand():
    md = builder().build(SEQS)
    # decode pos 5 -> block 2 offset 1; prefill pos 0..2 -> block 4; chunk pos 3, 4 -> block 1 off 3, block 5 off 0
    assert md.slot_mapping.tolist() == [2 * 4 + 1, 16, 17, 18, 1 * 4 + 3, 5 * 4 + 0]
    assert md.slot_mapping.dtype == torch.int64


def test_lengths_and_cu_seqlens():
    md = builder().build(SEQS)
    assert md.query_start_loc.tolist() == [0, 1, 4, 6]
    assert md.query_start_loc.dtype == torch.int32
    assert md.seq_lens.tolist() == [6, 3, 5] and md.seq_lens.dtype == torch.int32
    assert (md.max_query_len, md.max_seq_len) == (3, 6)
    assert (md.num_actual_tokens, md.num_tokens, md.num_actual_seqs, md.num_seqs) == (6, 6, 3, 3)
    assert md.block_size == BS
    assert md.block_table.dtype == torch.int32 and md.block_table.shape == (3, 4)
    assert md.block_table[:, :2].tolist() == [[7, 2], [4, 0], [1, 5]]


def test_token_counts_past_int32_are_refused_by_name():
    """seq_lens and query_start_loc are int32: a sequence of 2**31 tokens failed in torch.tensor
    naming nothing, and a step's cumulative query lengths (bounded by max_num_tokens) wrapped."""
    assert builder(max_num_tokens=2**31 - 1).max_num_tokens == 2**31 - 1  # buffers are made at the first build
    with pytest.raises(ValueError, match=r"^max_num_tokens must be at most 2147483647 \(2\*\*31 - 1\), got 2147483648"):
        builder(max_num_tokens=2**31)
    big = 2**16  # 2**15 blocks of 2**16 tokens: one sequence of 2**31
    long = builder(block_size=big, num_blocks=2**15 + 1, max_blocks_per_seq=2**15)
    with pytest.raises(ValueError, match=r"^seqs\[1\]: context_len 2147483647 \+ query_len 1 must be at most "
                                         r"2147483647 \(2\*\*31 - 1\), got 2147483648"):
        long.build([SequenceStep(1, 0, [2**15]), SequenceStep(1, 2**31 - 1, list(range(2**15)))])
    assert long.build([SequenceStep(1, 2**31 - 2, list(range(2**15)))]).max_seq_len == 2**31 - 1


def test_decode_prefill_split():
    md = builder().build([SequenceStep(1, 3, [0]), SequenceStep(1, 0, [3])] + SEQS[1:])
    assert (md.num_decodes, md.is_uniform_decode) == (2, False)
    md = builder().build([SequenceStep(1, 3, [0]), SequenceStep(1, 7, [1, 2])])
    assert (md.num_decodes, md.is_uniform_decode) == (2, True)
    md = builder().build([SequenceStep(4, 0, [0])])
    assert (md.num_decodes, md.is_uniform_decode) == (0, False)
    # Only the leading q_len == 1 run counts: a decode after a prefill is not in the decode part.
    md = builder().build([SequenceStep(1, 3, [0]), SequenceStep(3, 0, [1]), SequenceStep(1, 2, [2])])
    assert md.num_decodes == 1


def test_padding():
    md = builder().build(SEQS, pad_to=9)
    assert (md.num_actual_tokens, md.num_tokens, md.num_actual_seqs, md.num_seqs) == (6, 9, 3, 6)
    assert md.query_start_loc.diff().tolist() == [1, 3, 2, 1, 1, 1]
    assert md.seq_lens.tolist() == [6, 3, 5, 0, 0, 0]
    assert md.query_start_loc.tolist() == [0, 1, 4, 6, 7, 8, 9]
    assert md.slot_mapping.tolist()[6:] == [-1, -1, -1]
    assert md.slot_mapping.tolist()[:6] == builder().build(SEQS).slot_mapping.tolist()
    assert (md.max_query_len, md.max_seq_len) == (3, 6), "padding must not change the max lengths"
    assert md.num_decodes == 1 and md.num_actual_seqs == 3


def test_padding_writes_nowhere_and_outputs_zero():
    spec = AttentionSpec(4, 2, 64)
    caches = allocate_kv_caches({"l0": spec}, num_blocks=NB, block_size=BS, dtype=torch.float32)
    before_k = caches["l0"].key_cache.clone()
    md = builder().build(SEQS, pad_to=10)
    q = torch.randn(10, 4, 64)
    k, v = torch.randn(10, 2, 64), torch.randn(10, 2, 64)
    out = torch.full_like(q, float("nan"))
    with set_forward_context(md, caches):
        torch.ops.compileattn.attention(q, k, v, out, "l0")
    assert torch.equal(out[6:], torch.zeros(4, 4, 64))
    assert not out[:6].isnan().any()
    flat = caches["l0"].key_cache.view(-1, 2, 64)
    written = set(md.slot_mapping[:6].tolist())
    for s in range(flat.shape[0]):
        if s not in written:
            assert torch.equal(flat[s], before_k.view(-1, 2, 64)[s]), f"slot {s} was written by padding"
    for t, s in enumerate(md.slot_mapping[:6].tolist()):
        assert torch.equal(flat[s], k[t])


def test_persistent_buffers_keep_their_addresses():
    b = builder()
    first = b.build(SEQS, pad_to=8)
    ptrs = {n: getattr(first, n).data_ptr() for n in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")}
    second = b.build([SequenceStep(1, 9, [3, 8, 9]), SequenceStep(2, 0, [6])], pad_to=4)
    for n, p in ptrs.items():
        assert getattr(second, n).data_ptr() == p, f"{n} moved between steps"
    # ... and the second step's values are its own, not the first step's leftovers.
    assert second.query_start_loc.tolist() == [0, 1, 3, 4]
    assert second.seq_lens.tolist() == [10, 2, 0]
    assert second.slot_mapping.tolist() == [9 * 4 + 1, 24, 25, -1]
    assert second.block_table[:2, :3].tolist() == [[3, 8, 9], [6, 0, 0]]
    assert first.selector is second.selector


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_first_build_under_inference_mode_leaves_buffers_later_builds_outside_it_can_write(backend):
    """The buffers are made by the first build: under ``torch.inference_mode()`` (a warm-up step)
    they were inference tensors, and every later build under ``torch.no_grad()`` (or neither)
    raised "Inplace update to inference tensor outside InferenceMode"."""
    b = builder(backend=backend)
    with torch.inference_mode():
        b.build(SEQS, pad_to=8)
    with torch.no_grad():
        md = b.build([SequenceStep(1, 9, [3, 8, 9]), SequenceStep(2, 0, [6])], pad_to=4)
    assert md.slot_mapping.tolist() == [9 * 4 + 1, 24, 25, -1]
    assert b.build(SEQS).seq_lens.tolist() == [6, 3, 5]
    with torch.inference_mode():
        assert b.build(SEQS, pad_to=8).query_start_loc.tolist()[:4] == [0, 1, 4, 6]


def test_persistent_buffer_shape_conflict_raises():
    b = builder()
    b.buffers.get("x", (4,), torch.int32)
    with pytest.raises(RuntimeError, match="'x'"):
        b.buffers.get("x", (5,), torch.int32)


def test_call_table_is_prepared_once_per_step_shape(monkeypatch):
    """Entering a step resolves it into the selector's call table; a step shape seen before reuses
    the table (its calls read the same persistent buffers), a new shape prepares a new one."""
    prepared = []
    real = ReferenceBackend.prepare_attend
    monkeypatch.setattr(ReferenceBackend, "prepare_attend",
                        lambda self, *a: prepared.append(a[0]) or real(self, *a))
    spec = AttentionSpec(4, 2, 64)
    caches = allocate_kv_caches({"l0": spec, "l1": spec}, num_blocks=NB, block_size=BS, dtype=torch.float32)
    b = builder()
    with set_forward_context(b.build(SEQS, pad_to=8), caches) as first:
        pass
    assert len(prepared) == 2, "one prepared call per layer"
    with set_forward_context(b.build([SequenceStep(1, 9, [3, 8, 9]), SequenceStep(6, 0, [6, 10])], pad_to=8),
                             caches) as second:
        pass
    assert len(prepared) == 4, "max_query_len changed (3 -> 6): a new step shape"
    with set_forward_context(b.build(SEQS, pad_to=8), caches) as third:
        pass
    assert len(prepared) == 4 and third.table is first.table and second.table is not first.table


@st.composite
def drawn_steps(draw):
    n = draw(st.integers(1, 5))
    lens = [(draw(st.integers(1, 6)), draw(st.integers(0, 9))) for _ in range(n)]
    return lens, draw(st.integers(0, 4)), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=30, deadline=None)
@given(drawn=drawn_steps(), block_size=st.sampled_from([1, 2, 4, 16]))
def test_slot_mapping_matches_naive(drawn, block_size):
    lens, pad, seed = drawn
    totals = [q + c for q, c in lens]
    num_blocks = sum(-(-t // block_size) for t in totals) + 3
    tables = naive.assign_blocks(totals, block_size, num_blocks, random.Random(seed))
    b = builder(block_size=block_size, num_blocks=num_blocks, max_num_tokens=64,
                max_blocks_per_seq=max(len(t) for t in tables))
    md = b.build([SequenceStep(q, c, t) for (q, c), t in zip(lens, tables)], pad_to=sum(q for q, _ in lens) + pad)
    want = [naive.slot_of(t, p, block_size) for (q, c), t in zip(lens, tables) for p in range(c, c + q)]
    assert md.slot_mapping.tolist() == want + [-1] * pad
    assert md.query_start_loc.tolist() == naive.cu_seqlens([q for q, _ in lens] + [1] * pad).tolist()
    assert md.seq_lens.tolist() == totals + [0] * pad


# ---------------------------------------------------------------- forward context

def _caches(block_size=BS, device="cpu"):
    spec = AttentionSpec(4, 2, 64)
    return {"l0": KVCache(torch.zeros(NB, block_size, 2, 64, device=device),
                          torch.zeros(NB, block_size, 2, 64, device=device), spec)}


def test_forward_context_is_scoped_and_nests():
    md1, md2 = builder().build(SEQS), builder().build(SEQS[:1])
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()
    with set_forward_context(md1, _caches()) as ctx1:
        assert get_forward_context() is ctx1 and ctx1.metadata is md1
        with set_forward_context(md2, _caches()):
            assert get_forward_context().metadata is md2
        assert get_forward_context() is ctx1
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()


def test_metadata_overwritten_by_a_later_build_is_refused():
    """Every build writes the builder's persistent buffers; an earlier step's metadata views them
    too, so running it would read the later step's slots and lengths."""
    b = builder()
    caches = allocate_kv_caches({"layer0": AttentionSpec(2, 2, 64)}, NB, BS, torch.float32)
    first = b.build([SequenceStep(3, 0, [0])])
    second = b.build([SequenceStep(1, 5, [1, 2])])
    with pytest.raises(ValueError, match=r"later build\(\) of the same AttentionMetadataBuilder"):
        with set_forward_context(first, caches):
            pass
    with set_forward_context(second, caches):
        assert get_forward_context().metadata is second


def test_a_build_inside_the_context_of_its_builders_step_is_refused():
    """The step's layers still to run read the builder's persistent buffers: a build there would
    make them write and read another step's slots (same token count, so no shape check notices)."""
    b = builder()
    caches = _caches()
    q, k, v = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    out = torch.empty_like(q)
    with set_forward_context(b.build([SequenceStep(3, 0, [0])]), caches):
        with pytest.raises(RuntimeError, match=r"build\(\) inside set_forward_context"):
            b.build([SequenceStep(1, 0, [5]), SequenceStep(2, 0, [6])])
        torch.ops.compileattn.attention(q, k, v, out, "l0")
        builder().build(SEQS)  # another builder's buffers: free
    assert caches["l0"].key_cache[0, :3].equal(k) and not caches["l0"].key_cache[5:7].any()
    b.build(SEQS)  # after the context: the next step


def test_forward_context_restored_after_an_exception():
    with pytest.raises(KeyError):
        with set_forward_context(builder().build(SEQS), _caches()):
            raise KeyError("boom")
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_forward_context_block_size_mismatch():
    with pytest.raises(ValueError, match=r"kv_caches\['l0'\] has block_size 8, metadata has 4"):
        with set_forward_context(builder().build(SEQS), _caches(block_size=8)):
            pass


def test_forward_context_device_mismatch():
    with pytest.raises(ValueError, match=r"kv_caches\['l0'\] is on meta, metadata on cpu"):
        with set_forward_context(builder().build(SEQS), _caches(device="meta")):
            pass


def test_forward_context_type_checks():
    with pytest.raises(TypeError, match="metadata"):
        with set_forward_context("not metadata", _caches()):
            pass
    with pytest.raises(TypeError, match=r"kv_caches\['l0'\]"):
        with set_forward_context(builder().build(SEQS), {"l0": torch.zeros(NB, BS, 2, 64)}):
            pass


@pytest.mark.parametrize("kv_caches", [None, "l0", ("l0",), "list", "cache"])
def test_forward_context_refuses_kv_caches_that_are_not_a_mapping(kv_caches):
    """A list of caches, a bare KVCache, a tuple of names: a TypeError naming ``kv_caches``, not
    the AttributeError or "not iterable" of looking its entries up."""
    cache = _caches()["l0"]
    kv_caches = {"list": [cache], "cache": cache}.get(kv_caches, kv_caches)
    b = builder()
    with pytest.raises(TypeError, match="^kv_caches must be a mapping of layer name -> KVCache"):
        with set_forward_context(b.build(SEQS), kv_caches):
            pass
    assert b.buffers.in_use == 0


def test_public_names():
    assert compileattn.AttentionMetadata is AttentionMetadata
    assert isinstance(builder().build(SEQS), AttentionMetadata)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_cache_replaced_in_the_same_mapping_is_the_one_the_next_step_uses(backend):
    """Steps reuse prepared calls per step shape and mapping; a layer's KVCache replaced in the
    mapping (frozen: new tensors mean a new KVCache) must be what the next step writes and reads,
    not the old one the prepared calls were bound to."""
    dtype = torch.float16 if backend == "triton" else torch.float32
    spec = AttentionSpec(4, 2, 32)
    caches = allocate_kv_caches({"L": spec}, num_blocks=8, block_size=4, dtype=dtype)
    builder = AttentionMetadataBuilder(block_size=4, num_blocks=8, max_num_tokens=16, max_blocks_per_seq=4,
                                          backend=backend)

    def step():
        md = builder.build([SequenceStep(1, 5, [1, 2])])  # a decode at position 5, blocks 1 and 2
        q, k, v = (torch.randn(1, h, 32, dtype=dtype) for h in (4, 2, 2))
        out = torch.empty_like(q)
        with set_forward_context(md, caches):
            torch.ops.compileattn.attention(q, k, v, out, "L")
        c = caches["L"]
        kk = torch.cat([c.key_cache[1], c.key_cache[2]])[:6].double().repeat_interleave(2, 1)
        vv = torch.cat([c.value_cache[1], c.value_cache[2]])[:6].double().repeat_interleave(2, 1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[0].double(), kk) * spec.scale, -1)
        torch.testing.assert_close(out[0].double(), torch.einsum("hn,nhd->hd", probs, vv), atol=2e-3, rtol=2e-3)

    torch.manual_seed(0)
    step()
    new = allocate_kv_caches({"L": spec}, num_blocks=8, block_size=4, dtype=dtype)["L"]
    new.key_cache.normal_()
    new.value_cache.normal_()
    caches["L"] = new
    step()
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.key_cache = torch.zeros_like(new.key_cache)
