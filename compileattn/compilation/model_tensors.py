"""What a compile assumed of its models' parameters, buffers and submodules, checked per call.

``@compileattn.compile`` runs Dynamo's code without its guards, and those guards are what noticed
a model changed after its first call:

- converted: ``model.half()``, ``model.to(dtype)`` or ``.to(device)`` leave every parameter the same
  object with new storage of another dtype or device (``param.data = converted``: no registration
  hook runs, ``module_watch.py``). The compiled kernels then read the new storage as the old dtype:
  wrong numbers, no error, wherever no argument changed with the model (token ids stay int64);
- restructured: a submodule replaced by another (``model.norm = Norm(dtype=torch.float64)``, or an
  activation of another class), whose tensors the trace read with the old one's layout, or whose
  forward it never traced;
- untied: a tensor the model reached under two names (tied weights) is one graph input, read
  under its first name: the second name given a tensor of its own would never be read. Which
  tensors are the same is compared too (a tie made or undone), as the submodules are.

Comparing every parameter per call would cost what the guards cost (~21 µs for a Llama's 291 even
in torch's C++ helper, probe S18-4). So per call, three cheap looks:

1. ``module_watch.generation``, one integer: any parameter, buffer or submodule registered anywhere
   in the process since the last call (a replaced submodule registers itself; so does constructing
   any module, after which one call pays the full comparison below: ~0.8 ms for a 32-layer tiny
   Llama, 326 modules and 195 parameters, on the 2-core CPU box);
2. the addresses of two tensors of each model (its first and last parameter; buffers where it has
   none): a whole-model conversion moves every parameter (a dict lookup and ``data_ptr`` each: ~1.1
   µs for both on the CPU box with a test suite running beside it; ``benchmarks/host_step.py``'s
   direct-replay step moved by less than its run-to-run spread);
3. every buffer's dtype, shape, strides and device (a weakref call, a dict lookup and four reads
   each, ~0.37 µs for a tiny Llama's one
   buffer, ~0.09 of it the device, ``timeit`` on the 2-core CPU box at load 4; nothing for a model without buffers, OPT; a Llama has one): nothing counts a
   buffer's ``.data`` assignment (buffers are plain tensors, ``module_watch.py``), and on a step
   without CUDA graphs Inductor's kernels read a buffer given another dtype as the old one (float64
   as float32: a wrong answer, no error) and fail inside their ``assert_size_stride`` for other
   strides or shape. A buffer's address is the graph steps' to compare (``dispatch.py``,
   ``replay.py``); a step without graphs reads it where it is now.

A tensor reached outside the arguments that is no model's parameter or buffer (a plain module
attribute, a closure variable, a global: ``reach.other_tensors``, the list the argument check's
aliasing rules and the direct replays read too) is a graph input Dynamo's code reads at every call,
compiled for the first call's layout, and nothing counts its rebinding or ``.data`` assignment: so
every call compares its dtype, shape, strides and device too, as the buffers' (a reader call and
five reads each: ~0.5 µs a tensor, ``timeit`` of ``check`` on the 2-core CPU box at load 1.7, from
~0.5 to ~2.1 µs with three; nothing for a model reaching none: OPT and Llama reach only their
attention layers' ids, left out as ``layer_ids.is_layer_id``, whose values the compile bakes in).
Without it Inductor's code read float64 as float32 (a wrong answer, no error) and failed inside
``assert_size_stride`` for other strides or shape; a CUDA-graph step compares address, shape and
strides only, so ``t.data = t.view(torch.int32)`` was replayed. A difference raises
``RecompileError`` naming it. A module global rebound is refused even in the same layout: Dynamo's
ahead-of-time code kept reading the first call's tensor, no error (``reach.reads_a_global_name``;
one read and an identity a global).

Where any of looks 1-3 found a change, every submodule's class and every parameter's and buffer's dtype, device,
shape and strides, by name from the model, is compared with the first call's: a difference raises
``RecompileError`` naming it (a compile for the changed model would be a new instance's). Where only
addresses changed (``param.data = w`` with the same dtype, device, shape and strides), the compiled code
reads the new tensors by itself, and CUDA-graph steps are told to compare their captured addresses
(``module_watch.note_moved``: they capture again).

Another model put where the compiled code looks its model up at every call (a closure variable
of the decorated function, an attribute of a decorated method's instance that is not a module:
``reach.model_bindings``) is compared alike, per call one identity each.

A conversion of part of a model (``model.layers[3].half()``) moves neither watched tensor and
registers nothing, but goes through ``Module._apply``, which ``module_watch`` counts like a
registration; so is ``.data`` assigned to a parameter, a parameter's ``set_``, ``as_strided_``,
``t_`` and the like, and ``torch.utils.swap_tensors`` (``module_watch`` gives ``torch.nn.Parameter``
a counting ``__setattr__`` and counting in-place methods, and wraps the swap): a parameter of part
of a model given another dtype, device or strides that way (``w.data = w.t()`` of a square weight
keeps its address) is compared at the next call and refused. A buffer given another layout (``.data =``, ``set_``,
``as_strided_``, ``module._buffers[name] = t``) is refused at the next call by look 3, on every step;
one moved with its layout kept is served by a step without graphs and refused by a CUDA-graph step
(``CudaGraphAddressError``, which compares every buffer its graph reads). Not caught: what
``module_watch`` lists as not seen (``torch.ops.aten.set_(p, x)`` on a parameter of part of a
model, a storage resized under it): convert models before their first call. A replaced submodule
of the same class and tensor layouts is served with its own tensors, and the attribute values the
trace read from the old one (documented for every compile that skips guards).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch

from .. import layer_ids
from ..validation import byte_layout
from . import module_watch
from .argcheck import RecompileError
from .reach import reads_a_global_name


def _address(t: torch.Tensor) -> int | None:
    """Where ``t``'s data is; None for a tensor without storage (a wrapper subclass: quantized weights)."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


def _layout(t: torch.Tensor) -> tuple:
    """dtype, device, shape, and the strides (None for a size-1 dim's): Inductor's code assumes them
    (``assert_size_stride``, which leaves size-1 dims free), so a parameter given storage of its
    shape in another order (``w.data = w.t().contiguous().t()``) failed inside it, or with
    ``size_asserts`` off was read in the old order, no error."""
    return _layout_of(t.dtype, t.shape, t.stride(), t.device)


def _layout_of(dtype: torch.dtype, shape: torch.Size, stride: tuple, device: torch.device) -> tuple:
    return dtype, device, tuple(shape), tuple(s if size > 1 else None for size, s in zip(shape, stride))


class ModelTensors:
    """The submodules, parameters and buffers of the modules a compile baked in (the instance,
    modules among its arguments and closure, module globals its code reads, and those objects among
    them hold: ``reach.modules_in``), as the first call saw them. Holds the modules weakly."""

    __slots__ = ("_models", "_watched", "_generation", "_bindings", "_storages", "_buffers", "_buffer_layouts",
                 "others", "_other_layouts", "_globals")

    def __init__(self, models: Iterable[torch.nn.Module],
                 bindings: Iterable[tuple[str, Callable[[], Any], torch.nn.Module]] = (),
                 others: tuple[tuple[str, Callable[[], Any]], ...] = ()):
        """``bindings``: where the compiled code looks a model up again at each call
        (``reach.model_bindings``): another model put there is compared with the first call's.
        ``others``: (where, read) of the tensors reached outside the arguments that are no model's
        parameter or buffer (``reach.other_tensors``), whose layouts are compared every call
        (``check``; module docstring)."""
        module_watch.start()  # a submodule replaced from now on is counted
        #: ``others``, as given: the argument check and the direct replays read them too
        self.others = others
        #: [where, read, dtype, shape, strides, device] of each of ``others`` as the first call found it
        self._other_layouts = tuple([where, read, *_fast_layout(t)] for where, read, t in
                                    ((where, read, read()) for where, read in others)
                                    if isinstance(t, torch.Tensor) and not layer_ids.is_layer_id(t))
        #: (where, read, the tensor) of each of ``others`` that is a module global by name: compared
        #: by identity every call (``reach.reads_a_global_name``)
        self._globals = tuple((where, read, read()) for where, read in others if reads_a_global_name(read))
        #: (weakref to the model, {"submodule name" / "parameter name" / "buffer name": what it was}) per
        #: distinct model
        self._models: list[tuple[weakref.ref, dict[str, tuple]]] = []
        index: dict[int, int] = {}
        bindings = list(bindings)
        for model in (*models, *(model for _, _, model in bindings)):
            if id(model) not in index:
                index[id(model)] = len(self._models)
                self._models.append((weakref.ref(model), self._tensors_of(model)))
        #: (its name, what reads it, weakref to the model it holds, that model's index in ``_models``)
        self._bindings = tuple((name, read, weakref.ref(model), index[id(model)]) for name, read, model in bindings)
        #: (weakref to the owning module, its table, the tensor's name, address at the first call)
        self._watched: tuple[tuple[weakref.ref, str, str, int], ...] = ()
        #: (weakref to the owning module, the buffer's name, dtype, shape, strides, device) of every
        #: buffer of the models at the last comparison: compared every call (``_restrided``)
        self._buffer_layouts: tuple[tuple[weakref.ref, str, torch.dtype, torch.Size, tuple, torch.device], ...] = ()
        #: ``storages()``, built when first asked for; None again whenever ``_watch`` runs
        self._storages: dict[int, list[tuple[torch.device, tuple, str]]] | None = None
        #: ``buffers()``, built when first asked for; None again whenever ``_watch`` runs
        self._buffers: tuple[tuple[str, Callable[[], Any]], ...] | None = None
        self._watch()
        #: ``module_watch.generation`` when the models were last compared
        self._generation = module_watch.generation

    @staticmethod
    def _tensors_of(model: torch.nn.Module) -> dict[str, tuple]:
        """Every submodule's class and every parameter's and buffer's layout, by name: one walk of
        the module tree (``named_parameters`` and ``named_buffers`` would walk it twice more)."""
        found = {}
        first_name: dict[int, str] = {}
        for name, module in model.named_modules():
            found[f"submodule {name or '(the model)'}"] = (type(module),)
            prefix = f"{name}." if name else ""
            for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
                for leaf, t in table.items():
                    if t is not None:
                        found[f"{kind} {prefix}{leaf}"] = _layout(t)
                        first = first_name.setdefault(id(t), prefix + leaf)
                        if first != prefix + leaf:
                            found[f"tie of {kind} {prefix}{leaf}"] = (f"to {first}",)
        return found

    def storages(self) -> dict[int, list[tuple[torch.device, tuple, str]]]:
        """Storage address -> (device, ``byte_layout``, what it is) of each parameter and buffer of
        the models: what a written argument must not come to share (``ArgChecker``). Built when
        first asked for (only functions that write an argument ask, and a warm start's first
        call), and again after ``check`` found a registration or a watched tensor moved; between,
        ``param.data = w`` on a tensor that is not watched goes unseen (module docstring)."""
        if self._storages is None:
            found: dict[int, list[tuple[torch.device, tuple, str]]] = {}
            for ref, _ in self._models:
                model = ref()
                if model is None:
                    continue
                for kind, named in (("parameter", model.named_parameters), ("buffer", model.named_buffers)):
                    for name, t in named():
                        address = _address(t) if t.numel() else None
                        if address:  # storage of its own: not a wrapper subclass, a meta or an empty tensor
                            found.setdefault(t.untyped_storage().data_ptr(), []).append(
                                (t.device, byte_layout(t), f"{type(model).__qualname__}'s {kind} {name!r}"))
            self._storages = found
        return self._storages

    def buffers(self) -> tuple[tuple[str, Callable[[], Any]], ...]:
        """(where, read) of every buffer of the models, each read through its owner's ``_buffers``
        at each call (so a buffer given other storage, ``.data =``, ``set_``, ``swap_tensors``, or
        replaced in ``_buffers`` without a registration, reads as it is now; None once gone): what
        ``replay.FullStepShortcut`` compares per direct step, as the ordinary path compares the
        graph's buffer inputs (``dispatch.py``). Built when first asked for, and again after
        ``check`` found a registration or a watched tensor moved."""
        if self._buffers is None:
            found = []
            for ref, _ in self._models:
                model = ref()
                if model is None:
                    continue
                for path, module in model.named_modules():
                    for leaf, t in module._buffers.items():
                        if t is not None:
                            found.append((f"{type(model).__qualname__}'s buffer {path + '.' if path else ''}{leaf}",
                                          _buffer_reader(module, leaf)))
            self._buffers = tuple(found)
        return self._buffers

    def _watch(self) -> None:
        self._storages = None
        self._buffers = None
        watched = []
        for ref, _ in self._models:
            model = ref()
            if model is None:
                continue
            for table, named in (("_parameters", model.named_parameters), ("_buffers", model.named_buffers)):
                places = [(name, t, _address(t)) for name, t in named() if t is not None]
                places = [place for place in places if place[2] is not None]
                if places:
                    for name, address in {id(t): (name, a) for name, t, a in (places[0], places[-1])}.values():
                        owner_path, _, leaf = name.rpartition(".")
                        watched.append((weakref.ref(model.get_submodule(owner_path)), table, leaf, address))
                    break  # buffers only where the model has no parameter with storage
        self._watched = tuple(watched)
        self._buffer_layouts = tuple(
            (weakref.ref(module), leaf, *_fast_layout(t))
            for model in (ref() for ref, _ in self._models) if model is not None
            for module in model.modules() for leaf, t in module._buffers.items() if t is not None)

    def check(self) -> None:
        """Per call: the models where the compiled code finds them, nothing registered and the
        watched tensors where they were; else compare everything (module docstring)."""
        for i, (_, read, ref, _) in enumerate(self._bindings):
            if read() is not ref():
                self._rebound(i)
        for where, read, first in self._globals:
            if read() is not first:
                raise RecompileError(
                    f"compileattn.compile: {where} holds another tensor than at the first call, which the compiled "
                    f"code keeps reading (it runs with its own copy of the module globals): update the first one in "
                    f"place (t.copy_(new))")
        for record in self._other_layouts:
            where, read, dtype, shape, stride, device = record
            t = read()
            if (not isinstance(t, torch.Tensor) or t.dtype is not dtype or t.shape != shape or t.stride() != stride
                    or t.device != device):
                _check_other(record, t)
        registered = module_watch.generation != self._generation
        if not registered and not self._moved() and not self._restrided():
            return
        self._compare_all()
        if not registered:  # graph steps compare their parameters after a registration by themselves
            module_watch.note_moved()
        self._watch()
        self._generation = module_watch.generation

    def _moved(self) -> bool:
        """Whether a watched tensor is not where it was."""
        for ref, table, name, address in self._watched:
            owner = ref()
            if owner is None:
                continue  # the model is gone: its compiled code cannot run either
            try:
                if getattr(owner, table)[name].data_ptr() != address:
                    return True
            except (KeyError, AttributeError, RuntimeError):  # gone, None, or without storage now
                return True
        return False

    def _restrided(self) -> bool:
        """Whether a buffer has another dtype, shape, strides or device than at the last comparison
        (module docstring: nothing counts a buffer's ``.data`` assignment)."""
        for ref, leaf, dtype, shape, stride, device in self._buffer_layouts:
            owner = ref()
            if owner is None:
                continue  # the model is gone: its compiled code cannot run either
            t = owner._buffers.get(leaf)
            if t is None or t.dtype is not dtype or t.shape != shape or t.stride() != stride or t.device != device:
                return True
        return False

    def _rebound(self, i: int) -> None:
        """Another object where binding ``i`` held its model (``model = load(...)`` again in the
        function whose closure it is, a runner's ``self.model = other``): Dynamo's code runs with
        it. Refused unless it is a model of the same submodule classes and tensor layouts, which is
        then served with its own tensors (and the attribute values the trace read from the first,
        as for a replaced submodule), watched from now on; CUDA-graph steps capture again."""
        name, read, _, index = self._bindings[i]
        now = read()
        first = self._models[index][1]
        if not isinstance(now, torch.nn.Module):
            raise _changed(None, name, f"held a {first['submodule (the model)'][0].__qualname__} at the first call "
                                       f"and holds a {type(now).__qualname__} now")
        _refuse_changes(type(now), first, self._tensors_of(now), f"{name} holds another model than at the first call:")
        self._models[index] = (weakref.ref(now), first)
        self._bindings = (*self._bindings[:i], (name, read, weakref.ref(now), index), *self._bindings[i + 1:])
        self._watch()
        module_watch.note_moved()

    def _compare_all(self) -> None:
        for ref, first in self._models:
            model = ref()
            if model is not None:
                _refuse_changes(type(model), first, self._tensors_of(model))


def _fast_layout(t: torch.Tensor) -> tuple:
    """dtype, shape, strides and device as ``ModelTensors.check`` compares them per call."""
    return t.dtype, t.shape, t.stride(), t.device


def _check_other(record: list, now: Any) -> None:
    """A tensor of ``ModelTensors.others`` (a plain module attribute, a closure variable, a global)
    differs from the first call's at a per-call look: Dynamo's code reads it at every call, and its
    Inductor code assumes the first call's layout: float64 read as float32 (a wrong answer, no error), other strides or shape failing
    inside ``assert_size_stride``, or read in the old order without it. Only the strides of size-1
    dims are free, as for Inductor (``_layout``): the record takes them. Else ``RecompileError``."""
    where, _, dtype, shape, stride, device = record
    if isinstance(now, torch.Tensor):
        was, is_ = _layout_of(dtype, shape, stride, device), _layout(now)
        if was == is_:
            record[2:] = _fast_layout(now)
            return
        strides = was[:-1] == is_[:-1]  # only they differ
        what = f"was {_shown(was, strides)} at the first call and is {_shown(is_, strides)} now"
    else:
        what = f"was a tensor at the first call and is {'absent' if now is None else f'a {type(now).__qualname__}'} now"
    raise RecompileError(
        f"compileattn.compile: {where} {what}. The compiled code reads it at every call as a tensor of the first "
        f"call's dtype, shape, strides and device (Dynamo's guards, which would have recompiled, are skipped): "
        f"update it in place (t.copy_(new)), or put a tensor of that layout there")


def _buffer_reader(owner: torch.nn.Module, leaf: str) -> Callable[[], Any]:
    ref = weakref.ref(owner)

    def read():
        module = ref()
        return None if module is None else module._buffers.get(leaf)

    return read


def _refuse_changes(cls: type, first: dict[str, tuple], now: dict[str, tuple], subject: str | None = None) -> None:
    """Raise ``RecompileError`` naming the first difference between a model's tables (``_tensors_of``)."""
    changed = [name for name, was in first.items() if now.get(name) != was]
    changed += [name for name in now if name not in first]
    if changed:
        name = changed[0]
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        was, is_ = first.get(name), now.get(name)
        strides = was is not None and is_ is not None and was[:-1] == is_[:-1]  # only they differ
        what = f"was {_shown(was, strides)} at the first call and is {_shown(is_, strides)} now"
        raise _changed(cls, f"{name}{more}", what, subject)


def _shown(what: tuple | None, strides: bool = False) -> str:
    if what is None:
        return "absent"
    if len(what) == 1:
        return what[0] if isinstance(what[0], str) else f"a {what[0].__qualname__}"
    dtype, device, shape, _ = what
    shown = f"{dtype} {shape} on {device}"
    if strides:
        return f"{shown} with strides {what[3]}"
    return shown


def _changed(cls: type | None, name: str, what: str, subject: str | None = None) -> RecompileError:
    owner = f"{cls.__qualname__}'s " if cls is not None else ""
    subject = f"{subject} " if subject else ""
    return RecompileError(
        f"compileattn.compile: {subject}{owner}{name} {what}. The compiled code was made for the "
        f"model as its first call found it and reads its tensors as such (Dynamo's guards, which would have "
        f"recompiled, are skipped): convert or move the model before its first call, or compile a new instance")
