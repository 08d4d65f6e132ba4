"""Next tokens from a step's logits, on the logits' device, one batch per step.

Greedy rows take the argmax. Sampled rows draw from softmax(logits / temperature), restricted to
the top-p nucleus, by inverse-transform sampling: the token where the row's cumulative
distribution first exceeds a uniform ``u``. Each request brings its own ``u`` for its k-th output
token, a hash of (the request's sampling key, k) computed on the host (``uniform``), because the
step and row a request is drawn in are not its own: batch composition, prefix-cache hits,
preemptions and ``max_num_seqs`` all move them. So a request's draws depend on its seed alone, and
its tokens on its seed and its logits (which, in low precision, a batch's composition can still
move by a rounding, and with them a near-tie). One number per row is also the whole draw (no
(rows, vocab) noise tensor); a cumulative sum and one binary search per row do the rest.

The cumulative sum is float64: float32 loses ~1e-5 of the mass over a 128k vocabulary, more than
a rare token's probability. Float64 needs a device that has it (CPU and CUDA do).
"""
from __future__ import annotations

import secrets
from typing import Sequence

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit ints whose output bits each depend on every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sampling_key(seed: int | None, index: int = 0) -> int:
    """The 64-bit key of a request's draws: from ``seed`` (any int) and the request's ``index``
    among those one seed serves, so prompts seeded together draw independently; None: random."""
    if seed is None:
        return secrets.randbits(64)
    return _mix64((_mix64(seed & _MASK64) + (index + 1) * _GOLDEN64) & _MASK64)


def uniform(key: int, k: int) -> float:
    """The uniform in [0, 1) of a request's ``k``-th output token: splitmix64's ``k``-th output
    from the state ``key``, 53 bits."""
    return (_mix64((key + (k + 1) * _GOLDEN64) & _MASK64) >> 11) * 2.0 ** -53


def sample(logits: torch.Tensor, temperatures: Sequence[float], top_ps: Sequence[float],
           uniforms: Sequence[float]) -> torch.Tensor:
    """logits fp32 (N, vocab); per row a temperature, a top-p and a uniform in [0, 1) (read only
    where the temperature is > 0) -> token ids (N,) int64, on the device."""
    if not len(temperatures) == len(top_ps) == len(uniforms) == logits.shape[0]:
        raise ValueError(f"sample: {logits.shape[0]} rows of logits, {len(temperatures)} temperatures, "
                         f"{len(top_ps)} top_ps, {len(uniforms)} uniforms: one each per row")
    greedy = logits.argmax(dim=-1)
    if not any(temperatures):
        return greedy
    device = logits.device
    temp = torch.tensor(temperatures, dtype=torch.float32).to(device, non_blocking=True)
    probs = torch.softmax(logits / temp.clamp_min(1e-6).unsqueeze(1), dim=-1)
    if any(p < 1.0 for p in top_ps):
        top_p = torch.tensor(top_ps, dtype=torch.float32).to(device, non_blocking=True)
        # Stable: tied tokens rank by token id, so the set kept at the cut is the same on every
        # device (and its first token is greedy's argmax); an unstable sort's tie order is its own.
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        # Keep a token while the mass ranked above it is below top_p: the smallest set reaching
        # top_p, and always the most likely token. Only rows with top_p < 1 lose a token: a float32
        # sum can round up to 1 before the tail, and a top_p=1 row must draw from every token of
        # its distribution whatever the rows beside it ask for.
        drop = ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    u = torch.tensor(uniforms, dtype=torch.float64).to(device, non_blocking=True)
    target = u.unsqueeze(1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(probs.shape[-1] - 1)
    # The first cdf entry above the target has probability > 0, unless rounding put the target at
    # the top or a parallel scan's sums dip by an ulp: the row's most likely token stands in then.
    picked = torch.where(probs.gather(1, picked.unsqueeze(1)).squeeze(1) > 0, picked, greedy)
    return torch.where(temp == 0, greedy, picked)
