"""CUDA graphs: capture per size into one shared pool, replay, check addresses. Nothing else: which
mode a step runs in is decided by the dispatcher (``dispatch.py``).

Graph replay reads its inputs from the addresses they had at capture. Nothing is copied in: the
pieces' inputs are the model's persistent input buffers, its parameters and the previous piece's
static outputs, so copying would only cost time. The price is that a caller who passes a tensor
at a new address would silently get results computed from the old one, which is how stale
addresses corrupted outputs in vLLM when its check ran only at debug level. Here the check runs
on the first replay of every size in every mode and raises ``CudaGraphAddressError``.

Outputs of a replay are the graph's static tensors: they are overwritten by the next replay of
the same size, as with any CUDA-graph runtime.

A 0-dim CPU tensor input (a Python scalar Dynamo passes as a graph input) is not read by address:
capturing reads its value on the host (``.item()``, or aten wrapping it as a scalar operand) and
bakes it into the kernel launches, so every replay computes with the value of the capture. Such
inputs are compared by value on the first replay; the dispatcher compares them every graph step
and captures again for another value (``dispatch.py``). Under simulated graphs every tensor is on
the CPU, so a model's 0-dim buffer is taken for a scalar here too.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from .. import _torch_compat
from ..counters import counters

logger = logging.getLogger("compileattn")


class CudaGraphAddressError(RuntimeError):
    """A captured graph's input no longer lives at the address it was captured with."""


def _is_scalar(a: Any) -> bool:
    """A 0-dim CPU tensor: a captured graph holds its value, not its address (module docstring)."""
    return isinstance(a, torch.Tensor) and a.dim() == 0 and a.device.type == "cpu"


def _tensor_layout(args: Sequence[Any]) -> list[tuple[int, int, tuple[int, ...]]]:
    return [(i, a.data_ptr(), tuple(a.shape)) for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and not _is_scalar(a)]


def _scalar_values(args: Sequence[Any]) -> list[tuple[int, Any]]:
    return [(i, a.item()) for i, a in enumerate(args) if _is_scalar(a)]


class CapturedGraph:
    __slots__ = ("graph", "outputs", "layout", "scalars", "checked", "name", "size", "dropped", "__weakref__")

    def __init__(self, graph, outputs, layout, name: str, size: int, scalars=()):
        self.graph = graph
        self.outputs = outputs
        self.layout = layout
        #: (position, value) of the 0-dim CPU inputs at capture, which the graph holds by value
        self.scalars = scalars
        self.checked = False
        self.name = name
        self.size = size
        #: its wrapper let it go (``CUDAGraphWrapper.forget``): whoever kept it must not replay it
        self.dropped = False

    def check(self, args: Sequence[Any]) -> None:
        """Inputs must sit where, and be shaped as, they were at capture: a replay reads them there."""
        for i, ptr, shape in self.layout:
            now, now_shape = args[i].data_ptr(), tuple(args[i].shape)
            if now != ptr:
                raise CudaGraphAddressError(
                    f"{self.name}, size {self.size}: input {i} was captured at 0x{ptr:x} but is now at "
                    f"0x{now:x}; a CUDA graph would read stale memory. Pass inputs that live in persistent "
                    f"buffers (slice views of one preallocated tensor), or turn CUDA graphs off."
                )
            if now_shape != shape:
                raise CudaGraphAddressError(
                    f"{self.name}, size {self.size}: input {i} was captured with shape {shape} but has "
                    f"{now_shape}; the step's inputs must hold metadata.num_tokens tokens."
                )
        for i, value in self.scalars:
            if args[i].item() != value:
                raise CudaGraphAddressError(
                    f"{self.name}, size {self.size}: scalar input {i} (a 0-dim CPU tensor) was captured as "
                    f"{value!r} but is now {args[i].item()!r}; a CUDA graph replays the value it was captured with. "
                    f"Drop this size's graph (CUDAGraphWrapper.forget) to capture it again.")
        self.checked = True


def _copy_results(outputs: Any, values: Any) -> None:
    """Write a run's results ``values`` into a graph's static ``outputs``: the tensors among them,
    in a tensor or any nesting of tuples, lists and dicts (pytree leaves; the pieces and the split
    graph return a flat tuple, a step function may return more)."""
    with torch.no_grad():  # a copy under grad mode would hang the warm-up's autograd graph on the outputs
        for o, v in zip(_torch_compat.tree_leaves(outputs), _torch_compat.tree_leaves(values)):
            if isinstance(o, torch.Tensor) and not (o.data_ptr() == v.data_ptr() and o.stride() == v.stride()):
                o.copy_(v)  # (an output that is a view of an argument is the warm-up's, in place)


class GraphPool:
    """One memory pool shared by every graph of one compiled model, and the bookkeeping of it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.handle = torch.cuda.graph_pool_handle()
        self.capture_seconds = 0.0
        #: Graphs dropped for good (``retire``), kept so the pool stays alive.
        self.retired: list = []
        #: Whether a capture ran under ``torch.inference_mode()``: its outputs, and the tensors
        #: between pieces that the eager attention writes into, are then inference tensors, which
        #: refuse in-place writes outside inference mode, so later steps replaying these graphs run
        #: in it (``dispatch``). Allocating them as normal tensors instead would fail the pieces'
        #: own writes into what the caller made under inference mode (KV caches).
        self.inference_outputs = False

    def capture(self, fn: Callable[..., Any], args: Sequence[Any], name: str, size: int) -> CapturedGraph:
        """Run the step once (the warm-up: JIT compiles, allocator settles), capture, and give the
        capture's outputs the warm-up's results (a capture records kernels without running them).

        The warm-up is the step's only run. Replaying the new graph to make its outputs real would
        run the step a second time, and a step that updates memory it also reads (a counter buffer,
        ``h += attn_out`` on the previous piece's output, an argument updated in place) would then
        answer, and leave that memory, as after two steps."""
        start = time.perf_counter()
        values = fn(*args)
        graph, outputs = self._record(fn, args, values)
        _copy_results(outputs, values)
        del values
        self.retired.clear()  # the new graph keeps the pool alive now (``retire``)
        self.inference_outputs |= torch.is_inference_mode_enabled()
        elapsed = time.perf_counter() - start
        self.capture_seconds += elapsed
        counters.cudagraph_captures += 1
        logger.info("captured %s for %d tokens in %.1f ms (graph pool now %.1f MiB)", name, size,
                    elapsed * 1e3, self.pool_bytes() / 2**20)
        # Unchecked until its first replay: that is when a caller's moved input would bite.
        return CapturedGraph(graph, outputs, _tensor_layout(args), name, size, _scalar_values(args))

    def _record(self, fn: Callable[..., Any], args: Sequence[Any], values: Any) -> tuple[Any, Any]:
        """(the graph of ``fn`` on ``args``, its static outputs), recorded, not run."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # "thread_local": in the default "global" mode an unsafe CUDA call from any other thread
        # (the NCCL watchdog polling an eager collective's event, under tensor parallelism)
        # invalidates this capture; Inductor's CUDA-graph trees capture this way for that reason.
        with torch.cuda.graph(graph, pool=self.handle, capture_error_mode="thread_local"):
            outputs = fn(*args)
        return graph, outputs

    def retire(self, graph) -> None:
        """Keep a graph that will never replay again until the next capture into this pool:
        PyTorch frees a private pool when the last graph using it is destroyed, and a later
        capture into the same handle then fails an internal assert ("it->second->use_count > 0",
        CUDACachingAllocator, torch 2.11 on the H200). The retired graph holds no tensors; its
        freed blocks serve the next captures, whose graph then keeps the pool alive, so the
        retired ones go (weights replaced again and again, ``module_watch``, or static pieces
        landing, must not keep every old graph's instantiation)."""
        self.retired.append(graph)

    def pool_bytes(self) -> int:
        """Bytes reserved in this pool's segments (from the caching allocator's snapshot)."""
        total = 0
        for seg in torch.cuda.memory_snapshot():
            if tuple(seg.get("segment_pool_id", ())) == tuple(self.handle):
                total += seg["total_size"]
        return total


class SimulatedGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` where there is no GPU: a replay re-runs the captured
    callable on the captured arguments and copies the results into the tensors the capture
    returned, so a replay hands back the same tensor objects with fresh values, as a real graph does.
    The arguments are kept as aliases of the memory they had at capture (``detach``), which a real
    graph reads: a tensor object given other storage since (``param.data = other``) is replayed
    from its old memory, not from the new one the tensor object now shows. A 0-dim CPU argument is
    kept as a copy: a real graph holds its value at capture, and replays that whatever the tensor
    holds since (module docstring).
    """

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], outputs):
        self.fn, self.outputs = fn, outputs
        self.args = [(a.detach().clone() if _is_scalar(a) else a.detach()) if isinstance(a, torch.Tensor) else a
                     for a in args]

    def replay(self) -> None:
        fresh = self.fn(*self.args)
        # A graph writes its outputs whatever the mode; captured under inference mode they are
        # inference tensors, which refuse a copy outside it.
        with torch.inference_mode():
            for o, f in zip(_torch_compat.tree_leaves(self.outputs), _torch_compat.tree_leaves(fresh)):
                if isinstance(o, torch.Tensor):
                    o.copy_(f)


class SimulatedGraphPool(GraphPool):
    """A ``GraphPool`` of ``SimulatedGraph``s: the dispatcher's per-step logic (modes, capture and
    replay counts, padding, address checks) runs on the CPU, in CI (``compileattn.testing
    .simulated_cuda_graphs``), and so does ``GraphPool.capture`` itself, whose recording
    (``_record``) runs nothing, as a real capture. What it cannot show (kernels really captured,
    memory really shared) is tested on the GPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.capture_seconds = 0.0
        self.retired: list = []
        self.inference_outputs = False  # as GraphPool's

    def _record(self, fn: Callable[..., Any], args: Sequence[Any], values: Any) -> tuple[Any, Any]:
        """A capture runs nothing: its outputs are the tensors the step makes, unwritten. Those of
        ``values`` (the warm-up's results) laid out alike: one that is a view of an argument is
        that view, the others views of the same size, strides and offset into new memory, one
        block per block of the warm-up's (outputs that shared memory still do)."""
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        blocks: dict[int, Any] = {}

        def unwritten(v: Any) -> Any:
            if not isinstance(v, torch.Tensor) or v.untyped_storage().data_ptr() in inputs:
                return v
            storage = v.untyped_storage()
            if storage.data_ptr() not in blocks:
                blocks[storage.data_ptr()] = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                                         device=v.device).untyped_storage()
            return torch.empty(0, dtype=v.dtype, device=v.device).set_(
                blocks[storage.data_ptr()], v.storage_offset(), v.shape, v.stride())

        outputs = _torch_compat.tree_map(unwritten, values)
        return SimulatedGraph(fn, args, outputs), outputs

    def pool_bytes(self) -> int:
        return 0


_simulated = False


def warm_up_for_capture(step: Callable[[], Any], times: int = 1) -> None:
    """Run ``step`` ``times`` on a side stream ordered after the current one, and order the current
    stream after it: what must happen before ``torch.cuda.graph`` captures ``step`` (its first call
    compiles kernels and allocates buffers, neither of which may happen during capture, and torch
    asks for warm-up iterations on a side stream so that they leave the capture's memory pool and
    stream state alone)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            step()
    torch.cuda.current_stream().wait_stream(side)


def replay_gpu_us(graph: Any, replays: int = 20, warmup: int = 3) -> float:
    """GPU µs of one replay of a captured ``torch.cuda.CUDAGraph``: ``replays`` replays back to back
    between two CUDA events (after ``warmup``), so the GPU never waits for the host and the time is
    the kernels' alone."""
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def simulate(on: bool) -> None:
    """Use ``SimulatedGraphPool`` instead of real CUDA graphs for runtimes created from now on."""
    global _simulated
    _simulated = on


def simulating() -> bool:
    return _simulated


def make_pool(device: torch.device):
    return SimulatedGraphPool(device) if _simulated else GraphPool(device)


class CUDAGraphWrapper:
    """Per-size graphs of one callable: a piece (piecewise mode) or the whole forward (full mode).
    It captures, checks and replays; it never decides whether a step should use graphs."""

    def __init__(self, name: str, fn: Callable[..., Any], pool, check_addresses: bool = True):
        self.name = name
        self.fn = fn
        self.pool = pool
        self.check_addresses = check_addresses
        self.graphs: dict[int, CapturedGraph] = {}

    def forget(self, size: int) -> None:
        """Drop the graph of ``size`` (its code changed): the next ``run`` of that size captures anew."""
        entry = self.graphs.pop(size, None)
        if entry is not None:
            entry.dropped = True
            self.pool.retire(entry.graph)
            entry.graph = entry.outputs = None  # its outputs' memory returns to the pool once nothing else holds them

    def run(self, size: int, args: Sequence[Any], fn: Callable[..., Any] | None = None):
        """Replay the graph of ``size``; capture it first, from ``fn`` (default: this wrapper's)."""
        entry = self.graphs.get(size)
        if entry is None:
            entry = self.graphs[size] = self.pool.capture(fn or self.fn, args, self.name, size)
            entry.checked = not self.check_addresses
            return entry.outputs
        if not entry.checked:
            entry.check(args)
        entry.graph.replay()
        return entry.outputs
