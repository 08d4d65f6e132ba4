"""Launchers: a kernel with its grid and compile-time constants fixed, with no grid lambda, no
per-call constexpr dict and no config lookup.

Each launcher has two ways in. ``bind(...)`` returns the per-layer prepared call
``attend(q, out)`` (or ``write(key, value)``) with the caches, the step's metadata tensors, the
strides and the softmax constants already in its argument tuple, launched through the compiled
kernel's own launcher (``direct.py``): the eager op between CUDA-graph replays pays one closure
frame and the C launcher, not Triton's binder. ``__call__`` is the unprepared form for the public
entry points, which reads strides per call and goes through ``JITFunction.run``.

Optional tensors a kernel does not use (no ALiBi, an unquantized cache) are passed as another
tensor of the call: the kernel's constexpr flags compile their loads away.
"""
from __future__ import annotations

import math

import torch

from . import _mode, decode, kv_write, unified
from .direct import make_launch
from .config import DecodeConfig, UnifiedConfig, merges_in_kernel, next_pow2, precision

LOG2E = 1.4426950408889634


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

    def args(self) -> tuple:
        return self.qk_scale, self.cap, self.window


def _launch_kwargs(grid: tuple[int, ...], **constexprs) -> dict:
    return dict(constexprs, grid=grid, warmup=False)


def _or(tensor, stand_in):
    return stand_in if tensor is None else tensor


class KVWriteLaunch:
    """The KV-write kernel for one (token count, layer shape, page size)."""

    __slots__ = ("run", "kwargs")

    def __init__(self, num_slots: int, num_kv_heads: int, head_dim: int, block_size: int, quantize: bool = False):
        d_pad = next_pow2(head_dim)
        heads = min(next_pow2(num_kv_heads), max(1, 4096 // d_pad))
        grid = (num_slots, math.ceil(num_kv_heads / heads))
        self.run = kv_write.kv_write_kernel.run if num_slots else None
        self.kwargs = _launch_kwargs(grid, BLOCK_SIZE=block_size, HEADS=heads, HEAD_DIM=head_dim, D_PAD=d_pad,
                                     QUANT=quantize, num_warps=4)

    def __call__(self, key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        """Key/value may be strided views (a fused projection); the head dim must be unit-stride."""
        if self.run is None:
            return
        kc, vc = key_cache.stride(), value_cache.stride()
        self.run(key, value, key_cache, value_cache, slot_mapping, _or(k_scale, slot_mapping),
                 _or(v_scale, slot_mapping), key.shape[1], key.stride(0), key.stride(1),
                 value.stride(0), value.stride(1), kc[0], kc[1], kc[2], vc[0], vc[1], vc[2], **self.kwargs)

    def bind(self, key_cache, value_cache, slot_mapping, kv_scales=None):
        """``write(key, value)`` for one layer's caches and the step's slot mapping (and a quantized
        cache's ``(k_scale, v_scale)``)."""
        if self.run is None:
            return lambda key, value: None
        kc, vc = key_cache.stride(), value_cache.stride()
        cache_strides = (kc[0], kc[1], kc[2], vc[0], vc[1], vc[2])
        k_scale, v_scale = kv_scales if kv_scales is not None else (slot_mapping, slot_mapping)
        # key, value, their head count and strides may differ per call (a fused projection's views)
        # The likely first call: unquantized, key/value of the cache's dtype; a fused projection's
        # views have other row strides, but every supported head dim is a multiple of 16, so
        # Triton specializes them alike.
        _, _, kv_heads, head_dim = key_cache.shape
        expect = None if self.kwargs["QUANT"] else (key_cache.dtype, key_cache.dtype, kv_heads, kv_heads * head_dim,
                                                    head_dim, kv_heads * head_dim, head_dim)
        run = make_launch(kv_write.kv_write_kernel, self.kwargs,
                          (None, None, key_cache, value_cache, slot_mapping, k_scale, v_scale, None, None, None, None,
                           None, *cache_strides), (0, 1, 7, 8, 9, 10, 11), expect)

        def write(key, value):
            if key.stride(2) != 1 or value.stride(2) != 1:  # the kernel reads a head's dims at unit stride
                key, value = key.contiguous(), value.contiguous()
            run(key, value, key.shape[1], key.stride(0), key.stride(1), value.stride(0), value.stride(1))

        return write


class FreshScratch:
    """Split-KV scratch for ``DecodeLaunch``, made per call: ``partials(rows, d_pad)`` -> (fp32
    partial outputs, their log2-sum-exp), ``arrivals(pairs)`` -> int32 counters, zero (the public
    functional API and benchmarks; a prepared call uses the builder's persistent buffers)."""

    def __init__(self, device):
        self.device = device

    def partials(self, rows: int, d_pad: int):
        return (torch.empty((rows, d_pad), dtype=torch.float32, device=self.device),
                torch.empty((rows,), dtype=torch.float32, device=self.device))

    def arrivals(self, pairs: int):
        return torch.zeros((pairs,), dtype=torch.int32, device=self.device)


class DecodeLaunch:
    """The decode kernel for one layer shape and batch shape; with split keys, the merge of the
    partials either inside that launch or in the combine kernel after it (``merges_in_kernel``).
    ``scratch``: a ``FreshScratch`` or anything with its two methods."""

    __slots__ = ("run", "kwargs", "combine_run", "combine_kwargs", "splits", "sm", "o_part", "lse_part",
                 "arrivals", "dtype")

    def __init__(self, cfg: DecodeConfig, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, sm: Softmax, splits: int, scratch, has_alibi: bool = False,
                 kv_scaled: bool = False):
        d_pad = next_pow2(head_dim)
        self.splits = splits
        self.sm = sm
        self.dtype = dtype
        self.run = decode.decode_kernel.run
        merged = merges_in_kernel(splits)
        self.kwargs = _launch_kwargs(
            (num_seqs, num_kv_heads, splits), GROUP=num_heads // num_kv_heads, BLOCK_M=cfg.block_m,
            HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=block_size, BLOCK_N=cfg.block_n, SPLIT=splits > 1, MERGE=merged,
            HAS_WINDOW=sm.has_window, HAS_SOFTCAP=sm.has_softcap, HAS_ALIBI=has_alibi, KV_SCALED=kv_scaled,
            PRECISION=precision(dtype), NUM_STAGES=cfg.num_stages, TAIL_STAGES=cfg.tail_stages,
            INTERPRET=_mode.interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        self.o_part = self.lse_part = self.arrivals = self.combine_run = self.combine_kwargs = None
        if splits > 1:
            self.o_part, self.lse_part = scratch.partials(num_seqs * num_heads * splits, d_pad)
        if merged:
            self.arrivals = scratch.arrivals(num_seqs * num_kv_heads)
        elif splits > 1:
            self.combine_run = decode.combine_kernel.run
            self.combine_kwargs = _launch_kwargs((num_seqs, num_heads), HEAD_DIM=head_dim, D_PAD=d_pad,
                                                 SPLITS_PAD=next_pow2(splits),
                                                 num_warps=4 if d_pad * splits <= 4096 else 8)

    def _tail(self, key_cache, cu_q, seq_lens, block_table, q_strides, out_strides, alibi, kv_scales) -> tuple:
        """Arguments after (q, k_cache, v_cache, out): ``value_cache`` must have ``key_cache``'s
        strides (one row offset serves both). ``cu_q`` stands in for scratch a launch does not
        use (the SPLIT and MERGE flags compile those accesses away)."""
        sk = key_cache.stride()
        k_scale, v_scale = kv_scales if kv_scales is not None else (cu_q, cu_q)
        scratch = (_or(self.o_part, cu_q), _or(self.lse_part, cu_q), _or(self.arrivals, cu_q))
        return (*scratch, cu_q, seq_lens, block_table, _or(alibi, cu_q), k_scale, v_scale, q_strides[0],
                q_strides[1], out_strides[0], out_strides[1], sk[0], sk[1], sk[2], block_table.stride(0),
                *self.sm.args())

    def __call__(self, q, key_cache, value_cache, out, cu_q, seq_lens, block_table, alibi=None,
                 kv_scales=None) -> None:
        tail = self._tail(key_cache, cu_q, seq_lens, block_table, q.stride(), out.stride(), alibi, kv_scales)
        self.run(q, key_cache, value_cache, out, *tail, **self.kwargs)
        if self.combine_run is not None:
            self.combine_run(out, self.o_part, self.lse_part, cu_q, seq_lens, out.stride(0), out.stride(1),
                             self.splits, **self.combine_kwargs)

    def bind(self, key_cache, value_cache, cu_q, seq_lens, block_table, num_heads: int, head_dim: int,
             alibi=None, kv_scales=None):
        """``attend(q, out)`` for contiguous (tokens, num_heads, head_dim) q and out."""
        strides = (num_heads * head_dim, head_dim)
        tail = self._tail(key_cache, cu_q, seq_lens, block_table, strides, strides, alibi, kv_scales)
        run = make_launch(decode.decode_kernel, self.kwargs, (None, key_cache, value_cache, None, *tail), (0, 3),
                          (self.dtype, self.dtype))
        if self.combine_run is None:
            return run  # attend(q, out) itself: no frame in between
        combine = make_launch(decode.combine_kernel, self.combine_kwargs,
                              (None, self.o_part, self.lse_part, cu_q, seq_lens, strides[0], strides[1], self.splits),
                              (0,),
                              (self.dtype,))

        def attend_split(q, out):
            run(q, out)
            combine(out)

        return attend_split


class UnifiedLaunch:
    """Unified varlen kernel for one layer shape and one (tokens, sequences) shape."""

    __slots__ = ("run", "kwargs", "num_seqs", "sm", "paged", "dtype")

    def __init__(self, cfg: UnifiedConfig, num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, dtype: torch.dtype, sm: Softmax, causal: bool, paged: bool,
                 has_seq_lens: bool, has_alibi: bool = False, kv_scaled: bool = False):
        self.num_seqs = num_seqs
        self.sm = sm
        self.paged = paged
        self.dtype = dtype
        grid = (num_tokens // cfg.block_q + num_seqs, num_kv_heads)
        self.run = None if grid[0] == 0 else unified.unified_kernel.run
        self.kwargs = _launch_kwargs(
            grid, GROUP=num_heads // num_kv_heads, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_q, HEAD_DIM=head_dim,
            D_PAD=next_pow2(head_dim), PAGE=block_size, BLOCK_N=cfg.block_n, PAGED=paged,
            HAS_SEQ_LENS=has_seq_lens, CAUSAL=causal, HAS_WINDOW=sm.has_window, HAS_SOFTCAP=sm.has_softcap,
            HAS_ALIBI=has_alibi, KV_SCALED=kv_scaled, PRECISION=precision(dtype), NUM_STAGES=cfg.num_stages,
            INTERPRET=_mode.interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def _tail(self, k, cu_q, cu_k, seq_lens, block_table, q_strides, out_strides, alibi, kv_scales) -> tuple:
        """Arguments after (q, k, v, out): ``v`` must have ``k``'s strides."""
        sk = k.stride()
        if self.paged:
            kb, kp, kh, bt_stride = sk[0], sk[1], sk[2], block_table.stride(0)
        else:  # (tokens, kv_heads, head_dim): no page stride; block_table is an unused pointer
            kb, kp, kh, bt_stride = 0, sk[0], sk[1], 0
            block_table = cu_q
        k_scale, v_scale = kv_scales if kv_scales is not None else (cu_q, cu_q)
        return (cu_q, _or(cu_k, cu_q), _or(seq_lens, cu_q), block_table, self.num_seqs, _or(alibi, cu_q), k_scale,
                v_scale, q_strides[0], q_strides[1], out_strides[0], out_strides[1], kb, kp, kh, bt_stride,
                *self.sm.args())

    def __call__(self, q, k, v, out, cu_q, cu_k, seq_lens, block_table, alibi=None, kv_scales=None) -> None:
        if self.run is not None:
            self.run(q, k, v, out, *self._tail(k, cu_q, cu_k, seq_lens, block_table, q.stride(), out.stride(),
                                               alibi, kv_scales), **self.kwargs)

    def bind(self, key_cache, value_cache, cu_q, seq_lens, block_table, num_heads: int, head_dim: int,
             alibi=None, kv_scales=None):
        """``attend(q, out)`` over the paged caches for contiguous (tokens, heads, head_dim) q/out."""
        if self.run is None:
            return lambda q, out: None
        strides = (num_heads * head_dim, head_dim)
        tail = self._tail(key_cache, cu_q, None, seq_lens, block_table, strides, strides, alibi, kv_scales)
        run = make_launch(unified.unified_kernel, self.kwargs, (None, key_cache, value_cache, None, *tail), (0, 3),
                          (self.dtype, self.dtype))

        def attend(q, out):
            run(q, out)

        return attend
