"""How many KV-cache blocks to allocate: from a block count, a memory budget, or what the device has.

On CUDA without a budget, the engine measures instead of guessing (vLLM's approach): one eager
forward of the largest step it will run (``max_num_tokens`` tokens, logits of ``max_num_seqs``
rows) shows the activation peak; the cache gets ``gpu_memory_utilization`` of the device's memory
minus what is in use (weights, CUDA context, other processes) and minus that peak. What it does not
see (CUDA-graph pools, Inductor's workspaces) comes out of the remaining ``1 - utilization``.
On the CPU there is nothing to measure against; the default is enough for ``max_num_seqs``
sequences of ``max_model_len`` tokens, capped at ``CPU_DEFAULT_BYTES`` (256 MiB), and never less
than one sequence of ``max_model_len`` tokens (which a long-context model's can exceed: pass
``max_model_len`` or a budget to bound it).
"""
from __future__ import annotations

import logging
from numbers import Real
from typing import Mapping

import torch

from ..kv_cache import AttentionSpec
from ..metadata import SequenceStep
from ..refusals import ServingRefused

logger = logging.getLogger("compileattn")

CPU_DEFAULT_BYTES = 256 << 20
GiB = float(1 << 30)


def bytes_per_block(specs: Mapping[str, AttentionSpec], block_size: int, dtype: torch.dtype) -> int:
    """K and V of ``block_size`` tokens in every layer."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * s.num_kv_heads * s.head_dim * item for s in specs.values())


def blocks_for_memory(specs: Mapping[str, AttentionSpec], block_size: int, dtype: torch.dtype,
                      memory_bytes: int) -> int:
    per_block = bytes_per_block(specs, block_size, dtype)
    num_blocks = int(memory_bytes // per_block)
    if num_blocks < 1:
        raise ServingRefused(f"a KV-cache budget of {memory_bytes / 2**20:.1f} MiB holds no block of "
                             f"{block_size} tokens ({per_block / 2**20:.2f} MiB each)")
    return num_blocks


def cpu_default_bytes(specs: Mapping[str, AttentionSpec], block_size: int, dtype: torch.dtype,
                      max_num_seqs: int, max_model_len: int) -> int:
    per_block = bytes_per_block(specs, block_size, dtype)
    full = max_num_seqs * -(-max_model_len // block_size) * per_block
    return max(min(full, CPU_DEFAULT_BYTES), -(-max_model_len // block_size) * per_block)


def check_utilization(gpu_memory_utilization) -> None:
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, Real) \
            or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")


def profile_cuda_budget(model: torch.nn.Module, *, block_size: int, max_num_tokens: int, max_num_seqs: int,
                        max_model_len: int, dtype: torch.dtype, device: torch.device, attention_backend: str,
                        gpu_memory_utilization: float) -> int:
    """Bytes the KV cache may take on ``device`` after a profiling step (see the module docstring)."""
    from .model_runner import ModelRunner

    check_utilization(gpu_memory_utilization)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner = ModelRunner(model, block_size=block_size, num_blocks=1, max_num_tokens=max_num_tokens,
                         max_model_len=max_model_len, dtype=dtype, device=device,
                         attention_backend=attention_backend, pad_fn=lambda n: max_num_tokens)
    # One real token in block 0; the rest are padding (each its own empty sequence), so the step
    # has the largest token count without needing cache room for it.
    hidden = runner.execute([SequenceStep(1, 0, [0])], [0], [0])
    rows = min(max_num_seqs, max_num_tokens)
    runner.compute_logits(hidden.expand(rows, -1), range(rows))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - allocated
    del runner, hidden
    torch.cuda.empty_cache()
    in_use = total - free
    budget = int(total * gpu_memory_utilization - in_use - peak)
    logger.info("KV-cache budget: %.2f GiB = %.0f%% of %.1f GiB - %.2f GiB in use - %.2f GiB activation peak "
                "(a %d-token step)", budget / GiB, gpu_memory_utilization * 100, total / GiB, in_use / GiB,
                peak / GiB, max_num_tokens)
    if budget <= 0:
        raise ServingRefused(f"no memory left for the KV cache on {device}: {in_use / GiB:.1f} GiB in use and a "
                             f"{peak / GiB:.1f} GiB activation peak exceed {gpu_memory_utilization:.0%} of "
                             f"{total / GiB:.1f} GiB; lower max_num_batched_tokens or raise "
                             f"gpu_memory_utilization")
    return budget


def log_capacity(num_blocks: int, block_size: int, per_block: int, max_model_len: int, max_num_seqs: int) -> None:
    tokens = num_blocks * block_size
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB), %d tokens; fits %d sequences of max_model_len %d at "
                "once (max_num_seqs %d)", num_blocks, block_size, num_blocks * per_block / GiB, tokens,
                tokens // max_model_len, max_model_len, max_num_seqs)
