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

``param.data = other`` outside ``_apply`` registers nothing either, and keeps the parameter object
(and its ``_version``: torch's ``set_data`` preserves the version counter, so neither an identity
nor a version comparison tells; checked on torch 2.13): the parameter now reads other storage, or,
for ``w.data = w.t()`` of a square ``w``, the same address with other strides. A CUDA graph would
replay the old memory or layout: a stale answer, no error, on the decorator's direct path
(``replay.py``) and through Dynamo's code alike wherever the parameter was neither the first nor the
last. Comparing every parameter per step is what this module exists to avoid (~15 µs for 150
tensors' ``data_ptr`` in a Python loop on the repo's 2-core CPU box), so ``start`` also gives
``torch.nn.Parameter`` (a Python class without a ``__setattr__`` of its own on torch 2.13: it
inherits ``object``'s through ``torch.Tensor``) a ``__setattr__`` that makes the inherited
assignment and bumps the generation after a ``data`` one. Only parameters' attribute assignments
pay, ~130-180 ns each (``timeit``, best of 5 x 7 runs, same box: ``p.grad = None`` 48 -> ~175 ns,
``p.data = x`` 141 -> ~320 ns); a plain tensor's, a buffer's included, and Dynamo's and Inductor's
markers on fake or real tensors (neither is a ``Parameter``) run as before (``t.grad = None`` 48,
``t.data = x`` 140 ns, before and after), and ``torch.Tensor`` is left as it is. Subclasses of
``Parameter`` (``UninitializedParameter``, whose ``materialize`` assigns ``.data``, a library's own)
inherit it; one that defines its own ``__setattr__`` is seen wherever it calls
``super().__setattr__``. Pickling and ``copy.deepcopy`` of a parameter are unaffected
(``Parameter.__reduce_ex__`` / ``__deepcopy__``; a restored ``__dict__`` is assigned through it, and
counted only for a ``data`` key, which torch never writes there). Not seen: a parameter made from a
tensor subclass's instance (``nn.Parameter(t)`` returns ``t``'s own class, marked ``_is_param``, for
``isinstance`` only), and a ``.data`` assignment inside a compiled function, which Dynamo traces as
``set_`` without running any ``__setattr__`` (both checked on torch 2.13; the earlier
``torch.Tensor``-wide hook counted the first, not the second). Nothing is added to a step (attribute
reads, ``.data`` included, go nowhere near it). After one, the next call compares as after a
registration: ``model_tensors.py`` raises ``RecompileError`` for a changed layout (the transposed
square weight), a graph step captures again for a moved parameter. The count is process-wide, as for
registrations: code that assigns ``.data`` to some parameter every step makes every step of every
compiled model compare (the decorator's ~0.8 ms for a 32-layer tiny Llama, ``model_tensors.py``, and
the parameters' ~50 µs below) and leave the direct replay: slower, never wrong; use ``copy_``.

A parameter's in-place methods that give it other storage or another shape or strides
(``p.set_(other)``, ``p.as_strided_(...)``, ``p.t_()``, ``p.resize_(...)``: ``COUNTED_METHODS``) and
``torch.utils.swap_tensors(p, other)`` keep the object too and register nothing: on a parameter
neither first nor last, a graph step replayed the old storage or layout (a stale answer, no error:
``tests/test_replay_data.py``) and a step without graphs read a restrided weight in its old order or
failed inside Inductor's ``assert_size_stride``. ``set_`` bumps ``_version``, but so does every
in-place update a step serves as it is, and reading every parameter's version per step costs what
reading its address does; so ``start`` gives ``Parameter`` counting versions of those methods, each
wrapping what the name resolved to (``TensorBase``'s): ~0.11 µs more a call of one on a parameter
(``timeit``, same box: ``p.set_(x)`` 524 -> 626 ns, ``p.t_()`` 457 -> 567 ns), nothing for a plain
tensor's (``t.t_()`` 455 -> 453 ns) or for other methods, nothing a step. ``torch.utils.swap_tensors``
looks ``torch._C._swap_tensor_impl`` up at each of its calls, so ``start`` wraps that one
(``_torch_compat.set_swap_tensor_impl``), which counts a swap however the function was imported (on
torch 2.13 ``swap_tensors`` refuses a parameter that a compile in this process traced: a weak
reference from torch's tracing state outlives the compile). Not seen: those ops reached other than as a parameter's method
(``torch.Tensor.set_(p, x)``, ``torch.ops.aten.set_``, an ``out=p`` that resizes ``p``), a storage
resized under a parameter (``p.untyped_storage().resize_(n)``), and any of them inside a compiled
function (Dynamo traces the op and runs no Python method).

Buffers are plain tensors (``torch.nn.Buffer(t)`` returns one): ``buffer.data = other`` bumps
nothing. Graph steps do not need it: both paths compare every buffer the step's graph reads, its
address, shape and strides, at every step (``dispatch.py``, ``replay.py``: ~0.3-0.4 µs a buffer on
the direct path; a Llama reads one, OPT none), and raise ``CudaGraphAddressError`` for a moved,
reshaped or restrided one (``buffer.data = t``, ``buffer.set_(t)``, ``module._buffers[name] = t``,
``w.data = w.t()`` of a square buffer, ``b.data = b[:k]``). Steps without graphs need no address
(they read the buffer where it is), and every decorated call compares each buffer's dtype, shape,
strides and device (``model_tensors.py``).

What the hooks see: ``register_parameter`` / ``register_buffer`` / ``register_module`` and the
attribute assignments that call them, which covers ``load_state_dict(..., assign=True)`` and
constructing any module, a compile's ``GraphModule``s included: after one, every compiled model's
next graph step compares its parameters, once (a Python loop: ~50 µs for 291 parameters on the
repo's 2-core CPU box); every ``Module._apply`` (conversions, above); every ``.data`` assignment to
a parameter, call of a parameter's ``COUNTED_METHODS`` and ``torch.utils.swap_tensors`` (above). What
they do not see: ``.data`` assigned to a buffer or any other plain tensor, ``set_`` and in-place
restriding of one, writes into ``_parameters`` or ``_buffers``, and what the paragraphs above list. The decorator's per-call look at
two tensors of each model (``model_tensors.py``) bumps the generation itself (``note_moved``) when
those moved; the graph steps compare every buffer they read, address, shape and strides, each step
(``dispatch.py``, ``replay.py``), so for a buffer these raise as a moved argument does.

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

from .. import _torch_compat

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


#: ``torch.nn.Parameter``'s ``__setattr__`` before ``start`` (the inherited one, ``object``'s on torch 2.13)
_inherited_setattr = None


def _counting_setattr(self, name: str, value) -> None:
    """``torch.nn.Parameter.__setattr__``: the inherited assignment, then, for ``data``, a bump of
    the generation (module docstring), also where it raised part-way."""
    global generation
    if name != "data":
        _inherited_setattr(self, name, value)
        return
    try:
        _inherited_setattr(self, name, value)
    finally:
        generation += 1


_counting_setattr.counts_for_module_watch = True

#: The in-place methods that give a tensor other storage (``set_``, ``resize_`` past its storage) or
#: another shape or strides at the same address, which ``Parameter`` counts as it counts a ``.data``
#: assignment (module docstring): the aten ops tagged ``inplace_view`` on torch 2.13 (``as_strided_``,
#: ``resize_as_``, ``set_``, ``t_``, ``transpose_``, ``unsqueeze_``), their aliases and ``squeeze_``.
COUNTED_METHODS = ("set_", "as_strided_", "resize_", "resize_as_", "t_", "transpose_", "swapdims_", "swapaxes_",
                   "squeeze_", "unsqueeze_")


def _counting(method):
    """``method`` (``Module._apply``, a parameter's in-place method, or the swap of two tensors' C++
    halves) that bumps the generation once it returned, or raised part-way (a conversion of a model
    may have converted some submodules already)."""

    @functools.wraps(method)
    def counted(*args, **kwargs):
        global generation
        try:
            return method(*args, **kwargs)
        finally:
            generation += 1

    counted.counts_for_module_watch = True
    return counted


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
            _module.Module._apply = _counting(_module.Module._apply)
        _count_parameter_data()
        _count_parameter_changes()
        _started = True


def _count_parameter_data() -> None:
    """Give ``torch.nn.Parameter`` the counting ``__setattr__`` (module docstring), wrapping the one
    it resolves to now: its own if a torch version defines one, else the inherited one (which is
    what an assignment to a parameter ran before). ``torch.Tensor`` is left alone."""
    global _inherited_setattr
    cls = torch.nn.Parameter
    if getattr(cls.__setattr__, "counts_for_module_watch", False):
        return
    _inherited_setattr = cls.__setattr__
    cls.__setattr__ = _counting_setattr


def _count_parameter_changes() -> None:
    """Give ``torch.nn.Parameter`` counting ``COUNTED_METHODS``, each wrapping the one it resolves to
    now, and ``torch.utils.swap_tensors`` a counting swap (module docstring). ``torch.Tensor`` is
    left alone."""
    cls = torch.nn.Parameter
    for name in COUNTED_METHODS:
        method = getattr(cls, name)
        if not getattr(method, "counts_for_module_watch", False):
            setattr(cls, name, _counting(method))
    swap = _torch_compat.swap_tensor_impl()
    if not getattr(swap, "counts_for_module_watch", False):
        _torch_compat.set_swap_tensor_impl(_counting(swap))


def started() -> bool:
    return _started
