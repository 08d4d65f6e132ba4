"""Every private torch API compileattn uses, behind one door.

torch keeps no promise about underscore names, so each one is reached only through this module,
with the torch versions it was checked on and a clear error if a torch version lacks it. The
project supports torch 2.11-2.13 (``pyproject.toml``);
``tests/test_house.py::test_private_torch_apis_resolve`` resolves every entry of ``PRIVATE_APIS``
on the torch it runs with, so a torch upgrade that moves one fails there, by name, rather than
deep inside a compile.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import io
import inspect
import os
import sys
import types
from typing import Any, Callable

import torch
import torch.fx

#: Checked on: 2.11 (the GPU machine's 2.11.0+cu130), 2.12 (2.12.0+cu130 wheel, run on the CPU), 2.13
#: (the CPU machines' 2.13.0+cpu). "dotted.path": what compileattn uses it for.
PRIVATE_APIS = {
    "torch._dynamo.backends.registry._BACKENDS": "is the backend name registered yet (a PYTHONPATH checkout "
                                                 "has no entry point)",
    "torch._dynamo.register_backend": "registering the name on import (the entry point covers installed copies)",
    "torch._dynamo.convert_frame.register_bytecode_hook": "debug dumps of Dynamo's code under torch.compile",
    "torch._dynamo.config": "enable_aot_compile: torch.compile(...).aot_compile exists only with it on (off by "
                            "default in 2.11)",
    "torch._dynamo.aot_compile.AOTCompiledFunction": "what aot_compile returns: .fn (Dynamo's code as a function), "
                                                     "serialize(), source_info()",
    "torch._dynamo.aot_compile_types.SerializableCallable": "base of what the backend returns, so aot_compile "
                                                            "can save it",
    "torch._dynamo.guards._get_closure_vars": "the helpers Dynamo's guard names call, to read a value the "
                                              "trace baked in again where the guard named it (warm start)",
    "torch._dynamo.utils": "the module of the helpers Dynamo's code calls around the graph (profiler markers, "
                           "call_size): a full-decode step may skip that code only if it calls nothing else",
    "torch.multiprocessing.reductions.StorageWeakRef": "which traced nodes share a storage (the hoist pass: "
                                                       "what an op writes), compared by the storage's identity",
    "torch.fx._graph_pickler.GraphPickler": "saving the split graph in the warm-start artifact",
    "torch.fx._graph_pickler.Options": "GraphPickler options (custom ops allowed)",
    "torch._inductor.config": "the settings a compile worker copies from the compiling process "
                              "(ConfigModule._get_dict(skip_default=True), patch)",
    "torch._inductor.standalone_compile.AOTCompiledArtifact": "a compiled piece as bytes (aot=True) and back",
    "torch._inductor.compile_fx": "imported ahead of a warm start (the first artifact load pays Inductor's import)",
    "torch._inductor.runtime.cache_dir_utils.default_cache_dir": "the TORCHINDUCTOR_CACHE_DIR Inductor sets where "
                                                                 "unset, which does not make a fork server stale",
    "torch._inductor.runtime.cache_dir_utils.triton_cache_dir": "the TRITON_CACHE_DIR Inductor sets where unset, "
                                                                "given to the attention kernels' compiles ahead",
    "torch._dynamo.backends.debugging.aot_eager": "piece_compiler='aot_eager'",
    "torch._functorch.config": "force_autograd_cache/bundled_autograd_cache off around aot_eager pieces (2.11: "
                               "aot_compile forces them on, and a non-Inductor piece then fails its cache entry)",
    "torch._dynamo.mark_dynamic": "marking the token dim of a step's inputs dynamic (documented, but private)",
    "torch._dynamo.lookup_backend": "@compileattn.compile(backend='inductor') and the like",
    "torch._inductor.standalone_compile": "compiling one piece with Inductor outside Dynamo",
    "torch._inductor.custom_graph_pass.CustomGraphPass": "the pieces' post-grad pass (passes/residual_addmm.py)",
    "torch.autograd.grad_mode._enter_inference_mode": "how Dynamo records entering torch.inference_mode(): "
                                                      "kept by the clean-up, which FX does not count impure",
    "torch.autograd.grad_mode._exit_inference_mode": "how Dynamo records leaving torch.inference_mode() (its "
                                                     "result unused): kept by the clean-up, as the entry",
    "torch._inductor.custom_graph_pass.get_hash_for_files": "that pass's cache identity (its file's hash)",
    "torch.fx.experimental.symbolic_shapes.statically_known_true": "that pass's shape checks on symbolic sizes",
    "torch.fx.experimental.symbolic_shapes.free_unbacked_symbols": "graph inputs of data-dependent size, refused "
                                                                  "by the backend (no example value to pin or "
                                                                  "capture at)",
    "torch._guards.detect_fake_mode": "the fake mode of the graph's example inputs",
    "torch._dynamo.source.AttrSource": "graph inputs Dynamo's code reads through an attribute (a module's "
                                       "buffers): the dispatcher compares their strides every graph step",
    "torch._dynamo.source.LocalSource": "graph inputs that are the compiled call's own arguments (or items of "
                                        "them): their strides are left to Dynamo's guards and argcheck",
    "torch._guards.tracing": "a tracing context around a worker's dynamic-shape piece compile (as Dynamo's)",
    "torch._guards.TracingContext": "that context, of the fake mode that travelled with the piece; the ShapeEnv "
                                    "of Dynamo's around the backend (the sizes its compile assumed)",
    "torch.utils._sympy.printers.PythonPrinter": "a compile's size guards as Python, which the decorator "
                                                 "evaluates per call (size_guards.py)",
    "torch._subclasses.fake_tensor.unset_fake_temporarily": "compiling a piece for static shapes",
    "torch._subclasses.fake_tensor.FakeTensorMode": "fake inputs with every size fixed",
    "torch._subclasses.fake_tensor.FakeTensor": "example values of a piece sent to a compile worker; a plain "
                                                "tensor's type in a piece signature",
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass": "a tensor subclass's inner tensors in a piece "
                                                                  "signature",
    "torch.utils._pytree.tree_leaves": "the tensors of a step's nested outputs a capture gives the warm-up's "
                                       "results",
    "torch.utils._pytree.tree_map": "a simulated capture's unwritten outputs, laid out as the warm-up's",
    "torch.fx.experimental.symbolic_shapes.ShapeEnv": "the symbolic sizes of a piece a compile worker "
                                                      "unpickles",
    "torch._ops.OpOverload": "matching splitting ops in FX graphs",
    "torch._ops.OpOverloadPacket": "matching splitting ops in FX graphs (Dynamo records packets)",
    "torch._C._AutoDispatchBelowAutograd": "the inference-only ops' Autograd kernel redispatches below it",
    "torch.distributed.distributed_c10d._get_default_store": "the store torchrun's group was set up with: a "
                                                             "failed TP step's reason for its peers",
    "torch._C._len_torch_dispatch_stack": "whether a dispatch mode is active (then the Autograd kernel redispatches)",
    "torch._C._swap_tensor_impl": "what torch.utils.swap_tensors calls, looked up at each call, to swap two "
                                  "tensors' storage and layout: module_watch counts it as a .data assignment",
}


def resolve(dotted: str) -> Any:
    """The object at ``dotted``; ImportError naming it if missing. An attribute wins over a
    submodule of the same name (``torch._inductor.standalone_compile`` is both)."""
    obj = _RESOLVED.get(dotted)
    if obj is not None:
        return obj
    parts = dotted.split(".")
    for i in [*range(len(parts) - 1, 0, -1), len(parts)]:  # the whole path last: a module
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except (ImportError, AttributeError):
            continue
        _RESOLVED[dotted] = obj
        return obj
    raise ImportError(f"torch {torch.__version__} has no {dotted} ({PRIVATE_APIS.get(dotted, 'private API')}); "
                      f"compileattn supports torch 2.11-2.13")


_RESOLVED: dict[str, Any] = {}


def registered_backends() -> dict:
    return resolve("torch._dynamo.backends.registry._BACKENDS")


def register_backend(fn: Callable, name: str) -> None:
    resolve("torch._dynamo.register_backend")(fn, name=name)


def dispatch_stack_depth() -> Callable[[], int]:
    """The function counting active dispatch modes: callers resolve it once, as it sits on the eager
    op's per-call path."""
    return resolve("torch._C._len_torch_dispatch_stack")


def swap_tensor_impl() -> Callable:
    """What ``torch.utils.swap_tensors`` calls now to swap the two tensors' C++ halves (its
    ``torch._C`` attribute, read at each of its calls)."""
    resolve("torch._C._swap_tensor_impl")  # ImportError naming it where a torch lacks it
    return torch._C._swap_tensor_impl


def set_swap_tensor_impl(fn: Callable) -> None:
    """Make ``torch.utils.swap_tensors`` call ``fn`` (``swap_tensor_impl``'s, wrapped)."""
    torch._C._swap_tensor_impl = fn


def default_store():
    """The key-value store of the default process group (initialised by the caller)."""
    return resolve("torch.distributed.distributed_c10d._get_default_store")()


def dynamo_utils_module():
    """The module Dynamo's generated code imports its helpers from (``__import_torch_dot__dynamo_dot_utils``)."""
    return resolve("torch._dynamo.utils")


def register_bytecode_hook(hook: Callable):
    return resolve("torch._dynamo.convert_frame.register_bytecode_hook")(hook)


class AotUnsupported(RuntimeError):
    """This torch cannot trace a function ahead of time (``torch.compile(...).aot_compile``)."""


#: Dynamo's guards on a plain value the trace read and baked in (a float attribute, a flag, a
#: module global, a class attribute, a config's field however deep)
_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH"})


def aot_compile(fn, args: tuple, kwargs: dict, backend, baked: list | None = None):
    """Dynamo's trace of ``fn(*args, **kwargs)`` handed to ``backend``, with every guard dropped
    (the caller checks arguments itself), returned as an ``AOTCompiledFunction``: nothing is
    installed on ``fn``'s code object and ``fn`` is not run. ``baked`` (emptied first) receives
    (Dynamo's name of where it read the value, the value) of each value guard it dropped
    (``_VALUE_GUARDS``; not code objects, which Dynamo compares by id): ``name`` evaluates with the
    frame's locals and ``G``, the compiled code's globals. ``aot_compile`` exists on the wrapper
    only if ``enable_aot_compile`` is on when ``torch.compile`` wraps (2.11's default is off)."""
    if baked is not None:
        baked.clear()

    def drop_all(entries) -> list[bool]:
        if baked is not None:
            baked.extend((e.name, e.value) for e in entries
                         if e.guard_type in _VALUE_GUARDS and e.has_value and not isinstance(e.value, types.CodeType))
        return [False] * len(entries)

    with resolve("torch._dynamo.config").patch(enable_aot_compile=True):
        compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend,
                                 options={"guard_filter_fn": drop_all})
    if not hasattr(compiled, "aot_compile"):
        raise AotUnsupported(f"torch {torch.__version__}'s torch.compile has no aot_compile")
    aot_fn = compiled.aot_compile((args, kwargs))
    if not isinstance(aot_fn, resolve("torch._dynamo.aot_compile.AOTCompiledFunction")):
        raise AotUnsupported(f"torch {torch.__version__}'s aot_compile returned {type(aot_fn).__name__}")
    return aot_fn


def guard_name_scope() -> dict[str, Any]:
    """The helpers Dynamo's guard names call (``___odict_getitem``, ``___tuple_iterator_getitem``):
    with ``G`` (the globals) and the frame's locals, a name evaluates to the value it guards."""
    return dict(resolve("torch._dynamo.guards._get_closure_vars")())


def aot_function(aot_fn):
    """Dynamo's transformed code of an ``AOTCompiledFunction`` as a plain function (no guards)."""
    return aot_fn.fn


def aot_serialize(aot_fn) -> bytes:
    return type(aot_fn).serialize(aot_fn).serialized_data


def aot_load(data: bytes, f_globals: dict):
    return torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=f_globals)


def aot_traced_sources(aot_fn) -> list[tuple[str, str]]:
    """(module name, the module's whole source at save time) of every code object Dynamo traced."""
    return sorted({(s.module, s.content) for s in aot_fn.source_info().inlined_sources})


def serializable_callable_base() -> type:
    """The class a backend's result must subclass for ``aot_compile`` (``object`` if this torch
    has none; then aot_compile is unavailable anyway)."""
    try:
        return resolve("torch._dynamo.aot_compile_types.SerializableCallable")
    except ImportError:
        return object


def graph_pickle(gm) -> bytes:
    options = resolve("torch.fx._graph_pickler.Options")(ops_filter=None)  # custom ops allowed
    return resolve("torch.fx._graph_pickler.GraphPickler").dumps(gm, options)


def graph_unpickle(data: bytes):
    gm = resolve("torch.fx._graph_pickler.GraphPickler").loads(data, static_fake_mode())
    gm.recompile()
    return gm


def piece_pickle(gm) -> bytes:
    """A piece's graph for a compile worker (``compilation/compile_pool.py``): a copy keeping
    of node metadata the stack traces and the example values (AOTAutograd's cache, hence a
    serialisable artifact, needs every tensor node's ``example_value``). Dynamo's other metadata
    (graph-argument sources, module stacks) does not pickle; an example value that is a view is
    replaced by a fake tensor of the same sizes and strides that is not (GraphPickler cannot save
    a view's base). Symbolic sizes travel with their ShapeEnv."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        meta = {}
        if isinstance(node.meta.get("stack_trace"), str):
            meta["stack_trace"] = node.meta["stack_trace"]
        for key in ("example_value", "val"):
            if key in node.meta:
                meta[key] = _without_views(node.meta[key])
        node.meta = meta
    return graph_pickle(torch.fx.GraphModule(gm, graph))


def _without_views(value):
    if isinstance(value, (list, tuple)):
        return type(value)(_without_views(v) for v in value)
    fake_tensor = resolve("torch._subclasses.fake_tensor.FakeTensor")
    if isinstance(value, fake_tensor) and value._is_view():
        with value.fake_mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device,
                                       requires_grad=value.requires_grad)
    return value


def tensor_type_name(t: torch.Tensor) -> str:
    """The type compiled code sees a tensor as, for keys of saved or shared compiles: "Tensor" for a
    plain tensor, a Parameter and the fake tensor Dynamo traces one as; a subclass by its module
    and qualified name (Dynamo traces its ``__torch_function__``, and a wrapper subclass as the
    tensors it flattens into)."""
    kind = type(t)
    if kind in (torch.Tensor, torch.nn.Parameter) or isinstance(t, resolve("torch._subclasses.fake_tensor.FakeTensor")):
        return "Tensor"
    return f"{kind.__module__}.{kind.__qualname__}"


def tensor_flatten(t: torch.Tensor) -> tuple[list[str], Any] | None:
    """``t.__tensor_flatten__()`` (its inner tensors' attribute names, its context) for a traceable
    wrapper subclass, else None."""
    return t.__tensor_flatten__() if resolve("torch.utils._python_dispatch.is_traceable_wrapper_subclass")(t) else None


def tree_leaves(tree: Any) -> list:
    """The leaves of nested tuples, lists and dicts (torch's pytree: what a step function returns)."""
    return resolve("torch.utils._pytree.tree_leaves")(tree)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)`` (torch's pytree)."""
    return resolve("torch.utils._pytree.tree_map")(fn, tree)


def node_example_value(node):
    """What Dynamo traced a node as (a fake tensor, SymInt, ...): its ``example_value``, else ``val``."""
    return node.meta.get("example_value", node.meta.get("val"))


@contextlib.contextmanager
def tracing_fake_mode(fake_mode):
    """A tracing context of ``fake_mode``, as Dynamo's around a backend: what
    ``standalone_compile(dynamic_shapes="from_tracing_context")`` takes its shapes from."""
    with resolve("torch._guards.tracing")(resolve("torch._guards.TracingContext")(fake_mode)):
        yield


def size_assumptions(shape_env) -> tuple:
    """What a ShapeEnv has assumed of its symbols: its guards, its replacements and its deferred
    runtime assertions (a compile that adds one of them narrowed the sizes its code is valid for)."""
    return (len(shape_env.guards), tuple(sorted((str(k), str(v)) for k, v in shape_env.replacements.items())),
            sum(len(v) for v in shape_env.deferred_runtime_asserts.values()))


def size_assumptions_added(shape_env, before: tuple) -> str:
    """What a ShapeEnv assumed since ``size_assumptions`` gave ``before``, on one line: the new
    guards' expressions, replacements and the count of deferred runtime assertions."""
    guards, replacements, deferred = before
    now_guards, now_replacements, now_deferred = size_assumptions(shape_env)
    parts = [f"guard {g.expr}" for g in list(shape_env.guards)[guards:]]
    parts += [f"replacement {k} -> {v}" for k, v in sorted(set(now_replacements) - set(replacements))]
    if now_deferred > deferred:
        parts.append(f"{now_deferred - deferred} deferred runtime assertions")
    return "; ".join(parts)


def tracing_shape_env():
    """The ShapeEnv of the tracing context around a backend call (Dynamo's), or None."""
    context = resolve("torch._guards.TracingContext").try_get()
    fake_mode = getattr(context, "fake_mode", None) if context is not None else None
    return getattr(fake_mode, "shape_env", None)


def size_hints(shape_env) -> dict:
    """symbol -> the size it stands for in this compile (the first call's); 2.13 renamed
    ``var_to_val`` to ``backed_var_to_val``."""
    known = getattr(shape_env, "backed_var_to_val", None)
    return dict(known if known is not None else shape_env.var_to_val)


def holds_at_hints(shape_env, expr) -> bool:
    """Whether ``expr`` (over this ShapeEnv's symbols) is true at their hints, recording nothing;
    False for an expression over symbols it does not have."""
    hints = size_hints(shape_env)
    if not expr.free_symbols <= set(hints):
        return False
    return bool(expr.xreplace(hints))


def reassume_guard(shape_env, expr) -> None:
    """Assume ``expr``, a guard that another ShapeEnv over the same symbols made (a compile
    worker's, a cached piece's), in ``shape_env``, as Inductor's own checks do (a guard, the
    symbols being backed). Only for an ``expr`` that ``holds_at_hints``: one that does not would
    record its negation."""
    shape_env.guard_or_defer_runtime_assert(expr, "compileattn: a piece compiled elsewhere assumed it")


def size_guard_expressions(shape_env) -> list:
    """Every guard expression (sympy) of a ShapeEnv, in the order they were added."""
    return [g.expr for g in shape_env.guards]


def symbol_bounds(shape_env) -> dict[str, tuple[int | None, int | None]]:
    """symbol name -> its value range's (lower, upper) bound, None where unbounded: a range can
    narrow without a guard (``torch._check``, ``constrain_range``)."""
    out = {}
    for symbol, vr in shape_env.var_to_range.items():
        lower = int(vr.lower) if vr.lower.is_Integer else None  # int_oo and oo are not Integers
        upper = int(vr.upper) if vr.upper.is_Integer else None
        out[str(symbol)] = (lower, upper)
    return out


def symbol_sources(shape_env) -> dict[str, list[str]]:
    """symbol name -> the names of the sources Dynamo made it for (``L['x'].size()[0]``, ...)."""
    out = {}
    for symbol, sources in shape_env.var_to_sources.items():
        out[str(symbol)] = [s.name() if callable(s.name) else s.name for s in sources]
    return out


def dynamo_size_source(argument: str, dim: int) -> str:
    """The name of Dynamo's source for dim ``dim`` of parameter ``argument`` of the traced frame
    (``x`` -> ``L['x'].size()[0]``; ``dynamic_arg_dims`` names parameters, never ``*args`` items)."""
    return f"{dynamo_argument_source(argument)}.size()[{dim}]"


def dynamo_argument_source(argument: str) -> str:
    """The name of Dynamo's source for parameter ``argument`` of the traced frame (``L['x']``)."""
    return f"L[{argument!r}]"


def dynamo_stride_source(argument: str, dim: int) -> str:
    """The name of Dynamo's source for stride ``dim`` of parameter ``argument`` (``L['x'].stride()[1]``)."""
    return f"{dynamo_argument_source(argument)}.stride()[{dim}]"


def python_code_of(expr) -> str:
    """A sympy size expression as Python code over its symbols' names (torch's printer: ``//``
    for FloorDiv, ``%`` for Mod, ``==`` for Eq)."""
    return resolve("torch.utils._sympy.printers.PythonPrinter")().doprint(expr)


def piece_unpickle(data: bytes):
    shape_env = resolve("torch.fx.experimental.symbolic_shapes.ShapeEnv")()
    gm = resolve("torch.fx._graph_pickler.GraphPickler").loads(
        data, resolve("torch._subclasses.fake_tensor.FakeTensorMode")(shape_env=shape_env))
    gm.recompile()
    return gm


def _config_modules() -> dict[str, Any]:
    """The torch config modules whose settings a compile worker copies."""
    return {"torch._inductor.config": resolve("torch._inductor.config"),
            "torch._functorch.config": resolve("torch._functorch.config")}


#: Inductor settings a worker sets itself: one compile at a time, Triton kernels compiled in-process
#: (no pool of pools); neither changes the generated code.
_WORKER_INDUCTOR = {"compile_threads": 1}


def config_changes(module) -> dict[str, Any]:
    """The entries of a torch config module that differ from their defaults (patches in force,
    environment overrides)."""
    return module._get_dict(skip_default=True)


def config_resets(module, keep) -> dict[str, Any]:
    """Each entry of a torch config module changed here (``config_changes``) but not in ``keep``,
    with its default value: what a process that has ``keep`` as its only changes reads. An entry
    without a plain default (set from a justknob or the environment alone) is left as it is."""
    unset = getattr(sys.modules.get("torch.utils._config_module"), "_UNSET_SENTINEL", object())
    resets = {}
    for name in config_changes(module).keys() - keep.keys():
        entry = getattr(module, "_config", {}).get(name)
        if entry is not None and getattr(entry, "default", unset) is not unset:
            resets[name] = copy.deepcopy(entry.default)
    return resets


def compile_settings() -> dict[str, Any]:
    """What steers an Inductor compile beyond its graph, inputs and options, as plain data: the
    non-default Inductor and AOTAutograd config and the global numerics flags (not grad mode:
    pieces are compiled for inference, grad mode off, wherever they are compiled)."""
    matmul = torch.backends.cuda.matmul
    return {
        "configs": {name: config_changes(module) for name, module in _config_modules().items()},
        "flags": {
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "fp16_reduction": matmul.allow_fp16_reduced_precision_reduction,
            "bf16_reduction": matmul.allow_bf16_reduced_precision_reduction,
            "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "default_dtype": torch.get_default_dtype(),
        },
        # Inductor's CPU code is generated for this many threads (``#pragma omp parallel
        # num_threads(N)``, its GEMM templates' blocking): a worker's own count (a fresh
        # interpreter's default, what a fork server inherited at decoration) would compile a static
        # piece for another. Not among the flags the cache keys read (``cache.environment_key``).
        "threads": torch.get_num_threads(),
    }


def autocast_state() -> tuple:
    """(device type, enabled, dtype) of autocast for the CPU and CUDA: a graph traced under it
    computes in its dtype, so a compile made under it is another compile."""
    state = []
    for device in ("cpu", "cuda"):
        try:
            state.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
        except (TypeError, RuntimeError):  # no such device type in this build
            continue
    return tuple(state)


def _set_flags(flags: dict[str, Any]) -> None:
    """Set the global flags of ``compile_settings`` that differ (a setter is only called to change
    something: torch warns about mixing some of the old and new precision APIs)."""
    current = compile_settings()["flags"]
    matmul = torch.backends.cuda.matmul
    setters = {
        "float32_matmul_precision": torch.set_float32_matmul_precision,
        "fp16_reduction": lambda v: setattr(matmul, "allow_fp16_reduced_precision_reduction", v),
        "bf16_reduction": lambda v: setattr(matmul, "allow_bf16_reduced_precision_reduction", v),
        "cudnn_tf32": lambda v: setattr(torch.backends.cudnn, "allow_tf32", v),
        "deterministic": lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        "default_dtype": torch.set_default_dtype,
    }
    for name, value in flags.items():
        if current.get(name) != value:
            setters[name](value)


@contextlib.contextmanager
def compile_settings_applied(settings: dict[str, Any]):
    """In a compile worker: the compiling process's ``compile_settings`` around a compile, grad
    mode off, autocast off: the compiling process sends no task under autocast
    (``compile_pool.unsendable_context``), but a worker forked from a fork server started at
    decoration inherits the thread state of that moment, and one decorated inside
    ``torch.autocast`` compiled every piece with autocast's casts (its bf16 outputs then failed the
    KV-cache write, or ran at the lower precision)."""
    _set_flags(settings["flags"])
    threads = settings.get("threads")
    if threads and torch.get_num_threads() != threads:  # no parallel region runs in a worker: none starts
        torch.set_num_threads(threads)
    for device_type in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device_type):
                torch.set_autocast_enabled(device_type, False)
        except (RuntimeError, TypeError):  # no such device type in this build
            continue
    modules = _config_modules()
    with contextlib.ExitStack() as stack:
        for name, changes in settings["configs"].items():
            # The settings name the compiling process's changes only: an entry it has at its
            # default (never set, or set back since the fork server was forked from it) is absent,
            # and a worker that inherited it set would compile with a config the compiling
            # process no longer has.
            changes = {**config_resets(modules[name], changes), **changes}
            if name == "torch._inductor.config":
                changes = {**changes, **_WORKER_INDUCTOR}
            if changes:
                stack.enter_context(modules[name].patch(changes))
        stack.enter_context(torch.no_grad())
        yield


def artifact_source(artifact) -> str | None:
    """The Python module Inductor generated for a compiled piece (its kernels' source included),
    or None if this torch's artifact does not expose it."""
    inner = getattr(artifact, "inner_fn", None)
    fn = getattr(inner, "compiled_fn", None) if inner is not None else None
    module = sys.modules.get(getattr(getattr(fn, "current_callable", None), "__module__", None) or "")
    path = getattr(module, "__file__", None)
    if path is None:
        return None
    with open(path) as f:
        return f.read()


def artifact_bytes(artifact) -> bytes:
    """A piece compiled with ``standalone_compile(..., aot=True)`` as bytes."""
    return artifact.serialize()


def artifact_from_bytes(data: bytes):
    return resolve("torch._inductor.standalone_compile.AOTCompiledArtifact").deserialize(data)


def artifact_callable(artifact):
    """The innermost callable of a compiled piece: the artifact's ``__call__`` adds two Python
    frames per call (AOTCompiledArtifact -> BundledAOTAutogradSerializableCallable -> the
    compiled function), paid per piece per step."""
    inner = getattr(artifact, "inner_fn", None)
    fn = getattr(inner, "compiled_fn", None) if inner is not None else None
    return fn if callable(fn) else artifact


def inductor_triton_cache_dir(device_index: int) -> str | None:
    """The Triton cache directory Inductor sets ``TRITON_CACHE_DIR`` to, when it is unset, the first
    time it builds a Triton kernel (``torch._inductor.runtime.cache_dir_utils.triton_cache_dir``,
    torch 2.11-2.13); None if this torch has no such function."""
    try:
        return resolve("torch._inductor.runtime.cache_dir_utils.triton_cache_dir")(device_index)
    except (ImportError, AttributeError):
        return None


def inductor_default_cache_dir() -> str | None:
    """The directory Inductor sets ``TORCHINDUCTOR_CACHE_DIR`` to, when it is unset, at its first
    cache access in any process (``torch._inductor.runtime.cache_dir_utils.cache_dir``, torch
    2.11-2.13: the absolute default); None if this torch has no such function."""
    try:
        return os.path.abspath(resolve("torch._inductor.runtime.cache_dir_utils.default_cache_dir")())
    except (ImportError, AttributeError, OSError):
        return None


def forget_inductor_compile_pools() -> None:
    """In a fork's child: Inductor's thread pool and the kernel builds in flight at the fork are
    the parent's (its ``after_fork`` resets the process pool only). A compile or cache load in the
    child that reused them waited for good on a future no thread would finish (seen: a forked
    child's landing loading a CPU piece whose build the parent had in flight). Clears the thread
    pool's cache and the C++ code caches, whose entries for in-flight builds hold such futures;
    finished entries are loaded again from disk. Touches only what is already imported."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    pool = getattr(getattr(async_compile, "AsyncCompile", None), "pool", None)
    if hasattr(pool, "cache_clear"):
        pool.cache_clear()
    codecache = sys.modules.get("torch._inductor.codecache")
    for name in ("CppCodeCache", "CppPythonBindingsCodeCache", "CppWrapperCodeCache"):
        cache = getattr(getattr(codecache, name, None), "cache", None)
        if isinstance(cache, dict):
            cache.clear()


def source_is_call_argument(source: Any) -> bool:
    """Whether a graph input's Dynamo source is the compiled call's own argument or an item of
    one (``L['input_ids']``, ``L['args'][0]``), not read through an attribute on the way
    (``L['self']._buffers['scale']``): walks ``base`` to the first local or attribute source."""
    attr = resolve("torch._dynamo.source.AttrSource")
    local = resolve("torch._dynamo.source.LocalSource")
    while source is not None and not isinstance(source, (attr, local)):
        source = getattr(source, "base", None)
    return isinstance(source, local)


def switches_inference_mode(target: Any) -> bool:
    """Whether a graph's call of ``target`` enters or leaves ``torch.inference_mode()``, as Dynamo
    records it: state for the nodes that follow, which FX's ``is_impure`` does not see (its list
    has ``torch._C._set_grad_enabled``, not these)."""
    return (target is resolve("torch.autograd.grad_mode._enter_inference_mode")
            or target is resolve("torch.autograd.grad_mode._exit_inference_mode"))


def import_inductor() -> None:
    """Import what the first compiled-artifact load needs (seconds, once per process)."""
    resolve("torch._inductor.compile_fx")


def mark_dynamic(tensor, dims) -> None:
    resolve("torch._dynamo.mark_dynamic")(tensor, dims)


def lookup_backend(name: str):
    return resolve("torch._dynamo.lookup_backend")(name)


def aot_eager(gm, example_inputs):
    """``aot_eager`` on one piece. ``aot_compile`` (the decorator's trace) turns AOTAutograd's
    bundled cache on around the backend, and on torch 2.11 an AOTAutograd compile inside it then
    builds a cache entry for aot_eager's plain-function output and fails ("expected OutputCode";
    2.13 skips the entry). Such a piece is never saved, so the forced cache is switched off here."""
    with resolve("torch._functorch.config").patch(force_autograd_cache=False, bundled_autograd_cache=False):
        return resolve("torch._dynamo.backends.debugging.aot_eager")(gm, example_inputs)


def standalone_compile(gm, example_inputs, dynamic_shapes: str, config_patches: dict):
    """Inductor on one FX graph: ``dynamic_shapes`` is "from_tracing_context" (the shapes Dynamo
    traced, symbols included) or "from_example_inputs" (every size as given); ``config_patches``:
    Inductor config settings for this compile (``standalone_compile``'s ``options`` are
    ``compile_fx``'s keyword arguments, of which ``config_patches`` is one). ``aot=True``: a
    self-contained artifact with a bytes form (``artifact_bytes``), which the default
    (``CacheCompiledArtifact``, file only, loads through the on-disk Inductor cache) lacks."""
    return resolve("torch._inductor.standalone_compile")(gm, example_inputs, dynamic_shapes=dynamic_shapes,
                                                         options={"config_patches": config_patches}, aot=True)


def inductor_config_value(name: str):
    """The current value of an Inductor config setting (``torch._inductor.config.<name>``)."""
    return getattr(resolve("torch._inductor.config"), name)


def custom_graph_pass_base() -> type:
    """Inductor's base class of a ``post_grad_custom_*_pass`` (its ``uuid`` keys the caches)."""
    return resolve("torch._inductor.custom_graph_pass.CustomGraphPass")


def files_hash(paths: tuple[str, ...]) -> bytes:
    """Inductor's hash of source files, the usual ``uuid`` of a custom graph pass."""
    return resolve("torch._inductor.custom_graph_pass.get_hash_for_files")(paths)


def statically_known_true(expr) -> bool:
    """True only if ``expr`` (a bool, or a SymBool over symbolic sizes) holds without a guard."""
    return resolve("torch.fx.experimental.symbolic_shapes.statically_known_true")(expr)


def unbacked_sizes(value) -> bool:
    """Whether a traced tensor's shape, strides or offset hold a data-dependent (unbacked) symbol:
    one ``torch._dynamo.mark_unbacked`` made, which has no example value."""
    if not isinstance(value, torch.Tensor):
        return False
    find = resolve("torch.fx.experimental.symbolic_shapes.free_unbacked_symbols")
    return any(find(n) for n in (*value.shape, *value.stride(), value.storage_offset()) if isinstance(n, torch.SymInt))


def detect_fake_mode(example_inputs):
    return resolve("torch._guards.detect_fake_mode")(example_inputs)


def unset_fake_temporarily():
    return resolve("torch._subclasses.fake_tensor.unset_fake_temporarily")()


def static_fake_mode():
    """A FakeTensorMode without a ShapeEnv: tensors made in it have plain int sizes."""
    return resolve("torch._subclasses.fake_tensor.FakeTensorMode")()



def op_names(target) -> tuple[str, ...]:
    """Names a call_function target answers to: ("ns::op",) for a packet, plus "ns::op.overload"."""
    if isinstance(target, resolve("torch._ops.OpOverloadPacket")):
        return (target._qualified_op_name,)
    if isinstance(target, resolve("torch._ops.OpOverload")):
        packet = target.overloadpacket._qualified_op_name
        return (packet, f"{packet}.{target._overloadname}")
    return ()


def op_schemas(target) -> list:
    """The schemas of an op target (every overload of a packet)."""
    if isinstance(target, resolve("torch._ops.OpOverloadPacket")):
        return [getattr(target, name)._schema for name in target.overloads()]
    if isinstance(target, resolve("torch._ops.OpOverload")):
        return [target._schema]
    return []


def storage_key(t: torch.Tensor):
    """A hashable key equal for tensors that share storage (fake tensors too: a traced view shares
    its base's fake storage), or None where the tensor has none (a wrapper subclass)."""
    try:
        return resolve("torch.multiprocessing.reductions.StorageWeakRef")(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def size_hint(n) -> int:
    """A traced size as an int: a SymInt's value at the trace's example (its hint)."""
    if isinstance(n, torch.SymInt):
        hint = getattr(n.node, "hint", None)
        return int(hint) if hint is not None else int(n.node.expr.xreplace(size_hints(n.node.shape_env)))
    return int(n)


def input_name(node) -> str:
    """The user's name of a Dynamo graph input: its source (``L['x']``, ``L['self'].weight``) where
    the graph keeps it (not after ``aot_compile``), else its placeholder's (``L_x_``) as ``x``."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)  # a method on torch 2.11, a cached property on 2.13
    name = name() if callable(name) else name
    if isinstance(name, str):
        return name
    target = str(node.target)
    return target[2:-1] if target.startswith("L_") and target.endswith("_") else target


def call_schema(target):
    """The schema of the overload a call of ``target`` runs (a packet's ``default``), or None for a
    target that is not an op or a packet without a ``default`` (``torch.ops.aten.add_``: its
    overloads are ``Tensor`` and ``Scalar``, picked by the arguments). Dynamo records packets, AOT
    graphs record overloads."""
    if isinstance(target, resolve("torch._ops.OpOverloadPacket")):
        target = getattr(target, "default", None)
    return target._schema if isinstance(target, resolve("torch._ops.OpOverload")) else None


def below_autograd_guard() -> type:
    """The guard class whose instances, used as context managers, dispatch below Autograd."""
    return resolve("torch._C._AutoDispatchBelowAutograd")


def symbolic_size_value(size, symbol, value: int) -> int:
    """``size`` (an int or a SymInt) with ``symbol`` set to ``value`` and other symbols at their hints."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    import sympy

    expr = sympy.sympify(size.node.expr)
    hints = size_hints(size.node.shape_env)
    values = {s: sympy.Integer(value if s == symbol else hints[s]) for s in expr.free_symbols}
    return int(expr.xreplace(values))


def symbol_of(size):
    """The sympy expression of a SymInt size."""
    return size.node.expr


def distributed_world_size() -> int:
    """Ranks in the default process group (1 without torch.distributed or before its init)."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def compile_region():
    """``torch.compiler.nested_compile_region`` where Dynamo traces a region once and reuses the
    trace, else None. Both torch behaviours keep each call's constants: 2.13 reuses the subgraph
    for a later call only if every guard of the first trace holds for it (``max_reuse_entries``
    variants, then it raises); 2.11 traces every call and keeps one subgraph per distinct graph,
    which saves little or nothing (on the H200 host: a 32-layer tiny Llama's trace 4.8 s against
    5.9 s flat; the Llama-3-8B shape's Dynamo time 8.1 s against 6.0 s, one run each), where 2.13
    traced it in 0.9 s against 3.3 s flat on the CPU box (``benchmarks/region_trace.py``)."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None or "max_reuse_entries" not in inspect.signature(region).parameters:
        return None
    return region
