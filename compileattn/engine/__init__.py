"""The offline engine: continuous batching over a paged KV cache, with compileattn's compiled forward.

One job per module: ``block_allocator`` (reference-counted blocks, free pools, the prefix cache's
index), ``request`` (sampling parameters and a request's state), ``scheduler`` (which tokens run
in a step; prefix hits at admission; preemption), ``sampler`` (next tokens
on the device), ``model_runner`` (inputs, metadata, forward context, compiled forward),
``engine`` (the step loop, each step planned while the previous one runs), ``kv_budget`` (cache
size from a memory budget), ``llm`` (the public ``LLM``), ``throughput`` (the offline throughput
measurement the CLI and ``benchmarks/throughput.py`` share).
"""
from .block_allocator import BlockAllocator, OutOfBlocksError
from .engine import Engine, StepResult
from .request import Request, SamplingParams

__all__ = ["BlockAllocator", "Engine", "OutOfBlocksError", "Request", "SamplingParams", "StepResult"]
