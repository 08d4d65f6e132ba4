"""Device helpers shared by the decode and unified kernels: KV tiles through the block table,
the masked/unmasked online-softmax step, and the split of a sequence's keys into tile ranges.

Scores live in the log2 domain (``exp2`` is one SFU instruction, ``exp`` is two), so the callers
fold ``log2(e)`` into ``qk_scale``/``cap`` and into the per-row ALiBi slopes.

K/V tiles of a float8_e4m3fn cache are cast to the query's dtype after the load (exact: every e4m3
value is a bf16/fp16 value) and their per-head scales are folded in where they cost nothing: the
K scale into ``qk_scale`` (a scalar per program, which owns one KV head), the V scale into the
finished rows (``finish_rows``).

Why three ranges (head, body, tail) instead of one masked loop: in decode almost every tile is
fully visible, and dropping the per-element causal/window/length masks and the load predicates
there is what keeps the loop a pure stream of loads and dots. Only the first tile of a sliding
window, the diagonal tiles of a prefill and the last partial tile pay for masks.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tl has no tanh that also runs under TRITON_INTERPRET; this form saturates to +-1 without NaN
    # (exp2 -> inf gives 1 - 0, exp2 -> 0 gives 1 - 2).
    return 1.0 - 2.0 / (tl.exp2(x * 2.885390081777927) + 1.0)  # 2 * log2(e)


@triton.jit
def head_constants(alibi_ptr, k_scale_ptr, v_scale_ptr, kvh, heads, row_ok, qk_scale,
                   HAS_ALIBI: tl.constexpr, KV_SCALED: tl.constexpr):
    """(alibi, qk_scale, v_scale) of a program over KV head ``kvh`` whose rows are query ``heads``:
    the rows' ALiBi slopes times log2(e) (zeros without ALiBi), ``qk_scale`` times the head's K
    scale and the head's V scale (1 unless the cache is quantized)."""
    if HAS_ALIBI:
        alibi = tl.load(alibi_ptr + heads, mask=row_ok, other=0.0) * 1.4426950408889634  # log2(e)
    else:
        alibi = tl.zeros(heads.shape, dtype=tl.float32)
    if KV_SCALED:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)
        v_scale = tl.load(v_scale_ptr + kvh)
    else:
        v_scale = 1.0
    return alibi, qk_scale, v_scale


@triton.jit
def kv_row_offsets(bt_row, kv_first, start, pos, kv_len, stride_b, stride_p,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr):
    """Element offsets (int64) of the tile's token rows in a K or V cache (all ``pos`` < kv_len).

    Paged: token ``pos`` lives in page ``bt_row[pos // PAGE]`` at row ``pos % PAGE``. When a tile
    lies inside one page (PAGE a multiple of BLOCK_N, tile starts aligned) one scalar block-table
    load serves the tile; otherwise each token gathers its own entry (repeated entries hit L1).
    Contiguous (varlen with cu_seqlens_k): row ``kv_first + pos``.
    """
    if PAGED:
        if PAGE % BLOCK_N == 0:
            page = tl.load(bt_row + start // PAGE).to(tl.int64)
        else:
            page = tl.load(bt_row + pos // PAGE).to(tl.int64)
        return page * stride_b + (pos % PAGE).to(tl.int64) * stride_p
    else:
        return (kv_first + pos).to(tl.int64) * stride_p


@triton.jit
def _tile(acc, m_i, l_i, start, q, q_pos, k_base, v_base, bt_row, kv_first, kv_len,
          stride_b, stride_p, offs_d, qk_scale, cap, window, alibi,
          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
          PAGED: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
          HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over the key tile [start, start + BLOCK_N).

    ``alibi``: each row's ALiBi slope times log2(e) (used when HAS_ALIBI): the logit of key ``p``
    for a row at position ``q_pos`` loses ``slope * |q_pos - p|``. It is a bias, not a mask, so
    the unmasked body pays it too.
    """
    pos = start + tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    if MASKED:
        # Keys past the end read the last valid row instead of being predicated off: the scores
        # mask drops them (p = 0 times a finite value), and unpredicated loads keep the tile in
        # the pipeline's shared-memory buffers without per-vector predicate registers.
        rows = kv_row_offsets(bt_row, kv_first, start, tl.minimum(pos, kv_len - 1), kv_len, stride_b, stride_p,
                              PAGE, BLOCK_N, PAGED)
    else:
        rows = kv_row_offsets(bt_row, kv_first, start, pos, kv_len, stride_b, stride_p, PAGE, BLOCK_N, PAGED)
    k_ptrs = k_base + rows[:, None] + offs_d[None, :]
    v_ptrs = v_base + rows[:, None] + offs_d[None, :]
    if HEAD_DIM != D_PAD:
        k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    k = k.to(q.dtype)  # a no-op unless the cache is fp8
    v = v.to(q.dtype)

    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if HAS_SOFTCAP:
        s = cap * _tanh(s * qk_scale)
    else:
        s = s * qk_scale
    if HAS_ALIBI:
        s = s - alibi[:, None] * tl.abs(q_pos[:, None] - pos[None, :]).to(tl.float32)
    if MASKED:
        visible = (pos < kv_len)[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] >= q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row whose scores so far are all -inf (no key visible yet, or visible keys scoring -inf: an
    # infinite q or k) keeps m = -inf; subtracting it would give NaN (-inf - -inf), in the body too:
    # a tile of -inf scores before the row's finite ones would poison a row that SDPA answers.
    # Its -inf scores weigh nothing (l stays 0); finish_rows tells a row that saw keys (NaN, as
    # SDPA's softmax of only -inf scores) from one that saw none (zeros).
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def attend_tiles(acc, m_i, l_i, q, q_pos, k_base, v_base, bt_row, kv_first, lo, hi, kv_len,
                 stride_b, stride_p, offs_d, qk_scale, cap, window, alibi,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGED: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, PRECISION: tl.constexpr,
                 NUM_STAGES: tl.constexpr, INTERPRET: tl.constexpr):
    """Online softmax of the query rows ``q`` over key tiles [lo, hi) (lo tile-aligned).

    MASKED=False promises every (row, key) pair of every tile is visible and every key < kv_len:
    no masks and no load predicates. ``q_pos`` holds each row's absolute position (for the
    causal and window masks). Under the interpreter the loop is a ``while``: its ``range`` turns
    the bounds into Python ints through ``int(ndarray of shape (1,))``, an error on NumPy 2; the
    compiled kernel keeps ``tl.range``, which the software pipeliner needs.
    """
    if INTERPRET:
        start = lo
        while start < hi:
            acc, m_i, l_i = _tile(acc, m_i, l_i, start, q, q_pos, k_base, v_base, bt_row, kv_first, kv_len,
                                  stride_b, stride_p, offs_d, qk_scale, cap, window, alibi,
                                  HEAD_DIM, D_PAD, PAGE, BLOCK_N, PAGED, MASKED, CAUSAL, HAS_WINDOW,
                                  HAS_SOFTCAP, HAS_ALIBI, PRECISION)
            start += BLOCK_N
    else:
        for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
            acc, m_i, l_i = _tile(acc, m_i, l_i, start, q, q_pos, k_base, v_base, bt_row, kv_first, kv_len,
                                  stride_b, stride_p, offs_d, qk_scale, cap, window, alibi,
                                  HEAD_DIM, D_PAD, PAGE, BLOCK_N, PAGED, MASKED, CAUSAL, HAS_WINDOW,
                                  HAS_SOFTCAP, HAS_ALIBI, PRECISION)
    return acc, m_i, l_i


@triton.jit
def finish_rows(acc, l_i, v_scale, sees):
    """Normalised rows of the online softmax: ``v_scale * acc / l``, and where ``l == 0`` zero for
    a row that sees no key, NaN for one that does (``v_scale``: a quantized cache's V scale for
    this KV head, else 1; ``sees``: per row, whether any key is visible to it).

    ``l == 0`` means no visible key had a score above -inf. A row that sees none outputs zeros,
    even when a masked-off value in a loaded tile is NaN or Inf (``p = 0`` times it would be NaN).
    A row whose visible keys all score -inf (an infinite q or k) is NaN, as SDPA's softmax of only
    -inf scores is: an Inf input is never turned into zeros. A NaN ``l`` (a NaN score) is not
    zero, so the row stays NaN: non-finite inputs reach the rows that see them, as in SDPA.
    """
    l_zero = l_i == 0.0
    blank = tl.where(sees, float("nan"), 0.0)
    return tl.where(l_zero[:, None], blank[:, None], acc * (v_scale / tl.where(l_zero, 1.0, l_i))[:, None])


@triton.jit
def key_ranges(kv_len, min_qpos, max_qpos, window, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr):
    """(k_lo, k_hi, body_lo, body_hi) for query rows at positions [min_qpos, max_qpos].

    Keys [k_lo, k_hi) are visible to some row (k_lo tile-aligned); tiles in [body_lo, body_hi)
    are visible to every row (both tile-aligned, body_lo <= body_hi). Negative intermediates are
    clamped before any division: compiled Triton truncates integer division, the interpreter floors.
    """
    k_hi = kv_len
    f_hi = kv_len
    if CAUSAL:
        k_hi = tl.minimum(kv_len, max_qpos + 1)
        f_hi = tl.minimum(kv_len, min_qpos + 1)
    k_hi = tl.maximum(k_hi, 0)
    f_hi = tl.maximum(f_hi, 0)
    k_lo = kv_len * 0
    f_lo = kv_len * 0
    if HAS_WINDOW:
        k_lo = tl.maximum(min_qpos - window, 0)
        f_lo = tl.maximum(max_qpos - window, 0)
    k_lo = (k_lo // BLOCK_N) * BLOCK_N
    body_lo = ((f_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    body_hi = tl.maximum((f_hi // BLOCK_N) * BLOCK_N, body_lo)
    return k_lo, k_hi, body_lo, body_hi


@triton.jit
def attend_range(acc, m_i, l_i, q, q_pos, k_base, v_base, bt_row, kv_first, s0, s1, body_lo, body_hi, kv_len,
                 stride_b, stride_p, offs_d, qk_scale, cap, window, alibi,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, PRECISION: tl.constexpr,
                 NUM_STAGES: tl.constexpr, TAIL_STAGES: tl.constexpr, INTERPRET: tl.constexpr):
    """Keys [s0, s1) (s0 tile-aligned) as masked head, unmasked body and masked tail.

    Head and tail hold at most two tiles each (a window's first tiles; the causal diagonal of a
    BLOCK_Q-token tile or a sequence's last partial tile). The head is not software-pipelined;
    without a window it is empty (body_lo == 0) and not compiled.

    ``TAIL_STAGES`` picks how the tail runs, for the sake of registers (occupancy): 0 folds it
    into the body loop (which then masks every tile), n >= 1 runs it as its own loop with n
    pipeline stages. The best choice depends on the tile shape; compiled for sm90 (bf16, GQA 8,
    head dim 128, 64-key tiles) the decode kernel needs per thread: page 16: 120 registers with
    a 1-stage tail, 108 folded, 96 with a 3-stage tail; page 64: 80 folded, 136 with a 3-stage tail.
    """
    if HAS_WINDOW:
        acc, m_i, l_i = attend_tiles(acc, m_i, l_i, q, q_pos, k_base, v_base, bt_row, kv_first,
                                     s0, tl.minimum(s1, body_lo), kv_len, stride_b, stride_p, offs_d,
                                     qk_scale, cap, window, alibi, HEAD_DIM, D_PAD, PAGE, BLOCK_N, PAGED, True, CAUSAL,
                                     HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, PRECISION, 1, INTERPRET)
    if TAIL_STAGES == 0:
        acc, m_i, l_i = attend_tiles(acc, m_i, l_i, q, q_pos, k_base, v_base, bt_row, kv_first,
                                     tl.maximum(s0, body_lo), s1, kv_len, stride_b, stride_p,
                                     offs_d, qk_scale, cap, window, alibi, HEAD_DIM, D_PAD, PAGE, BLOCK_N, PAGED, True,
                                     CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, PRECISION, NUM_STAGES, INTERPRET)
    else:
        acc, m_i, l_i = attend_tiles(acc, m_i, l_i, q, q_pos, k_base, v_base, bt_row, kv_first,
                                     tl.maximum(s0, body_lo), tl.minimum(s1, body_hi), kv_len, stride_b,
                                     stride_p, offs_d, qk_scale, cap, window, alibi, HEAD_DIM, D_PAD, PAGE, BLOCK_N,
                                     PAGED, False, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, PRECISION, NUM_STAGES,
                                     INTERPRET)
        acc, m_i, l_i = attend_tiles(acc, m_i, l_i, q, q_pos, k_base, v_base, bt_row, kv_first,
                                     tl.maximum(s0, body_hi), s1, kv_len, stride_b, stride_p, offs_d,
                                     qk_scale, cap, window, alibi, HEAD_DIM, D_PAD, PAGE, BLOCK_N, PAGED, True, CAUSAL,
                                     HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, PRECISION, TAIL_STAGES, INTERPRET)
    return acc, m_i, l_i


#: The mode the kernels above were decorated in (see _mode.sync_interpreter_mode).
INTERPRETED = bool(triton.knobs.runtime.interpret)
