"""Offline throughput of an ``LLM``: random prompts of random lengths (or sharing one random system
prompt), every output generated to its full length (``ignore_eos``), output tokens/s, requests/s
and time per output token.

Shared by ``python -m compileattn throughput``, ``benchmarks/throughput.py`` and
``benchmarks/prefix_sharing.py``, so they measure the same thing the same way.
"""
from __future__ import annotations

import dataclasses
import random
import time
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .llm import LLM, RequestOutput


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))


@dataclasses.dataclass(frozen=True)
class ThroughputResult:
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    output_tokens_per_s: float
    requests_per_s: float
    #: Time per output token after the first, per request (decode time / (tokens - 1)), in ms.
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    num_preemptions: int


def random_workload(num_requests: int, input_lens: tuple[int, int], output_lens: tuple[int, int], vocab_size: int,
                    seed: int = 0) -> Workload:
    """Prompt and output lengths uniform in the inclusive ranges, token ids uniform in the vocabulary."""
    for name, (lo, hi) in (("input_lens", input_lens), ("output_lens", output_lens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(*input_lens))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_lens) for _ in range(num_requests)])


def shared_prefix_workload(num_requests: int, prefix_len: int, suffix_lens: tuple[int, int],
                           output_lens: tuple[int, int], vocab_size: int, seed: int = 0) -> Workload:
    """Every prompt is one random "system prompt" of ``prefix_len`` tokens followed by its own
    random suffix (length uniform in ``suffix_lens``): the workload prefix caching is for."""
    if not isinstance(prefix_len, int) or prefix_len < 1:
        raise ValueError(f"prefix_len must be a positive int, got {prefix_len!r}")
    for name, (lo, hi) in (("suffix_lens", suffix_lens), ("output_lens", output_lens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(*suffix_lens))]
               for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_lens) for _ in range(num_requests)])


def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear-interpolated percentile; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(outputs: Sequence["RequestOutput"], elapsed_s: float, input_tokens: int) -> ThroughputResult:
    out_tokens = sum(len(o.token_ids) for o in outputs)
    tpots = [t * 1e3 for o in outputs
             if (t := o.metrics.time_per_output_token_s(len(o.token_ids))) is not None]
    return ThroughputResult(len(outputs), input_tokens, out_tokens, elapsed_s, out_tokens / elapsed_s,
                            len(outputs) / elapsed_s, percentile(tpots, 50), percentile(tpots, 99),
                            sum(o.metrics.num_preemptions for o in outputs))


def check(llm: "LLM", workload: Workload) -> None:
    """The TypeError or ValueError ``measure`` raises for ``workload`` (a prompt and output longer
    than the LLM's max_model_len), raised before anything runs (``LLM.check_requests``)."""
    llm.check_requests(workload.prompts, workload.output_lens, ignore_eos=True)


def measure(llm: "LLM", workload: Workload, use_tqdm: bool = False) -> tuple[ThroughputResult, list["RequestOutput"]]:
    """One timed ``generate`` of the whole workload (the caller warms up first)."""
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, workload.output_lens, ignore_eos=True, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    return summarize(outputs, elapsed, workload.input_tokens), outputs


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: "1 request", "2 requests", "0 preemptions"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def describe(r: ThroughputResult) -> str:
    tpot = (f"TPOT p50 {r.tpot_p50_ms:.2f} ms, p99 {r.tpot_p99_ms:.2f} ms" if r.tpot_p50_ms is not None
            else "TPOT n/a")
    return (f"{counted(r.num_requests, 'request')}, {counted(r.input_tokens, 'prompt token')} + "
            f"{counted(r.output_tokens, 'output token')} in {r.elapsed_s:.2f} s: "
            f"{r.output_tokens_per_s:,.1f} output tokens/s, {r.requests_per_s:.2f} requests/s, "
            f"{tpot}, {counted(r.num_preemptions, 'preemption')}")

