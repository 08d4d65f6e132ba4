"""compileattn: FlashAttention as a first-class citizen of torch.compile for LLM inference.

Public API only; see README.md for the data path of one step.
"""
import logging as _logging

from . import ops  # noqa: F401  (defines the torch.ops.compileattn.* attention ops)
from .parallel import comm as _comm  # noqa: F401  (defines torch.ops.compileattn.all_reduce: pieces of
#                                     a tensor-parallel model call it, in compile workers too)
from .config import CompileConfig
from .context import get_forward_context, set_forward_context
from .counters import counters
from .functional import flash_attn_varlen_func, flash_attn_with_kvcache, write_kv_cache
from .kv_cache import AttentionSpec, KVCache, alibi_slopes, allocate_kv_caches, fp8_scale
from .metadata import AttentionMetadata, AttentionMetadataBuilder, SequenceStep

_logging.getLogger("compileattn").addHandler(_logging.NullHandler())


def _register_backend_name() -> None:
    """Also register "compileattn" with Dynamo on import. The entry point covers installed copies;
    this covers a checkout used through PYTHONPATH (as on machines with no package index)."""
    from ._torch_compat import register_backend, registered_backends

    if "compileattn" not in registered_backends():
        def compileattn(gm, example_inputs, options=None):
            from .compilation.backend import compileattn_backend

            return compileattn_backend(gm, example_inputs, options=options)

        register_backend(compileattn, name="compileattn")


_register_backend_name()

__version__ = "0.1.0"


def __getattr__(name):
    # Imported lazily: they pull in torch._dynamo / Inductor, which costs seconds at import (the
    # engine's LLM, in turn, transformers when it loads a model).
    if name in ("compile", "RecompileError"):
        from .compilation import decorator

        return getattr(decorator, name)
    if name in ("LLM", "RequestOutput", "SamplingParams"):
        from .engine import llm

        return getattr(llm, name)
    if name == "compileattn_backend":
        from .compilation.backend import compileattn_backend

        return compileattn_backend
    raise AttributeError(f"module 'compileattn' has no attribute {name!r}")


__all__ = [
    "AttentionMetadata", "AttentionMetadataBuilder", "AttentionSpec", "CompileConfig", "KVCache", "LLM",
    "RecompileError", "RequestOutput", "SamplingParams", "SequenceStep", "alibi_slopes", "allocate_kv_caches",
    "compile", "compileattn_backend", "counters", "flash_attn_varlen_func", "flash_attn_with_kvcache", "fp8_scale",
    "get_forward_context", "set_forward_context", "write_kv_cache",
]
