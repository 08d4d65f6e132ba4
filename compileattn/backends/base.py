"""The one interface every attention kernel backend implements.

A backend does its shape-dependent work in ``plan`` (once per step, from host-side metadata) and
keeps ``forward`` (once per layer per step, eager between CUDA-graph replays) down to kernel
launches. ``forward``'s default is "write K/V into the cache, then paged varlen attention", which
is right for any backend that implements the two primitives.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from ..kv_cache import AttentionSpec, KVCache
    from ..metadata import AttentionMetadata, PersistentBuffers


class AttentionBackend:
    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type

    name: ClassVar[str] = "base"
    #: True when ``forward`` never syncs the host and launches a grid fixed by ``num_tokens``,
    #: so it may be captured inside a CUDA graph (full-graph decode).
    cuda_graph_capturable: ClassVar[bool] = False

    def unsupported_reason(
        self, spec: "AttentionSpec", dtype: torch.dtype, device: torch.device, block_size: int
    ) -> str | None:
        """None if this backend runs the configuration, else a one-line reason (logged on fallback)."""
        return None

    def capturable_for(self, cache: "KVCache", metadata: "AttentionMetadata") -> bool:
        """Whether this step's attention for ``cache``'s layer may be captured in a CUDA graph,
        judged on the backend that actually runs it (after fallback)."""
        from .registry import resolve

        return resolve(self, cache).cuda_graph_capturable

    def plan(self, metadata: "AttentionMetadata", buffers: "PersistentBuffers") -> Any:
        """Once per step: everything that depends only on the step's shapes."""
        return None

    def write_kv_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        raise NotImplementedError

    def varlen_attention(
        self, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
        max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
        window_left: int, softcap: float,
    ) -> None:
        raise NotImplementedError

    def write_layer_kv(self, key, value, cache: "KVCache", metadata: "AttentionMetadata") -> None:
        """Store this step's K/V of one layer. Must be capturable (no host sync): the compile
        backend moves it into the CUDA-graph piece before the attention op (passes/kv_write.py)."""
        self.write_kv_cache(key, value, cache.key_cache, cache.value_cache, metadata.slot_mapping)

    def attend(self, query, output, cache: "KVCache", metadata: "AttentionMetadata") -> None:
        """Attention of one layer over the paged cache (which already holds this step's K/V)."""
        spec = cache.spec
        self.varlen_attention(
            query, cache.key_cache, cache.value_cache, output, metadata.query_start_loc, None,
            metadata.seq_lens, metadata.block_table, metadata.max_query_len, metadata.max_seq_len,
            spec.scale, spec.causal, spec.sliding_window, spec.softcap,
        )

    def forward(self, query, key, value, output, cache: "KVCache", metadata: "AttentionMetadata") -> None:
        """One layer of one step: store this step's K/V, then attend over the paged cache."""
        self.write_layer_kv(key, value, cache, metadata)
        self.attend(query, output, cache, metadata)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
