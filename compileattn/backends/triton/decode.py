"""Paged decode (one query token per sequence) with GQA packing and split-KV, and the merge of splits.

Grid ``(num_seqs, num_kv_heads, num_splits)``. A program owns every query head of its KV head:
the GROUP query rows (padded to BLOCK_M >= 16, the smallest tl.dot M) form the A operand, so each
K/V tile is loaded once for the whole group and both products run on tensor cores. Decode is
bound by HBM bandwidth, so reading each KV byte once is the whole game; the padded rows cost only
tensor-core issue slots, which are idle anyway.

Split-KV: with few sequences, ``num_seqs * num_kv_heads`` programs cannot keep every SM's memory
pipeline busy, so each sequence's tiles are dealt out evenly over ``num_splits`` programs which
write fp32 partial outputs and their log2-sum-exp. The split count is a launch-time constant chosen
from the batch shape alone (see config.py); each program loops to its own sequence's length (read
from ``seq_lens`` on the device), so a CUDA graph captured once per batch size serves every context
length.

Merging the partials: with few splits (``config.merges_in_kernel``) in the same launch: each split,
after writing its partials, takes a ticket from a per-(sequence, KV head) arrival counter, and the
last to arrive merges all the splits and resets the counter to zero for the next launch (the
threadfence-reduction pattern), which saves the second launch per layer. With many splits one
program's merge of every split is slower than ``combine_kernel``, which spreads it over one
program per (sequence, query head): measured on the H200 in config.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .tile import attend_range, finish_rows, head_constants, key_ranges

#: Splits the merge reads per step (their loads in flight together).
MERGE_UNROLL = tl.constexpr(4)


@triton.jit
def decode_kernel(q_ptr, k_cache, v_cache, out_ptr, o_part, lse_part, arrivals, cu_q, seq_lens, block_table,
                  alibi_ptr, k_scale_ptr, v_scale_ptr,
                  stride_qt, stride_qh, stride_ot, stride_oh,
                  stride_kb, stride_kp, stride_kh, stride_bt,
                  qk_scale, cap, window,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, MERGE: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                  KV_SCALED: tl.constexpr, PRECISION: tl.constexpr,
                  NUM_STAGES: tl.constexpr, TAIL_STAGES: tl.constexpr, INTERPRET: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_heads = tl.num_programs(1) * GROUP

    tok = tl.load(cu_q + seq)
    has_query = tl.load(cu_q + seq + 1) > tok  # the public varlen API allows empty queries
    kv_len = tl.load(seq_lens + seq)
    kv_len = tl.where(has_query, kv_len, 0)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    row_ok = (offs_m < GROUP) & has_query
    d_ok = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_m
    tok64 = tok.to(tl.int64)
    q = tl.load(q_ptr + tok64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    alibi, qk_scale, v_scale = head_constants(alibi_ptr, k_scale_ptr, v_scale_ptr, kvh, heads, offs_m < GROUP,
                                              qk_scale, HAS_ALIBI, KV_SCALED)

    q_last = kv_len - 1
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + q_last
    k_lo, k_hi, body_lo, body_hi = key_ranges(kv_len, q_last, q_last, window, BLOCK_N, False, HAS_WINDOW)
    if SPLIT:
        num_tiles = tl.cdiv(k_hi - k_lo, BLOCK_N)
        s0 = k_lo + ((split * num_tiles) // num_splits) * BLOCK_N
        s1 = tl.minimum(k_lo + (((split + 1) * num_tiles) // num_splits) * BLOCK_N, k_hi)
    else:
        s0 = k_lo
        s1 = k_hi

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = attend_range(acc, m_i, l_i, q, q_pos, k_cache + kvh * stride_kh, v_cache + kvh * stride_kh,
                                 block_table + seq.to(tl.int64) * stride_bt, 0, s0, s1, body_lo, body_hi, kv_len,
                                 stride_kb, stride_kp, offs_d, qk_scale, cap, window, alibi,
                                 HEAD_DIM, D_PAD, PAGE, BLOCK_N, True, False, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                                 PRECISION, NUM_STAGES, TAIL_STAGES, INTERPRET)

    # A decode row sees its own position's key whenever it has any (kv_len is 0 without a query).
    sees = (q_pos * 0 + kv_len) > 0
    # A split's partial is zero where its keys all scored -inf (or it had none): its weight is 0
    # either way, and whether the row saw keys is the merge's question (the whole row's).
    if SPLIT:
        o = finish_rows(acc, l_i, v_scale, sees & (kv_len < 0))
    else:
        o = finish_rows(acc, l_i, v_scale, sees)
    out_rows = out_ptr + tok64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    if SPLIT:
        # A split that saw no key weighs nothing; a NaN sum (a NaN score) gives a NaN lse, which
        # makes every weight of the merge, and so the row, NaN.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        rows = ((seq * num_heads + heads) * num_splits).to(tl.int64)
        group_ok = offs_m < GROUP
        tl.store(lse_part + rows + split, lse, mask=group_ok)
        tl.store(o_part + (rows + split)[:, None] * D_PAD + offs_d[None, :], o, mask=group_ok[:, None])
        if MERGE:
            merge_splits(out_rows, o_part, lse_part, arrivals + seq * tl.num_programs(1) + kvh, rows, num_splits,
                         group_ok, row_ok[:, None] & d_ok[None, :], offs_d, kv_len > 0, BLOCK_M, D_PAD)
    else:
        tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def merge_splits(out_rows, o_part, lse_part, ticket, rows, num_splits, group_ok, out_ok, offs_d, sees,
                 BLOCK_M: tl.constexpr, D_PAD: tl.constexpr):
    """Called by every split of one (sequence, KV head) after writing its partials; the last one
    to arrive merges them into ``out_rows``. ``sees``: the sequence has keys (then a row whose
    splits all weigh nothing scored -inf on every key: NaN, as in finish_rows)."""
    # Every thread's partials are written before the ticket (acq_rel, GPU scope) is taken; the
    # last split reads the others' through L2 (.cg), never a stale L1 line.
    tl.debug_barrier()
    if tl.atomic_add(ticket, 1, sem="acq_rel") == num_splits - 1:
        tl.store(ticket, 0)
        # One pass with a running maximum, MERGE_UNROLL splits per step: their loads do not
        # depend on each other, so they are in flight together (merged one at a time, each split
        # cost ~0.2 µs on the H200). Up to MAX_SPLITS_MERGED_IN_KERNEL (4) splits that is one
        # step; the loop keeps the merge right for any count. while, not range: the interpreter's
        # num_programs is a 1-element array, which is no loop bound.
        m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        merged = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        s0 = 0
        while s0 < num_splits:
            for u in tl.static_range(MERGE_UNROLL):
                ok = group_ok & (s0 + u < num_splits)
                lse_s = tl.load(lse_part + rows + s0 + u, mask=ok, other=float("-inf"), cache_modifier=".cg")
                part = tl.load(o_part + (rows + s0 + u)[:, None] * D_PAD + offs_d[None, :], mask=ok[:, None],
                               other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m, lse_s)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: weights 0, not NaN
                alpha = tl.exp2(m - m_ref)
                w = tl.exp2(lse_s - m_ref)
                merged = merged * alpha[:, None] + part * w[:, None]
                total = total * alpha + w
                m = m_new
            s0 += MERGE_UNROLL
        # no key in any split: zeros; keys that all scored -inf: NaN; NaN stays NaN
        blank = tl.where(sees, float("nan"), 0.0)
        res = tl.where(total[:, None] == 0.0, blank, merged / tl.where(total == 0.0, 1.0, total)[:, None])
        tl.store(out_rows, res.to(out_rows.dtype.element_ty), mask=out_ok)


@triton.jit
def combine_kernel(out_ptr, o_part, lse_part, cu_q, seq_lens, stride_ot, stride_oh, num_splits,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Grid (num_seqs, num_heads): out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M); where
    every weight is 0, zeros for a sequence without keys and NaN for one with keys (they all
    scored -inf: see merge_splits)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    tok = tl.load(cu_q + seq)
    if tl.load(cu_q + seq + 1) > tok:
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, D_PAD)
        s_ok = offs_s < num_splits
        base = ((seq * num_heads + head) * num_splits).to(tl.int64)
        lse = tl.load(lse_part + base + offs_s, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)
        o = tl.load(o_part + (base + offs_s)[:, None] * D_PAD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
        total = tl.sum(w, 0)
        blank = tl.where(tl.load(seq_lens + seq) > 0, float("nan"), 0.0)
        res = tl.where(total == 0.0, blank, tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total))
        tl.store(out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
                 res.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)

#: The mode the kernels above were decorated in (see _mode.sync_interpreter_mode).
INTERPRETED = bool(triton.knobs.runtime.interpret)
