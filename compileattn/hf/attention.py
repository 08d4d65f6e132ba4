"""The attention function compileattn registers with transformers' ``AttentionInterface``.

A transformers model whose ``config._attn_implementation`` is ``"compileattn"`` calls
``attention_forward(module, query, key, value, attention_mask, scaling=..., sliding_window=...,
softcap=..., ...)`` from every attention layer, with query (1, heads, tokens, head_dim) after RoPE
and key/value (1, kv_heads, tokens, head_dim). All tokens of a step are packed into that one row;
which token belongs to which sequence, and where its K/V go, is the step's metadata, read by
``compileattn::attention`` from the forward context. transformers builds no mask for an
implementation name it has no mask function for, so ``attention_mask`` is None.

What the op does for a layer is its ``AttentionSpec``, derived when the model was loaded
(``compileattn.hf.model``) and stored on the module as a ``LayerBinding``. The arguments the model
passes are compared with that spec at trace time (under torch.compile, where the check costs
nothing per step) or on a layer's first eager call, never per step: a model that asked for
something else than what the cache was allocated for must fail loudly, not attend wrongly.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .. import context, layer_ids
from ..kv_cache import AttentionSpec

#: The name models are switched to (``model.set_attn_implementation(IMPLEMENTATION)``).
IMPLEMENTATION = "compileattn"
#: Attribute of an attention module that holds its ``LayerBinding``.
BINDING_ATTR = "compileattn_layer"
#: Keyword arguments transformers passes through to attention functions that change nothing about
#: attention here: the model's forward arguments (``position_ids``, ``use_cache``) travel down
#: in ``**kwargs``. Any other keyword is something this function would silently ignore, so the
#: load-time probe refuses the model instead.
PASSTHROUGH_KWARGS = frozenset({"position_ids", "use_cache", "output_attentions", "return_dict"})


class AttentionMismatchError(ValueError):
    """A layer was called with settings that differ from the spec its KV cache was allocated for."""


@dataclasses.dataclass
class LayerBinding:
    """A transformers attention module's compileattn layer: its KV-cache key and spec."""

    name: str
    spec: AttentionSpec
    #: ``settings_of(spec)``: what a call is compared with.
    settings: tuple = dataclasses.field(init=False)
    #: Set after the first eager call passed the check (compiled calls check at trace time).
    checked: bool = False
    #: The layer's identity as a tensor (``compileattn.layer_ids``), for a trace with regions. Not in
    #: the repr: the warm-start key prints the binding, and an id's value depends on the order
    #: layers were registered in the process.
    layer_id: torch.Tensor = dataclasses.field(init=False, repr=False, compare=False)
    #: Who switched the model to this attention to serve it (``"LLM"``), or None: named by the error
    #: of a call outside a forward context, such as the model's own ``generate``. Not in the repr
    #: (the warm-start key prints the binding): it changes nothing the compile sees.
    served_by: str | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.settings = settings_of(self.spec)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "name":  # the id follows the name, or a region trace would attend another layer's cache
            super().__setattr__("layer_id", layer_ids.id_of(value))

    @property
    def layer_name(self) -> str:
        return self.name


def settings_from_call(query: torch.Tensor, key: torch.Tensor, scaling: float | None,
                       sliding_window: int | None, softcap: float | None) -> tuple:
    """The ``AttentionSpec`` fields (``settings_of``'s order) that do what transformers' eager
    attention does with these arguments. Plain scalars, not a spec: this also runs under Dynamo,
    which traces tuple arithmetic but not a frozen dataclass's ``__post_init__``.

    transformers' sliding window lets a query see keys with ``q - kv < sliding_window``: itself
    and ``sliding_window - 1`` earlier ones (``sliding_window_overlay`` in masking_utils; its
    FlashAttention path passes ``window_size=(sliding_window - 1, ...)``). compileattn's
    ``sliding_window`` is FlashAttention's left window, hence the ``- 1``.
    """
    head_dim = query.shape[-1]
    return (query.shape[1], key.shape[1], head_dim,
            float(scaling) if scaling is not None else 1.0 / math.sqrt(head_dim),
            int(sliding_window) - 1 if sliding_window is not None else -1,
            float(softcap) if softcap else 0.0)


def settings_of(spec: AttentionSpec) -> tuple:
    return (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale, spec.sliding_window, spec.softcap)


def spec_from_settings(settings: tuple) -> AttentionSpec:
    heads, kv_heads, head_dim, scale, window, softcap = settings
    return AttentionSpec(heads, kv_heads, head_dim, scale=scale, sliding_window=window, softcap=softcap)


def check_call(binding: LayerBinding, query, key, value, attention_mask, scaling, dropout, sliding_window,
               softcap, kwargs) -> None:
    """Raise ``AttentionMismatchError`` unless this call asks for exactly the layer's spec. The
    layer's name is read only to raise: under Dynamo a read is a per-layer value guard, which would
    keep the decoder layers from sharing one traced region (``compileattn.layer_ids``)."""
    if attention_mask is not None:
        raise AttentionMismatchError(f"{binding.name}: the model passed an attention mask; compileattn attends "
                                     f"causally over the paged cache and cannot apply a mask")
    if dropout:
        raise AttentionMismatchError(f"{binding.name}: dropout={dropout}; put the model in eval mode")
    unknown = sorted(set(kwargs) - PASSTHROUGH_KWARGS)
    if unknown:
        raise AttentionMismatchError(f"{binding.name}: attention arguments {unknown} are not supported")
    if query.dim() != 4 or query.shape[0] != 1 or key.shape[0] != 1:
        raise AttentionMismatchError(f"{binding.name}: expected all tokens packed as one row, got query "
                                     f"{tuple(query.shape)} and key {tuple(key.shape)}")
    if key.shape[2] != query.shape[2] or value.shape != key.shape or key.shape[-1] != query.shape[-1]:
        raise AttentionMismatchError(f"{binding.name}: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                                     f"{tuple(value.shape)}: only self-attention with one head dim is served")
    asked = settings_from_call(query, key, scaling, sliding_window, softcap)
    if asked != binding.settings:
        raise AttentionMismatchError(
            f"{binding.name}: called with (heads, kv_heads, head_dim, scale, window_left, softcap) = {asked}, but its "
            f"KV cache was allocated for {binding.settings}")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers' attention-function signature -> ``(output (1, tokens, heads, head_dim), None)``."""
    binding: LayerBinding = getattr(module, BINDING_ATTR)
    # is_compiling first: under Dynamo the context is never read (a read would guard on it).
    if not torch.compiler.is_compiling() and context._current is None:
        raise context.no_context_error(outside_context_reason(binding.served_by))
    if torch.compiler.is_compiling() or not binding.checked:
        check_call(binding, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, kwargs)
        if not torch.compiler.is_compiling():
            binding.checked = True
    # (1, heads, tokens, dim) -> contiguous (tokens, heads, dim): shape work stays in the graph,
    # in the piece before the op (the op does no shape work per call).
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    out = torch.empty_like(q)
    layer_ids.call_attention(q, k, v, out, binding)
    return out.unsqueeze(0), None


def outside_context_reason(served_by: str | None) -> str | None:
    """Why a model switched to this attention by ``served_by`` runs only inside it: a transformers
    user who calls the model's own ``generate`` after handing it to ``LLM`` learns what happened
    and what to call instead; None (the generic advice) for a model switched otherwise."""
    if served_by is None:
        return None
    return (f"this transformers model's attention was switched to compileattn's ({IMPLEMENTATION!r}) for serving "
            f"through {served_by}, which sets up every step's context; generate with {served_by}.generate, not "
            f"the model's own generate or forward")


def register() -> None:
    """Register ``attention_forward`` as ``"compileattn"`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
