"""FlashAttention-4's SM90 K/V tile choice and page-loader geometry, restated from its source
(flash-attn-4 4.0.0b36: ``interface._tile_size_fwd_sm90`` l.151-183, ``paged_kv.py`` l.69-87 and
225-236), for the tests that check compileattn refuses what that loader gets wrong. On the GPU the
backend asks FA4 itself; a disagreement with this restatement fails the refusal tests there."""
from __future__ import annotations

import math
import types


def tile_size_fwd_sm90(head_dim, head_dim_v, causal, local):
    """FA4's SM90 forward tile height ``n_block_size`` (head_dim_v == head_dim)."""
    if head_dim <= 64:
        n = 128
    elif head_dim <= 96:
        n = 128 if causal or local else 144
    elif head_dim <= 128:
        n = 128
    elif head_dim <= 192:
        n = 96 if local else 112
    else:
        n = 64 if local else 80
    return types.SimpleNamespace(n_block_size=n)


def resolve_causal_local_window(causal, window_left, window_right):
    return causal, window_left is not None, window_left, window_right


def faked_interface():
    """A stand-in for ``flash_attn.cute.interface`` with just the tile choice."""
    return types.SimpleNamespace(_tile_size_fwd_sm90=tile_size_fwd_sm90,
                                 _resolve_causal_local_window=resolve_causal_local_window)


def paged_loader_overruns(head_dim: int, causal: bool, window_left: int, block_size: int) -> bool:
    """Whether FA4's SM90 row-wave page loader writes past the K/V tile for this paged layout."""
    if not block_size:
        return False  # contiguous K/V: TMA loads
    tile_n = tile_size_fwd_sm90(head_dim, head_dim, causal, window_left >= 0).n_block_size
    if block_size == tile_n:
        return False  # the page is the tile: TMA loads
    wave = 128 // (math.gcd(head_dim, 64) // 8)
    return tile_n % wave != 0
