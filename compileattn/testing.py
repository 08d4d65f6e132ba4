"""Helpers for compile-correctness tests: random ragged steps, cache snapshots, eager-vs-compiled.

A compiled model and its eager twin both write the KV cache, so comparing them on one batch means
running each from the same cache state: ``assert_matches_eager`` snapshots the caches, runs eager,
restores, runs the compiled callable, and compares outputs on the real (unpadded) tokens and the
caches afterwards.
"""
from __future__ import annotations

import contextlib
import random
from typing import Any, Callable, Mapping, Sequence

import torch

from .context import set_forward_context
from .kv_cache import KVCache
from .metadata import AttentionMetadataBuilder, SequenceStep

#: (atol, rtol) for comparing a compiled run with eager, by dtype: Inductor may fuse and reorder
#: reductions, so results differ by rounding, not by semantics.
TOLERANCES = {torch.float32: (2e-4, 2e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (6e-2, 6e-2)}


def random_step(
    rng: random.Random, *, num_seqs: int, block_size: int, num_blocks: int, max_query_len: int = 8,
    max_context_len: int = 40, decode_fraction: float = 0.5,
) -> list[SequenceStep]:
    """A ragged step: decodes first (as the engine orders them), then prefills and chunked prefills,
    each sequence with its own distinct blocks."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = []
    for i in range(num_seqs):
        decode = rng.random() < decode_fraction
        q = 1 if decode else rng.randint(1, max_query_len)
        ctx = rng.randint(1 if decode else 0, max_context_len)
        need = -(-(q + ctx) // block_size)
        if need > len(free):
            raise ValueError("num_blocks too small for this random step")
        seqs.append(SequenceStep(q, ctx, [free.pop() for _ in range(need)]))
    seqs.sort(key=lambda s: s.query_len != 1)  # stable: decodes first
    return seqs


def snapshot(caches: Mapping[str, KVCache]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {k: (c.key_cache.clone(), c.value_cache.clone()) for k, c in caches.items()}


def restore(caches: Mapping[str, KVCache], saved) -> None:
    for k, c in caches.items():
        c.key_cache.copy_(saved[k][0])
        c.value_cache.copy_(saved[k][1])


def assert_matches_eager(
    eager: Callable[..., torch.Tensor], compiled: Callable[..., torch.Tensor],
    builder: AttentionMetadataBuilder, caches: Mapping[str, KVCache], seqs: Sequence[SequenceStep],
    make_inputs: Callable[[int], Sequence[Any]], *, pad_to: int | None = None,
    atol: float | None = None, rtol: float | None = None,
) -> torch.Tensor:
    """Run one step eagerly and compiled from the same cache state; compare real rows and caches.
    ``make_inputs(num_tokens)`` returns the model inputs for the (padded) token count."""
    md = builder.build(seqs, pad_to=pad_to)
    inputs = make_inputs(md.num_tokens)
    saved = snapshot(caches)
    with set_forward_context(md, caches):
        expected = eager(*inputs).clone()
    after_eager = snapshot(caches)
    restore(caches, saved)
    with set_forward_context(md, caches):
        actual = compiled(*inputs).clone()
    dtype = expected.dtype
    default_atol, default_rtol = TOLERANCES.get(dtype, (1e-5, 1e-5))
    tol = dict(atol=default_atol if atol is None else atol, rtol=default_rtol if rtol is None else rtol)
    n = md.num_actual_tokens
    torch.testing.assert_close(actual[:n], expected[:n], **tol)
    for name, cache in caches.items():
        torch.testing.assert_close(cache.key_cache, after_eager[name][0], **tol)
        torch.testing.assert_close(cache.value_cache, after_eager[name][1], **tol)
    return actual


class RecordingBackend:
    """The ``compileattn`` torch.compile backend, remembering the ``PiecewiseRuntime`` of every
    graph it compiled (``.built``), so a test or benchmark can look at its graphs, pool and
    capture time. ``options`` are those of ``torch.compile(..., options=...)``."""

    def __init__(self, **options):
        self.options = options
        self.built: list = []

    def __call__(self, gm, example_inputs):
        from .backend import compileattn_backend

        compiled = compileattn_backend(gm, example_inputs, options=self.options)
        self.built.append(compiled.__self__)  # the backend returns the runtime's bound __call__
        return compiled


class _SimulatedGraph:
    """Stands in for a captured CUDA graph on the CPU: a replay re-runs the callable and copies the
    results into the outputs returned at capture, so a replay hands back the same tensor objects
    with fresh values, as a real graph does."""

    def __init__(self, fn, args, outputs):
        self.fn, self.args, self.outputs = fn, list(args), outputs

    def replay(self):
        fresh = self.fn(*self.args)
        outs = self.outputs if isinstance(self.outputs, (tuple, list)) else (self.outputs,)
        fresh = fresh if isinstance(fresh, (tuple, list)) else (fresh,)
        for o, f in zip(outs, fresh):
            if isinstance(o, torch.Tensor):
                o.copy_(f)


class _SimulatedPool:
    def __init__(self, device):
        self.capture_seconds = 0.0

    def capture(self, fn, args, name, size):
        from . import cudagraph
        from .counters import counters

        outputs = fn(*args)
        counters.cudagraph_captures += 1
        return cudagraph.CapturedGraph(_SimulatedGraph(fn, args, outputs), outputs, cudagraph._tensor_layout(args),
                                       name, size)

    def pool_bytes(self):
        return 0


def simulated_graph_pool(device) -> _SimulatedPool:
    """A graph pool whose captures and replays run the callable (``GraphPool``'s interface)."""
    return _SimulatedPool(device)


@contextlib.contextmanager
def simulated_cuda_graphs():
    """CUDA graphs on a CPU model, inside the block: the piecewise runtime believes it is on CUDA
    and its graph pool simulates capture and replay. What this cannot show (kernels really
    captured, memory really shared) is for the GPU tests; what it shows is the runtime's choice of
    mode per step, its replay and capture counting, and padding."""
    import types

    from . import cudagraph, piecewise

    real_pool, real_init = cudagraph.GraphPool, piecewise.PiecewiseRuntime.__init__

    def init(self, split_gm, pieces, compiled, config, device, *rest, **kw):
        real_init(self, split_gm, pieces, compiled, config, types.SimpleNamespace(type="cuda"), *rest, **kw)
        self.device = device

    cudagraph.GraphPool, piecewise.PiecewiseRuntime.__init__ = _SimulatedPool, init
    try:
        yield
    finally:
        cudagraph.GraphPool, piecewise.PiecewiseRuntime.__init__ = real_pool, real_init
