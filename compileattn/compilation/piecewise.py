"""Piecewise compilation: split the Dynamo graph at attention and compile each distinct piece once.

``split_and_compile`` is what the ``compileattn`` torch.compile backend does with a Dynamo graph:

1. region inlining (a trace with repeated layers as regions, ``regions.py``), clean-up, KV-write
   capture and hoist passes, then the split at the splitting ops (``compileattn.passes``);
2. the layer names of each piece's KV writes become per-piece slots, and each *distinct* piece
   (``piece_signature.py``: a transformer's middle layers are one piece on other weights) is
   compiled once, for the input shapes Dynamo traced, with the dynamic token dimension (Inductor's
   ``standalone_compile`` with the shapes of Dynamo's tracing context, or eager/aot_eager for
   debugging), and for each of
   ``config.resolved_compile_sizes`` with static shapes (in worker processes beside the dynamic
   compiles, ``compile_pool.py``), or loaded from the compile cache;
3. each splitting op becomes a direct call (``ops.attend_caller``): the forward-context lookup and
   the layer's prepared kernel call, skipping the dispatcher;
4. the result (``CompiledSplit``) goes to a ``StepDispatcher`` (``dispatch.py``), which runs it step
   by step and can be saved whole (``artifact.py``).
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx

from .. import _torch_compat, layer_ids, ops
from ..config import CompileConfig
from ..counters import counters
from ..passes import capture_kv_write, cleanup, hoist_shape_logic, inline_regions, split_graph
from ..passes.split import Piece, is_splitting_node, written_values
from ..validation import byte_layout, layouts_overlap
from . import compile_pool, inductor_piece
from .cache import CompileCache, cache_key
from .landing import StaticLanding
from .piece_signature import parametrize_layer_names, piece_signature
from .pinned_sizes import PinnedSizes, pin_other_sizes

logger = logging.getLogger("compileattn")

_UNIFIED = ("compileattn::attention", "compileattn::attention.default")
_ATTEND = ("compileattn::attend", "compileattn::attend.default")
_WRITE_KV = ("compileattn::write_layer_kv", "compileattn::write_layer_kv.default")
#: The ops that take the step from the forward context at each call: host values a CUDA graph
#: would freeze at its capture (a later step of the same size would attend with the captured
#: step's lengths and launch), so they must run between captured pieces, never inside one.
_PER_STEP_ATTENTION = (*_UNIFIED, *_ATTEND, "compileattn::attention_by_id", "compileattn::attention_by_id.default")


def attention_inside_pieces(pieces: Sequence[Piece]) -> list[str]:
    """The per-step attention ops in compiled (non-splitting) pieces: there when ``splitting_ops``
    leaves them out. A warm start's pieces have no graph: their compile was checked."""
    graphs = [p.module.graph for p in pieces if not p.is_splitting_op and hasattr(p.module, "graph")]
    return sorted({_torch_compat.op_names(node.target)[0] for graph in graphs for node in graph.nodes
                   if is_splitting_node(node, _PER_STEP_ATTENTION)})


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
    #: The query's device: the KV caches must be on it (kernels given tensors of two devices fail
    #: inside, naming neither).
    device: torch.device | None = None
    #: (KV heads, head dim) of the key the graph writes into the layer's cache (None: unknown). The
    #: prepared writes take the key's head count as it comes (Triton's writes every head it is given,
    #: over the next slots' rows): a model of other KV heads than its cache's spec must be refused.
    key_heads: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class SplittingCall:
    """How a splitting-op submodule is run: ``kind`` "attend" / "attention" is a direct call of the
    layer's prepared kernels with the operands at ``operands`` (``ops.attend_caller``), "module"
    the submodule's own forward (any other splitting op)."""

    kind: str
    layer: str | None = None
    operands: tuple[int, ...] = ()
    dense: bool = True

    def make(self, module: torch.fx.GraphModule | None) -> Callable[..., Any]:
        if self.kind == "attend":
            return ops.attend_caller(self.layer, *self.operands, dense=self.dense)
        if self.kind == "attention":
            return ops.attention_caller(self.layer, *self.operands, dense=self.dense)
        return module.forward


@dataclasses.dataclass(frozen=True)
class PieceCode:
    """One compiled distinct piece. ``kind``: "inductor" (``artifact`` is an Inductor AOT artifact),
    "eager" (the piece's GraphModule), "aot_eager" (a callable that cannot be saved)."""

    kind: str
    artifact: Any
    #: An Inductor artifact's bytes, deserialized at the first ``callable()`` (``artifact`` is None
    #: until then): a warm start loads a static size's pieces when that size first runs, not all
    #: of them up front (on the H200 loading took 1.2-1.6 s for 15-20 artifacts).
    data: bytes | None = None

    @property
    def loaded(self) -> bool:
        return self.artifact is not None

    def callable(self) -> Callable[..., Any]:
        if self.kind == "inductor":
            if self.artifact is None:
                object.__setattr__(self, "artifact", _torch_compat.artifact_from_bytes(self.data))
            return _torch_compat.artifact_callable(self.artifact)
        if self.kind == "eager":
            return self.artifact.forward
        return self.artifact


class _LoadOnFirstCall:
    """A static piece whose artifact is not loaded yet: loads it on the first call and puts the
    loaded code in its place in ``table`` (the dispatcher's per-size table), so later steps call
    the code directly. An artifact that does not load leaves the size to ``fallback`` (the
    dynamic-shape piece), logged: a warm start checks its file when loading, this is later."""

    __slots__ = ("table", "size", "code", "fallback")

    def __init__(self, table: dict[int, Any], size: int, code: PieceCode, fallback: Callable[..., Any]):
        self.table, self.size, self.code, self.fallback = table, size, code, fallback

    def __call__(self, *args):
        try:
            fn = self.code.callable()
        except Exception as exc:  # noqa: BLE001
            logger.warning("compileattn: a static piece for %d tokens does not load (%s: %s); the dynamic-shape "
                           "piece serves that size", self.size, type(exc).__name__, exc)
            fn = self.fallback
        self.table[self.size] = fn
        return fn(*args)


@dataclasses.dataclass
class CompiledSplit:
    """The split graph with its pieces compiled: what the dispatcher runs, and what a warm start
    saves (``artifact.py``; every field but ``split_gm``'s submodules and ``pieces`` is plain data
    or a ``PieceCode``)."""

    split_gm: torch.fx.GraphModule
    pieces: list[Piece]
    #: (signature, static size or None) -> the compiled code, shared by identical pieces
    code: dict[tuple[str, int | None], PieceCode]
    #: compiled piece name -> its signature (its code is ``code[(signature, None)]`` and
    #: ``code[(signature, size)]`` for each of ``static_sizes``)
    signatures: dict[str, str]
    static_sizes: tuple[int, ...]
    #: compiled piece name -> {slot: layer name} of its KV writes (piece_signature.py)
    layer_slots: dict[str, dict[str, str]]
    #: splitting-op piece name -> how it is called
    splitting: dict[str, SplittingCall]
    #: layer name -> what the graph passes its attention
    layers: dict[str, LayerSignature]
    #: index of the graph input whose dim 0 is the step's token count (None: no symbolic token dim)
    token_index: int | None
    #: the inputs' other dynamic sizes, which graphs and static pieces take at the compiled call's values
    pinned: PinnedSizes = PinnedSizes()
    #: seconds the static-shape compiles (or loads) added to the compile: in-process compiles and
    #: loads, sending them to worker processes, waiting for and loading the workers' artifacts
    #: (worker time that overlapped the dynamic-shape compiles is not in it)
    static_seconds: float = 0.0
    #: static compiles still running in workers (``background_static_compiles``; not saved)
    landing: StaticLanding | None = None
    #: where a landed static piece is saved (None: no compile cache)
    cache: CompileCache | None = None

    def adopt_landed(self, key: tuple[str, int], task: compile_pool.Task,
                     resolve: Callable[[tuple[str, int], compile_pool.Task], PieceCode] | None
                     ) -> Callable[..., Any] | None:
        """Install a static compile that landed after the compile returned: its callable. A
        worker's answer goes through ``resolve`` (``_PieceCompiler.code_for``: its artifact, or the
        piece compiled here when it failed); None (logged) only if that fails too, or the landing
        was given up, and the size keeps the dynamic-shape piece."""
        if task.result[0] == "here":
            code = task.result[1]
        elif task.result[0] == "here-failed" or resolve is None:
            logger.warning("compileattn: the static compile of %s did not land (%s); steps of %d tokens keep the "
                           "dynamic-shape piece", task.label, task.result[1], key[1])
            return None
        else:
            try:
                code = resolve(key, task)
            except Exception as exc:  # noqa: BLE001 (a step must not fail for a faster piece)
                logger.warning("compileattn: the static compile of %s did not land (%s: %s); steps of %d tokens "
                               "keep the dynamic-shape piece", task.label, type(exc).__name__, exc, key[1])
                return None
        self.code[key] = code
        return code.callable()

    def dynamic(self, name: str) -> Callable[..., Any]:
        return self.code[(self.signatures[name], None)].callable()

    def static(self, name: str) -> dict[int, Callable[..., Any]]:
        """Per static size, the piece's code (a ``_LoadOnFirstCall`` for code not loaded yet)."""
        sig = self.signatures[name]
        table: dict[int, Callable[..., Any]] = {}
        for size in self.static_sizes:
            code = self.code.get((sig, size))
            if code is not None:
                table[size] = (code.callable() if code.loaded
                               else _LoadOnFirstCall(table, size, code, self.dynamic(name)))
        return table

    def token_count(self) -> Callable[[Sequence[Any]], int] | None:
        i = self.token_index
        return (lambda args: args[i].shape[0]) if i is not None else None


def _meta(node) -> Any:
    return _torch_compat.node_example_value(node) if isinstance(node, torch.fx.Node) else None


def _splitting_call(piece: Piece) -> tuple[SplittingCall, LayerSignature | None]:
    """How to call a splitting-op submodule, and what its layer is fed."""
    nodes = [n for n in piece.module.graph.nodes if n.op == "call_function"]
    position = {p: i for i, p in enumerate(n for n in piece.module.graph.nodes if n.op == "placeholder")}
    if len(nodes) != 1 or nodes[0].kwargs:
        return SplittingCall("module"), None
    node = nodes[0]
    if is_splitting_node(node, _ATTEND):
        query, output, _, name = node.args
        operands, kind = (query, output), "attend"
    elif is_splitting_node(node, _UNIFIED):
        query, key, value, output, name = node.args
        operands, kind = (query, key, value, output), "attention"
    else:
        return SplittingCall("module"), None
    if not isinstance(name, str) or not all(isinstance(a, torch.fx.Node) and a in position for a in operands):
        return SplittingCall("module"), None
    q, out = _meta(query), _meta(output)
    dense = all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in (q, out))
    signature = None
    if isinstance(q, torch.Tensor):
        tokens = q.shape[0]
        signature = LayerSignature(q.dtype, int(q.shape[1]), int(q.shape[2]),
                                   None if isinstance(tokens, torch.SymInt) else int(tokens), q.device)
    return SplittingCall(kind, name, tuple(position[a] for a in operands), dense), signature


def _key_heads(gm: torch.fx.GraphModule) -> dict[str, tuple[int, int]]:
    """layer name -> (KV heads, head dim) of the key the graph writes into its cache (the unified
    op's, or the captured KV write's), read before the split renames the writes' layers."""
    found = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if is_splitting_node(node, _UNIFIED) and len(node.args) == 5:
            key, name = node.args[1], node.args[4]
        elif is_splitting_node(node, _WRITE_KV) and len(node.args) == 3:
            key, name = node.args[0], node.args[2]
        else:
            continue
        k = _meta(key)
        if isinstance(name, str) and isinstance(k, torch.Tensor) and k.dim() == 3:
            heads, dim = k.shape[1], k.shape[2]
            if not isinstance(heads, torch.SymInt) and not isinstance(dim, torch.SymInt):
                found[name] = (int(heads), int(dim))
    return found


def _compile_piece(piece: Piece, args: list[Any], config: CompileConfig, static: bool = False) -> PieceCode:
    """Compile one piece for the dynamic token dim, or (``static``) for the shapes of ``args``.

    Always for inference (grad mode off), as the pieces run (the dispatcher calls them under
    ``torch.no_grad()``): a compile made while grad mode is on, of a model whose parameters
    require grad, would trace AOTAutograd's joint forward/backward graph and partition it, work
    whose backward half never runs, and trip over the ops' missing autograd kernels."""
    with torch.no_grad():
        return _compile_piece_for_inference(piece, args, config, static)


def _compile_piece_for_inference(piece: Piece, args: list[Any], config: CompileConfig, static: bool) -> PieceCode:
    if static:
        with _torch_compat.unset_fake_temporarily():
            return PieceCode("inductor", inductor_piece.compile_piece(piece.module, args, "from_example_inputs",
                                                                      config.inductor_options))
    if config.piece_compiler == "eager":
        return PieceCode("eager", piece.module)
    if config.piece_compiler == "aot_eager":
        return PieceCode("aot_eager", _torch_compat.aot_eager(piece.module, args))
    return PieceCode("inductor", inductor_piece.compile_piece(piece.module, args, "from_tracing_context",
                                                                  config.inductor_options))


def _token_input(fake_args: Sequence[Any], gm: torch.fx.GraphModule | None = None) -> int | None:
    """Index of the input whose dim 0 is the step's token count: the first tensor input whose dim 0
    is the first attention op's query token count (the count the step's metadata holds; none where
    that is a plain int: Dynamo specialised a 1-token call), else (no such op or input) the first
    tensor input whose dim 0 is symbolic. Not "the first symbolic dim 0" alone: a model given
    another dynamic size first (``forward(extra, x)``) was keyed by it, and every step refused with
    "called with <that size> tokens". Not "the first SymInt input": when an input is a view of a
    persistent buffer, Dynamo may also lift the buffer's own (symbolic) size, which is not the
    token count."""
    tokens = _query_tokens(gm) if gm is not None else None
    if isinstance(tokens, int):
        return None
    candidates = [i for i, a in enumerate(fake_args)
                  if isinstance(a, torch.Tensor) and a.dim() and isinstance(a.shape[0], torch.SymInt)]
    for i in candidates:
        if tokens is not None and _torch_compat.symbol_of(fake_args[i].shape[0]) == tokens:
            return i
    return candidates[0] if candidates else None


def _query_tokens(gm: torch.fx.GraphModule):
    """The first attention op's query token count: an int, the symbol of a symbolic one, or None
    (no such op, or a size that is an expression)."""
    for node in gm.graph.nodes:
        if is_splitting_node(node, _ATTEND) or is_splitting_node(node, _UNIFIED):
            query = _meta(node.args[0]) if node.args else None
            if not isinstance(query, torch.Tensor) or not query.dim():
                return None
            if not isinstance(query.shape[0], torch.SymInt):
                return int(query.shape[0])
            expr = _torch_compat.symbol_of(query.shape[0])
            return expr if expr.is_Symbol else None
    return None


def _static_example_args(args: Sequence[Any], token_symbol, size: int) -> list[Any]:
    return compile_pool.static_args_from_specs(compile_pool.static_input_specs(args, token_symbol, size))


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
    """Compiles each distinct piece once for its own input shapes; a piece identical to an earlier
    one takes that one's code. The shapes come from Dynamo's trace (every placeholder's
    ``example_value``); only a graph without them is run on fake inputs to find them. Running the
    pieces is avoided where possible: on torch 2.11 a fake ``aten.size`` call inside an op's
    decomposition (the ``@`` of RoPE's frequency product in transformers' models) turns the
    symbolic token count into a guard on its traced value, and the compile then fails with a
    ``ConstraintViolationError`` for the dynamic dim.

    With a ``pool`` (``compile_pool.py``) a distinct piece's compiles go to worker processes as
    soon as its inputs are known: its dynamic-shape compile (urgent) and its static-shape ones;
    ``finish_dynamic`` compiles here the urgent ones no worker took (and duplicates those a worker
    is still on), ``finish`` the static ones, each loading the workers' artifacts."""

    def __init__(self, split_gm, pieces: list[Piece], config: CompileConfig, cache: CompileCache | None,
                 token_symbol, static_sizes: tuple[int, ...], pool: compile_pool.CompilePool | None = None,
                 background: bool = False):
        super().__init__(split_gm)
        #: leave the static compiles still out to land after the compile (``landing.py``)
        self.background = background
        self.pieces = {p.name: p for p in pieces}
        self.config = config
        self.cache = cache
        self.token_symbol = token_symbol
        self.static_sizes = static_sizes
        self.code: dict[tuple[str, int | None], PieceCode] = {}
        self.signatures: dict[str, str] = {}
        self.static_seconds = 0.0
        self.pool = pool
        #: (signature, size) -> (task, piece, the piece's traced inputs) of the static compiles sent
        self.tasks: dict[tuple[str, int], tuple[compile_pool.Task, Piece, list[Any]]] = {}
        #: the same of the dynamic-shape compiles sent (``finish_dynamic``)
        self.dynamic_tasks: dict[tuple[str, None], tuple[compile_pool.Task, Piece, list[Any]]] = {}
        self._settings: dict[str, Any] | None = None
        self._graphs: dict[str, bytes | None] = {}
        #: the static compiles left to land after the compile (``finish``)
        self.landing: StaticLanding | None = None
        #: the pieces' inputs are the placeholders' traced example values (``compile_all``)
        self._traced = False

    def compile_all(self, fake_mode, fake_args) -> None:
        traced = {name: _placeholder_values(p) for name, p in self.pieces.items() if not p.is_splitting_op}
        with fake_mode:
            if all(v is not None for v in traced.values()):
                self._traced = True
                for name, args in traced.items():
                    self.compile_piece(self.pieces[name], args)
            else:
                self.run(*fake_args)
            self.finish_dynamic()
        self.finish()

    def call_module(self, target, args, kwargs):
        result = super().call_module(target, args, kwargs)
        piece = self.pieces.get(target)
        if piece is not None and not piece.is_splitting_op:
            self.compile_piece(piece, list(args))
        return result

    def compile_piece(self, piece: Piece, args: list[Any]) -> None:
        signature = self.signatures[piece.name] = piece_signature(piece.module, args, piece.index)
        if self.pool is not None:  # sent before the dynamic compile, so the workers start on them at once
            start = time.perf_counter()
            for size in self.static_sizes:
                self._send(piece, signature, args, size)
            self.static_seconds += time.perf_counter() - start
        if self._dynamic_in_workers:
            self._send(piece, signature, args, None)
        else:
            self._once(piece, signature, None, lambda: args)
        if self.pool is None:
            for size in self.static_sizes:
                self._once(piece, signature, size,
                           lambda size=size: _static_example_args(args, self.token_symbol, size))

    def _once(self, piece: Piece, signature: str, size: int | None, make_args: Callable[[], list[Any]]) -> None:
        if (signature, size) in self.code:
            counters.piece_reuses += 1
            return
        start = time.perf_counter()
        self.code[(signature, size)] = self._compile(piece, signature, make_args(), size)
        if size is not None:
            self.static_seconds += time.perf_counter() - start

    @property
    def _dynamic_in_workers(self) -> bool:
        """Whether the dynamic-shape compiles go to the workers too (the compiling process
        compiling those no worker has started): only Inductor's, and only with workers running
        from the first call (``compile_workers_start="after_dynamic"`` keeps them to itself), and
        only for pieces whose inputs Dynamo traced (a worker compiles from the placeholders'
        example values, which a graph run on fake inputs instead lacks)."""
        return (self.pool is not None and self.pool.started and self.config.piece_compiler == "inductor"
                and self._traced)

    @property
    def _use_cache(self) -> bool:
        return self.cache is not None and self.config.piece_compiler == "inductor"

    def _compile(self, piece: Piece, signature: str, args: list[Any], size: int | None) -> PieceCode:
        loaded = self._load(piece, signature, size)
        return loaded if loaded is not None else self._compile_here(piece, signature, args, size)

    def _load(self, piece: Piece, signature: str, size: int | None) -> PieceCode | None:
        if not self._use_cache:
            return None
        loaded = self.cache.load(signature, size)
        unassumed = assume_guards(loaded[1]) if loaded is not None else None
        if loaded is None or unassumed is not None:
            if unassumed is not None:
                logger.info("compileattn: the compile cache's %s (%s) is not used: %s", piece.name, _shape(size),
                            unassumed)
            counters.cache_misses += 1
            return None
        counters.cache_hits += 1
        logger.info("loaded %s (%s) from the compile cache %s", piece.name, _shape(size), self.cache.dir)
        return PieceCode("inductor", loaded[0])

    def _compile_here(self, piece: Piece, signature: str, args: list[Any], size: int | None) -> PieceCode:
        start = time.perf_counter()
        shape_env = _torch_compat.tracing_shape_env() if size is None and self._use_cache else None
        before = _torch_compat.size_assumptions(shape_env) if shape_env is not None else None
        compiled = _compile_piece(piece, args, self.config, static=size is not None)
        counters.backend_compiles += 1
        logger.info("compiled %s (%s) with %s in %.2f s", piece.name, _shape(size),
                    "inductor" if size is not None else self.config.piece_compiler, time.perf_counter() - start)
        if self._use_cache and size is not None:
            self.cache.save(signature, compiled.artifact, size)
        elif self._use_cache and shape_env is not None:
            # a dynamic-shape piece with every guard its code may rely on (the trace's and earlier
            # pieces' ones too: they let this compile decide things statically); not one whose
            # compile replaced a symbol or deferred an assertion, which a guard list cannot carry
            if _torch_compat.size_assumptions(shape_env)[1:] == before[1:]:
                self.cache.save(signature, compiled.artifact, size,
                                tuple(_torch_compat.size_guard_expressions(shape_env)))
        return compiled

    # -- compiles in worker processes ---------------------------------------------------------------

    def _send(self, piece: Piece, signature: str, args: list[Any], size: int | None) -> None:
        """Send one compile (``size`` None: the dynamic-shape one) to the workers, unless an
        identical piece's or the cache's code serves, or it cannot be sent (compiled here)."""
        key = (signature, size)
        tasks = self.tasks if size is not None else self.dynamic_tasks
        if key in self.code or key in tasks:
            counters.piece_reuses += 1
            return
        loaded = self._load(piece, signature, size)
        if loaded is not None:
            self.code[key] = loaded
            return
        message = self._message(piece, signature, args, size)
        if message is None:  # cannot be sent (logged): compiled here, as without workers
            self.code[key] = self._compile_here(piece, signature, self._example_args(args, size), size)
            return
        task = compile_pool.Task(len(self.tasks) + len(self.dynamic_tasks), f"{piece.name} ({_shape(size)})", message,
                                urgent=size is None)
        tasks[key] = (task, piece, args)
        self.pool.submit(task)

    def _example_args(self, traced_args: list[Any], size: int | None) -> list[Any]:
        """A compile's example inputs: the traced ones (dynamic shapes), or static for ``size``."""
        return traced_args if size is None else _static_example_args(traced_args, self.token_symbol, size)

    def _message(self, piece: Piece, signature: str, args: list[Any], size: int) -> dict[str, Any] | None:
        if self._settings is None:
            try:
                settings = _torch_compat.compile_settings()
                pickle.dumps((settings, dict(self.config.inductor_options)))
                self._settings = settings
            except Exception as exc:  # noqa: BLE001 (e.g. a custom Inductor pass object that does not pickle)
                logger.info("compileattn: static compiles run in-process: the Inductor settings or options cannot "
                            "be sent to a worker (%s: %s)", type(exc).__name__, exc)
                self._settings = {}
        if not self._settings:
            return None
        if signature not in self._graphs:
            try:
                self._graphs[signature] = _torch_compat.piece_pickle(piece.module)
            except Exception as exc:  # noqa: BLE001 (an op or constant GraphPickler cannot save)
                logger.info("compileattn: %s is compiled for static shapes in-process: its graph cannot be sent to "
                            "a worker (%s: %s)", piece.name, type(exc).__name__, exc)
                self._graphs[signature] = None
        graph = self._graphs[signature]
        if graph is None:
            return None
        if size is None:  # the graph's own example values, which travel with it
            return {"graph": graph, "inputs": None, "options": dict(self.config.inductor_options),
                    "settings": self._settings}
        inputs = compile_pool.static_input_specs(args, self.token_symbol, size)
        try:
            pickle.dumps(inputs)
        except Exception as exc:  # noqa: BLE001 (a non-tensor input that does not pickle)
            logger.info("compileattn: %s is compiled for static shapes in-process: an input cannot be sent to a "
                        "worker (%s: %s)", piece.name, type(exc).__name__, exc)
            return None
        return {"graph": graph, "inputs": inputs, "options": dict(self.config.inductor_options),
                "settings": self._settings}

    def finish_dynamic(self) -> None:
        """Wait for the dynamic-shape compiles sent to workers, compiling here, newest first, those
        no worker has started (all of them while no worker is ready yet): the compile returns
        only with every dynamic-shape piece. Inside Dynamo's fake mode and tracing context, which a
        compile here uses; a task a worker failed is compiled here."""
        if not self.dynamic_tasks:
            return
        start = time.perf_counter()

        def compile_here(key: tuple[str, None], task: compile_pool.Task) -> PieceCode:
            _, piece, args = self.dynamic_tasks[key]
            return self._compile_here(piece, key[0], args, None)

        in_workers, _ = self._drain(self.dynamic_tasks, compile_here, urgent_only=True)
        logger.info("compileattn: %d dynamic-shape compiles: %d in worker processes, %d in-process, in %.2f s",
                    len(self.dynamic_tasks), in_workers, len(self.dynamic_tasks) - in_workers,
                    time.perf_counter() - start)

    def finish(self) -> None:
        """Wait for the static compiles sent to workers, compiling here those no worker started,
        and load their artifacts; a task a worker failed is compiled here. With
        ``background_static_compiles``, keep what has finished and leave the rest to land later
        (``landing.py``): ``self.landing``."""
        if not self.tasks:
            return
        self.pool.start()  # with compile_workers_start="after_dynamic": now that the dynamic pieces are done
        start = time.perf_counter()
        if self.background and self._leave_to_land():
            self.static_seconds += time.perf_counter() - start
            return
        in_workers, worker_seconds = self._drain(self.tasks, self.code_for)
        seconds = time.perf_counter() - start
        self.static_seconds += seconds
        logger.info("compileattn: %d static-shape compiles: %d in %d worker processes (%.2f s of compiling), %d "
                    "in-process; waiting for and loading them took %.2f s", len(self.tasks), in_workers,
                    self.pool.size, worker_seconds, len(self.tasks) - in_workers, seconds)

    def _drain(self, tasks: dict, compile_here: Callable[[tuple, compile_pool.Task], PieceCode],
               urgent_only: bool = False) -> tuple[int, float]:
        """Wait for ``tasks`` (``CompilePool.drain``), those the compiling process takes going
        through ``compile_here``, and put every task's code in ``self.code`` (a worker's answer
        loaded, a failed one compiled here): how many came from workers, and their compile seconds."""
        keys = {task.id: key for key, (task, _, _) in tasks.items()}

        def here(task: compile_pool.Task) -> None:
            self.pool.settle(task, ("here", compile_here(keys[task.id], task)))

        self.pool.drain(here, urgent_only=urgent_only)
        in_workers, worker_seconds = 0, 0.0
        for key, (task, _, _) in tasks.items():
            if task.result[0] == "here":
                self.code[key] = task.result[1]
                continue
            self.code[key], from_worker = self._worker_code_or_here(key, task)
            if from_worker:
                in_workers += 1
                worker_seconds += task.result[2]
        return in_workers, worker_seconds

    def code_for(self, key: tuple[str, int], task: compile_pool.Task) -> PieceCode:
        """A static compile's code: the worker's artifact, else (no answer, or a failed one, logged)
        the piece compiled here. After the compile returned (a landing's task) it runs under the
        process's Inductor settings and matmul precision of that moment, which a program that
        changed them since would see in this piece (the workers get the compile's;
        ``_torch_compat.compile_settings_applied`` sets process-wide flags, fit for a worker only)."""
        return self._worker_code_or_here(key, task)[0]

    def _worker_code_or_here(self, key: tuple[str, int | None], task: compile_pool.Task) -> tuple[PieceCode, bool]:
        """``code_for``, and whether the code is the worker's."""
        _, piece, args = (self.tasks if key[1] is not None else self.dynamic_tasks)[key]
        if task.result is not None:
            code = adopt(task, key[0], key[1], self.cache if self._use_cache else None)
            if isinstance(code, PieceCode):
                return code, True
            logger.info("compileattn: no compile worker's answer for %s (%s); compiling it in-process", task.label,
                        code)
        return self._compile_here(piece, key[0], self._example_args(args, key[1]), key[1]), False

    def _leave_to_land(self) -> bool:
        """Adopt the static compiles already done and hand the pool, with the others, to a
        landing; False (nothing done) if the pool cannot be handed over."""
        waiting = {key: task for key, (task, _, _) in self.tasks.items() if task.result is None}
        pool = compile_pool.detach() if waiting else None
        if waiting and pool is None:
            return False
        try:
            for key, (task, _, _) in self.tasks.items():
                if key not in waiting:
                    self.code[key] = self.code_for(key, task)
        except BaseException:
            if pool is not None:  # detached: nobody else would stop its workers
                pool.close(kill=True)
            raise
        if waiting:
            self.landing = StaticLanding(pool, waiting, self.code_for)
            logger.info("compileattn: %d of %d static-shape compiles left to land in the background (%d worker "
                        "processes); until they do, their sizes run the dynamic-shape pieces", len(waiting),
                        len(self.tasks), pool.size)
        return True


def adopt(task: compile_pool.Task, signature: str, size: int | None, cache: CompileCache | None) -> PieceCode | str:
    """A worker's answer to a compile as code (saved to ``cache``), or why there is none."""
    if task.result is None or task.result[0] != "ok":
        why = task.result[1] if task.result is not None else "no answer"
        if task.result is not None and len(task.result) > 2:
            logger.debug("compileattn: the worker's traceback for %s:\n%s", task.label, task.result[2])
        return why
    _, data, seconds, pid, guards = task.result
    try:
        code = PieceCode("inductor", _torch_compat.artifact_from_bytes(data))
    except Exception as exc:  # noqa: BLE001
        return f"its artifact does not load here ({type(exc).__name__}: {exc})"
    unassumed = assume_guards(guards)
    if unassumed is not None:
        return unassumed
    counters.backend_compiles += 1
    if size is None:
        counters.dynamic_compiles_in_workers += 1
    else:
        counters.static_compiles_in_workers += 1
    logger.info("compiled %s with inductor in a worker (pid %d) in %.2f s", task.label, pid, seconds)
    if cache is not None:
        cache.save_bytes(signature, data, size, guards)
    return code


def assume_guards(guards: tuple) -> str | None:
    """Assume, in the ShapeEnv of the compile under way (Dynamo's, through its tracing context),
    the guards a dynamic-shape piece's code relies on, compiled elsewhere (a compile worker, an
    earlier process whose piece the compile cache holds): None once they are, else (none assumed:
    one does not hold at this compile's sizes) why the piece cannot be used. Compiled here,
    Inductor would have put them there itself; left out, Dynamo (or the decorator's size check,
    ``size_guards.py``) would let a call past them run code that does not hold there (32-bit
    indices that wrap)."""
    if not guards:
        return None
    shape_env = _torch_compat.tracing_shape_env()
    if shape_env is None:
        return "no ShapeEnv to assume its size guards in"
    for expr in guards:  # all of them first: assuming one that fails would record its negation
        if not _torch_compat.holds_at_hints(shape_env, expr):
            return f"its size guard {expr} does not hold at this compile's sizes"
    for expr in guards:
        _torch_compat.reassume_guard(shape_env, expr)
    logger.debug("compileattn: assumed the size guards of a piece compiled elsewhere: %s",
                 "; ".join(map(str, guards)))
    return None


def _shape(size: int | None) -> str:
    return "dynamic shapes" if size is None else f"{size} tokens"


def refuse_written_overlapping_inputs(gm: torch.fx.GraphModule) -> None:
    """A ``ValueError`` where the graph writes a tensor that two of its inputs see (two views of
    one buffer sharing bytes, one of them written). Dynamo traces them as distinct inputs; eager
    code sees the write through the other, and the compiled pieces, compiled per piece without the
    inputs' aliasing, do not: Inductor's code for ``d = y * 2; x.add_(1)`` with ``y`` overlapping
    ``x`` gave 2y + 2 where eager gives 2y (``torch.compile``'s own Inductor, which compiles the
    whole graph with the aliasing, gave 2y). Checked at the traced sizes; the decorator checks
    later calls (``argcheck``)."""
    inputs: dict[Any, list[tuple[torch.fx.Node, torch.Tensor]]] = {}
    for node in gm.graph.nodes:
        value = _torch_compat.node_example_value(node) if node.op == "placeholder" else None
        if (isinstance(value, torch.Tensor) and not _torch_compat.statically_known_true(value.numel() == 0)
                and (key := _torch_compat.storage_key(value)) is not None):
            inputs.setdefault(key, []).append((node, value))
    shared = {key: members for key, members in inputs.items() if len(members) > 1}
    if not shared:
        return
    for node in gm.graph.nodes:
        for written in written_values(node):
            members = shared.get(_torch_compat.storage_key(written))
            if members is None:
                continue
            layout = byte_layout(written, _torch_compat.size_hint)
            seen = [n for n, v in members if layouts_overlap(byte_layout(v, _torch_compat.size_hint), layout)]
            if len(seen) > 1:
                a, b = (_torch_compat.input_name(n) for n in seen[:2])
                op = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target)
                raise ValueError(f"compileattn: inputs {a} and {b} share memory and the compiled code writes it "
                                 f"({op}): compileattn compiles its pieces without the inputs' aliasing, so the "
                                 f"other would not see the write as in eager code; pass tensors that share no "
                                 f"memory (clone one)")


def refuse_unbacked_inputs(gm: torch.fx.GraphModule) -> None:
    """A ``ValueError`` naming a graph input whose size is data-dependent (``mark_unbacked``): the
    backend reads every dynamic size's example value (the pinned sizes, the CUDA-graph and static
    capture sizes, the overlap checks), which such a size does not have."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and _torch_compat.unbacked_sizes(_torch_compat.node_example_value(node)):
            raise ValueError(f"compileattn: input {_torch_compat.input_name(node)} has a data-dependent size "
                             f"(torch._dynamo.mark_unbacked): compileattn needs each dynamic size's example value "
                             f"to pin the other sizes and pick capture sizes; mark the dim with "
                             f"torch._dynamo.mark_dynamic instead")


def split_and_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: CompileConfig) -> CompiledSplit:
    start = time.perf_counter()
    refuse_unbacked_inputs(gm)
    # First, and before anything is counted: a graph whose regions cannot be flattened is traced
    # again flat by the decorator.
    gm, region_calls, region_subgraphs = inline_regions(gm, example_inputs, layer_ids.name_of)
    counters.dynamo_graphs += 1
    if region_calls:
        counters.regions_inlined += region_calls
        counters.region_subgraphs += region_subgraphs
        logger.info("compileattn: %d nested-region calls of %d traced subgraphs flattened", region_calls,
                    region_subgraphs)
    refuse_written_overlapping_inputs(gm)
    gm = cleanup(gm)
    if config.capture_kv_write and any(op in config.splitting_ops for op in _ATTEND):
        gm = capture_kv_write(gm)
    if config.hoist_shape_logic:
        gm = hoist_shape_logic(gm, config.splitting_ops)
    key_heads = _key_heads(gm)
    split_gm, pieces = split_graph(gm, config.splitting_ops)
    layer_slots = {p.name: parametrize_layer_names(p.module) for p in pieces if not p.is_splitting_op}
    counters.pieces += sum(not p.is_splitting_op for p in pieces)
    collectives_in_pieces = sum(p.collectives() for p in pieces if not p.is_splitting_op)
    counters.collectives_in_pieces += collectives_in_pieces
    collectives_at_splits = sum(p.collectives() for p in pieces if p.is_splitting_op)
    counters.collectives_at_splits += collectives_at_splits
    if config.debug_dump_dir:
        from .debug import dump_graph

        dump_graph(config.debug_dump_dir, "graph", gm)
        dump_graph(config.debug_dump_dir, "split_graph", split_gm)
        for p in pieces:
            dump_graph(config.debug_dump_dir, f"piece_{p.index}_{p.name}", p.module)

    fake_mode = _torch_compat.detect_fake_mode(example_inputs)
    # Dynamo hands the backend real tensors, whose shapes are plain ints; only their fake twins
    # say which dims are symbolic.
    fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs]
    token_index = _token_input(fake_args, gm)
    token_symbol = _torch_compat.symbol_of(fake_args[token_index].shape[0]) if token_index is not None else None
    device = next((a.device for a in example_inputs if isinstance(a, torch.Tensor)), torch.device("cpu"))
    inputs = [n.name for n in split_gm.graph.nodes if n.op == "placeholder"]
    pinned = pin_other_sizes(fake_args, inputs, token_symbol)
    cache = CompileCache.opened(config.cache_dir, cache_key(config, gm), pinned.values) if config.cache_dir else None
    static_sizes = config.resolved_compile_sizes(device.type) if token_symbol is not None else ()
    if static_sizes and not pinned.keyed_by_token_count:
        logger.info("compile_sizes %s ignored: %s, so a call's sizes cannot be matched to a static piece",
                    list(static_sizes), pinned.describe())
        static_sizes = ()
    if static_sizes and config.piece_compiler != "inductor":
        logger.info("compile_sizes %s ignored: static compiles need piece_compiler='inductor', not %r",
                    list(static_sizes), config.piece_compiler)
        static_sizes = ()
    pool = None
    workers = compile_pool.worker_count(config.compile_workers) if static_sizes else 0
    if workers:
        why_not = compile_pool.unsendable_context()
        if why_not is None:
            pool = compile_pool.acquire(workers, start=config.compile_workers_start != "after_dynamic")
        else:
            logger.info("compileattn: static pieces compile in-process: %s, which workers would not see", why_not)
    background = config.background_static_compiles
    if pool is not None and background and (collectives_in_pieces or collectives_at_splits
                                            or _torch_compat.distributed_world_size() > 1):
        # A landing drops and recaptures a size's graphs at a step that differs from rank to rank
        # (each rank's workers finish when they do): a capturing rank runs the step's collectives
        # eagerly (the warm-up) and records them, while a replaying rank launches them from its
        # graph, and NCCL takes "captured or not" as a property every rank's operation shares
        # (``parallel/group.py``, 2). Ranks capture in lockstep only if nothing lands late.
        logger.info("compileattn: static pieces are waited for, not left to land in the background: the graph "
                    "holds collectives (or runs on several ranks), whose CUDA graphs every rank must capture at the "
                    "same step")
        background = False
    try:
        compiler = _PieceCompiler(split_gm, pieces, config, cache, token_symbol, static_sizes, pool, background)
        compiler.compile_all(fake_mode, fake_args)
    finally:
        compile_pool.release()  # also one a decorator started for a graph that turned out to need none

    splitting, layers = {}, {}
    for piece in pieces:
        if piece.is_splitting_op:
            splitting[piece.name], signature = _splitting_call(piece)
            if signature is not None:
                layer = splitting[piece.name].layer
                layers[layer] = dataclasses.replace(signature, key_heads=key_heads.get(layer))
    distinct = sum(size is None for _, size in compiler.code)
    logger.info("%d pieces (%d distinct, %d splitting ops, static sizes %s) ready in %.2f s", len(compiler.signatures),
                distinct, len(splitting), list(static_sizes) or "none", time.perf_counter() - start)
    return CompiledSplit(split_gm, pieces, compiler.code, compiler.signatures, static_sizes, layer_slots, splitting,
                         layers, token_index, pinned, compiler.static_seconds, compiler.landing,
                         cache if compiler._use_cache else None)
