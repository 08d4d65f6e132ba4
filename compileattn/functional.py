"""FlashAttention-shaped Python entry points over the compileattn ops, with argument checks.

``flash_attn_varlen_func`` mirrors ``flash_attn.flash_attn_varlen_func`` (plus FlashAttention's
``block_table``/``seqused_k`` paged form) so code written for flash-attn ports by changing the
import. ``validate=True`` (the default) checks values too, which reads device tensors (a host sync
on CUDA); hot paths built on per-step metadata call the ops directly instead.
"""
from __future__ import annotations

import math

import torch

from . import ops
from .validation import check_kv_write_args, check_varlen_args, check_varlen_values


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, *,
    softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
    block_table=None, seqused_k=None, out=None, backend: str = "auto", validate: bool = True,
) -> torch.Tensor:
    """Attention over ragged sequences; K/V contiguous (``cu_seqlens_k``) or paged (``block_table``)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a tensor, got {type(q).__name__}")
    if out is None:
        out = torch.empty_like(q)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair, got {window_size!r}")
    window_left, window_right = int(window_size[0]), int(window_size[1])
    if window_right not in (-1, 0):
        raise ValueError(f"window_size right={window_right} is not supported (only -1 or 0: compileattn "
                         f"serves decoders, whose windows look left)")
    # FlashAttention: a right window of 0 hides every later key, which is exactly causal masking.
    causal = causal or window_right == 0
    # Structure first: the defaults below read the index tensors, which must exist and be tensors.
    check_varlen_args(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, 0, 0,
                      window_left, softcap, check_values=False)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 0
    if max_seqlen_k is None:
        if seqused_k is not None:
            max_seqlen_k = int(seqused_k.max()) if seqused_k.numel() else 0
        else:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if cu_seqlens_k.numel() > 1 else 0
    if validate:
        check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    ops.varlen_attention(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                         max_seqlen_k, float(softmax_scale), bool(causal), window_left, float(softcap), backend)
    return out


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, backend: str = "auto",
                   validate: bool = True) -> None:
    """Scatter (tokens, kv_heads, head_dim) K/V into paged caches; slot -1 = padded token, skipped."""
    check_kv_write_args(key, value, key_cache, value_cache, slot_mapping, check_values=validate)
    ops.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, backend)
