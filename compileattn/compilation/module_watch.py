"""A process-wide count of module registrations, so CUDA-graph steps notice a replaced parameter.

A CUDA graph reads every parameter at the address it had at capture. Replacing a parameter object
(``module.weight = nn.Parameter(w)``, ``load_state_dict(..., assign=True)``, a new submodule)
leaves the graphs reading the old tensor's memory: stale answers, no error. Comparing every
parameter's address on every step would catch it but costs ~21 µs a step for a Llama's 291
parameters even through torch's C++ helper (``torch._C._tensors_data_ptrs_at_indices_equal``,
~72 ns a tensor, H200 host, probe S18-4). Instead, torch's global module registration hooks bump
``generation`` whenever any module registers a parameter, buffer or submodule; a graph step
compares one integer with the generation it last checked and compares addresses only when it
moved, or when the first or last parameter input did (another instance of the model's class,
served from the same graph: ``dispatch.StepDispatcher``).

``module.to(...)``, ``.half()``, ``.cuda()`` and the like register nothing: they assign each
parameter's ``.data`` (or, with ``torch.__future__``'s conversion flags, swap tensors or write
``_parameters`` directly). All of them go through ``nn.Module._apply``, once per submodule, so
``start`` also wraps ``Module._apply`` to bump the generation after it: a conversion of part of a
model (``model.layers[3].half()``), which moves neither tensor the decorator looks at per call
(``model_tensors.py``), is compared at the next call like a registration. Subclasses that override
``_apply`` reach it through ``super()``.

``tensor.data = other`` outside ``_apply`` registers nothing either, and keeps the tensor object
(and its ``_version``: torch's ``set_data`` preserves the version counter, so neither an identity nor
a version comparison tells; checked on torch 2.13): the parameter or buffer now reads other
storage, or, for ``w.data = w.t()`` of a square ``w``, the same address with other strides. A CUDA
graph would replay the old memory or layout: a stale answer, no error, on the decorator's direct
path (``replay.py``) and through Dynamo's code alike wherever the tensor was neither the first nor
the last parameter. Comparing every parameter per step is what this module exists to avoid
(~15 µs for 150 tensors' ``data_ptr`` in a Python loop on the repo's 2-core CPU box), so ``start``
also gives ``torch.Tensor`` a ``__setattr__`` that bumps the generation after a ``data``
assignment: nothing is added to a step (attribute reads, ``.data`` included, go nowhere near it),
and an attribute assignment on any tensor costs ~130 ns more (``p.grad = None`` 52 -> 188 ns,
``t.data = x`` 140 -> 286 ns, same box). After one, the next call compares as after a
registration: ``model_tensors.py`` raises ``RecompileError`` for a changed layout (the transposed
square weight), a graph step captures again for a moved parameter and raises
``CudaGraphAddressError`` for a moved buffer. The count is process-wide, as for registrations:
code that assigns ``.data`` to some tensor every step makes every step of every compiled model
compare (the decorator's ~0.8 ms for a 32-layer tiny Llama, ``model_tensors.py``, and the
parameters' ~50 µs below) and leave the direct replay: slower, never wrong; use ``copy_``. A class
that defines its own ``__setattr__`` without calling ``super().__setattr__`` for ``data`` is not
seen.

What the hooks see: ``register_parameter`` / ``register_buffer`` / ``register_module`` and the
attribute assignments that call them, which covers ``load_state_dict(..., assign=True)`` and
constructing any module, a compile's ``GraphModule``s included: after one, every compiled model's
next graph step compares its parameters, once (a Python loop: ~50 µs for 291 parameters on the
repo's 2-core CPU box); every ``Module._apply`` (conversions, above); and every ``.data``
assignment to a tensor (above). What they do not see: ``torch.utils.swap_tensors``, ``t.set_(other)``
and in-place restriding (``as_strided_``), writes into ``_parameters`` or ``_buffers``. The
decorator's per-call look at two tensors of each model (``model_tensors.py``) bumps the generation
itself (``note_moved``) when those moved; the graph steps compare every buffer they read, each
step (``dispatch.py``, ``replay.py``), so for a buffer these raise as a moved argument does.

The hooks run just before torch stores the new tensor, so a replacement made on another thread
while a step runs can be counted before it lands and missed by that step's comparison; replace
weights between steps, on the thread that runs them. Under tensor parallelism each rank decides
alone: replace on every rank before the next step, since a rank that captures again runs its
collectives eagerly (the warm-up before capture) while a rank that replays launches them from its
graph, which NCCL does not pair (``parallel/group.py``, 2), and both would wait.

Installed once, at the first compile of a ``@compileattn.compile`` function (whose per-call look at
its models reads the count too, ``model_tensors.py``) or the first CUDA-graph step of any compiled
model (``start``), not at import: a library must not add global hooks to processes that never
compile. Each hook only adds one to an integer and keeps no reference to the module or tensor it
is shown.
"""
from __future__ import annotations

import functools
import threading

import torch
from torch.nn.modules import module as _module

#: Bumped by every parameter, buffer or submodule registration in the process (once ``start`` ran).
generation = 0

_started = False
_start_lock = threading.Lock()


def _count_registration(module, name, value) -> None:
    """The registration hook: returning None leaves the registered value as it is."""
    global generation
    generation += 1


def note_moved() -> None:
    """A parameter or buffer moved without a registration (``model_tensors.py`` saw it): graph
    steps compare their parameters with their capture, as after a registration."""
    global generation
    generation += 1


def _counting_apply(apply):
    """``Module._apply`` that bumps the generation once it returned (or raised part-way through a
    model: some submodules may be converted already)."""

    @functools.wraps(apply)
    def _apply(self, *args, **kwargs):
        try:
            return apply(self, *args, **kwargs)
        finally:
            note_moved()

    _apply.counts_for_module_watch = True
    return _apply


_object_setattr = object.__setattr__


def _counting_setattr(self, name: str, value) -> None:
    """``torch.Tensor.__setattr__``: the ordinary assignment, then, for ``data``, a bump of the
    generation (module docstring), also where it raised part-way."""
    global generation
    if name != "data":
        _object_setattr(self, name, value)
        return
    try:
        _object_setattr(self, name, value)
    finally:
        generation += 1


_counting_setattr.counts_for_module_watch = True


def start() -> None:
    """Install the hooks, once per process; later calls do nothing."""
    global _started
    if _started:
        return
    with _start_lock:
        if _started:
            return
        _module.register_module_parameter_registration_hook(_count_registration)
        _module.register_module_buffer_registration_hook(_count_registration)
        _module.register_module_module_registration_hook(_count_registration)
        if not getattr(_module.Module._apply, "counts_for_module_watch", False):
            _module.Module._apply = _counting_apply(_module.Module._apply)
        if "__setattr__" not in torch.Tensor.__dict__:  # torch.Tensor's is object's: nothing to wrap
            torch.Tensor.__setattr__ = _counting_setattr
        _started = True


def started() -> bool:
    return _started
