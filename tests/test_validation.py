"""Bad input raises ValueError/TypeError naming the argument, before any kernel runs.

Every test here runs with the reference backend's kernels (and its per-step ``plan``) replaced by
functions that raise ``AssertionError``: a check that fires too late, after a kernel started,
shows up as that AssertionError instead of the expected ValueError/TypeError. ``test_kernels_are_
really_patched`` proves the patch is live, so the other tests cannot pass vacuously. A second
device is emulated with the ``meta`` device, which has no kernels of its own to run either.
"""
from __future__ import annotations

import pytest
import torch

import compileattn
from compileattn import AttentionMetadataBuilder, AttentionSpec, KVCache, SequenceStep, allocate_kv_caches, set_forward_context
from compileattn.backends import selector
from compileattn.backends.reference import ReferenceBackend

NB, BS, H, KVH, D = 6, 4, 4, 2, 64


class KernelRan(AssertionError):
    pass


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    def ran(*args, **kwargs):
        raise KernelRan("a kernel ran before the input was rejected")

    for name in ("varlen_attention", "prepare_attend"):
        monkeypatch.setattr(ReferenceBackend, name, ran)
    for name in ("run_varlen", "run_write"):
        monkeypatch.setattr(selector, name, ran)


def i32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def contiguous(**over):
    """Valid contiguous-K/V arguments (two sequences: 3 queries over 5 keys, 1 over 4), overridable."""
    args = dict(q=torch.randn(4, H, D), k=torch.randn(9, KVH, D), v=torch.randn(9, KVH, D),
                cu_seqlens_q=i32([0, 3, 4]), cu_seqlens_k=i32([0, 5, 9]), max_seqlen_q=3, max_seqlen_k=5)
    args.update(over)
    return args


def paged(**over):
    """Valid paged arguments: two sequences of 5 and 4 keys in blocks of 4."""
    args = dict(q=torch.randn(4, H, D), k=torch.randn(NB, BS, KVH, D), v=torch.randn(NB, BS, KVH, D),
                cu_seqlens_q=i32([0, 3, 4]), cu_seqlens_k=None, max_seqlen_q=3, max_seqlen_k=5,
                block_table=i32([[2, 0], [5, 1]]), seqused_k=i32([5, 4]))
    args.update(over)
    return args


def call(args, **kw):
    a = dict(args)
    pos = [a.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    return compileattn.flash_attn_varlen_func(*pos, causal=True, **a, **kw)


def kv_write(**over):
    args = dict(key=torch.randn(3, KVH, D), value=torch.randn(3, KVH, D),
                key_cache=torch.zeros(NB, BS, KVH, D), value_cache=torch.zeros(NB, BS, KVH, D),
                slot_mapping=torch.tensor([0, 7, -1]))
    args.update(over)
    return args


def builder(**over):
    kw = dict(block_size=BS, num_blocks=NB, max_num_tokens=16, max_blocks_per_seq=3, backend="reference")
    kw.update(over)
    return AttentionMetadataBuilder(**kw)


def test_kernels_are_really_patched():
    for args in (contiguous(), paged()):
        with pytest.raises(KernelRan):
            call(args)
    with pytest.raises(KernelRan):
        compileattn.write_kv_cache(**kv_write())
    caches = allocate_kv_caches({"l0": AttentionSpec(4, 2, 32)}, NB, BS, torch.float32)
    with pytest.raises(KernelRan), set_forward_context(builder().build([SequenceStep(1, 4, [0, 1])]), caches):
        pass


# ---------------------------------------------------------------- heads

@pytest.mark.parametrize("make", [contiguous, paged])
@pytest.mark.parametrize("q_heads,kv_heads", [(6, 4), (2, 4), (4, 3)])
def test_heads_not_divisible_by_kv_heads(make, q_heads, kv_heads):
    kshape = (9, kv_heads, D) if make is contiguous else (NB, BS, kv_heads, D)
    args = make(q=torch.randn(4, q_heads, D), k=torch.randn(kshape), v=torch.randn(kshape),
                out=torch.empty(4, q_heads, D))
    with pytest.raises(ValueError, match=rf"^q has {q_heads} heads, not a multiple of the {kv_heads} kv heads"):
        call(args)


def test_spec_heads_not_divisible():
    with pytest.raises(ValueError, match="num_kv_heads"):
        AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=D)
    with pytest.raises(ValueError, match="num_kv_heads"):
        AttentionSpec(num_heads=4, num_kv_heads=0, head_dim=D)


# ---------------------------------------------------------------- dtypes

@pytest.mark.parametrize("name", ["k", "v", "out"])
def test_varlen_dtype_mismatch(name):
    args = paged()
    t = args.get(name, torch.randn(4, H, D))
    args[name] = t.half()
    with pytest.raises(TypeError, match=rf"^{name} has dtype"):
        call(args)


def test_varlen_unsupported_dtype():
    args = contiguous()
    for n in ("q", "k", "v"):
        args[n] = args[n].double()
    with pytest.raises(TypeError, match="^q has dtype"):
        call(args)


@pytest.mark.parametrize("name", ["cu_seqlens_q", "seqused_k", "block_table"])
def test_varlen_index_dtype(name):
    args = paged()
    args[name] = args[name].long()
    with pytest.raises(TypeError, match=f"^{name} must be int32"):
        call(args)


@pytest.mark.parametrize("name", ["value", "key_cache", "value_cache"])
def test_write_kv_cache_dtype_mismatch(name):
    args = kv_write()
    args[name] = args[name].half()
    with pytest.raises(TypeError, match=f"^{name} has dtype"):
        compileattn.write_kv_cache(**args)


@pytest.mark.parametrize("name", ["key", "value", "key_cache", "value_cache", "slot_mapping"])
def test_write_kv_cache_argument_not_a_tensor(name):
    with pytest.raises(TypeError, match=f"^{name} must be a tensor, got list"):
        compileattn.write_kv_cache(**kv_write(**{name: [0]}))


def test_write_kv_cache_unsupported_dtypes():
    """key's dtype is checked against the supported ones, not only against the caches' (all
    float64 agree with each other); a cache dtype that is neither key's nor float8_e4m3fn is
    named as unsupported, float8_e5m2 included."""
    args = {name: t.double() for name, t in kv_write().items() if name != "slot_mapping"}
    with pytest.raises(TypeError, match=r"^key has dtype torch\.float64; supported"):
        compileattn.write_kv_cache(**kv_write(**args))
    e5m2 = torch.zeros(NB, BS, KVH, D, dtype=torch.float8_e5m2)
    with pytest.raises(TypeError, match=r"^key_cache has dtype torch\.float8_e5m2; supported"):
        compileattn.write_kv_cache(**kv_write(key_cache=e5m2, value_cache=e5m2.clone()))


def test_write_kv_cache_slot_mapping_dtype():
    with pytest.raises(TypeError, match="slot_mapping"):
        compileattn.write_kv_cache(**kv_write(slot_mapping=torch.tensor([0, 7, -1], dtype=torch.int32)))


def test_kv_cache_dtype_mismatch():
    spec = AttentionSpec(H, KVH, D)
    with pytest.raises(TypeError, match="value_cache"):
        KVCache(torch.zeros(NB, BS, KVH, D), torch.zeros(NB, BS, KVH, D, dtype=torch.float16), spec)


# ---------------------------------------------------------------- devices (meta = "another device")

@pytest.mark.parametrize("name", ["k", "v", "out"])
def test_varlen_device_mismatch(name):
    args = paged()
    t = args.get(name, torch.randn(4, H, D))
    args[name] = t.to("meta")
    with pytest.raises(ValueError, match=rf"^{name} is on meta"):
        call(args)


@pytest.mark.parametrize("name", ["cu_seqlens_q", "seqused_k", "block_table"])
def test_varlen_index_device_mismatch(name):
    args = paged()
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"^{name} is on meta"):
        call(args)


def test_varlen_cu_seqlens_k_device_mismatch():
    with pytest.raises(ValueError, match="^cu_seqlens_k is on meta"):
        call(contiguous(cu_seqlens_k=i32([0, 5, 9], device="meta")))


@pytest.mark.parametrize("name", ["value", "key_cache", "value_cache", "slot_mapping"])
def test_write_kv_cache_device_mismatch(name):
    args = kv_write()
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"^{name} is on meta"):
        compileattn.write_kv_cache(**args)


def test_kv_cache_device_mismatch():
    spec = AttentionSpec(H, KVH, D)
    with pytest.raises(ValueError, match="value_cache"):
        KVCache(torch.zeros(NB, BS, KVH, D), torch.zeros(NB, BS, KVH, D, device="meta"), spec)


# ---------------------------------------------------------------- head dims

@pytest.mark.parametrize("make", [contiguous, paged])
def test_unsupported_head_dim(make):
    args = make()
    for n in ("q", "k", "v"):
        args[n] = torch.randn(*args[n].shape[:-1], 48)
    with pytest.raises(ValueError, match="head_dim=48"):
        call(args)


def test_k_head_dim_differs_from_q():
    args = contiguous(k=torch.randn(9, KVH, 128), v=torch.randn(9, KVH, 128))
    with pytest.raises(ValueError, match="^k head_dim"):
        call(args)


def test_spec_unsupported_head_dim():
    with pytest.raises(ValueError, match="head_dim=48"):
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=48)


def test_kv_cache_disagrees_with_spec():
    spec = AttentionSpec(H, KVH, D)
    with pytest.raises(ValueError, match="num_kv_heads=2, head_dim=64"):
        KVCache(torch.zeros(NB, BS, KVH, 128), torch.zeros(NB, BS, KVH, 128), spec)


# ---------------------------------------------------------------- block tables

@pytest.mark.parametrize("entry", [NB, NB + 5, -1])
def test_builder_block_table_entry_out_of_range(entry):
    with pytest.raises(ValueError, match=r"seqs\[1\]\.block_table entry"):
        builder().build([SequenceStep(1, 4, [0, 1]), SequenceStep(2, 0, [entry])])


@pytest.mark.parametrize("entry", [NB, NB + 5, -1])
def test_varlen_block_table_entry_out_of_range(entry):
    with pytest.raises(ValueError, match=r"^block_table row 1"):
        call(paged(block_table=i32([[2, 0], [entry, 1]])))


def test_varlen_block_table_entries_past_the_context_are_ignored():
    """FlashAttention only reads the blocks a sequence uses; padding entries may hold anything."""
    with pytest.raises(KernelRan):  # i.e. validation passed
        call(paged(block_table=i32([[2, 0, 99], [5, 1, -7]])))


def test_builder_context_beyond_blocks():
    with pytest.raises(ValueError, match=r"seqs\[0\]: context_len 7 \+ query_len 2 .* block_table has 2"):
        builder().build([SequenceStep(2, 7, [0, 1])])


def test_varlen_context_beyond_blocks():
    with pytest.raises(ValueError, match="^seqused_k has a context of 9 tokens beyond"):
        call(paged(seqused_k=i32([9, 4]), max_seqlen_k=9))


def test_builder_table_wider_than_max_blocks_per_seq():
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        builder().build([SequenceStep(1, 0, [0, 1, 2, 3])])


# ---------------------------------------------------------------- cu_seqlens

@pytest.mark.parametrize("name,values", [
    ("cu_seqlens_q", [0, 3, 2, 4]),
    ("cu_seqlens_k", [0, 5, 4, 9]),
])
def test_non_monotonic_cu_seqlens(name, values):
    args = contiguous(q=torch.randn(4, H, D), cu_seqlens_q=i32([0, 3, 3, 4]), cu_seqlens_k=i32([0, 5, 5, 9]))
    args[name] = i32(values)
    with pytest.raises(ValueError, match=f"^{name} must be non-decreasing"):
        call(args)


@pytest.mark.parametrize("name,values,msg", [
    ("cu_seqlens_q", [1, 3, 4], "must start at 0"),
    ("cu_seqlens_q", [0, 3, 5], "ends at 5"),
    ("cu_seqlens_k", [0, 5, 10], "ends at 10"),
])
def test_cu_seqlens_bounds(name, values, msg):
    args = contiguous()
    args[name] = i32(values)
    with pytest.raises(ValueError, match=f"^{name} {msg}"):
        call(args)


def test_cu_seqlens_lengths_disagree():
    with pytest.raises(ValueError, match="^cu_seqlens_k has 2 entries"):
        call(contiguous(cu_seqlens_k=i32([0, 9])))


@pytest.mark.parametrize("name,value", [("max_seqlen_q", 2), ("max_seqlen_k", 4)])
def test_max_seqlen_below_actual(name, value):
    with pytest.raises(ValueError, match=f"^{name}={value}"):
        call(contiguous(**{name: value}))


# ---------------------------------------------------------------- slots

@pytest.mark.parametrize("slot", [NB * BS, 10 ** 6, -2])
def test_slot_out_of_range(slot):
    with pytest.raises(ValueError, match="^slot_mapping entries must lie in"):
        compileattn.write_kv_cache(**kv_write(slot_mapping=torch.tensor([0, slot, -1])))


def test_slot_mapping_longer_than_tokens():
    with pytest.raises(ValueError, match="^slot_mapping has 4 entries for 3 tokens"):
        compileattn.write_kv_cache(**kv_write(slot_mapping=torch.tensor([0, 1, 2, 3])))


# ---------------------------------------------------------------- K/V cache shapes

def test_kv_cache_shapes_disagree():
    spec = AttentionSpec(H, KVH, D)
    with pytest.raises(ValueError, match="value_cache shape"):
        KVCache(torch.zeros(NB, BS, KVH, D), torch.zeros(NB, 2 * BS, KVH, D), spec)


def test_write_kv_cache_shapes_disagree():
    with pytest.raises(ValueError, match=r"^key_cache .* and value_cache .* must agree"):
        compileattn.write_kv_cache(**kv_write(value_cache=torch.zeros(NB + 1, BS, KVH, D)))
    with pytest.raises(ValueError, match=r"key_cache \(kv_heads, head_dim\)"):
        compileattn.write_kv_cache(**kv_write(key_cache=torch.zeros(NB, BS, 1, D),
                                              value_cache=torch.zeros(NB, BS, 1, D)))
    with pytest.raises(ValueError, match="^key and value"):
        compileattn.write_kv_cache(**kv_write(value=torch.randn(2, KVH, D)))


@pytest.mark.parametrize("name", ["key_cache", "value_cache"])
def test_write_kv_cache_into_a_broadcast_cache_is_named(name):
    """A cache whose dim has stride 0 (``expand``) is one memory for all its slots: the torch writer
    failed with an unnamed RuntimeError and Triton's would race; refused naming it."""
    broadcast = torch.zeros(1, BS, KVH, D).expand(NB, BS, KVH, D)
    with pytest.raises(ValueError, match=rf"^{name} has stride 0 in dim 0 \(a broadcast view"):
        compileattn.write_kv_cache(**kv_write(**{name: broadcast}))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_write_kv_cache_into_views_of_a_combined_cache(backend, monkeypatch):
    """(num_blocks, 2, block_size, ...) K/V with key_cache = kv[:, 0] (a FlashInfer-style layout):
    every writer indexes the strided views by (block, row), the masked and the capturable one."""
    from compileattn.backends.kv_write import write_kv_padded

    monkeypatch.undo()  # this module's autouse fixture patches the kernels out; these must run
    args = kv_write()
    kv = torch.zeros(NB, 2, BS, KVH, D)
    compileattn.write_kv_cache(args["key"], args["value"], kv[:, 0], kv[:, 1], args["slot_mapping"], backend=backend)
    for slot, token in ((0, 0), (7, 1)):
        assert torch.equal(kv[slot // BS, 0, slot % BS], args["key"][token])
        assert torch.equal(kv[slot // BS, 1, slot % BS], args["value"][token])
    assert kv.count_nonzero() == 2 * 2 * KVH * D  # the -1 slot wrote nothing
    padded = torch.zeros(NB, 2, BS, KVH, D)
    write_kv_padded(args["key"], args["value"], padded[:, 0], padded[:, 1], args["slot_mapping"])
    assert torch.equal(padded, kv)


def test_paged_varlen_refuses_empty_blocks():
    args = paged()
    args["k"], args["v"] = torch.randn(NB, 0, KVH, D), torch.randn(NB, 0, KVH, D)
    with pytest.raises(ValueError, match="^k has block_size 0"):
        call(args)


@pytest.mark.parametrize("make", [contiguous, paged])
def test_varlen_kv_shapes_disagree(make):
    args = make()
    args["v"] = torch.randn(args["v"].shape[0] + 1, *args["v"].shape[1:])
    with pytest.raises(ValueError, match=r"^k shape .* and v shape .* disagree"):
        call(args)


def test_paged_k_must_be_4d():
    with pytest.raises(ValueError, match="^with block_table, k must be"):
        call(paged(k=torch.randn(9, KVH, D), v=torch.randn(9, KVH, D)))


# ---------------------------------------------------------------- other arguments

def test_paged_needs_seqused_k():
    with pytest.raises(ValueError, match="^seqused_k is required"):
        call(paged(seqused_k=None))


def test_seqused_k_negative():
    with pytest.raises(ValueError, match="^seqused_k must be >= 0"):
        call(paged(seqused_k=i32([5, -1])))


def test_out_shape():
    with pytest.raises(ValueError, match="^out has shape"):
        call(contiguous(out=torch.empty(5, H, D)))


@pytest.mark.parametrize("window,match", [((-2, 0), "window_size left"), ((3, 2), "window_size right"),
                                          (3, "window_size must be")])
def test_window_size(window, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(contiguous(window_size=window))


def test_negative_softcap():
    with pytest.raises(ValueError, match="^softcap"):
        call(contiguous(softcap=-1.0))


def test_missing_cu_seqlens_k_is_named_even_without_max_seqlen():
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        call(contiguous(cu_seqlens_k=None, max_seqlen_k=None))


@pytest.mark.parametrize("make", [contiguous, paged])
def test_missing_cu_seqlens_q_is_named(make):
    """cu_seqlens_q is required in both forms: None is a TypeError naming it, not an
    AttributeError from reading its shape."""
    with pytest.raises(TypeError, match="^cu_seqlens_q must be a tensor"):
        call(make(cu_seqlens_q=None))


# Each check of check_varlen_args below could be deleted with every other test here passing: no
# test gave the entry that argument (a later check or the kernel then fails without naming it).
@pytest.mark.parametrize("make,over,error,match", [
    (contiguous, dict(k=[[0.0]]), TypeError, r"^k must be a tensor, got list"),
    (contiguous, dict(q=torch.randn(4, H * D), out=torch.empty(4, H * D)), ValueError,
     r"^q must be \(total_q, num_heads, head_dim\), got shape \(4, 256\)"),
    (contiguous, dict(k=torch.randn(9, 1, KVH, D), v=torch.randn(9, 1, KVH, D)), ValueError,
     r"^k must be \(total_k, kv_heads, head_dim\), got shape \(9, 1, 2, 64\)"),
    (contiguous, dict(q=torch.randn(0, H, D), cu_seqlens_q=i32([]), cu_seqlens_k=i32([]), max_seqlen_q=0,
                      max_seqlen_k=0), ValueError, r"^cu_seqlens_q must have at least one entry"),
    (paged, dict(seqused_k=i32([5, 4, 1])), ValueError, r"^seqused_k has 3 entries for 2 sequences"),
    (paged, dict(block_table=i32([[2, 0], [5, 1], [3, 4]])), ValueError, r"^block_table has 3 rows for 2 sequences"),
    (contiguous, dict(seqused_k=i32([6, 4])), ValueError,
     r"^seqused_k \[6, 4\] must lie within the cu_seqlens_k lengths \[5, 4\]"),
], ids=["k-not-a-tensor", "q-2d", "contiguous-k-4d", "cu_seqlens_q-empty", "seqused_k-length", "block_table-rows",
        "seqused_k-past-cu_seqlens_k"])
def test_varlen_refusals_named_by_argument(make, over, error, match):
    with pytest.raises(error, match=match):
        call(make(**over))


@pytest.mark.parametrize("make", [contiguous, paged])
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_varlen_out_sharing_memory_with_an_input(make, name):
    """An out that shares memory with q/k/v is written while the kernels still read it (out=k gave
    values off by ~0.6 on Triton, no error); a view into the same buffer counts too. An out
    interleaved with q in one buffer, sharing no element, is accepted."""
    args = make(q=torch.randn(9, KVH, D), cu_seqlens_q=i32([0, 5, 9]), max_seqlen_q=5)
    with pytest.raises(ValueError, match=f"^out shares memory with {name}"):
        call(args, out=args[name].view(-1, KVH, D)[:9])
    buf = torch.randn(9, 2, KVH, D)
    with pytest.raises(KernelRan):
        call({**args, "q": buf[:, 0]}, out=buf[:, 1])


def test_key_and_value_caches_sharing_memory_are_refused():
    """One tensor passed as both caches: the write stored values over keys and attention read
    them as keys, with no error (write_kv_cache left the cache holding the values). Views of one
    combined cache that share no element stay accepted."""
    cache = torch.zeros(NB, BS, KVH, D)
    with pytest.raises(ValueError, match="^value_cache shares memory with key_cache"):
        compileattn.write_kv_cache(**kv_write(key_cache=cache, value_cache=cache))
    with pytest.raises(ValueError, match="^value_cache shares memory with key_cache"):
        compileattn.write_kv_cache(**kv_write(key_cache=cache[1:], value_cache=cache[:-1]))
    with pytest.raises(ValueError, match="^value_cache shares memory with key_cache"):
        KVCache(cache, cache, AttentionSpec(H, KVH, D))
    kv = torch.zeros(NB, 2, BS, KVH, D)
    with pytest.raises(KernelRan):
        compileattn.write_kv_cache(**kv_write(key_cache=kv[:, 0], value_cache=kv[:, 1]))
    KVCache(kv.transpose(0, 1).contiguous()[0], kv.transpose(0, 1).contiguous()[1], AttentionSpec(H, KVH, D))


# ---------------------------------------------------------------- the metadata builder

@pytest.mark.parametrize("seqs,pad_to,match", [
    ([], None, "^seqs"),
    ([SequenceStep(0, 3, [0])], None, r"seqs\[0\]\.query_len"),
    ([SequenceStep(2, -1, [0])], None, r"seqs\[0\]\.context_len"),
    ([SequenceStep(3, 0, [0])], 2, "pad_to=2"),
    ([SequenceStep(3, 0, [0])], 17, "max_num_tokens"),
])
def test_builder_rejects_bad_steps(seqs, pad_to, match):
    with pytest.raises(ValueError, match=match):
        builder().build(seqs, pad_to=pad_to)


@pytest.mark.parametrize("seqs,match", [
    ([SequenceStep(2.0, 0, [0])], r"seqs\[0\]\.query_len must be an int, got float 2\.0"),
    ([SequenceStep(True, 0, [0])], r"seqs\[0\]\.query_len must be an int, got True"),
    ([SequenceStep(2, 1.5, [0])], r"seqs\[0\]\.context_len must be an int"),
    ([SequenceStep(2, 0, [2.9])], r"seqs\[0\]\.block_table entry must be an int, got float 2\.9"),
    ([SequenceStep(2, 0, [torch.tensor(2.0)])], r"seqs\[0\]\.block_table entry must be an int, got tensor\(2\.\)"),
    ([SequenceStep(1, 0, [0]), SequenceStep(2, 0, [1.0])], r"seqs\[1\]\.block_table entry must be an int"),
])
def test_builder_refuses_lengths_and_block_ids_that_are_not_ints(seqs, match):
    """A float block id would be truncated into another block (2.9 -> 2); a bool length is refused too
    (block ids take whatever ``operator.index`` takes, a bool as 0 or 1: checking each entry's type
    would cost as much as converting the step's tables)."""
    with pytest.raises(TypeError, match=match):
        builder().build(seqs)


@pytest.mark.parametrize("seqs,match", [
    (None, r"^seqs must be a sequence of SequenceStep, got NoneType"),
    ((SequenceStep(1, 0, [i]) for i in range(2)), r"^seqs must be a sequence of SequenceStep, got generator"),
    ([(1, 0)], r"^seqs\[0\] must be a SequenceStep\(query_len, context_len, block_table\), got tuple \(1, 0\)"),
    ([SequenceStep(1, 0, [0]), 3], r"^seqs\[1\] must be a SequenceStep"),
    ([SequenceStep(1, 0, None)], r"^seqs\[0\]\.block_table must be a sequence of block ids, got NoneType None"),
    ([SequenceStep(1, 0, [0]), SequenceStep(1, 0, 5)], r"^seqs\[1\]\.block_table must be a sequence of block ids"),
    ([SequenceStep(1, 0, torch.tensor(2))], r"^seqs\[0\]\.block_table must be a sequence of block ids, got "
                                           r"tensor\(2\)"),
])
def test_builder_names_a_step_or_block_table_of_the_wrong_shape(seqs, match):
    """Not a list of (query_len, context_len, block_table) triples, or a block table that is not a
    sequence: a TypeError naming it, not Python's unpacking or iteration error."""
    with pytest.raises(TypeError, match=match):
        builder().build(seqs)


@pytest.mark.parametrize("dummy_writes", ["no", 1, None])
def test_builder_dummy_writes_must_be_a_bool(dummy_writes):
    """It lifts the refusal of writes where the step reads context: a truthy non-bool ("no")
    would lift it silently."""
    seqs = [SequenceStep(2, 4, [2, 2])]  # refused unless dummy_writes=True
    with pytest.raises(TypeError, match=r"^dummy_writes must be a bool"):
        builder().build(seqs, dummy_writes=dummy_writes)
    builder().build(seqs, dummy_writes=True)


def test_builder_names_a_block_id_past_int64():
    with pytest.raises(ValueError, match=r"seqs\[1\]\.block_table entry 1180591620717411303424 out of range"):
        builder().build([SequenceStep(1, 0, [True]), SequenceStep(1, 0, [2 ** 70])])


def test_builder_takes_numpy_and_tensor_integers():
    import numpy as np

    md = builder().build([SequenceStep(np.int64(2), torch.tensor(1), [np.int32(3)])])
    assert md.slot_mapping.tolist() == [3 * BS + 1, 3 * BS + 2]


@pytest.mark.parametrize("seqs,match", [
    # sequence 1 writes rows 0-1 of block 3, whose rows 0-3 sequence 0 reads as its context
    ([SequenceStep(1, 4, [3, 4]), SequenceStep(2, 0, [3])], r"seqs\[1\] writes cache slot 12 \(block 3, row 0\), "
                                                          r"which seqs\[0\] read as context"),
    # one block listed twice: positions 4-5 land on rows 0-1 of block 2, the sequence's own context
    ([SequenceStep(2, 4, [2, 2])], r"seqs\[0\] writes cache slot 8 \(block 2, row 0\), which seqs\[0\] read"),
])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["ints", "tensor-tables"])
def test_builder_refuses_writes_where_the_step_reads_context(seqs, match, as_tensor):
    """The kernels write a step's K/V before they read: a write into a block some sequence reads as
    context would change what it attends to. A table given as a tensor (its entries hash by
    identity, not value) is checked alike."""
    if as_tensor:
        seqs = [SequenceStep(s.query_len, s.context_len, torch.tensor(s.block_table)) for s in seqs]
    with pytest.raises(ValueError, match=match):
        builder().build(seqs)


def test_builder_allows_sequences_sharing_a_prefix_block_they_only_read():
    """Prefix caching: two sequences read the same full block 3 as context and each writes its own."""
    md = builder().build([SequenceStep(1, 4, [3, 4]), SequenceStep(2, 4, [3, 5])])
    assert md.slot_mapping.tolist() == [4 * BS, 5 * BS, 5 * BS + 1]


@pytest.mark.parametrize("name", ["block_size", "num_blocks", "max_num_tokens", "max_blocks_per_seq"])
def test_builder_rejects_bad_sizes(name):
    with pytest.raises(ValueError, match=f"^{name}"):
        builder(**{name: 0})


@pytest.mark.parametrize("name", ["block_size", "num_blocks", "max_num_tokens", "max_blocks_per_seq"])
def test_builder_sizes_follow_the_int_rule(name):
    """argtypes' rule for every public entry: numpy's integers are ints, a bool or a float never is
    (``block_size=True`` built pages of one token)."""
    import numpy as np

    b = builder(**{name: np.int64(8)})
    assert getattr(b, name) == 8 and type(getattr(b, name)) is int
    for bad in (True, 8.0):
        with pytest.raises(TypeError, match=f"^{name} must be an int"):
            builder(**{name: bad})


def test_block_counts_past_int32_are_refused():
    """Block tables hold block ids as int32: a builder for more blocks wrote block 2**31 + 3 into
    its table as -2147483645 and a KV cache of that many blocks was taken."""
    assert builder(num_blocks=2**31 - 1).num_blocks == 2**31 - 1
    with pytest.raises(ValueError, match=r"^num_blocks must be at most 2147483647 \(2\*\*31 - 1\), got 2147483648"):
        builder(num_blocks=2**31)
    with pytest.raises(ValueError, match="^num_blocks must be at most 2147483647"):
        allocate_kv_caches({"l0": AttentionSpec(H, KVH, D)}, num_blocks=2**31, block_size=BS, dtype=torch.float32)
    k = torch.empty(2**31, BS, KVH, D, device="meta")  # no memory: the check reads the shape
    with pytest.raises(ValueError, match="^key_cache's num_blocks \\(dim 0\\) must be at most 2147483647"):
        KVCache(k, torch.empty_like(k), AttentionSpec(H, KVH, D))


def test_builder_rejects_unknown_backend():
    with pytest.raises(ValueError, match="attention_backend='nope'"):
        builder(backend="nope")


# ---------------------------------------------------------------- layouts and softmax numbers

def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, every other element of a buffer twice as long."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize("make,name", [(contiguous, "cu_seqlens_q"), (contiguous, "cu_seqlens_k"),
                                       (paged, "seqused_k"), (paged, "block_table")])
def test_index_tensors_the_kernels_read_at_unit_stride_must_be_contiguous(make, name):
    """The Triton kernels read them at unit stride (a strided view crashed or read the wrong blocks)."""
    args = make()
    args[name] = _strided(args[name])
    with pytest.raises(ValueError, match=rf"^{name} must be contiguous"):
        call(args)


def test_a_block_table_with_padded_rows_is_accepted():
    args = paged(block_table=torch.zeros(2, 5, dtype=torch.int32)[:, :2].copy_(i32([[2, 0], [5, 1]])))
    with pytest.raises(KernelRan):  # valid: reaches the (patched) kernel
        call(args)


def test_write_kv_cache_slot_mapping_must_be_contiguous():
    args = kv_write()
    args["slot_mapping"] = _strided(args["slot_mapping"])
    with pytest.raises(ValueError, match="^slot_mapping must be contiguous"):
        compileattn.write_kv_cache(**args)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.5])
def test_softmax_scale_must_be_finite_and_positive(scale):
    with pytest.raises(ValueError, match=rf"^softmax_scale must be a finite float > 0, got {scale}"):
        call(paged(), softmax_scale=scale)


@pytest.mark.parametrize("softcap", [float("nan"), float("inf"), -1.0])
def test_softcap_must_be_finite(softcap):
    """An infinite softcap made every row NaN; a NaN one silently meant no softcap."""
    with pytest.raises(ValueError, match=rf"^softcap must be a finite float >= 0"):
        call(paged(), softcap=softcap)


def test_kvcache_checks_its_softmax_numbers_before_writing_the_cache():
    """The append to the cache ran before the scale was refused (and named ``scale``)."""
    k_cache, v_cache = torch.zeros(NB, BS, KVH, D), torch.zeros(NB, BS, KVH, D)
    q, k = torch.randn(2, 1, H, D), torch.randn(2, 1, KVH, D)
    for bad in (dict(softmax_scale=float("nan")), dict(softcap=float("inf"))):
        with pytest.raises(ValueError, match=rf"^{next(iter(bad))} must be a finite float"):
            compileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, k.clone(), cache_seqlens=i32([3, 2]),
                                                block_table=i32([[2, 0], [5, 1]]), **bad)
        assert not k_cache.any()


def test_max_seqlen_must_be_an_int():
    args = paged(max_seqlen_q=3.0)
    with pytest.raises(TypeError, match="^max_seqlen_q must be an int, got float"):
        call(args)


@pytest.mark.parametrize("window", [(2.7, -1), (-1.5, -1), ("3", -1), (None, -1)])
def test_a_window_of_floats_strings_or_none_is_refused_not_truncated(window):
    """``int()`` made (2.7, -1) a window of 2 and (-1.5, -1) no window at all."""
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        call(contiguous(window_size=window))


def np_bool(value):
    import numpy as np

    return np.bool_(value)


def test_causal_and_backend_are_checked_by_type():
    a = contiguous()
    with pytest.raises(TypeError, match="causal must be a bool, got 'no'"):
        compileattn.flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], causal="no")
    for flag in (1, 0, np_bool(True)):  # accepted: the check passes and the (patched) kernel runs
        with pytest.raises(KernelRan):
            compileattn.flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                               causal=flag)
    with pytest.raises(TypeError, match="backend must be a str, got NoneType"):
        call(contiguous(backend=None))
    with pytest.raises(ValueError, match="backend='fast' is unknown"):
        call(contiguous(backend="fast"))
    k = torch.zeros(NB, BS, KVH, D)
    with pytest.raises(TypeError, match="backend must be a str"):
        compileattn.flash_attn_with_kvcache(torch.randn(1, 1, H, D), k, k.clone(), backend=None)
    with pytest.raises(TypeError, match="backend must be a str"):
        compileattn.write_kv_cache(torch.randn(1, KVH, D), torch.randn(1, KVH, D), k, k.clone(),
                                   torch.zeros(1, dtype=torch.int64), backend=None)


@pytest.mark.parametrize("field,value,error,match", [
    ("softcap", float("nan"), ValueError, "softcap must be a finite float"),  # was read as "off"
    ("softcap", float("inf"), ValueError, "softcap must be a finite float"),  # made every output NaN
    ("softcap", "1", TypeError, "softcap must be a float"),
    ("sliding_window", 2.5, TypeError, "sliding_window must be an int, got 2.5"),
    ("head_dim", 64.0, TypeError, "head_dim must be an int, got 64.0"),
    ("num_heads", True, TypeError, "num_heads must be an int, got True"),
    ("causal", "no", TypeError, "causal must be a bool, got 'no'"),
])
def test_spec_fields_are_checked_by_type_and_value(field, value, error, match):
    with pytest.raises(error, match=match):
        AttentionSpec(**{"num_heads": H, "num_kv_heads": KVH, "head_dim": D, field: value})


def test_spec_takes_numpy_integers_as_ints():
    import numpy as np

    spec = AttentionSpec(np.int64(H), np.int32(KVH), np.int64(D), sliding_window=np.int64(8))
    assert spec == AttentionSpec(H, KVH, D, sliding_window=8) and type(spec.head_dim) is int
    caches = allocate_kv_caches({"l0": spec}, np.int64(NB), np.int64(BS), torch.float32)
    assert caches["l0"].key_cache.shape == (NB, BS, KVH, D)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dtype=torch.float16, kv_cache_dtype=torch.bfloat16), ValueError, "only a float8_e4m3fn cache"),
    (dict(dtype=torch.float16, kv_cache_dtype=torch.float32), ValueError, "only a float8_e4m3fn cache"),
    (dict(num_blocks=4.0), TypeError, "num_blocks must be an int, got 4.0"),
    (dict(num_blocks=None), TypeError, "num_blocks must be an int, got None"),
    (dict(block_size=16.0), TypeError, "block_size must be an int, got 16.0"),
])
def test_allocate_refuses_a_storage_dtype_it_would_not_serve_and_sizes_that_are_not_ints(kwargs, error, match):
    """A float16 model given bfloat16 storage got caches that serve bfloat16 queries only."""
    args = dict(num_blocks=NB, block_size=BS, dtype=torch.float32)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        allocate_kv_caches({"l0": AttentionSpec(H, KVH, D)}, **args)


@pytest.mark.parametrize("specs,match", [
    ([AttentionSpec(H, KVH, D)], r"specs must be a mapping of layer name -> AttentionSpec, got list"),
    ({"l0": (H, KVH, D)}, r"specs\['l0'\] must be an AttentionSpec, got tuple"),
    ({0: AttentionSpec(H, KVH, D)}, r"specs: layer names must be strings, got 0"),
])
def test_allocate_refuses_specs_that_are_not_a_mapping_of_names_to_attention_specs(specs, match):
    """They failed as an AttributeError ('tuple' object has no attribute 'num_kv_heads')."""
    with pytest.raises(TypeError, match=match):
        allocate_kv_caches(specs, NB, BS, torch.float32)


@pytest.mark.parametrize("pad_to", [8.0, True, "8"])
def test_builder_refuses_a_pad_to_that_is_not_an_int(pad_to):
    with pytest.raises(TypeError, match="pad_to must be an int or None"):
        builder().build([SequenceStep(3, 0, [0])], pad_to=pad_to)


def test_overlap_of_a_broadcast_view_is_decided_not_divided_by_its_zero_stride():
    """A view whose only dim of more than one element has stride 0 (one element broadcast,
    ``buf[i].expand(n)``) covers that element's bytes: it overlaps what holds them and nothing
    else (its runs were taken as ``n`` runs 0 bytes apart, a division by zero)."""
    from compileattn.validation import overlaps

    buf = torch.arange(16.0)
    broadcast = buf[3:4].expand(5)
    for other, shared in ((buf[:3], False), (buf[4:9], False), (buf[2:5], True), (buf[3:4], True),
                          (buf[3:4].expand(2, 1), True), (buf[8:9].expand(4), False), (buf.view(4, 4)[:, 0], False),
                          (buf.view(4, 4)[:, 3], True)):
        assert overlaps(broadcast, other) is shared, other
        assert overlaps(other, broadcast) is shared, other


FP8 = torch.float8_e4m3fn
BAD_SCALES = [0.0, -0.5, float("nan"), float("inf")]


@pytest.mark.parametrize("bad", BAD_SCALES)
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("entry", ["write_kv_cache", "varlen", "kvcache"])
def test_kv_scale_values_are_checked_like_kvcache_checks_them(entry, name, bad):
    """KVCache refuses a scale that is not finite and > 0; the entry points' value checks refuse it
    too (a zero scale stored every written element as +-448 or NaN, a NaN one read the cache as
    NaN), and ``validate=False`` leaves the tensors unread."""
    scales = {"k_scale": torch.full((KVH,), 0.1), "v_scale": torch.full((KVH,), 0.1)}
    scales[name][1] = bad
    if entry == "write_kv_cache":
        def run(validate):
            compileattn.write_kv_cache(**kv_write(key_cache=torch.zeros(NB, BS, KVH, D, dtype=FP8),
                                                  value_cache=torch.zeros(NB, BS, KVH, D, dtype=FP8)),
                                       **scales, validate=validate)
    elif entry == "varlen":
        def run(validate):
            call(paged(k=torch.zeros(NB, BS, KVH, D, dtype=FP8), v=torch.zeros(NB, BS, KVH, D, dtype=FP8)),
                 **scales, validate=validate)
    else:
        def run(validate):
            compileattn.flash_attn_with_kvcache(torch.randn(2, 1, H, D), torch.zeros(NB, BS, KVH, D, dtype=FP8),
                                                torch.zeros(NB, BS, KVH, D, dtype=FP8), torch.randn(2, 1, KVH, D),
                                                torch.randn(2, 1, KVH, D), cache_seqlens=i32([5, 2]),
                                                block_table=i32([[2, 0], [5, 1]]), **scales, validate=validate)
    with pytest.raises(ValueError, match=rf"^{name} must hold finite floats > 0 \(one per KV head\), got "):
        run(True)
    with pytest.raises(KernelRan):
        run(False)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("entry", ["varlen", "kvcache"])
def test_alibi_slope_values_are_checked_like_the_spec_checks_them(entry, bad):
    """AttentionSpec refuses a slope that is not finite; so do the entry points' value checks (a
    NaN slope gave NaN rows, an infinite one NaN or one-key rows)."""
    slopes = torch.tensor([0.5, 0.25, bad, 0.125])
    if entry == "varlen":
        def run(validate):
            call(paged(), alibi_slopes=slopes, validate=validate)
    else:
        def run(validate):
            compileattn.flash_attn_with_kvcache(torch.randn(2, 1, H, D), torch.zeros(NB, BS, KVH, D),
                                                torch.zeros(NB, BS, KVH, D), cache_seqlens=i32([5, 2]),
                                                block_table=i32([[2, 0], [5, 1]]), alibi_slopes=slopes,
                                                validate=validate)
    with pytest.raises(ValueError, match=r"^alibi_slopes must hold finite floats \(one per query head\), got "):
        run(True)
    with pytest.raises(KernelRan):
        run(False)


@pytest.mark.parametrize("slopes,match", [
    (torch.tensor([0.5, 0.0, 0.25, 0.0, 0.125, 0.0, 0.0625, 0.0])[::2], r"^alibi_slopes must be contiguous"),
    (torch.tensor([0.5, 0.25, 0.125, 0.0625], device="meta"), r"^alibi_slopes is on meta, but q is on cpu"),
])
def test_alibi_slopes_layout_and_device_are_checked(slopes, match):
    """The kernels read the slopes at unit stride, on q's device: a strided view or another device's
    tensor is refused by name (deleting either check left every other test passing)."""
    with pytest.raises(ValueError, match=match):
        call(paged(), alibi_slopes=slopes)


def test_flash_attn_training_arguments_are_taken_at_inference_values_and_refused_otherwise():
    """flash-attn's dropout_p, deterministic and return_attn_probs: a call ported with
    dropout_p=0.0 got an unexpected-keyword TypeError; a dropout asked for is refused, not skipped."""
    for kw in (dict(dropout_p=0.0), dict(dropout_p=0), dict(deterministic=True), dict(return_attn_probs=False)):
        with pytest.raises(KernelRan):
            call(contiguous(), **kw)
    for kw, error, match in ((dict(dropout_p=0.1), ValueError, "^dropout_p=0.1 is not supported"),
                             (dict(dropout_p=None), TypeError, "^dropout_p must be a number"),
                             (dict(deterministic="yes"), TypeError, "^deterministic must be a bool"),
                             (dict(return_attn_probs=True), ValueError, "^return_attn_probs=True is not supported")):
        with pytest.raises(error, match=match):
            call(contiguous(), **kw)


def test_flash_attn_varlen_func_binds_flash_attns_positional_order(monkeypatch):
    """(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
    causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table)."""
    seen = {}

    def record(q, k, v, out, cu_q, cu_k, seqused_k, block_table, max_q, max_k, scale, causal, window_left, softcap,
               backend, alibi_slopes, k_scale, v_scale):
        seen.update(scale=scale, causal=causal, window_left=window_left, softcap=softcap, block_table=block_table)

    monkeypatch.setattr(compileattn.functional.ops, "varlen_attention", record)
    a = paged()
    compileattn.flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], None, 3, 5, 0.0, 0.5, True, (2, 0),
                                       1.5, None, False, False, a["block_table"], seqused_k=a["seqused_k"])
    assert seen["scale"] == 0.5 and seen["causal"] is True and seen["window_left"] == 2 and seen["softcap"] == 1.5
    assert seen["block_table"] is a["block_table"]
