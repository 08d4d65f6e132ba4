"""Launchers: a kernel with its grid and compile-time constants bound once, and the three
launch sequences (KV write, decode + combine, unified) shared by the per-step plan and the
public entry points.

A bound launcher calls ``JITFunction.run`` directly with a prebuilt keyword dict: no grid lambda,
no per-call constexpr dict, no config lookup. The per-call Python left is the argument list
(pointers, strides, scalars) and Triton's own binder.
"""
from __future__ import annotations

import math

import torch

from . import _mode, decode, kv_write, unified
from .config import DecodeConfig, UnifiedConfig, next_pow2, precision

LOG2E = 1.4426950408889634


class Bound:
    """``kernel[grid](*args, **constexprs)`` with everything but ``args`` fixed."""

    __slots__ = ("run", "kwargs", "grid")

    def __init__(self, kernel, grid: tuple[int, ...], **constexprs):
        self.run = kernel.run
        self.grid = grid
        self.kwargs = dict(constexprs, grid=grid, warmup=False)

    def __call__(self, *args) -> None:
        self.run(*args, **self.kwargs)


class Softmax:
    """A layer's softmax settings as the kernels want them (log2 domain, flags)."""

    __slots__ = ("qk_scale", "cap", "window", "has_window", "has_softcap")

    def __init__(self, scale: float, softcap: float, window_left: int):
        self.has_softcap = softcap > 0
        self.has_window = window_left >= 0
        # With softcap, scores are cap * tanh(s * scale / softcap) in the log2 domain.
        self.qk_scale = scale / softcap if self.has_softcap else scale * LOG2E
        self.cap = softcap * LOG2E if self.has_softcap else 0.0
        self.window = max(window_left, 0)


def kv_write_launcher(num_slots: int, num_kv_heads: int, head_dim: int, block_size: int) -> Bound | None:
    if num_slots == 0:
        return None
    d_pad = next_pow2(head_dim)
    heads = min(next_pow2(num_kv_heads), max(1, 4096 // d_pad))
    grid = (num_slots, math.ceil(num_kv_heads / heads))
    return Bound(kv_write.kv_write_kernel, grid, BLOCK_SIZE=block_size, HEADS=heads, HEAD_DIM=head_dim,
                 D_PAD=d_pad, num_warps=4)


def write_kv(launcher: Bound | None, key, value, key_cache, value_cache, slot_mapping) -> None:
    if launcher is None:
        return
    kc, vc = key_cache.stride(), value_cache.stride()
    launcher(key, value, key_cache, value_cache, slot_mapping, key.shape[1], key.stride(0), key.stride(1),
             value.stride(0), value.stride(1), kc[0], kc[1], kc[2], vc[0], vc[1], vc[2])


class DecodeLaunch:
    """Decode kernel (and combine when split) for one layer shape and one batch shape."""

    __slots__ = ("attn", "combine", "splits", "sm", "o_part", "lse_part")

    def __init__(self, cfg: DecodeConfig, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, sm: Softmax, splits: int, scratch):
        d_pad = next_pow2(head_dim)
        self.splits = splits
        self.sm = sm
        self.attn = Bound(decode.decode_kernel, (num_seqs, num_kv_heads, splits), GROUP=num_heads // num_kv_heads,
                          BLOCK_M=cfg.block_m, HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=block_size,
                          BLOCK_N=cfg.block_n, SPLIT=splits > 1, HAS_WINDOW=sm.has_window,
                          HAS_SOFTCAP=sm.has_softcap, PRECISION=precision(dtype), NUM_STAGES=cfg.num_stages,
                          TAIL_STAGES=cfg.tail_stages, INTERPRET=_mode.interpreting(), num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages)
        self.combine = None
        self.o_part = self.lse_part = None
        if splits > 1:
            rows = num_seqs * num_heads * splits
            self.o_part, self.lse_part = scratch(rows, d_pad)
            self.combine = Bound(decode.combine_kernel, (num_seqs, num_heads), HEAD_DIM=head_dim, D_PAD=d_pad,
                                 SPLITS_PAD=next_pow2(splits), num_warps=4 if d_pad * splits <= 4096 else 8)

    def __call__(self, q, key_cache, value_cache, out, cu_q, seq_lens, block_table) -> None:
        """``value_cache`` must have ``key_cache``'s strides (one row offset serves both)."""
        sq, so, sk = q.stride(), out.stride(), key_cache.stride()
        sm = self.sm
        o_part = self.o_part if self.o_part is not None else out
        lse_part = self.lse_part if self.lse_part is not None else out
        self.attn(q, key_cache, value_cache, out, o_part, lse_part, cu_q, seq_lens, block_table,
                  sq[0], sq[1], so[0], so[1], sk[0], sk[1], sk[2], block_table.stride(0),
                  sm.qk_scale, sm.cap, sm.window)
        if self.combine is not None:
            self.combine(out, o_part, lse_part, cu_q, so[0], so[1], self.splits)


class UnifiedLaunch:
    """Unified varlen kernel for one layer shape and one (tokens, sequences) shape."""

    __slots__ = ("attn", "num_seqs", "sm", "paged")

    def __init__(self, cfg: UnifiedConfig, num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, dtype: torch.dtype, sm: Softmax, causal: bool, paged: bool,
                 has_seq_lens: bool):
        self.num_seqs = num_seqs
        self.sm = sm
        self.paged = paged
        grid = (num_tokens // cfg.block_q + num_seqs, num_kv_heads)
        self.attn = None if grid[0] == 0 else Bound(
            unified.unified_kernel, grid, GROUP=num_heads // num_kv_heads, BLOCK_M=cfg.block_m,
            BLOCK_Q=cfg.block_q, HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim), PAGE=block_size,
            BLOCK_N=cfg.block_n, PAGED=paged, HAS_SEQ_LENS=has_seq_lens, CAUSAL=causal,
            HAS_WINDOW=sm.has_window, HAS_SOFTCAP=sm.has_softcap, PRECISION=precision(dtype),
            NUM_STAGES=cfg.num_stages, INTERPRET=_mode.interpreting(), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)

    def __call__(self, q, k, v, out, cu_q, cu_k, seq_lens, block_table) -> None:
        """``v`` must have ``k``'s strides (one row offset serves both)."""
        if self.attn is None:
            return
        sq, so, sk = q.stride(), out.stride(), k.stride()
        sm = self.sm
        if self.paged:
            kb, kp, kh, bt_stride = sk[0], sk[1], sk[2], block_table.stride(0)
        else:  # (tokens, kv_heads, head_dim): no page stride
            kb, kp, kh, bt_stride = 0, sk[0], sk[1], 0
            block_table = cu_q  # unused pointer argument
        self.attn(q, k, v, out, cu_q, cu_k if cu_k is not None else cu_q,
                  seq_lens if seq_lens is not None else cu_q, block_table, self.num_seqs,
                  sq[0], sq[1], so[0], so[1], kb, kp, kh, bt_stride, sm.qk_scale, sm.cap, sm.window)
