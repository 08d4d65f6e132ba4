"""``TritonBackend``: own Triton kernels for the KV write, paged decode and varlen attention.

Per step shape, ``prepare_attend`` picks the kernel: the decode kernel (GQA-packed, split-KV)
when every sequence has one query token (``uniform_decode``, which includes padding sequences),
the unified varlen kernel otherwise. A mixed batch runs entirely through the unified kernel
rather than decode kernel + unified kernel on the two halves: splitting would make a grid depend
on the number of decodes, which is not fixed per capture size, and the unified kernel already
reads each KV tile once per KV head for a decode row (its cost there is only idle tensor-core
rows). Every grid is a function of the step shape and the layer shape, and no prepared call reads
a device tensor on the host: the calls can be captured in a CUDA graph and replayed with new
lengths and block tables in the persistent metadata buffers.

Launch configurations are memoised per (layer shape, dtype, step shape), so a step shape seen
before costs one dict lookup per layer kind plus binding each layer's caches.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Sequence

import torch

from ...kv_cache import SUPPORTED_HEAD_DIMS, is_fp8
from ..base import AttentionBackend
from ..kv_write import write_kv_padded
from . import _mode
from .autotune import DEFAULT_CONTEXTS, Candidate, DecodeAutotuner, DecodeShape, candidates, cuda_graph_timer
from .config import DecodeConfig, Tuning, decode_config, fills_waves, num_splits, sm_count, unified_config
from .launch import DecodeLaunch, FreshScratch, KVWriteLaunch, Softmax, UnifiedLaunch

_MEMO_SIZE = 512

logger = logging.getLogger("compileattn")


def _last_dim_contiguous(*tensors) -> bool:
    return all(t.stride(-1) == 1 for t in tensors)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy with the row-major strides of its shape where it has others (then K and V
    of one shape get equal strides). Not ``contiguous()``: it hands back as it is a tensor torch
    calls contiguous whose strides still differ over a size-1 dim (MQA's K/V cut from a (kv_heads,
    seq, head_dim) layout), or an empty one with any strides. A dense paged cache is not copied."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= max(size, 1)
    return t if t.stride() == tuple(reversed(strides)) else t.clone(memory_format=torch.contiguous_format)


class TritonBackend(AttentionBackend):
    name = "triton"
    capturable = True

    def __init__(self, device_type: str = "cpu"):
        super().__init__(device_type)
        if device_type == "cpu":
            _mode.sync_interpreter_mode()
        #: Heuristic overrides (tests force split counts and tile sizes; benchmarks sweep them).
        self.tuning = Tuning()
        #: ``enable_autotune``'s tuner of decode launches; None: the heuristics.
        self.autotuner: DecodeAutotuner | None = None
        self._launches: dict[tuple, object] = {}

    def enable_autotune(self, cache_dir: str | None = None, contexts: Sequence[int] = DEFAULT_CONTEXTS,
                        timer: Callable[[Callable[[int], None]], float] | None = None) -> DecodeAutotuner:
        """Time each decode shape's heuristic launch and its neighbours at plan time and keep the
        fastest over ``contexts`` keys per sequence (``autotune.py``); choices cached in
        ``cache_dir`` when given. Call it before the engine plans its steps: calls already
        prepared and bound keep their configuration.
        ``timer``: µs per call of ``fn(i)`` (default: inside a CUDA graph; required off CUDA,
        where timing the interpreter would measure nothing)."""
        if timer is None and self.device_type != "cuda":
            raise ValueError("autotuning times kernels on a GPU: pass timer= to autotune on "
                             f"device type {self.device_type!r}")
        self.autotuner = DecodeAutotuner(cache_dir, contexts, timer or cuda_graph_timer)
        return self.autotuner

    def disable_autotune(self) -> None:
        """The heuristics for decode shapes planned from now on."""
        self.autotuner = None

    # -- support ----------------------------------------------------------------------------

    def unsupported_reason(self, spec, dtype, device, block_size, cache_dtype=None) -> str | None:
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return "CUDA is not available"
            if torch.cuda.get_device_capability(device) < (8, 0):
                return "the Triton kernels need compute capability 8.0+ (bf16 tensor-core dots)"
            if is_fp8(cache_dtype) and torch.cuda.get_device_capability(device) < (8, 9):
                return "an fp8 KV cache needs compute capability 8.9+ (Triton's e4m3 conversions)"
        elif device.type == "cpu":
            if not _mode.interpreting():
                return "Triton runs on the CPU only under TRITON_INTERPRET=1"
            if dtype == torch.bfloat16:
                return "the Triton interpreter's bf16 tl.dot is wrong; use float16/float32 on the CPU"
        else:
            return f"no Triton target for device type {device.type!r}"
        if spec.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim {spec.head_dim} not in {SUPPORTED_HEAD_DIMS}"
        return None

    # -- prepared calls (per step shape) ----------------------------------------------------

    def _memo(self, key, make):
        launch = self._launches.get(key)
        if launch is None:
            if len(self._launches) >= _MEMO_SIZE:
                self._launches.clear()
            launch = self._launches[key] = make()
        return launch

    def prepare_attend(self, shape, tensors, spec, dtype, key_cache, value_cache, buffers, kv_scales=None):
        has_alibi, scaled = spec.alibi_slopes is not None, kv_scales is not None
        if shape.uniform_decode:
            # Kept with the builder's buffers: the launch holds their split-KV scratch, and this
            # backend instance serves every builder in the process (two engines must not share it).
            # Keyed by everything ``_decode_launch`` plans from, the autotuner's timed contexts
            # included: they depend on the layer cache's block count, so layers of one spec whose
            # caches differ in size may be tuned to different launches.
            contexts = (self.autotuner.timed_contexts(shape.num_seqs, key_cache.shape[0], shape.block_size)
                        if self.autotuner is not None else None)
            launch = buffers.memo(("triton.decode", spec, dtype, scaled, shape.num_seqs, shape.block_size,
                                   key_cache.device, self.tuning, self.autotuner, contexts),
                                  lambda: self._decode_launch(shape.num_seqs, spec.num_heads, spec.num_kv_heads,
                                                              spec.head_dim, shape.block_size, dtype, _softmax(spec),
                                                              key_cache.device, _PersistentScratch(buffers),
                                                              has_alibi, scaled, (key_cache, value_cache)))
        else:
            launch = self._memo(("unified", spec, dtype, scaled, shape.num_tokens, shape.num_seqs, shape.block_size,
                                 key_cache.device, self.tuning),
                                lambda: UnifiedLaunch(unified_config(spec.group_size, spec.head_dim, dtype, self.tuning),
                                                      shape.num_tokens, shape.num_seqs, spec.num_heads,
                                                      spec.num_kv_heads, spec.head_dim, shape.block_size, dtype,
                                                      _softmax(spec), spec.causal, paged=True, has_seq_lens=True,
                                                      has_alibi=has_alibi, kv_scaled=scaled))
        alibi = buffers.constant(spec.alibi_slopes) if has_alibi else None
        return launch.bind(key_cache, value_cache, tensors.query_start_loc, tensors.seq_lens, tensors.block_table,
                           spec.num_heads, spec.head_dim, alibi, kv_scales)

    def prepare_write(self, shape, tensors, spec, key_cache, value_cache, kv_scales=None):
        """``write(key, value)`` for one layer: the KV-write kernel with the step's slot mapping
        (quantizing into an fp8 cache with ``kv_scales``)."""
        quant = kv_scales is not None
        launch = self._memo(("write", shape.num_tokens, spec.num_kv_heads, spec.head_dim, shape.block_size, quant),
                            lambda: KVWriteLaunch(shape.num_tokens, spec.num_kv_heads, spec.head_dim,
                                                  shape.block_size, quant))
        return launch.bind(key_cache, value_cache, tensors.slot_mapping, kv_scales)

    # -- public primitives (functional API; not the per-layer hot path) ----------------------

    def write_kv_cache(self, key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        if not _last_dim_contiguous(key, value, key_cache, value_cache):  # the kernel assumes a unit-stride head dim
            write_kv_padded(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
            return
        KVWriteLaunch(slot_mapping.shape[0], key.shape[1], key.shape[2], key_cache.shape[1], k_scale is not None)(
            key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)

    def varlen_attention(self, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                         max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, softcap,
                         alibi_slopes=None, k_scale=None, v_scale=None) -> None:
        """Paged with max_seqlen_q == 1 runs the decode kernel, everything else the unified one
        (contiguous K/V included: the tile loader addresses rows ``cu_seqlens_k[s] + pos``)."""
        if not _last_dim_contiguous(q, k, v, out) or k.stride() != v.stride():
            q, k, v = (_dense(t) for t in (q, k, v))
            tmp = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self.varlen_attention(q, k, v, tmp, cu_seqlens_q, cu_seqlens_k,
                                  seqused_k, block_table, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                  window_left, softcap, alibi_slopes, k_scale, v_scale)
            out.copy_(tmp)
            return
        num_seqs = cu_seqlens_q.shape[0] - 1
        if num_seqs <= 0 or max_seqlen_q <= 0:
            return
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k.shape[-2]
        paged = block_table is not None
        sm = Softmax(float(softmax_scale), float(softcap), int(window_left))
        has_alibi = alibi_slopes is not None
        kv_scales = (k_scale, v_scale) if k_scale is not None else None
        if paged and max_seqlen_q == 1:
            launch = self._decode_launch(num_seqs, num_heads, kv_heads, head_dim, k.shape[1], q.dtype, sm,
                                         q.device, FreshScratch(q.device), has_alibi, kv_scales is not None, (k, v))
            launch(q, k, v, out, cu_seqlens_q, seqused_k, block_table, alibi_slopes, kv_scales)
        else:
            cfg = unified_config(num_heads // kv_heads, head_dim, q.dtype, self.tuning)
            launch = UnifiedLaunch(cfg, num_tokens, num_seqs, num_heads, kv_heads, head_dim,
                                   k.shape[1] if paged else 1, q.dtype, sm, bool(causal), paged,
                                   seqused_k is not None, has_alibi, kv_scales is not None)
            launch(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes, kv_scales)

    def _decode_launch(self, num_seqs, num_heads, kv_heads, head_dim, block_size, dtype, sm, device, buffers,
                       has_alibi=False, kv_scaled=False, caches=None):
        """``caches``: the layer's (key, value) caches, which the autotuner's trial step reads."""
        index = device.index if device.type == "cuda" else None
        sms = sm_count(device.type, index)

        def plan(tuning: Tuning) -> tuple[DecodeConfig, int]:
            cfg = decode_config(num_heads // kv_heads, head_dim, dtype, block_size, tuning,
                                fills_waves(num_seqs, kv_heads, sms))
            return cfg, num_splits(num_seqs, kv_heads, sms, tuning)

        def launch(tuning: Tuning, scratch) -> DecodeLaunch:
            cfg, splits = plan(tuning)
            return DecodeLaunch(cfg, num_seqs, num_heads, kv_heads, head_dim, block_size, dtype, sm, splits, scratch,
                                has_alibi, kv_scaled)

        tuning = self.tuning
        if self.autotuner is not None and caches is not None and not _capturing(device):
            tuner = self.autotuner
            shape = DecodeShape(_device_name(device), num_seqs, num_heads, kv_heads, head_dim, block_size, str(dtype),
                                str(caches[0].dtype), has_alibi, kv_scaled,
                                f"window={sm.has_window} softcap={sm.has_softcap}", self.tuning)
            contexts = tuner.timed_contexts(num_seqs, caches[0].shape[0], block_size)
            if contexts != tuner.contexts:
                logger.info("decode autotune: %d sequences timed at %s keys, not %s: the layer's KV cache holds %d "
                            "blocks of %d", num_seqs, contexts, tuner.contexts, caches[0].shape[0], block_size)
            tuning = tuner.cached(shape, contexts)
            if tuning is None:
                try:
                    trial = _TrialStep(shape, dtype, *caches, contexts)
                except torch.OutOfMemoryError as exc:  # plan time may come when the KV cache holds the memory
                    logger.warning("decode autotune: no memory for the trial step (%s); the heuristic serves", exc)
                    return launch(self.tuning, buffers)

                def knobs(t: Tuning) -> Tuning:
                    cfg, splits = plan(t)
                    return dataclasses.replace(t, decode_block_n=cfg.block_n, decode_num_warps=cfg.num_warps,
                                               decode_num_stages=cfg.num_stages, decode_tail_stages=cfg.tail_stages,
                                               num_splits=splits)

                tuning = tuner.tuning_for(shape, candidates(self.tuning, *plan(self.tuning)),
                                          lambda t: trial.candidate(launch(t, FreshScratch(device))), contexts, knobs)
        return launch(tuning, buffers)


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)


def _capturing(device: torch.device) -> bool:
    """Inside a CUDA-graph capture nothing may be tuned (allocations, a synchronize): a shape
    first planned inside one keeps the heuristic for good (its launch is memoized). compileattn's
    captures run each graph's function once before capturing it (``GraphPool.capture``), which
    plans, and tunes, its shapes outside the capture."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _TrialStep:
    """The autotuner's two steps for one decode shape (``autotune.py`` says why two):

    - the check: every sequence at up to ``CHECK_KEYS`` keys over a small private random cache
      (pages reused across sequences), the output filled with NaN first;
    - the timed steps, one per context: every sequence at that many keys over the layer's own
      caches, read only (no cache-sized allocation: plan time may come when the KV cache holds
      the GPU's memory), call ``i`` reading the ``i % rotations``-th set of pages, enough sets to
      pass twice the L2 cache between two reads of a page where the cache has that many pages.
    """

    CHECK_KEYS = 256
    #: At most this many keys of random pages in the check's private cache (whatever the page size).
    CHECK_POOL_KEYS = 1024

    def __init__(self, shape: DecodeShape, dtype: torch.dtype, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 contexts: Sequence[int]):
        n, page, device = shape.num_seqs, shape.block_size, key_cache.device
        gen = torch.Generator(device=device).manual_seed(0)
        kvh, d = shape.num_kv_heads, shape.head_dim
        self.q = torch.randn(n, shape.num_heads, d, generator=gen, device=device).to(dtype)
        self.out = torch.empty_like(self.q)
        self.cu_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.alibi = torch.linspace(0.5, 0.01, shape.num_heads, device=device) if shape.has_alibi else None
        self.kv_scales = (torch.full((kvh,), 0.02, device=device),
                          torch.full((kvh,), 0.02, device=device)) if shape.kv_scaled else None
        # the check: at most CHECK_KEYS keys of pages, in the query's dtype (randn has no fp8)
        check_keys = min(min(contexts), self.CHECK_KEYS)
        check_pages = -(-check_keys // page)
        pool = max(1, min(n * check_pages, self.CHECK_POOL_KEYS // page))
        self.check_k = torch.randn(pool, page, kvh, d, generator=gen, device=device, dtype=dtype).to(key_cache.dtype)
        self.check_v = torch.randn(pool, page, kvh, d, generator=gen, device=device, dtype=dtype).to(key_cache.dtype)
        self.check_lens = torch.full((n,), check_keys, dtype=torch.int32, device=device)
        self.check_table = (torch.arange(n * check_pages, dtype=torch.int32, device=device) % pool).view(n, -1)
        # the timed steps (``contexts`` fit the cache: DecodeAutotuner.timed_contexts)
        self.k, self.v = key_cache, value_cache
        blocks = key_cache.shape[0]
        l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
        self.lens, self.tables = {}, {}
        for context in contexts:
            pages = -(-context // page)
            step_bytes = 2 * n * pages * page * kvh * d * key_cache.element_size()
            wanted = max(1, min(16, -(-2 * l2 // step_bytes)))
            rotations = max(1, min(wanted, blocks // (n * pages)))
            if rotations < wanted:
                logger.info("decode autotune: the layer's KV cache (%d blocks) is under twice the L2 cache for %d "
                            "sequences at %d keys: their pages are read again after %d calls, partly from L2",
                            blocks, n, context, rotations)
            self.lens[context] = torch.full((n,), context, dtype=torch.int32, device=device)
            self.tables[context] = [((r * n * pages + torch.arange(n * pages, dtype=torch.int32, device=device))
                                     % blocks).view(n, pages) for r in range(rotations)]

    def candidate(self, launch: DecodeLaunch) -> Candidate:
        def check() -> torch.Tensor:
            self.out.fill_(float("nan"))
            launch(self.q, self.check_k, self.check_v, self.out, self.cu_q, self.check_lens, self.check_table,
                   self.alibi, self.kv_scales)
            return self.out

        def timed(context: int, i: int) -> None:
            tables = self.tables[context]
            launch(self.q, self.k, self.v, self.out, self.cu_q, self.lens[context], tables[i % len(tables)],
                   self.alibi, self.kv_scales)

        return Candidate(check, timed)


@functools.lru_cache(maxsize=256)
def _softmax(spec) -> Softmax:
    return Softmax(spec.scale, spec.softcap, spec.sliding_window)


class _PersistentScratch:
    """Split-KV partials and arrival counters that keep their address for the builder's lifetime
    (a captured graph reads them). Named by size, so every capture size gets its own and none is
    reallocated; the counters start at zero and every launch leaves them at zero. Launches that
    share a buffer must run in stream order (they do: one builder's layers run on one stream); two
    at once would mix their partials and, through the counters, every later merge."""

    def __init__(self, buffers):
        self.buffers = buffers

    def partials(self, rows: int, d_pad: int):
        return (self.buffers.get(f"triton.o_part.{rows}x{d_pad}", (rows, d_pad), torch.float32),
                self.buffers.get(f"triton.lse_part.{rows}", (rows,), torch.float32))

    def arrivals(self, pairs: int):
        return self.buffers.get(f"triton.split_arrivals.{pairs}", (pairs,), torch.int32)
