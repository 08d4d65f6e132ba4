"""Launching a compiled Triton kernel through its C launcher, not ``JITFunction.run``.

``JITFunction.run`` binds every argument, builds the specialization key (each tensor's dtype and
16-byte alignment, each int's ``== 1`` / ``% 16`` / width), hashes it, looks the kernel up and
builds launch metadata before it reaches the compiled launcher: most of the Triton op's 27–44 µs
of host time per layer on the H200 (two launches with split-KV) against 7 µs for the flash path
(``benchmarks/results/op_overhead.md``). A prepared per-layer call fixes every argument but a few
(the query and output of ``attend(q, out)``), so the key can only change through those:
``DirectKernel`` keeps the compiled kernel per specialization of the free arguments and calls its
launcher with the current stream; a new specialization (or an active launch hook, e.g. a
profiler's) goes through ``run``, which compiles or finds that variant, so the fast path never
launches a kernel compiled for other arguments.

Only compiled kernels take this path; under the interpreter ``make_launch`` returns ``run`` itself.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import triton
from triton import knobs
from triton.runtime import driver

from . import _mode


#: Triton 3.6 keeps launch hooks in ``HookChain``s (always set, empty when unused); earlier
#: versions in plain attributes that are None when unused.
_HOOK_CHAINS = hasattr(knobs.runtime.launch_enter_hook, "calls")
#: The Triton whose ``CudaLauncher`` internals the scratch-free fast path was checked against.
_LAUNCHER_CHECKED = triton.__version__.startswith("3.6.")


def _hooks_active() -> bool:
    rt = knobs.runtime
    if _HOOK_CHAINS:
        return bool(rt.launch_enter_hook.calls or rt.launch_exit_hook.calls)
    return rt.launch_enter_hook is not None or rt.launch_exit_hook is not None


def _variant(kernel) -> tuple:
    """``(call, prefix)`` with ``call(gx, gy, gz, stream, *prefix, *args)`` launching ``kernel``.

    Triton's ``CudaLauncher.__call__`` first allocates global and profile scratch (two closures,
    three Python frames) and then calls its C ``launch``; a kernel that needs neither scratch is
    launched through ``launch`` directly, with what ``__call__`` would pass (Triton 3.6; other
    versions keep ``__call__``). Hooks are None here: a hooked launch goes through ``run``."""
    launcher = kernel.run
    if (_LAUNCHER_CHECKED and getattr(launcher, "global_scratch_size", None) == 0
            and getattr(launcher, "profile_scratch_size", None) == 0 and hasattr(launcher, "launch")):
        return launcher.launch, (kernel.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                                 kernel.packed_metadata, None, None, None)
    return launcher, (kernel.function, kernel.packed_metadata, None, None, None)


class DirectKernel:
    """One kernel with its grid, options and constexprs fixed, called with its positional
    arguments; ``free`` are the positions that may change from call to call (every other position
    must hold the same value on every call: it is not part of the key). One device: the one
    current at the first call (a prepared call serves one builder's caches)."""

    __slots__ = ("jit", "kwargs", "grid", "tail", "free", "variants", "device", "current_device", "current_stream")

    def __init__(self, jit, kwargs: dict, num_positional: int, free: tuple[int, ...], active=None):
        self.jit = jit
        self.kwargs = kwargs
        grid = tuple(kwargs["grid"]) + (1, 1)
        self.grid = grid[:3]
        # The launcher takes every parameter in order, constexprs included (it skips them).
        self.tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in jit.params[num_positional:])
        self.free = free
        #: specialization of the free arguments -> (call, prefix) (``_variant``)
        self.variants: dict[tuple, tuple] = {}
        self.device = None
        # What ``JITFunction.run`` asks too (torch's current device and raw stream, so a launch
        # during CUDA-graph capture goes to the capturing stream).
        active = active if active is not None else driver.active
        self.current_device, self.current_stream = active.get_current_device, active.get_current_stream

    def __call__(self, *args) -> None:
        # A refinement of Triton's specialization of each free argument (a tensor's dtype and
        # 16-byte alignment; an int's == 1 (a constant), % 16 and width): equal keys, same kernel.
        key = []
        for i in self.free:
            a = args[i]
            if isinstance(a, torch.Tensor):
                key.append((a.dtype, a.data_ptr() % 16 == 0))
            elif type(a) is int:
                key.append((a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31), a >= (1 << 63)))
            else:
                key.append((type(a), a))  # never a free argument of ours; keyed by value to stay exact
        key = tuple(key)
        variant = self.variants.get(key)
        if variant is None or _hooks_active():
            self._run(key, args)
            return
        call, prefix = variant
        g0, g1, g2 = self.grid
        call(g0, g1, g2, self.current_stream(self.device), *prefix, *args, *self.tail)

    def _run(self, key: tuple, args: tuple) -> None:
        """Through ``JITFunction.run`` (compiles or finds the variant), kept for the next call."""
        if len(args) + len(self.tail) != len(self.jit.params):
            raise TypeError(f"{self.jit.__name__}: {len(args)} positional arguments, the launch was prepared for "
                            f"{len(self.jit.params) - len(self.tail)}")
        kernel = self.jit.run(*args, **self.kwargs)
        if not _hooks_active():
            if self.device is None:
                self.device = self.current_device()
            self.variants[key] = _variant(kernel)


def make_launch(jit, kwargs: dict, num_positional: int, free: tuple[int, ...]) -> Callable[..., None]:
    """``launch(*positional)``: a ``DirectKernel`` for compiled kernels, ``jit.run`` bound to
    ``kwargs`` under the interpreter (where there is no compiled launcher)."""
    if _mode.interpreting():
        return functools.partial(jit.run, **kwargs)
    return DirectKernel(jit, kwargs, num_positional, free)
