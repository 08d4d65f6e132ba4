"""Attention kernel backends. ``selector.py`` makes every choice of kernel; a new backend is a
subclass of ``base.AttentionBackend`` in its own module, named in ``selector.py``."""
from .base import AttentionBackend
from .selector import BACKEND_NAMES, get_backend

__all__ = ["AttentionBackend", "BACKEND_NAMES", "get_backend"]
