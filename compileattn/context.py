"""The forward context: how the per-layer attention op finds this step's prepared calls.

The op's graph inputs are only (query, key, value, output, layer_name): metadata and caches are
deliberately not graph inputs, so the compiled graph does not change when they do, and no
CUDA-graph piece has to treat them as inputs. Entering the context resolves the step into the
selector's call table (memoised per step shape), so a layer's eager work is one dict lookup and
one call. A plain module global (not a ContextVar) because the op reads it once per layer per
step and a global read is the cheapest lookup Python has.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Mapping

import torch

from .backends.selector import CallTable
from .kv_cache import KVCache
from .metadata import AttentionMetadata


@dataclasses.dataclass
class ForwardContext:
    metadata: AttentionMetadata
    kv_caches: Mapping[str, KVCache]
    #: layer name -> ``attend(query, output)``, the prepared attention call
    attend: dict[str, Callable[[torch.Tensor, torch.Tensor], None]]
    #: layer name -> ``write(key, value)``, the prepared KV-cache write
    write: dict[str, Callable[[torch.Tensor, torch.Tensor], None]]
    table: CallTable
    #: which caches this step runs with (``caches_key``); the same object while they are the same
    caches_key: tuple = ()


def caches_key(kv_caches: Mapping[str, KVCache]) -> tuple:
    """The layer names and cache objects of ``kv_caches``: a cache replaced in the same mapping
    is another set of caches (its prepared calls, checks and captured graphs belong to the old one)."""
    return tuple(kv_caches), tuple(kv_caches.values())


_current: ForwardContext | None = None

#: Identical pieces of different layers share compiled code (compilation/piece_signature.py), so the
#: KV-write layer names inside a piece are per-piece slots; the dispatcher sets this {slot: layer
#: name} map before it runs a piece, and ``write_layer_kv`` resolves slots through it.
PIECE_LAYER_PREFIX = "compileattn:piece_layer:"
piece_layer_names: Mapping[str, str] = {}


def no_context_error(why: str | None = None) -> RuntimeError:
    """The error for an attention op called outside ``set_forward_context``. ``why``: what the
    caller knows of how the model came to run outside one (a transformers model that ``LLM``
    switched to compileattn's attention and then ran through its own ``generate``), said instead
    of the generic advice."""
    return RuntimeError("no forward context: " + (why or "run the model inside "
                                                  "compileattn.set_forward_context(metadata, kv_caches)"))


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise no_context_error()
    return _current


def missing_layer_error(layer_name: str) -> ValueError:
    """The error for a layer the forward context has no cache for."""
    known = sorted(_current.kv_caches) if _current is not None else []
    shown = known[:8] + (["..."] if len(known) > 8 else [])
    return ValueError(f"layer_name={layer_name!r}: the forward context's kv_caches have no entry for this layer "
                      f"(it has {len(known)}: {shown}); allocate a cache per attention layer, keyed by the "
                      f"layer_name the model passes")


def _check_caches(metadata: AttentionMetadata, kv_caches: Mapping[str, KVCache]) -> None:
    """Once per (builder, caches) pair: the caches fit the geometry the metadata was built for."""
    for name, cache in kv_caches.items():
        if not isinstance(cache, KVCache):
            raise TypeError(f"kv_caches[{name!r}] must be a compileattn.KVCache, got {type(cache).__name__}")
        if cache.block_size != metadata.block_size:
            raise ValueError(f"kv_caches[{name!r}] has block_size {cache.block_size}, metadata has "
                             f"{metadata.block_size}")
        if cache.num_blocks < metadata.num_blocks:
            raise ValueError(f"kv_caches[{name!r}] has {cache.num_blocks} blocks, but the metadata builder was "
                             f"made for num_blocks={metadata.num_blocks}: its block tables may point past the "
                             f"cache")
        if cache.device != metadata.device:
            raise ValueError(f"kv_caches[{name!r}] is on {cache.device}, metadata on {metadata.device}")


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata, kv_caches: Mapping[str, KVCache]) -> Iterator[ForwardContext]:
    """Make ``metadata`` and ``kv_caches`` (layer name -> KVCache) visible to the attention ops."""
    global _current
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"metadata must be AttentionMetadata, got {type(metadata).__name__}")
    if not metadata.current:
        raise ValueError("metadata: a later build() of the same AttentionMetadataBuilder has overwritten the "
                         "persistent buffers this step's tensors view; build each step right before it runs")
    if not isinstance(kv_caches, Mapping):  # before ``caches_key``, which iterates it and calls .values()
        raise TypeError(f"kv_caches must be a mapping of layer name -> KVCache, got {type(kv_caches).__name__}")
    selector = metadata.selector
    key = caches_key(kv_caches)
    if key != selector.checked_caches:  # KVCache compares by identity: a tuple compare of pointers
        _check_caches(metadata, kv_caches)
        selector.checked_caches = key
    else:
        key = selector.checked_caches  # one object while the caches stay: later checks compare by `is`
    table = selector.call_table(metadata.shape, metadata.tensors, kv_caches, key)
    for refresh in table.per_step:
        refresh()
    previous = _current
    _current = ForwardContext(metadata, kv_caches, table.attend, table.write, table, key)
    selector.buffers.in_use += 1
    try:
        yield _current
    finally:
        selector.buffers.in_use -= 1
        _current = previous
