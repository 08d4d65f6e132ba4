"""FlashAttention-2 (``flash_attn`` >= 2.6): support checks and the lowest-level forward call.

The call goes straight to the C++ extension, ``flash_attn_2_cuda.varlen_fwd`` (``mha_varlen_fwd`` in
``csrc/flash_attn/flash_api.cpp``), skipping ``flash_attn_varlen_func``'s ``torch.autograd.Function``
and its ``torch.library.custom_op`` wrapper, which add Python and dispatcher layers per call.
Its positional arguments (2.6+, when ``leftpad_k`` was added):
``q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
window_size_right, softcap, return_softmax, generator``.

Constraints that shape the backend:
- paged K/V needs ``block_size % 256 == 0`` (``TORCH_CHECK`` in ``mha_varlen_fwd``); smaller blocks
  fall back to the next backend;
- ``cu_seqlens_k`` is required even with ``block_table`` + ``seqused_k``, but only its shape
  matters then, so a prepared call passes a zero buffer of that shape;
- the split-KV count is chosen on the host from ``max_seqlen_k`` and baked into a captured graph,
  and each split covers ``max_seqlen_k / num_splits`` keys: passing the true per-step maximum would
  silently drop keys when a graph is replayed with longer sequences, so the bound passed is the
  block table's capacity (``max_blocks_per_seq * block_size``);
- a sliding window without causal masking is ``(window_left, -1)``, -1 meaning no right limit, but
  FlashAttention-2 stands in ``max_seqlen_k`` for that -1 once the left limit is set
  (``set_params_fprop``): query row r of a sequence of ``lq`` queries and ``lk`` keys then sees
  keys up to ``r + lk - lq + max_seqlen_k`` only, short of its last keys where ``lq > max_seqlen_k +
  r + 1``. ``fwd`` passes a ``max_seqlen_k`` of at least ``max_seqlen_q`` there, which reaches
  every key (a larger ``max_seqlen_k`` is only a looser bound);
- ALiBi is FlashAttention-2's own ``alibi_slopes`` (float32, (num_heads,)): the same bias,
  ``-slope * |query position - key position|`` after scale and softcap;
- for decode with GQA it swaps query heads into the sequence dimension and, when ``out`` is given,
  writes into a reshaped *copy* of it, returning the result; ``fwd`` copies it back when needed.

Not exercised on the project's H200 (which carries FlashAttention-4 only).
"""
from __future__ import annotations

import torch

from .base import AttentionBackend

_MIN_VERSION = (2, 6)


def load():
    """``(flash_attn_2_cuda, version)`` or ImportError saying why FlashAttention-2 is unusable."""
    try:
        import flash_attn  # noqa: PLC0415
        import flash_attn_2_cuda  # noqa: PLC0415
    except Exception as exc:
        raise ImportError(f"flash_attn (FlashAttention-2) is not importable: {type(exc).__name__}: {exc}") from exc
    ver = getattr(flash_attn, "__version__", "0")
    parts = tuple(int(p) for p in ver.split(".")[:2] if p.isdigit())
    if parts < _MIN_VERSION:
        raise ImportError(f"flash_attn {ver} is too old: varlen_fwd with seqused_k/leftpad_k/block_table "
                          f"needs >= {'.'.join(map(str, _MIN_VERSION))}")
    return flash_attn_2_cuda, ver


class FA2Backend(AttentionBackend):
    """``flash`` on FlashAttention-2 (where FlashAttention-4 is not installed or the GPU is older
    than SM90)."""

    name = "flash"
    label = "FlashAttention-2"
    #: Fixed grids for a fixed step shape; ``max_seqlen_k`` is the block table's capacity (above).
    capturable = True

    def __init__(self, device_type: str = "cuda"):
        super().__init__(device_type)
        self.ext, self.version = load()

    def unsupported_reason(self, spec, dtype: torch.dtype, device: torch.device, block_size: int,
                           cache_dtype: torch.dtype | None = None) -> str | None:
        device = torch.device(device)
        if device.type != "cuda":
            return f"FlashAttention-2 needs a CUDA device, got {device.type}"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"FlashAttention-2 runs float16/bfloat16 only, got {dtype}"
        if cache_dtype not in (None, dtype):
            return f"FlashAttention-2 reads K/V in the queries' dtype only, not a {cache_dtype} cache"
        major, _ = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"FlashAttention-2 needs SM80 or newer, this GPU is SM{major}x"
        if block_size % 256:
            return f"FlashAttention-2 paged KV needs block_size divisible by 256, got {block_size}"
        if spec.head_dim > 256 or spec.head_dim % 8:
            return f"FlashAttention-2 needs head_dim <= 256 divisible by 8, got {spec.head_dim}"
        return None

    def prepare_attend(self, shape, tensors, spec, dtype, key_cache, value_cache, buffers, kv_scales=None):
        cu_k = buffers.get(f"fa2.cu_seqlens_k.{shape.num_seqs}", (shape.num_seqs + 1,), torch.int32)
        max_k = tensors.block_table.shape[1] * shape.block_size
        alibi = buffers.constant(spec.alibi_slopes) if spec.alibi_slopes is not None else None
        args = (tensors.query_start_loc, cu_k, tensors.seq_lens, tensors.block_table, shape.max_query_len, max_k,
                spec.scale, spec.causal, spec.sliding_window, spec.softcap, alibi)
        fwd = self.fwd

        def attend(q, out):
            fwd(q, key_cache, value_cache, out, *args)

        return attend

    def fwd(self, q, k, v, out, cu_q, cu_k, used_k, table, max_q, max_k, scale, causal, window_left,
            softcap, alibi_slopes=None) -> None:
        if window_left >= 0 and not causal:  # the right window's stand-in reaches every key (module docstring)
            max_k = max(max_k, max_q)
        res = self.ext.varlen_fwd(q, k, v, out, cu_q, cu_k, used_k, None, table, alibi_slopes, max_q, max_k, 0.0,
                                  scale, False, causal, window_left, 0 if causal else -1, softcap, False,
                                  None)[0]
        if res.data_ptr() != out.data_ptr():  # the GQA-decode head swap wrote into a copy
            out.copy_(res.reshape(out.shape))

    def varlen_attention(self, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                         max_seqlen_k, softmax_scale, causal, window_left, softcap, alibi_slopes=None, k_scale=None,
                         v_scale=None) -> None:
        if cu_seqlens_k is None:  # paged: FA2 wants cu_seqlens_k for its shape only
            cu_seqlens_k = torch.zeros_like(cu_seqlens_q)
        if block_table is not None:
            max_seqlen_k = max(max_seqlen_k, block_table.shape[1] * k.shape[1])
        self.fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                 max_seqlen_k, softmax_scale, causal, window_left, softcap, alibi_slopes)
