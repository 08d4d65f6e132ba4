"""Varlen attention for prefill, chunked prefill and mixed batches, over a paged or contiguous K/V.

Grid ``(num_tokens // BLOCK_Q + num_seqs, num_kv_heads)``: sequence ``s`` owns the q-blocks
``[cu_q[s] // BLOCK_Q + s, cu_q[s+1] // BLOCK_Q + s + 1)``, which covers ceil(q_len / BLOCK_Q)
blocks for any ragged layout, so the grid depends only on the token and sequence counts (fixed
per CUDA-graph capture size) and a program finds its sequence by binary search over ``cu_q``.
Surplus programs return at once.

A tile is BLOCK_Q query tokens x all GROUP query heads of one KV head (BLOCK_M = BLOCK_Q * GROUP
rows, row r = token r // GROUP, head r % GROUP), so each K/V tile is read once per KV head, as in
decode. Causal masking is bottom-right aligned (query i of q_len sits at kv_len - q_len + i),
which is what chunked prefill over a cached prefix needs.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .tile import attend_range, finish_rows, head_constants, key_ranges


@triton.jit
def find_seq(cu_q, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose q-block range holds ``pid`` (last s with cu_q[s] // BLOCK_Q + s <= pid)."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(cu_q + mid) // BLOCK_Q + mid <= pid:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def unified_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_q, cu_k, seq_lens, block_table, num_seqs,
                   alibi_ptr, k_scale_ptr, v_scale_ptr,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kb, stride_kp, stride_kh, stride_bt,
                   qk_scale, cap, window,
                   GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                   D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                   HAS_SEQ_LENS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, KV_SCALED: tl.constexpr,
                   PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = find_seq(cu_q, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_q + seq)
    q_len = tl.load(cu_q + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return

    if PAGED:
        kv_first = 0
        kv_len = tl.load(seq_lens + seq)
    else:
        kv_first = tl.load(cu_k + seq)
        if HAS_SEQ_LENS:
            kv_len = tl.load(seq_lens + seq)
        else:
            kv_len = tl.load(cu_k + seq + 1) - kv_first

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    alibi, qk_scale, v_scale = head_constants(alibi_ptr, k_scale_ptr, v_scale_ptr, kvh, heads,
                                              offs_m < BLOCK_Q * GROUP, qk_scale, HAS_ALIBI, KV_SCALED)

    ctx = kv_len - q_len
    q_pos = ctx + q_idx
    min_qpos = ctx + q_block * BLOCK_Q
    max_qpos = ctx + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    k_lo, k_hi, body_lo, body_hi = key_ranges(kv_len, min_qpos, max_qpos, window, BLOCK_N, CAUSAL, HAS_WINDOW)

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = attend_range(acc, m_i, l_i, q, q_pos, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_kh,
                                 block_table + seq.to(tl.int64) * stride_bt, kv_first, k_lo, k_hi, body_lo,
                                 body_hi, kv_len, stride_kb, stride_kp, offs_d, qk_scale,
                                 cap, window, alibi, HEAD_DIM, D_PAD, PAGE, BLOCK_N, PAGED, CAUSAL, HAS_WINDOW,
                                 HAS_SOFTCAP, HAS_ALIBI, PRECISION, NUM_STAGES, 1, INTERPRET)

    # Bottom-right causal: a row at a negative position sees no key; any other row sees its own.
    sees = (q_pos * 0 + kv_len) > 0
    if CAUSAL:
        sees = sees & (q_pos >= 0)
    o = finish_rows(acc, l_i, v_scale, sees)
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

#: The mode the kernels above were decorated in (see _mode.sync_interpreter_mode).
INTERPRETED = bool(triton.knobs.runtime.interpret)
