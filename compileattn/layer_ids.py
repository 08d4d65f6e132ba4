"""A layer's identity as a tensor, so that Dynamo can trace one decoder layer for all of them.

Dynamo traces each of a model's N decoder layers again (~0.1 s of Python per layer on the CPU
box: 3.1 s of a 32-layer tiny Llama's trace, where compileattn's own code is under 1 %).
``torch.compiler.nested_compile_region`` traces a repeated layer once and reuses the subgraph
for the next layer when every guard of the first trace holds for it. Tensors a layer reads
become subgraph inputs, but a Python value becomes a constant with a value guard, and the
attention op's ``layer_name`` string differs in every layer: with it, no layer can reuse another's
subgraph (torch gives up after ``max_reuse_entries`` variants).

So, while compileattn traces with regions (``compilation/regions.py``), attention layers call
``compileattn::attention_by_id`` with a *layer id*: a 0-dim int64 CPU tensor naming the layer by
an index into this module's registry. The backend reads each id's value from Dynamo's example
inputs and puts the layer name back (``passes/regions.py``), so everything after sees
``compileattn::attention(..., layer_name)`` as from a flat trace. A layer id is a plain attribute,
not a buffer: ``model.to("cuda")`` leaves it on the CPU, where reading it costs no device sync.
"""
from __future__ import annotations

import threading
import weakref

import torch

_lock = threading.Lock()
_names: list[str] = []
_index: dict[str, int] = {}
#: id -> weak reference of each tensor ``id_of`` made and that is still alive (``is_layer_id``)
_made: dict[int, weakref.ref] = {}
#: True while compileattn traces a model with its repeated layers as regions (set only by
#: ``compilation.regions.layers_as_regions``): attention layers then pass their layer id, not their name.
#: An eager call in another thread meanwhile takes ``attention_by_id`` too, which does the same.
tracing_regions = False


def id_of(layer_name: str) -> torch.Tensor:
    """A new layer-id tensor for ``layer_name`` (one index per distinct name, for the process)."""
    if not isinstance(layer_name, str) or not layer_name:
        raise TypeError(f"layer_name must be a non-empty str, got {layer_name!r}")
    with _lock:
        index = _index.get(layer_name)
        if index is None:
            index = _index[layer_name] = len(_names)
            _names.append(layer_name)
    # device explicitly: models are often built under ``with torch.device("meta")``.
    t = torch.tensor(index, dtype=torch.int64, device="cpu")
    _made[id(t)] = weakref.ref(t, lambda _, key=id(t): _made.pop(key, None))
    return t


def is_layer_id(t: torch.Tensor) -> bool:
    """Whether ``t`` was made by ``id_of``: ``model_tensors.py`` leaves such a tensor out of its
    per-call layout comparison (one per attention layer, ~0.5 µs each, for a tensor whose value the
    compile bakes in as the layer's name)."""
    ref = _made.get(id(t))
    return ref is not None and ref() is t


def name_of(layer_id: torch.Tensor) -> str:
    """The layer name a layer-id tensor stands for."""
    if not isinstance(layer_id, torch.Tensor) or layer_id.dtype != torch.int64 or layer_id.numel() != 1:
        raise TypeError(f"layer_id must be a one-element int64 tensor from compileattn.layer_ids.id_of, got "
                        f"{type(layer_id).__name__} {getattr(layer_id, 'dtype', '')} "
                        f"{tuple(getattr(layer_id, 'shape', ()))}")
    index = int(layer_id)
    if not 0 <= index < len(_names):
        raise ValueError(f"layer_id={index} names no layer: layer ids come from compileattn.layer_ids.id_of "
                         f"({len(_names)} registered)")
    return _names[index]


def call_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                   layer) -> None:
    """The attention op for ``layer`` (anything with ``layer_name`` and ``layer_id``): by id
    while compileattn traces with regions, else by name. ``layer`` is passed whole because under
    Dynamo merely reading ``layer.layer_name`` puts a value guard on it."""
    if tracing_regions:
        torch.ops.compileattn.attention_by_id(query, key, value, output, layer.layer_id)
    else:
        torch.ops.compileattn.attention(query, key, value, output, layer.layer_name)
