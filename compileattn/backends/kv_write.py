"""KV-cache writes in plain PyTorch: the shared core every backend can fall back on.

Slot -1 marks a padded token, which must write nothing. Two writers, for two constraints:

- ``write_kv_masked`` drops the -1 slots with a boolean mask. The mask's nonzero count syncs the
  host, so it cannot be captured in a CUDA graph: it is the CPU writer.
- ``write_kv_padded`` never syncs. A capturable scatter cannot skip elements, and ``index_copy_``
  rejects -1, so every padded token is sent to the slot of a real token *with that token's
  values* (``dst = slot of token j, src = j``): duplicate writes in one ``index_copy_`` then carry
  identical bytes and the result does not depend on their order. A step of only padding writes
  slot 0's current rows back onto it. It is the CUDA writer when Triton's kernel is unavailable.
"""
from __future__ import annotations

import torch

from .base import StepTensors


def write_kv_masked(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Scatter K/V rows to their slots, skipping slot -1 (host sync: not capturable)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    n = slot_mapping.shape[0]
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[:n][valid]
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[:n][valid]


def write_kv_padded(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Scatter K/V rows to their slots, skipping slot -1, without a host sync (capturable)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    valid = slot_mapping >= 0
    first = valid.to(torch.uint8).argmax().view(1)  # the first real token, 0 if none
    src = torch.where(valid, torch.arange(n, device=slot_mapping.device), first)
    dst = torch.where(valid, slot_mapping, slot_mapping.index_select(0, first)).clamp_(min=0)
    any_valid = valid.index_select(0, first).view(1, 1, 1)
    for new, cache in ((key[:n], key_cache), (value[:n], value_cache)):
        flat = cache.view(-1, *cache.shape[2:])
        rows = torch.where(any_valid, new.index_select(0, src), flat.index_select(0, dst))
        flat.index_copy_(0, dst, rows)


def prepare_torch_write(tensors: StepTensors, key_cache, value_cache, capturable: bool):
    """``write(key, value)`` for one layer's caches with the step's slot mapping bound."""
    write = write_kv_padded if capturable else write_kv_masked
    slots = tensors.slot_mapping

    def write_layer(key, value):
        write(key, value, key_cache, value_cache, slots)

    return write_layer
