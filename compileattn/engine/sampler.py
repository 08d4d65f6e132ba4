"""Next tokens from a step's logits, on the logits' device, one batch per step.

Greedy rows take the argmax. Sampled rows draw from softmax(logits / temperature), restricted to
the top-p nucleus, by the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with
probability p_i, and needs one batched draw instead of a cumulative sum per row. The draw uses
the engine's ``torch.Generator``, so a seeded ``generate`` repeats its tokens exactly; the stream
is consumed per step, so the same seed gives the same tokens for the same prompts and engine
settings (the steps, and so the draws, follow from those).
"""
from __future__ import annotations

from typing import Sequence

import torch


def sample(logits: torch.Tensor, temperatures: Sequence[float], top_ps: Sequence[float],
           generator: torch.Generator | None) -> torch.Tensor:
    """logits fp32 (N, vocab); one temperature and top-p per row -> token ids (N,) int64, on the device."""
    greedy = logits.argmax(dim=-1)
    if not any(temperatures):
        return greedy
    device = logits.device
    temp = torch.tensor(temperatures, dtype=torch.float32).to(device, non_blocking=True)
    probs = torch.softmax(logits / temp.clamp_min(1e-6).unsqueeze(1), dim=-1)
    if any(p < 1.0 for p in top_ps):
        top_p = torch.tensor(top_ps, dtype=torch.float32).to(device, non_blocking=True)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the mass ranked above it is below top_p: the smallest set reaching
        # top_p, and always the most likely token.
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    race = torch.empty_like(probs).exponential_(generator=generator)
    sampled = (probs / race).argmax(dim=-1)
    return torch.where(temp == 0, greedy, sampled)
