"""FlashAttention-shaped Python entry points over the compileattn ops, with argument checks.

``flash_attn_varlen_func`` mirrors ``flash_attn.flash_attn_varlen_func`` (plus FlashAttention's
``block_table``/``seqused_k`` paged form) and ``flash_attn_with_kvcache`` mirrors
``flash_attn.flash_attn_with_kvcache``, so code written for flash-attn ports by changing the
import. ``validate=True`` (the default) checks values too, which reads device tensors (a host sync
on CUDA); hot paths built on per-step metadata call the ops directly instead, and
``validate=False`` keeps an entry point free of host syncs (it may then be captured in a CUDA
graph, as the serving engines that call ``flash_attn_with_kvcache`` do), provided
``flash_attn_varlen_func`` is given ``max_seqlen_q`` and ``max_seqlen_k`` (flash-attn requires
them; left out, they are computed from the index tensors, which reads them).
"""
from __future__ import annotations

import math
import numbers

import torch

from . import ops
from .backends.selector import check_backend_name
from .argtypes import as_int, integer_as_int, is_bool, non_negative_int
from .validation import (
    check_append_slots, check_float_values, check_kv_write_args, check_kvcache_args, check_kvcache_values,
    check_varlen_args, check_varlen_values,
)


def _window_and_causal(window_size, causal: bool) -> tuple[int, bool]:
    if not is_bool(causal) and as_int(causal) not in (0, 1):
        raise TypeError(f"causal must be a bool, got {causal!r}")  # bool("no") is True
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair, got {window_size!r}")
    window_left, window_right = (as_int(w) for w in window_size)
    if window_left is None or window_right is None:  # int(2.7) would quietly be a window of 2
        raise TypeError(f"window_size must be a pair of ints, got {window_size!r}")
    if window_right not in (-1, 0):
        raise ValueError(f"window_size right={window_right} is not supported (only -1 or 0: compileattn "
                         f"serves decoders, whose windows look left)")
    # FlashAttention: a right window of 0 hides every later key, which is exactly causal masking.
    return window_left, bool(causal) or window_right == 0


def _refuse_training_arguments(dropout_p, deterministic, return_attn_probs) -> None:
    """flash-attn's training arguments, taken in their flash-attn positions so that a call ported
    from flash-attn binds as it meant: dropout has no place in inference and a dropout that was
    asked for is never silently skipped; ``deterministic`` picks flash-attn's backward, and the ops
    here have none; the attention probabilities are not returned."""
    if is_bool(dropout_p) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a number, got {dropout_p!r}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p!r} is not supported: compileattn is inference-only and applies no "
                         f"dropout; pass dropout_p=0.0 (flash-attn's value for evaluation)")
    if not is_bool(deterministic):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    _refuse_extra_outputs("return_attn_probs", return_attn_probs, "flash_attn_varlen_func",
                          "not flash-attn's (out, softmax_lse, S_dmask)")


def _refuse_extra_outputs(name: str, value, entry: str, instead: str) -> None:
    """A flash-attn flag asking ``entry`` for outputs besides the attention's: a bool, and False
    (the ops return the attention output only)."""
    if not is_bool(value):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    if value:
        raise ValueError(f"{name}=True is not supported by compileattn.{entry} (it returns the attention output "
                         f"only, {instead})")


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p: float = 0.0,
    softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
    alibi_slopes=None, deterministic: bool = False, return_attn_probs: bool = False, block_table=None, *,
    seqused_k=None, out=None, k_scale=None, v_scale=None, backend: str = "auto", validate: bool = True,
) -> torch.Tensor:
    """Attention over ragged sequences; K/V contiguous (``cu_seqlens_k``) or paged (``block_table``).

    The arguments up to ``block_table`` stand in ``flash_attn.flash_attn_varlen_func``'s order, so
    a call written for flash-attn, positional or not, binds as it meant. Its training arguments are
    taken at inference's values: ``dropout_p`` must be 0 (any other value is refused, not
    ignored), ``deterministic`` selects flash-attn's backward and changes nothing here (the ops have
    no backward), and ``return_attn_probs=True`` is refused. ``alibi_slopes``: float32
    (num_heads,), FlashAttention's ALiBi. K/V may be float8_e4m3fn with ``k_scale``/``v_scale``
    (float32 (kv_heads,)): they are read as ``stored * scale``.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a tensor, got {type(q).__name__}")
    _refuse_training_arguments(dropout_p, deterministic, return_attn_probs)
    backend = check_backend_name(backend, "backend")
    if out is None:
        out = torch.empty_like(q)
    window_left, causal = _window_and_causal(window_size, causal)
    # Structure first: the defaults below read the index tensors, which must exist and be tensors.
    check_varlen_args(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                      max_seqlen_k, window_left, softcap, check_values=False, alibi_slopes=alibi_slopes,
                      k_scale=k_scale, v_scale=v_scale, softmax_scale=softmax_scale)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 0
    if max_seqlen_k is None:
        if seqused_k is not None:
            max_seqlen_k = int(seqused_k.max()) if seqused_k.numel() else 0
        else:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if cu_seqlens_k.numel() > 1 else 0
    if validate:
        check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k)
        check_float_values(alibi_slopes, k_scale, v_scale)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    ops.varlen_attention(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                         max_seqlen_k, float(softmax_scale), bool(causal), window_left, float(softcap), backend,
                         alibi_slopes, k_scale, v_scale)
    return out


def _refuse_unsupported_kvcache_arguments(rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
                                          rotary_interleaved, num_splits, return_softmax_lse) -> None:
    """flash-attn's arguments this entry point takes in their flash-attn positions (so that a call
    written for flash-attn, positional or not, binds every value to the argument it meant) but does
    not implement: refused unless left at flash-attn's default, never ignored."""
    for name, value, instead in (
            ("rotary_cos", rotary_cos, "apply the rotary embedding to q and k before the call"),
            ("rotary_sin", rotary_sin, "apply the rotary embedding to q and k before the call"),
            ("cache_batch_idx", cache_batch_idx, "gather the cache rows into a block_table instead"),
            ("cache_leftpad", cache_leftpad, "store each sequence from the start of its cache row")):
        if value is not None:
            raise ValueError(f"{name} is not supported by compileattn.flash_attn_with_kvcache ({instead}); "
                             f"got {type(value).__name__}")
    if not is_bool(rotary_interleaved):
        raise TypeError(f"rotary_interleaved must be a bool, got {rotary_interleaved!r}")
    # a hint in flash-attn (0: its heuristic); the split count is chosen here
    non_negative_int(num_splits, "num_splits")
    _refuse_extra_outputs("return_softmax_lse", return_softmax_lse, "flash_attn_with_kvcache", "not its log-sum-exp")


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False, *, out=None, backend="auto", k_scale=None, v_scale=None, validate: bool = True,
) -> torch.Tensor:
    """Attention of ``q`` over a KV cache, after appending ``k``/``v`` to it in place.

    FlashAttention's ``flash_attn_with_kvcache``: ``q`` (batch, seqlen_q, num_heads, head_dim); the
    cache contiguous (batch_cache >= batch, seqlen_cache, kv_heads, head_dim) or paged
    (num_blocks, block_size, kv_heads, head_dim) with ``block_table`` (batch, blocks per sequence)
    int32; ``cache_seqlens`` (an int, or int32 (batch,); None: the whole cache, allowed only
    without ``k``/``v``) the tokens each sequence has cached. ``k``/``v`` (batch, seqlen_new,
    kv_heads, head_dim), if given, are written at positions ``cache_seqlens[b] .. + seqlen_new``
    first; attention then sees ``cache_seqlens + seqlen_new`` keys, causal aligned bottom-right
    (query i sits at position ``cache_seqlens + seqlen_new - seqlen_q + i``). Returns ``out``
    (q's shape).

    The arguments stand in flash-attn's order, so a call written for flash-attn binds as it meant;
    its rotary embedding, ``cache_batch_idx``, ``cache_leftpad`` and ``return_softmax_lse=True``
    are refused (``num_splits`` is a hint there and ignored here: the split count is chosen from the
    batch shape). A contiguous cache is served as a paged one whose page is a whole sequence (page
    size ``seqlen_cache``, sequence b in page b): one code path, and decode gets the split-KV decode
    kernel. float8_e4m3fn caches take ``k_scale``/``v_scale`` (float32 (kv_heads,)): ``k``/``v``
    are quantized on the write and the cache is read as ``stored * scale``.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a tensor, got {type(q).__name__}")
    _refuse_unsupported_kvcache_arguments(rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, rotary_interleaved,
                                          num_splits, return_softmax_lse)
    backend = check_backend_name(backend, "backend")
    window_left, causal = _window_and_causal(window_size, causal)
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = integer_as_int(cache_seqlens)  # numpy's integers are ints (argtypes)
    check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, window_left, softcap,
                       alibi_slopes, k_scale, v_scale, softmax_scale)
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_new = k.shape[1] if k is not None else 0
    page = k_cache.shape[1]
    if block_table is None:
        block_table = torch.arange(batch, dtype=torch.int32, device=q.device).view(batch, 1)
    capacity = block_table.shape[1] * page
    if cache_seqlens is None:  # the whole cache (k/v require cache_seqlens: where to append)
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if validate:
        check_kvcache_values(k_cache, cache_seqlens, seqlen_new, block_table)
        check_float_values(alibi_slopes, k_scale, v_scale)
    slots = _append_slots(cache_seqlens, seqlen_new, block_table, page) if seqlen_new else None
    if validate and slots is not None:  # no slot written twice (sequences may share blocks they only read)
        check_append_slots(slots, page, block_table, cache_seqlens)
        # Structure only: the slots' values are checked above, and lie in the cache (the block
        # table's entries and the lengths were checked by check_kvcache_values).
        check_kv_write_args(k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]), k_cache, v_cache,
                            slots.view(-1), check_values=False, k_scale=k_scale, v_scale=v_scale)
    if slots is not None:
        kvh = k_cache.shape[2]
        rows = batch * seqlen_new
        ops.write_kv_cache(k.reshape(rows, kvh, head_dim), v.reshape(rows, kvh, head_dim), k_cache, v_cache,
                           slots.view(-1), backend, k_scale, v_scale)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    dense_out = out is not None and out.is_contiguous()
    result = out if dense_out else torch.empty_like(q, memory_format=torch.contiguous_format)
    cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
    seqused_k = (cache_seqlens + seqlen_new).to(torch.int32)
    ops.varlen_attention(q.reshape(batch * seqlen_q, num_heads, head_dim), k_cache, v_cache,
                         result.view(batch * seqlen_q, num_heads, head_dim), cu_seqlens_q, None, seqused_k,
                         block_table, seqlen_q, capacity, float(softmax_scale), bool(causal), window_left,
                         float(softcap), backend, alibi_slopes, k_scale, v_scale)
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result


def _append_slots(cache_seqlens: torch.Tensor, seqlen_new: int, block_table: torch.Tensor,
                  page: int) -> torch.Tensor:
    """(batch, seqlen_new) int64 cache slots of the appended tokens, computed on the device (no
    host sync): position ``p = cache_seqlens[b] + j`` is row ``p % page`` of page
    ``block_table[b, p // page]``. Positions outside the table are clamped into it here (an index
    out of range would be a device-side assert); ``validate=True`` refuses them first."""
    pos = cache_seqlens.to(torch.int64).view(-1, 1) + torch.arange(seqlen_new, device=cache_seqlens.device)
    column = (pos // page).clamp_(0, block_table.shape[1] - 1)
    return block_table.to(torch.int64).gather(1, column) * page + pos % page


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None,
                   backend: str = "auto", validate: bool = True) -> None:
    """Scatter (tokens, kv_heads, head_dim) K/V into paged caches; slot -1 = padded token, skipped.
    Into float8_e4m3fn caches, with ``k_scale``/``v_scale`` (float32 (kv_heads,)): quantized."""
    backend = check_backend_name(backend, "backend")
    check_kv_write_args(key, value, key_cache, value_cache, slot_mapping, check_values=validate, k_scale=k_scale,
                        v_scale=v_scale)
    ops.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, backend, k_scale, v_scale)
