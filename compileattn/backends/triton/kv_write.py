"""Scatter this step's K/V rows into the paged caches.

Grid ``(num_slots, cdiv(kv_heads, HEADS))``: one program copies HEADS heads of one token, for
key and value both. Slot -1 (a padded token) stores nothing; it is a mask, not a branch, so the
grid and the instruction stream do not depend on the data. Any block size works: slot ``s`` is
row ``s % block_size`` of page ``s // block_size``, addressed through the cache strides.
Into a float8_e4m3fn cache (``QUANT``) it stores ``x / scale`` per KV head, saturated to +-448
and rounded to nearest even, as ``backends/kv_write.quantize`` does.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(x):
    """fp32 ``x`` (|x| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32: the cast
    to fp8 that follows is then exact. Done here rather than left to the cast because Triton's
    interpreter rounds fp8 downcasts without carrying into the exponent (1.9375 * 2**k becomes
    2**k, not 2**(k+1)); the GPU's own conversion would round the same way as this.

    The e4m3 spacing at ``x`` is ``2**(e - 3)`` for an exponent e >= -6 and ``2**-9`` below (the
    subnormals). Adding and subtracting ``c = 1.5 * 2**(k + 23)`` rounds to a multiple of ``2**k``
    with the fp32 adder's own round-to-nearest-even (|x| < 2**(k + 4) keeps x + c in c's binade);
    a result of zero takes x's sign (``x * 0``), as the cast would give it.
    """
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = tl.maximum(exponent, -6) - 3
    c = (((k + 150) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    rounded = (x + c) - c
    return tl.where(rounded == 0.0, x * 0.0, rounded)


@triton.jit
def kv_write_kernel(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, num_kv_heads,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_kcb, stride_kcp, stride_kch, stride_vcb, stride_vcp, stride_vch,
                    BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    QUANT: tl.constexpr):
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
    if QUANT:
        h_ok = offs_h < num_kv_heads
        # NaN stays NaN (clamp's default min/max would make it finite), as in the torch writer: a NaN
        # in K/V must reach the rows that attend to it
        k = tl.clamp(k.to(tl.float32) / tl.load(k_scale + offs_h, mask=h_ok, other=1.0)[:, None], -448.0, 448.0,
                     propagate_nan=tl.PropagateNan.ALL)
        v = tl.clamp(v.to(tl.float32) / tl.load(v_scale + offs_h, mask=h_ok, other=1.0)[:, None], -448.0, 448.0,
                     propagate_nan=tl.PropagateNan.ALL)
        # e4m3fn's NaN written as such: Triton's interpreter casts a NaN to a finite 384
        nan = tl.full((HEADS, D_PAD), 0x7F, tl.uint8).to(key_cache.dtype.element_ty, bitcast=True)
        k = tl.where(k != k, nan, round_to_e4m3(k).to(key_cache.dtype.element_ty))
        v = tl.where(v != v, nan, round_to_e4m3(v).to(value_cache.dtype.element_ty))
    tl.store(key_cache + page * stride_kcb + row * stride_kcp + offs_h[:, None] * stride_kch + offs_d[None, :],
             k, mask=mask)
    tl.store(value_cache + page * stride_vcb + row * stride_vcp + offs_h[:, None] * stride_vch + offs_d[None, :],
             v, mask=mask)

#: The mode the kernels above were decorated in (see _mode.sync_interpreter_mode).
INTERPRETED = bool(triton.knobs.runtime.interpret)
