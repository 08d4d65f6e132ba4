"""A deliberately naive attention oracle for the tests, independent of compileattn's kernels.

Why a second oracle when ``backends/reference.py`` already is one: the reference backend is
vectorised (masks built from broadcast position grids, GQA by ``repeat_interleave``, paging by
fancy indexing), and every later backend is tested against it, so a mistake there would be
inherited silently. This module spells the same semantics out one sequence, one head and one
query at a time, with positions as Python ints and arithmetic in float64, so that the two share
nothing but the definition. It must never import ``compileattn.backends``.

Semantics (FlashAttention's ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache``):
- causal masking is aligned bottom-right: query ``i`` of ``q_len`` queries over ``k_len`` keys sits
  at absolute position ``k_len - q_len + i`` (so a chunked prefill over a cached prefix is right);
- ``window_left = w >= 0`` lets a query at ``qpos`` see key ``p`` only if ``qpos - w <= p``
  (and ``p <= qpos`` when causal); ``-1`` means no window;
- logits are ``q.k * scale``, then, if ``softcap > 0``, ``softcap * tanh(logit / softcap)``, then
  with ALiBi ``logit - slope[h] * |qpos - p|``;
- query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (GQA/MQA);
- a query that sees no key outputs zeros.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch


def visible_keys(qpos: int, k_len: int, causal: bool, window_left: int) -> list[int]:
    """Key positions a query at absolute position ``qpos`` may attend to."""
    keys = []
    for p in range(k_len):
        if causal and p > qpos:
            continue
        if window_left >= 0 and p < qpos - window_left:
            continue
        keys.append(p)
    return keys


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True,
           window_left: int = -1, softcap: float = 0.0, alibi_slopes: Sequence[float] | None = None) -> torch.Tensor:
    """One sequence: q (q_len, H, D), k/v (k_len, KVH, D) -> (q_len, H, D) in float64."""
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    assert num_heads % num_kv_heads == 0, "the oracle only defines GQA/MQA/MHA"
    group = num_heads // num_kv_heads
    q64, k64, v64 = q.double(), k.double(), v.double()
    out = torch.zeros(q_len, num_heads, v.shape[-1], dtype=torch.float64)
    for h in range(num_heads):
        kvh = h // group
        for i in range(q_len):
            qpos = k_len - q_len + i
            keys = visible_keys(qpos, k_len, causal, window_left)
            if not keys:
                continue  # sees nothing: stays zero
            idx = torch.tensor(keys, dtype=torch.long)
            logits = (k64[idx, kvh] @ q64[i, h]) * scale
            if softcap > 0:
                logits = softcap * torch.tanh(logits / softcap)
            if alibi_slopes is not None:
                logits = logits - float(alibi_slopes[h]) * torch.tensor([abs(qpos - p) for p in keys],
                                                                        dtype=torch.float64)
            weights = torch.exp(logits - logits.max())
            out[i, h] = (weights / weights.sum()) @ v64[idx, kvh]
    return out


def attend_batch(qs: Sequence[torch.Tensor], ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
                 **kwargs) -> torch.Tensor:
    """Ragged batch as lists of per-sequence tensors -> packed (total_q, H, D) float64."""
    outs = [attend(q, k, v, **kwargs) for q, k, v in zip(qs, ks, vs)]
    if not outs:
        raise ValueError("attend_batch needs at least one sequence")
    return torch.cat(outs, dim=0)


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    """int32 prefix sums [0, l0, l0+l1, ...] built with a Python loop."""
    acc, out = 0, [0]
    for n in lengths:
        acc += n
        out.append(acc)
    return torch.tensor(out, dtype=torch.int32)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Token by token: slot s goes to block s // block_size, offset s % block_size; -1 is skipped."""
    block_size = key_cache.shape[1]
    for t, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        key_cache[s // block_size, s % block_size] = key[t]
        value_cache[s // block_size, s % block_size] = value[t]


def assign_blocks(lengths: Sequence[int], block_size: int, num_blocks: int,
                  rng: random.Random) -> list[list[int]]:
    """Distinct, shuffled physical blocks per sequence (so a kernel that assumes contiguous or
    ordered blocks gets wrong answers), each sequence given exactly the blocks it needs."""
    needed = [-(-n // block_size) for n in lengths]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, only {num_blocks}")
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables, start = [], 0
    for n in needed:
        tables.append(pool[start:start + n])
        start += n
    return tables


def paginate(ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], block_tables: Sequence[Sequence[int]],
             key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Store each sequence's K/V (k_len, KVH, D) into its blocks, one position at a time."""
    block_size = key_cache.shape[1]
    for k, v, table in zip(ks, vs, block_tables):
        for p in range(k.shape[0]):
            block, offset = table[p // block_size], p % block_size
            key_cache[block, offset] = k[p]
            value_cache[block, offset] = v[p]


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """Flat cache slot of a token at ``position`` of a sequence using ``block_table``."""
    return block_table[position // block_size] * block_size + position % block_size
