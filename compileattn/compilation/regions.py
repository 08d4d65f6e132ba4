"""Trace a model's repeated decoder layers once: they become one nested compile region.

Dynamo's trace is the largest part of a cold start that grows with depth: ~0.1 s of Python per
decoder layer on the CPU box, 3.1 of 3.5 s for a 32-layer tiny Llama; on the H200 3.9-5.6 s of
Llama-3-8B's cold start. With ``torch.compiler.nested_compile_region`` on the decoder layer's
forward, Dynamo traces the first layer and reuses that subgraph for every other layer whose
guards hold (its weights and its attention layer id are subgraph inputs, ``layer_ids.py``); the
32-layer trace took 1.1 s instead of 3.1 s. torch 2.11 traces every call and only deduplicates
the subgraphs, which saved little or nothing (``_torch_compat.compile_region``): regions are used
where torch reuses the trace (2.13). The backend flattens the regions again
(``passes/regions.py``) before it splits, so what is compiled is what a flat trace gives.

Only during compileattn's own trace (``layers_as_regions``, used by ``@compileattn.compile``
with its default backend): the class's ``forward`` is wrapped for the trace and restored after, so
eager calls, other backends and other ``torch.compile`` calls see the model unchanged.
A model whose layers need more than ``max_reuse_entries`` different subgraphs makes Dynamo raise (2.13);
the decorator then traces again without regions (``compile_stats["regions"]`` says why).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch import nn

from .. import _torch_compat, layer_ids
from ..hf.attention import BINDING_ATTR

#: One region trace at a time: the wrapped ``forward`` and ``layer_ids.tracing_regions`` are
#: process-wide while a trace runs.
_lock = threading.RLock()


def _holds_attention(block: nn.Module) -> bool:
    """Whether ``block`` contains a compileattn attention layer (own models' ``Attention`` or a
    transformers attention module bound by ``compileattn.hf``): both carry a layer id."""
    return any(isinstance(getattr(m, "layer_id", None), torch.Tensor)
               or isinstance(getattr(getattr(m, BINDING_ATTR, None), "layer_id", None), torch.Tensor)
               for m in block.modules())


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


def describe(classes: dict[type, int]) -> str:
    return ", ".join(f"{cls.__name__} x{count}" for cls, count in classes.items())


@contextlib.contextmanager
def layers_as_regions(root: object) -> Iterator[str]:
    """While the block runs, the decoder layers of ``root`` (an ``nn.Module``) are nested compile
    regions and attention layers pass layer ids. Yields what was done: "on: <Class> xN" or "off: <why>"."""
    region = _torch_compat.compile_region()
    classes = repeated_layers(root) if isinstance(root, nn.Module) else {}
    if region is None:
        yield f"off: torch {torch.__version__} traces every region call again (nothing saved)"
        return
    if not classes:
        yield "off: no repeated layers with attention"
        return
    with _lock:
        own = {cls: cls.__dict__.get("forward") for cls in classes}
        try:
            for cls in classes:
                cls.forward = region(cls.forward)
            layer_ids.tracing_regions = True
            yield f"on: {describe(classes)}"
        finally:
            layer_ids.tracing_regions = False
            for cls, forward in own.items():
                if forward is None:
                    del cls.forward  # it was inherited
                else:
                    cls.forward = forward
