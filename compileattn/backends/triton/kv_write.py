"""Scatter this step's K/V rows into the paged caches.

Grid ``(num_slots, cdiv(kv_heads, HEADS))``: one program copies HEADS heads of one token, for
key and value both. Slot -1 (a padded token) stores nothing; it is a mask, not a branch, so the
grid and the instruction stream do not depend on the data. Any block size works: slot ``s`` is
row ``s % block_size`` of page ``s // block_size``, addressed through the cache strides.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_write_kernel(key, value, key_cache, value_cache, slot_mapping, num_kv_heads,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_kcb, stride_kcp, stride_kch, stride_vcb, stride_vcp, stride_vch,
                    BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    tok = tl.program_id(0)
    offs_h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    offs_d = tl.arange(0, D_PAD)
    slot = tl.load(slot_mapping + tok)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :] & (slot >= 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    page = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    tok64 = tok.to(tl.int64)
    k = tl.load(key + tok64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value + tok64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(key_cache + page * stride_kcb + row * stride_kcp + offs_h[:, None] * stride_kch + offs_d[None, :],
             k, mask=mask)
    tl.store(value_cache + page * stride_vcb + row * stride_vcp + offs_h[:, None] * stride_vch + offs_d[None, :],
             v, mask=mask)

#: The mode the kernels above were decorated in (see _mode.sync_interpreter_mode).
INTERPRETED = bool(triton.knobs.runtime.interpret)
