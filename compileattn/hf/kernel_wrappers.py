"""Transformers' hub-kernel wrappers on attention classes, stepped around while decoder layers are
traced as nested compile regions.

With the ``kernels`` package installed (transformers 5.25 requires it; 5.17 did not), transformers
decorates its attention classes with ``kernels.use_kernelized_func(apply_rotary_pos_emb)``: their
``forward`` sets a process-wide "active kernel functions" variable around the original forward,
so that a hub function it calls runs the instance's kernelized version. Under Dynamo that
set-and-reset is a mutation of a global object, and torch 2.13 reuses no nested compile region
with a side effect ("subgraph_reuse: not eligible -- subgraph has side effects"): every decoder
layer is traced again and the regions save nothing (``compilation/regions.py``).

For an instance never kernelized (no ``forward`` of its own on its private function wrappers,
which is what ``kernels.kernelize`` sets), the routed call is the plain function, the same call
the hub function makes when no routing is active. So for the trace, ``original_forwards`` puts
the wrapped forward back on such classes and restores the wrapper after: the traced code is the
same, minus the side effect. A class with any kernelized instance in the model keeps its
wrapper (its layers are then traced one by one, correctly).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from torch import nn


def _is_kernel_wrapper(forward: Callable) -> bool:
    """``kernels.use_kernelized_func``'s forward: ``functools.wraps`` copied the original's name
    and module, but its globals are the kernels package's."""
    module = getattr(forward, "__globals__", {}).get("__name__", "")
    return module.split(".")[0] == "kernels" and callable(getattr(forward, "__wrapped__", None))


def _never_kernelized(module: nn.Module) -> bool:
    """Its private function wrappers (kernels 0.19's ``_kernel_funcs``) have no forward of their
    own. An instance without them is of another kernels version, whose routing is not known here:
    not stepped around."""
    funcs = vars(module).get("_kernel_funcs")
    return isinstance(funcs, dict) and not any("forward" in vars(wrapper) for wrapper in funcs.values())


def unwrappable_classes(root: nn.Module) -> list[type]:
    """Classes in ``root`` whose ``forward`` is a hub-kernel wrapper and that no instance in
    ``root`` has been kernelized for."""
    wrapped: dict[type, bool] = {}
    for module in root.modules():
        forward = getattr(type(module), "forward", None)
        if _is_kernel_wrapper(forward):  # on the decorated class, which a subclass may inherit from
            owner = next(c for c in type(module).__mro__ if c.__dict__.get("forward") is forward)
            wrapped[owner] = wrapped.get(owner, True) and _never_kernelized(module)
    return [cls for cls, plain in wrapped.items() if plain]


@contextlib.contextmanager
def original_forwards(root: nn.Module) -> Iterator[list[type]]:
    """While the block runs, ``unwrappable_classes(root)`` have their original ``forward``.
    Process-wide, like the region wrapping it serves: an eager call of another model's instance
    of such a class in another thread meanwhile runs its plain function, not a hub kernel."""
    classes = unwrappable_classes(root)
    wrappers = {cls: cls.__dict__["forward"] for cls in classes}
    try:
        for cls, wrapper in wrappers.items():
            cls.forward = wrapper.__wrapped__
        yield classes
    finally:
        for cls, wrapper in wrappers.items():
            cls.forward = wrapper
