"""The ``compileattn`` torch.compile backend (entry point ``torch_dynamo_backends``)."""
from __future__ import annotations

from typing import Any


def compileattn_backend(gm, example_inputs, options: dict[str, Any] | None = None):
    """torch.compile(model, backend="compileattn", options={...}); see CompileConfig for options."""
    from . import ops  # noqa: F401  (registers the ops when torch loads us by entry point)
    from .piecewise import compile_piecewise
    from .config import CompileConfig

    return compile_piecewise(gm, example_inputs, CompileConfig.from_options(options))
