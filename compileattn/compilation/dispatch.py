"""The per-step dispatcher: runs a compiled split graph, choosing each step's execution mode.

Per step, from the forward context's metadata (vLLM's division of labour: the dispatcher picks the
mode, ``cudagraph.CUDAGraphWrapper`` only captures, checks and replays):

- **full**: the step is a uniform decode, its token count is a capture size and every layer's
  prepared call is capturable (``CallTable.capturable``): one CUDA graph of the whole forward.
- **piecewise**: the token count is a capture size: each piece replays its own CUDA graph and the
  attention calls run eagerly between them.
- **none**: anything larger, or graphs off: the compiled pieces run as they are.

Static-shape compiles (``CompileConfig.compile_sizes``) replace the dynamic-shape piece for steps
of exactly that size, in every mode. Those still compiling in workers when the compile returned
land between two steps (``landing.py``): the dispatcher installs them at the start of a step and
drops the CUDA graphs of their sizes, which the next step of that size captures again. Identical
pieces share compiled code; before running one, the dispatcher publishes which layers its KV-write
slots stand for (``piece_signature.py``).

Under ``@compileattn.compile`` a full-decode step whose graph this dispatcher has already replayed
may not reach it at all: the decorator replays that graph itself (``replay.py``), after asking
``full_replay_entry`` whether this step would replay it.

The dispatcher is what the backend returns to Dynamo, and a ``SerializableCallable``:
``torch.compile(...).aot_compile`` saves it (``artifact.py``) and a warm start loads it.

CUDA graphs and static pieces are keyed by the token count; a call whose other dynamic sizes differ
from the compiled call's runs the dynamic-shape pieces without graphs (``pinned_sizes.py``).

Checks, once per step (not per layer): the graph inputs' token count equals the metadata's, and
(once per set of KV caches) every attention layer the graph calls has a cache of its dtype and
head shape. The compiled forward is inference-only: it runs under ``torch.no_grad()``.

Addresses: a CUDA graph reads its inputs where they were at capture. ``CapturedGraph.check``
compares every input of a graph on its first replay; after that, a graph step compares the graph
inputs that are neither parameters nor unread by any captured graph (the caller's token ids and
positions, buffers: a few per step, ~0.1 µs each by ``timeit`` on the repo's 2-core CPU box) with
where they were when the size's graphs were captured, and raises ``CudaGraphAddressError`` for a
moved one, which every replay would otherwise read stale. Of those that are not the call's arguments
(``_gathered``: a module's buffers, a module attribute or global Dynamo's code reads) it compares
the shape and strides too, since ``buffer.data = buffer.t()`` of a square buffer, or
``buffer.data = buffer[:k]``, keeps the address and no hook counts it (``module_watch`` counts
``.data`` assignments and in-place changes of parameters only): ~0.1-0.2 µs more a buffer (~0.21 against ~0.09 µs an
input for the address and strides, the shape ~0.09 µs more, same box; a Llama has one, OPT none).
The arguments' layouts are Dynamo's guards' and ``argcheck``'s. Parameters
are too many to compare every step (~21 µs for a Llama's 291, probe S18-4): a graph step compares
``module_watch.generation``, bumped by every parameter, buffer or submodule registration in the
process, with the one it last checked, and the addresses of the first and last parameter inputs with
theirs (another instance of the model's class, which Dynamo serves from this same graph, registered
nothing since the capture), and only when one changed compares every parameter with its address at
capture. A replaced parameter (``module.weight = nn.Parameter(w)``,
``load_state_dict(..., assign=True)``, a new submodule) drops every CUDA graph, and each size's next step captures them
again from the current tensors (a buffer replaced with it is then served too); a buffer replaced
alone raises ``CudaGraphAddressError``, as a moved token-id input does (with
``check_input_addresses``, the default). Updating a parameter in place is served as it is.
``param.data = other``, ``param.set_(other)``, ``torch.utils.swap_tensors`` and ``module.to(...)``
register nothing, but bump the generation all the same (``module_watch`` wraps ``Module._apply`` and
the swap, and gives ``torch.nn.Parameter`` a ``__setattr__`` that counts ``data`` and counting
in-place methods): the next graph step compares every parameter. A graph step also sees a moved first
or last parameter input by itself, and the decorator a model's first or last parameter
(``model_tensors.py``: a conversion of the whole model raises there, moved tensors of the same
layout bump the generation as a registration does).

Scalars: a Python float or int that Dynamo made a graph input (automatic dynamic, after a second
instance of the class read another value of an attribute) arrives as a fresh 0-dim CPU tensor every
call. A CUDA graph does not read it by address: its value is read on the host while capturing (an
``.item()``, or an operand aten wraps as a scalar) and baked into the kernel launches, so a replay
computes with the value of the capture. A graph step compares these inputs by value (``.item()``,
~0.6 µs each on a 2-core CPU box; a graph without them pays one dict lookup) with their values
when the size's graphs were captured; another value drops that size's graphs, which the step
captures again (``scalar_recaptures``), with or without ``check_input_addresses``. A scalar that
keeps changing (a step counter, two instances of a class stepped in turn) would capture every step,
a capture costing ms of host time and a replay's worth of graph memory churned; after
``SCALAR_RECAPTURES_BEFORE_EAGER`` such changes (one change counts once, however many capture
sizes then capture again for it) the dispatcher stops capturing and runs its steps
through the compiled pieces without graphs (``scalar_graphs_off``, a WARNING naming the input), as
``torch.compile``'s own CUDA graphs skip a graph with CPU scalar inputs.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from .. import _torch_compat, context
from ..config import DEFAULT_SPLITTING_OPS, CompileConfig
from ..counters import counters
from . import cudagraph, module_watch
from .piecewise import CompiledSplit, attention_inside_pieces

logger = logging.getLogger("compileattn")

#: Changes of a scalar input a dispatcher captures again for before it stops capturing (module docstring).
SCALAR_RECAPTURES_BEFORE_EAGER = 3


class StepDispatcher(_torch_compat.serializable_callable_base()):
    def __init__(self, compiled: CompiledSplit, config: CompileConfig, device: torch.device):
        self.compiled = compiled
        self.split_gm = compiled.split_gm
        self.config = config
        self.device = device
        self.token_count = compiled.token_count()
        self.layers = compiled.layers
        self.static_tokens = next((s.static_tokens for s in compiled.layers.values() if s.static_tokens), None)
        graph_device = "cuda" if cudagraph.simulating() else device.type
        self.mode = config.resolved_cudagraph_mode(graph_device)
        if self.mode != "none" and graph_device != "cuda":
            raise ValueError(f"cudagraph_mode={config.cudagraph_mode!r} needs CUDA, the graph is on {device}")
        stuck = attention_inside_pieces(compiled.pieces) if self.mode != "none" else []
        if stuck:
            raise ValueError(f"cudagraph_mode={self.mode!r} would capture {stuck} inside a piece's CUDA graph, which "
                             f"freezes the step it reads at capture: keep them in splitting_ops "
                             f"(default {list(DEFAULT_SPLITTING_OPS)}) or use cudagraph_mode='none'")
        self.capture_sizes = frozenset(config.capture_sizes)
        #: whether a call's other dynamic sizes are those graphs and static pieces hold (None: no
        #: other sizes, or neither graphs nor static pieces to keep them from)
        keyed = self.mode != "none" or bool(compiled.static_sizes) or compiled.landing is not None
        self.pinned_sizes_hold = compiled.pinned.checker() if keyed else None
        self._warned_unpinned = False
        if self.pinned_sizes_hold is not None:
            logger.info("compileattn: CUDA graphs and static pieces serve calls whose other dynamic sizes are the "
                        "compiled call's: %s", compiled.pinned.describe())
        self.pool = None
        self.static = {name: compiled.static(name) for name in compiled.signatures if compiled.static_sizes}
        self._landing = compiled.landing
        #: when the last static piece landed, seconds after the landing started (None: none landed late)
        self.static_settled_after: float | None = None
        #: a static piece that could be compiled neither by a worker nor here (its size keeps the
        #: dynamic piece; a warm start file would lack it, so none is written)
        self.static_incomplete = False
        #: the step's token count while the split graph runs, when pieces need it (graphs or static)
        self.current_size: int | None = None
        self.graphs_on = False
        self._full: cudagraph.CUDAGraphWrapper | None = None
        self._checked_caches = None
        #: (selector, kv_caches) the CUDA graphs were captured with: a captured graph reads that
        #: builder's metadata buffers and those caches by address.
        self._graph_owner: tuple | None = None
        self._warned_grad = False
        #: the full-graph entry the last step replayed (not captured), for ``replay.FullStepShortcut``
        self.replayed: cudagraph.CapturedGraph | None = None
        self.pieces = compiled.pieces
        self._piece_graphs: list[cudagraph.CUDAGraphWrapper] = []
        for piece in compiled.pieces:
            delattr(self.split_gm, piece.name)  # plain attributes, not submodules: no Module.__call__
            if piece.is_splitting_op:
                setattr(self.split_gm, piece.name, compiled.splitting[piece.name].make(piece.module))
            else:
                setattr(self.split_gm, piece.name, self._piece_runner(piece.name, compiled.dynamic(piece.name),
                                                                      self.static.get(piece.name, {}),
                                                                      compiled.layer_slots.get(piece.name) or None))
        self._forward = self.split_gm.forward
        #: graph inputs (by position) a piece's graph / the full graph reads (``_inputs_read``)
        self._read_by_pieces, self._read_by_full = self._inputs_read()
        self._input_names = [n.name for n in self.split_gm.graph.nodes if n.op == "placeholder"]
        #: graph inputs (by position) Dynamo made from a Python scalar: compared by value
        self._scalar_inputs = self._scalars()
        #: graph inputs (by position) Dynamo's code gathers itself (buffers, module attributes, globals):
        #: their strides are compared every graph step with their addresses (module docstring)
        self._gathered_inputs = self._gathered()
        #: (size, full?) -> (position, address, strides or None) of its graphs' checked inputs at their
        #: capture (strides of the gathered inputs only)
        self._captured_at: dict[tuple[int, bool], tuple[tuple[int, int, tuple[int, ...] | None], ...]] = {}
        #: (size, full?) -> (position, value) of its graphs' scalar inputs at their capture
        self._scalars_at: dict[tuple[int, bool], tuple[tuple[int, Any], ...]] = {}
        #: changes of a scalar input so far that graphs were captured again for (a change counts once,
        #: however many sizes capture again for it); past the bound, no graph steps
        self._scalar_recaptures = 0
        #: (position, value) of the last change counted there
        self._last_scalar_change: tuple[int, Any] | None = None
        #: set once a scalar input changed past that bound: every step runs without graphs
        self._graphs_stopped = False
        #: (position, address) of every parameter graph input when the live graphs were captured
        self._parameters_at: tuple[tuple[int, int], ...] = ()
        #: ``module_watch.generation`` when the parameters were last compared (None: no graph step yet)
        self._watched_generation: int | None = None
        #: (position, address) of the first and last parameter graph input at that comparison:
        #: compared every graph step (``_parameters_moved``)
        self._watched_parameters: tuple[tuple[int, int], ...] = ()
        #: size -> ``module_watch.generation`` at this size's last full-graph step through the
        #: ordinary path, which compared that size's graph inputs, buffers too: a direct replay
        #: (``full_replay_entry``) needs the current one. The dispatcher-wide generation is not
        #: enough: a step of another size or mode compares only its own graphs' inputs.
        self._full_checked_at: dict[int, int] = {}

    def _inputs_read(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Positions of the graph inputs some piece reads (which its graph then reads by address),
        and of those anything reads (the full graph captures all of it)."""
        splitting = {p.name for p in self.pieces if p.is_splitting_op}
        placeholders = [n for n in self.split_gm.graph.nodes if n.op == "placeholder"]
        by_pieces = tuple(i for i, n in enumerate(placeholders)
                          if any(u.op == "call_module" and u.target not in splitting for u in n.users))
        by_full = tuple(i for i, n in enumerate(placeholders) if n.users)
        return by_pieces, by_full

    def _scalars(self) -> frozenset[int]:
        """Positions of the graph inputs that are Python scalars passed as 0-dim CPU tensors (module
        docstring): those Dynamo says it wrapped (``GraphArg.pass_arg_as_tensor`` of a non-tensor),
        and, where the graph runs on a GPU, any 0-dim CPU tensor (a graph loaded from a file keeps
        no Dynamo metadata). A model's 0-dim buffer on the CPU under simulated graphs is neither."""
        scalars = set()
        for i, n in enumerate(n for n in self.split_gm.graph.nodes if n.op == "placeholder"):
            arg = n.meta.get("grapharg")
            value = _torch_compat.node_example_value(n)
            if arg is not None and getattr(arg, "pass_arg_as_tensor", False) and not getattr(arg, "is_tensor", True):
                scalars.add(i)
            elif (self.device.type != "cpu" and isinstance(value, torch.Tensor) and value.dim() == 0
                  and value.device.type == "cpu"):
                scalars.add(i)
        return frozenset(scalars)

    def _gathered(self) -> frozenset[int]:
        """Positions of the graph inputs that are not known to be the compiled call's arguments (or
        items of them): their strides are compared every graph step (module docstring), since no
        hook sees ``buffer.data = buffer.t()``, which keeps the address, and neither Dynamo's guards
        (skipped by ``@compileattn.compile``) nor ``argcheck`` look at them. Known arguments: an
        input whose Dynamo source is a local, or an item of one, with no attribute read on the way
        (``L['input_ids']``, not ``L['self']._buffers['scale']``); where the graph keeps no source
        (``aot_compile``, the decorator's graphs), one Dynamo did not mark a module's tensor
        (``_dynamo_static_input_type``) and traced with a symbolic size (the token dimension). A
        static-shaped argument there is compared too: ~0.1 µs more, never wrong."""
        gathered = set()
        for i, n in enumerate(n for n in self.split_gm.graph.nodes if n.op == "placeholder"):
            grapharg = n.meta.get("grapharg")
            source = getattr(grapharg, "source", None)
            if source is not None:
                argument = _torch_compat.source_is_call_argument(source)
            else:
                value = _torch_compat.node_example_value(n)
                argument = (isinstance(value, torch.Tensor)
                            and "_dynamo_static_input_type" not in (n.meta.get("tensor_dict") or {})
                            and any(isinstance(d, torch.SymInt) for d in value.shape))
            if not argument:
                gathered.add(i)
        return frozenset(gathered)

    def _check_addresses(self, size: int, full: bool, args) -> bool:
        """A graph step's inputs are where its graphs were captured with them, and its scalar inputs
        hold the values they were captured with (module docstring). False: the step runs without
        graphs, a scalar input having changed too often to capture again."""
        key = (size, full)
        captured = self._captured_at.get(key)
        if captured is None:
            read = self._read_by_full if full else self._read_by_pieces
            self._scalars_at[key] = tuple((i, args[i].item()) for i in read if i in self._scalar_inputs)
            self._captured_at[key] = tuple(
                (i, args[i].data_ptr(), (args[i].shape, args[i].stride()) if i in self._gathered_inputs else None)
                for i in read
                if isinstance(args[i], torch.Tensor) and not isinstance(args[i], torch.nn.Parameter)
                and i not in self._scalar_inputs) if self.config.check_input_addresses else ()
            return True
        for i, value in self._scalars_at[key]:
            now = args[i].item()
            if now != value:
                self._drop_graphs((size,))
                if (i, now) != self._last_scalar_change:  # another size catching up with it is not another
                    if self._scalar_recaptures >= SCALAR_RECAPTURES_BEFORE_EAGER:
                        self._stop_graphs_for_scalar(self._input_names[i])
                        return False
                    self._scalar_recaptures += 1
                    self._last_scalar_change = (i, now)
                counters.scalar_recaptures += 1
                logger.info("compileattn: size %d: scalar graph input %s is %r, its CUDA graphs were captured with "
                            "%r (a replay would compute with that): capturing them again", size,
                            self._input_names[i], now, value)
                return self._check_addresses(size, full, args)  # records this step's, whose graphs it captures
        for i, ptr, layout in captured:
            if args[i].data_ptr() != ptr:
                raise cudagraph.CudaGraphAddressError(
                    f"size {size}: graph input {i} ({self._input_names[i]}, shape {tuple(args[i].shape)}) was at "
                    f"0x{ptr:x} when this size's "
                    f"CUDA graphs were captured and is now at 0x{args[i].data_ptr():x}; a replay would read the old "
                    f"memory. Pass inputs that live in persistent buffers (slice views of one preallocated tensor), "
                    f"or turn CUDA graphs off. A module's buffer replaced after capture is refused alike: update it "
                    f"in place (buffer.copy_(new)).")
            if layout is not None and (args[i].shape, args[i].stride()) != layout:
                raise cudagraph.CudaGraphAddressError(
                    f"size {size}: graph input {i} ({self._input_names[i]}) had shape {tuple(layout[0])} and "
                    f"strides {layout[1]} when this size's CUDA graphs were captured and now has shape "
                    f"{tuple(args[i].shape)} and strides {args[i].stride()} at the same address "
                    f"(buffer.data = buffer.t() or buffer[:k], as_strided_); a replay would read it in the old "
                    f"layout. Keep the layout, and update the tensor in place (buffer.copy_(new)).")
        return True

    def _stop_graphs_for_scalar(self, name: str) -> None:
        """No more CUDA graphs for this dispatcher: a scalar input changed more often than a capture
        pays for (module docstring)."""
        self._graphs_stopped = True
        self._drop_graphs(self.capture_sizes)
        counters.scalar_graphs_off += 1
        logger.warning("compileattn: scalar graph input %s changed again after %d changes captured: its steps run "
                       "without CUDA graphs from now on (a CUDA graph bakes a Python scalar in at capture). Keep "
                       "the value in a tensor (a buffer) to have graphs again", name, self._scalar_recaptures)

    def _recheck_after_registrations(self, size: int, full: bool, args, generation: int) -> bool:
        """A module registered a parameter, buffer or submodule since the last graph step, or the
        first or last parameter input moved (``_parameters_moved``), or this is the first one:
        compare every parameter input with its address at capture, and drop
        every graph if one was replaced (module docstring). ``generation`` counts as checked only
        once the step's other inputs passed too: a buffer replaced alone keeps every graph step
        here, raising, and off ``replay.FullStepShortcut``, which does not compare buffers."""
        now = tuple((i, args[i].data_ptr()) for i in self._read_by_full if isinstance(args[i], torch.nn.Parameter))
        if self._watched_generation is None:
            module_watch.start()  # before this step captures: a replacement from now on is counted
        else:
            counters.module_rechecks += 1
            captured = dict(self._parameters_at)
            moved = [i for i, address in now if captured.get(i) != address]
            if moved:
                counters.parameter_recaptures += 1
                logger.info("compileattn: parameter %s%s replaced since this model's CUDA graphs were captured: "
                            "dropping them, each size's next graph step captures them again",
                            self._input_names[moved[0]], f" (and {len(moved) - 1} more)" if len(moved) > 1 else "")
                self._drop_graphs(self.capture_sizes)
        self._parameters_at = now
        self._watched_parameters = (now[0], now[-1]) if now else ()
        graphs = self._check_addresses(size, full, args)
        self._watched_generation = generation
        return graphs

    def _parameters_moved(self, args) -> bool:
        """Whether the first or last parameter graph input is not where it was at the last
        comparison: another instance of the model's class, which Dynamo serves from this same
        graph (its parameters are graph inputs, and guards do not compare modules by identity),
        whose parameters were all made before the graphs were captured, so no registration tells
        (two data_ptr reads a graph step)."""
        for i, address in self._watched_parameters:
            if args[i].data_ptr() != address:
                return True
        return False

    # -- saving (torch.compile(...).aot_compile calls these) -----------------------------------

    @classmethod
    def serialize_compile_artifacts(cls, fn: "StepDispatcher") -> bytes:
        from . import artifact

        return artifact.dumps(fn)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "StepDispatcher":
        from . import artifact

        return artifact.loads(data)

    # -- wiring ------------------------------------------------------------------------------

    def _graph_wrapper(self, name: str, fn: Callable[..., Any]) -> cudagraph.CUDAGraphWrapper:
        if self.pool is None:
            self.pool = cudagraph.make_pool(self.device)
        return cudagraph.CUDAGraphWrapper(name, fn, self.pool, self.config.check_input_addresses)

    def _piece_runner(self, name: str, fn: Callable[..., Any], static: dict[int, Any],
                      slots: dict[str, str] | None) -> Callable[..., Any]:
        """The callable the split graph calls for a piece. ``slots``: the layers its KV writes
        stand for, published before the piece runs (and so also when it is captured)."""
        if self.mode == "none" and not static and self._landing is None:
            if slots is None:
                return fn

            def run_as_layer(*args):
                context.piece_layer_names = slots
                return fn(*args)

            return run_as_layer
        graphs = self._graph_wrapper(name, fn) if self.mode != "none" else None
        if graphs is not None:
            self._piece_graphs.append(graphs)
        names = slots if slots is not None else {}

        def run(*args):
            context.piece_layer_names = names
            size = self.current_size
            if size is None:
                return fn(*args)
            if self.graphs_on:
                return graphs.run(size, args, static.get(size, fn))
            return static.get(size, fn)(*args)

        return run

    # -- per step ----------------------------------------------------------------------------

    def _check_step(self, ctx: context.ForwardContext, args: Sequence[Any]) -> None:
        md = ctx.metadata
        tokens = self.token_count(args) if self.token_count is not None else self.static_tokens
        if tokens is not None and tokens != md.num_tokens:
            raise ValueError(f"the compiled model was called with {tokens} tokens, but the step's metadata has "
                             f"num_tokens={md.num_tokens} ({md.num_actual_tokens} real + padding); pass inputs "
                             f"of the metadata's (padded) token count")
        caches = ctx.kv_caches
        if ctx.caches_key is self._checked_caches:
            return
        for layer, sig in self.layers.items():
            cache = caches.get(layer)
            if cache is None:
                raise context.missing_layer_error(layer)
            if sig.device is not None and cache.device != sig.device:
                raise ValueError(f"layer {layer!r}: the model's attention runs on {sig.device} but its KV cache is "
                                 f"on {cache.device}; allocate caches on the model's device")
            if cache.query_dtype != sig.dtype:
                raise TypeError(f"layer {layer!r}: the model's attention runs in {sig.dtype} but its KV cache takes "
                                f"{cache.query_dtype} queries; allocate caches for the model's dtype")
            spec = cache.spec
            if (spec.num_heads, spec.head_dim) != (sig.num_heads, sig.head_dim):
                raise ValueError(f"layer {layer!r}: the model passes {sig.num_heads} query heads of {sig.head_dim}, "
                                 f"its KV cache's AttentionSpec has {spec.num_heads} of {spec.head_dim}")
            if sig.key_heads is not None and sig.key_heads != (spec.num_kv_heads, spec.head_dim):
                raise ValueError(f"layer {layer!r}: the model writes keys of {sig.key_heads[0]} KV heads of "
                                 f"{sig.key_heads[1]}, its KV cache's AttentionSpec has {spec.num_kv_heads} of "
                                 f"{spec.head_dim}")
        self._checked_caches = ctx.caches_key

    def __call__(self, *args):
        if self._landing is not None and self._landing.changed:
            self._land()
        ctx = context._current
        if ctx is not None:
            self._check_step(ctx, args)
            # The step's (padded) token count is the metadata's: the graph inputs can hold more than
            # one symbolic size, and a graph with no symbolic token dim (Dynamo specialises 1-token
            # steps) still gets graphs for its one size.
            size = ctx.metadata.num_tokens
        else:
            size = self.token_count(args) if self.token_count is not None else None
        if self.pinned_sizes_hold is not None and not self.pinned_sizes_hold(args):
            self._note_unpinned(args)
            size = None  # the dynamic-shape pieces, no graphs: both are keyed by the token count alone
        if torch.is_grad_enabled():
            if not self._warned_grad:
                self._warned_grad = True
                logger.info("the compileattn backend is inference-only: the compiled forward runs under "
                            "torch.no_grad() and its outputs have no autograd history")
            with torch.no_grad():
                return self._step(ctx, size, args)
        return self._step(ctx, size, args)

    def _note_unpinned(self, args) -> None:
        counters.unpinned_steps += 1
        if not self._warned_unpinned:
            self._warned_unpinned = True
            pinned = self.compiled.pinned
            if not pinned.keyed_by_token_count:
                logger.warning("compileattn: every call runs the dynamic-shape pieces without CUDA graphs or static "
                               "pieces: %s", pinned.describe())
            else:
                logger.warning("compileattn: calls whose other dynamic sizes differ from the compiled call's run the "
                               "dynamic-shape pieces without CUDA graphs or static pieces, which hold only those: %s",
                               pinned.describe(args))

    def _step(self, ctx, size, args):
        if self.mode == "none" and not self.static:
            counters.eager_steps += 1
            return self._forward(*args)
        graphs = self.mode != "none" and size in self.capture_sizes and not self._graphs_stopped
        if graphs and self.pool is not None and self.pool.inference_outputs and not torch.is_inference_mode_enabled():
            with torch.inference_mode():  # graphs captured in it made inference tensors (``GraphPool``)
                return self._step(ctx, size, args)
        if graphs:
            self._check_graph_owner(ctx)
            full = (self.mode == "full_and_piecewise" and ctx is not None and ctx.metadata.is_uniform_decode
                    and ctx.table.capturable)
            generation = module_watch.generation
            if generation != self._watched_generation or self._parameters_moved(args):
                graphs = self._recheck_after_registrations(size, full, args, generation)
            else:
                graphs = self._check_addresses(size, full, args)
        if graphs:
            counters.cudagraph_replays += 1
            if full:
                out = self._run_full(size, args)
                self._full_checked_at[size] = generation
                return out
        else:
            counters.eager_steps += 1
        self.current_size, self.graphs_on = size, graphs
        try:
            return self._forward(*args)
        finally:
            self.current_size, self.graphs_on = None, False

    def _check_graph_owner(self, ctx) -> None:
        owner = (ctx.metadata.selector, ctx.caches_key) if ctx is not None else (None, None)
        if self._graph_owner is None:
            self._graph_owner = owner
        elif owner[0] is not self._graph_owner[0] or (owner[1] is not self._graph_owner[1]
                                                      and owner[1] != self._graph_owner[1]):
            raise cudagraph.CudaGraphAddressError(
                "this compiled model's CUDA graphs were captured with another metadata builder or other KV "
                "caches (another kv_caches mapping, or a layer's cache replaced in it); a replay would read the "
                "old buffers and caches. Use one builder and one set of caches per compiled model (or compile one "
                "per engine)")
        elif owner[1] is not self._graph_owner[1]:
            self._graph_owner = owner  # the same caches under a new key: compared by `is` from now on

    def _run_full(self, size: int, args):
        counters.full_graph_steps += 1
        if self._full is None:
            self._full = self._graph_wrapper("full graph", self._forward)
        entry = self._full.graphs.get(size)
        self.current_size = size  # inside the full graph, pieces run their (static) compiled code
        try:
            out = self._full.run(size, args)
        finally:
            self.current_size = None
        if entry is not None and entry.checked:
            self.replayed = entry
        return out

    def full_replay_entry(self, ctx: context.ForwardContext) -> cudagraph.CapturedGraph | None:
        """The full graph a step in ``ctx`` would replay with no check of the dispatcher's left
        to run but those of its arguments (the caller's: their addresses, shapes and strides are
        those of the graph's first replay, which also keeps the pinned sizes), or None:
        a uniform decode of capturable calls, at a size whose graph was captured and checked,
        through the builder and caches the graphs were captured with, caches already checked
        (``__call__``'s token-count check is the caller's, ``replay.FullStepShortcut``)."""
        if self._landing is not None and self._landing.changed:
            return None  # the ordinary path installs the static pieces first
        if self._full_checked_at.get(ctx.metadata.num_tokens) != module_watch.generation:
            return None  # a module registered something since this size's last ordinary full step: it compares first
        md = ctx.metadata
        owner = self._graph_owner
        if (self._full is None or not md.is_uniform_decode or not ctx.table.capturable
                or ctx.caches_key is not self._checked_caches or md.selector is not owner[0]
                or ctx.caches_key is not owner[1]):
            return None
        entry = self._full.graphs.get(md.num_tokens)
        return entry if entry is not None and entry.checked else None

    # -- static pieces that land after the compile --------------------------------------------

    def _land(self, max_failed: int | None = 1) -> None:
        """Install the static pieces that landed since the last step (of the failed ones, which are
        compiled here, ``max_failed``) and drop the graphs of their sizes; once none is left out,
        run what waited for it."""
        landing = self._landing
        sizes = set()
        for key, task in landing.take(max_failed):
            fn = self.compiled.adopt_landed(key, task, landing.resolve)
            if fn is None:
                self.static_incomplete = True
                continue
            signature, size = key
            for name, sig in self.compiled.signatures.items():
                if sig == signature:
                    self.static[name][size] = fn
            sizes.add(size)
        self._drop_graphs(sizes)
        counters.static_landings += len(sizes)
        if landing.settled:
            self._landing = None
            self.static_settled_after = landing.settled_after
            logger.info("compileattn: static-shape pieces in place %.2f s after the compile returned",
                        landing.settled_after)
            landing.finish()

    def _drop_graphs(self, sizes) -> None:
        """Forget every CUDA graph of ``sizes``, the pieces' and the full one: the next graph step of
        each size captures them again. A piece's graph reads the previous piece's static outputs
        by address, so no piece's graph can be captured again alone."""
        for size in sorted(sizes):
            for graphs in self._piece_graphs:
                graphs.forget(size)
            if self._full is not None:
                self._full.forget(size)
            for full in (False, True):
                self._captured_at.pop((size, full), None)
                self._scalars_at.pop((size, full), None)
        if sizes:
            self.replayed = None

    def pending_static_compiles(self) -> int:
        """Static compiles not yet installed (0 once every one has landed or been given up)."""
        return self._landing.pending if self._landing is not None else 0

    def wait_for_static_pieces(self, timeout: float | None = None) -> bool:
        """Block until every static compile still out has finished and install them now (on the
        thread that runs the model, between steps). Without a ``timeout`` the tasks no worker has
        started are compiled here meanwhile, as a compile that waits would; with one, False if
        they are not all done in time."""
        landing = self._landing
        if landing is None:
            return True
        if timeout is None:
            landing.drain()
            self._land(max_failed=None)  # the caller waits anyway: every failed task is compiled now
            return True
        deadline = time.monotonic() + timeout
        if not landing.wait(timeout):
            return False
        # A task a worker failed is compiled here (1-5 s each on the H200): with a timeout, only
        # while time is left (one started before the deadline may pass it), else a process whose
        # workers all died waited at exit for every static piece to compile, past the documented
        # bound (``decorator.EXIT_WAIT_FOR_STATIC_S``); the rest land at later steps.
        while True:
            self._land(max_failed=1 if time.monotonic() < deadline else 0)
            if self._landing is None:
                return True
            if time.monotonic() >= deadline:
                return False

    def abandon_static_compiles(self) -> None:
        """Stop the workers of static compiles nobody will install (the compile that made this
        dispatcher is being discarded)."""
        if self._landing is not None:
            self._landing.close()
            self._landing = None

    def when_static_settled(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` once no static compile is out (now, if none is)."""
        if self._landing is None:
            callback()
        else:
            self._landing.when_settled(callback)

    # -- what tests and benchmarks read ---------------------------------------------------------

    def full_graph_count(self) -> int:
        """CUDA graphs captured of the whole forward (one per size)."""
        return len(self._full.graphs) if self._full is not None else 0

    def piece_graphs(self) -> list[cudagraph.CUDAGraphWrapper]:
        """The CUDA-graph wrapper of every compiled piece (empty with graphs off)."""
        return list(self._piece_graphs)

    def piece_graph_count(self) -> int:
        """CUDA graphs captured for pieces, over all sizes."""
        return sum(len(g.graphs) for g in self._piece_graphs)

    def graph_pool_bytes(self) -> int:
        return self.pool.pool_bytes() if self.pool is not None else 0

    def capture_seconds(self) -> float:
        return self.pool.capture_seconds if self.pool is not None else 0.0
