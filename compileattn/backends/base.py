"""The interface every attention kernel backend implements, and the records it is handed.

A backend answers two questions and offers two ways in:

- ``unsupported_reason``: can it run a layer of this shape, dtype, device, page size and cache
  dtype? (The selector asks before it chooses; a backend that cannot run a configuration says
  why, it never runs it wrongly.)
- ``prepare_attend``: once per step shape (not per layer call), bind everything a layer's
  attention needs except the query and the output, and return the call ``attend(query, output)``.
  The eager op between CUDA-graph replays does nothing else per layer but look that call up and
  make it: this is where a backend moves its shape logic, kernel choice and argument packing.
- ``varlen_attention``: the generic, unprepared path behind the public flash-attn-shaped entry
  points; correctness over speed.

This module imports nothing of the package, so every backend can depend on it alone.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, NamedTuple

import torch

#: ``attend(query, output)``: a layer's attention with everything else bound.
AttendCall = Callable[[torch.Tensor, torch.Tensor], None]


class StepShape(NamedTuple):
    """What a prepared call may depend on besides the layer: the step's (padded) shape. A CUDA
    graph captured for one ``StepShape`` replays for every step of that shape, so nothing here
    may be a sequence length."""

    num_tokens: int
    num_seqs: int
    block_size: int
    #: The longest query of the step (1 for uniform decode); FlashAttention picks kernels by it.
    max_query_len: int
    #: Every sequence has one query token (padding included): the decode kernels apply.
    uniform_decode: bool


class StepTensors(NamedTuple):
    """The step's metadata on the device: views of persistent buffers, so their addresses are
    the same in every step of a shape (what a captured kernel reads)."""

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]  (cu_seqlens_q)
    seq_lens: torch.Tensor  # int32 [num_seqs]  K length (seqused_k)
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 = padding


class PersistentBuffers:
    """Device buffers allocated once at a fixed shape and kept for the metadata builder's lifetime:
    the step's metadata (each step writes a prefix) and what prepared calls need besides (split-KV
    partials). A CUDA graph captured with one step reads the next step's values at the same address.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._memo: dict[tuple, Any] = {}
        #: builds that wrote the buffers so far: the latest metadata's ``generation``
        self.generation = 0
        #: forward contexts open on a step these buffers hold: while one is, its layers read them
        #: and the builder refuses to overwrite them
        self.in_use = 0

    def get(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None:
            # a normal tensor even when the first build runs under ``torch.inference_mode()``: an
            # inference tensor refuses the copies of every later build outside it
            with torch.inference_mode(False):
                buf = self._buffers[name] = torch.zeros(tuple(shape), dtype=dtype, device=self.device)
        elif tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            raise RuntimeError(f"persistent buffer {name!r} requested as {tuple(shape)}/{dtype}, "
                               f"exists as {tuple(buf.shape)}/{buf.dtype}")
        return buf

    def fill(self, name: str, host: torch.Tensor, max_shape) -> torch.Tensor:
        """Copy ``host`` into the leading corner of buffer ``name`` and return that view."""
        buf = self.get(name, max_shape, host.dtype)
        view = buf[tuple(slice(0, n) for n in host.shape)]
        view.copy_(host, non_blocking=True)
        return view

    def memo(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()`` once per ``key``, kept with these buffers: a prepared launch bound to this
        builder's scratch lives exactly as long as the builder (a backend instance, which every
        builder in the process shares, would keep it, and the scratch, alive after the engine)."""
        obj = self._memo.get(key)
        if obj is None:
            obj = self._memo[key] = make()
        return obj

    def constant(self, values: tuple[float, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A device tensor holding ``values``, made once and kept (a prepared call binds it, e.g.
        a layer's ALiBi slopes): the same values give the same tensor."""
        name = f"constant.{dtype}.{values!r}"
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = torch.tensor(values, dtype=dtype, device=self.device)
        return buf


class AttentionBackend:
    """One family of attention kernels. Instances are shared (one per device type)."""

    name: ClassVar[str] = "base"
    #: True when prepared calls never sync the host and launch grids fixed by the ``StepShape``:
    #: they may then be captured inside a CUDA graph (the full-graph decode mode).
    capturable: ClassVar[bool] = False

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type

    def unsupported_reason(self, spec: Any, dtype: torch.dtype, device: torch.device,
                           block_size: int, cache_dtype: torch.dtype | None = None) -> str | None:
        """None if this backend runs the configuration, else a one-line reason (logged on
        fallback). ``dtype`` is the queries', ``cache_dtype`` the K/V storage dtype (None: the
        same; float8_e4m3fn: a quantized cache); ``block_size`` the KV page size (for contiguous
        K/V: 0); ``spec.alibi_slopes`` not None: ALiBi."""
        return None

    def prepare_attend(self, shape: StepShape, tensors: StepTensors, spec: Any, dtype: torch.dtype,
                       key_cache: torch.Tensor, value_cache: torch.Tensor, buffers: PersistentBuffers,
                       kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> AttendCall:
        """``attend(query, output)`` for one layer in steps of ``shape``: query and output are
        contiguous (num_tokens, num_heads, head_dim) of ``dtype``, the caches already hold this
        step's K/V. ``kv_scales``: a quantized cache's (k_scale, v_scale) per KV head (float32)."""
        raise NotImplementedError

    def varlen_attention(self, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                         max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
                         window_left: int, softcap: float, alibi_slopes: torch.Tensor | None = None,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        """The generic path: ``alibi_slopes`` float32 (num_heads,); ``k_scale``/``v_scale`` float32
        (kv_heads,) when k/v are float8_e4m3fn (read as ``stored * scale``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
