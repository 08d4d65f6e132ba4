"""KV-cache writes in plain PyTorch: the shared core every backend can fall back on.

Slot -1 marks a padded token, which must write nothing. Two writers, for two constraints:

- ``write_kv_masked`` drops the -1 slots with a boolean mask. The mask's nonzero count syncs the
  host, so it cannot be captured in a CUDA graph: it is the CPU writer.
- ``write_kv_padded`` never syncs. A capturable scatter cannot skip elements, and ``index_copy_``
  rejects -1, so every padded token is sent to the slot of a real token *with that token's
  values* (``dst = slot of token j, src = j``): duplicate writes in one ``index_copy_`` then carry
  identical bytes and the result does not depend on their order. A step of only padding writes
  slot 0's current rows back onto it. It is the CUDA writer when Triton's kernel is unavailable.

Into a float8_e4m3fn cache both store ``quantize(x, scale)`` (see kv_cache.py), given the
(kv_heads,) float32 scales.
"""
from __future__ import annotations

import torch

from ..kv_cache import FP8_E4M3_MAX, is_fp8
from .base import StepTensors


def quantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(tokens, kv_heads, head_dim) rows as stored in a ``dtype`` cache: ``x / scale`` per KV head,
    saturated to e4m3's finite range and rounded to nearest, when ``scale`` is given."""
    if scale is None:
        return x
    scaled = x.float() / scale.view(1, -1, 1)
    return scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 rows as their bytes: torch has no ``index_copy_`` for float8 (the copy is bitwise anyway)."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def write_kv_masked(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter K/V rows to their slots, skipping slot -1 (host sync: not capturable)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    n = slot_mapping.shape[0]
    for new, cache, scale in ((key[:n], key_cache, k_scale), (value[:n], value_cache, v_scale)):
        _bits(cache.view(-1, *cache.shape[2:]))[slots] = _bits(quantize(new[valid], scale, cache.dtype))


def write_kv_padded(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter K/V rows to their slots, skipping slot -1, without a host sync (capturable)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    valid = slot_mapping >= 0
    first = valid.to(torch.uint8).argmax().view(1)  # the first real token, 0 if none
    src = torch.where(valid, torch.arange(n, device=slot_mapping.device), first)
    dst = torch.where(valid, slot_mapping, slot_mapping.index_select(0, first)).clamp_(min=0)
    any_valid = valid.index_select(0, first).view(1, 1, 1)
    for new, cache, scale in ((key[:n], key_cache, k_scale), (value[:n], value_cache, v_scale)):
        flat = _bits(cache.view(-1, *cache.shape[2:]))
        rows = torch.where(any_valid, _bits(quantize(new.index_select(0, src), scale, cache.dtype)),
                           flat.index_select(0, dst))
        flat.index_copy_(0, dst, rows)


def prepare_torch_write(tensors: StepTensors, key_cache, value_cache, capturable: bool, kv_scales=None):
    """``write(key, value)`` for one layer's caches with the step's slot mapping (and a quantized
    cache's ``(k_scale, v_scale)``) bound."""
    write = write_kv_padded if capturable else write_kv_masked
    slots = tensors.slot_mapping
    k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)

    def write_layer(key, value):
        write(key, value, key_cache, value_cache, slots, k_scale, v_scale)

    return write_layer
