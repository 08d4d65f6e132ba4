"""A PagedAttention-V1/V2-style decode kernel: the "before" of the change compileattn grew out of.

That change moved GQA decode in a serving engine from PagedAttention V1/V2 to FlashAttention's
``flash_attn_with_kvcache``. This is a benchmark peer with that kernel family's structure, written
here in Triton so its table can be reproduced beside compileattn on any GPU (it is not a
compileattn backend, and it is not vLLM's CUDA code):

- **one program per (sequence, query head)**: no GQA packing. Each program loads the K and V of
  its query head's KV head, so a KV head is read ``num_heads / num_kv_heads`` times (once per
  query head of its group); the dot products run on CUDA cores (one query row, no ``tl.dot``).
- **V2 partitioning**: with ``partition_size`` set, each sequence's context is cut into
  partitions of that many tokens, one program each, and a reduce kernel merges their partial
  outputs by their max logit and exp-sum. vLLM's V2 uses 512-token partitions.
- ``use_v1``: vLLM's rule for which of the two it runs, ``max_seq_len <= 8192 and
  (partitions == 1 or num_seqs * num_heads > 512)`` (``vllm/attention/ops/paged_attn.py``).

One difference in the arithmetic, not in the memory traffic: vLLM's V1 keeps a partition's logits
in shared memory and makes two passes over them; this kernel uses the one-pass online softmax.
Both read each K and V element of the context once per query head.

Layout: caches (num_blocks, page, kv_heads, head_dim) as compileattn's (vLLM's own V1/V2 caches
split the head dim into 16-byte vectors; that changes coalescing, not the bytes read).
Runs on CUDA and, for the tests, under ``TRITON_INTERPRET=1`` (fp16/fp32).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

#: vLLM's V2 partition size (tokens per program).
V2_PARTITION = 512
#: Keys per loop iteration of one program (a tile of the gathered rows).
BLOCK_N = 32


def use_v1(max_seq_len: int, num_seqs: int, num_heads: int, partition: int = V2_PARTITION) -> bool:
    """vLLM's choice between V1 and V2 (see the module docstring)."""
    partitions = -(-max_seq_len // partition)
    return max_seq_len <= 8192 and (partitions == 1 or num_seqs * num_heads > 512)


@triton.jit
def _keys(acc, m_i, l_i, start, hi, q, k_base, v_base, bt_row, offs_d, d_ok, stride_kb, stride_kp,
          PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """Online softmax of one query row over keys [start, min(start + BLOCK, hi)), each key's row
    gathered through the block table; dot products as multiply-and-sum (CUDA cores)."""
    pos = start + tl.arange(0, BLOCK)
    ok = pos < hi
    page = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
    rows = page * stride_kb + (pos % PAGE).to(tl.int64) * stride_kp
    mask = ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.where(ok, tl.sum(k * q[None, :], 1), -float("inf"))  # log2-domain logits
    m_new = tl.maximum(m_i, tl.max(s, 0))
    p = tl.exp2(s - m_new)
    alpha = tl.exp2(m_i - m_new)
    v = tl.load(v_base + rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    return acc * alpha + tl.sum(p[:, None] * v, 0), m_new, l_i * alpha + tl.sum(p, 0)


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache, v_cache, out_ptr, m_part, l_part, o_part, seq_lens, block_table,
                            stride_qs, stride_qh, stride_kb, stride_kp, stride_kh, stride_bt, stride_os,
                            stride_oh, qk_scale, max_partitions,
                            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                            BLOCK: tl.constexpr, PARTITION: tl.constexpr, SPLIT: tl.constexpr,
                            INTERPRET: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    part = tl.program_id(2)
    kv_head = head // GROUP
    seq_len = tl.load(seq_lens + seq)
    if SPLIT:
        lo = part * PARTITION
        hi = tl.minimum(lo + PARTITION, seq_len)
    else:
        lo = seq_len * 0
        hi = seq_len

    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + head * stride_qh + offs_d, mask=d_ok, other=0.0)
    q = q.to(tl.float32) * qk_scale
    bt_row = block_table + seq.to(tl.int64) * stride_bt
    k_base = k_cache + kv_head * stride_kh
    v_base = v_cache + kv_head * stride_kh

    m_i = tl.full([], -float("inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    if INTERPRET:  # the interpreter's range() cannot take tensor bounds (see compileattn's tile.py)
        start = lo
        while start < hi:
            acc, m_i, l_i = _keys(acc, m_i, l_i, start, hi, q, k_base, v_base, bt_row, offs_d, d_ok, stride_kb,
                                  stride_kp, PAGE, BLOCK)
            start += BLOCK
    else:
        for start in tl.range(lo, hi, BLOCK):
            acc, m_i, l_i = _keys(acc, m_i, l_i, start, hi, q, k_base, v_base, bt_row, offs_d, d_ok, stride_kb,
                                  stride_kp, PAGE, BLOCK)

    if SPLIT:
        idx = (seq * tl.num_programs(1) + head).to(tl.int64) * max_partitions + part
        tl.store(m_part + idx, m_i)
        tl.store(l_part + idx, l_i)
        tl.store(o_part + idx * D_PAD + offs_d, acc)
    else:
        out = tl.where(l_i > 0.0, acc / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
        tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
                 out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _reduce_kernel(out_ptr, m_part, l_part, o_part, seq_lens, stride_os, stride_oh, max_partitions,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PARTITION: tl.constexpr, PARTS_PAD: tl.constexpr):
    """V2's reduce: out = sum_p 2^(m_p - M) o_p / sum_p 2^(m_p - M) l_p over the sequence's partitions."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.cdiv(tl.load(seq_lens + seq), PARTITION)
    offs_p = tl.arange(0, PARTS_PAD)
    offs_d = tl.arange(0, D_PAD)
    p_ok = offs_p < parts
    base = (seq * tl.num_programs(1) + head).to(tl.int64) * max_partitions
    m = tl.load(m_part + base + offs_p, mask=p_ok, other=-float("inf"))
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == -float("inf"), 0.0, m_max)
    w = tl.where(p_ok, tl.exp2(m - m_max), 0.0)
    l_sum = tl.sum(w * tl.load(l_part + base + offs_p, mask=p_ok, other=0.0), 0)
    o = tl.load(o_part + (base + offs_p)[:, None] * D_PAD + offs_d[None, :], mask=p_ok[:, None], other=0.0)
    res = tl.sum(o * w[:, None], 0)
    res = tl.where(l_sum > 0.0, res / tl.where(l_sum > 0.0, l_sum, 1.0), 0.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
             res.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


class PagedAttentionBaseline:
    """The kernel bound to one decode shape: ``call(q, k_cache, v_cache, out)`` for q/out
    (num_seqs, num_heads, head_dim) and the ``seq_lens`` / ``block_table`` given here.

    ``partition_size``: None = V1 (one program per head over the whole context), an int = V2 with
    partitions of that many tokens (a multiple of BLOCK_N); ``max_seq_len`` sizes V2's grid (a
    host value, as vLLM passes it). ``variant`` says which it is.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page: int, seq_lens: torch.Tensor,
                 block_table: torch.Tensor, scale: float, max_seq_len: int, partition_size: int | None):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if partition_size is not None and (partition_size < BLOCK_N or partition_size % BLOCK_N):
            raise ValueError(f"partition_size must be a positive multiple of {BLOCK_N}, got {partition_size}")
        self.seq_lens, self.block_table = seq_lens, block_table
        self.num_seqs = seq_lens.shape[0]
        self.num_heads, self.head_dim = num_heads, head_dim
        self.d_pad = 1 << (head_dim - 1).bit_length()
        self.split = partition_size is not None
        self.partition = partition_size if self.split else BLOCK_N  # V1: unused
        self.max_partitions = max(1, -(-max_seq_len // self.partition)) if self.split else 1
        self.variant = f"V2 ({partition_size}-token partitions)" if self.split else "V1"
        self.constexprs = dict(GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, D_PAD=self.d_pad, PAGE=page,
                               BLOCK=BLOCK_N, PARTITION=self.partition, SPLIT=self.split,
                               INTERPRET=bool(triton.knobs.runtime.interpret), num_warps=4 if self.d_pad <= 128 else 8)
        self.qk_scale = scale * 1.4426950408889634  # log2(e): the kernel works in exp2
        rows = self.num_seqs * num_heads * self.max_partitions
        dev = seq_lens.device
        if self.split:
            self.m_part = torch.empty(rows, dtype=torch.float32, device=dev)
            self.l_part = torch.empty(rows, dtype=torch.float32, device=dev)
            self.o_part = torch.empty(rows, self.d_pad, dtype=torch.float32, device=dev)
        else:
            self.m_part = self.l_part = self.o_part = seq_lens  # unused pointers

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
            raise ValueError("k_cache and v_cache must share strides with a unit-stride head dim")
        sk = k_cache.stride()
        grid = (self.num_seqs, self.num_heads, self.max_partitions)
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, self.m_part, self.l_part, self.o_part, self.seq_lens, self.block_table,
            q.stride(0), q.stride(1), sk[0], sk[1], sk[2], self.block_table.stride(0), out.stride(0), out.stride(1),
            self.qk_scale, self.max_partitions, **self.constexprs)
        if self.split:
            _reduce_kernel[(self.num_seqs, self.num_heads)](
                out, self.m_part, self.l_part, self.o_part, self.seq_lens, out.stride(0), out.stride(1),
                self.max_partitions, HEAD_DIM=self.head_dim, D_PAD=self.d_pad, PARTITION=self.partition,
                PARTS_PAD=max(2, 1 << (self.max_partitions - 1).bit_length()), num_warps=4)


def baseline_for(num_heads: int, num_kv_heads: int, head_dim: int, page: int, seq_lens: torch.Tensor,
                 block_table: torch.Tensor, max_seq_len: int, scale: float | None = None,
                 variant: str = "auto", partition_size: int = V2_PARTITION) -> PagedAttentionBaseline:
    """The baseline as vLLM would run it for this batch (``variant="auto"``: ``use_v1``), or
    forced to ``"v1"``/``"v2"``."""
    if variant not in ("auto", "v1", "v2"):
        raise ValueError(f"variant must be auto, v1 or v2, got {variant!r}")
    if variant == "auto":
        variant = "v1" if use_v1(max_seq_len, seq_lens.shape[0], num_heads, partition_size) else "v2"
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    return PagedAttentionBaseline(num_heads, num_kv_heads, head_dim, page, seq_lens, block_table, scale, max_seq_len,
                                  partition_size if variant == "v2" else None)
