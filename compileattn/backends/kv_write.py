"""KV-cache writes in plain PyTorch: the shared core every backend can fall back on.

Slot -1 marks a padded token, which must write nothing. Two writers, for two constraints:

- ``write_kv_masked`` drops the -1 slots with a boolean mask. The mask's nonzero count syncs the
  host, so it cannot be captured in a CUDA graph: it is the CPU writer.
- ``write_kv_padded`` never syncs. A capturable scatter cannot skip elements, and ``index_copy_``
  rejects -1, so every padded token is sent to the slot of a real token *with that token's
  values* (``dst = slot of token j, src = j``): duplicate writes in one ``index_copy_`` then carry
  identical bytes and the result does not depend on their order. A step of only padding writes
  slot 0's current rows back onto it. It is the CUDA writer when Triton's kernel is unavailable.

For a builder-made step the indices are computed once per step (``StepWriteIndices``), not per
layer: its padding comes after the real tokens and token 0 is real, so a padded token repeats
token 0's write. Per layer that leaves two ``index_select`` and two ``index_copy_`` (measured on
the H200: 10 us of GPU per layer, against 41 us for the generic write's dozen small kernels).

Into a float8_e4m3fn cache every writer stores ``quantize(x, scale)`` (see kv_cache.py), given the
(kv_heads,) float32 scales.
"""
from __future__ import annotations

import torch

from ..kv_cache import FP8_E4M3_MAX, is_fp8
from .base import PersistentBuffers, StepTensors


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
    """Scatter K/V rows to their slots, skipping slot -1 (host sync: not capturable). Indexed by
    (block, row), so a cache that is a strided view (one half of a combined K/V tensor) works too."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    n = slot_mapping.shape[0]
    block_size = key_cache.shape[1]
    blocks, rows = slots // block_size, slots % block_size
    for new, cache, scale in ((key[:n], key_cache, k_scale), (value[:n], value_cache, v_scale)):
        _bits(cache)[blocks, rows] = _bits(quantize(new[valid], scale, cache.dtype))


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
        if cache.is_contiguous():  # every cache a KVCache holds: one flat index, two kernels
            flat = _bits(cache.view(-1, *cache.shape[2:]))
            rows = torch.where(any_valid, _bits(quantize(new.index_select(0, src), scale, cache.dtype)),
                               flat.index_select(0, dst))
            flat.index_copy_(0, dst, rows)
        else:  # a strided view (one half of a combined K/V tensor): indexed by (block, row)
            at = (dst // cache.shape[1], dst % cache.shape[1])
            bits = _bits(cache)
            rows = torch.where(any_valid, _bits(quantize(new.index_select(0, src), scale, cache.dtype)), bits[at])
            bits.index_put_(at, rows)


class StepWriteIndices:
    """``dst``/``src`` of a builder-made step's capturable write, in persistent buffers (a
    captured write reads them there), refreshed by ``refresh()`` once per step."""

    def __init__(self, num_tokens: int, tensors: StepTensors, buffers: PersistentBuffers):
        self.slots = tensors.slot_mapping
        self.dst = buffers.get(f"kv_write.dst.{num_tokens}", (num_tokens,), torch.int64)
        self.src = buffers.get(f"kv_write.src.{num_tokens}", (num_tokens,), torch.int64)
        self.tokens = buffers.get(f"kv_write.tokens.{num_tokens}", (num_tokens,), torch.int64)
        # Made on the device: a table first built while a CUDA graph captures (a layer captured on
        # its own) must not copy from the host.
        torch.arange(num_tokens, out=self.tokens)

    def refresh(self) -> None:
        """Two small device ops, no host sync: padded tokens (slot -1) repeat token 0's write."""
        valid = self.slots >= 0
        torch.where(valid, self.slots, self.slots[:1], out=self.dst)
        torch.mul(self.tokens, valid, out=self.src)  # padded tokens read token 0


def prepare_torch_write(key_cache, value_cache, indices: StepWriteIndices | None, slot_mapping, kv_scales=None):
    """``write(key, value)`` for one layer's caches: with ``indices`` the capturable indexed write
    of a builder-made step, without them the masked (CPU) write of ``slot_mapping``; into a
    quantized cache both store ``quantize`` under its ``(k_scale, v_scale)``."""
    k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
    if indices is None:
        def write_masked(key, value):
            write_kv_masked(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return write_masked
    dst, src = indices.dst, indices.src
    k_flat = _bits(key_cache.view(-1, *key_cache.shape[2:]))
    v_flat = _bits(value_cache.view(-1, *value_cache.shape[2:]))
    k_dtype, v_dtype = key_cache.dtype, value_cache.dtype

    def write_indexed(key, value):
        k_flat.index_copy_(0, dst, _bits(quantize(key.index_select(0, src), k_scale, k_dtype)))
        v_flat.index_copy_(0, dst, _bits(quantize(value.index_select(0, src), v_scale, v_dtype)))

    return write_indexed
