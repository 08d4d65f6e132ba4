"""Trace a model's repeated decoder layers once: they become one nested compile region.

Dynamo's trace is the largest part of a cold start that grows with depth: ~0.1 s of Python per
decoder layer on the CPU box, 3.1 of 3.5 s for a 32-layer tiny Llama; on the H200 3.9-5.6 s of
Llama-3-8B's cold start. With ``torch.compiler.nested_compile_region`` on the decoder layer's
forward, Dynamo traces the first layer and reuses that subgraph for every other layer whose
guards hold (its weights and its attention layer id are subgraph inputs, ``layer_ids.py``); the
32-layer trace took 0.9 s instead of 3.3 s. torch 2.11 traces every call and only deduplicates
the subgraphs, which saved little or nothing (``_torch_compat.compile_region``): regions are used
where torch reuses the trace (2.13). The backend flattens the regions again
(``passes/regions.py``) before it splits, so what is compiled is what a flat trace gives.

Only during compileattn's own trace (``layers_as_regions``, used by ``@compileattn.compile``
with its default backend): the class's ``forward`` is wrapped for the trace, backend included
(Dynamo reads the wrapper when it builds guards after the backend), and restored after.
Meanwhile the wrapping is process-wide: an eager call in another thread runs the same code
through the region wrapper (a no-op outside a trace) and the by-id op (the same attention), and
another thread's region trace waits for the lock. A model whose layers need more than
``max_reuse_entries`` different subgraphs makes Dynamo raise (2.13), and a graph the backend cannot
flatten raises ``RegionInlineError``: the decorator then traces again without regions
(``compile_stats["regions"]`` says why).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch
from torch import nn

from .. import _torch_compat, layer_ids
from ..hf import kernel_wrappers
from ..hf.attention import BINDING_ATTR
from ..passes import RegionInlineError

#: One region trace at a time: the wrapped ``forward`` and ``layer_ids.tracing_regions`` are
#: process-wide while a trace runs.
_lock = threading.RLock()


def _is_attention(module: nn.Module) -> bool:
    """A compileattn attention layer (own models' ``Attention``, or a transformers attention
    module bound by ``compileattn.hf``): both carry a layer id."""
    return isinstance(getattr(module, "layer_id", None), torch.Tensor) or \
        isinstance(getattr(getattr(module, BINDING_ATTR, None), "layer_id", None), torch.Tensor)


def _holds_attention(block: nn.Module) -> bool:
    """Whether ``block`` contains an attention layer below it. A list of the attention layers
    themselves is not a list of decoder layers: a region that is just the op saves nothing, and
    its q/k/v, views of one projection, alias each other, which Dynamo cannot capture as a region."""
    return not _is_attention(block) and any(_is_attention(m) for m in block.modules())


def repeated_layers(root: nn.Module) -> dict[type, int]:
    """Class -> count of the blocks in ``root``'s ``ModuleList``s that hold attention layers and
    repeat (two or more of one class in a list): the decoder layers."""
    found: dict[type, int] = {}
    for module in root.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            classes = {type(block) for block in module}
            if len(classes) == 1 and _holds_attention(module[0]):
                cls = classes.pop()
                found[cls] = found.get(cls, 0) + len(module)
    return found


def region_failure(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain that says the trace failed inside or because of a region, so
    a flat trace may succeed: torch gave up on the region (past ``max_reuse_entries`` variants;
    a region body Dynamo cannot capture whole, e.g. inputs that alias each other) or the backend
    could not flatten it. None for any other error, which is raised as is, not traced again (a
    model's shape error inside a layer reaches here as Dynamo's fake-tensor error, not the region's)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RegionInlineError) or "invoke_subgraph" in str(exc):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def describe(classes: dict[type, int]) -> str:
    return ", ".join(f"{cls.__name__} x{count}" for cls, count in classes.items())


@contextlib.contextmanager
def patched(classes, region: Callable[[Callable], Callable]) -> Iterator[None]:
    """While the block runs, ``classes``' forward is wrapped by ``region`` (torch's
    ``nested_compile_region``) and attention layers pass layer ids. The whole ``aot_compile``
    must run inside: after the backend returns, Dynamo still builds guards that read the wrapped
    ``forward``'s closure."""
    with _lock:
        own = {cls: cls.__dict__.get("forward") for cls in classes}
        flag = layer_ids.tracing_regions
        try:
            for cls in classes:
                cls.forward = region(cls.forward)
            layer_ids.tracing_regions = True
            yield
        finally:
            layer_ids.tracing_regions = flag
            for cls, forward in own.items():
                if forward is None:  # it was inherited
                    if "forward" in cls.__dict__:
                        del cls.forward
                else:
                    cls.forward = forward


@contextlib.contextmanager
def layers_as_regions(root: object) -> Iterator[str]:
    """While the block runs, the decoder layers of ``root`` (the module whose method is traced)
    are nested compile regions and attention layers pass layer ids. Yields what was done:
    "on: <Class> xN" or "off: <why>"."""
    region = _torch_compat.compile_region()
    if region is None:
        yield f"off: torch {torch.__version__} traces every region call again (nothing saved)"
        return
    if not isinstance(root, nn.Module):
        yield "off: the compiled function is not a module's method"
        return
    classes = repeated_layers(root)
    if not classes:
        yield "off: no repeated layers with attention"
        return
    with kernel_wrappers.original_forwards(root), patched(classes, region):
        yield f"on: {describe(classes)}"
