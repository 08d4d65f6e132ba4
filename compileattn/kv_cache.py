"""Per-layer attention shape (AttentionSpec) and the paged KV cache that goes with it.

Everything a layer's attention needs that is not per-step lives here: head counts, head dim,
softmax scale, sliding window and softcap. Validating it once, at model construction and at
cache allocation, is what lets the per-layer op skip validation on the hot path.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch

#: Head dims every backend must accept. Backends may support more (reference does any of these),
#: and fall back when they support fewer.
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 256)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_head_dim(head_dim: int, name: str = "head_dim") -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name}={head_dim} is not supported; supported head dims: {SUPPORTED_HEAD_DIMS}")


def check_gqa(num_heads: int, num_kv_heads: int) -> None:
    if num_heads <= 0 or num_kv_heads <= 0:
        raise ValueError(f"num_heads ({num_heads}) and num_kv_heads ({num_kv_heads}) must be positive")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads}) for GQA/MQA"
        )


def check_dtype(dtype: torch.dtype, name: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {dtype}; supported: float32, float16, bfloat16")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Shape and softmax settings of one attention layer (frozen, hashable: plans key on it)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None = None
    #: Tokens to the left a query may see (FlashAttention's window_size[0]); -1 = unlimited.
    sliding_window: int = -1
    #: tanh soft-capping of logits (Gemma-2); 0 = off.
    softcap: float = 0.0
    causal: bool = True

    def __post_init__(self) -> None:
        check_gqa(self.num_heads, self.num_kv_heads)
        check_head_dim(self.head_dim)
        if self.scale is None:
            object.__setattr__(self, "scale", 1.0 / math.sqrt(self.head_dim))
        elif isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)):
            raise TypeError(f"scale must be a float (or None for 1/sqrt(head_dim)), got {type(self.scale).__name__}")
        elif not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a finite positive float (the softmax scale), got {self.scale}")
        if self.sliding_window < -1:
            raise ValueError(f"sliding_window must be -1 (off) or >= 0, got {self.sliding_window}")
        if self.softcap < 0:
            raise ValueError(f"softcap must be >= 0, got {self.softcap}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclasses.dataclass
class KVCache:
    """One layer's paged cache: key/value of shape (num_blocks, block_size, kv_heads, head_dim)."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    spec: AttentionSpec

    def __post_init__(self) -> None:
        k, v, spec = self.key_cache, self.value_cache, self.spec
        if k.shape != v.shape:
            raise ValueError(f"key_cache shape {tuple(k.shape)} and value_cache shape {tuple(v.shape)} disagree")
        if k.dtype != v.dtype:
            raise TypeError(f"key_cache dtype {k.dtype} and value_cache dtype {v.dtype} disagree")
        if k.device != v.device:
            raise ValueError(f"key_cache on {k.device} but value_cache on {v.device}")
        check_dtype(k.dtype, "key_cache")
        if k.dim() != 4:
            raise ValueError(f"key_cache must be (num_blocks, block_size, kv_heads, head_dim), got {tuple(k.shape)}")
        if k.shape[2] != spec.num_kv_heads or k.shape[3] != spec.head_dim:
            raise ValueError(
                f"key_cache shape {tuple(k.shape)} does not match the layer's "
                f"num_kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}"
            )
        if not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError("key_cache and value_cache must be contiguous")

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[0]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.key_cache.dtype

    @property
    def device(self) -> torch.device:
        return self.key_cache.device


def allocate_kv_caches(
    specs: Mapping[str, AttentionSpec],
    num_blocks: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
) -> dict[str, KVCache]:
    """Zero-filled caches for every layer of ``specs`` (layer name -> spec)."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    check_dtype(dtype, "dtype")
    caches = {}
    for name, spec in specs.items():
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        caches[name] = KVCache(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            spec,
        )
    return caches
