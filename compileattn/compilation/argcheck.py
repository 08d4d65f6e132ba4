"""What a call of a ``@compileattn.compile`` function looked like, and whether a later call matches.

The compiled code runs with every Dynamo guard dropped (``warm_start``/``decorator``), so this is
the only check between a call and code traced for the first call: dtype, device, ndim, static
sizes, requires_grad, negative/conjugate view bits and contiguity of tensors (the exact strides
of a non-contiguous one without dynamic dims; with them, the strides as the trace expressed them
in the sizes), values of scalars, strings, dtypes and devices, dtype, shape and strides of numpy
arrays, identity of functions, types of other objects, containers item by item, grad mode, which
arguments were one and the same tensor (Dynamo traces such a tensor as one graph input: a later
call passing two tensors there would have both read from the first), also with a tensor held
outside the arguments (a model's parameter, a global: ``reach.held_elsewhere``), and which were
distinct (traced as two inputs: one tensor passed for both would not see the compiled code's
write into the other, checked for the tensors the first call wrote into, or may have:
inference-mode tensors have no version counter), whether such a tensor newly shares memory with
a model's parameter or buffer (``ModelTensors.storages``); and, once the compile is done, what
it assumed of the dynamic sizes (``size_guards.py``). torch's own guard filters
cannot replace it: ``keep_tensor_guards_unsafe`` checks tensors but not scalar values or grad mode, and
its failure is a ``RuntimeError`` naming ``L['x']`` from inside the guard manager; a change must
instead raise ``RecompileError`` naming the argument, before any kernel runs (with no check at all,
an int32 token-id input ran the code compiled for int64 and aborted the process on the CPU).

``key()`` of each spec is stable text for the warm-start cache key: a second process whose first
call differs in any checked way must not load code compiled for the first.
"""
from __future__ import annotations

import contextlib
import dis
import enum
import functools
import inspect
import math
import types
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from ..validation import byte_layout, layouts_overlap, overlaps
from .size_guards import SizeGuards


class RecompileError(RuntimeError):
    """A call differs from the first one in a way that would have made Dynamo recompile.

    ``@compileattn.compile`` skips Dynamo's guards, so it cannot recompile; the message names the
    argument and what changed.
    """


# ----------------------------------------------------------------------------------------------
# What a call looked like: one spec per argument, compared on every later call.


def _layout_rules(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple:
    """What Dynamo's trace of a non-contiguous tensor with a dynamic dim assumes of its strides
    (``ShapeEnv._compute_symbolic_stride``): a stride of 0 or 1 is that constant; one equal to
    ``size(j) * stride(j)`` of another dim may be traced as that product (whichever such ``j``
    Dynamo meets first: all of them are kept, which can only refuse more); any other is a symbol
    of its own, left to the size guards. (i, value) for a constant, (i, (j, ...)) for products."""
    rules = []
    for i, stride in enumerate(strides):
        if stride in (0, 1):
            rules.append((i, stride))
            continue
        products = tuple(j for j in range(len(shape)) if j != i and shape[j] * strides[j] == stride)
        if products:
            rules.append((i, products))
    return tuple(rules)


def _tensor_class(t: torch.Tensor) -> type:
    """The class a call's tensor is checked by: a subclass's own (its ``__torch_function__`` was
    traced, or not, into the compiled code), but a Parameter counts as a plain Tensor."""
    cls = t.__class__
    return torch.Tensor if cls is torch.nn.Parameter else cls


class _TensorSpec:
    __slots__ = ("cls", "dtype", "device", "ndim", "shape", "static", "dynamic", "requires_grad", "contiguous",
                 "strides", "layout", "neg", "conj")

    def __init__(self, t: torch.Tensor, dynamic: tuple[int, ...] = ()):
        self.cls = _tensor_class(t)
        self.dtype = t.dtype
        self.device = t.device
        self.ndim = t.dim()
        self.shape = tuple(t.shape)
        self.dynamic = dynamic
        self.static = tuple((i, s) for i, s in enumerate(self.shape) if i not in dynamic)
        self.requires_grad = t.requires_grad
        #: a negative or conjugate view (``z.conj().imag``, ``z.conj()``) is its memory read with a
        #: sign or conjugation that the tensor's dispatch keys carry: Inductor's code, traced with a
        #: plain tensor, reads the memory as is (Dynamo's guards compare the dispatch keys). Only a
        #: complex tensor can be a conjugate view: ``conj`` is None for the others (0.13 µs a check)
        self.neg = t.is_neg()
        self.conj = t.is_conj() if t.is_complex() else None
        self.contiguous = t.is_contiguous()
        #: a non-contiguous tensor is traced with its layout, which Inductor's code asserts and a CUDA
        #: graph reads: without dynamic dims its exact strides (Dynamo specialises them), with them
        #: the rules its strides follow in the sizes (``_layout_rules``)
        self.strides = tuple(t.stride()) if not self.contiguous and not dynamic else None
        self.layout = _layout_rules(self.shape, tuple(t.stride())) if not self.contiguous and dynamic else None

    def matches(self, v: Any) -> bool:
        # Ordered cheapest-first; ~1-2 µs per tensor on a slow CPU, device being the dearest.
        if (
            (v.__class__ is not self.cls and (not isinstance(v, torch.Tensor) or _tensor_class(v) is not self.cls))
            or v.dtype is not self.dtype
            or v.dim() != self.ndim
            or v.requires_grad is not self.requires_grad
            or v.is_neg() is not self.neg
            or (self.conj is not None and v.is_conj() is not self.conj)
            or v.device != self.device
        ):
            return False
        if self.static:
            shape = v.shape
            for i, s in self.static:
                if shape[i] != s:
                    return False
        if self.strides is not None:
            return v.stride() == self.strides
        if self.layout is not None:
            return self._broken_rule(v) is None
        return self.contiguous is False or v.is_contiguous()

    def _broken_rule(self, v: torch.Tensor) -> str | None:
        shape, strides = v.shape, v.stride()
        for i, rule in self.layout:
            if isinstance(rule, int):
                if strides[i] != rule:
                    return f"stride({i}) = {rule}"
            else:
                for j in rule:
                    if strides[i] != shape[j] * strides[j]:
                        return f"stride({i}) = size({j}) * stride({j})"
        return None

    def explain(self, v: Any) -> str:
        if not isinstance(v, torch.Tensor):
            return f"was a Tensor on the first call, now {type(v).__name__}"
        if _tensor_class(v) is not self.cls:
            return f"was a {self.cls.__qualname__} on the first call, now a {type(v).__qualname__}"
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
        for flag, what, resolve in (("neg", "negative", "resolve_neg"), ("conj", "conjugate", "resolve_conj")):
            was = getattr(self, flag)
            if was is not None and getattr(v, f"is_{flag}")() is not was:
                return (f"is {'not ' if was else ''}a {what} view (is_{flag}()) now, and was {'' if was else 'not '}"
                        f"on the first call (the compiled code reads its memory as the first call's); pass "
                        f"x.{resolve}()")
        if self.strides is not None:
            return (f"strides changed from {self.strides} to {tuple(v.stride())} (a non-contiguous argument without "
                    f"dynamic dims is compiled for its layout)")
        if self.layout is not None:
            return (f"has shape {tuple(v.shape)} and strides {tuple(v.stride())}, but the first call's layout (shape "
                    f"{self.shape}) was traced with {self._broken_rule(v)}, which the compiled code assumes")
        return "was contiguous on the first call, now is not"

    def describe(self) -> str:
        return f"Tensor{self.shape} {self.dtype} on {self.device}"

    def key(self) -> str:
        return (f"T({self.cls.__module__}.{self.cls.__qualname__},{self.dtype},{self.device},{self.ndim},"
                f"{self.static},{self.dynamic},{self.requires_grad},{self.contiguous},{self.strides},{self.layout}"
                f"{',neg' if self.neg else ''}{',conj' if self.conj else ''})")


_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
                torch.memory_format, enum.Enum)


class _ValueSpec:
    """Scalars and the like: Dynamo specializes on the value (``dynamic=False``), so must we."""

    __slots__ = ("type", "value")

    def __init__(self, v: Any):
        self.type = type(v)
        self.value = v

    def matches(self, v: Any) -> bool:
        return type(v) is self.type and (v is self.value or same_value(v, self.value))

    def explain(self, v: Any) -> str:
        if type(v) is not self.type:
            return f"type changed from {self.type.__name__} to {type(v).__name__} (value {v!r})"
        return f"value changed from {self.value!r} to {v!r}"

    def describe(self) -> str:
        return repr(self.value)

    def key(self) -> str:
        return f"V({self.type.__module__}.{self.type.__qualname__},{self.value!r})"


def same_value(now: Any, value: Any) -> bool:
    """Whether code that baked in ``value`` serves for ``now`` (of its type): equal, a float zero of
    the same sign (``0.0 == -0.0``, but ``1 / (x * scale)`` is +inf or -inf), or both NaN (equal to
    nothing, but baked in it computes the same)."""
    if bool(now == value):
        return not (isinstance(value, float) and value == 0) or math.copysign(1.0, now) == math.copysign(1.0, value)
    return isinstance(value, float) and now != now and value != value


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

    def key(self) -> str:
        return f"O({self.type.__module__}.{self.type.__qualname__})"


class _FunctionSpec:
    """A function (Python or builtin): the trace inlined the first call's, and Dynamo guards its
    identity, so a call must pass the same one (a lambda made per call is another each time).
    Held weakly where it can be."""

    __slots__ = ("type", "ref", "name")

    def __init__(self, v: Any):
        self.type = type(v)
        try:
            self.ref = weakref.ref(v)
        except TypeError:  # a builtin: lives as long as its module
            self.ref = lambda v=v: v
        self.name = _function_name(v)

    def matches(self, v: Any) -> bool:
        return v is self.ref()

    def explain(self, v: Any) -> str:
        if type(v) is not self.type:
            return f"type changed from {self.type.__qualname__} to {type(v).__qualname__}"
        return (f"is another function than on the first call ({_function_name(v)}, was {self.name}), "
                f"whose code the compiled code inlined")

    def describe(self) -> str:
        return f"<function {self.name}>"

    def key(self) -> str:
        return f"F({self.type.__qualname__},{getattr(self.ref(), '__module__', None)}.{self.name})"


def _function_name(v: Any) -> str:
    """A Python function's qualified name; a builtin's name (``torch.relu``'s qualified name is
    ``_VariableFunctionsClass.relu``)."""
    return v.__qualname__ if isinstance(v, types.FunctionType) else getattr(v, "__name__", repr(v))


class _ArraySpec:
    """A numpy array: Dynamo traces it as a tensor of its dtype, shape and strides (static), which
    Inductor's code assumes (a float64 array read as float32: wrong numbers, no error)."""

    __slots__ = ("type", "dtype", "shape", "strides")

    def __init__(self, v: Any):
        self.type = type(v)
        self.dtype = v.dtype
        self.shape = v.shape
        self.strides = v.strides

    def matches(self, v: Any) -> bool:
        return type(v) is self.type and v.dtype == self.dtype and v.shape == self.shape and v.strides == self.strides

    def explain(self, v: Any) -> str:
        if type(v) is not self.type:
            return f"type changed from {self.type.__qualname__} to {type(v).__qualname__}"
        for what in ("dtype", "shape", "strides"):
            if getattr(v, what) != getattr(self, what):
                return f"{what} changed from {getattr(self, what)} to {getattr(v, what)}"
        return "changed"

    def describe(self) -> str:
        return f"ndarray{self.shape} {self.dtype}"

    def key(self) -> str:
        return f"A({self.type.__module__}.{self.type.__qualname__},{self.dtype},{self.shape},{self.strides})"


def _is_array(v: Any) -> bool:
    """A numpy array (numpy is not imported for it: a process without it passes none)."""
    cls = type(v)
    return cls.__name__ == "ndarray" and cls.__module__ == "numpy"


class _ModuleSpec:
    """An ``nn.Module`` argument: the trace baked in that instance's attributes (and Dynamo would
    guard on them), so a call must pass the same instance; its parameters' values are read per
    call. Held weakly."""

    __slots__ = ("type", "ref")

    def __init__(self, v: torch.nn.Module):
        self.type = type(v)
        self.ref = weakref.ref(v)

    def matches(self, v: Any) -> bool:
        return v is self.ref()

    def explain(self, v: Any) -> str:
        if type(v) is not self.type:
            return f"type changed from {self.type.__qualname__} to {type(v).__qualname__}"
        return (f"is another {self.type.__name__} instance than on the first call, whose attributes the "
                f"compiled code holds; pass the same model (its parameters may change in place), or compile one "
                f"function per model")

    def describe(self) -> str:
        return f"<{self.type.__qualname__} instance>"

    def key(self) -> str:
        return f"M({self.type.__module__}.{self.type.__qualname__})"


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

    def key(self) -> str:
        return f"{self.type.__module__}.{self.type.__qualname__}[{','.join(spec.key() for spec in self.items)}]"


class _DictSpec:
    __slots__ = ("type", "items")

    def __init__(self, v: Mapping, items: dict):
        self.type = type(v)
        self.items = items

    def matches(self, v: Any) -> bool:
        # In the first call's key order: the trace iterated it in that order (``d.values()``, a
        # ``**kwargs`` passed on), and the compiled code keeps it.
        if type(v) is not self.type or len(v) != len(self.items):
            return False
        for (key, spec), k in zip(self.items.items(), v):
            if k != key or not spec.matches(v[key]):
                return False
        return True

    def explain(self, v: Any) -> str:
        if type(v) is not self.type:
            return f"type changed from {self.type.__name__} to {type(v).__name__}"
        if set(v) != set(self.items):
            return f"keys changed from {sorted(map(repr, self.items))} to {sorted(map(repr, v))}"
        if list(v) != list(self.items):
            return (f"key order changed from {list(self.items)} to {list(v)} (the compiled code iterates it in the "
                    f"first call's order)")
        key = next(k for k, spec in self.items.items() if not spec.matches(v[k]))
        return f"item [{key!r}]: {self.items[key].explain(v[key])}"

    def describe(self) -> str:
        return f"{self.type.__name__} of {len(self.items)}"

    def key(self) -> str:
        return (f"{self.type.__module__}.{self.type.__qualname__}"
                f"{{{','.join(f'{k!r}:{spec.key()}' for k, spec in self.items.items())}}}")


def _is_sequence(v: Any) -> bool:
    """Checked item by item (``_SeqSpec``), and walked for tensors passed twice (``tensor_places``):
    lists and tuples, their subclasses (``torch.Size``, named tuples) included, whose exact type
    is checked as well."""
    return isinstance(v, (tuple, list))


def _is_mapping(v: Any) -> bool:
    """Checked key by key (``_DictSpec``) and walked like a sequence: dicts and their subclasses
    (``OrderedDict``, ``defaultdict``), by exact type too."""
    return isinstance(v, dict)


def spec_of(v: Any, dynamic: tuple[int, ...] = ()):
    if isinstance(v, torch.Tensor):
        return _TensorSpec(v, dynamic)
    if isinstance(v, _VALUE_TYPES):
        return _ValueSpec(v)
    if isinstance(v, torch.nn.Module):
        return _ModuleSpec(v)
    if _is_array(v):
        return _ArraySpec(v)
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType)):
        return _FunctionSpec(v)
    if _is_sequence(v):
        return _SeqSpec(v, [spec_of(x) for x in v])
    if _is_mapping(v):
        return _DictSpec(v, {k: spec_of(x) for k, x in v.items()})
    return _TypeSpec(v)


def tensor_places(values: Mapping[str, Any]) -> tuple[tuple[tuple, ...], ...]:
    """The places (argument name, then the keys into its containers, as ``spec_of`` walks them)
    of each distinct tensor object, grouped per object. Dynamo dedupes a tensor passed in two
    places into one graph input and traces distinct tensors as distinct inputs; skipping its
    guards skips the ones that say so (``ArgChecker`` checks both)."""
    by_id: dict[int, list[tuple]] = {}
    for name, v in values.items():
        for path, leaf in leaves(v, (name,)):
            if isinstance(leaf, torch.Tensor):
                by_id.setdefault(id(leaf), []).append(path)
    return tuple(tuple(paths) for paths in by_id.values())


def overlapping_tensors(values: Mapping[str, Any], places: tuple[tuple[tuple, ...], ...]) -> frozenset[tuple[int, int]]:
    """Pairs (i, j), i < j, of the distinct tensors (``tensor_places``' order) that share memory:
    views of one buffer. Dynamo traces distinct tensors as distinct inputs, and the compiled code
    may read one after writing the other, or before (Inductor orders by its buffers, not by
    memory; a functionalized write lands at the end): a tensor the compiled code writes may share
    memory with no argument it did not share it with on the first call (``ArgChecker.check``)."""
    tensors = [value_at(values, group[0]) for group in places]
    return frozenset((i, j) for i in range(len(tensors)) for j in range(i + 1, len(tensors))
                     if overlaps(tensors[i], tensors[j]))


def _sharing(t: torch.Tensor, storages: Mapping[int, list] | None, others: list[tuple[str, Any]]) -> Iterator[str]:
    """The names of the tensors outside the arguments ``t`` shares memory with: the models'
    parameters and buffers (``storages``: ``ModelTensors.storages``, found by storage address, a
    dict lookup) and ``others`` ((name, tensor or whatever is there now), compared one by one)."""
    try:
        address = t.untyped_storage().data_ptr()
    except RuntimeError:  # no storage (a wrapper subclass): nothing to share
        return
    members = storages.get(address) if storages else None
    if members:
        layout = byte_layout(t)
        for device, held, name in members:
            if device == t.device and layouts_overlap(held, layout):
                yield name
    for name, other in others:
        if isinstance(other, torch.Tensor) and overlaps(other, t):
            yield name


def leaves(v: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Every value inside ``v`` that is not one of the containers the check walks item by item
    (``_is_sequence``, ``_is_mapping``), with the keys leading to it from ``path``."""
    if _is_sequence(v):
        for i, item in enumerate(v):
            yield from leaves(item, (*path, i))
    elif _is_mapping(v):
        for key, item in v.items():
            yield from leaves(item, (*path, key))
    else:
        yield path, v


def value_at(v: Any, path: tuple) -> Any:
    """What ``v`` holds at ``path`` (container keys; the arguments by name: a ``tensor_places`` path)."""
    for key in path:
        v = v[key]
    return v


def _shown_path(path: tuple) -> str:
    return path[0] + "".join(f"[{key!r}]" for key in path[1:])


_SELF = object()  # stands for the bound instance when binding a method's signature


class ArgChecker:
    """Compares each call's arguments with the first call's, by parameter name.

    Mapping positions and keywords to names needs ``Signature.bind`` (~10 µs), so it is done once
    per call *layout* (number of positional args + keyword names, in order) and cached as a flat
    list of (position or keyword, name, spec); a call then costs a dict lookup and one ``matches``
    per argument. Parameters a layout leaves at their default are compared with the first call
    once, when the layout is first seen.
    """

    def __init__(self, sig: inspect.Signature, bound_self: bool, specs: dict[str, Any], grad_enabled: bool,
                 tensors: tuple[tuple[tuple, ...], ...] = (), overlapping: frozenset[tuple[int, int]] = frozenset(),
                 held: tuple[tuple[tuple, str, Callable[[], Any]], ...] = (),
                 model_storages: Callable[[], Mapping[int, list]] | None = None,
                 other_tensors: tuple[tuple[str, Callable[[], Any]], ...] = (), name: str | None = None):
        """``model_storages``: the models' parameters and buffers by storage
        (``ModelTensors.storages``); ``other_tensors``: (where, read) of the other tensors the
        first call reached outside its arguments (``reach.other_tensors``): what a written
        argument must not come to share. ``name``: the function as a call the signature rejects
        names it (``bind``)."""
        self._sig = sig
        self._name = name
        self._bound_self = bound_self
        self._specs = specs
        self._grad_enabled = grad_enabled
        #: the places of each tensor of the first call, one group per tensor object (``tensor_places``)
        self._tensors = tensors
        #: groups of places that held one tensor on the first call
        self._same = tuple(group for group in tensors if len(group) > 1)
        #: pairs of indices into ``_tensors`` that shared memory on the first call (``overlapping_tensors``)
        self._overlapping = overlapping
        #: (path, where, read) of each argument tensor of the first call that was also held outside
        #: the arguments (``held_elsewhere``): later calls must pass what ``read()`` holds then
        self._held = held
        self._model_storages = model_storages
        self._other_tensors = other_tensors
        #: indices into ``_tensors`` of the tensors the compiled code writes into, and of those it may
        #: (no version counter to tell: inference-mode tensors), from the first call (``noting_writes``)
        self._written: frozenset[int] = frozenset()
        self._unknown: frozenset[int] = frozenset()
        #: (index into ``_tensors``, name) of each tensor outside the arguments (a model's, or one of
        #: ``_other_tensors``) that the first call's tensor shared memory with (``noting_writes``):
        #: not a new sharing when a later call's does (``_check_written_shared``)
        self._shared_at_first: frozenset[tuple[int, str]] = frozenset()
        #: per call layout: (position or keyword, name, spec) of each argument, and the size
        #: guards' check of that layout (None without guards)
        self._plans: dict[Any, tuple[list[tuple[int | str, str, Any]], Any]] = {}
        self._size_guards: SizeGuards | None = None

    def assume_sizes(self, guards: SizeGuards) -> None:
        """Check ``guards``, what the compile assumed of the dynamic dims (``size_guards.py``), on
        every call from now on."""
        self._size_guards = guards if guards else None
        self._plans.clear()

    @contextlib.contextmanager
    def noting_writes(self, args: tuple, kwargs: dict) -> Iterator[None]:
        """Around the first call: which tensors the compiled code writes into (their version
        counters move). From then on none of them may be passed as another argument too; distinct
        tensors that are only read may be one tensor later (it reads the same). A tensor without a
        version counter (made under ``torch.inference_mode()``) may have been written: it is held
        to the same rule."""
        before = self._tensor_versions(args, kwargs)
        yield
        after = self._tensor_versions(args, kwargs)
        self._unknown = frozenset(i for i, b in enumerate(before) if b is None)
        self._written = self._unknown | frozenset(i for i, (b, a) in enumerate(zip(before, after)) if a != b)
        self._shared_at_first = self._shared_outside(self._written, args, kwargs)
        self._plans.clear()

    def _shared_outside(self, indices: Iterable[int], args: tuple, kwargs: dict) -> frozenset[tuple[int, str]]:
        """(index into ``_tensors``, name) of each pair of a call's tensor of ``indices`` and a tensor
        outside the arguments (a model's parameter or buffer, or one of ``_other_tensors``) that
        share memory. Only for the tensors the first call wrote (the later check's), and after it:
        the models' storages are looked up only by functions that write an argument."""
        indices = list(indices)
        if not indices or (self._model_storages is None and not self._other_tensors):
            return frozenset()
        where = dict((name, src) for src, name in _argument_names(self._sig, self._bound_self, args, kwargs))
        outside = self._outside_now()
        return frozenset((i, name) for i in indices
                         for name in _sharing(self._value((where.get(self._tensors[i][0][0]), self._tensors[i][0]),
                                                          args, kwargs), *outside))

    def _outside_now(self) -> tuple[Mapping[int, list] | None, list[tuple[str, Any]]]:
        """(the models' tensors by storage, (name, what it holds now) of each other tensor reached):
        what ``_sharing`` compares a tensor with."""
        storages = self._model_storages() if self._model_storages is not None else None
        return storages, [(name, read()) for name, read in self._other_tensors]

    def _tensor_versions(self, args: tuple, kwargs: dict) -> list[int | None]:
        """The version counter of each tensor of the call (``_tensors``' order); None where a tensor
        has none (an inference-mode tensor)."""
        where = dict((name, src) for src, name in _argument_names(self._sig, self._bound_self, args, kwargs))
        versions = []
        for group in self._tensors:
            t = self._value((where.get(group[0][0]), group[0]), args, kwargs)
            try:
                versions.append(t._version)
            except RuntimeError:
                versions.append(None)
        return versions

    @property
    def other_tensors(self) -> tuple[tuple[str, Callable[[], Any]], ...]:
        """(where, read) of the tensors the first call reached outside its arguments that are not a
        model's parameters or buffers (``reach.other_tensors``)."""
        return self._other_tensors

    def strided(self) -> dict[str, int]:
        """name -> ndim of the arguments whose strides the trace may have made symbols (tensors
        traced with a layout rule, ``_TensorSpec.layout``), for ``SizeGuards.from_shape_env``."""
        return {name: spec.ndim for name, spec in self._specs.items()
                if isinstance(spec, _TensorSpec) and spec.layout is not None}

    def key(self) -> str:
        """Stable text of what the first call looked like (part of the warm-start cache key)."""
        specs = ";".join(f"{name}={spec.key()}" for name, spec in self._specs.items())
        same = f";same={[[_shown_path(p) for p in group] for group in self._same]}" if self._same else ""
        pairs = [[_shown_path(self._tensors[i][0]), _shown_path(self._tensors[j][0])]
                 for i, j in sorted(self._overlapping)]
        shared = f";overlapping={pairs}" if pairs else ""
        held = f";held={[[_shown_path(path), where] for path, where, _ in self._held]}" if self._held else ""
        return f"{specs};grad={self._grad_enabled}{same}{shared}{held}"

    def check(self, args: tuple, kwargs: dict) -> None:
        key = (len(args), *kwargs) if kwargs else len(args)
        layout = self._plans.get(key)
        if layout is None:
            layout = self._plans[key] = self._plan(args, kwargs)
        plan, sizes_hold, same, distinct, held, written = layout
        for src, name, spec in plan:
            v = args[src] if src.__class__ is int else kwargs[src]
            if not spec.matches(v):
                raise recompile_error(name, spec.explain(v))
        if distinct:
            sources, places = distinct
            ids = ({id(args[src] if src.__class__ is int else kwargs[src]) for src in sources} if sources
                   else {id(self._value(place, args, kwargs)) for place in places})
            if len(ids) < len(places):
                self._refuse_written_alias(places, args, kwargs)
            self._check_written_overlaps(places, args, kwargs)
        if written:
            self._check_written_shared(written, args, kwargs)
        for group in same:
            first = self._value(group[0], args, kwargs)
            for place in group[1:]:
                if self._value(place, args, kwargs) is not first:
                    default = " (left at its default)" if place[0] is None else ""
                    raise recompile_error(None, f"argument {_shown_path(place[1])!r}{default} was the same tensor "
                                                f"as {_shown_path(group[0][1])!r} on the first call, now is another: "
                                                f"the compiled code reads one input for both")
        for place, where, read in held:
            if self._value(place, args, kwargs) is not read():
                default = " (left at its default)" if place[0] is None else ""
                raise recompile_error(None, f"argument {_shown_path(place[1])!r}{default} was the same tensor as "
                                            f"{where} on the first call, now is another: the compiled code reads "
                                            f"one input for both (Dynamo traced them as one)")
        if sizes_hold is not None and not sizes_hold(args, kwargs):
            sources = {name: src for src, name, _ in plan}

            raise recompile_error(*self._size_guards.explain(
                lambda name: self._value((sources.get(name), (name,)), args, kwargs)))
        if torch.is_grad_enabled() is not self._grad_enabled:
            raise recompile_error(
                None, f"grad mode (torch.is_grad_enabled()) changed from {self._grad_enabled} to "
                f"{not self._grad_enabled}; use the same torch.no_grad()/inference_mode() as the first call")

    def check_before_loaded_call(self, args: tuple, kwargs: dict) -> None:
        """``check``, before a compile loaded from a warm start file serves its first call, with
        every argument taken for written: which ones the compiled code writes is known only after a
        call (``noting_writes``), and the compile that would refuse a written argument sharing
        memory with a model's tensor or a global (``piecewise.refuse_written_overlapping_inputs``)
        did not run in this process. A refusal here sends the call to a compile, which decides;
        only a first call passing a view of such a tensor pays that."""
        written, self._written = self._written, frozenset(range(len(self._tensors)))
        self._plans.clear()
        try:
            self.check(args, kwargs)
        finally:
            self._written = written
            self._plans.clear()

    def _refuse_written_alias(self, distinct: list, args: tuple, kwargs: dict) -> None:
        """Two of the first call's distinct tensors are one now: refused where the compiled code
        writes into one of them (it would not see its write through the other)."""
        ids = [id(self._value(place, args, kwargs)) for place in distinct]
        for i in sorted(self._written):
            for j, other in enumerate(ids):
                if j != i and other == ids[i]:
                    writes = ("which the compiled code may write into (it was made under inference mode: no "
                              "version counter told whether the first call wrote it)" if i in self._unknown
                              else "which the compiled code writes into")
                    raise recompile_error(None, f"argument {_shown_path(distinct[j][1])!r} is the same tensor "
                                                f"as {_shown_path(distinct[i][1])!r}, {writes}; they were two "
                                                f"tensors on the first call, traced as two inputs, so the write "
                                                f"would not be seen through the other")

    def _check_written_overlaps(self, distinct: list, args: tuple, kwargs: dict) -> None:
        """A tensor the compiled code writes shares no memory with another argument that it did not
        share on the first call: traced as distinct inputs, two views of one buffer see each
        other's writes in eager code, and in the compiled code only in the order it happened to
        keep (Inductor's code for ``d = y * 2; x.add_(1)``, traced with two buffers, gave 2y + 2
        for a ``y`` overlapping ``x``, as torch.compile's does). The compile refuses a write that
        the first call's overlapping inputs both see (``piecewise.refuse_written_overlapping_inputs``).
        ~1 µs per pair, paid only by functions that write an argument."""
        tensors = [self._value(place, args, kwargs) for place in distinct]
        for i in sorted(self._written):
            for j in range(len(tensors)):
                if j != i and (min(i, j), max(i, j)) not in self._overlapping and overlaps(tensors[i], tensors[j]):
                    written, other = _shown_path(distinct[i][1]), _shown_path(distinct[j][1])
                    raise RecompileError(f"compileattn.compile: argument {other!r} shares memory with {written!r}, "
                                         f"which the compiled code writes into; on the first call they shared none, "
                                         f"and the compiled code does not see the write through the other as eager "
                                         f"code would (torch.compile's guards miss this too). Pass tensors that "
                                         f"share no memory (clone one), or compile a separate instance for this "
                                         f"variant.")

    def _check_written_shared(self, written: list, args: tuple, kwargs: dict) -> None:
        """A tensor the compiled code writes shares no memory with a model's parameter or buffer
        (``ModelTensors.storages``) or another tensor the first call reached outside its arguments
        (a global, a closure variable: ``_other_tensors``) unless it was that tensor on the first
        call (``held_elsewhere``: one graph input) or shared memory with it then
        (``_shared_at_first``: the compile saw that, and refuses it where the code reads that tensor
        too, so what it compiled does not read it). Traced as distinct inputs, the compiled code
        reads the other tensor as it was before the write: ``w.mul_(2); m(x)`` with
        ``m.lin.weight`` passed as ``w`` returned ``m(x)`` of the old weight (eager: of the doubled
        one). A view of such a tensor written on the first call is refused by the compile
        (``piecewise.refuse_written_overlapping_inputs``: they are graph inputs too). Paid only by
        functions that write an argument: a storage address and a dict lookup per written argument
        (~1.7 µs each on the loaded 2-core CPU box), and a read and a storage address per other
        tensor reached (most models reach none), more only where storages match."""
        outside = self._outside_now()  # once per call, not per argument
        for i, place in written:
            for name in _sharing(self._value(place, args, kwargs), *outside):
                if (i, name) not in self._shared_at_first:
                    self._refuse_written_shared(place, name)

    @staticmethod
    def _refuse_written_shared(place: tuple, name: str) -> None:
        raise RecompileError(f"compileattn.compile: argument {_shown_path(place[1])!r}, which the compiled code "
                             f"writes into, shares memory with {name}; on the first call it shared none, and the "
                             f"compiled code reads that tensor as another input, without the write (torch.compile's "
                             f"guards miss this too). Pass a tensor of its own (clone it), or compile a separate "
                             f"instance for this variant.")

    def _value(self, place: tuple, args: tuple, kwargs: dict) -> Any:
        """The object at ``place``: (position, keyword, or None for an argument left at its default;
        the path of argument name and container keys)."""
        src, path = place
        if src.__class__ is int:
            v = args[src]
        elif src is None:
            v = self._sig.parameters[path[0]].default
        else:
            v = kwargs[src]
        return value_at(v, path[1:])  # the containers' structure matched the first call's (the specs)

    def _plan(self, args: tuple, kwargs: dict) -> tuple[list, Any, list, tuple | None, list, list]:
        names = _argument_names(self._sig, self._bound_self, args, kwargs, self._name)
        plan = [(src, name, self._specs[name]) for src, name in names if name in self._specs]
        where = dict((name, src) for src, name in names)
        # an argument left at its default is read as the default (``_value``'s None)
        groups = [[(where.get(path[0]), path) for path in group] for group in self._tensors]
        same = [group for group in groups if len(group) > 1]
        distinct = None
        if len(groups) > 1 and self._written:  # (top-level sources, read directly; or None) and the places
            places = [group[0] for group in groups]
            simple = all(src is not None and len(path) == 1 for src, path in places)
            distinct = ([src for src, _ in places] if simple else None, places)
        unexpected = [name for _, name in names if name not in self._specs]
        if unexpected:
            raise recompile_error(unexpected[0], "was not passed on the first call")
        passed = {name for _, name in names}
        for name, spec in self._specs.items():
            if name in passed:
                continue
            param = self._sig.parameters.get(name)
            if param is None or param.default is inspect.Parameter.empty:
                raise recompile_error(name, "was passed on the first call, now missing")
            if not spec.matches(param.default):
                raise recompile_error(name, f"now left at its default ({spec.explain(param.default)})")
        self._check_var_keyword_order(names)
        held = [((where.get(path[0]), path), held_where, read) for path, held_where, read in self._held]
        # written tensors that were not held outside the arguments on the first call (``_check_written_shared``)
        one_input = {path for path, _, _ in self._held}
        shared = self._model_storages is not None or self._other_tensors
        written = [(i, groups[i][0]) for i in sorted(self._written) if shared and groups[i][0][1] not in one_input]
        if self._size_guards is None:
            return plan, None, same, distinct, held, written
        defaults = {name: self._sig.parameters[name].default for name in self._specs if name not in passed}
        return (plan, self._size_guards.checker({name: src for src, name in names}, defaults), same, distinct, held,
                written)

    def _check_var_keyword_order(self, names: list) -> None:
        """``**kw``'s keys in the first call's order: its items are checked by name, but the trace
        iterated the dict (``kw.values()``, passed on as ``**kw``) in that order."""
        var_kw = next((p.name for p in self._sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        if var_kw is None:
            return
        prefix = f"{var_kw}["
        now = [name[len(prefix):-1] for _, name in names if name.startswith(prefix)]
        first = [name[len(prefix):-1] for name in self._specs if name.startswith(prefix)]
        if now != first:
            raise recompile_error(var_kw, f"key order changed from [{', '.join(first)}] to [{', '.join(now)}] (the "
                                          f"compiled code iterates it in the first call's order)")


def bind(sig: inspect.Signature, bound_self: bool, args: tuple, kwargs: dict,
         name: str | None = None) -> inspect.BoundArguments:
    """``sig.bind`` of a call (the instance stood in for when ``bound_self``). A call the signature
    rejects raises the TypeError Python would, naming the function as ``name()``: ``Signature.bind``
    alone says "got an unexpected keyword argument 'extra'" without saying whose."""
    try:
        return sig.bind(_SELF, *args, **kwargs) if bound_self else sig.bind(*args, **kwargs)
    except TypeError as exc:
        if name is None:
            raise
        raise TypeError(f"{name}() {exc}") from None


def _argument_names(sig: inspect.Signature, bound_self: bool, args: tuple, kwargs: dict, name: str | None = None):
    """(position or keyword, name) of every argument actually passed; raises the usual TypeError
    (``bind``'s, naming ``name``) for a call the signature rejects. ``*args`` items are named
    ``args[i]``, ``**kw`` items ``kw['key']``."""
    bound = bind(sig, bound_self, args, kwargs, name)
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


def all_arguments(sig: inspect.Signature, bound_self: bool, args: tuple, kwargs: dict,
                  name: str | None = None) -> dict[str, Any]:
    """name -> value of every parameter (defaults applied; ``*args``/``**kw`` items flattened); a
    call the signature rejects raises ``bind``'s TypeError naming ``name``."""
    bound = bind(sig, bound_self, args, kwargs, name)
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


def recompile_error(name: str | None, what: str) -> RecompileError:
    subject = f"argument {name!r} " if name is not None else ""
    return RecompileError(
        f"compileattn.compile: {subject}{what}. This would make Dynamo recompile, but "
        f"@compileattn.compile dispatches without Dynamo's guards and does not recompile: call it as on "
        f"the first call, list the varying dim in dynamic_arg_dims, or compile a separate instance for "
        f"this variant."
    )
