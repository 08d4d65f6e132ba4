"""Argument checks for the flash-attn-shaped public functions, run before any kernel.

Each check names the offending argument and raises ``TypeError`` (wrong dtype/type) or
``ValueError`` (wrong shape/value). The value checks (monotonic cu_seqlens, block-table range)
read device tensors, i.e. sync the host on CUDA: they belong to the public API's ``validate=True``
path and to the once-per-step metadata builder, never to the per-layer op.
"""
from __future__ import annotations

import math
import numbers

import torch

from .kv_cache import check_cache_dtype, check_dtype, check_head_dim, is_fp8

_INDEX_DTYPES = (torch.int32,)

#: The most tokens a sequence or a step may have: token counts (the builder's ``seq_lens`` and
#: ``query_start_loc``, ``flash_attn_with_kvcache``'s ``cache_seqlens`` and the key lengths it
#: passes on) are int32, the kernels' index type, and a larger count would wrap to a negative length.
MAX_TOKENS = 2 ** 31 - 1


def check_token_count(num_tokens: int, name: str, held_in: str = "seq_lens and query_start_loc") -> int:
    """``num_tokens`` (an int), or a ValueError naming ``name`` if it exceeds ``MAX_TOKENS``;
    ``held_in`` names the int32 tensors the count would wrap in."""
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"{name} must be at most {MAX_TOKENS} (2**31 - 1), got {num_tokens}: token counts are "
                         f"int32 in {held_in}, and larger ones would wrap to negative lengths")
    return num_tokens


def _same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, but q is on {device}")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share a byte of memory (``layouts_overlap``)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    return layouts_overlap(byte_layout(a), byte_layout(b))


def byte_layout(t: torch.Tensor, size=int) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    """(first byte in its storage, shape, strides in elements, element size); ``size`` turns a
    traced size into an int (a fake tensor's symbolic sizes: their hints)."""
    return (size(t.storage_offset()) * t.element_size(), tuple(size(n) for n in t.shape),
            tuple(size(s) for s in t.stride()), t.element_size())


def layouts_overlap(a: tuple, b: tuple) -> bool:
    """Whether two ``byte_layout``s in one storage share a byte: exact for views that are runs at
    one step (``kv[:, 0]`` and ``kv[:, 1]`` of one buffer do not overlap), else whether their
    spans intersect."""
    if 0 in a[1] or 0 in b[1]:
        return False  # no element, no byte
    ra, rb = _runs(*a), _runs(*b)
    if ra is None or rb is None or (ra[2] > 1 and rb[2] > 1 and ra[1] != rb[1]):
        ra, rb = ((start, 1, 1, (1 + sum((n - 1) * s for n, s in zip(shape, strides))) * size)
                  for start, shape, strides, size in (a, b))
    (start_a, step_a, count_a, len_a), (start_b, step_b, count_b, len_b) = ra, rb
    step = step_a if count_a > 1 else step_b
    # Run i of a meets run j of b iff d - len_a < (i - j) * step < d + len_b, with d = start_b - start_a.
    d = start_b - start_a
    lo = max((d - len_a) // step + 1, 1 - count_b)
    hi = min(-((-(d + len_b)) // step) - 1, count_a - 1)
    return lo <= hi


def _runs(start: int, shape: tuple, strides: tuple, size: int) -> tuple[int, int, int, int] | None:
    """A layout's bytes as ``count`` runs of ``length`` bytes, ``step`` bytes apart, from ``start``:
    its contiguous inner dims merged into one run and at most one dim left over; None if more are.
    A dim of stride 0 (a broadcast) repeats the same bytes, so it adds none and is left out."""
    dims = sorted(((s, n) for n, s in zip(shape, strides) if n > 1 and s != 0), reverse=True)
    run = 1
    while dims and dims[-1][0] == run:
        run *= dims.pop()[1]
    if len(dims) > 1:
        return None
    step, count = dims[0] if dims else (run, 1)
    return start, step * size, count, run * size


def check_no_overlap(name: str, t: torch.Tensor, others, why: str = "the kernels read {other} while they "
                     "write {name}") -> None:
    """``t`` (a tensor the kernels write) shares no memory with ``others`` ((name, tensor or None)
    pairs): the kernels read (or write) those while writing ``t``, so a write could land on an
    element before it is read, or overwrite another write, without an error. Skipped while
    tracing: fake tensors have no memory."""
    if torch.compiler.is_compiling():
        return
    for other_name, other in others:
        if other is not None and overlaps(t, other):
            raise ValueError(f"{name} shares memory with {other_name}: {why.format(name=name, other=other_name)}; "
                             f"give {name} its own tensor")


def _index_tensor(name: str, t: torch.Tensor | None, ndim: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    _same_device(name, t, device)
    # The kernels read entries at unit stride (a block table's rows by its row stride): a strided
    # view would be read past its elements (FlashAttention requires the same).
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous{' in its last dim' if ndim > 1 else ''}, got strides "
                         f"{tuple(t.stride())} for shape {tuple(t.shape)}")


def _check_softmax(softmax_scale, softcap) -> None:
    """Real, finite numbers: a NaN scale or an infinite softcap gives NaN rows, and a NaN softcap
    compares false with 0 and would silently mean "no softcap". Finite by comparisons (a NaN fails
    them), not ``math.isfinite``: under ``torch.compile(dynamic=True)`` the numbers, the entry
    points' float defaults included, are symbolic floats, which comparisons trace."""
    for name, value, positive in (("softmax_scale", softmax_scale, True), ("softcap", softcap, False)):
        if value is None and name == "softmax_scale":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
        if not -math.inf < value < math.inf or (value <= 0 if positive else value < 0):
            raise ValueError(f"{name} must be a finite float {'> 0' if positive else '>= 0 (0: no softcap)'}, "
                             f"got {value}")


def _float_vector(name: str, t, length: int, what: str, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a float32 tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if t.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},) (one per {what}), got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, but {'q' if what == 'query head' else 'the cache'} is on "
                         f"{device}")


def check_kv_scales(kv_dtype: torch.dtype, k_scale, v_scale, num_kv_heads: int, device: torch.device,
                    cache: str = "k/v") -> None:
    """``k_scale``/``v_scale``: required with float8 K/V (the per-KV-head dequantization multipliers,
    float32 of shape (kv_heads,)), refused otherwise."""
    if is_fp8(kv_dtype):
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is None:
                raise ValueError(f"{name} is required with {kv_dtype} {cache}: the float32 dequantization "
                                 f"multiplier per KV head, shape ({num_kv_heads},)")
            _float_vector(name, t, num_kv_heads, "KV head", device)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale/v_scale apply to float8_e4m3fn {cache} only; {cache} is {kv_dtype}")


def check_alibi(alibi_slopes, num_heads: int, device: torch.device) -> None:
    if alibi_slopes is not None:
        _float_vector("alibi_slopes", alibi_slopes, num_heads, "query head", device)


def check_float_values(alibi_slopes=None, k_scale=None, v_scale=None) -> None:
    """The values of the float vectors, as ``AttentionSpec`` and ``KVCache`` check theirs: ALiBi
    slopes finite (a NaN slope gives NaN rows), K/V scales finite and > 0 (a zero scale stores
    every written element as +-448 or NaN). Reads the tensors: a host sync on CUDA."""
    if alibi_slopes is not None and not bool(torch.isfinite(alibi_slopes).all()):
        raise ValueError(f"alibi_slopes must hold finite floats (one per query head), got {alibi_slopes.tolist()}")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is not None and not bool((torch.isfinite(t) & (t > 0)).all()):
            raise ValueError(f"{name} must hold finite floats > 0 (one per KV head), got {t.tolist()}")


def check_k_lengths_given(block_table, seqused_k, cu_seqlens_k) -> None:
    """Where the K lengths come from: no backend reads paged lengths from ``cu_seqlens_k`` (Triton
    would read its placeholder for ``seqused_k`` as lengths), and contiguous K/V have no offsets
    without it."""
    if block_table is not None and seqused_k is None:
        raise ValueError("seqused_k is required with block_table (the K length of each sequence)")
    if block_table is None and cu_seqlens_k is None:
        raise ValueError("cu_seqlens_k is required when K/V are not paged (no block_table)")


def check_varlen_args(
    q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
    window_left: int, softcap: float, check_values: bool = True, alibi_slopes=None, k_scale=None, v_scale=None,
    softmax_scale: float | None = None,
) -> None:
    """K/V in q's dtype, or float8_e4m3fn with ``k_scale``/``v_scale``; ``alibi_slopes`` float32
    (num_heads,); ``softmax_scale`` None (1/sqrt(head_dim)) or a finite float > 0."""
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    check_dtype(q.dtype, "q")
    kv_dtype = k.dtype if is_fp8(k.dtype) else q.dtype  # K/V in q's dtype, or quantized
    for name, t, want in (("k", k, kv_dtype), ("v", v, kv_dtype), ("out", out, q.dtype)):
        if t.dtype != want:
            raise TypeError(f"{name} has dtype {t.dtype} but {'k' if want != q.dtype else 'q'} has {want}")
        _same_device(name, t, q.device)
    if q.dim() != 3:
        raise ValueError(f"q must be (total_q, num_heads, head_dim), got shape {tuple(q.shape)}")
    if out.shape != q.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, q has {tuple(q.shape)}")
    check_no_overlap("out", out, (("q", q), ("k", k), ("v", v)))
    paged = block_table is not None
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} and v shape {tuple(v.shape)} disagree")
    if paged:
        if k.dim() != 4:
            raise ValueError(f"with block_table, k must be (num_blocks, block_size, kv_heads, head_dim), "
                             f"got shape {tuple(k.shape)}")
        check_k_lengths_given(block_table, seqused_k, cu_seqlens_k)
        if k.shape[1] < 1:
            raise ValueError(f"k has block_size {k.shape[1]}: a paged cache needs blocks of at least one token")
    else:
        if k.dim() != 3:
            raise ValueError(f"k must be (total_k, kv_heads, head_dim), got shape {tuple(k.shape)}")
        check_k_lengths_given(block_table, seqused_k, cu_seqlens_k)
    head_dim, kv_heads = k.shape[-1], k.shape[-2]
    check_head_dim(q.shape[2], "q head_dim")
    if head_dim != q.shape[2]:
        raise ValueError(f"k head_dim {head_dim} differs from q head_dim {q.shape[2]}")
    if q.shape[1] < 1 or kv_heads < 1 or q.shape[1] % kv_heads:
        # Named after the arguments the caller passed (q, k), not AttentionSpec's field names.
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the {kv_heads} kv heads of k/v "
                         f"(GQA/MQA need num_heads divisible by num_kv_heads)")
    if cu_seqlens_q is None:
        raise TypeError("cu_seqlens_q must be a tensor, got NoneType (the query offsets are required)")
    _index_tensor("cu_seqlens_q", cu_seqlens_q, 1, q.device)
    _index_tensor("cu_seqlens_k", cu_seqlens_k, 1, q.device)
    _index_tensor("seqused_k", seqused_k, 1, q.device)
    _index_tensor("block_table", block_table, 2, q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens_q must have at least one entry")
    if cu_seqlens_k is not None and cu_seqlens_k.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.shape[0]} entries, cu_seqlens_q {num_seqs + 1}")
    if seqused_k is not None and seqused_k.shape[0] != num_seqs:
        raise ValueError(f"seqused_k has {seqused_k.shape[0]} entries for {num_seqs} sequences")
    if paged and block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_seqs} sequences")
    if window_left < -1:
        raise ValueError(f"window_size left must be -1 or >= 0, got {window_left}")
    _check_softmax(softmax_scale, softcap)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    check_alibi(alibi_slopes, q.shape[1], q.device)
    check_kv_scales(k.dtype, k_scale, v_scale, kv_heads, q.device)
    if check_values:
        check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k)
        check_float_values(alibi_slopes, k_scale, v_scale)


def _check_monotonic(name: str, cu: torch.Tensor, total: int, exact: bool) -> list[int]:
    """``exact``: the offsets must end at ``total`` (every row belongs to a sequence), else within it."""
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {vals}")
    if vals[-1] > total or (exact and vals[-1] != total):
        raise ValueError(f"{name} ends at {vals[-1]} but the tensor holds {total} tokens"
                         + ("; every row must belong to a sequence (a row past the last offset would be "
                            "left unwritten)" if exact else ""))
    return vals


def check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k):
    """The value checks (they read the index tensors: a host sync on CUDA)."""
    cu_q = _check_monotonic("cu_seqlens_q", cu_seqlens_q, q.shape[0], exact=True)
    lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    if lens_q and max(lens_q) > max_seqlen_q:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} is below the longest query ({max(lens_q)})")
    if block_table is not None:
        lens_k = seqused_k.tolist()
        if any(x < 0 for x in lens_k):
            raise ValueError(f"seqused_k must be >= 0, got {lens_k}")
        num_blocks, block_size = k.shape[0], k.shape[1]
        capacity = block_table.shape[1] * block_size
        if lens_k and max(lens_k) > capacity:
            raise ValueError(f"seqused_k has a context of {max(lens_k)} tokens beyond the "
                             f"{block_table.shape[1]} blocks x {block_size} given in block_table")
        if block_table.numel():
            for i, n in enumerate(lens_k):
                used = block_table[i, : -(-n // block_size)]
                if used.numel() and (int(used.max()) >= num_blocks or int(used.min()) < 0):
                    raise ValueError(f"block_table row {i} has an entry outside [0, {num_blocks})")
    else:
        cu_k = _check_monotonic("cu_seqlens_k", cu_seqlens_k, k.shape[0], exact=False)
        lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
        if seqused_k is not None:
            used = seqused_k.tolist()
            if any(u < 0 or u > n for u, n in zip(used, lens_k)):
                raise ValueError(f"seqused_k {used} must lie within the cu_seqlens_k lengths {lens_k}")
            lens_k = used
    if lens_k and max(lens_k) > max_seqlen_k:
        raise ValueError(f"max_seqlen_k={max_seqlen_k} is below the longest key sequence ({max(lens_k)})")


def _tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")


#: Where ``flash_attn_with_kvcache``'s token counts are int32 (``check_token_count``'s ``held_in``).
_KVCACHE_COUNTS = "cache_seqlens and in the key lengths the kernels read (cache_seqlens plus the new tokens)"


def check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, window_left: int,
                       softcap: float, alibi_slopes, k_scale, v_scale, softmax_scale: float | None = None) -> None:
    """Structure of a ``flash_attn_with_kvcache`` call (no device tensor is read)."""
    _tensor("q", q)
    check_dtype(q.dtype, "q")
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, seqlen_q, num_heads, head_dim), got shape {tuple(q.shape)}")
    batch, _, num_heads, head_dim = q.shape
    check_head_dim(head_dim, "q head_dim")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t)
        _same_device(name, t, q.device)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree and be "
                         f"(batch_cache, seqlen_cache, kv_heads, head_dim), or (num_blocks, block_size, kv_heads, "
                         f"head_dim) with block_table")
    kv_dtype = k_cache.dtype if is_fp8(k_cache.dtype) else q.dtype
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != kv_dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype} (caches take q's dtype, or "
                            f"float8_e4m3fn with k_scale/v_scale)")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    check_no_overlap("v_cache", v_cache, (("k_cache", k_cache),), "values would be stored over keys and read as "
                     "keys")
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} differs from q head_dim {head_dim}")
    if q.shape[1] < 1:
        raise ValueError(f"q has seqlen_q {q.shape[1]}: each sequence needs at least one query token")
    if k_cache.shape[1] < 1:
        raise ValueError(f"k_cache has {k_cache.shape[1]} tokens per block (or per sequence): it needs at least one")
    if num_heads < 1 or kv_heads < 1 or num_heads % kv_heads:
        raise ValueError(f"q has {num_heads} heads, not a multiple of the {kv_heads} kv heads of k_cache/v_cache "
                         f"(GQA/MQA need num_heads divisible by num_kv_heads)")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values to append) or not at all")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _tensor(name, t)
            if t.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
            _same_device(name, t, q.device)
            if t.dim() != 4 or t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:]:
                raise ValueError(f"{name} must be (batch={batch}, seqlen_new, kv_heads={kv_heads}, "
                                 f"head_dim={head_dim}), got shape {tuple(t.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"k shape {tuple(k.shape)} and v shape {tuple(v.shape)} disagree")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required with k/v: the position each sequence's new tokens go to")
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
            raise TypeError(f"cache_seqlens must be an int or an int32 tensor, got {type(cache_seqlens).__name__}")
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
    elif cache_seqlens is not None:
        _index_tensor("cache_seqlens", cache_seqlens, 1, q.device)
        if cache_seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries for a batch of {batch}")
    if block_table is not None:
        _index_tensor("block_table", block_table, 2, q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table has {block_table.shape[0]} rows for a batch of {batch}")
        if block_table.shape[1] < 1:
            raise ValueError("block_table needs at least one column")
    elif k_cache.shape[0] < batch:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences for a batch of {batch} (without block_table "
                         f"sequence b uses row b of the cache)")
    # An int (or None: the whole cache) is on the host: checked here, free of device reads
    # (validate=False too). The entry makes an int32 tensor of it, and of it plus the new tokens.
    blocks = block_table.shape[1] if block_table is not None else 1
    if cache_seqlens is None:
        check_token_count(blocks * k_cache.shape[1], f"cache_seqlens=None (the whole cache, {blocks} blocks x "
                          f"{k_cache.shape[1]})", _KVCACHE_COUNTS)
    elif isinstance(cache_seqlens, int):
        seqlen_new = k.shape[1] if k is not None else 0
        if cache_seqlens + seqlen_new > blocks * k_cache.shape[1]:
            raise ValueError(f"cache_seqlens={cache_seqlens} plus the {seqlen_new} new tokens of k/v exceed the "
                             f"{blocks * k_cache.shape[1]} tokens each sequence can hold ({blocks} blocks x "
                             f"{k_cache.shape[1]})")
        check_token_count(cache_seqlens + seqlen_new, f"cache_seqlens={cache_seqlens} plus the {seqlen_new} new "
                          f"tokens of k/v", _KVCACHE_COUNTS)
    if out is not None:
        _tensor("out", out)
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must have q's shape {tuple(q.shape)} and dtype {q.dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}")
        _same_device("out", out, q.device)
        check_no_overlap("out", out, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)))
    if window_left < -1:
        raise ValueError(f"window_size left must be -1 or >= 0, got {window_left}")
    _check_softmax(softmax_scale, softcap)
    check_alibi(alibi_slopes, num_heads, q.device)
    check_kv_scales(k_cache.dtype, k_scale, v_scale, kv_heads, q.device, cache="caches")


def check_kvcache_values(k_cache, cache_seqlens: torch.Tensor, seqlen_new: int, block_table: torch.Tensor) -> None:
    """Every sequence's cached and appended tokens fit its blocks, and those blocks exist (reads
    ``cache_seqlens`` and ``block_table``: a host sync on CUDA)."""
    page, num_blocks = k_cache.shape[1], k_cache.shape[0]
    capacity = block_table.shape[1] * page
    block_table = block_table.cpu()
    for b, n in enumerate(cache_seqlens.tolist()):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] = {n} must be >= 0")
        if n + seqlen_new > capacity:
            raise ValueError(f"cache_seqlens[{b}] = {n} plus the {seqlen_new} new tokens of k/v exceed the "
                             f"{capacity} tokens sequence {b} can hold ({block_table.shape[1]} blocks x {page})")
        check_token_count(n + seqlen_new, f"cache_seqlens[{b}] = {n} plus the {seqlen_new} new tokens of k/v",
                          _KVCACHE_COUNTS)
        used = block_table[b, : -(-(n + seqlen_new) // page)]
        if used.numel() and (int(used.max()) >= num_blocks or int(used.min()) < 0):
            raise ValueError(f"block_table row {b} has an entry outside [0, {num_blocks})")


def context_write_clash(slots: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
                        block_size: int) -> tuple[int, int, int, list[int]] | None:
    """The first of ``slots`` (host int64, one per written token) that lands where a sequence reads
    context: rows ``< context_lens[s] - j * block_size`` of block ``tables[s, j]`` (its own earlier
    tokens, or a block another sequence shares), as (token index, block, row, the reading
    sequences); None if none does. The kernels write a step's K/V before they read, so such a write
    changes what a sequence attends to: one block listed twice in a table, or a shared block still
    being filled. Vectorised over the step's context blocks only (sorted, the deepest row read per
    block, looked up for each written slot), so the cost does not grow with the cache's block count."""
    j = torch.arange(tables.shape[1], dtype=torch.int32)
    rows_read = (context_lens[:, None] - j[None, :] * block_size).clamp(0, block_size)
    read = rows_read > 0
    if not bool(read.any()):
        return None
    blocks, where = torch.unique(tables[read], return_inverse=True)
    depth = torch.zeros(blocks.numel(), dtype=rows_read.dtype).scatter_reduce_(0, where, rows_read[read], "amax")
    written_block, written_row = slots // block_size, slots % block_size
    at = torch.searchsorted(blocks, written_block.to(blocks.dtype)).clamp_(max=blocks.numel() - 1)
    clash = (blocks[at] == written_block) & (depth[at] > written_row)
    if not bool(clash.any()):
        return None
    t = int(clash.nonzero()[0])
    block, row = int(written_block[t]), int(written_row[t])
    readers = [int(s) for s in ((tables == block) & read & (rows_read > row)).any(1).nonzero().flatten()]
    return t, block, row, readers


def check_append_slots(slots: torch.Tensor, page: int, block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
    """No two appended tokens of ``flash_attn_with_kvcache`` land in one cache slot, nor in a slot a
    sequence reads as context (``context_write_clash``): (batch, seqlen_new) slots from
    ``block_table`` and ``cache_seqlens``; the errors name the sequences (the flat slot list the
    write gets is internal)."""
    flat = slots.reshape(-1)
    values, counts = flat.unique(return_counts=True)
    if (counts > 1).any():
        slot = int(values[counts > 1][0])
        (b1, j1), (b2, j2) = (slots == slot).nonzero().tolist()[:2]
        raise ValueError(f"new token {j1} of sequence {b1} and new token {j2} of sequence {b2} would both be written "
                         f"to row {slot % page} of block {slot // page}: their block_table rows share a block that "
                         f"cache_seqlens appends into (which value lands there would depend on the write order)")
    clash = context_write_clash(flat.cpu(), block_table.cpu(), cache_seqlens.cpu(), page)
    if clash is not None:
        t, block, row, readers = clash
        b, j = divmod(t, slots.shape[1])
        raise ValueError(f"new token {j} of sequence {b} would be written to row {row} of block {block}, which "
                         f"sequence(s) {readers} read as context (below their cache_seqlens): sequences may share "
                         f"only the blocks they read")


def check_kv_write_args(key, value, key_cache, value_cache, slot_mapping, check_values: bool = True,
                        k_scale=None, v_scale=None) -> None:
    """Caches in key's dtype, or float8_e4m3fn with ``k_scale``/``v_scale`` to quantize with."""
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    check_dtype(key.dtype, "key")
    if value.dtype != key.dtype:
        raise TypeError(f"value has dtype {value.dtype} but key has {key.dtype}")
    check_cache_dtype(key_cache.dtype, "key_cache")
    if not is_fp8(key_cache.dtype) and key_cache.dtype != key.dtype:
        raise TypeError(f"key_cache has dtype {key_cache.dtype} but key has {key.dtype}")
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache has dtype {value_cache.dtype} but key_cache has {key_cache.dtype}")
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping)):
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device}, but key is on {key.device}")
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be (tokens, kv_heads, head_dim), got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must "
                         f"agree and be (num_blocks, block_size, kv_heads, head_dim)")
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"key_cache (kv_heads, head_dim) {tuple(key_cache.shape[2:])} differs from key's "
                         f"{tuple(key.shape[1:])}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        broadcast = next((d for d, (n, st) in enumerate(zip(t.shape, t.stride())) if n > 1 and st == 0), None)
        if broadcast is not None:  # every slot of that dim is the same memory: writes would race
            raise ValueError(f"{name} has stride 0 in dim {broadcast} (a broadcast view, e.g. expand): its slots "
                             f"share memory; pass a cache with memory of its own")
    check_no_overlap("value_cache", value_cache, (("key_cache", key_cache),),
                     "the write would store values over keys")
    check_kv_scales(key_cache.dtype, k_scale, v_scale, key_cache.shape[2], key_cache.device, cache="caches")
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        raise TypeError(f"slot_mapping must be 1-D int64, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if slot_mapping.shape[0] > 1 and slot_mapping.stride(0) != 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slot_mapping.stride(0)} (the kernels read "
                         f"it at unit stride)")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens of key/value; "
                         f"give every token a slot (-1 for one that writes nothing)")
    if check_values:
        check_float_values(None, k_scale, v_scale)
    if check_values and slot_mapping.numel():
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        hi, lo = int(slot_mapping.max()), int(slot_mapping.min())
        if hi >= num_slots or lo < -1:
            raise ValueError(f"slot_mapping entries must lie in [-1, {num_slots}); got min {lo}, max {hi}")
        real = slot_mapping[slot_mapping >= 0]
        values, counts = real.unique(return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"slot_mapping writes slot {int(values[counts > 1][0])} more than once; which value "
                             f"lands there would depend on the kernel's write order")
