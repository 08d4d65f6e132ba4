"""The compileattn custom ops: what torch.compile sees of attention.

Six ops in the ``compileattn`` namespace, each with a fake (meta) function and exact aliasing:

- ``write_kv_cache(key, value, key_cache!, value_cache!, slot_mapping, backend, k_scale?, v_scale?)``:
  scatter this step's K/V into paged caches; slot -1 marks a padded token and is skipped; into a
  float8_e4m3fn cache it quantizes with the per-KV-head scales.
- ``varlen_attention(q, k, v, out!, cu_seqlens_q, cu_seqlens_k?, seqused_k?, block_table?, ...,
  backend, alibi_slopes?, k_scale?, v_scale?)``: FlashAttention's ``flash_attn_varlen_func`` /
  ``flash_attn_with_kvcache`` semantics, contiguous or paged K/V (float8_e4m3fn K/V read as
  ``stored * scale``), writing into a caller-owned ``out``. The optional tensors come after
  ``backend`` so that calls written before they existed keep their meaning.
- ``attention(query, key, value, output!, layer_name)``: the per-layer unified op the graph is split
  at. Metadata and KV caches are not graph inputs: it reads this step's prepared calls from the
  forward context, so the graph (and every CUDA graph captured from it) is independent of them.
  The K/V cache write it does is not declared in the schema; this is safe because the op is
  opaque to the compiler and only this op reads or writes the caches.
- ``attention_by_id(query, key, value, output!, layer_id)``: ``attention`` with the layer named
  by a layer-id tensor (``layer_ids.py``), which is what lets Dynamo trace a repeated decoder layer
  once; compileattn's backend turns it back into ``attention`` before anything else sees the graph.
- ``write_layer_kv(key, value, layer_name) -> token`` and ``attend(query, output!, token, layer_name)``:
  the two halves passes/kv_write.py rewrites ``attention`` into, so the K/V write is captured in
  the CUDA-graph piece before the split and only ``attend`` runs eagerly.

Ops are defined with ``torch.library.Library`` + ``impl`` rather than ``@custom_op``: the latter adds
a Python wrapper layer to every call, and ``attention`` runs eagerly once per layer per step. The
compiled runtime does not go through the dispatcher at all: it calls ``attend_caller(layer)``,
which is the context lookup and the prepared call, nothing else.

The ops are inference-only. ``attention``, ``varlen_attention`` and ``write_kv_cache`` have an
Autograd kernel that runs them below autograd and, when an input requires grad, gives the written
tensor a backward that raises naming the op: backpropagating through attention must fail loudly,
not silently treat it as a constant.
"""
from __future__ import annotations

import torch

from . import _torch_compat, context, layer_ids
from .backends import selector

_lib = torch.library.Library("compileattn", "DEF")  # noqa: TOR901 (an op library, not a test)

_lib.define(
    "write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, str backend=\"auto\", Tensor? k_scale=None, Tensor? v_scale=None) -> ()"
)
_lib.define(
    "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor cu_seqlens_q, "
    "Tensor? cu_seqlens_k, Tensor? seqused_k, Tensor? block_table, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, float softmax_scale, bool causal=True, int window_left=-1, "
    "float softcap=0.0, str backend=\"auto\", Tensor? alibi_slopes=None, Tensor? k_scale=None, "
    "Tensor? v_scale=None) -> ()"
)
_lib.define("attention(Tensor query, Tensor key, Tensor value, Tensor(a!) output, str layer_name) -> ()")
_lib.define("attention_by_id(Tensor query, Tensor key, Tensor value, Tensor(a!) output, Tensor layer_id) -> ()")
# The unified op in two halves, made by passes/kv_write.py so the K/V write can be captured in the
# CUDA-graph piece before attention. ``write_layer_kv`` returns an empty tensor that ``attend``
# takes: the data dependency keeps the write ahead of the attention and alive through DCE.
_lib.define("write_layer_kv(Tensor key, Tensor value, str layer_name) -> Tensor")
_lib.define("attend(Tensor query, Tensor(a!) output, Tensor kv_written, str layer_name) -> ()")


def _context() -> context.ForwardContext:
    """``context.get_forward_context()`` without its call frame: the eager op's hot path."""
    ctx = context._current
    if ctx is None:
        raise context.no_context_error()
    return ctx


def _check_layer_call(ctx: context.ForwardContext, layer_name: str, query, output, key=None, value=None) -> None:
    """Eager calls only (the compiled runtime checks once per step shape): the tensors agree with
    the step's metadata and the layer's cache, so a mismatch is an error, not zero rows."""
    cache = ctx.kv_caches.get(layer_name)
    if cache is None:
        raise context.missing_layer_error(layer_name)
    md, spec = ctx.metadata, cache.spec
    for name, t in (("query", query), ("key", key), ("value", value), ("output", output)):
        if t is not None and t.device != cache.device:
            raise ValueError(f"compileattn::attention({layer_name!r}): {name} is on {t.device} but the layer's KV "
                             f"cache is on {cache.device}; run the model on the caches' device")
    if query.shape[0] != md.num_tokens:
        raise ValueError(f"compileattn::attention({layer_name!r}): query has {query.shape[0]} tokens but the step's "
                         f"metadata has num_tokens={md.num_tokens} ({md.num_actual_tokens} real + padding); pass "
                         f"the step's (padded) tokens")
    if query.dtype != cache.query_dtype:
        raise TypeError(f"compileattn::attention({layer_name!r}): query is {query.dtype} but the layer's KV cache "
                        f"takes {cache.query_dtype} queries; allocate caches for the model's dtype")
    if query.shape[1:] != (spec.num_heads, spec.head_dim):
        raise ValueError(f"compileattn::attention({layer_name!r}): query is (tokens, {query.shape[1]}, "
                         f"{query.shape[2]}) but the layer's AttentionSpec has {spec.num_heads} heads of "
                         f"{spec.head_dim}")
    if key is not None and (key.shape[0] != query.shape[0] or key.shape[1:] != (spec.num_kv_heads, spec.head_dim)):
        raise ValueError(f"compileattn::attention({layer_name!r}): key is {tuple(key.shape)}, expected "
                         f"({query.shape[0]}, {spec.num_kv_heads}, {spec.head_dim}) from the query and the "
                         f"layer's AttentionSpec")
    if key is not None and key.dtype != query.dtype:
        raise TypeError(f"compileattn::attention({layer_name!r}): key is {key.dtype} but query is {query.dtype}; new "
                        f"K/V come in the queries' dtype (an fp8 cache quantizes them)")
    if value is not None and (value.shape != key.shape or value.dtype != key.dtype):
        raise ValueError(f"compileattn::attention({layer_name!r}): value is {tuple(value.shape)} {value.dtype}, "
                         f"key is {tuple(key.shape)} {key.dtype}: they must agree")
    if output.shape != query.shape or output.dtype != query.dtype:
        raise ValueError(f"compileattn::attention({layer_name!r}): output is {tuple(output.shape)} {output.dtype}, "
                         f"it must have the query's shape {tuple(query.shape)} and dtype {query.dtype}")


def _attend_eager(attend, query, output) -> None:
    """``attend`` (a prepared call) on tensors of any strides: prepared calls take dense
    (tokens, heads, head_dim) tensors, so strided ones go through dense copies."""
    if query.is_contiguous() and output.is_contiguous():
        attend(query, output)
    else:
        dense = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        attend(query.contiguous(), dense)
        output.copy_(dense)


def attention_impl(query, key, value, output, layer_name):
    """``compileattn::attention`` called eagerly: checked, then the layer's write and attend."""
    ctx = _context()
    _check_layer_call(ctx, layer_name, query, output, key, value)
    ctx.write[layer_name](key, value)
    _attend_eager(ctx.attend[layer_name], query, output)


def attention_by_id_impl(query, key, value, output, layer_id):
    """``attention`` for the layer ``layer_id`` names (a CPU tensor: reading it does not sync)."""
    attention_impl(query, key, value, output, layer_ids.name_of(layer_id))


def write_layer_kv_impl(key, value, layer_name):
    """Runs inside a compiled piece (captured in its CUDA graph): the prepared write."""
    if layer_name.startswith(context.PIECE_LAYER_PREFIX):  # a shared piece's slot: this piece's layer
        layer_name = context.piece_layer_names.get(layer_name, layer_name)
    try:
        write = _context().write[layer_name]
    except KeyError:
        raise context.missing_layer_error(layer_name) from None
    write(key, value)
    return key.new_empty(0)


def attend_impl(query, output, kv_written, layer_name):
    ctx = _context()
    _check_layer_call(ctx, layer_name, query, output)
    _attend_eager(ctx.attend[layer_name], query, output)


def _lookup_error(layer_name: str, ctx) -> Exception:
    return context.no_context_error() if ctx is None else context.missing_layer_error(layer_name)


def attend_caller(layer_name: str, query_index: int, output_index: int, dense: bool = True):
    """``call(*args)`` for the compiled runtime's attention submodule, whose inputs hold the query
    at ``query_index`` and the output at ``output_index``: the context lookup and the prepared
    call, nothing else. ``dense``: the compile proved query and output contiguous (the hoist pass
    makes them so); otherwise the call goes through dense copies."""

    def call_attend(*args):
        ctx = context._current
        try:
            attend = ctx.attend[layer_name]
        except (AttributeError, KeyError):
            raise _lookup_error(layer_name, ctx) from None
        attend(args[query_index], args[output_index])

    def call_attend_strided(*args):
        ctx = context._current
        try:
            attend = ctx.attend[layer_name]
        except (AttributeError, KeyError):
            raise _lookup_error(layer_name, ctx) from None
        _attend_eager(attend, args[query_index], args[output_index])

    return call_attend if dense else call_attend_strided


def attention_caller(layer_name: str, query_index: int, key_index: int, value_index: int, output_index: int,
                     dense: bool = True):
    """``attend_caller`` for the unified op (write, then attend), when the KV write is not
    captured in the piece before it (``CompileConfig.capture_kv_write=False``)."""

    def call_attention(*args):
        ctx = context._current
        try:
            write, attend = ctx.write[layer_name], ctx.attend[layer_name]
        except (AttributeError, KeyError):
            raise _lookup_error(layer_name, ctx) from None
        write(args[key_index], args[value_index])
        attend(args[query_index], args[output_index])

    def call_attention_strided(*args):
        ctx = context._current
        try:
            write, attend = ctx.write[layer_name], ctx.attend[layer_name]
        except (AttributeError, KeyError):
            raise _lookup_error(layer_name, ctx) from None
        write(args[key_index], args[value_index])
        _attend_eager(attend, args[query_index], args[output_index])

    return call_attention if dense else call_attention_strided


def _write_kv_cache(key, value, key_cache, value_cache, slot_mapping, backend="auto", k_scale=None, v_scale=None):
    selector.run_write(backend, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def _varlen_attention(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                      max_seqlen_k, softmax_scale, causal=True, window_left=-1, softcap=0.0, backend="auto",
                      alibi_slopes=None, k_scale=None, v_scale=None):
    selector.run_varlen(backend, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                        max_seqlen_k, softmax_scale, causal, window_left, softcap, alibi_slopes, k_scale, v_scale)


_lib.impl("write_kv_cache", _write_kv_cache, "CompositeExplicitAutograd")
_lib.impl("write_layer_kv", write_layer_kv_impl, "CompositeExplicitAutograd")
_lib.impl("attend", attend_impl, "CompositeExplicitAutograd")
_lib.impl("varlen_attention", _varlen_attention, "CompositeExplicitAutograd")
_lib.impl("attention", attention_impl, "CompositeExplicitAutograd")
_lib.impl("attention_by_id", attention_by_id_impl, "CompositeExplicitAutograd")


class _InferenceOnly(torch.autograd.Function):
    """Marks ``written`` as produced by an inference-only op: their backward raises."""

    @staticmethod
    def forward(ctx, op_name, num_written, *tensors):
        ctx.op_name = op_name
        written = tensors[:num_written]
        ctx.mark_dirty(*written)
        return written

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.op_name} is inference-only and has no backward: compileattn serves models, it "
                           f"does not train them (run under torch.no_grad() or torch.inference_mode())")


_BelowAutograd = _torch_compat.below_autograd_guard()
#: Resolved once: the Autograd kernel asks it on every eager call.
_dispatch_stack_depth = _torch_compat.dispatch_stack_depth()


def _register_inference_only(name: str, impl, written: tuple[int, ...], inputs: tuple[int, ...],
                             optional: tuple[int, ...] = ()) -> None:
    """The op's Autograd kernel. With plain tensors, no dispatch mode and no input requiring grad
    (an eager inference call, the common case) it calls ``impl`` itself: a redispatch below
    Autograd would cost a second trip through the dispatcher (~2 us of host per call). Tensor
    subclasses (fake, functional), dispatch modes (tracing, debugging) and inputs requiring grad
    take the redispatch: the first two reach their handlers there, and below Autograd the impl's
    own torch ops record no graph (recorded, a reference write would give the caches an autograd
    history chaining each step's activations to the next). Every tensor in ``written`` then gets
    the backward that raises. ``optional``: the positions of inputs that may be None or left out
    (ALiBi slopes, which a model may hold as a parameter)."""
    op = getattr(torch.ops.compileattn, name).default
    qualified = f"compileattn::{name}"
    plain = torch.Tensor
    first_written = written[0]

    def autograd_kernel(*args, **kwargs):
        grad = torch.is_grad_enabled() and (any(args[i].requires_grad for i in inputs) or any(
            i < len(args) and args[i] is not None and args[i].requires_grad for i in optional))
        if not grad and type(args[0]) is plain and type(args[first_written]) is plain and not _dispatch_stack_depth():
            return impl(*args, **kwargs)
        with _BelowAutograd():
            result = op(*args, **kwargs)
        if grad:
            _InferenceOnly.apply(qualified, len(written), *(args[i] for i in written), *(args[i] for i in inputs),
                                 *(args[i] for i in optional if i < len(args) and args[i] is not None))
        return result

    _lib.impl(name, autograd_kernel, "Autograd")


_register_inference_only("attention", attention_impl, written=(3,), inputs=(0, 1, 2))
_register_inference_only("attention_by_id", attention_by_id_impl, written=(3,), inputs=(0, 1, 2))
_register_inference_only("varlen_attention", _varlen_attention, written=(3,), inputs=(0, 1, 2), optional=(15,))
_register_inference_only("write_kv_cache", _write_kv_cache, written=(2, 3), inputs=(0, 1))


@torch.library.register_fake("compileattn::write_kv_cache")
def _write_kv_cache_fake(key, value, key_cache, value_cache, slot_mapping, backend="auto", k_scale=None,
                         v_scale=None):
    return None


@torch.library.register_fake("compileattn::varlen_attention")
def _varlen_attention_fake(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                           max_seqlen_k, softmax_scale, causal=True, window_left=-1, softcap=0.0, backend="auto",
                           alibi_slopes=None, k_scale=None, v_scale=None):
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
    if output.shape != query.shape:
        raise ValueError(f"compileattn::attention({layer_name!r}): output {tuple(output.shape)} must have the "
                         f"query's shape {tuple(query.shape)}")
    return None


@torch.library.register_fake("compileattn::attention_by_id")
def _attention_by_id_fake(query, key, value, output, layer_id):
    # Not its device: the id lives on the CPU while the query may be on a GPU, and fake tensors
    # of some traces are on the meta device.
    if layer_id.dtype != torch.int64 or layer_id.numel() != 1:
        raise TypeError(f"compileattn::attention_by_id: layer_id must be a one-element int64 tensor "
                        f"(compileattn.layer_ids.id_of), got {layer_id.dtype} {tuple(layer_id.shape)}")
    return _attention_fake(query, key, value, output, "by layer id")


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
attention_by_id = torch.ops.compileattn.attention_by_id.default
