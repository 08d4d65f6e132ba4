"""``flash``: FlashAttention (FA4 ``flash_attn.cute`` preferred, else FA2 ``flash_attn``) with the
per-layer call cut down to a KV-cache write and one direct kernel launch.

``forward`` runs eagerly once per layer per step, between CUDA-graph replays, so its CPU cost is
paid L times a step. Everything that depends only on shapes and configuration is therefore done in
``plan`` (once per step) or once per kernel key and cached across steps: the FA4 compiled kernel
and its argument list (see ``flash_fa4``), the metadata tensors bound into that list, the KV-write
indices. ``forward`` is then: write K/V, one dict lookup, one call.

The KV-cache write. Slot -1 marks a padded token, which must write nothing; a capturable torch
scatter cannot skip elements, and ``index_copy_`` raises on -1. Preferred writer: the triton
backend's KV-write kernel (one launch for K and V that masks slot -1), bound once per step and
layer kind through its launcher (``triton.launch.kv_write_launcher``/``write_kv``, else its public
``write_kv_cache``), when importable. Otherwise the torch writer sends every padded token to the
slot of a real token *with that token's values*
(``dst = slot of token j, src = j``), so the duplicate writes in one ``index_copy_`` carry identical
bytes and the result does not depend on their order; nothing outside the step's real slots is
touched and no host sync or data-dependent shape is needed. Per step, ``plan`` computes
``dst``/``src`` once (the builder puts padding after the real tokens, so ``j`` = token 0); per layer
it is two ``index_select`` + two ``index_copy_``. The public ``write_kv_cache`` op, whose slot
mapping may have -1 anywhere (or only -1), computes the same indices on the device per call.

Selection knobs (constructor arguments, or the environment for the registry-built instance):
``COMPILEATTN_FLASH_CALL`` = ``compiled`` (default: the FA4 compiled kernel object) or
``public`` (FA4's Python entry every call, for debugging and measurement). A third mode that
called the bare TVM-FFI function behind the compiled object was tried and removed: it saved two
Python frames but its output differed from FA4's entry on the H200.
``COMPILEATTN_FLASH_KV_WRITE`` = ``auto`` | ``triton`` | ``torch``; ``COMPILEATTN_FLASH_IMPL`` =
``auto`` | ``fa4`` | ``fa2``.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

from .base import AttentionBackend

logger = logging.getLogger("compileattn")

CALL_MODES = ("compiled", "public")
KV_WRITERS = ("auto", "triton", "torch")
#: Learned kernels kept per backend; mixed steps add one key per distinct max query length.
_MAX_TEMPLATES = 1024
#: Layer kinds bound ahead in every plan; a model has a handful, tests make many.
_MAX_SEEN = 32
_UNKNOWN = object()


def padded_write_indices(slot_mapping: torch.Tensor):
    """``(dst, src, any_valid)`` on the device for a slot mapping with -1 anywhere (see module doc).

    Every token ``t`` writes ``value[src[t]]`` to ``dst[t]``: itself for a real token, the first
    real token ``j`` for a padded one. ``any_valid`` (shape (1,)) is False when every slot is -1;
    then ``dst`` is 0 and the caller must write the slot's current contents back.
    """
    n = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    first = valid.to(torch.uint8).argmax().view(1)  # first real token, 0 if none
    tokens = torch.arange(n, device=slot_mapping.device)
    src = torch.where(valid, tokens, first)
    dst = torch.where(valid, slot_mapping, slot_mapping.index_select(0, first)).clamp_(min=0)
    return dst, src, valid.index_select(0, first)


def write_kv_any(key, value, key_cache, value_cache, slot_mapping) -> None:
    """The public write for any slot mapping (-1 anywhere, or only -1), without a host sync."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    dst, src, any_valid = padded_write_indices(slot_mapping)
    for new, cache in ((key[:n], key_cache), (value[:n], value_cache)):
        flat = cache.view(-1, *cache.shape[2:])
        # all -1: write slot 0's current rows back onto it, i.e. change nothing
        rows = torch.where(any_valid.view(1, 1, 1), new.index_select(0, src), flat.index_select(0, dst))
        flat.index_copy_(0, dst, rows)


def step_write_indices(slot_mapping: torch.Tensor, num_actual_tokens: int, dst: torch.Tensor,
                       src: torch.Tensor) -> None:
    """Fill ``dst``/``src`` (views of persistent buffers) for a builder-made step, once per step.

    Relies on the builder's layout: tokens ``[num_actual_tokens, num_tokens)`` are the padding and
    token 0 is real, so padded tokens repeat token 0's write. Two small device ops and one
    host-to-device copy, no sync.
    """
    n = slot_mapping.shape[0]
    dst.copy_(slot_mapping)
    host_src = torch.arange(n, dtype=torch.int64)
    if num_actual_tokens < n:
        dst[num_actual_tokens:].copy_(slot_mapping[:1].expand(n - num_actual_tokens))
        host_src[num_actual_tokens:] = 0
    src.copy_(host_src, non_blocking=True)


def write_kv_torch(key, value, key_cache, value_cache, dst, src) -> None:
    """Scatter K/V rows ``src`` to flat slots ``dst``; capturable (no sync, shapes fixed by tokens)."""
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, dst, key.index_select(0, src))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, dst, value.index_select(0, src))


def _load_impl(preference: str):
    """The FA4 or FA2 glue object, FA4 first; ImportError with every reason if neither works."""
    from . import flash_fa2, flash_fa4  # noqa: PLC0415

    order = {"auto": ("fa4", "fa2"), "fa4": ("fa4",), "fa2": ("fa2",)}.get(preference)
    if order is None:
        raise ValueError(f"COMPILEATTN_FLASH_IMPL / impl must be auto, fa4 or fa2, got {preference!r}")
    reasons, found = [], []
    for name in order:
        try:
            found.append(flash_fa4.FA4Impl() if name == "fa4" else flash_fa2.FA2Impl())
        except ImportError as exc:
            reasons.append(str(exc))
    if not found:
        raise ImportError("no FlashAttention is usable: " + "; ".join(reasons))
    if len(found) == 2 and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
        return found[1]  # FA4 pages K/V only on SM90+; on an A100 with both installed FA2 runs
    return found[0]


def _write_kv_triton(write_kv, launcher, key, value, key_cache, value_cache, slot_mapping) -> None:
    if key.stride(-1) == 1 and value.stride(-1) == 1:
        write_kv(launcher, key, value, key_cache, value_cache, slot_mapping)
    else:  # the kernel assumes a unit-stride head dim
        write_kv_any(key, value, key_cache, value_cache, slot_mapping)


class _Step:
    """One step's plan: what every layer's ``forward`` reads, built once in ``plan``."""

    __slots__ = ("calls", "tensors", "max_q", "num_seqs", "num_tokens", "block_size",
                 "slot_mapping", "kv_idx", "cu_k", "max_k")

    def __init__(self):
        #: id(spec) -> (attn_fn, attn_tail, dtype, write_fn, write_tail, spec) for layers of that spec:
        #: ``write_fn(key, value, k_cache, v_cache, *write_tail)`` then
        #: ``attn_fn(query, k_cache, v_cache, output, *attn_tail)``.
        self.calls: dict[int, tuple] = {}


class FlashBackend(AttentionBackend):
    name = "flash"
    #: The direct FA4 call, the FA2 call (max_seqlen_k bounded by the block table) and both KV
    #: writers launch fixed grids for a fixed token count and never read device memory on the host.
    #: Warm each capture size up once before capturing: FA4 compiles (and is learned) on first use.
    cuda_graph_capturable = True

    def __init__(self, device_type: str = "cuda", *, impl: str | None = None, call_mode: str | None = None,
                 kv_writer: str | None = None):
        super().__init__(device_type)
        self.impl = _load_impl(impl or os.environ.get("COMPILEATTN_FLASH_IMPL", "auto"))
        self.is_fa4 = self.impl.name == "FlashAttention-4"
        self.call_mode = call_mode or os.environ.get("COMPILEATTN_FLASH_CALL", "compiled")
        if self.call_mode not in CALL_MODES:
            raise ValueError(f"call_mode must be one of {CALL_MODES}, got {self.call_mode!r}")
        self.kv_writer = kv_writer or os.environ.get("COMPILEATTN_FLASH_KV_WRITE", "auto")
        if self.kv_writer not in KV_WRITERS:
            raise ValueError(f"kv_writer must be one of {KV_WRITERS}, got {self.kv_writer!r}")
        self._writer = None  # ("torch",) | ("bound", launch module) | ("public", write_kv_cache)
        self._templates: dict[tuple, object] = {}  # FA4 kernel key -> Template | None (public entry)
        self._seen: dict[int, tuple] = {}  # id(spec) -> (spec, dtype) of layers run so far
        self._warned: set[str] = set()

    # -- support -------------------------------------------------------------------------------

    def unsupported_reason(self, spec, dtype, device, block_size) -> str | None:
        return self.impl.unsupported_reason(spec, dtype, torch.device(device), block_size)

    # -- per step ------------------------------------------------------------------------------

    def writer_kind(self) -> str:
        """Which KV writer ``forward`` uses: "triton" (bound launcher), "triton-public" or "torch"."""
        if self._writer is None:
            self._writer = ("torch",)
            if self.kv_writer in ("auto", "triton"):
                from .registry import get_backend  # noqa: PLC0415

                try:
                    triton_backend = get_backend("triton", "cuda")
                    launch = importlib.import_module(".triton.launch", __package__)
                except Exception as exc:  # noqa: BLE001  (a half-installed triton is a reason, not a crash)
                    if self.kv_writer == "triton":
                        raise ImportError(f"kv_writer='triton' but the triton backend is unusable: {exc}") from exc
                    logger.info("flash backend: triton KV writer unavailable (%s); using the torch writer", exc)
                else:
                    if hasattr(launch, "kv_write_launcher") and hasattr(launch, "write_kv"):
                        self._writer = ("bound", launch)
                    else:
                        self._writer = ("public", triton_backend.write_kv_cache)
        return {"bound": "triton", "public": "triton-public", "torch": "torch"}[self._writer[0]]

    def plan(self, metadata, buffers):
        if metadata.device.type != "cuda":
            return None
        step = _Step()
        n = step.num_tokens = metadata.num_tokens
        step.max_q = metadata.max_query_len
        step.num_seqs = metadata.num_seqs
        step.block_size = metadata.block_size
        step.slot_mapping = metadata.slot_mapping
        step.tensors = {"cu_q": metadata.query_start_loc, "used_k": metadata.seq_lens,
                        "table": metadata.block_table}
        # The builder sizes its buffers for max_num_tokens; ours follow (same address every step).
        cap = metadata.slot_mapping.untyped_storage().nbytes() // metadata.slot_mapping.element_size()
        step.kv_idx = None
        if self.writer_kind() == "torch":
            dst = buffers.get("flash.kv_dst", (cap,), torch.int64)[:n]
            src = buffers.get("flash.kv_src", (cap,), torch.int64)[:n]
            step_write_indices(metadata.slot_mapping, metadata.num_actual_tokens, dst, src)
            step.kv_idx = (dst, src)
        # An upper bound, not the step's maximum: FA2 bakes its split count into captured graphs.
        step.max_k = metadata.block_table.shape[1] * metadata.block_size
        step.cu_k = None
        if not self.is_fa4:
            cu_k = buffers.get("flash.cu_seqlens_k", (cap + 1,), torch.int32)[: metadata.num_seqs + 1]
            torch.cumsum(metadata.seq_lens, 0, dtype=torch.int32, out=cu_k[1:])
            step.cu_k = cu_k
        for spec, dtype in list(self._seen.values()):  # bind every known layer kind once per step
            self._bind(step, spec, dtype)
        return step

    def _bind(self, step: _Step, spec, dtype) -> tuple:
        """Bind the KV write and the attention call for layers of ``spec`` in this step."""
        kind = self._writer[0]
        if kind == "bound":
            launch = self._writer[1]
            launcher = launch.kv_write_launcher(step.num_tokens, spec.num_kv_heads, spec.head_dim,
                                                step.block_size)
            write = (functools.partial(_write_kv_triton, launch.write_kv, launcher), (step.slot_mapping,))
        elif kind == "public":
            write = (self._writer[1], (step.slot_mapping,))
        else:
            write = (write_kv_torch, step.kv_idx)
        t = step.tensors
        if not self.is_fa4:
            attn = (self.impl.fwd, (t["cu_q"], step.cu_k, t["used_k"], t["table"], step.max_q, step.max_k,
                                    spec.scale, spec.causal, spec.sliding_window, spec.softcap))
        elif self.call_mode == "public":
            attn = self._public_call(step, spec)
        else:
            key = self.impl.kernel_key(spec, dtype, step.block_size, step.max_q, step.num_seqs)
            tpl = self._templates.get(key, _UNKNOWN)
            if tpl is _UNKNOWN:
                attn = (self._learner(step, spec, dtype, key), ())
            elif tpl is None:
                attn = self._public_call(step, spec)
            else:
                attn = (tpl.fn, self.impl.bind(tpl, step.tensors))
        call = step.calls[id(spec)] = (*attn, dtype, *write, spec)
        return call

    def _learner(self, step: _Step, spec, dtype, key):
        """A one-shot attention call that runs FA4's entry, learns its kernel and rebinds the step."""

        def learn(q, k, v, out):
            t = step.tensors
            tpl, why = self.impl.learn(q, k, v, out, t["cu_q"], t["used_k"], t["table"], step.max_q,
                                       spec.scale, spec.causal, spec.sliding_window, spec.softcap, q.device)
            if why is not None:
                self._warn_once(f"FlashAttention-4 direct call unavailable for {spec} "
                                f"(max_query_len={step.max_q}, {step.num_seqs} sequences): {why}; "
                                f"using its Python entry for this configuration")
            if len(self._templates) >= _MAX_TEMPLATES:
                self._templates.clear()
            self._templates[key] = tpl
            self._bind(step, spec, dtype)

        return learn

    def _public_call(self, step: _Step, spec):
        t = step.tensors
        return (self.impl.fwd_public, (t["cu_q"], t["used_k"], t["table"], step.max_q, spec.scale,
                                       spec.causal, spec.sliding_window, spec.softcap))

    def _warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            logger.warning(msg)

    # -- per layer -----------------------------------------------------------------------------

    def _call(self, metadata, spec, dtype) -> tuple:
        step = metadata.plans.get(self)
        if step is None:
            step = metadata.plan_for(self)
        call = step.calls.get(id(spec))
        if call is None or call[2] is not dtype:
            if len(self._seen) >= _MAX_SEEN:
                self._seen.clear()
            self._seen[id(spec)] = (spec, dtype)
            call = self._bind(step, spec, dtype)
        return call

    def write_layer_kv(self, key, value, cache, metadata) -> None:
        call = self._call(metadata, cache.spec, key.dtype)
        call[3](key, value, cache.key_cache, cache.value_cache, *call[4])

    def attend(self, query, output, cache, metadata) -> None:
        call = self._call(metadata, cache.spec, query.dtype)
        call[0](query, cache.key_cache, cache.value_cache, output, *call[1])

    def forward(self, query, key, value, output, cache, metadata) -> None:
        call = self._call(metadata, cache.spec, query.dtype)
        kc = cache.key_cache
        vc = cache.value_cache
        call[3](key, value, kc, vc, *call[4])
        call[0](query, kc, vc, output, *call[1])

    def prepared_call(self, metadata, cache):
        """``(fn, tail)`` this step calls for ``cache``'s layer (after one ``forward``); for benchmarks."""
        call = metadata.plan_for(self).calls[id(cache.spec)]
        return call[0], call[1]

    # -- public ops ----------------------------------------------------------------------------

    def write_kv_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        if key.device.type == "cuda" and self.writer_kind() != "torch":
            from .registry import get_backend  # noqa: PLC0415

            get_backend("triton", "cuda").write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        else:
            write_kv_any(key, value, key_cache, value_cache, slot_mapping)

    def varlen_attention(self, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                         max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, softcap) -> None:
        from ..kv_cache import AttentionSpec  # noqa: PLC0415
        from .registry import first_supporting  # noqa: PLC0415

        spec = AttentionSpec(q.shape[1], k.shape[-2], q.shape[-1], softmax_scale, window_left, softcap, causal)
        block_size = k.shape[1] if block_table is not None else 256  # contiguous K/V: no block constraint
        reason = self.unsupported_reason(spec, q.dtype, q.device, block_size)
        if reason is not None:
            first_supporting(self, spec, q.dtype, q.device, block_size).varlen_attention(
                q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window_left, softcap)
            return
        self.impl.varlen(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                         max_seqlen_k, softmax_scale, causal, window_left, softcap)
        # Rows past the last sequence belong to nobody; FlashAttention leaves them untouched.
        rows = torch.arange(out.shape[0], device=out.device)
        out.masked_fill_((rows >= cu_seqlens_q[-1:]).view(-1, *([1] * (out.dim() - 1))), 0)
