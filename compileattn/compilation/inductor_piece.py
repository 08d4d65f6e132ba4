"""Every Inductor compile of a piece, in the compiling process or a compile worker.

One place for what a piece's Inductor compile gets: the user's ``CompileConfig.inductor_options``
(Inductor config settings) and the pieces' post-grad pass (``passes/residual_addmm.py``), run
before any pass the user set there or in ``torch._inductor.config`` (theirs still runs, after
ours). ``{"post_grad_custom_post_pass": None}`` in ``inductor_options`` turns the pieces' pass off,
with the user's global one. The pass's module loads Inductor's configuration (0.8 s on the CPU
box) and is imported at the first piece compile, which a model that never compiles one (eager
pieces, a warm start) does not pay for.
"""
from __future__ import annotations

from typing import Any

from .. import _torch_compat

_POST_PASS = "post_grad_custom_post_pass"


def config_patches(options: dict) -> dict:
    """``options`` with the pieces' post-grad pass chained in front of the user's."""
    from ..passes.residual_addmm import UnfuseResidualAddmm

    patches = dict(options)
    if _POST_PASS in patches and patches[_POST_PASS] is None:
        return patches
    theirs = patches[_POST_PASS] if _POST_PASS in patches else _torch_compat.inductor_config_value(_POST_PASS)
    patches[_POST_PASS] = UnfuseResidualAddmm(then=theirs)
    return patches


def compile_piece(gm, args: list[Any], dynamic_shapes: str, options: dict):
    """``standalone_compile`` of one piece (``dynamic_shapes``: "from_tracing_context" or
    "from_example_inputs"), ``options`` being ``CompileConfig.inductor_options``."""
    return _torch_compat.standalone_compile(gm, args, dynamic_shapes, config_patches(options))
