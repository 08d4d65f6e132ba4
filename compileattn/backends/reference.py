"""Plain-PyTorch kernels: the semantic oracle every other backend is tested against.

Semantics are FlashAttention's (``flash_attn_varlen_func`` / ``flash_attn_with_kvcache``):
causal masking is aligned to the bottom-right corner (query i of a sequence with q_len queries and
k_len keys sits at absolute position k_len - q_len + i), so a chunked prefill over a cached prefix
is right; ``window_left`` lets a query see that many earlier positions besides its own; logits are
scaled, then soft-capped (softcap * tanh(s / softcap)), then ALiBi-biased (head h adds
-slope[h] * |query position - key position|, FlashAttention's alibi_slopes); K/V stored as
float8_e4m3fn are read as ``stored * scale`` per KV head; a query that sees no key outputs zeros, and
a NaN or Inf in q, k or v reaches the rows that see it, as in SDPA (never turned into zeros).
Rows of ``out`` past ``cu_seqlens_q[-1]`` belong to no sequence and are not written (as in
FlashAttention; the public entry points refuse such inputs).
Loops over sequences on the host (it reads cu_seqlens), so it is neither fast nor capturable.
"""
from __future__ import annotations

import torch

from ..kv_cache import FP8_DTYPES
from .base import AttentionBackend


def attend_one_sequence(q, k, v, scale: float, causal: bool, window_left: int, softcap: float,
                        alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """q (Lq, H, D), k/v (Lk, KVH, D) -> (Lq, H, D) in float32; ``alibi_slopes`` (H,)."""
    lq, h, _ = q.shape
    lk, kvh, _ = k.shape
    group = h // kvh
    qf = q.float().transpose(0, 1)  # H, Lq, D
    kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # H, Lk, D
    vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(lq, device=q.device).unsqueeze(1) + (lk - lq)
    kpos = torch.arange(lk, device=q.device).unsqueeze(0)
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.float().view(h, 1, 1) * (qpos - kpos).abs()
    visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= kpos <= qpos
    if window_left >= 0:
        visible &= kpos >= qpos - window_left
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)
    # Only a query that sees no key is zero (its softmax is 0/0). Zeroing NaN rows wholesale would
    # hide a NaN or Inf in q, k or v; SDPA and FlashAttention return it in the rows that see it.
    sees_nothing = ~visible.any(dim=-1)
    return out.masked_fill(sees_nothing.view(1, lq, 1), 0.0).transpose(0, 1)


def gather_paged(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from a paged cache (num_blocks, bs, KVH, D)."""
    bs = cache.shape[1]
    nb = -(-length // bs)
    if cache.dtype in FP8_DTYPES:  # gathered as bytes: indexing kernels do not cover float8 everywhere
        return gather_paged(cache.view(torch.uint8), blocks, length).view(cache.dtype)
    return cache[blocks[:nb].long()].reshape(nb * bs, *cache.shape[2:])[:length]


def dequantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """(L, KVH, D) K or V as float32: ``stored * scale[head]`` for a quantized cache."""
    return x if scale is None else x.float() * scale.float().view(1, -1, 1)


class ReferenceBackend(AttentionBackend):
    name = "reference"
    capturable = False

    def prepare_attend(self, shape, tensors, spec, dtype, key_cache, value_cache, buffers, kv_scales=None):
        t = tensors
        alibi = buffers.constant(spec.alibi_slopes) if spec.alibi_slopes is not None else None
        k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
        args = (t.query_start_loc, None, t.seq_lens, t.block_table, shape.max_query_len, 0, spec.scale,
                spec.causal, spec.sliding_window, spec.softcap, alibi, k_scale, v_scale)

        def attend(query, output):
            self.varlen_attention(query, key_cache, value_cache, output, *args)

        return attend

    def varlen_attention(
        self, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
        max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, softcap,
        alibi_slopes=None, k_scale=None, v_scale=None,
    ) -> None:
        cu_q = cu_seqlens_q.tolist()
        paged = block_table is not None
        lens_k = seqused_k.tolist() if seqused_k is not None else None
        cu_k = cu_seqlens_k.tolist() if cu_seqlens_k is not None else None
        for i in range(len(cu_q) - 1):
            q_i = q[cu_q[i]: cu_q[i + 1]]
            if q_i.shape[0] == 0:
                continue
            if paged:
                k_i = gather_paged(k, block_table[i], lens_k[i])
                v_i = gather_paged(v, block_table[i], lens_k[i])
            else:
                end = cu_k[i] + lens_k[i] if lens_k is not None else cu_k[i + 1]
                k_i, v_i = k[cu_k[i]: end], v[cu_k[i]: end]
            o = attend_one_sequence(q_i, dequantize(k_i, k_scale), dequantize(v_i, v_scale), softmax_scale, causal,
                                    window_left, softcap, alibi_slopes)
            out[cu_q[i]: cu_q[i + 1]] = o.to(out.dtype)
