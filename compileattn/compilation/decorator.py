"""``@compileattn.compile``: compile a forward once, then call Dynamo's output without its guards.

A ``torch.compile``'d function evaluates Dynamo's guards on every call: for a model forward, one
check per parameter and module attribute the trace read, every step. In an LLM serving loop the
only things that change between steps are the arguments, so this decorator checks exactly those
itself (dtype, device, ndim, static sizes, non-tensor values) and jumps straight into the code
Dynamo generated. A change that would have made Dynamo recompile raises ``RecompileError``
instead: recompiling mid-serving costs seconds and, with CUDA graphs, memory, so it must be loud.

How the dispatch works (the idea of vLLM's ``TorchCompileWrapperWithCustomDispatcher``):

1. First call: mark the dynamic dims, then ``torch.compile(fullgraph=True, dynamic=False)`` a copy
   of the function whose code object is a fresh copy (``code.replace()``) of the original's. The
   copy gives this compile its own Dynamo cache entry (no other instance's guards can match it and
   skip the compile) and lets the bytecode hook recognise its frame by identity, with no stack
   walking into Dynamo's internals; the user's function is never modified.
2. A bytecode hook (``torch._dynamo.convert_frame.register_bytecode_hook``) records the code
   object Dynamo produced for that copy: it calls ``__compiled_fn_*`` (the backend's output) with
   the tensors it reads from the arguments.
3. Later calls run a function built from that code with the original function's globals (Dynamo
   installed ``__compiled_fn_*`` and ``__import_*`` there), defaults and closure. Dynamo keeps the
   arguments, cell and free variables of the original, so the calling convention is unchanged.

Dynamo deletes those globals when the code object it ran is garbage-collected, so the dispatcher
holds that code object (the hook is registered last, inside depyf's, so it sees the final one)
and survives ``torch._dynamo.reset()``.

Limits, because guards are skipped: everything that is not an argument is frozen at the first
call: Python globals and non-parameter module attributes the forward reads; shapes, dtypes and
devices of parameters and buffers (their *values* are read at each call, so in-place weight
updates show, but move the model before its first call); autocast, torch function modes and global
flags other than grad mode. Objects other than tensors, scalars, strings, dtypes/devices and
tuples/lists/dicts of those are checked for type only. Dynamic dims need size >= 2 on the first
call (Dynamo specializes sizes 0 and 1; a size-1 first call is refused rather than compiled
static); later calls may use any size, including 1.

Cost, measured on this repo's 2-core CPU box with a backend whose compiled function does nothing
(so only dispatch is timed): checking two tensor arguments 2-7 µs; a decorated module call
~25-40 µs, of which ~10 µs is ``nn.Module.__call__``; the same module under a guarded
``torch.compile`` 77-135 µs.
"""
from __future__ import annotations

import enum
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

log = logging.getLogger("compileattn")

#: Set to 1 to run every ``@compileattn.compile`` function eagerly (read at each site's first call).
DISABLE_ENV = "COMPILEATTN_DISABLE"

_is_compiling = torch.compiler.is_compiling


class RecompileError(RuntimeError):
    """A call differs from the first one in a way that would have made Dynamo recompile.

    ``@compileattn.compile`` skips Dynamo's guards, so it cannot recompile; the message names the
    argument and what changed.
    """


# ----------------------------------------------------------------------------------------------
# What a call looked like: one spec per argument, compared on every later call.


class _TensorSpec:
    __slots__ = ("dtype", "device", "ndim", "shape", "static", "dynamic", "requires_grad", "contiguous")

    def __init__(self, t: torch.Tensor, dynamic: tuple[int, ...] = ()):
        self.dtype = t.dtype
        self.device = t.device
        self.ndim = t.dim()
        self.shape = tuple(t.shape)
        self.dynamic = dynamic
        self.static = tuple((i, s) for i, s in enumerate(self.shape) if i not in dynamic)
        self.requires_grad = t.requires_grad
        self.contiguous = t.is_contiguous()

    def matches(self, v: Any) -> bool:
        # Ordered cheapest-first; ~1-2 µs per tensor on a slow CPU, device being the dearest.
        if (
            not isinstance(v, torch.Tensor)
            or v.dtype is not self.dtype
            or v.dim() != self.ndim
            or v.requires_grad is not self.requires_grad
            or v.device != self.device
        ):
            return False
        if self.static:
            shape = v.shape
            for i, s in self.static:
                if shape[i] != s:
                    return False
        return self.contiguous is False or v.is_contiguous()

    def explain(self, v: Any) -> str:
        if not isinstance(v, torch.Tensor):
            return f"was a Tensor on the first call, now {type(v).__name__}"
        if v.dtype is not self.dtype:
            return f"dtype changed from {self.dtype} to {v.dtype}"
        if v.device != self.device:
            return f"device changed from {self.device} to {v.device}"
        if v.dim() != self.ndim:
            return f"ndim changed from {self.ndim} to {v.dim()} (shape {self.shape} -> {tuple(v.shape)})"
        for i, s in self.static:
            if v.shape[i] != s:
                return (f"size of static dim {i} changed from {s} to {v.shape[i]} (shape {self.shape} -> "
                        f"{tuple(v.shape)}; dynamic dims: {list(self.dynamic)})")
        if v.requires_grad is not self.requires_grad:
            return f"requires_grad changed from {self.requires_grad} to {v.requires_grad}"
        return "was contiguous on the first call, now is not"

    def describe(self) -> str:
        return f"Tensor{self.shape} {self.dtype} on {self.device}"


_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
                torch.memory_format, enum.Enum)


class _ValueSpec:
    """Scalars and the like: Dynamo specializes on the value (``dynamic=False``), so must we."""

    __slots__ = ("type", "value")

    def __init__(self, v: Any):
        self.type = type(v)
        self.value = v

    def matches(self, v: Any) -> bool:
        return type(v) is self.type and (v is self.value or v == self.value)

    def explain(self, v: Any) -> str:
        if type(v) is not self.type:
            return f"type changed from {self.type.__name__} to {type(v).__name__} (value {v!r})"
        return f"value changed from {self.value!r} to {v!r}"

    def describe(self) -> str:
        return repr(self.value)


class _TypeSpec:
    """Opaque objects: Dynamo guards on whatever attributes the trace read, which we cannot know."""

    __slots__ = ("type",)

    def __init__(self, v: Any):
        self.type = type(v)

    def matches(self, v: Any) -> bool:
        return type(v) is self.type

    def explain(self, v: Any) -> str:
        return f"type changed from {self.type.__qualname__} to {type(v).__qualname__}"

    def describe(self) -> str:
        return f"<{self.type.__qualname__}>"


class _SeqSpec:
    __slots__ = ("type", "items")

    def __init__(self, v: Any, items: list):
        self.type = type(v)
        self.items = items

    def matches(self, v: Any) -> bool:
        if type(v) is not self.type or len(v) != len(self.items):
            return False
        for spec, item in zip(self.items, v):
            if not spec.matches(item):
                return False
        return True

    def explain(self, v: Any) -> str:
        if type(v) is not self.type:
            return f"type changed from {self.type.__name__} to {type(v).__name__}"
        if len(v) != len(self.items):
            return f"length changed from {len(self.items)} to {len(v)}"
        i = next(i for i, (spec, item) in enumerate(zip(self.items, v)) if not spec.matches(item))
        return f"item [{i}]: {self.items[i].explain(v[i])}"

    def describe(self) -> str:
        return f"{self.type.__name__} of {len(self.items)}"


class _DictSpec:
    __slots__ = ("type", "items")

    def __init__(self, v: Mapping, items: dict):
        self.type = type(v)
        self.items = items

    def matches(self, v: Any) -> bool:
        if type(v) is not self.type or len(v) != len(self.items):
            return False
        for key, spec in self.items.items():
            if key not in v or not spec.matches(v[key]):
                return False
        return True

    def explain(self, v: Any) -> str:
        if type(v) is not self.type:
            return f"type changed from {self.type.__name__} to {type(v).__name__}"
        if set(v) != set(self.items):
            return f"keys changed from {sorted(map(repr, self.items))} to {sorted(map(repr, v))}"
        key = next(k for k, spec in self.items.items() if not spec.matches(v[k]))
        return f"item [{key!r}]: {self.items[key].explain(v[key])}"

    def describe(self) -> str:
        return f"{self.type.__name__} of {len(self.items)}"


def _spec_of(v: Any, dynamic: tuple[int, ...] = ()):
    if isinstance(v, torch.Tensor):
        return _TensorSpec(v, dynamic)
    if isinstance(v, _VALUE_TYPES):
        return _ValueSpec(v)
    if type(v) in (tuple, list, torch.Size) or (isinstance(v, tuple) and hasattr(v, "_fields")):
        return _SeqSpec(v, [_spec_of(x) for x in v])
    if type(v) is dict:
        return _DictSpec(v, {k: _spec_of(x) for k, x in v.items()})
    return _TypeSpec(v)


_SELF = object()  # stands for the bound instance when binding a method's signature


class _ArgChecker:
    """Compares each call's arguments with the first call's, by parameter name.

    Mapping positions and keywords to names needs ``Signature.bind`` (~10 µs), so it is done once
    per call *layout* (number of positional args + keyword names, in order) and cached as a flat
    list of (position or keyword, name, spec); a call then costs a dict lookup and one ``matches``
    per argument. Parameters a layout leaves at their default are compared with the first call
    once, when the layout is first seen.
    """

    def __init__(self, sig: inspect.Signature, bound_self: bool, specs: dict[str, Any], grad_enabled: bool):
        self._sig = sig
        self._bound_self = bound_self
        self._specs = specs
        self._grad_enabled = grad_enabled
        self._plans: dict[Any, list[tuple[int | str, str, Any]]] = {}

    def check(self, args: tuple, kwargs: dict) -> None:
        key = (len(args), *kwargs) if kwargs else len(args)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(args, kwargs)
        for src, name, spec in plan:
            v = args[src] if src.__class__ is int else kwargs[src]
            if not spec.matches(v):
                raise _recompile_error(name, spec.explain(v))
        if torch.is_grad_enabled() is not self._grad_enabled:
            raise _recompile_error(
                None, f"grad mode (torch.is_grad_enabled()) changed from {self._grad_enabled} to "
                f"{not self._grad_enabled}; use the same torch.no_grad()/inference_mode() as the first call")

    def _plan(self, args: tuple, kwargs: dict) -> list:
        names = _argument_names(self._sig, self._bound_self, args, kwargs)
        plan = [(src, name, self._specs[name]) for src, name in names if name in self._specs]
        unexpected = [name for _, name in names if name not in self._specs]
        if unexpected:
            raise _recompile_error(unexpected[0], "was not passed on the first call")
        passed = {name for _, name in names}
        for name, spec in self._specs.items():
            if name in passed:
                continue
            param = self._sig.parameters.get(name)
            if param is None or param.default is inspect.Parameter.empty:
                raise _recompile_error(name, "was passed on the first call, now missing")
            if not spec.matches(param.default):
                raise _recompile_error(name, f"now left at its default ({spec.explain(param.default)})")
        return plan


def _argument_names(sig: inspect.Signature, bound_self: bool, args: tuple, kwargs: dict):
    """(position or keyword, name) of every argument actually passed; raises the usual TypeError
    for a call the signature rejects. ``*args`` items are named ``args[i]``, ``**kw`` items
    ``kw['key']``."""
    bound = sig.bind(_SELF, *args, **kwargs) if bound_self else sig.bind(*args, **kwargs)
    names: list[tuple[int | str, str]] = []
    pos = -1 if bound_self else 0  # index into ``args`` of the next positional parameter
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            names += [(pos + i, f"{name}[{i}]") for i in range(len(value))]
            pos += len(value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            names += [(k, f"{name}[{k!r}]") for k in value]
        elif name in kwargs:
            names.append((name, name))
        else:
            if pos >= 0:
                names.append((pos, name))
            pos += 1
    return names


def _all_arguments(sig: inspect.Signature, bound_self: bool, args: tuple, kwargs: dict) -> dict[str, Any]:
    """name -> value of every parameter (defaults applied; ``*args``/``**kw`` items flattened)."""
    bound = sig.bind(_SELF, *args, **kwargs) if bound_self else sig.bind(*args, **kwargs)
    bound.apply_defaults()
    out: dict[str, Any] = {}
    for i, (name, value) in enumerate(bound.arguments.items()):
        kind = sig.parameters[name].kind
        if bound_self and i == 0:
            continue
        if kind is inspect.Parameter.VAR_POSITIONAL:
            out.update({f"{name}[{j}]": v for j, v in enumerate(value)})
        elif kind is inspect.Parameter.VAR_KEYWORD:
            out.update({f"{name}[{k!r}]": v for k, v in value.items()})
        else:
            out[name] = value
    return out


def _recompile_error(name: str | None, what: str) -> RecompileError:
    subject = f"argument {name!r} " if name is not None else ""
    return RecompileError(
        f"compileattn.compile: {subject}{what}. This would make Dynamo recompile, but "
        f"@compileattn.compile dispatches without Dynamo's guards and does not recompile: call it as on "
        f"the first call, list the varying dim in dynamic_arg_dims, or compile a separate instance for "
        f"this variant."
    )


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


class _Site:
    """Compiled state for one function or one module instance. ``fast`` is None until compiled."""

    __slots__ = ("owner", "bound", "fast", "checker", "code", "pins", "stats")

    def __init__(self, owner: "CompiledFunction", bound: bool):
        self.owner = owner
        self.bound = bound  # calls carry the instance as first argument, excluded from the checks
        self.fast: Callable | None = None
        self.checker: _ArgChecker | None = None
        self.code: types.CodeType | None = None  # the transformed code; holds Dynamo's globals alive
        self.pins: list = []
        self.stats: dict[str, float] = {}  # seconds of the compile: total, Dynamo, backend

    def call(self, full_args: tuple, args: tuple, kwargs: dict):
        fast = self.fast
        if fast is None:
            with self.owner._lock:
                if self.fast is None:
                    return self._compile(full_args, args, kwargs)
                fast = self.fast
        if self.checker is not None:
            self.checker.check(args, kwargs)
        return fast(*full_args, **kwargs)

    def _compile(self, full_args: tuple, args: tuple, kwargs: dict):
        owner = self.owner
        fn = owner._fn
        what = f"{type(full_args[0]).__qualname__}.{fn.__name__}" if self.bound else fn.__qualname__
        if owner._disabled():
            log.info("compileattn: compile of %s disabled (%s=1 or config.disable); running eagerly",
                     what, DISABLE_ENV)
            self.fast = fn
            return fn(*full_args, **kwargs)

        values = _all_arguments(owner._sig, self.bound, args, kwargs)
        dynamic = _mark_dynamic(values, owner._dynamic_arg_dims)
        specs = {name: _spec_of(v, dynamic.get(name, ())) for name, v in values.items()}
        checker = _ArgChecker(owner._sig, self.bound, specs, torch.is_grad_enabled())

        code_copy = fn.__code__.replace()
        fn_copy = _function_with_code(fn, code_copy)
        timings = {"backend": 0.0, "hook": None}
        backend = _resolve_backend(owner._backend, owner._config)

        dumping = owner._config.debug_dump_dir is not None

        def timed_backend(gm, example_inputs):
            t = time.perf_counter()
            try:
                compiled_fn = backend(gm, example_inputs)
            finally:
                timings["backend"] += time.perf_counter() - t
            if dumping and not hasattr(compiled_fn, "__code__") and hasattr(compiled_fn, "__call__"):
                # depyf's full_code_for_* summary decompiles every __compiled_fn_* and fails on a
                # callable object (such as the piecewise runtime); its bound __call__ forwards
                # __code__ and calls the same thing.
                compiled_fn = compiled_fn.__call__
            return compiled_fn

        captured: list[types.CodeType] = []

        def bytecode_hook(old_code, new_code):
            if old_code is code_copy:
                captured.append(new_code)
                timings["hook"] = time.perf_counter()

        from . import debug

        start = time.perf_counter()
        with debug.dump_context(owner._config):
            # Registered inside depyf's context so it runs after depyf's hook and sees the code
            # Dynamo will actually keep (depyf swaps in a recompiled, debuggable copy).
            handle = _torch_compat.register_bytecode_hook(bytecode_hook)
            try:
                compiled = torch.compile(fn_copy, fullgraph=True, dynamic=False, backend=timed_backend)
                out = compiled(*full_args, **kwargs)
            finally:
                handle.remove()

        if not captured:
            # Dynamo did not compile the frame (disabled globally, e.g. TORCHDYNAMO_DISABLE=1):
            # fall back to the guarded callable, which is then plain eager.
            log.warning("compileattn: Dynamo produced no code for %s; running it through torch.compile's "
                        "guarded path", what)
            self.fast = compiled
            return out
        self.code = captured[-1]
        self.pins = _pin_cache_entry_code(code_copy)
        self.checker = checker
        self.fast = _function_with_code(fn, self.code)
        total = timings["hook"] - start
        self.stats = {"total_s": total, "dynamo_s": total - timings["backend"], "backend_s": timings["backend"]}
        log.info(
            "compileattn: compiled %s in %.2f s (Dynamo %.2f s, backend %.2f s); dynamic dims %s; later "
            "calls skip Dynamo's guards", what, total, total - timings["backend"],
            timings["backend"], dynamic or "none",
        )
        return out


def _function_with_code(fn: Callable, code: types.CodeType) -> types.FunctionType:
    new = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    return new


def _pin_cache_entry_code(code: types.CodeType) -> list:
    """Hold the code objects of Dynamo's cache entries for ``code``: Dynamo deletes the globals they
    use when they are collected, which would strand ours if another hook replaced them after ours."""
    try:
        return _torch_compat.cache_entry_codes(code)
    except Exception:  # noqa: BLE001 (a debug API; pinning is belt and braces)
        return []


def _resolve_backend(backend: Callable | str | None, config: CompileConfig) -> Callable:
    if backend is None:
        from .backend import compileattn_backend

        return functools.partial(compileattn_backend, options={"config": config})
    if isinstance(backend, str):  # "eager", "aot_eager", "inductor": handy for bisecting a problem
        return _torch_compat.lookup_backend(backend)
    return backend


# ----------------------------------------------------------------------------------------------
# The public wrapper


class _BoundForward(functools.partial):
    """``instance.forward`` of a compiled class: a C-level partial (no Python frame added per
    call, unlike a wrapper object) that also answers ``compile_stats`` for that instance."""

    __slots__ = ()

    @property
    def compile_stats(self) -> dict[str, float]:
        return self.func.__self__.stats_of(self.args[0])


class CompiledFunction:
    """What ``@compileattn.compile`` returns for a function (and installs as a class's ``forward``).

    A descriptor: looked up on an instance it dispatches per instance (each module instance gets its
    own compile, since the trace bakes in that instance's attributes); called directly it has one
    compile for the function.
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
        self._dynamic_arg_dims = _normalize_dynamic_arg_dims(dynamic_arg_dims, fn, self._sig, method)
        self._config = config if config is not None else CompileConfig()
        self._backend = backend
        self._lock = threading.RLock()
        self._site = _Site(self, bound=False)
        self._sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last: tuple[weakref.ref, _Site] | None = None

    @property
    def compile_stats(self) -> dict[str, float]:
        """Seconds the compile took (``total_s``, ``dynamo_s``: tracing and bytecode, ``backend_s``:
        compileattn's passes, piece compiles or cache loads); empty before the first call. For a
        method, the most recently called instance's."""
        site = self._last[1] if self._last is not None else self._site
        return dict(site.stats)

    def _disabled(self) -> bool:
        return os.environ.get(DISABLE_ENV, "0") not in ("", "0") or bool(getattr(self._config, "disable", False))

    def __call__(self, *args, **kwargs):
        if _is_compiling():  # traced by an outer torch.compile: let it inline the original
            return self._fn(*args, **kwargs)
        return self._site.call(args, args, kwargs)

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return _BoundForward(self._call_bound, obj)

    def stats_of(self, obj) -> dict[str, float]:
        """``compile_stats`` of instance ``obj``'s compile (empty before its first call)."""
        site = self._sites.get(obj)
        return dict(site.stats) if site is not None else {}

    def _call_bound(self, obj, *args, **kwargs):
        if _is_compiling():
            return self._fn(obj, *args, **kwargs)
        last = self._last
        if last is not None and last[0]() is obj:
            site = last[1]
        else:
            site = self._site_for(obj)
        return site.call((obj, *args), args, kwargs)

    def _site_for(self, obj) -> _Site:
        with self._lock:
            site = self._sites.get(obj)
            if site is None:
                site = self._sites[obj] = _Site(self, bound=True)
            self._last = (weakref.ref(obj), site)
            return site

    def __repr__(self) -> str:
        return f"<compileattn.compile of {self._fn.__qualname__}>"


def compile(cls_or_fn: Any = None, *, dynamic_arg_dims: Mapping[str, int | list[int]] | None = None,
            config: CompileConfig | None = None, backend: Callable | str | None = None):
    """Compile a model's forward once, with ``dynamic_arg_dims`` dynamic, and dispatch without guards.

    ``@compileattn.compile(dynamic_arg_dims={"input_ids": 0, "positions": 0})`` on an ``nn.Module``
    class compiles each instance's ``forward`` on its first call; on a function (or a method in a
    class body) it compiles that. ``dynamic_arg_dims=None`` makes dim 0 of every argument annotated
    ``torch.Tensor`` dynamic. ``backend`` defaults to the compileattn backend with ``config``.
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
            return types.MethodType(CompiledFunction(target.__func__, dynamic_arg_dims, config, backend,
                                                     method=True)._call_bound, target.__self__)
        return CompiledFunction(target, dynamic_arg_dims, config, backend)

    if cls_or_fn is None:
        return wrap
    return wrap(cls_or_fn)
