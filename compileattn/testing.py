"""Helpers for compile-correctness tests: random ragged steps, cache snapshots, eager-vs-compiled.

A compiled model and its eager twin both write the KV cache, so comparing them on one batch means
running each from the same cache state: ``assert_matches_eager`` snapshots the caches, runs eager,
restores, runs the compiled callable, and compares outputs on the real (unpadded) tokens and the
caches afterwards.
"""
from __future__ import annotations

import contextlib
import math
import random
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from . import _torch_compat
from .compilation.cudagraph import warm_up_for_capture  # noqa: F401  (part of this module's API)
from .context import set_forward_context
from .kv_cache import AttentionSpec, KVCache, is_fp8
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
        for got, want in ((cache.key_cache, after_eager[name][0]), (cache.value_cache, after_eager[name][1])):
            if is_fp8(got.dtype):  # K/V a rounding apart may land one e4m3 step apart (2**-3 relative)
                torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -3, atol=2 ** -9)
            else:
                torch.testing.assert_close(got, want, **tol)
    return actual


def assert_matches_eager_over_steps(
    eager: Callable[..., torch.Tensor], compiled: Callable[..., torch.Tensor],
    builder: AttentionMetadataBuilder, caches: Mapping[str, KVCache], make_inputs: Callable[[int], Sequence[Any]],
    *, steps: int, seed: int, num_seqs: tuple[int, int], max_query_len: int, max_context_len: int,
    capture_sizes: Sequence[int] | None = None,
) -> None:
    """``assert_matches_eager`` over ``steps`` random steps (``random_step`` on the builder's blocks),
    every other one a pure decode, so both a mixed step's pieces and a decode step's full graph
    run. With ``capture_sizes`` each step is padded to the next capture size, as the engine pads a
    step replayed from CUDA graphs."""
    rng = random.Random(seed)
    for i in range(steps):
        seqs = random_step(rng, num_seqs=rng.randint(*num_seqs), block_size=builder.block_size,
                           num_blocks=builder.num_blocks, max_query_len=1 if i % 2 else max_query_len,
                           max_context_len=max_context_len)
        n = sum(s.query_len for s in seqs)
        # the next capture size; above every one the engine runs a step unpadded, and so does this
        pad = next((s for s in capture_sizes if s >= n), None) if capture_sizes else None
        assert_matches_eager(eager, compiled, builder, caches, seqs, make_inputs, pad_to=pad)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖a − e‖ / ‖e‖ in fp64 (Frobenius); inf when either holds a NaN/inf or ‖e‖ = 0 ≠ ‖a‖.

    A norm-relative error, not an elementwise atol: decode outputs are averages of many values and
    small (~0.03), so an absolute tolerance loose enough for bf16 would pass an all-zero output.
    Never NaN, so ``max()`` over errors and ``err <= tol`` cannot skip a broken result: a NaN/inf
    in the reference gave NaN (inf / inf), and ``max`` drops a NaN that is not its first argument.
    fp64, because the squares of large bf16 or fp32 values overflow fp32's norm into inf / inf too."""
    a = actual.detach().double()
    e = expected.detach().double().to(a.device)
    if a.shape != e.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}")
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return math.inf
    den = e.norm().item()
    num = (a - e).norm().item()
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def recording_greedy(record: dict[int, list[torch.Tensor]]):
    """A greedy host sampler (an engine's ``sampler=``) that appends each sampled row's fp32 logits
    (on the host) to ``record[seq_id]``: two runs' logits can then be compared step by step."""
    def sample(logits, seq_ids):
        for row, s in zip(logits, seq_ids):
            record.setdefault(s, []).append(row.detach().float().cpu())
        return logits.argmax(-1).tolist()
    return sample


def near_tie(reference_logits: torch.Tensor, other_logits: torch.Tensor, reference_token: int,
             other_token: int) -> tuple[bool, float]:
    """(is a near-tie, the reference's margin) for a greedy divergence at one step, where both runs
    saw the same context. Their logits then differ only by arithmetic (reduction order,
    precision), so when the reference's margin between its token and the other run's is within
    twice the largest logit difference of the two, either token is a fair argmax."""
    margin = (reference_logits[reference_token] - reference_logits[other_token]).item()
    return margin <= 2 * (reference_logits - other_logits).abs().max().item(), margin


class RecordingBackend:
    """The ``compileattn`` torch.compile backend, remembering the ``StepDispatcher`` of every
    graph it compiled (``.built``), so a test or benchmark can look at its graphs, pool and
    capture time. ``options`` are those of ``torch.compile(..., options=...)``."""

    def __init__(self, **options):
        self.options = options
        self.built: list = []

    def __call__(self, gm, example_inputs):
        from .compilation.backend import compileattn_backend

        compiled = compileattn_backend(gm, example_inputs, options=self.options)
        self.built.append(getattr(compiled, "__self__", compiled))  # a bound __call__ when dumping
        return compiled


@contextlib.contextmanager
def simulated_cuda_graphs(reference_capturable: bool = True) -> Iterator[None]:
    """Compiled models made inside the block get CUDA-graph modes on the CPU, with graphs that
    re-run their callable on replay (``compilation.cudagraph.SimulatedGraphPool``): the dispatcher's
    per-step logic (modes, capture and replay counts, padding, 1-token graphs, address checks)
    runs in CI. Compile and run inside the block.

    ``reference_capturable``: the reference backend (the CPU's) counts as capturable inside the
    block, so full-graph decode steps happen too. A simulated graph re-runs it, so its host reads
    are harmless; a real graph could not hold it."""
    from .backends import selector
    from .backends.reference import ReferenceBackend
    from .compilation import cudagraph

    previous = cudagraph.simulating(), ReferenceBackend.capturable
    cudagraph.simulate(True)
    ReferenceBackend.capturable = reference_capturable
    selector.capturable_changed()  # a builder's memoised call tables hold the value they were built with
    try:
        yield
    finally:
        cudagraph.simulate(previous[0])
        ReferenceBackend.capturable = previous[1]
        selector.capturable_changed()


class PersistentInputs:
    """``inputs(n)``: random token ids and positions for an ``n``-token step, written into two
    buffers allocated once (``ids``, ``positions``) and returned as views of them. A CUDA graph
    reads its inputs at the addresses it was captured with, so a model replayed from graphs must be
    fed slices of persistent buffers, as an engine does. ``mark_dynamic``: dim 0 of each view is
    marked dynamic for ``torch.compile``."""

    def __init__(self, vocab_size: int, max_tokens: int, positions: tuple[int, int] = (0, 200),
                 device: str | torch.device = "cpu", mark_dynamic: bool = True):
        self.vocab_size = vocab_size
        self.low, self.high = positions
        self.mark_dynamic = mark_dynamic
        self.ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)

    def __call__(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n > self.ids.shape[0]:  # [:n] would quietly give fewer
            raise ValueError(f"{n} tokens > max_tokens {self.ids.shape[0]} of these persistent inputs")
        self.ids[:n].random_(0, self.vocab_size)
        self.positions[:n].random_(self.low, self.high)
        ids, pos = self.ids[:n], self.positions[:n]
        if self.mark_dynamic:
            _torch_compat.mark_dynamic(ids, 0)
            _torch_compat.mark_dynamic(pos, 0)
        return ids, pos


class AttentionBlock(torch.nn.Module):
    """The smallest model with a compileattn attention layer: one fused q/k/v projection of
    ``hidden`` features (``spec``'s query, key and value heads), then ``Attention``, so a compiled
    forward has a piece before the attention op."""

    def __init__(self, spec: AttentionSpec, hidden: int, layer_name: str = "block.attn"):
        from .models.attention import Attention

        super().__init__()
        self.split = [spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                      spec.num_kv_heads * spec.head_dim]
        self.qkv = torch.nn.Linear(hidden, sum(self.split))
        self.attn = Attention(spec, layer_name=layer_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        return self.attn(q, k, v)

