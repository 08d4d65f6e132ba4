"""``@compileattn.compile``: compile a forward once, then call Dynamo's code without its guards.

A ``torch.compile``'d function evaluates Dynamo's guards on every call: for a model forward, one
check per parameter and module attribute the trace read, every step. In an LLM serving loop the
only things that change between steps are the arguments, so this decorator checks exactly those
itself (``argcheck.py``: dtype, device, ndim, static sizes, non-tensor values, grad mode) and jumps
straight into the code Dynamo generated. A change that would have made Dynamo recompile raises
``RecompileError`` naming the argument instead: recompiling mid-serving costs seconds and, with
CUDA graphs, memory, so it must be loud.

The first call of a site (the function, or one module instance's forward) gets its code one of
three ways:

1. **warm start** (``warm_start.py``): with ``config.cache_dir`` and the default backend, a file a
   previous process saved under this call's key: no Dynamo, no compile.
2. **ahead-of-time trace**: ``torch.compile(fn, fullgraph=True, dynamic=False, options=
   {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}).aot_compile((args, kwargs))`` (the
   module instance is the first argument of the unbound forward). Dynamo traces once, installs
   nothing on ``fn``'s code and returns its transformed code as a plain function, which later
   calls run directly; with a cache dir it is saved for the next process.
3. **frame path**, when (2) is unavailable: a debug dump (depyf sees Dynamo's code only through
   frame evaluation), a torch without ``aot_compile``, or a trace ``aot_compile`` rejects (e.g.
   code without a source file). ``torch.compile`` of a copy of ``fn`` (its own code object, so its
   own Dynamo cache entry, which no other instance's call can hit) with every guard skipped,
   called under ``torch.compiler.set_stance("fail_on_recompile")``: no guard can fail, and if
   Dynamo's cache is reset a call raises instead of silently tracing again. Costs more per call
   than (1)/(2) (torch.compile's frame-evaluation machinery); logged at INFO with the reason.

Before (2) or (3), the first call starts compiling the Triton attention kernels its first step
will launch, in other processes (``kernel_warmup.py``, ``config.compile_kernels_ahead``); a warm
start finds them in Triton's disk cache, where the cold run left them.

What the trace and the compile assumed of the dynamic sizes (a branch on a size, Inductor's 32-bit
indexing below a size, the strides of a non-contiguous argument) is read from Dynamo's ShapeEnv
after the compile and checked per call with the arguments (``size_guards.py``, ``argcheck.py``;
saved with a warm start): a call past it raises ``RecompileError``, where Dynamo would have
recompiled.

Limits, because guards are skipped: everything that is not an argument is frozen at the first
call: Python globals and non-parameter module attributes the forward reads; shapes, dtypes and
devices of parameters and buffers (their *values* are read at each call, so in-place weight
updates show, and so does a parameter replaced by one of the same shape, dtype and device: its
CUDA graphs are captured again, ``dispatch.py``); a model converted or moved after its first call
(``.half()``, ``.to(device)``) raises ``RecompileError`` naming a tensor (``model_tensors.py``:
watched at two tensors per model, so convert a part of a model before the first call);
autocast, torch function modes and global flags other than grad mode. Objects other than tensors,
numpy arrays, functions, scalars, strings, dtypes/devices and tuples/lists/dicts of those are checked
for type only (a bound method or ``functools.partial`` too). Dynamic
dims need size >= 2 on the first call (Dynamo specializes sizes 0 and 1; a size-1 first call is
refused rather than compiled static); later calls may use any size, including 1 (so a forward must
not branch on a dynamic size being > 1: Dynamo decides that without a guard, ``size_guards.py``).

Full-decode steps (``cudagraph_mode="full_and_piecewise"``) skip Dynamo's code too, once a size's
graph has been replayed through it: the site replays the graph itself where that provably returns
what Dynamo's code would (``replay.py``; ``compile_stats["direct_replay"]`` says "on" or why not,
``config.direct_full_replay=False`` turns it off). On the OPT-125m shape that cut a step's host
Python from ~9.8 to ~2.0 µs on the CPU box below (``benchmarks/host_step.py``).

Cost, measured on this repo's 2-core CPU box with a backend whose compiled function does nothing
(``benchmarks/dispatch_overhead.py``, ``results/dispatch_overhead_cpu.md``): a decorated call of a
32-layer Llama-shaped model ~17 µs, of which the argument check ~0.8 µs and Dynamo's generated code
(which gathers every parameter as a graph input) ~15 µs; earlier on the same box, a small module
under a guarded ``torch.compile`` took 77-135 µs against 25-40 µs decorated.
"""
from __future__ import annotations

import atexit
import functools
import inspect
import logging
import os
import threading
import time
import types
import typing
import weakref
from typing import Any, Callable, Mapping

import torch

from .. import _torch_compat
from ..config import CompileConfig
from . import compile_pool, kernel_warmup, regions, warm_start
from .argcheck import ArgChecker, RecompileError, all_arguments, overlapping_tensors, spec_of, tensor_places
from .model_tensors import ModelTensors
from .reach import (closure_values, global_modules, held_elsewhere, model_bindings, modules_in, other_tensors,
                    tensors_reached)
from .replay import MISS, FullStepShortcut, graph_call_of
from .size_guards import SizeGuards, UncheckableGuard

log = logging.getLogger("compileattn")

#: Set to 1 to run every ``@compileattn.compile`` function eagerly (read at each site's first call).
DISABLE_ENV = "COMPILEATTN_DISABLE"
_ENV_TRUE = ("1", "true", "yes", "on")
_ENV_FALSE = ("", "0", "false", "no", "off")


def _env_disables() -> bool:
    """``COMPILEATTN_DISABLE`` as a switch: 1/true/yes/on disable, 0/false/no/off (or unset) do
    not, any case. Anything else raises naming it: read as "set means disabled", "false" would
    quietly run the model eagerly."""
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    if value in _ENV_TRUE:
        return True
    if value in _ENV_FALSE:
        return False
    raise ValueError(f"{DISABLE_ENV}={os.environ[DISABLE_ENV]!r}: expected 1/true/yes/on to disable compilation "
                     f"or 0/false/no/off not to")


#: At most this long, a process that ends while static pieces still compile in the background waits
#: for them to save its warm start file (only with ``cache_dir``).
EXIT_WAIT_FOR_STATIC_S = 120.0
#: ``atexit``'s register/unregister (tests run the registered wait themselves).
_at_exit = atexit

_is_compiling = torch.compiler.is_compiling

__all__ = ["CompiledFunction", "RecompileError", "compile"]


# ----------------------------------------------------------------------------------------------
# Dynamic dims


def _is_tensor_annotation(ann: Any) -> bool:
    if ann is torch.Tensor:
        return True
    if isinstance(ann, str):
        ann = ann.replace(" ", "")
        return ann in {"torch.Tensor", "Tensor", "torch.Tensor|None", "Tensor|None", "Optional[torch.Tensor]",
                       "Optional[Tensor]", "None|torch.Tensor"}
    args = typing.get_args(ann)
    return bool(args) and torch.Tensor in args and all(a in (torch.Tensor, type(None)) for a in args)


def _normalize_dynamic_arg_dims(dims: Mapping[str, Any] | None, fn: Callable, sig: inspect.Signature,
                                skip_first: bool) -> dict[str, tuple[int, ...]]:
    params = list(sig.parameters)[1 if skip_first else 0:]
    if dims is None:
        # vLLM's convention: every argument annotated as a Tensor has its token dim (0) dynamic.
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # noqa: BLE001 (unresolvable forward references: fall back to the strings)
            hints = {n: p.annotation for n, p in sig.parameters.items()}
        inferred = {n: (0,) for n in params if _is_tensor_annotation(hints.get(n))}
        if not inferred:
            raise ValueError(
                f"dynamic_arg_dims: none given and no argument of {fn.__qualname__} is annotated as "
                f"torch.Tensor; pass e.g. dynamic_arg_dims={{'input_ids': 0}}"
            )
        return inferred
    if not isinstance(dims, Mapping):
        raise TypeError(f"dynamic_arg_dims must be a dict of argument name -> dim(s), got {type(dims).__name__}")
    out = {}
    for name, d in dims.items():
        if name not in params:
            raise ValueError(f"dynamic_arg_dims: {fn.__qualname__} has no argument {name!r}; it has {params}")
        if sig.parameters[name].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise ValueError(f"dynamic_arg_dims: {name!r} collects {fn.__qualname__}'s extra arguments; name a "
                             f"parameter of its own (its dims are marked dynamic on the tensor passed there)")
        ds = (d,) if isinstance(d, int) else tuple(d) if isinstance(d, (list, tuple)) else None
        if ds is None or not ds or any(not isinstance(x, int) or isinstance(x, bool) for x in ds):
            raise TypeError(f"dynamic_arg_dims[{name!r}] must be an int or a non-empty list of ints, got {d!r}")
        out[name] = ds
    return out


def _mark_dynamic(values: Mapping[str, Any], dims: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Resolve negative dims against the first call's tensors and mark them dynamic."""
    resolved = {}
    for name, ds in dims.items():
        t = values.get(name)
        if t is None:
            continue  # optional tensor not passed: nothing to mark (its spec records the None)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"dynamic_arg_dims names {name!r}, but it is a {type(t).__name__}, not a Tensor")
        norm = []
        for d in ds:
            if not -t.dim() <= d < t.dim():
                raise ValueError(f"dynamic_arg_dims[{name!r}]: dim {d} out of range for shape {tuple(t.shape)}")
            d %= t.dim()
            if t.shape[d] < 2:
                raise ValueError(
                    f"dynamic_arg_dims[{name!r}]: dim {d} has size {t.shape[d]} on the first call; Dynamo "
                    f"specializes sizes 0 and 1, so the compiled code would only be valid for that size. "
                    f"Make the first call (the compile) with size >= 2; later calls may use any size."
                )
            norm.append(d)
        _torch_compat.mark_dynamic(t, norm)
        resolved[name] = tuple(sorted(set(norm)))
    return resolved


# ----------------------------------------------------------------------------------------------
# One compile site: the function itself, or one instance's bound method.


class _UnsavedCallable(_torch_compat.serializable_callable_base()):
    """A backend result that is not a ``SerializableCallable`` (a test's or a debugging backend's
    function), wrapped so ``aot_compile`` accepts it; it cannot be saved."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    @classmethod
    def serialize_compile_artifacts(cls, fn):
        raise TypeError(f"the backend returned {type(fn.fn).__name__}, which cannot be saved")

    @classmethod
    def deserialize_compile_artifacts(cls, data):
        raise TypeError("nothing of this kind is ever saved")


class _TimedBackend:
    """The backend, timed, remembering what it returned (the compileattn backend's dispatchers)."""

    def __init__(self, backend: Callable, wrap: bool):
        self.backend = backend
        self.wrap = wrap  # for aot_compile: make every result a SerializableCallable
        self.seconds = 0.0
        self.results: list = []
        self.failed = False
        #: Dynamo's ShapeEnv around the latest backend call: after the compile, its guards are what
        #: the trace and the compile assumed of the dynamic sizes (``size_guards.py``)
        self.shape_env = None

    def __call__(self, gm, example_inputs):
        self.shape_env = _torch_compat.tracing_shape_env()  # the last trace's (a failed one is traced again)
        start = time.perf_counter()
        try:
            out = self.backend(gm, example_inputs)
        except BaseException:
            self.failed = True
            raise
        finally:
            self.seconds += time.perf_counter() - start
        self.results.append(out)
        if self.wrap and not isinstance(out, _torch_compat.serializable_callable_base()):
            return _UnsavedCallable(out)
        return out

    def dispatchers(self) -> list:
        from .dispatch import StepDispatcher

        found = [getattr(r, "__self__", r) for r in self.results]
        return [d for d in found if isinstance(d, StepDispatcher)]

    def static_seconds(self) -> float:
        return sum(d.compiled.static_seconds for d in self.dispatchers())


class _Site:
    """Compiled state for one function or one module instance. ``fast`` is None until compiled."""

    __slots__ = ("owner", "bound", "fast", "checker", "tensors", "stats", "runtimes", "bound_call", "direct",
                 "refused")

    def __init__(self, owner: "CompiledFunction", bound: bool):
        self.owner = owner
        self.bound = bound  # calls carry the instance as first argument, excluded from the checks
        self.fast: Callable | None = None
        self.checker: ArgChecker | None = None
        #: the models' parameters and buffers as the first call found them (``model_tensors.py``)
        self.tensors: ModelTensors | None = None
        self.stats: dict[str, Any] = {}
        self.runtimes: list = []  # the compileattn backend's StepDispatchers, compiled or loaded
        self.bound_call: BoundCompiledFunction | None = None
        #: full-decode steps replayed without Dynamo's code (``replay.py``); None where not provably the same
        self.direct: FullStepShortcut | None = None
        #: why the compile was refused (its size guards cannot be checked per call): later calls raise
        #: it again at once instead of tracing and compiling again
        self.refused: UncheckableGuard | None = None

    def call(self, full_args: tuple, args: tuple, kwargs: dict):
        fast = self.fast
        if fast is None:
            with self.owner._lock:
                if self.refused is not None:
                    raise UncheckableGuard(str(self.refused))
                if self.fast is None:
                    return self._compile(full_args, args, kwargs)
                fast = self.fast
        if self.tensors is not None:  # first: the argument check reads its storages (``ModelTensors.storages``)
            self.tensors.check()
        if self.checker is not None:
            self.checker.check(args, kwargs)
        direct = self.direct
        if direct is not None:
            out = direct.step(args, kwargs)
            if out is not MISS:
                return out
            return direct.run(fast, full_args, args, kwargs)
        return fast(*full_args, **kwargs)

    def _compile(self, full_args: tuple, args: tuple, kwargs: dict):
        owner = self.owner
        fn, config = owner._fn, owner._config
        what = f"{type(full_args[0]).__qualname__}.{fn.__name__}" if self.bound else fn.__qualname__
        if owner._disabled():
            log.info("compileattn: compile of %s disabled (%s=1 or config.disable); running eagerly",
                     what, DISABLE_ENV)
            self.fast = fn
            return fn(*full_args, **kwargs)

        values = all_arguments(owner._sig, self.bound, args, kwargs, what)
        dynamic = _mark_dynamic(values, owner._dynamic_arg_dims)
        instance = full_args[:1 if self.bound else 0]
        models = list(modules_in((*instance, *values.values(), *closure_values(fn), *global_modules(fn))))
        reached = list(tensors_reached(models, fn, instance))
        self.tensors = ModelTensors(models, model_bindings(fn, instance), other_tensors(reached))
        places = tensor_places(values)
        checker = ArgChecker(owner._sig, self.bound, {name: spec_of(v, dynamic.get(name, ()))
                                                      for name, v in values.items()}, torch.is_grad_enabled(),
                             places, overlapping_tensors(values, places), held_elsewhere(values, places, reached),
                             self.tensors.storages, self.tensors.others, name=what)
        start = time.perf_counter()
        kernel_warmup.settle_cache_dir()
        path = None
        if owner._backend is not None and config.cache_dir is not None:
            log.info("compileattn: %s uses backend %r: no warm start (only the default backend's compile is "
                     "saved, the cache key cannot describe another)", what, owner._backend)
        elif config.cache_dir is not None:
            try:
                key = warm_start.key_of(fn, config, dynamic, checker.key(), (*instance, *values.values()))
                path = warm_start.path_of(config, key, fn)
            except warm_start.Undescribable as exc:
                log.info("compileattn: %s: no warm start: the cache key cannot describe %s", what, exc)
                path = None
            except NotADirectoryError as exc:  # a file where warm_start/ belongs: compile, save nothing
                log.warning("compileattn: %s: no warm start (%s)", what, exc)
                path = None
            loaded = warm_start.load(path, fn, config, what, full_args, kwargs) if path is not None else None
            if loaded is not None:
                checker.assume_sizes(loaded.size_guards)
                try:  # the key leaves the dynamic sizes out: the saved compile may assume others
                    checker.check_before_loaded_call(args, kwargs)
                except RecompileError as exc:
                    log.info("compileattn: %s: the warm start file's compile does not serve this first call (%s); "
                             "compiling", what, exc)
                    loaded = None
            if loaded is not None:
                compile_pool.drop_early_fork_server(owner)
                self.runtimes = loaded.dispatchers
                stats = {"path": "warm", "load_s": loaded.seconds, "import_wait_s": loaded.import_wait,
                         "regions": "off: warm start (no trace)"}
                return self._first_call(what, loaded.function, checker, stats, start, full_args, kwargs)

        if config.compile_kernels_ahead:
            kernel_warmup.start()  # not before a warm start: the cold run left them in Triton's disk cache
            # (never raises: an optimisation)
        if owner._backend is None:
            _prestart_static_compiles(config, values)
        try:
            return self._compile_cold(fn, config, what, checker, dynamic, start, path, full_args, kwargs)
        finally:
            compile_pool.release()  # the backend releases it; this covers a trace that never reached it
            compile_pool.drop_early_fork_server(owner)  # no pool took it: this compile wanted no workers

    def _compile_cold(self, fn: Callable, config: CompileConfig, what: str, checker: ArgChecker,
                      dynamic: dict[str, tuple[int, ...]], start: float, path, full_args: tuple, kwargs: dict):
        owner = self.owner
        backend = _resolve_backend(owner._backend, config)
        reason = None
        if config.debug_dump_dir is not None:
            reason = "debug_dump_dir is set (depyf sees Dynamo's code only through frame evaluation)"
        elif _torch_compat.serializable_callable_base() is object:
            reason = f"torch {torch.__version__} has no SerializableCallable"
        if reason is None:
            timed = _TimedBackend(backend, wrap=True)
            import_wait = warm_start.wait_for_inductor()
            baked: list = []
            try:
                aot_fn, traced_regions = self._trace_ahead(fn, config, what, full_args, kwargs, timed, baked)
            except Exception as exc:
                for d in timed.dispatchers():
                    d.abandon_static_compiles()  # its compile is discarded
                if timed.failed:
                    raise  # the backend itself failed: the frame path would only fail again
                reason = f"aot_compile failed ({_first_line(exc)})"
            else:
                size_guards = self._size_guards(timed, dynamic, checker)
                checker.assume_sizes(size_guards)
                stats = self._compile_stats(timed, path="cold")
                stats["import_wait_s"] = import_wait
                stats["regions"] = traced_regions
                self.runtimes = timed.dispatchers()
                values = (warm_start.baked_values(baked, aot_fn, fn, full_args, kwargs, what)
                          if path is not None and self.runtimes else None)
                save = ((lambda: warm_start.save(path, aot_fn, size_guards, values, what))
                        if values is not None else None)
                late = [d for d in self.runtimes if d.pending_static_compiles()]
                if late:
                    stats["static_pending"] = sum(d.pending_static_compiles() for d in late)
                    _when_all_settled(late, start, stats, save)
                elif save is not None:
                    saved = save()
                    if saved is not None:
                        stats["save_s"] = saved
                return self._first_call(what, _torch_compat.aot_function(aot_fn), checker, stats, start, full_args,
                                        kwargs)
        log.info("compileattn: compiling %s through torch.compile's frame evaluation: %s", what, reason)
        return self._compile_frame(fn, backend, checker, dynamic, start, what, full_args, kwargs)

    def _trace_ahead(self, fn: Callable, config: CompileConfig, what: str, full_args: tuple, kwargs: dict,
                     timed: "_TimedBackend", baked: list):
        """``aot_compile`` with the module's decoder layers traced once (``regions.py``; only for
        the default backend, which flattens them again) -> (AOTCompiledFunction, what regions did).
        A trace that fails because of its regions (``regions.region_failure``: more layer variants
        than torch keeps, a layer Dynamo cannot capture as a region, a graph the backend cannot
        flatten) is traced again flat; any other error is raised after the one trace. ``baked``
        receives the value guards of the trace returned (``_torch_compat.aot_compile``)."""
        def trace():
            return _torch_compat.aot_compile(fn, full_args, kwargs, timed, baked)

        if not config.trace_layers_once:
            return trace(), "off: config.trace_layers_once is False"
        if self.owner._backend is not None:
            return trace(), "off: not the compileattn backend"
        with regions.layers_as_regions(full_args[0] if self.bound else None) as state:
            try:
                return trace(), state
            except Exception as exc:
                culprit = regions.region_failure(exc) if state.startswith("on") else None
                if culprit is None:
                    raise
                why = _first_line(culprit)
        log.info("compileattn: tracing %s with its layers as regions failed (%s); tracing it flat", what, why)
        timed.failed = False
        return trace(), f"off: {why}"

    @staticmethod
    def _compile_stats(timed: _TimedBackend, path: str) -> dict[str, Any]:
        stats = {"path": path, "backend_s": timed.seconds}
        if timed.dispatchers():
            stats["static_s"] = timed.static_seconds()
        return stats

    @staticmethod
    def _total(stats: dict[str, Any], start: float) -> None:
        """``total_s`` since ``start``; on a compile, ``dynamo_s`` is what the backend and saving
        did not take (Dynamo's trace, plus the cache-key work)."""
        stats["total_s"] = time.perf_counter() - start
        if "backend_s" in stats:
            stats["dynamo_s"] = (stats["total_s"] - stats["backend_s"] - stats.get("save_s", 0.0)
                                 - stats.get("import_wait_s", 0.0))

    def _first_call(self, what: str, fast: Callable, checker: ArgChecker, stats: dict[str, Any], start: float,
                    full_args: tuple, kwargs: dict):
        """Install ``fast`` and run the first call through it (timed: it includes the first-call
        work of the compiled code, e.g. CUDA-graph capture)."""
        self._total(stats, start)
        self.direct, stats["direct_replay"] = self._shortcut(fast, checker)
        self.checker, self.stats, self.fast = checker, stats, fast
        _log_ready(what, stats)
        t = time.perf_counter()
        with checker.noting_writes(full_args[1:] if self.bound else full_args, kwargs):
            out = fast(*full_args, **kwargs)
        stats["first_call_s"] = time.perf_counter() - t
        return out

    def _shortcut(self, fast: Callable, checker: ArgChecker) -> tuple[FullStepShortcut | None, str]:
        """Full-decode steps skip Dynamo's code where that provably changes nothing (``replay.py``):
        (the shortcut or None, "on" or why not)."""
        runtimes = self.runtimes
        if not self.owner._config.direct_full_replay:
            return None, "off (config.direct_full_replay)"
        if len(runtimes) != 1 or runtimes[0].mode != "full_and_piecewise":
            return None, "no full-decode graphs"
        if any(isinstance(p.default, torch.Tensor) for p in self.owner._sig.parameters.values()):
            return None, "a parameter defaults to a tensor (not checkable per call)"
        graph, why = graph_call_of(fast)
        if graph is None:
            return None, why
        graph = getattr(graph, "fn", graph)  # _UnsavedCallable wraps a test's backend result
        if getattr(graph, "__self__", graph) is not runtimes[0]:  # or a bound __call__
            return None, "Dynamo's code calls something other than the compileattn dispatcher"
        return FullStepShortcut(runtimes[0], checker.other_tensors,
                                self.tensors.buffers if self.tensors is not None else tuple), "on"

    def _size_guards(self, timed: _TimedBackend, dynamic: dict[str, tuple[int, ...]],
                     checker: ArgChecker) -> SizeGuards:
        """The compile's size guards (over the dynamic dims, and the strides of the arguments whose
        layout the argument check leaves partly free); one the decorator cannot check per call
        refuses the compile for good (its static compiles are stopped): a later call would trace,
        compile and fail alike."""
        try:
            return SizeGuards.from_shape_env(timed.shape_env, dynamic, checker.strided())
        except UncheckableGuard as exc:
            for d in timed.dispatchers():
                d.abandon_static_compiles()
            self.refused = UncheckableGuard(f"{exc}. torch.compile(backend='compileattn') checks its guards "
                                            f"itself and recompiles instead")
            raise self.refused from None

    def _compile_frame(self, fn: Callable, backend: Callable, checker: ArgChecker, dynamic: dict[str, tuple[int, ...]],
                       start: float, what: str, full_args: tuple, kwargs: dict):
        from . import debug

        timed = _TimedBackend(backend, wrap=False)
        compiled = torch.compile(_function_with_code(fn, fn.__code__.replace()), fullgraph=True, dynamic=False,
                                 backend=timed, options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
        with checker.noting_writes(full_args[1:] if self.bound else full_args, kwargs), \
                debug.dump_context(self.owner._config):
            out = compiled(*full_args, **kwargs)
        if not timed.results:
            # Dynamo did not compile the frame (disabled globally, e.g. TORCHDYNAMO_DISABLE=1).
            log.warning("compileattn: Dynamo produced no code for %s; it runs eagerly", what)
        # The frame path runs the first call inside the compile: it is part of dynamo_s here.
        self.stats = self._compile_stats(timed, path="frame")
        self.stats["direct_replay"] = "off (frame path: Dynamo's code runs under torch.compile's frame evaluation)"
        self.stats["regions"] = "off: frame path"
        self._total(self.stats, start)
        _log_ready(what, self.stats)
        checker.assume_sizes(self._size_guards(timed, dynamic, checker))
        self.runtimes = timed.dispatchers()
        self.checker = checker
        self.fast = torch.compiler.set_stance("fail_on_recompile")(compiled)
        return out


def _wait_for_static_pieces(runtimes: list, timeout: float | None) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    for runtime in runtimes:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not runtime.wait_for_static_pieces(left):
            return False
    return True


#: ``time.monotonic()`` when the process's exit began waiting for static pieces (None before).
_exit_wait_started: float | None = None


def _exit_wait_left() -> float:
    """Seconds the exit may still wait for static pieces: ``EXIT_WAIT_FOR_STATIC_S`` for the
    whole process, not per compiled function (each registers its own wait: two functions with
    pieces out waited twice as long). The clock starts at the first wait after the last compile
    registered one."""
    global _exit_wait_started
    now = time.monotonic()
    if _exit_wait_started is None:
        _exit_wait_started = now
    return max(0.0, EXIT_WAIT_FOR_STATIC_S - (now - _exit_wait_started))


def _when_all_settled(dispatchers: list, start: float, stats: dict[str, Any], save: Callable[[], Any] | None) -> None:
    """Once the static pieces still compiling in the background have all landed (or been given
    up), record when (``static_landed_s``, from the call's start) and save the warm start: a file
    saved before would hold only the dynamic-shape pieces, and a warm start has no workers to
    compile the rest. A process that ends first waits for them at exit (at most
    ``EXIT_WAIT_FOR_STATIC_S``) so that its warm start file is written: a short script would
    otherwise never leave one."""
    global _exit_wait_started
    left = [len(dispatchers)]

    def at_exit() -> None:
        pending = sum(d.pending_static_compiles() for d in dispatchers)
        bound = _exit_wait_left()
        log.warning("compileattn: waiting up to %.0f s at exit for %d static-shape compiles, to save the warm start",
                    bound, pending)
        _wait_for_static_pieces(dispatchers, bound)

    def settled() -> None:
        left[0] -= 1
        if left[0]:
            return
        stats["static_landed_s"] = time.perf_counter() - start
        if save is not None:
            _at_exit.unregister(at_exit)
            if any(d.static_incomplete for d in dispatchers):
                log.warning("compileattn: no warm start file saved: a static piece could not be compiled (logged "
                            "above), and a warm start would never compile it")
                return
            saved = save()
            if saved is not None:
                stats["late_save_s"] = saved

    if save is not None:
        _exit_wait_started = None  # a compile: the process is not exiting yet
        _at_exit.register(at_exit)
    for d in dispatchers:
        d.when_static_settled(settled)


def _prestart_static_compiles(config: CompileConfig, values: Mapping[str, Any]) -> None:
    """Start the compile workers before Dynamo traces, when the backend will want them
    (static sizes for the device of the call's tensors): their import overlaps the trace."""
    if config.piece_compiler != "inductor" or config.compile_workers_start == "after_dynamic":
        return
    device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)), None)
    if device is not None and config.resolved_compile_sizes(device.type):
        compile_pool.prestart(compile_pool.worker_count(config.compile_workers))


def _start_fork_server_early(fn: Callable, config: CompileConfig, owner: "CompiledFunction") -> None:
    """At decoration (``compile_workers_start`` "auto": if it can be a fork of this process;
    "decoration": in any case): start the compile workers' fork server where the first call will
    likely compile static pieces in workers: on a machine with a GPU (static sizes are for CUDA
    pieces unless given), with no warm start file of ``fn`` saved."""
    if config.piece_compiler != "inductor" or config.compile_workers_start not in ("auto", "decoration"):
        return
    device_type = "cuda" if torch.cuda.device_count() else "cpu"  # NVML where it can: no CUDA context
    if not config.resolved_compile_sizes(device_type) or warm_start.saved_for(config, fn):
        return
    compile_pool.start_fork_server_early(compile_pool.worker_count(config.compile_workers),
                                         only_forked=config.compile_workers_start == "auto", owner=owner)


def _log_ready(what: str, stats: dict[str, Any]) -> None:
    if stats["path"] == "warm":
        log.info("compileattn: loaded %s in %.2f s (warm start, no Dynamo); later calls skip Dynamo's guards",
                 what, stats["load_s"])
        return
    extra = "".join(f", {name} {stats[key]:.2f} s" for key, name in (("static_s", "of which static-shape pieces"),
                                                                       ("save_s", "saving")) if key in stats)
    log.info("compileattn: compiled %s in %.2f s (Dynamo %.2f s, backend %.2f s%s%s); later "
             "calls skip Dynamo's guards", what, stats["total_s"], stats["dynamo_s"], stats["backend_s"], extra,
             ", frame path: Dynamo's time includes the first run" if stats["path"] == "frame" else "")


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _function_with_code(fn: Callable, code: types.CodeType) -> types.FunctionType:
    new = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    return new


def _resolve_backend(backend: Callable | str | None, config: CompileConfig) -> Callable:
    if backend is None:
        from .backend import compileattn_backend

        return functools.partial(compileattn_backend, options={"config": config})
    if isinstance(backend, str):  # "eager", "aot_eager", "inductor": handy for bisecting a problem
        return _torch_compat.lookup_backend(backend)
    return backend


# ----------------------------------------------------------------------------------------------
# The public wrapper


class CompiledFunction:
    """What ``@compileattn.compile`` returns for a function (and installs as a class's ``forward``).

    A descriptor: looked up on an instance it gives that instance's ``BoundCompiledFunction``
    (each module instance gets its own compile, since the trace bakes in that instance's
    attributes), and so does ``Cls.forward(instance, x)``; a function called directly has one
    compile.
    """

    def __init__(self, fn: Callable, dynamic_arg_dims: Mapping[str, Any] | None, config: CompileConfig | None,
                 backend: Callable | str | None, method: bool | None = None):
        if not isinstance(fn, types.FunctionType):
            raise TypeError(f"compileattn.compile needs a Python function or nn.Module class, got {type(fn).__name__}")
        if config is not None and not isinstance(config, CompileConfig):
            raise TypeError(f"config must be a CompileConfig, got {type(config).__name__}")
        if backend is not None and not (callable(backend) or isinstance(backend, str)):
            raise TypeError(f"backend must be a torch.compile backend (name or callable), got {backend!r}")
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._sig = inspect.signature(fn)
        params = list(self._sig.parameters.values())
        if method is None:  # a function defined in a class body: bound when looked up on an instance
            method = bool(params) and params[0].name == "self" and "." in fn.__qualname__
        self._method = method
        self._dynamic_arg_dims = _normalize_dynamic_arg_dims(dynamic_arg_dims, fn, self._sig, method)
        self._config = config if config is not None else CompileConfig()
        self._backend = backend
        self._lock = threading.RLock()
        self._site = _Site(self, bound=False)
        self._sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last: BoundCompiledFunction | None = None
        if backend is None and not self._disabled():
            _start_fork_server_early(fn, self._config, self)  # first: a fork needs this process single-threaded
            if self._config.cache_dir is not None:
                warm_start.preload_inductor()

    @property
    def compile_stats(self) -> dict[str, Any]:
        """Where the first call's time went, in seconds; empty before it. ``path``: "warm" (loaded
        from the cache: ``load_s``), "cold" (``dynamo_s`` tracing, ``backend_s`` compileattn's passes
        and piece compiles, of which ``static_s`` what the static-shape ones added (``CompiledSplit.static_seconds``); ``save_s`` writing the warm
        start file) or "frame" (the frame path; its ``dynamo_s`` includes the first run);
        ``static_pending``: static compiles still running in the background when the first call
        began, ``static_landed_s`` when the last of them landed (from the call's start; the warm
        start file is saved then, ``late_save_s``);
        ``import_wait_s``: waiting for the background import of Inductor (warm: part of ``load_s``);
        ``total_s`` everything before the first run, ``first_call_s`` the first run itself (with
        any CUDA-graph capture). For a method, the most recently called instance's (``instance.forward.compile_stats``
        gives a given instance's)."""
        site = self._last._site if self._last is not None else self._site
        return dict(site.stats)

    @property
    def runtimes(self) -> list:
        """The ``StepDispatcher``s the compileattn backend built or loaded for the most recently called
        site (graphs, pool, capture time: what tests and benchmarks read)."""
        site = self._last._site if self._last is not None else self._site
        return list(site.runtimes)

    def wait_for_static_pieces(self, timeout: float | None = None) -> bool:
        """Block until the static-shape pieces still compiling in the background have landed
        (``CompileConfig.background_static_compiles``), installed now; False on timeout."""
        site = self._last._site if self._last is not None else self._site
        return _wait_for_static_pieces(site.runtimes, timeout)

    def _disabled(self) -> bool:
        return _env_disables() or bool(getattr(self._config, "disable", False))

    def __call__(self, *args, **kwargs):
        if _is_compiling():  # traced by an outer torch.compile: let it inline the original
            return self._fn(*args, **kwargs)
        if self._method and args:
            # ``Cls.forward(instance, x)`` (a subclass's forward calling its parent's): the
            # instance's own compile, as ``instance.forward(x)`` gets; one site for every instance
            # would check ``self`` by type only and run code traced with another's attributes.
            return self._bound_for(args[0])(*args[1:], **kwargs)
        return self._site.call(args, args, kwargs)

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        if _is_compiling():  # traced by an outer torch.compile: let it inline the original
            return types.MethodType(self._fn, obj)
        last = self._last
        if last is not None and last._ref() is obj:
            return last
        return self._bound_for(obj)

    def _bound_for(self, obj) -> "BoundCompiledFunction":
        with self._lock:
            site = self._sites.get(obj)
            if site is None:
                site = self._sites[obj] = _Site(self, bound=True)
                site.bound_call = BoundCompiledFunction(site, obj)
            self._last = site.bound_call
            return site.bound_call

    def __repr__(self) -> str:
        return f"<compileattn.compile of {self._fn.__qualname__}>"


class BoundCompiledFunction:
    """``instance.forward`` of a compiled class: calls that instance's compile, and reports it
    (``compile_stats``, ``runtimes``). Holds the instance weakly (its site lives as long as it)."""

    __slots__ = ("_site", "_ref", "__weakref__")

    def __init__(self, site: _Site, obj: Any):
        self._site = site
        self._ref = weakref.ref(obj)

    def __call__(self, *args, **kwargs):
        obj = self._ref()
        if obj is None:
            raise ReferenceError(f"{self._site.owner!r}: the instance this forward was bound to no longer exists")
        if _is_compiling():
            return self._site.owner._fn(obj, *args, **kwargs)
        return self._site.call((obj, *args), args, kwargs)

    @property
    def compile_stats(self) -> dict[str, Any]:
        """This instance's compile stats (see ``CompiledFunction.compile_stats``)."""
        return dict(self._site.stats)

    @property
    def runtimes(self) -> list:
        return list(self._site.runtimes)

    def wait_for_static_pieces(self, timeout: float | None = None) -> bool:
        """See ``CompiledFunction.wait_for_static_pieces``."""
        return _wait_for_static_pieces(self._site.runtimes, timeout)

    @property
    def __self__(self) -> Any:
        return self._ref()

    @property
    def __func__(self) -> CompiledFunction:
        return self._site.owner

    @property
    def __signature__(self) -> inspect.Signature:
        params = list(self._site.owner._sig.parameters.values())[1:]
        return self._site.owner._sig.replace(parameters=params)

    def __getattr__(self, name: str) -> Any:  # __name__, __doc__, __wrapped__, ... of the function
        return getattr(self._site.owner, name)

    def __repr__(self) -> str:
        return f"<bound compileattn.compile of {self._site.owner._fn.__qualname__} of {self._ref()!r}>"


def compile(cls_or_fn: Any = None, *, dynamic_arg_dims: Mapping[str, int | list[int]] | None = None,
            config: CompileConfig | None = None, backend: Callable | str | None = None):
    """Compile a model's forward once, with ``dynamic_arg_dims`` dynamic, and dispatch without guards.

    ``@compileattn.compile(dynamic_arg_dims={"input_ids": 0, "positions": 0})`` on an ``nn.Module``
    class compiles each instance's ``forward`` on its first call; on a function (or a method in a
    class body) it compiles that. ``dynamic_arg_dims=None`` makes dim 0 of every argument annotated
    ``torch.Tensor`` dynamic. ``backend`` defaults to the compileattn backend with ``config``; with
    ``config.cache_dir`` set, a later process loads the compile instead (warm start, no Dynamo).
    Later calls that would have made Dynamo recompile raise ``RecompileError``.
    ``COMPILEATTN_DISABLE=1`` (or a config with ``disable=True``) runs eagerly.
    """

    def wrap(target):
        if isinstance(target, type):
            forward = getattr(target, "forward", None)
            if isinstance(forward, CompiledFunction):
                raise TypeError(f"{target.__qualname__}.forward is already compiled by compileattn.compile")
            if not isinstance(forward, types.FunctionType):
                raise TypeError(f"compileattn.compile: class {target.__qualname__} has no Python forward method")
            target.forward = CompiledFunction(forward, dynamic_arg_dims, config, backend, method=True)
            return target
        if isinstance(target, types.MethodType):
            return CompiledFunction(target.__func__, dynamic_arg_dims, config, backend,
                                    method=True).__get__(target.__self__)
        return CompiledFunction(target, dynamic_arg_dims, config, backend)

    if cls_or_fn is None:
        return wrap
    return wrap(cls_or_fn)
