"""The attention layer models use: reshapes in Python, then one ``compileattn::attention`` call.

The reshapes and shape checks here are plain Python on static sizes, so under torch.compile
they are evaluated at trace time or become views inside the captured piece before the op; the op
itself receives (tokens, heads, head_dim) tensors and does no shape work per call. The error
message names the layer only when it is raised: a traced read of ``layer_name`` would be a
per-layer constant, which keeps Dynamo from tracing the decoder layer once for all (``layer_ids.py``).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import layer_ids
from ..kv_cache import AttentionSpec


class Attention(nn.Module):
    def __init__(self, spec: AttentionSpec, layer_name: str):
        super().__init__()
        self.spec = spec
        self.layer_name = layer_name  # sets layer_id too

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "layer_name":
            #: The layer's identity as a tensor (``layer_ids.py``), for a trace with regions:
            #: kept in step with the name, or a region trace would attend another layer's cache.
            super().__setattr__("layer_id", layer_ids.id_of(value))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (tokens, heads*head_dim), k/v (tokens, kv_heads*head_dim) -> (tokens, heads*head_dim)."""
        spec = self.spec
        d = spec.head_dim
        # 2-D each: view() below would fold another leading dim into the token or head dims.
        if (q.dim() != 2 or k.dim() != 2 or q.shape[1] != spec.num_heads * d or k.shape[1] != spec.num_kv_heads * d
                or v.shape != k.shape):
            raise ValueError(
                f"{self.layer_name}: expected q (tokens, {spec.num_heads * d}) and k/v (tokens, "
                f"{spec.num_kv_heads * d}); "
                f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        n = q.shape[0]
        q = q.view(n, spec.num_heads, d)
        k = k.view(n, spec.num_kv_heads, d)
        v = v.view(n, spec.num_kv_heads, d)
        out = torch.empty_like(q)
        layer_ids.call_attention(q, k, v, out, self)
        return out.view(n, spec.num_heads * d)


class ServedModel(nn.Module):
    """What the engine asks of compileattn's own decoders (``model_runner``'s model interface):
    their vocabulary and positions come from ``config``, their attention layers sit at
    ``model.layers[i].self_attn.attn``."""

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_position(self) -> int:
        return self.config.max_position

    def attention_specs(self) -> dict[str, AttentionSpec]:
        """Layer name -> its AttentionSpec: what the KV caches are allocated from."""
        return {layer.self_attn.attn.layer_name: layer.self_attn.attn.spec for layer in self.model.layers}
