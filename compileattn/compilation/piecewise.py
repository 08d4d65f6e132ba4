"""Piecewise compilation: split the Dynamo graph at attention and compile each piece once.

``compile_piecewise`` is what the ``compileattn`` torch.compile backend returns for a Dynamo graph:

1. clean-up, KV-write capture and hoist passes, then the split at the splitting ops
   (``compileattn.passes``);
2. each piece is compiled once for the dynamic token dimension (Inductor's ``standalone_compile``
   with the shapes of Dynamo's tracing context, or eager/aot_eager for debugging), and for each of
   ``config.compile_sizes`` with static shapes, or loaded from the compile cache;
3. each splitting op becomes a direct call (``ops.attend_caller``): the forward-context lookup and
   the layer's prepared kernel call, skipping the dispatcher;
4. the result goes to a ``StepDispatcher`` (``dispatch.py``), which runs it step by step.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx

from .. import _torch_compat, ops
from ..config import CompileConfig
from ..counters import counters
from ..passes import capture_kv_write, cleanup, hoist_shape_logic, split_graph
from ..passes.split import Piece, is_splitting_node
from .cache import CompileCache, cache_key

logger = logging.getLogger("compileattn")

_UNIFIED = ("compileattn::attention", "compileattn::attention.default")
_ATTEND = ("compileattn::attend", "compileattn::attend.default")


@dataclasses.dataclass(frozen=True)
class LayerSignature:
    """What the compiled graph feeds a layer's attention: checked against the layer's KV cache
    once per set of caches, so a mismatch is an error before any kernel runs."""

    dtype: torch.dtype
    num_heads: int
    head_dim: int
    #: The query's token count when the graph has no symbolic token dim (Dynamo specialises a
    #: 1-token first call), else None.
    static_tokens: int | None


@dataclasses.dataclass
class CompiledSplit:
    """The split graph with its pieces compiled: what the dispatcher runs."""

    split_gm: torch.fx.GraphModule
    pieces: list[Piece]
    #: piece name -> compiled callable for the dynamic token count
    dynamic: dict[str, Callable[..., Any]]
    #: piece name -> {token count: callable compiled for exactly that count}
    static: dict[str, dict[int, Callable[..., Any]]]
    #: splitting-op piece name -> its direct call
    splitting_calls: dict[str, Callable[..., Any]]
    #: layer name -> what the graph passes its attention
    layers: dict[str, LayerSignature]
    #: how to read a step's token count from the graph inputs (None: no symbolic token dim)
    token_count: Callable[[Sequence[Any]], int] | None


def _meta(node) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None


def _splitting_call(piece: Piece) -> tuple[Callable[..., Any], str | None, LayerSignature | None]:
    """A plain callable for a splitting-op submodule (the context lookup and the prepared call),
    the layer name it serves and what it is fed; the submodule's own forward for other ops."""
    nodes = [n for n in piece.module.graph.nodes if n.op == "call_function"]
    position = {p: i for i, p in enumerate(n for n in piece.module.graph.nodes if n.op == "placeholder")}
    if len(nodes) != 1 or nodes[0].kwargs:
        return piece.module.forward, None, None
    node = nodes[0]
    if is_splitting_node(node, _ATTEND):
        query, output, _, name = node.args
        operands = (query, output)
        make = ops.attend_caller
    elif is_splitting_node(node, _UNIFIED):
        query, key, value, output, name = node.args
        operands = (query, key, value, output)
        make = ops.attention_caller
    else:
        return piece.module.forward, None, None
    if not isinstance(name, str) or not all(isinstance(a, torch.fx.Node) and a in position for a in operands):
        return piece.module.forward, None, None
    q, out = _meta(query), _meta(output)
    dense = all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in (q, out))
    signature = None
    if isinstance(q, torch.Tensor):
        tokens = q.shape[0]
        signature = LayerSignature(q.dtype, int(q.shape[1]), int(q.shape[2]),
                                   None if isinstance(tokens, torch.SymInt) else int(tokens))
    return make(name, *(position[a] for a in operands), dense=dense), name, signature


def _compile_piece(piece: Piece, args: list[Any], config: CompileConfig, static: bool = False) -> Any:
    """Compile one piece for the dynamic token dim, or (``static``) for the shapes of ``args``."""
    if static:
        with _torch_compat.unset_fake_temporarily():
            return _torch_compat.standalone_compile(piece.module, args, "from_example_inputs",
                                                    dict(config.inductor_options))
    if config.piece_compiler == "eager":
        return piece.module.forward
    if config.piece_compiler == "aot_eager":
        return _torch_compat.aot_eager(piece.module, args)
    return _torch_compat.standalone_compile(piece.module, args, "from_tracing_context", dict(config.inductor_options))


def _token_input(fake_args: Sequence[Any]) -> int | None:
    """Index of the input whose dim 0 is the step's token count: the first tensor input whose dim 0
    is symbolic. Not "the first SymInt input": when an input is a view of a persistent buffer,
    Dynamo may also lift the buffer's own (symbolic) size, which is not the token count."""
    for i, a in enumerate(fake_args):
        if isinstance(a, torch.Tensor) and a.dim() and isinstance(a.shape[0], torch.SymInt):
            return i
    return None


def _static_example_args(args: Sequence[Any], token_symbol, size: int) -> list[Any]:
    """The piece's fake inputs with the token count fixed to ``size``: fresh fake tensors of a
    FakeTensorMode without a ShapeEnv (so Inductor specialises every shape), no real memory.
    Other symbols (a lifted buffer size) take their hints."""
    def concrete(x) -> int:
        return _torch_compat.symbolic_size_value(x, token_symbol, size)

    out = []
    with _torch_compat.unset_fake_temporarily(), _torch_compat.static_fake_mode():
        for a in args:
            if isinstance(a, torch.Tensor):
                out.append(torch.empty_strided([concrete(d) for d in a.shape], [concrete(d) for d in a.stride()],
                                               dtype=a.dtype, device=a.device))
            else:
                out.append(concrete(a) if isinstance(a, torch.SymInt) else a)
    return out


def _placeholder_values(piece: Piece) -> list[Any] | None:
    """The piece's inputs as Dynamo traced them (fake tensors with the graph's symbolic sizes, or
    SymInts), from the placeholders' ``example_value``; None if one lacks it (a graph that did not
    come from Dynamo)."""
    values = []
    for node in piece.module.graph.nodes:
        if node.op == "placeholder":
            if "example_value" not in node.meta and "val" not in node.meta:
                return None
            values.append(_meta(node))
    return values


class _PieceCompiler(torch.fx.Interpreter):
    """Compiles each piece for its own input shapes. The shapes come from Dynamo's trace (every
    placeholder's ``example_value``); only a graph without them is run on fake inputs to find
    them. Running the pieces is avoided where possible: on torch 2.11 a fake ``aten.size`` call
    inside an op's decomposition (the ``@`` of RoPE's frequency product in transformers' models)
    turns the symbolic token count into a guard on its traced value, and the compile then fails
    with a ``ConstraintViolationError`` for the dynamic dim."""

    def __init__(self, split_gm, pieces: list[Piece], config: CompileConfig, cache: CompileCache | None,
                 token_symbol=None):
        super().__init__(split_gm)
        self.pieces = {p.name: p for p in pieces}
        self.config = config
        self.cache = cache
        self.token_symbol = token_symbol
        self.compiled: dict[str, Any] = {}
        self.static: dict[str, dict[int, Any]] = {}

    def compile_all(self, fake_mode, fake_args) -> None:
        traced = {name: _placeholder_values(p) for name, p in self.pieces.items() if not p.is_splitting_op}
        if all(v is not None for v in traced.values()):
            with fake_mode:
                for name, args in traced.items():
                    self.compile_piece(self.pieces[name], args)
            return
        with fake_mode:
            self.run(*fake_args)

    def call_module(self, target, args, kwargs):
        result = super().call_module(target, args, kwargs)
        piece = self.pieces.get(target)
        if piece is not None and not piece.is_splitting_op:
            self.compile_piece(piece, list(args))
        return result

    def compile_piece(self, piece: Piece, args: list[Any]) -> None:
        self.compiled[piece.name] = self._compile(piece, list(args), None)
        if self.config.compile_sizes and self.config.piece_compiler == "inductor" and self.token_symbol is not None:
            self.static[piece.name] = {
                size: self._compile(piece, _static_example_args(args, self.token_symbol, size), size)
                for size in self.config.compile_sizes}

    def _compile(self, piece: Piece, args: list[Any], size: int | None):
        use_cache = self.cache is not None and self.config.piece_compiler == "inductor"
        shape = "dynamic shapes" if size is None else f"{size} tokens"
        if use_cache:
            loaded = self.cache.load(piece.index, piece.module, size)
            if loaded is not None:
                counters.cache_hits += 1
                logger.info("loaded %s (%s) from the compile cache %s", piece.name, shape, self.cache.dir)
                return loaded
            counters.cache_misses += 1
        start = time.perf_counter()
        compiled = _compile_piece(piece, args, self.config, static=size is not None)
        counters.backend_compiles += 1
        logger.info("compiled %s (%s) with %s in %.2f s", piece.name, shape, self.config.piece_compiler,
                    time.perf_counter() - start)
        if use_cache:
            self.cache.save(piece.index, piece.module, compiled, size)
        return compiled


def split_and_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: CompileConfig) -> CompiledSplit:
    counters.dynamo_graphs += 1
    start = time.perf_counter()
    gm = cleanup(gm)
    if config.capture_kv_write and any(op in config.splitting_ops for op in _ATTEND):
        gm = capture_kv_write(gm)
    if config.hoist_shape_logic:
        gm = hoist_shape_logic(gm, config.splitting_ops)
    split_gm, pieces = split_graph(gm, config.splitting_ops)
    counters.pieces += sum(not p.is_splitting_op for p in pieces)
    counters.collectives_in_pieces += sum(p.collectives() for p in pieces if not p.is_splitting_op)
    counters.collectives_at_splits += sum(p.collectives() for p in pieces if p.is_splitting_op)
    if config.debug_dump_dir:
        from .debug import dump_graph

        dump_graph(config.debug_dump_dir, "graph", gm)
        dump_graph(config.debug_dump_dir, "split_graph", split_gm)
        for p in pieces:
            dump_graph(config.debug_dump_dir, f"piece_{p.index}_{p.name}", p.module)

    cache = CompileCache(config.cache_dir, cache_key(config, gm)) if config.cache_dir else None
    fake_mode = _torch_compat.detect_fake_mode(example_inputs)
    # Dynamo hands the backend real tensors, whose shapes are plain ints; only their fake twins
    # say which dims are symbolic.
    fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs]
    token_index = _token_input(fake_args)
    token_symbol = _torch_compat.symbol_of(fake_args[token_index].shape[0]) if token_index is not None else None
    compiler = _PieceCompiler(split_gm, pieces, config, cache, token_symbol)
    compiler.compile_all(fake_mode, fake_args)

    splitting_calls, layers = {}, {}
    for piece in pieces:
        if piece.is_splitting_op:
            call, layer, signature = _splitting_call(piece)
            splitting_calls[piece.name] = call
            if layer is not None and signature is not None:
                layers[layer] = signature
    logger.info("%d pieces (%d splitting ops) ready in %.2f s", len(compiler.compiled),
                sum(p.is_splitting_op for p in pieces), time.perf_counter() - start)
    return CompiledSplit(split_gm, pieces, compiler.compiled, compiler.static, splitting_calls, layers,
                         (lambda args, _i=token_index: args[_i].shape[0]) if token_index is not None else None)
