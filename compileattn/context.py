"""The forward context: how the per-layer attention op finds this step's metadata and KV caches.

The op's graph inputs are only (query, key, value, output, layer_name): metadata and caches
are deliberately not graph inputs, so the compiled graph does not change when they do, and no
CUDA-graph piece has to treat them as inputs. A plain module global (not a ContextVar) because the
op reads it once per layer per step and a global read is the cheapest lookup Python has.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Mapping

from .kv_cache import KVCache
from .metadata import AttentionMetadata


@dataclasses.dataclass
class ForwardContext:
    metadata: AttentionMetadata
    kv_caches: Mapping[str, KVCache]


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError(
            "no forward context: run the model inside compileattn.set_forward_context(metadata, kv_caches)"
        )
    return _current


def _check_caches(metadata: AttentionMetadata, kv_caches: Mapping[str, KVCache]) -> None:
    for name, cache in kv_caches.items():
        if not isinstance(cache, KVCache):
            raise TypeError(f"kv_caches[{name!r}] must be a compileattn.KVCache, got {type(cache).__name__}")
        if cache.block_size != metadata.block_size:
            raise ValueError(f"kv_caches[{name!r}] has block_size {cache.block_size}, metadata has "
                             f"{metadata.block_size}")
        if cache.device != metadata.device:
            raise ValueError(f"kv_caches[{name!r}] is on {cache.device}, metadata on {metadata.device}")


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata, kv_caches: Mapping[str, KVCache]) -> Iterator[ForwardContext]:
    """Make ``metadata`` and ``kv_caches`` (layer name -> KVCache) visible to the attention ops."""
    global _current
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"metadata must be AttentionMetadata, got {type(metadata).__name__}")
    _check_caches(metadata, kv_caches)
    previous = _current
    _current = ForwardContext(metadata, kv_caches)
    try:
        yield _current
    finally:
        _current = previous
