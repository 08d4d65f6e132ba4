"""``TritonBackend``: own Triton kernels for the KV write, paged decode and varlen attention.

Per step, ``plan`` picks the path: the decode kernel (GQA-packed, split-KV) when every sequence
has one query token (``is_uniform_decode``, which includes padding sequences), the unified
varlen kernel otherwise. A mixed batch runs entirely through the unified kernel rather than
decode kernel + unified kernel on the two halves: splitting would make a grid depend on
``num_decodes``, which is not fixed per capture size, and the unified kernel already reads each
KV tile once per KV head for a decode row (its cost there is only idle tensor-core rows).

What depends on the layer (head counts, head dim, dtype, window, softcap) is bound on the first
``forward`` of each layer shape in a step (``_LayerRun``) and reused by every other layer of
that shape, so ``forward`` is a dict lookup plus two or three kernel launches. Nothing in
``forward`` reads a device tensor on the host, and every grid is a function of
``metadata.num_tokens``/``num_seqs`` and the layer shape: the whole thing can be captured in a
CUDA graph and replayed with new lengths and block tables in the persistent metadata buffers.
"""
from __future__ import annotations

import logging

import torch

from ...kv_cache import SUPPORTED_HEAD_DIMS
from ..base import AttentionBackend
from . import _mode
from .config import Tuning, decode_config, num_splits, sm_count, unified_config
from .launch import DecodeLaunch, Softmax, UnifiedLaunch, kv_write_launcher, write_kv

logger = logging.getLogger("compileattn")


def _last_dim_contiguous(*tensors) -> bool:
    return all(t.stride(-1) == 1 for t in tensors)


class TritonBackend(AttentionBackend):
    name = "triton"
    cuda_graph_capturable = True

    def __init__(self, device_type: str = "cpu"):
        super().__init__(device_type)
        if device_type == "cpu":
            _mode.sync_interpreter_mode()
        #: Heuristic overrides (tests force split counts and tile sizes; benchmarks sweep them).
        self.tuning = Tuning()

    # -- support ----------------------------------------------------------------------------

    def unsupported_reason(self, spec, dtype, device, block_size) -> str | None:
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return "CUDA is not available"
            if torch.cuda.get_device_capability(device) < (8, 0):
                return "the Triton kernels need compute capability 8.0+ (bf16 tensor-core dots)"
        elif device.type == "cpu":
            if not _mode.interpreting():
                return "Triton runs on the CPU only under TRITON_INTERPRET=1"
            if dtype == torch.bfloat16:
                return "the Triton interpreter's bf16 tl.dot is wrong; use float16/float32 on the CPU"
        else:
            return f"no Triton target for device type {device.type!r}"
        if spec.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim {spec.head_dim} not in {SUPPORTED_HEAD_DIMS}"
        if block_size < 1:
            return f"block_size {block_size} < 1"
        return None

    def _sm_count(self, device: torch.device) -> int:
        return sm_count(device.type, device.index if device.type == "cuda" else None)

    # -- per step ---------------------------------------------------------------------------

    def plan(self, metadata, buffers) -> "_StepPlan":
        if metadata.device.type == "cpu":
            _mode.sync_interpreter_mode()
        return _StepPlan(self, metadata, buffers)

    def _plan(self, metadata) -> "_StepPlan":
        plan = metadata.plans.get(self)
        return plan if plan is not None else metadata.plan_for(self)

    def forward(self, query, key, value, output, cache, metadata) -> None:
        self._plan(metadata).forward(query, key, value, output, cache)

    def write_layer_kv(self, key, value, cache, metadata) -> None:
        run = self._plan(metadata).layer(cache.spec, cache.key_cache.dtype)
        run.write_kv(key, value, cache.key_cache, cache.value_cache)

    def attend(self, query, output, cache, metadata) -> None:
        run = self._plan(metadata).layer(cache.spec, cache.key_cache.dtype)
        run.attention(query, output, cache.key_cache, cache.value_cache)

    # -- public primitives (functional API; not the per-layer hot path) ----------------------

    def write_kv_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        if not _last_dim_contiguous(key, value, key_cache, value_cache):
            from ..reference import ReferenceBackend

            ReferenceBackend().write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
            return
        launcher = kv_write_launcher(slot_mapping.shape[0], key.shape[1], key.shape[2], key_cache.shape[1])
        write_kv(launcher, key, value, key_cache, value_cache, slot_mapping)

    def varlen_attention(self, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                         max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, softcap) -> None:
        """Paged with max_seqlen_q == 1 runs the decode kernel, everything else the unified one
        (contiguous K/V included: the tile loader addresses rows ``cu_seqlens_k[s] + pos``)."""
        if not _last_dim_contiguous(q, k, v, out) or k.stride() != v.stride():
            tmp = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self.varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), tmp, cu_seqlens_q, cu_seqlens_k,
                                  seqused_k, block_table, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                  window_left, softcap)
            out.copy_(tmp)
            return
        num_seqs = cu_seqlens_q.shape[0] - 1
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k.shape[-2]
        paged = block_table is not None
        sm = Softmax(float(softmax_scale), float(softcap), int(window_left))
        if num_seqs > 0 and max_seqlen_q > 0:
            if paged and max_seqlen_q == 1:
                launch = self._decode_launch(num_seqs, num_heads, kv_heads, head_dim, k.shape[1], q.dtype, sm,
                                             q.device, _fresh_scratch(q.device))
                launch(q, k, v, out, cu_seqlens_q, seqused_k, block_table)
            else:
                cfg = unified_config(num_heads // kv_heads, head_dim, q.dtype, self.tuning)
                launch = UnifiedLaunch(cfg, num_tokens, num_seqs, num_heads, kv_heads, head_dim,
                                       k.shape[1] if paged else 1, q.dtype, sm, bool(causal), paged,
                                       seqused_k is not None)
                launch(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)
        # Rows past the last sequence belong to nobody and are zero (the reference's contract);
        # done on the device so the call stays free of host syncs.
        if num_tokens:
            tail = torch.arange(num_tokens, device=q.device) >= cu_seqlens_q[-1]
            out.masked_fill_(tail.view(-1, 1, 1), 0)

    def _decode_launch(self, num_seqs, num_heads, kv_heads, head_dim, block_size, dtype, sm, device, scratch):
        cfg = decode_config(num_heads // kv_heads, head_dim, dtype, block_size, self.tuning)
        splits = num_splits(num_seqs, kv_heads, self._sm_count(device), self.tuning)
        return DecodeLaunch(cfg, num_seqs, num_heads, kv_heads, head_dim, block_size, dtype, sm, splits, scratch)


def _fresh_scratch(device):
    def scratch(rows: int, d_pad: int):
        return (torch.empty((rows, d_pad), dtype=torch.float32, device=device),
                torch.empty((rows,), dtype=torch.float32, device=device))
    return scratch


def _persistent_scratch(buffers):
    """Split-KV partials in the step's persistent buffers: a captured graph keeps their address.
    Named by size, so every capture size gets its own and none is ever reallocated."""
    def scratch(rows: int, d_pad: int):
        return (buffers.get(f"triton.o_part.{rows}x{d_pad}", (rows, d_pad), torch.float32),
                buffers.get(f"triton.lse_part.{rows}", (rows,), torch.float32))
    return scratch


class _StepPlan:
    """One step's decisions; layer-shape-specific launchers are bound on first use."""

    __slots__ = ("backend", "decode", "num_seqs", "num_tokens", "block_size", "device", "slot_mapping",
                 "cu_q", "seq_lens", "block_table", "buffers", "_layers")

    def __init__(self, backend: TritonBackend, md, buffers):
        self.backend = backend
        self.decode = md.is_uniform_decode
        self.num_seqs = md.num_seqs
        self.num_tokens = md.num_tokens
        self.block_size = md.block_size
        self.device = md.device
        self.slot_mapping = md.slot_mapping
        self.cu_q = md.query_start_loc
        self.seq_lens = md.seq_lens
        self.block_table = md.block_table
        self.buffers = buffers
        self._layers: dict[int, _LayerRun] = {}

    @property
    def path(self) -> str:
        return "decode" if self.decode else "unified"

    def layer(self, spec, dtype) -> "_LayerRun":
        run = self._layers.get(id(spec))
        if run is None or run.spec is not spec or run.dtype is not dtype:
            run = self._layers[id(spec)] = _LayerRun(self, spec, dtype)
        return run

    def forward(self, query, key, value, output, cache) -> None:
        self.layer(cache.spec, cache.key_cache.dtype)(query, key, value, output, cache.key_cache,
                                                      cache.value_cache)


class _LayerRun:
    """KV write + attention launchers bound for one layer shape in one step."""

    __slots__ = ("spec", "dtype", "write", "attend", "plan", "decode")

    def __init__(self, plan: _StepPlan, spec, dtype):
        self.spec = spec
        self.dtype = dtype
        self.plan = plan
        self.decode = plan.decode
        backend = plan.backend
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        sm = Softmax(spec.scale, spec.softcap, spec.sliding_window)
        self.write = kv_write_launcher(plan.num_tokens, kvh, d, plan.block_size)
        if plan.decode:
            self.attend = backend._decode_launch(plan.num_seqs, h, kvh, d, plan.block_size, dtype, sm, plan.device,
                                                 _persistent_scratch(plan.buffers))
        else:
            cfg = unified_config(h // kvh, d, dtype, backend.tuning)
            self.attend = UnifiedLaunch(cfg, plan.num_tokens, plan.num_seqs, h, kvh, d, plan.block_size, dtype, sm,
                                        spec.causal, paged=True, has_seq_lens=True)
        if plan.decode:
            logger.debug("triton decode: %d seqs x %d kv heads x %d splits", plan.num_seqs, kvh, self.attend.splits)

    def __call__(self, q, k, v, out, key_cache, value_cache) -> None:
        self.write_kv(k, v, key_cache, value_cache)
        self.attention(q, out, key_cache, value_cache)

    def write_kv(self, k, v, key_cache, value_cache) -> None:
        if k.stride(2) != 1 or v.stride(2) != 1:
            k, v = k.contiguous(), v.contiguous()
        write_kv(self.write, k, v, key_cache, value_cache, self.plan.slot_mapping)

    def attention(self, q, out, key_cache, value_cache) -> None:
        if q.stride(2) != 1 or out.stride(2) != 1:
            tmp = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self.attention(q.contiguous(), tmp, key_cache, value_cache)
            out.copy_(tmp)
            return
        plan = self.plan
        if self.decode:
            self.attend(q, key_cache, value_cache, out, plan.cu_q, plan.seq_lens, plan.block_table)
        else:
            self.attend(q, key_cache, value_cache, out, plan.cu_q, None, plan.seq_lens, plan.block_table)

