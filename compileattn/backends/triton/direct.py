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

Only compiled kernels take this path; under the interpreter ``make_launch`` calls ``run``.

**Before the first launch.** A variant's first launch compiles it (or loads it from Triton's disk
cache): on the H200 the KV write, decode and combine kernels took 0.35-0.40, 0.93-1.09 and
0.38 s in a cold start's first run (run S12-5), after the compile. A prepared call is bound
before the model runs (``set_forward_context`` builds the step's call table), with its free
arguments' likely values (``expect``: the query and output as their dtype, 16-byte aligned; the
KV write's head count and row strides as a contiguous projection has them); ``awaiting_specs`` turns
those variants into what ``triton.compile`` needs, which ``compilation/kernel_warmup.py``
compiles in other processes while Dynamo traces, and a first launch while they still compile
waits for them (``wait_for_ahead``) rather than compiling the same variant twice. A guess that
turns out wrong (a misaligned query) only means the launch compiles its own variant, as without.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from typing import Callable

import torch
import triton
from triton import knobs
from triton.runtime import driver

from . import _mode

logger = logging.getLogger("compileattn")

#: A prepared call's first launch of a variant slower than this (a compile, or a load from Triton's
#: disk cache) is logged at DEBUG: where a cold start's first run goes. Finding a compiled variant
#: takes tens of µs.
COMPILE_LOG_S = 1e-3

#: Triton 3.6 keeps launch hooks in ``HookChain``s (always set, empty when unused); earlier
#: versions in plain attributes that are None when unused.
_HOOK_CHAINS = hasattr(knobs.runtime.launch_enter_hook, "calls")
#: The Triton whose ``CudaLauncher`` internals the scratch-free fast path was checked against.
_LAUNCHER_CHECKED = triton.__version__.startswith("3.6.")


#: Prepared calls whose ``expect``ed variant has not been launched nor sent to be compiled ahead.
_awaiting: "weakref.WeakSet[DirectKernel]" = weakref.WeakSet()
#: Called (once) by the next first launch of a variant: waits for the compiles ahead in flight
#: (``compilation/kernel_warmup.py`` sets it).
_ahead_wait: Callable[[], None] | None = None
_ahead_lock = threading.Lock()


def _hooks_active() -> bool:
    """Launch hooks are set or Triton's debug mode is on: every launch then goes through ``run``,
    which calls the hooks and compiles debug variants. Triton's other per-call settings
    (instrumentation mode, pre-run hooks, the check that globals a kernel read are unchanged) are
    read by ``run`` only: a direct launch keeps what they were at its variant's first launch."""
    rt = knobs.runtime
    if rt.debug:
        return True
    if _HOOK_CHAINS:
        return bool(rt.launch_enter_hook.calls or rt.launch_exit_hook.calls)
    return rt.launch_enter_hook is not None or rt.launch_exit_hook is not None


def _keyed_ptxas_version(target) -> str | None:
    """The ptxas version this process's Triton keys its CUDA compiles on: read once per process
    (``get_ptxas_version``, cached at its first compile) from the ptxas ``TRITON_PTXAS_PATH``
    named then. torch points that variable at its own ptxas when Inductor compiles, so a process
    whose Triton compiled a kernel before keys on the other ptxas's version than a process
    started later would: ``compile_ahead`` files its variant under this one."""
    if target.backend != "cuda":
        return None
    from triton.backends.nvidia.compiler import get_ptxas_version

    return get_ptxas_version(target.arch)


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
    """One kernel with its grid, options, constexprs and every positional argument fixed except
    those at ``free``, which each call passes, in order. One device: the one current at the
    first call (a prepared call serves one builder's caches).

    The fixed tensors are baked in as device addresses: Triton's C launcher takes an int as a
    pointer as is, where for a tensor it calls ``data_ptr()`` and checks the address with
    ``cuPointerGetAttribute``, a Python call and a driver call per tensor argument (a decode
    launch has 12). A prepared call's fixed tensors are the builder's persistent buffers and the
    KV caches, which never move while it lives (CUDA graphs rely on the same), and the launch
    keeps them alive. The free tensors go by address too, after their key says they are CUDA
    tensors of the compiled dtype and alignment."""

    __slots__ = ("jit", "kwargs", "grid", "tail", "free", "args", "addresses", "variants", "device",
                 "current_device", "current_stream", "expected", "last", "__weakref__")

    def __init__(self, jit, kwargs: dict, args: tuple, free: tuple[int, ...], active=None):
        self.jit = jit
        self.kwargs = kwargs
        grid = tuple(kwargs["grid"]) + (1, 1)
        self.grid = grid[:3]
        # The launcher takes every parameter in order, constexprs included (it skips them).
        if len(args) > len(jit.params):
            raise TypeError(f"{jit.__name__}: {len(args)} positional arguments for {len(jit.params)} parameters")
        self.tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in jit.params[len(args):])
        self.free = free
        self.args = list(args)  # the tensors themselves: ``run`` binds them, and they stay alive
        self.addresses = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        #: specialization of the free arguments -> (call, prefix) (``_variant``)
        self.variants: dict[tuple, tuple] = {}
        self.device = None
        # What ``JITFunction.run`` asks too (torch's current device and raw stream, so a launch
        # during CUDA-graph capture goes to the capturing stream).
        active = active if active is not None else driver.active
        self.current_device, self.current_stream = active.get_current_device, active.get_current_stream
        #: the free arguments' likely values (``expect``), a tensor given as its dtype
        self.expected: tuple | None = None
        #: (what the free values were: a tensor's (dtype, is_cuda, address), an int's (None, value);
        #: call; the whole argument tuple) of the last keyed launch
        self.last: tuple | None = None

    def expect(self, *values) -> None:
        """The free arguments the first launch will likely pass (a tensor as its ``torch.dtype``:
        Triton's ``MockTensor``, 16-byte aligned), for ``awaiting_specs``."""
        if len(values) != len(self.free):
            raise TypeError(f"{self.jit.__name__}: expect takes {len(self.free)} values, got {len(values)}")
        self.expected = values
        if not self.variants:
            with _ahead_lock:
                _awaiting.add(self)

    def ahead_spec(self, target) -> dict:
        """What ``JITFunction.run`` would hand ``triton.compile`` for the expected variant on
        ``target`` (its binder and argument packing, as ``run`` calls them), plus the kernel's
        module and name: a plain-data spec ``compile_ahead.py`` compiles in another process,
        into the disk cache entry ``run`` then finds."""
        from triton import knobs
        from triton.compiler import make_backend
        from triton.runtime.jit import MockTensor, create_function_from_signature

        jit = self.jit
        args = list(self.args)
        for i, a in zip(self.free, self.expected):
            args[i] = MockTensor.wrap_dtype(a)
        kwargs = {k: v for k, v in self.kwargs.items() if k not in ("grid", "warmup")}
        kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        backend = make_backend(target)
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
        return {"module": jit.fn.__module__, "name": jit.fn.__name__, "signature": signature,
                "constexprs": constexprs, "attrs": attrs, "options": dict(options.__dict__), "target": target,
                "ptxas_version": _keyed_ptxas_version(target)}

    def __call__(self, *values) -> None:
        # Free values equal to the last launch's in everything its key and arguments read (a
        # tensor's dtype, device type and address, an int's value): the same variant and argument
        # tuple, with no key to build. A piece's CUDA graph hands the attention op the same query
        # and output every step; about half of this call's Python (6.1 -> 2.3 µs on the CPU box).
        last = self.last
        if last is not None and len(values) == len(last[0]) and not _hooks_active():
            specs, call, full = last
            for a, (dtype, cuda, value) in zip(values, specs):
                if dtype is None:
                    if type(a) is not int or a != value:
                        break
                elif (not isinstance(a, torch.Tensor) or a.data_ptr() != value or a.dtype is not dtype
                      or a.is_cuda is not cuda):
                    break
            else:
                g0, g1, g2 = self.grid
                call(g0, g1, g2, self.current_stream(self.device), *full)
                return
        # A refinement of Triton's specialization of each free argument (a tensor's dtype and
        # 16-byte alignment; an int's == 1 (a constant), % 16 and width): equal keys, same kernel.
        key, specs = [], []
        args = self.addresses.copy()
        for i, a in zip(self.free, values):
            if isinstance(a, torch.Tensor):
                address = a.data_ptr()
                dtype, cuda = a.dtype, a.is_cuda
                key.append((dtype, cuda, address % 16 == 0))
                specs.append((dtype, cuda, address))
                args[i] = address
            elif type(a) is int:
                key.append((a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31), a >= (1 << 63)))
                specs.append((None, None, a))
                args[i] = a
            else:
                raise TypeError(f"{self.jit.__name__}: argument {i} must be a tensor or an int, got {type(a).__name__}")
        key = tuple(key)
        variant = self.variants.get(key)
        if variant is None or _hooks_active():
            self._run(key, values)
            return
        call, prefix = variant
        full = (*prefix, *args, *self.tail)
        if len(values) == len(self.free):
            self.last = (tuple(specs), call, full)
        g0, g1, g2 = self.grid
        call(g0, g1, g2, self.current_stream(self.device), *full)

    def _run(self, key: tuple, values: tuple) -> None:
        """Through ``JITFunction.run`` (compiles or finds the variant), kept for the next call."""
        if not self.variants:
            with _ahead_lock:
                _awaiting.discard(self)
            wait_for_ahead()  # a compile ahead may be making this variant: wait rather than compile it too
        args = self.args.copy()
        for i, a in zip(self.free, values):
            args[i] = a
        start = time.perf_counter()
        kernel = self.jit.run(*args, **self.kwargs)
        seconds = time.perf_counter() - start
        if seconds >= COMPILE_LOG_S and key not in self.variants:  # not every call with hooks on
            logger.debug("triton %s: a new variant's first launch took %.3f s (compiled, or loaded from Triton's "
                         "cache)", self.jit.__name__, seconds)
        if not _hooks_active():
            if self.device is None:
                self.device = self.current_device()
            self.variants[key] = _variant(kernel)


def _take_awaiting() -> list:
    with _ahead_lock:  # other threads add (``expect``) and drop (a first launch) entries
        kernels = list(_awaiting)
        _awaiting.clear()
    return kernels


def has_awaiting() -> bool:
    """Whether a prepared call's expected variant awaits its first launch."""
    with _ahead_lock:
        kernels = list(_awaiting)
    return any(k.expected is not None and not k.variants for k in kernels)


def awaiting_specs(target, limit: int | None = None) -> list[dict]:
    """The ``ahead_spec`` of every prepared call not launched yet, once per distinct variant (at
    most ``limit`` variants: the calls of others stay awaiting); the calls taken no longer await
    (a later call asks again only for calls bound since). A call whose spec cannot be computed is
    left to its first launch, logged at DEBUG."""
    specs, seen = [], set()
    kernels = _take_awaiting()
    for i, kernel in enumerate(kernels):
        if kernel.variants or kernel.expected is None:
            continue
        if limit is not None and len(specs) >= limit:
            with _ahead_lock:
                _awaiting.update(k for k in kernels[i:] if not k.variants)
            break
        try:
            spec = kernel.ahead_spec(target)
        except Exception as exc:  # noqa: BLE001 (the first launch compiles it and raises there)
            logger.debug("triton %s: no spec to compile ahead (%s: %s); its first launch compiles it",
                         kernel.jit.__name__, type(exc).__name__, exc)
            continue
        key = repr({k: v for k, v in spec.items() if k != "target"})
        if key not in seen:
            seen.add(key)
            specs.append(spec)
    return specs


def set_ahead_wait(wait: Callable[[], None] | None) -> None:
    global _ahead_wait
    with _ahead_lock:
        _ahead_wait = wait


def wait_for_ahead() -> None:
    """Wait for the compiles ahead in flight, once: the first launch that calls it."""
    global _ahead_wait
    with _ahead_lock:
        wait, _ahead_wait = _ahead_wait, None
    if wait is not None:
        wait()


def make_launch(jit, kwargs: dict, args: tuple, free: tuple[int, ...],
                expect: tuple | None = None) -> Callable[..., None]:
    """``launch(*values)``: ``jit`` with ``args``, the positions ``free`` replaced by ``values``.
    A ``DirectKernel`` for compiled kernels; ``run`` under the interpreter (no compiled launcher).
    ``expect``: the free values the first launch will likely pass (``DirectKernel.expect``)."""
    if not _mode.interpreting():
        kernel = DirectKernel(jit, kwargs, args, free)
        if expect is not None:
            kernel.expect(*expect)
        return kernel
    run, template = functools.partial(jit.run, **kwargs), list(args)

    def launch(*values):
        call = template.copy()
        for i, a in zip(free, values):
            call[i] = a
        run(*call)
    return launch
