"""The ``compileattn`` torch.compile backend (entry point ``torch_dynamo_backends``)."""
from __future__ import annotations

from typing import Any

import torch


def compileattn_backend(gm, example_inputs, options: dict[str, Any] | None = None):
    """torch.compile(model, backend="compileattn", options={...}); see CompileConfig for options.

    Returns the ``StepDispatcher`` (a ``SerializableCallable``, so ``aot_compile`` can save it);
    with ``debug_dump_dir`` set, its bound ``__call__`` instead, because depyf's dump reads the
    compiled callable's ``__code__`` (the dispatcher is then ``result.__self__``).
    """
    from .. import ops  # noqa: F401  (registers the ops when torch loads us by entry point)
    from ..config import CompileConfig
    from .dispatch import StepDispatcher
    from .piecewise import split_and_compile

    config = CompileConfig.from_options(options)
    if config.compile_kernels_ahead:  # torch.compile's path (the decorator's first call has started them)
        from .kernel_warmup import start

        start()  # the Inductor compiles of the pieces are still ahead: seconds to overlap
    compiled = split_and_compile(gm, example_inputs, config)
    device = next((a.device for a in example_inputs if isinstance(a, torch.Tensor)), torch.device("cpu"))
    try:
        dispatcher = StepDispatcher(compiled, config, device)
    except BaseException:
        if compiled.landing is not None:  # nobody will install what it brings
            compiled.landing.close()
        raise
    if config.debug_dump_dir:
        from .debug import expect_transformed_code

        expect_transformed_code(config)
        return dispatcher.__call__
    return dispatcher
