"""Full-decode steps replayed by ``@compileattn.compile`` itself, without running Dynamo's code.

A full-decode step through Dynamo's generated code gathers every parameter of the model as a graph
input (two dict lookups each), calls four ``torch._dynamo.utils`` helpers (profiler markers and
``call_size``) and calls the dispatcher with all of it, only for the dispatcher to replay a CUDA
graph that already holds every one of those addresses. That was ~8.6 of the ~9.9 µs a decorated
OPT-125m-shaped step cost on a 2-core CPU box (148 parameters; ``benchmarks/host_step.py``); on
the H200's host it left a full-decode step 20-24 µs above a bare ``CUDAGraph.replay()``.

The shortcut is taken only where it returns exactly what Dynamo's code would:

1. **Dynamo's code does nothing but gather and call** (``graph_call_of``, checked once per site):
   straight-line bytecode whose only calls are the compiled graph (our ``StepDispatcher``) and
   Dynamo's read-only helpers, and which stores nothing but its own locals. A forward whose trace
   left side effects for Dynamo to replay (an attribute or global written, a list appended to, a
   ``random`` call, an output object built) fails this, and keeps the ordinary path.
2. **The dispatcher would replay this full graph** (``StepDispatcher.full_replay_entry``): the
   step is a uniform decode at a size whose full graph was captured and has been replayed, through
   the same metadata builder and the same ``kv_caches`` mapping it already checked, and no module
   has registered a parameter, buffer or submodule, and no parameter has been assigned ``.data``,
   given other storage or layout in place (``set_``, ``as_strided_``, ...) or swapped, since the dispatcher last compared the parameters (``module_watch.py``: a step after one takes
   the ordinary path, which compares them and drops the graphs if one was replaced; a dropped
   graph is learned anew).
3. **The arguments are where they were** at that graph's first replay through the ordinary path
   (the one ``CapturedGraph.check`` compared with the capture): every tensor argument has the same
   data pointer, shape and strides (``argcheck`` has already pinned dtypes, devices and every
   non-tensor argument's value). Arguments of other kinds (containers, objects) keep the ordinary
   path for the site, since Dynamo's code reads through them. So is every other tensor the graph
   reads that is not a model's parameter: one that is neither an argument nor a parameter or
   buffer (a plain module attribute, a closure variable, a module global: ``reach.other_tensors``),
   and every buffer of the models, read through its owner's ``_buffers`` (``ModelTensors.buffers``):
   Dynamo's code gathers each afresh every call, and the ordinary path compares such graph inputs'
   addresses, shapes and strides every graph step and raises for a moved, reshaped or restrided one
   (``dispatch.py``). No hook sees every way a buffer moves (``module._buffers[name] = t``,
   ``buffer.set_(t)`` and ``buffer.data = t`` register nothing, and ``module_watch`` counts
   ``.data`` assignments and in-place changes of parameters only), so the direct path compares them itself, as the
   ordinary path does: each one's address, shape and strides (``buffer.data = buffer.t()`` of a
   square buffer, or ``buffer[:k]``, keeps the address), and a moved, reshaped or restrided one
   misses here and raises there. Cost:
   nothing for a model without buffers (OPT, ``others`` stays empty); for each buffer the graph
   reads, a reader call, a weakref call, a dict lookup, a ``data_ptr``, a ``shape`` and a
   ``stride()`` per step: ~0.33 µs a buffer by ``timeit`` on the repo's 2-core CPU box without the
   shape (~0.21 µs of it without the strides; the shape another ~0.09 µs; a Llama reads one,
   ``inv_freq``), against ~15 µs for the ``data_ptr`` of 150 parameters alike, which is why
   parameters are left to the count (2).
4. **The output is the graph's**: learned from an ordinary replay of the same graph, whose result
   must be built only of the graph's static output tensors (tuples as they are; lists rebuilt per
   call, as Dynamo's code would build a new one).

Anything that fails 2-4 on a given step runs the ordinary path, which raises or falls back as it
always did, with one exception: a step that would replay the same graph while an argument the graph
reads (its address is one of the graph's inputs) has moved raises ``CudaGraphAddressError``, as the
ordinary path does (``dispatch.py``: every graph step compares the inputs that are not parameters).
Parameters are compared by neither path at every step, only after a module registration, a
``.data`` assignment to a parameter or an in-place change of its storage or layout (2;
``module_watch.py`` counts them, ``t._version`` being left as it was by ``.data =``): the next call compares, the decorator every layout (``model_tensors.py``:
``w.data = w.t()`` of a square weight, which keeps the address and changes the strides, raises
``RecompileError``) and the ordinary path every parameter's address (a moved one: the graphs are
captured again). Buffers' addresses, shapes and strides are compared by both paths at every step (3).
Attribute reads and subscripts in Dynamo's code are assumed to have no side effects (``_modules``,
``_parameters`` and the graph's output tuple are plain containers).
"""
from __future__ import annotations

import dis
import sys
import weakref
from typing import Any, Callable

import torch

from .. import _torch_compat, context
from ..counters import counters
from .argcheck import _VALUE_TYPES
from .cudagraph import CudaGraphAddressError

#: What ``FullStepShortcut.step`` returns when the step must take the ordinary path.
MISS = object()

_GRAPH_PREFIX = "__compiled_fn"
_HELPER_MODULE = "__import_torch_dot__dynamo_dot_utils"
#: Functions of ``torch._dynamo.utils`` that Dynamo's code may call around the graph: profiler
#: markers and size/stride reads, none of which changes anything a step's result depends on.
_HELPERS = frozenset({"record_pregraph_bytecode_enter", "record_pregraph_bytecode_exit", "call_size",
                      "call_stride", "call_storage_offset"})

_NULL, _OTHER, _UTILS = object(), object(), object()


class _Unsupported(Exception):
    pass


def graph_call_of(fn: Callable[..., Any]) -> tuple[Any, str]:
    """(the compiled graph ``fn`` calls, "") if ``fn``'s bytecode only gathers values, calls that
    one graph and Dynamo's helpers, and returns; else (None, why not)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None, f"{type(fn).__name__} is not Dynamo's code as a plain function (frame path)"
    if sys.version_info < (3, 11):
        return None, f"Python {sys.version_info[0]}.{sys.version_info[1]}: bytecode check written for 3.11-3.13"
    try:
        name = _graph_call_name(code)
    except _Unsupported as exc:
        return None, str(exc)
    f_globals = getattr(fn, "__globals__", {})
    utils = _torch_compat.dynamo_utils_module()
    if f_globals.get(_HELPER_MODULE, utils) is not utils:
        return None, f"{_HELPER_MODULE} is not {utils.__name__}"
    if name not in f_globals:
        return None, f"the graph {name} is not among the code's globals"
    return f_globals[name], ""


def _graph_call_name(code) -> str:
    """Abstract interpretation of straight-line bytecode, tracking only which stack values are
    callables we allow; raises ``_Unsupported`` on anything else."""
    v312, v313 = sys.version_info >= (3, 12), sys.version_info >= (3, 13)
    stack: list = []
    local: dict[str, Any] = {}
    graph = None

    def pop():
        if not stack:
            raise _Unsupported("bytecode pops an empty stack (not understood)")
        return stack.pop()

    for ins in dis.get_instructions(code):
        op, arg, val = ins.opname, ins.arg, ins.argval
        if op in ("RESUME", "NOP", "PRECALL", "KW_NAMES", "COPY_FREE_VARS", "MAKE_CELL", "EXTENDED_ARG", "CACHE"):
            continue
        if op in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR"):
            stack.append(local.get(val, _OTHER))
        elif op == "LOAD_FAST_LOAD_FAST":
            stack += [local.get(val[0], _OTHER), local.get(val[1], _OTHER)]
        elif op == "STORE_FAST":
            local[val] = pop()
        elif op == "STORE_FAST_STORE_FAST":
            local[val[0]] = pop()
            local[val[1]] = pop()
        elif op == "STORE_FAST_LOAD_FAST":
            local[val[0]] = pop()
            stack.append(local.get(val[1], _OTHER))
        elif op == "DELETE_FAST":
            local.pop(val, None)
        elif op in ("LOAD_CONST", "LOAD_DEREF", "LOAD_CLOSURE"):
            stack.append(_OTHER)
        elif op == "LOAD_GLOBAL":
            obj = (("graph", val) if val.startswith(_GRAPH_PREFIX) else _UTILS if val == _HELPER_MODULE
                   else _OTHER)
            null = arg & 1
            if null and not v313:
                stack.append(_NULL)
            stack.append(obj)
            if null and v313:
                stack.append(_NULL)
        elif op in ("LOAD_ATTR", "LOAD_METHOD"):
            obj = pop()
            attr = ("helper", val) if obj is _UTILS and val in _HELPERS else _OTHER
            if op == "LOAD_METHOD" or (v312 and arg & 1):
                # A method load. Dynamo's helpers are module functions: NULL and the function.
                if attr is _OTHER:
                    raise _Unsupported(f"bytecode calls method {val!r}")
                stack += [attr, _NULL] if v313 else [_NULL, attr]
            else:
                stack.append(attr)
        elif op in ("CALL", "CALL_KW"):
            if op == "CALL_KW":
                pop()  # the keyword names
            for _ in range(arg):
                pop()
            upper, lower = pop(), pop()
            fn, null = (lower, upper) if v313 else (upper, lower)
            if null is not _NULL or not isinstance(fn, tuple):
                raise _Unsupported("bytecode calls something other than the graph and Dynamo's helpers")
            if fn[0] == "graph":
                if graph is not None:
                    raise _Unsupported("bytecode calls more than one graph")
                graph = fn[1]
            stack.append(_OTHER)
        elif op in ("BINARY_SUBSCR", "BINARY_SLICE", "BUILD_SLICE"):
            for _ in range({"BINARY_SUBSCR": 2, "BINARY_SLICE": 3}.get(op, arg)):
                pop()
            stack.append(_OTHER)
        elif op == "COPY":
            stack.append(stack[-arg])
        elif op == "SWAP":
            stack[-1], stack[-arg] = stack[-arg], stack[-1]
        elif op == "POP_TOP":
            pop()
        elif op == "PUSH_NULL":
            stack.append(_NULL)
        elif op in ("BUILD_TUPLE", "BUILD_LIST"):
            for _ in range(arg):
                pop()
            stack.append(_OTHER)
        elif op in ("LIST_EXTEND", "LIST_APPEND"):
            pop()
        elif op == "UNPACK_SEQUENCE":
            pop()
            stack += [_OTHER] * arg
        elif op in ("RETURN_VALUE", "RETURN_CONST"):
            if graph is None:
                raise _Unsupported("bytecode calls no graph")
            return graph
        else:
            raise _Unsupported(f"bytecode has {op} (only straight-line gathering and calls are understood)")
    raise _Unsupported("bytecode does not end in a return")


def _output_builder(out: Any, static: tuple) -> Callable[[], Any] | None:
    """A function giving what Dynamo's code returned (``out``), if that is built only of the
    graph's static output tensors (by identity) and None, in tuples and lists; else None."""
    ids = {id(t) for t in static if isinstance(t, torch.Tensor)}
    has_list = False

    def ok(v) -> bool:
        nonlocal has_list
        if v is None:
            return True
        if isinstance(v, torch.Tensor):
            return id(v) in ids
        if type(v) is tuple or type(v) is list:
            has_list |= type(v) is list
            return all(ok(x) for x in v)
        return False

    if not ok(out):
        return None
    if not has_list:
        return lambda: out

    def rebuild(v):
        if type(v) is list:
            return [rebuild(x) for x in v]
        if type(v) is tuple:
            return tuple(rebuild(x) for x in v)
        return v

    return lambda: rebuild(out)


def _moved(entry, src, ptr: int, now: torch.Tensor) -> CudaGraphAddressError:
    """A step that would replay ``entry`` with an argument the graph reads somewhere else: a replay
    would read the old memory, so this is an error, as on the ordinary path."""
    return CudaGraphAddressError(
        f"{entry.name}, size {entry.size}: argument {src!r} was at 0x{ptr:x} when this graph was first "
        f"replayed and is now at 0x{now.data_ptr():x} (shape {tuple(now.shape)}); the graph reads the old address. "
        f"Pass inputs that live in persistent buffers (slice views of one preallocated tensor), or turn CUDA "
        f"graphs off.")


class _Learned:
    __slots__ = ("entry", "nargs", "kwkeys", "tensors", "output", "others")

    def __init__(self, entry, nargs, kwkeys, tensors, output, others=()):
        self.entry, self.nargs, self.kwkeys, self.tensors, self.output = entry, nargs, kwkeys, tensors, output
        #: (read, address, strides) of the tensors outside the arguments the graph reads that are not
        #: parameters (``FullStepShortcut.others`` and ``.buffers``)
        self.others = others


class FullStepShortcut:
    """One compile site's direct replays of its dispatcher's full-decode graphs (see the module
    docstring for when ``step`` takes one), learned per size from ordinary replays (``run``)."""

    __slots__ = ("runtime", "learned", "tried", "others", "buffers")

    def __init__(self, runtime, others: tuple[tuple[str, Callable[[], Any]], ...] = (),
                 buffers: Callable[[], tuple[tuple[str, Callable[[], Any]], ...]] = tuple):
        self.runtime = runtime
        self.learned: dict[int, _Learned] = {}
        self.tried = weakref.WeakSet()  # graphs learned from, or found unfit, once each
        #: (where, read) of the tensors the first call reached outside its arguments that are not
        #: a model's parameters or buffers (``reach.other_tensors``): condition 3 of the module docstring
        self.others = others
        #: gives (where, read) of the models' buffers as they are now (``ModelTensors.buffers``):
        #: condition 3 of the module docstring
        self.buffers = buffers

    def step(self, args: tuple, kwargs: dict):
        """Replay and return the step's output, or ``MISS``."""
        ctx = context._current
        if ctx is None:
            return MISS
        md = ctx.metadata
        known = self.learned.get(md.num_tokens)
        if known is None or len(args) != known.nargs or (tuple(kwargs) if kwargs else ()) != known.kwkeys:
            return MISS
        entry = self.runtime.full_replay_entry(ctx)
        if entry is not known.entry:
            if known.entry.dropped:  # captured again (static pieces landed): learn it anew
                del self.learned[md.num_tokens]
            return MISS
        for src, ptr, shape, stride, read in known.tensors:
            t = args[src] if src.__class__ is int else kwargs[src]
            if t.data_ptr() != ptr or t.shape != shape or t.stride() != stride:
                if read and t.data_ptr() != ptr:
                    raise _moved(entry, src, ptr, t)
                return MISS  # reshaped in place: the ordinary path decides (argcheck, the pinned sizes)
        for read, ptr, shape, stride in known.others:
            t = read()
            if not isinstance(t, torch.Tensor) or t.data_ptr() != ptr or t.shape != shape or t.stride() != stride:
                return MISS  # rebound, replaced, given other storage, reshaped or restrided: the ordinary path raises
        counters.cudagraph_replays += 1
        counters.full_graph_steps += 1
        counters.full_graph_direct_steps += 1
        entry.graph.replay()
        return known.output()

    def run(self, fast: Callable[..., Any], full_args: tuple, args: tuple, kwargs: dict):
        """The ordinary path; if it replayed a full graph, learn that size's shortcut."""
        rt = self.runtime
        rt.replayed = None
        out = fast(*full_args, **kwargs)
        entry = rt.replayed
        if entry is not None:
            rt.replayed = None
            self._learn(entry, args, kwargs, out)
        return out

    def _learn(self, entry, args: tuple, kwargs: dict, out: Any) -> None:
        """Once per graph, from its first replay: the one whose inputs ``CapturedGraph.check``
        compared with the capture's (with ``check_input_addresses``), so a later step whose
        arguments moved misses here, as it should, rather than teaching a moved layout."""
        ctx = context._current
        if entry in self.tried or ctx is None or entry.size != ctx.metadata.num_tokens:
            return
        self.tried.add(entry)
        tensors = []
        graph_inputs = {ptr for _, ptr, _ in entry.layout}
        for src, v in [*enumerate(args), *kwargs.items()]:
            if isinstance(v, torch.Tensor):
                tensors.append((src, v.data_ptr(), v.shape, v.stride(), v.data_ptr() in graph_inputs))
            elif not isinstance(v, _VALUE_TYPES):
                return  # read through by Dynamo's code: not pinned by argcheck, not checkable here
        output = _output_builder(out, tuple(entry.outputs) if isinstance(entry.outputs, (tuple, list))
                                 else (entry.outputs,))
        if output is None:
            return
        others = []
        for _, read in (*self.others, *self.buffers()):
            t = read()
            if isinstance(t, torch.Tensor) and t.data_ptr() in graph_inputs:
                others.append((read, t.data_ptr(), t.shape, t.stride()))
        self.learned[entry.size] = _Learned(entry, len(args), tuple(kwargs), tuple(tensors), output, tuple(others))
