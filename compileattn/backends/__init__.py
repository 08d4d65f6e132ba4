"""Attention kernel backends: reference (plain PyTorch), triton (own kernels), flash (FA4/FA2)."""
from .base import AttentionBackend
from .registry import backend_names, get_backend, resolve

__all__ = ["AttentionBackend", "backend_names", "get_backend", "resolve"]
