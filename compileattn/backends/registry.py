"""Backend lookup by name, the ``auto`` choice, and fallback with one logged reason.

``auto`` on the CPU is ``reference`` (the only CPU backend). On CUDA it is chosen per regime from
measurements on the H200 (see ``AUTO_TABLE`` in ``auto.py`` and benchmarks/results/).
"""
from __future__ import annotations

import importlib
import logging

import torch

from .base import AttentionBackend

logger = logging.getLogger("compileattn")

#: name -> "module:Class", imported on first use so a missing optional package costs nothing.
_BACKENDS = {
    "reference": "compileattn.backends.reference:ReferenceBackend",
    "triton": "compileattn.backends.triton.backend:TritonBackend",
    "flash": "compileattn.backends.flash:FlashBackend",
    "auto": "compileattn.backends.auto:AutoBackend",
}
#: Who takes over when a backend cannot run a configuration.
FALLBACK_ORDER = ("flash", "triton", "reference")

_instances: dict[tuple[str, str], AttentionBackend] = {}
_logged: set[tuple[str, str]] = set()


def backend_names() -> list[str]:
    return list(_BACKENDS)


def get_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """The (cached) backend instance ``name`` for ``device``'s type."""
    if not isinstance(name, str):
        raise TypeError(f"attention_backend must be a str, got {type(name).__name__}")
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend={name!r} is unknown; choose from {backend_names()}")
    device_type = torch.device(device).type
    key = (name, device_type)
    inst = _instances.get(key)
    if inst is None:
        module, cls = _BACKENDS[name].split(":")
        inst = getattr(importlib.import_module(module), cls)(device_type)
        _instances[key] = inst
    return inst


def log_fallback_once(src: str, dst: str, reason: str) -> None:
    key = (src, reason)
    if key not in _logged:
        _logged.add(key)
        logger.info("attention backend %s cannot run this configuration (%s); using %s", src, reason, dst)


def resolve(backend: AttentionBackend, cache) -> AttentionBackend:
    """The backend that runs ``cache``'s layer when ``backend`` was asked for (memoised on the cache)."""
    chosen = cache.resolved.get(backend)
    if chosen is None:
        chosen = cache.resolved[backend] = first_supporting(backend, cache.spec, cache.dtype,
                                                            cache.device, cache.block_size)
    return chosen


def first_supporting(backend, spec, dtype, device, block_size) -> AttentionBackend:
    """``backend`` if it runs the configuration, else the next in FALLBACK_ORDER that does (the
    reason logged once); ValueError if none does."""
    reason = backend.unsupported_reason(spec, dtype, device, block_size)
    if reason is None:
        return backend
    start = FALLBACK_ORDER.index(backend.name) + 1 if backend.name in FALLBACK_ORDER else 0
    for name in FALLBACK_ORDER[start:]:
        try:
            candidate = get_backend(name, device)
        except ImportError as exc:  # an optional package is missing: that is a reason too
            log_fallback_once(name, "next", f"not importable: {exc}")
            continue
        if candidate.unsupported_reason(spec, dtype, device, block_size) is None:
            log_fallback_once(backend.name, name, reason)
            return candidate
    raise ValueError(f"no attention backend runs {spec} with dtype {dtype} on {device} "
                     f"(block size {block_size}); {backend.name}: {reason}")
