"""The compileattn custom ops: what torch.compile sees of attention.

Five ops in the ``compileattn`` namespace, each with a fake (meta) function and exact aliasing:

- ``write_kv_cache(key, value, key_cache!, value_cache!, slot_mapping)``: scatter this step's K/V
  into paged caches; slot -1 marks a padded token and is skipped.
- ``varlen_attention(q, k, v, out!, cu_seqlens_q, cu_seqlens_k?, seqused_k?, block_table?, ...)``:
  FlashAttention's ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` semantics, contiguous
  or paged K/V, writing into a caller-owned ``out``.
- ``attention(query, key, value, output!, layer_name)``: the per-layer unified op the graph is split
  at. Metadata and KV caches are not graph inputs: it reads them from the forward context, so the
  graph (and every CUDA graph captured from it) is independent of them. The K/V cache write it does
  is not declared in the schema; this is safe because the op is opaque to the compiler and only
  this op reads or writes the caches.
- ``write_layer_kv(key, value, layer_name) -> token`` and ``attend(query, output!, token, layer_name)``:
  the two halves passes/kv_write.py rewrites ``attention`` into, so the K/V write is captured in
  the CUDA-graph piece before the split and only ``attend`` runs eagerly.

Ops are defined with ``torch.library.Library`` + ``impl`` rather than ``@custom_op``: the latter adds
a Python wrapper layer to every call, and ``attention`` runs eagerly once per layer per step.
"""
from __future__ import annotations

import torch

from . import context
from .backends.registry import get_backend, resolve

_lib = torch.library.Library("compileattn", "DEF")  # noqa: TOR901 (an op library, not a test)

_lib.define(
    "write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, str backend=\"auto\") -> ()"
)
_lib.define(
    "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor cu_seqlens_q, "
    "Tensor? cu_seqlens_k, Tensor? seqused_k, Tensor? block_table, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, float softmax_scale, bool causal=True, int window_left=-1, "
    "float softcap=0.0, str backend=\"auto\") -> ()"
)
_lib.define("attention(Tensor query, Tensor key, Tensor value, Tensor(a!) output, str layer_name) -> ()")
# The unified op in two halves, made by passes/kv_write.py so the K/V write can be captured in the
# CUDA-graph piece before attention. ``write_layer_kv`` returns an empty tensor that ``attend``
# takes: the data dependency keeps the write ahead of the attention and alive through DCE.
_lib.define("write_layer_kv(Tensor key, Tensor value, str layer_name) -> Tensor")
_lib.define("attend(Tensor query, Tensor(a!) output, Tensor kv_written, str layer_name) -> ()")


def _write_kv_cache(key, value, key_cache, value_cache, slot_mapping, backend="auto"):
    get_backend(backend, key.device).write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def _varlen_attention(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                      max_seqlen_k, softmax_scale, causal=True, window_left=-1, softcap=0.0, backend="auto"):
    get_backend(backend, q.device).varlen_attention(
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
        softmax_scale, causal, window_left, softcap,
    )


def _layer(layer_name):
    """(backend that runs this layer, its KVCache, the step's metadata) from the forward context."""
    ctx = context._current
    if ctx is None:
        context.get_forward_context()  # raises the explanatory error
    cache = ctx.kv_caches[layer_name]
    md = ctx.metadata
    return cache.resolved.get(md.backend) or resolve(md.backend, cache), cache, md


def attention_impl(query, key, value, output, layer_name):
    """The body of ``compileattn::attention``; the piecewise runtime calls it directly, skipping the
    dispatcher, since it is a plain Python function with no autograd or dispatch needs."""
    backend, cache, md = _layer(layer_name)
    backend.forward(query, key, value, output, cache, md)


def write_layer_kv_impl(key, value, layer_name):
    backend, cache, md = _layer(layer_name)
    backend.write_layer_kv(key, value, cache, md)
    return key.new_empty(0)


def attend_impl(query, output, layer_name):
    """The body of ``compileattn::attend`` (minus the dependency token), called directly by the
    piecewise runtime: one dict lookup, then the backend's prepared kernel call."""
    backend, cache, md = _layer(layer_name)
    backend.attend(query, output, cache, md)


_lib.impl("write_kv_cache", _write_kv_cache, "CompositeExplicitAutograd")
_lib.impl("write_layer_kv", write_layer_kv_impl, "CompositeExplicitAutograd")
_lib.impl("attend", lambda query, output, kv_written, layer_name: attend_impl(query, output, layer_name),
          "CompositeExplicitAutograd")
_lib.impl("varlen_attention", _varlen_attention, "CompositeExplicitAutograd")
_lib.impl("attention", attention_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("compileattn::write_kv_cache")
def _write_kv_cache_fake(key, value, key_cache, value_cache, slot_mapping, backend="auto"):
    return None


@torch.library.register_fake("compileattn::varlen_attention")
def _varlen_attention_fake(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                           max_seqlen_k, softmax_scale, causal=True, window_left=-1, softcap=0.0, backend="auto"):
    return None


@torch.library.register_fake("compileattn::attention")
def _attention_fake(query, key, value, output, layer_name):
    # Runs once, at trace time: static checks here cost nothing per step.
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"compileattn::attention({layer_name!r}): query/key/value must be "
                         f"(tokens, heads, head_dim); got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    if key.dtype != query.dtype or value.dtype != query.dtype or output.dtype != query.dtype:
        raise TypeError(f"compileattn::attention({layer_name!r}): query/key/value/output dtypes differ: "
                        f"{query.dtype}, {key.dtype}, {value.dtype}, {output.dtype}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"compileattn::attention({layer_name!r}): {query.shape[1]} query heads not divisible "
                         f"by {key.shape[1]} kv heads")
    return None


@torch.library.register_fake("compileattn::write_layer_kv")
def _write_layer_kv_fake(key, value, layer_name):
    return key.new_empty(0)


@torch.library.register_fake("compileattn::attend")
def _attend_fake(query, output, kv_written, layer_name):
    if output.shape != query.shape or output.dtype != query.dtype:
        raise ValueError(f"compileattn::attend({layer_name!r}): output {tuple(output.shape)}/{output.dtype} "
                         f"must match query {tuple(query.shape)}/{query.dtype}")
    return None


write_kv_cache = torch.ops.compileattn.write_kv_cache.default
write_layer_kv = torch.ops.compileattn.write_layer_kv.default
attend = torch.ops.compileattn.attend.default
varlen_attention = torch.ops.compileattn.varlen_attention.default
attention = torch.ops.compileattn.attention.default
