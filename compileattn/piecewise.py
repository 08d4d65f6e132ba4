"""Piecewise compilation: split at attention, compile each piece once, run with CUDA graphs.

``compile_piecewise`` is what the ``compileattn`` torch.compile backend returns for a Dynamo graph:

1. clean-up and hoist passes, then the split at the splitting ops (passes/);
2. each piece is compiled once for the dynamic token dimension (Inductor's ``standalone_compile``
   with the shapes of Dynamo's tracing context, or eager/aot_eager for debugging), or loaded from
   the compile cache;
3. the splitting ops are rebound to direct Python calls (``ops.attention_impl``), skipping the
   dispatcher, and the split graph's ``submod_i`` attributes become plain callables, skipping
   ``nn.Module.__call__`` (hooks machinery costs microseconds per call, paid per layer per step);
4. ``PiecewiseRuntime`` picks the mode per step: full-graph replay for uniform-decode steps whose
   attention backend is capturable, piecewise replay for other steps at a capture size, and plain
   compiled pieces for anything larger.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch._guards import detect_fake_mode

from passes import capture_kv_write, cleanup, hoist_shape_logic, split_graph
from passes.split import Piece, is_splitting_node

from . import context
from .cache import CompileCache, cache_key
from .config import CompileConfig
from .counters import counters
from .ops import attend_impl, attention_impl

logger = logging.getLogger("compileattn")

_UNIFIED = ("compileattn::attention", "compileattn::attention.default")
_ATTEND = ("compileattn::attend", "compileattn::attend.default")


def _direct_splitting_call(piece: Piece) -> Callable[..., Any]:
    """A plain callable for a splitting-op submodule. For the unified attention op it calls
    ``attention_impl`` with the submodule's arguments, bypassing the dispatcher."""
    nodes = [n for n in piece.module.graph.nodes if n.op == "call_function"]
    placeholders = [n for n in piece.module.graph.nodes if n.op == "placeholder"]
    if len(nodes) == 1 and is_splitting_node(nodes[0], _UNIFIED) and not nodes[0].kwargs:
        position = {p: i for i, p in enumerate(placeholders)}
        spec = [(True, position[a]) if isinstance(a, torch.fx.Node) else (False, a) for a in nodes[0].args]
        (q_in, q), (k_in, k), (v_in, v), (o_in, o), (name_in, name) = spec
        if q_in and k_in and v_in and o_in and not name_in:
            def call(*args, _q=q, _k=k, _v=v, _o=o, _name=name):
                attention_impl(args[_q], args[_k], args[_v], args[_o], _name)
            return call
    if len(nodes) == 1 and is_splitting_node(nodes[0], _ATTEND) and not nodes[0].kwargs:
        position = {p: i for i, p in enumerate(placeholders)}
        query, output, _, name = nodes[0].args
        if isinstance(query, torch.fx.Node) and isinstance(output, torch.fx.Node) and isinstance(name, str):
            def call_attend(*args, _q=position[query], _o=position[output], _name=name):
                attend_impl(args[_q], args[_o], _name)
            return call_attend
    return piece.module.forward


def _compile_piece(piece: Piece, args: list[Any], config: CompileConfig, static: bool = False) -> Any:
    """Compile one piece for the dynamic token dim, or (``static``) for the shapes of ``args``."""
    if static:
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            return torch._inductor.standalone_compile(
                piece.module, args, dynamic_shapes="from_example_inputs", options=dict(config.inductor_options))
    if config.piece_compiler == "eager":
        return piece.module.forward
    if config.piece_compiler == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(piece.module, args)
    return torch._inductor.standalone_compile(
        piece.module, args, dynamic_shapes="from_tracing_context", options=dict(config.inductor_options)
    )


def _token_symbol(fake_args: Sequence[Any]):
    """The sympy symbol of the token dimension (dim 0 of the first tensor input where it is symbolic)."""
    for a in fake_args:
        if isinstance(a, torch.Tensor) and a.dim() and isinstance(a.shape[0], torch.SymInt):
            return a.shape[0].node.expr
    return None


def _static_example_args(args: Sequence[Any], token_symbol, size: int) -> list[Any]:
    """The piece's fake inputs with the token count fixed to ``size``: fresh fake tensors of a
    FakeTensorMode without a ShapeEnv (so Inductor specialises every shape), no real memory.
    Other symbols (a lifted buffer size) take their hints."""
    import sympy
    from torch._subclasses.fake_tensor import FakeTensorMode

    def concrete(x) -> int:
        if not isinstance(x, torch.SymInt):
            return int(x)
        expr = sympy.sympify(x.node.expr)
        values = {s: sympy.Integer(size if s == token_symbol else x.node.shape_env.size_hint(s))
                  for s in expr.free_symbols}
        return int(expr.xreplace(values))

    out = []
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), FakeTensorMode():
        for a in args:
            if isinstance(a, torch.Tensor):
                out.append(torch.empty_strided([concrete(d) for d in a.shape], [concrete(d) for d in a.stride()],
                                               dtype=a.dtype, device=a.device))
            else:
                out.append(concrete(a) if isinstance(a, torch.SymInt) else a)
    return out


def _token_count_getter(example_inputs: Sequence[Any]) -> Callable[[Sequence[Any]], int] | None:
    """How to read a step's token count from the graph inputs: dim 0 of the first tensor input
    whose dim 0 is symbolic. Not "the first SymInt input": when an input is a view of a persistent
    buffer, Dynamo may also lift the buffer's own (symbolic) size, which is not the token count.
    None for a fully static graph."""
    for i, ex in enumerate(example_inputs):
        if isinstance(ex, torch.Tensor) and ex.dim() and isinstance(ex.shape[0], torch.SymInt):
            return lambda args, _i=i: args[_i].shape[0]
    return None


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split graph on fake inputs so each piece is compiled with its own input shapes."""

    def __init__(self, split_gm, pieces: list[Piece], config: CompileConfig, cache: CompileCache | None,
                 token_symbol=None):
        super().__init__(split_gm)
        self.pieces = {p.name: p for p in pieces}
        self.config = config
        self.cache = cache
        self.token_symbol = token_symbol
        self.compiled: dict[str, Any] = {}
        #: piece name -> {token count: statically compiled piece}
        self.static: dict[str, dict[int, Any]] = {}

    def call_module(self, target, args, kwargs):
        result = super().call_module(target, args, kwargs)
        piece = self.pieces.get(target)
        if piece is not None and not piece.is_splitting_op:
            self.compiled[target] = self._compile(piece, list(args), None)
            if self.config.compile_sizes and self.config.piece_compiler == "inductor" and self.token_symbol is not None:
                self.static[target] = {
                    size: self._compile(piece, _static_example_args(args, self.token_symbol, size), size)
                    for size in self.config.compile_sizes}
        return result

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


def compile_piecewise(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: CompileConfig):
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
    fake_mode = detect_fake_mode(example_inputs)
    fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs]
    compiler = _PieceCompiler(split_gm, pieces, config, cache, _token_symbol(fake_args))
    with fake_mode:
        compiler.run(*fake_args)

    device = next((a.device for a in example_inputs if isinstance(a, torch.Tensor)), torch.device("cpu"))
    # From the fake inputs: Dynamo hands the backend real tensors, whose shapes are plain ints;
    # only their fake twins say which dims are symbolic.
    runtime = PiecewiseRuntime(split_gm, pieces, compiler.compiled, config, device,
                               _token_count_getter(fake_args), compiler.static)
    logger.info("compileattn: %d pieces (%d splitting ops) ready in %.2f s", len(compiler.compiled),
                sum(p.is_splitting_op for p in pieces), time.perf_counter() - start)
    if config.debug_dump_dir:
        from .debug import expect_transformed_code

        expect_transformed_code(config)
    # A bound method, not the object: depyf's dump reads the compiled callable's __code__.
    # The runtime stays reachable as ``.__self__`` (tests and benchmarks use it).
    return runtime.__call__


class PiecewiseRuntime:
    """Calls the split graph; picks full-graph, piecewise-graph or graph-free execution per step."""

    def __init__(self, split_gm, pieces, compiled, config: CompileConfig, device: torch.device,
                 token_count: Callable[[Sequence[Any]], int] | None, static: dict[str, dict[int, Any]] | None = None):
        self.split_gm = split_gm
        self.config = config
        self.device = device
        self.token_count = token_count
        self.mode = config.resolved_cudagraph_mode(device.type)
        if self.mode != "none" and device.type != "cuda":
            raise ValueError(f"cudagraph_mode={config.cudagraph_mode!r} needs CUDA, graph is on {device}")
        self.capture_sizes = frozenset(config.capture_sizes)
        self.pool = None
        self.static = static or {}
        #: the step's token count while the split graph runs, when pieces need it (graphs or static)
        self.current_size: int | None = None
        self.graphs_on = False
        self._full = None  # GraphCache of the whole forward, made on first use
        self._full_ok: dict[int, tuple[Any, Any, bool]] = {}
        self.pieces = pieces
        for piece in pieces:
            delattr(split_gm, piece.name)  # plain attributes, not submodules: no Module.__call__
            if piece.is_splitting_op:
                setattr(split_gm, piece.name, _direct_splitting_call(piece))
            else:
                setattr(split_gm, piece.name, self._piece_runner(piece.name, compiled[piece.name],
                                                                 self.static.get(piece.name, {})))
        self._forward = split_gm.forward

    def _graph_cache(self, name: str, fn: Callable[..., Any]):
        from .cudagraph import GraphCache, GraphPool

        if self.pool is None:
            self.pool = GraphPool(self.device)
        return GraphCache(name, fn, self.pool, self.config.check_input_addresses)

    def _piece_runner(self, name: str, fn: Callable[..., Any], static: dict[int, Any]) -> Callable[..., Any]:
        if self.mode == "none" and not static:
            return fn
        graphs = self._graph_cache(name, fn) if self.mode != "none" else None

        def run(*args):
            size = self.current_size
            if size is None:
                return fn(*args)
            if self.graphs_on:
                return graphs.run(size, args, static.get(size, fn))
            return static.get(size, fn)(*args)

        run.graphs = graphs  # for tests and introspection
        return run

    def _full_graph_allowed(self) -> bool:
        """Uniform decode, and every layer's attention (after fallback) is capturable. Memoised per
        (backend, caches) pair; the objects are kept in the memo so a recycled id cannot match."""
        ctx = context._current
        if ctx is None or not ctx.metadata.is_uniform_decode:
            return False
        md = ctx.metadata
        memo = self._full_ok.get(id(md.backend))
        if memo is not None and memo[0] is md.backend and memo[1] is ctx.kv_caches:
            return memo[2]
        ok = all(md.backend.capturable_for(c, md) for c in ctx.kv_caches.values())
        self._full_ok[id(md.backend)] = (md.backend, ctx.kv_caches, ok)
        return ok

    def __call__(self, *args):
        if self.mode == "none" and not self.static:
            counters.eager_steps += 1
            return self._forward(*args)
        # The step's (padded) token count is the metadata's: the graph inputs can include more
        # than one symbolic size (Dynamo lifts the base of a view input with its own size).
        # A graph with no symbolic token dim (Dynamo specialises 1-token steps: 0/1 specialisation)
        # still gets graphs: its one size comes from the metadata like any other step's.
        ctx = context._current
        if ctx is not None:
            size = ctx.metadata.num_tokens
        else:
            size = self.token_count(args) if self.token_count is not None else None
        graphs = self.mode != "none" and size in self.capture_sizes
        if graphs:
            counters.cudagraph_replays += 1
            if self.mode == "full_and_piecewise" and self._full_graph_allowed():
                return self._run_full(size, args)
        else:
            counters.eager_steps += 1
        self.current_size, self.graphs_on = size, graphs
        try:
            return self._forward(*args)
        finally:
            self.current_size, self.graphs_on = None, False

    def _run_full(self, size: int, args):
        if self._full is None:
            self._full = self._graph_cache("full graph", self._forward)
        self.current_size = size  # inside the full graph, pieces run their (static) compiled code
        try:
            return self._full.run(size, args)
        finally:
            self.current_size = None

    def full_graph_count(self) -> int:
        return len(self._full.graphs) if self._full is not None else 0

    def piece_graph_count(self) -> int:
        """CUDA graphs captured for pieces, over all sizes."""
        runners = [getattr(self.split_gm, p.name) for p in self.pieces if not p.is_splitting_op]
        return sum(len(r.graphs.graphs) for r in runners if getattr(r, "graphs", None) is not None)

    def graph_pool_bytes(self) -> int:
        return self.pool.pool_bytes() if self.pool is not None else 0
