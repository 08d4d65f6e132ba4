"""Warm start of ``@compileattn.compile``: Dynamo's code and every compiled piece from one file.

A cold compile is ``torch.compile(fn, fullgraph=True, dynamic=False, options={"guard_filter_fn":
skip_all_guards_unsafe}).aot_compile((args, kwargs))``: one Dynamo trace that installs nothing on
``fn`` and hands back its transformed code as a plain function (``AOTCompiledFunction.fn``), which
the decorator calls directly behind its own argument check. Its bytes (torch pickles Dynamo's code,
and the backend's ``StepDispatcher`` saves the split graph and each distinct piece, ``artifact.py``)
go to ``<cache_dir>/warm_start/<function tag>-<key>.bin``. A later process with the same key loads that file
(``torch.compiler.load_compiled_function``) and runs no Dynamo, no graph passes and no compile.
Beside Dynamo's code the file holds what the compile assumed of the dynamic sizes
(``size_guards.py``), which the loading process checks per call as the compiling one did.

The key is computed *before* anything is traced, from what decides the compiled code:
``key_of`` lists it (config, versions, compileattn's own source, the function, the first call's
arguments, the model's structure, environment). What the key cannot know in advance is which
source files Dynamo reads: the file stores every traced module's source, and a loaded entry whose
sources differ from the current files is not used (``_sources_unchanged``, as vLLM does).

The plain values the trace read and baked in (Dynamo's constant guards, which the decorator
skips: a module global, a class attribute, a config's field however deep) are saved with where
they were read, and a loaded entry whose first call reads any of them otherwise is not used
(``BakedValues``): the key cannot reach them all before tracing. Not compared: what Dynamo
compares by identity (which function or code object a hook or attribute holds: the key describes
those it reaches).

Only the default backend is saved (``backend=None``: compileattn's, with the decorator's config):
the key cannot describe another backend. Anything that fails here (an unpicklable global, a
closure holding a module, a file from another GPU or torch) falls back to compiling, logged once.
"""
from __future__ import annotations

import builtins
import dataclasses
import enum
import functools
import hashlib
import importlib
import inspect
import logging
import pathlib
import pickle
import re
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from .. import _torch_compat
from ..config import CompileConfig
from . import argcheck, reach
from .cache import compileattn_source_digest, environment_key, interpreter_key, save_or_log, secure_dir
from .size_guards import SizeGuards

log = logging.getLogger("compileattn")

#: Bumped when what is saved changes meaning.
FORMAT = 5

#: Values whose repr is their value, the same in every process.
_PLAIN = (type(None), bool, int, float, complex, str, bytes, range, type(Ellipsis), torch.dtype, torch.device,
          torch.layout, torch.memory_format, torch.qscheme, torch.finfo, torch.iinfo, re.Pattern, pathlib.PurePath,
          enum.Enum)
#: ``nn.Module``'s own bookkeeping (parameters, buffers, submodules, hooks: described apart), not
#: what a model's author put on it; ``training`` is the author's (it changes the trace).
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}
_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")
#: Containers longer than this are keyed by their length and a digest of their text.
_LONG = 256


class Undescribable(ValueError):
    """The cache key cannot describe a value the trace may have read: no warm start for this compile."""


def _fingerprint(value: Any, depth: int = 4) -> str:
    """Stable text of a value Dynamo may bake into the trace (it specialises on the plain values it
    reads: an attribute, a closure variable, a config object's fields, a hook). Containers,
    dataclasses and objects are described by their contents down to ``depth`` levels, functions by
    where they are defined and what they close over; nothing is described by ``repr`` of an object
    (its address would change every process). A module inside is named only: modules are described
    where they are the model's submodules or the call's arguments. A value with nothing to describe
    it by (no fields, not a function) raises ``Undescribable``: no warm start, rather than one
    that ignores it."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return _tensor_text(value)
    kind = type(value)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if depth == 0 or isinstance(value, (torch.nn.Module, type)):
        return f"<{name}>" if not isinstance(value, type) else f"<class {value.__module__}.{value.__qualname__}>"
    if isinstance(value, (tuple, list, set, frozenset)):
        items = [_fingerprint(v, depth - 1) for v in value]
        if isinstance(value, (set, frozenset)):
            items.sort()
        text = ", ".join(items)
        if len(items) > _LONG:
            text = f"len={len(items)} sha={hashlib.sha256(text.encode()).hexdigest()[:16]}"
        return f"{name}({text})"
    if isinstance(value, dict):
        text = ", ".join(f"{_fingerprint(k, 1)}: {_fingerprint(v, depth - 1)}" for k, v in value.items())
        return f"{name}{{{text}}}"
    if isinstance(value, functools.partial):
        return (f"partial({_fingerprint(value.func, depth - 1)}, {_fingerprint(value.args, depth - 1)}, "
                f"{_fingerprint(value.keywords, depth - 1)})")
    code = getattr(value, "__code__", None)
    if code is not None:  # a function (or a bound method's function, below)
        cells = [_fingerprint(c.cell_contents, depth - 1) if reach.cell_filled(c) else "<empty>"
                 for c in (getattr(value, "__closure__", None) or ())]
        defaults = (getattr(value, "__defaults__", None), getattr(value, "__kwdefaults__", None))
        owner = getattr(value, "__self__", None)
        bound = f" of {_fingerprint(owner, depth - 1)}" if owner is not None else ""
        return (f"fn {getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}@{code.co_firstlineno}"
                f":{_code_digest(code)}[{', '.join(cells)}]{_fingerprint(defaults, depth - 1)}{bound}")
    if dataclasses.is_dataclass(value):
        fields = (f"{f.name}={_fingerprint(getattr(value, f.name), depth - 1)}" for f in dataclasses.fields(value))
        return f"{name}({', '.join(fields)})"
    if isinstance(value, slice):
        return f"slice({_fingerprint(value.start, 1)}, {_fingerprint(value.stop, 1)}, {_fingerprint(value.step, 1)})"
    if kind.__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "dtype"):  # a scalar or array
        if value.dtype == object:  # its bytes are pointers: its items by value
            return f"{name}(object, {getattr(value, 'shape', ())}, {_fingerprint(value.tolist(), depth - 1)})"
        data = hashlib.sha256(value.tobytes()).hexdigest()[:16]
        return f"{name}({value.dtype}, {getattr(value, 'shape', ())}, {data})"
    # Public fields only: an object's private state can differ per process (transformers'
    # GenerationConfig keeps a string hash, randomized per process), which would make every warm
    # start miss; a config's public fields are what a forward reads. Slots beside a __dict__ too.
    attributes = getattr(value, "__dict__", None)
    fields = {k: v for k, v in attributes.items() if not k.startswith("_")} if isinstance(attributes, dict) else {}
    slots = [slot for cls in kind.__mro__ for slot in _slots_of(cls) if not slot.startswith("_")]
    fields.update((slot, getattr(value, slot, None)) for slot in slots if slot != "__dict__")
    if isinstance(attributes, dict) or slots:
        return f"{name}{{{', '.join(f'{k}={_fingerprint(v, depth - 1)}' for k, v in sorted(fields.items()))}}}"
    if callable(value) and hasattr(value, "__qualname__"):  # a builtin function: where it is defined
        return f"builtin {getattr(value, '__module__', '?')}.{value.__qualname__}"
    raise Undescribable(f"a {name} (no fields to describe it by, so a process where it differs would load this "
                        f"one's compile)")


def _tensor_text(t: torch.Tensor) -> str:
    """What the traced code assumes of a tensor it reads (its values are read at each call): shape,
    dtype, device, requires_grad, and the layout of one that is not contiguous, as the argument
    check keys an argument (``argcheck._TensorSpec.key``). Dynamo specialises a model's tensors'
    strides (a branch on ``is_contiguous()`` is baked in) and Inductor's code assumes them
    (``assert_size_stride``; with ``size_asserts`` off it reads the memory in the compiled order):
    a model whose weights are stored transposed must not load the compile of one whose are not.
    A subclass is named: Dynamo traces its ``__torch_function__`` into the graph, and a wrapper
    subclass (a quantized weight) as the tensors it flattens into, so the compile for a plain
    weight of the same shape and dtype cannot serve it, nor the other way round."""
    kind = _torch_compat.tensor_type_name(t)
    if t.layout != torch.strided:
        layout = f",{t.layout}"
    else:
        layout = "" if t.is_contiguous() else f",strides={tuple(t.stride())}"
    grad = ",requires_grad" if t.requires_grad else ""
    return f"{kind}({tuple(t.shape)},{t.dtype},{t.device}{layout}{grad})"


def _code_digest(code: types.CodeType) -> str:
    """What a function's code does: two lambdas on one line share their name and line, and which
    one a model holds is compared by identity only (the source check sees one file)."""
    h = hashlib.sha256()
    todo = [code]
    while todo:
        c = todo.pop()
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
        for k in c.co_consts:
            if isinstance(k, types.CodeType):
                todo.append(k)
            else:  # a frozenset's order follows the per-process string hash
                h.update(repr(sorted(map(repr, k)) if isinstance(k, frozenset) else k).encode())
    return h.hexdigest()[:12]


def _slots_of(cls: type) -> tuple[str, ...]:
    slots = getattr(cls, "__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


#: torch's forward hooks for every module (``register_module_forward_hook``): traced into each call
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_with_kwargs",
                 "_global_forward_hooks_always_called")


def global_hooks_fingerprint() -> Iterable[str]:
    """Which global forward hooks are registered (the functions, as a module's own hooks are)."""
    for name in _GLOBAL_HOOKS:
        registered = getattr(torch.nn.modules.module, name, None)
        if registered:
            yield f"{name}=[{', '.join(_fingerprint(h) for h in registered.values())}]"


def module_fingerprint(module: torch.nn.Module) -> Iterable[str]:
    """The model's structure as text: every submodule's class, its attributes (``_``-named ones
    too: Dynamo reads them alike), its hooks (which functions, not only how many), and the name,
    shape, dtype, device and layout of every parameter and buffer (``_tensor_text``: values are
    read at each call, shapes, layouts and attributes are baked into the trace). A tensor the
    model reaches under two names (tied weights, a submodule shared by two layers) is marked at
    its second name with its first: Dynamo passes it as one graph input, so the compile of a model
    that shares it would run a model that does not with the first name's tensor in both places."""
    first_name: dict[int, str] = {}

    def shared(name: str, t: torch.Tensor) -> str:
        first = first_name.setdefault(id(t), name)
        return f" is {first}" if first != name else ""

    for name, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        yield f"{name}:{type(mod).__module__}.{type(mod).__qualname__}"
        for attr, value in sorted(vars(mod).items()):
            if attr not in _MODULE_INTERNALS:
                tied = shared(prefix + attr, value) if isinstance(value, torch.Tensor) else ""
                yield f" {attr}={_fingerprint(value)}{tied}"
        for hooks in _HOOKS:
            registered = getattr(mod, hooks, None)
            if registered:
                yield f" {hooks}=[{', '.join(_fingerprint(h) for h in registered.values())}]"
        for kind, tensors in (("p", mod.named_parameters(recurse=False)), ("b", mod.named_buffers(recurse=False))):
            for pname, t in tensors:
                yield f" {kind} {pname} {_tensor_text(t)}{shared(prefix + pname, t)}"


def closure_fingerprint(fn: Callable) -> Iterable[str]:
    """What the decorated function closes over, and its defaults, by value (``_fingerprint``: two
    functions made by one factory share their source lines), and a module among them (in
    containers too) as the model it is."""
    yield f"function={_fingerprint(fn, depth=5)}"  # its cells and defaults at the depth of a value
    for i, module in enumerate(reach.modules_in(reach.closure_values(fn))):
        yield f"closure module {i}:"
        yield from module_fingerprint(module)


def key_of(fn: Callable, config: CompileConfig, dynamic: dict, arguments: str, values: Iterable[Any]) -> str:
    """The cache key of a compile: everything that decides Dynamo's code and the pieces that is
    known before tracing. ``arguments``: the argument checker's text of the first call;
    ``values``: the call's argument values (modules among them, in containers too, are fingerprinted;
    so are the other objects, by value: the argument check sees their type only, and the instance
    of a decorated method of a class that is not a module is not among the checked arguments at
    all, yet the trace read its attributes and the model it holds)."""
    values = tuple(values)
    parts = [
        f"format={FORMAT}", f"torch={torch.__version__}", interpreter_key(),
        f"compileattn={compileattn_source_digest()}",
        f"fn={_function_identity(fn)}",
        f"config={config.hash()}",
        f"dynamic={sorted(dynamic.items())}", f"arguments={arguments}", *environment_key(),
    ]
    parts.extend(closure_fingerprint(fn))
    for value in values:
        parts.extend(f"object={_fingerprint(leaf)}" for _, leaf in argcheck.leaves(value)
                     if not isinstance(leaf, (torch.nn.Module, torch.Tensor)))
    for module in reach.modules_in(values):
        parts.extend(module_fingerprint(module))
    parts.extend(global_hooks_fingerprint())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _function_identity(fn: Callable) -> str:
    """The function as the key and its tag name it: where it is defined."""
    code = fn.__code__
    return f"{fn.__module__}.{fn.__qualname__}@{code.co_filename}:{code.co_firstlineno}"


def function_tag(fn: Callable) -> str:
    """A short digest of the function itself (where it is defined), the prefix of its warm start
    files: ``saved_for`` finds them before a first call's key can be computed."""
    return hashlib.sha256(_function_identity(fn).encode()).hexdigest()[:8]


def path_of(config: CompileConfig, key: str, fn: Callable) -> Path:
    return secure_dir(secure_dir(config.cache_dir) / "warm_start") / f"{function_tag(fn)}-{key}.bin"


def saved_for(config: CompileConfig, fn: Callable) -> bool:
    """Whether ``config.cache_dir`` holds a warm start file of ``fn`` (for any arguments): its
    first call will likely load rather than compile. Reads the directory only."""
    if config.cache_dir is None:
        return False
    try:
        return any((Path(config.cache_dir).expanduser() / "warm_start").glob(f"{function_tag(fn)}-*.bin"))
    except OSError:
        return False


def _sources_unchanged(aot_fn) -> str | None:
    """None if every module Dynamo traced has the source it had at save time, else the first
    module that changed."""
    for module_name, content in _torch_compat.aot_traced_sources(aot_fn):
        try:
            module = sys.modules.get(module_name) or importlib.import_module(module_name)
            current = inspect.getsource(module)
        except Exception:  # noqa: BLE001 (a module that is gone or has no source file: not the same)
            return module_name
        if current != content:
            return module_name
    return None


#: How Dynamo names a value it read from one of compileattn's own modules: compileattn's state
#: (a registration counter, a flag set while tracing), which its source digest keys, not the program's.
_OWN_STATE = ("G['__import_compileattn_dot_", "G['__import_compileattn']")


class Unrecheckable(ValueError):
    """A value the trace baked in cannot be read again from a later first call: no warm start."""


@dataclasses.dataclass(frozen=True)
class BakedValues:
    """The plain values Dynamo's trace read and baked into the compiled code (a float attribute,
    a flag, a module global, a class attribute, a config's field however deep, a private field
    behind a property), each with Dynamo's name of where it read it (``m.cfg.rope.theta``,
    ``G['EPS']``, ``dict(type(self).__dict__)['k']``): the guards Dynamo would check on every
    call, which the decorator skips. The key describes what it can reach before tracing; these are
    what the trace actually read, and a warm start compares each with the first call's frame
    once (``first_difference``), so a value the key cannot see (changed at run time, deeper than
    the key describes, behind a property) compiles instead of running another's code."""

    entries: tuple[tuple[str, Any], ...]

    @classmethod
    def recorded(cls, entries: list[tuple[str, Any]], scope: dict, f_locals: dict) -> "BakedValues":
        """From the value guards ``aot_compile`` dropped, read again in the frame of the cold
        compile's first call, after the trace, as a later first call will read them (not those of
        compileattn's own state, ``_OWN_STATE``). One that reads otherwise now, or no longer reads
        (an index or attribute gone), is state compileattn set for the trace alone
        (``layer_ids.tracing_regions``; a Hugging Face attention class's forward put back,
        ``hf/kernel_wrappers.py``), set alike in every trace: not kept. Raises ``Unrecheckable``
        for a name no later process could evaluate or a value it could not compare: a warm start
        would be served unchecked against it."""
        names = _guard_names(scope)
        kept: dict[str, Any] = {}
        for name, value in entries:
            if name.startswith(_OWN_STATE):
                continue
            if not _comparable(value):
                raise Unrecheckable(f"{name} holds a {type(value).__qualname__}, not compared across processes")
            try:
                now = eval(name, names, f_locals)  # noqa: S307 (Dynamo's source names: attribute and item reads)
            except (NameError, SyntaxError) as exc:
                raise Unrecheckable(f"{name} cannot be evaluated ({type(exc).__name__}: {exc})") from None
            except Exception:  # noqa: BLE001 (the trace's own state, gone after it)
                continue
            if _same(now, value):
                kept[name] = value
        return cls(tuple(kept.items()))

    def first_difference(self, scope: dict, f_locals: dict) -> str | None:
        """None if every value reads the same in the frame of ``f_locals`` (``G``: ``scope``, the
        compiled code's globals), else the first that does not, as text."""
        names = _guard_names(scope)
        for name, value in self.entries:
            try:
                now = eval(name, names, f_locals)  # noqa: S307 (Dynamo's source names: attribute and item reads)
            except Exception as exc:  # noqa: BLE001 (gone, or not readable so: not the same)
                return f"{name} cannot be read ({type(exc).__name__}: {exc})"
            if not _same(now, value):
                return f"{name} is {now!r}, was {value!r}"
        return None


def _guard_names(scope: dict) -> dict[str, Any]:
    """The globals a Dynamo source name is evaluated with (its helpers, ``G``: the compiled code's
    globals ``scope``); the frame's locals are the other mapping."""
    return {**_torch_compat.guard_name_scope(), "G": scope, "__builtins__": builtins}


def baked_values(entries: list[tuple[str, Any]], aot_fn, fn: Callable, args: tuple, kwargs: dict,
                 what: str) -> BakedValues | None:
    """The values a cold compile of ``fn(*args, **kwargs)`` baked in (``entries``: its dropped value
    guards), to save with it; None (logged) where a later process could not check them: no save."""
    try:
        return BakedValues.recorded(entries, _torch_compat.aot_function(aot_fn).__globals__,
                                    frame_locals(fn, args, kwargs))
    except Unrecheckable as exc:
        log.info("compileattn: %s compiled but not saved for a warm start: a value its trace baked in could not be "
                 "checked in a later process (%s)", what, exc)
        return None


def _same(now: Any, value: Any) -> bool:
    if type(now) is not type(value):
        return False
    if isinstance(value, (tuple, list)):
        return len(now) == len(value) and all(_same(a, b) for a, b in zip(now, value))
    return argcheck.same_value(now, value)


def _comparable(value: Any) -> bool:
    """A value that compares by value in any process (its type is part of the comparison)."""
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_comparable(v) for v in value)
    return isinstance(value, _PLAIN)


@dataclasses.dataclass
class Loaded:
    function: Callable[..., Any]
    dispatchers: list
    #: seconds of the whole load, and of it waiting for Inductor's import
    seconds: float
    import_wait: float
    #: what the compile assumed of the dynamic sizes, checked per call (``size_guards.py``)
    size_guards: SizeGuards


def load(path: Path, fn: Callable, config: CompileConfig, what: str, args: tuple, kwargs: dict) -> Loaded | None:
    """The saved compile at ``path`` for the first call ``fn(*args, **kwargs)``, or None (missing,
    unusable or stale: logged) to compile."""
    from . import artifact

    if not path.exists():
        return None
    start = time.perf_counter()
    import_wait = wait_for_inductor()
    try:
        compiled, size_guards, baked = pickle.loads(path.read_bytes())
        if not isinstance(size_guards, SizeGuards) or not isinstance(baked, BakedValues):
            raise TypeError(f"holds {type(size_guards).__name__}, {type(baked).__name__} where the size guards "
                            f"and baked values belong")
        with artifact.loading(config) as dispatchers:
            aot_fn = _torch_compat.aot_load(compiled, fn.__globals__)
        function = _with_state_of(fn, _torch_compat.aot_function(aot_fn))
    except Exception as exc:  # noqa: BLE001 (another torch/GPU, a corrupt file: compile instead)
        log.warning("compileattn: warm-start cache %s unusable for %s (%s: %s); compiling", path, what,
                    type(exc).__name__, exc)
        return None
    changed = _sources_unchanged(aot_fn)
    if changed is not None:
        log.info("compileattn: source of %s changed since %s was saved; compiling %s", changed, path, what)
        return None
    differs = baked.first_difference(function.__globals__, frame_locals(fn, args, kwargs))
    if differs is not None:
        log.info("compileattn: %s: a value its trace baked in differs from %s's (%s); compiling", what, path, differs)
        return None
    return Loaded(function, dispatchers, time.perf_counter() - start, import_wait, size_guards)


def _with_state_of(fn: Callable, loaded: Callable) -> Callable:
    """Dynamo's loaded code with ``fn``'s own closure cells and defaults: the file holds pickled
    copies of the saving process's (the key describes a tensor among them by its shape only), and
    the compiled code reads them at every call, as the cold compile reads the live ones."""
    if loaded.__code__.co_freevars != fn.__code__.co_freevars:
        raise TypeError(f"the saved code closes over {loaded.__code__.co_freevars}, {fn.__qualname__} over "
                        f"{fn.__code__.co_freevars}")
    function = types.FunctionType(loaded.__code__, loaded.__globals__, loaded.__name__, fn.__defaults__,
                                  fn.__closure__)
    function.__kwdefaults__ = fn.__kwdefaults__
    return function


def frame_locals(fn: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The locals ``fn``'s frame starts with for this call, as Dynamo's guards name them: the
    arguments (defaults applied) and the closure variables."""
    names = fn.__code__.co_freevars
    f_locals = {name: cell.cell_contents for name, cell in zip(names, fn.__closure__ or ())
                if reach.cell_filled(cell)}
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    f_locals.update(bound.arguments)
    return f_locals


def save(path: Path, aot_fn, size_guards: SizeGuards, baked: "BakedValues", what: str) -> float | None:
    """Write the compile, what it assumed of the dynamic sizes and the values it baked in to
    ``path``; seconds taken, or None when it cannot be saved (logged)."""
    start = time.perf_counter()
    try:
        data = pickle.dumps((_torch_compat.aot_serialize(aot_fn), size_guards, baked))
    except Exception as exc:  # noqa: BLE001 (closure holding a module, unpicklable global, aot_eager pieces)
        log.info("compileattn: %s compiled but cannot be saved for a warm start (%s: %s)", what,
                 type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    if not save_or_log(path, data, f"{what} for a warm start"):
        return None
    log.info("compileattn: saved %s for a warm start to %s (%.1f MB)", what, path, len(data) / 2**20)
    return time.perf_counter() - start


# -- Inductor's import, ahead of time ------------------------------------------------------------

_preload: threading.Thread | None = None
_preload_lock = threading.Lock()


def preload_inductor() -> None:
    """Start importing Inductor in a background thread (once per process). The first compiled
    piece a process loads pays Inductor's import: ~2.7 s of the ~3 s warm start measured on the
    H200 (torch 2.11), so a program that decorates its model before building it and loading
    weights can overlap the two. ``wait_for_inductor`` joins before any compile or load, so
    Dynamo and Inductor are never imported from two threads at once."""
    global _preload
    with _preload_lock:
        if _preload is None and "torch._inductor.compile_fx" not in sys.modules:
            _preload = threading.Thread(target=_import_quietly, name="compileattn-import-inductor", daemon=True)
            _preload.start()


def _import_quietly() -> None:
    try:
        _torch_compat.import_inductor()
    except Exception as exc:  # noqa: BLE001 (the real import, later, raises it where it matters)
        log.debug("compileattn: background import of Inductor failed: %s", exc)


def wait_for_inductor() -> float:
    """Join the background import if one runs; the seconds waited (what it did not hide)."""
    thread = _preload
    if thread is None or not thread.is_alive():
        return 0.0
    start = time.perf_counter()
    thread.join()
    return time.perf_counter() - start
