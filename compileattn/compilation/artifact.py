"""A compiled split as bytes, and back: what ``torch.compile(...).aot_compile`` saves of the backend.

One pickle of plain data (the "mega artifact" of vLLM PR #37198): the split graph's top level
(GraphPickler, node metadata dropped), each *distinct* compiled piece once (an Inductor AOT
artifact's bytes, or for ``piece_compiler="eager"`` the piece's graph), the signature of every
piece, the KV-write slots, how each splitting op is called, the layers' signatures, the index
of the token-count input and the other dynamic sizes graphs are pinned to
(``pinned_sizes.py``). Loading it builds a ``StepDispatcher`` with no tracing, splitting or
compiling; CUDA graphs are captured lazily as after a cold compile, and each static size's pieces
are deserialized when that size first runs.

The run-time settings (CUDA-graph mode and sizes, kernel choice) come from the loading process's
``CompileConfig`` when the loader provides one (``loading(config)``): they are not part of the
cache key, so changing them must not need a recompile. ``piece_compiler="aot_eager"`` pieces
cannot be saved (``NotSaveable``).
"""
from __future__ import annotations

import contextlib
import pickle
import threading
from typing import Iterator

import torch
import torch.fx

from .. import _torch_compat
from ..config import CompileConfig
from ..passes.split import Piece
from .piecewise import CompiledSplit, PieceCode

FORMAT = 3


class NotSaveable(RuntimeError):
    """The compiled split holds something that has no bytes form."""


_loading = threading.local()


@contextlib.contextmanager
def loading(config: CompileConfig) -> Iterator[list]:
    """Dispatchers loaded in this thread inside the block take ``config`` (its run-time fields);
    the block yields the list they are appended to."""
    previous = getattr(_loading, "state", None)
    _loading.state = (config, [])
    try:
        yield _loading.state[1]
    finally:
        _loading.state = previous


def _clean_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` without node metadata (fake tensors, stack traces: nothing the run needs,
    and some of it does not pickle)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for node in graph.nodes:
        node.meta = {}
    return torch.fx.GraphModule(gm, graph)


def _top_level(compiled: CompiledSplit) -> torch.fx.GraphModule:
    """The split graph with placeholders for the compiled pieces (their code is saved once per
    distinct piece) and the modules of splitting ops that are run as modules."""
    root = torch.nn.Module()
    for p in compiled.pieces:
        keep = p.is_splitting_op and compiled.splitting[p.name].kind == "module"
        setattr(root, p.name, _clean_copy(p.module) if keep else torch.nn.Module())
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(compiled.split_gm.graph, {}))
    for node in graph.nodes:
        node.meta = {}
    return torch.fx.GraphModule(root, graph)


def _code_bytes(code: PieceCode) -> bytes:
    if code.kind == "inductor":
        return _torch_compat.artifact_bytes(code.artifact) if code.loaded else code.data
    if code.kind == "eager":
        return _torch_compat.graph_pickle(_clean_copy(code.artifact))
    raise NotSaveable(f"piece_compiler={code.kind!r} pieces cannot be saved")


def _code_from_bytes(kind: str, data: bytes, static: bool) -> PieceCode:
    """A static size's Inductor piece is deserialized when that size first runs (``PieceCode.data``)."""
    if kind == "inductor":
        return PieceCode(kind, None, data) if static else PieceCode(kind, _torch_compat.artifact_from_bytes(data))
    return PieceCode(kind, _torch_compat.graph_unpickle(data))


def dumps(dispatcher) -> bytes:
    compiled = dispatcher.compiled
    state = {
        "format": FORMAT,
        "graph": _torch_compat.graph_pickle(_top_level(compiled)),
        "pieces": [(p.name, p.index, p.is_splitting_op) for p in compiled.pieces],
        "code": {key: (code.kind, _code_bytes(code)) for key, code in compiled.code.items()},
        "signatures": compiled.signatures,
        "static_sizes": compiled.static_sizes,
        "layer_slots": compiled.layer_slots,
        "splitting": compiled.splitting,
        "layers": compiled.layers,
        "token_index": compiled.token_index,
        "pinned": compiled.pinned,
        "config": dispatcher.config,
        "device": str(dispatcher.device),
    }
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes):
    from .dispatch import StepDispatcher

    state = pickle.loads(data)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"not a compileattn compiled split of format {FORMAT}")
    split_gm = _torch_compat.graph_unpickle(state["graph"])
    pieces = [Piece(name, index, is_split, getattr(split_gm, name)) for name, index, is_split in state["pieces"]]
    code = {key: _code_from_bytes(kind, blob, key[1] is not None) for key, (kind, blob) in state["code"].items()}
    compiled = CompiledSplit(split_gm, pieces, code, state["signatures"], state["static_sizes"], state["layer_slots"],
                             state["splitting"], state["layers"], state["token_index"], state["pinned"])
    context = getattr(_loading, "state", None)
    config = context[0] if context is not None else state["config"]
    dispatcher = StepDispatcher(compiled, config, torch.device(state["device"]))
    if context is not None:
        context[1].append(dispatcher)
    return dispatcher
