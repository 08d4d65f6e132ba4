"""Every decision about which kernel runs, in one place.

- **Names.** ``reference`` (plain PyTorch, the oracle, the only CPU backend without Triton's
  interpreter), ``triton`` (own kernels), ``flash`` (FlashAttention: FA4 where it imports and the
  GPU is SM90+, else FA2), ``auto`` (per step regime, ``AUTO_TABLE``).
- **Fallback.** A backend that cannot run a layer's configuration hands it to the next in
  ``FALLBACK_ORDER``; the reason is logged once. No backend runs a configuration it refuses.
- **The KV writer.** Triton's write kernel (one launch for K and V, slot -1 masked) for layers
  the Triton backend runs, and on CUDA for every backend but ``reference`` where Triton supports
  the GPU; else a torch writer: capturable on CUDA, masked on the CPU. ``reference`` stays plain
  PyTorch end to end: it is the oracle.
- **Per step.** ``KernelSelector.call_table`` resolves the step into a per-layer table of
  prepared calls (``attend(query, output)``, ``write(key, value)``), memoised per step shape: a
  step shape seen before costs one dict lookup, and the eager op per layer is "look up the
  layer's call, call it".

Measurements behind ``AUTO_TABLE`` (H200, benchmarks/results/decode_attention.md and
op_overhead.md): the Triton decode kernel is 0.87-1.10x FlashInfer's GPU time and up to 4.5x faster
than FlashAttention-4, which has no split-KV on Hopper (13.2 vs 59.0 us at batch 1 / context 4096);
uniform decode is captured whole in the full-graph mode, so Triton's host launch cost is not paid
per step there. Mixed/prefill steps run attention eagerly between pieces, where FA4's ~7 us prepared
call beats Triton's ~12 us (op_overhead_direct.md, measured with two launches at split-KV; a launch of
up to 4 splits now merges its own partials).
"""
from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Mapping, NamedTuple

import torch

from ..kv_cache import AttentionSpec, is_fp8
from ..refusals import ServingRefused
from ..validation import check_alibi, check_k_lengths_given, check_kv_scales
from .base import AttendCall, AttentionBackend, PersistentBuffers, StepShape, StepTensors
from .kv_write import StepWriteIndices, prepare_torch_write, write_kv_masked, write_kv_padded

logger = logging.getLogger("compileattn")

#: Backend names a user may ask for.
BACKEND_NAMES = ("auto", "reference", "triton", "flash")
#: Who takes over when a backend cannot run a configuration.
FALLBACK_ORDER = ("flash", "triton", "reference")
#: regime -> backends in order of preference (the first that imports and supports the layer wins).
AUTO_TABLE = {
    "cpu": ("reference",),
    "cuda_decode": ("triton", "flash", "reference"),
    "cuda_mixed": ("flash", "triton", "reference"),
}
#: Call tables kept per selector (one per step shape seen recently).
_MAX_TABLES = 64
#: Part of every memoised call table's key: ``capturable_changed`` bumps it when a backend class's
#: ``capturable`` is changed (``testing.simulated_cuda_graphs``), since a table holds the value it
#: was built with and would answer for that backend under the old one.
_capturable_epoch = 0


def capturable_changed() -> None:
    """A backend class's ``capturable`` changed: call tables built before are not reused."""
    global _capturable_epoch
    _capturable_epoch += 1

_CLASSES = {
    "reference": "compileattn.backends.reference:ReferenceBackend",
    "triton": "compileattn.backends.triton.backend:TritonBackend",
    "flash4": "compileattn.backends.flash_fa4:FA4Backend",
    "flash2": "compileattn.backends.flash_fa2:FA2Backend",
}
_instances: dict[tuple[str, str], AttentionBackend] = {}
_logged: set[tuple[str, str]] = set()

WriteCall = Callable[[torch.Tensor, torch.Tensor], None]


class UnsupportedConfigurationError(ServingRefused):
    """No attention backend runs a layer's configuration (its spec, dtype, device, block size) for
    the backend asked for: ``choose``'s refusal, the message naming the first candidate's reason. A
    type of its own (a ``ServingRefused``) so that a caller refusing the configuration (``LLM``
    refuses the model, the command line the user's input) catches this and not any ValueError,
    which a backend's own bug raises too."""


def check_backend_name(name: Any, argument: str = "attention_backend") -> str:
    if isinstance(name, AttentionBackend):
        return name.name
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a str, got {type(name).__name__}")
    if name not in BACKEND_NAMES:
        raise ValueError(f"{argument}={name!r} is unknown; choose from {list(BACKEND_NAMES)}")
    return name


def _instance(key: str, device_type: str) -> AttentionBackend:
    inst = _instances.get((key, device_type))
    if inst is None:
        module, cls = _CLASSES[key].split(":")
        inst = _instances[(key, device_type)] = getattr(importlib.import_module(module), cls)(device_type)
    return inst


def get_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """The shared instance of backend ``name`` (not ``auto``) for ``device``'s type; ImportError,
    with the reason, when its package is missing.

    ``flash`` is FlashAttention-4 where it imports (its paged kernels need SM90+; on an older GPU
    with both installed, FlashAttention-2), else FlashAttention-2.
    """
    name = check_backend_name(name)
    if name == "auto":
        raise ValueError("'auto' is a choice per step, not a backend: use KernelSelector or run_varlen")
    device_type = torch.device(device).type
    if name != "flash":
        return _instance(name, device_type)
    old_gpu = device_type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9
    reasons = []
    for key in (("flash2", "flash4") if old_gpu else ("flash4", "flash2")):
        try:
            return _instance(key, device_type)
        except ImportError as exc:
            reasons.append(str(exc))
    raise ImportError("no FlashAttention is usable: " + "; ".join(reasons))


def _log_fallback_once(src: str, dst: str, reason: str) -> None:
    if (src, reason) not in _logged:
        _logged.add((src, reason))
        logger.info("attention backend %s cannot run this configuration (%s); using %s", src, reason, dst)


def _candidates(requested: str | AttentionBackend, regime: str) -> list[str | AttentionBackend]:
    check_backend_name(requested, "backend")
    if isinstance(requested, AttentionBackend):  # an instance (tests and sweeps tune one)
        start = FALLBACK_ORDER.index(requested.name) + 1 if requested.name in FALLBACK_ORDER else 0
        return [requested, *FALLBACK_ORDER[start:]]
    if requested == "auto":
        return list(AUTO_TABLE[regime])
    return list(FALLBACK_ORDER[FALLBACK_ORDER.index(requested):])


def choose(requested: str | AttentionBackend, spec, dtype: torch.dtype, device: torch.device, block_size: int,
           regime: str, cache_dtype: torch.dtype | None = None) -> AttentionBackend:
    """The backend that runs a layer of ``spec`` when ``requested`` was asked for (see module doc);
    ``dtype`` is the queries', ``cache_dtype`` the K/V storage dtype (None: the same).
    ``UnsupportedConfigurationError`` where none does."""
    device = torch.device(device)
    first_reason = None
    for cand in _candidates(requested, regime):
        try:
            backend = cand if isinstance(cand, AttentionBackend) else get_backend(cand, device)
        except ImportError as exc:
            reason = f"not importable: {exc}"
        else:
            reason = backend.unsupported_reason(spec, dtype, device, block_size, cache_dtype=cache_dtype)
            if reason is None:
                if first_reason is not None:
                    _log_fallback_once(first_reason[0], backend.name, first_reason[1])
                return backend
        name = cand.name if isinstance(cand, AttentionBackend) else cand
        if first_reason is None:
            first_reason = (name, reason)
    requested_name = requested.name if isinstance(requested, AttentionBackend) else requested
    kv = "" if cache_dtype in (None, dtype) else f", K/V stored as {cache_dtype}"
    raise UnsupportedConfigurationError(f"no attention backend runs {spec} with dtype {dtype}{kv} on {device} (block "
                                        f"size {block_size}) for attention_backend={requested_name!r}; "
                                        f"{first_reason[0]}: {first_reason[1]}")


def regime_of(device: torch.device, uniform_decode: bool) -> str:
    if device.type != "cuda":
        return "cpu"
    return "cuda_decode" if uniform_decode else "cuda_mixed"


# -- the public ops: unprepared, one call at a time ------------------------------------------------

def run_varlen(requested: str, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
               max_seqlen_k, softmax_scale, causal, window_left, softcap, alibi_slopes=None, k_scale=None,
               v_scale=None) -> None:
    """``compileattn::varlen_attention``: the chosen backend's generic path.

    The slopes stay in their device tensor (reading them would sync the host): the spec the choice
    is made on carries zeros in their place, as support depends on ALiBi being on, not on its values.
    """
    _check_scaled_cache(k.dtype, k_scale, v_scale, k.shape[-2], q.device)
    check_alibi(alibi_slopes, q.shape[1], q.device)
    check_k_lengths_given(block_table, seqused_k, cu_seqlens_k)
    alibi = (0.0,) * q.shape[1] if alibi_slopes is not None else None
    spec = AttentionSpec(q.shape[1], k.shape[-2], q.shape[-1], softmax_scale, window_left, softcap, causal, alibi)
    block_size = k.shape[1] if block_table is not None else 0
    regime = regime_of(q.device, block_table is not None and max_seqlen_q == 1)
    choose(requested, spec, q.dtype, q.device, block_size, regime, k.dtype).varlen_attention(
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
        softmax_scale, causal, window_left, softcap, alibi_slopes, k_scale, v_scale)


def run_write(requested: str, key, value, key_cache, value_cache, slot_mapping, k_scale=None,
              v_scale=None) -> None:
    """``compileattn::write_kv_cache``: Triton's kernel when the Triton backend runs here, else torch."""
    _check_scaled_cache(key_cache.dtype, k_scale, v_scale, key_cache.shape[-2], key_cache.device)
    name = check_backend_name(requested)
    if _triton_writes(key.device, key.dtype, key_cache.shape[1], name, name, key_cache.dtype):
        get_backend("triton", key.device).write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale,
                                                         v_scale)
    elif key.device.type == "cuda":
        write_kv_padded(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_masked(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def _check_scaled_cache(cache_dtype: torch.dtype, k_scale, v_scale, kv_heads: int, device: torch.device) -> None:
    """K/V scales belong to a float8 cache only, and come as a pair of float32 (kv_heads,). The
    choice is made on the cache's dtype, and the FlashAttention backends, which accept any cache in
    the queries' dtype, have no scale argument; Triton's kernels are scaled or not as a whole (by
    ``k_scale``) and read one scale per KV head (the reference would broadcast a single one):
    scales given otherwise would be applied by some backends and dropped or misread by others."""
    if k_scale is None and v_scale is None:
        return
    if is_fp8(cache_dtype) and (k_scale is None or v_scale is None):
        raise ValueError(f"k_scale and v_scale go together: got only {'v_scale' if k_scale is None else 'k_scale'}")
    check_kv_scales(cache_dtype, k_scale, v_scale, kv_heads, device, cache="caches")  # refuses another cache


def _triton_writes(device: torch.device, dtype: torch.dtype, block_size: int, requested: str,
                   attention: str, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether Triton's KV-write kernel writes a layer whose attention runs on backend ``attention``
    when ``requested`` was asked for (see the module doc)."""
    if attention != "triton" and (device.type != "cuda" or requested == "reference"):
        return False
    try:
        triton = get_backend("triton", device)
    except ImportError:
        return False
    return triton.unsupported_reason(AttentionSpec(1, 1, 64), dtype, device, block_size, cache_dtype) is None


# -- per step: the call table ----------------------------------------------------------------------

class CallTable(NamedTuple):
    """One step shape's prepared calls, per layer name."""

    attend: dict[str, AttendCall]
    write: dict[str, WriteCall]
    #: layer name -> the backend that runs it (after fallback)
    backends: dict[str, AttentionBackend]
    #: Every call may be captured in a CUDA graph (full-graph decode).
    capturable: bool
    kv_caches: Mapping[str, Any]
    #: Run once per step before the forward (device-side index refreshes the prepared calls read).
    per_step: tuple[Callable[[], None], ...] = ()
    #: the caches it was built for (``context.caches_key``)
    caches_key: tuple = ()


class KernelSelector:
    """The kernel choices of one metadata builder: which backend and writer run each layer, and
    the memoised call tables bound to the builder's persistent buffers."""

    def __init__(self, requested: str | AttentionBackend, device: torch.device, buffers: PersistentBuffers):
        check_backend_name(requested)
        self.requested = requested
        self.device = torch.device(device)
        self.buffers = buffers
        self._tables: dict[tuple, CallTable] = {}
        #: The caches last checked against this builder's geometry (``context.caches_key``, by
        #: the forward context): kept here, with the builder that owns it, so no process-wide
        #: cache keeps an engine's KV cache alive after the engine is gone.
        self.checked_caches: tuple | None = None
        self._choices: dict[tuple, AttentionBackend] = {}

    @property
    def requested_name(self) -> str:
        return self.requested.name if isinstance(self.requested, AttentionBackend) else self.requested

    def backend_for(self, spec, dtype: torch.dtype, block_size: int, uniform_decode: bool,
                    cache_dtype: torch.dtype | None = None) -> AttentionBackend:
        regime = regime_of(self.device, uniform_decode)
        key = (spec, dtype, cache_dtype, block_size, regime)
        backend = self._choices.get(key)
        if backend is None:
            backend = self._choices[key] = choose(self.requested, spec, dtype, self.device, block_size, regime,
                                                  cache_dtype)
        return backend

    def call_table(self, shape: StepShape, tensors: StepTensors, kv_caches: Mapping[str, Any],
                   caches_key: tuple) -> CallTable:
        """``caches_key``: ``context.caches_key(kv_caches)``; a table serves the caches it was built
        for, not whatever its mapping holds now."""
        key = (shape, id(kv_caches), _capturable_epoch)
        table = self._tables.get(key)
        if table is not None and table.kv_caches is kv_caches and (
                table.caches_key is caches_key or table.caches_key == caches_key):
            return table
        if len(self._tables) >= _MAX_TABLES:
            self._tables.pop(next(iter(self._tables)))
        table = self._tables[key] = self._build(shape, tensors, kv_caches)._replace(caches_key=caches_key)
        return table

    def _build(self, shape: StepShape, tensors: StepTensors, kv_caches) -> CallTable:
        attend, write, backends = {}, {}, {}
        capturable = True
        indices = None  # the torch writer's per-step indices, shared by its layers
        for name, cache in kv_caches.items():
            spec, dtype, scales = cache.spec, cache.query_dtype, cache.kv_scales
            backend = self.backend_for(spec, dtype, shape.block_size, shape.uniform_decode, cache.dtype)
            backends[name] = backend
            attend[name] = backend.prepare_attend(shape, tensors, spec, dtype, cache.key_cache, cache.value_cache,
                                                  self.buffers, scales)
            if _triton_writes(self.device, dtype, shape.block_size, self.requested_name, backend.name, cache.dtype):
                write[name] = get_backend("triton", self.device).prepare_write(
                    shape, tensors, spec, cache.key_cache, cache.value_cache, kv_scales=scales)
            else:
                if self.device.type == "cuda" and indices is None:
                    indices = StepWriteIndices(shape.num_tokens, tensors, self.buffers)
                write[name] = prepare_torch_write(cache.key_cache, cache.value_cache,
                                                  indices if self.device.type == "cuda" else None,
                                                  tensors.slot_mapping, kv_scales=scales)
            capturable = capturable and backend.capturable
        return CallTable(attend, write, backends, capturable, kv_caches,
                         (indices.refresh,) if indices is not None else ())
