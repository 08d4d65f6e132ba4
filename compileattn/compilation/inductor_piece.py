"""Every Inductor compile of a piece, in the compiling process or a static-compile worker.

One place for what a piece's Inductor compile gets beyond the user's ``inductor_options``: the
pieces' post-grad pass (``passes/residual_addmm.py``). That module is imported here, at the first
piece compile: it loads Inductor's configuration (0.8 s on the CPU box), which a model that never
compiles a piece (eager pieces, a warm start) should not pay for.
"""
from __future__ import annotations

from typing import Any

from .. import _torch_compat


def compile_piece(gm, args: list[Any], dynamic_shapes: str, options: dict):
    """``standalone_compile`` of one piece (``dynamic_shapes``: "from_tracing_context" or
    "from_example_inputs"). ``options``: Inductor config settings (``CompileConfig.inductor_options``),
    which ``standalone_compile`` takes as ``compile_fx``'s ``config_patches`` (its ``options`` are
    ``compile_fx``'s keyword arguments), with the pieces' pass added."""
    from ..passes.residual_addmm import piece_inductor_options

    return _torch_compat.standalone_compile(gm, args, dynamic_shapes,
                                            {"config_patches": piece_inductor_options(dict(options))})
