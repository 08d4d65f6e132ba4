"""Per-layer attention shape (AttentionSpec) and the paged KV cache that goes with it.

Everything a layer's attention needs that is not per-step lives here: head counts, head dim,
softmax scale, sliding window, softcap and ALiBi slopes; the cache's storage dtype and, for an
fp8 cache, its dequantization scales. Validating it once, at model construction and at cache
allocation, is what lets the per-layer op skip validation on the hot path.

fp8 KV caches (``float8_e4m3fn``). The write stores ``round(x / scale)`` saturated to +-448 (the
largest finite e4m3 value, as vLLM's ``scaled_fp8_conversion``), and every kernel reads
``stored * scale``: a cache holds what a bf16/fp16 cache would, rounded to 3 mantissa bits.
Scales are per KV head (a per-layer scale is the same value for every head), kept on the cache's
device as a (2, kv_heads) float32 tensor, so the kernels read them from memory and a captured
CUDA graph needs no new capture when they are recalibrated in place.

Accuracy. Round-to-nearest e4m3 keeps 3 mantissa bits, so each stored element is within
``2**-4 |x|`` of ``x`` when ``|x| / scale >= 2**-6`` (the normal range) and within ``2**-10 scale``
below it. With a scale of ``amax / 448`` (``fp8_scale``) nothing saturates. Attention over the
dequantized cache is then computed as precisely as over a bf16 cache; what remains is the
quantization itself: with rounding errors spread evenly over half an ulp either way, at most
``2**-4 / sqrt(3)`` (3.6 %) of each value, RMS. On unit-Gaussian q/k/v with scales ``fp8_scale(amax)``
(``tests/test_fp8_kv.py``) the output's norm-relative distance to the same attention over the
unquantized bf16 cache measured 0.026-0.040 for contexts of 1-4096 tokens; the tests hold it below
``FP8_REL_ERROR_BOUND`` (0.08, twice the worst measured). A bf16 cache's own rounding costs
~0.002 by the same measure.
"""
from __future__ import annotations

import dataclasses
import math
from numbers import Real
from typing import Mapping, Sequence

import torch

from .argtypes import as_int, positive_int

#: Head dims every backend must accept. Backends may support more (reference does any of these),
#: and fall back when they support fewer.
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 256)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Storage dtypes of quantized KV caches (queries and new K/V stay in a SUPPORTED_DTYPES dtype).
FP8_DTYPES = (torch.float8_e4m3fn,)
#: The largest finite float8_e4m3fn value: the write saturates to it.
FP8_E4M3_MAX = 448.0
#: Norm-relative error of attention over an fp8 cache against the same attention over the bf16
#: cache it quantizes, on unit-Gaussian data (module docstring: twice the worst measured).
FP8_REL_ERROR_BOUND = 0.08
#: The most blocks a paged cache may have: the largest int32. Block tables hold block ids as int32
#: (the metadata builder's, FlashAttention's ``block_table``), where an id past it would wrap to a
#: negative one, and FlashAttention reads the cache's block count into a C ``int``.
MAX_NUM_BLOCKS = 2 ** 31 - 1


def check_num_blocks(num_blocks: int, name: str = "num_blocks") -> int:
    """``num_blocks`` (an int), or a ValueError naming ``name`` if it exceeds ``MAX_NUM_BLOCKS``."""
    if num_blocks > MAX_NUM_BLOCKS:
        raise ValueError(f"{name} must be at most {MAX_NUM_BLOCKS} (2**31 - 1), got {num_blocks}: block ids are "
                         f"int32 in the block tables, and higher ones would wrap to negative ids")
    return num_blocks


def check_head_dim(head_dim: int, name: str = "head_dim") -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name}={head_dim} is not supported; supported head dims: {SUPPORTED_HEAD_DIMS}")


def check_gqa(num_heads: int, num_kv_heads: int) -> None:
    if num_heads <= 0 or num_kv_heads <= 0:
        raise ValueError(f"num_heads ({num_heads}) and num_kv_heads ({num_kv_heads}) must be positive")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads}) for GQA/MQA"
        )


def check_dtype(dtype: torch.dtype, name: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {dtype}; supported: float32, float16, bfloat16")


def check_cache_dtype(dtype: torch.dtype, name: str) -> None:
    if dtype not in SUPPORTED_DTYPES + FP8_DTYPES:
        raise TypeError(f"{name} has dtype {dtype}; supported: float32, float16, bfloat16, float8_e4m3fn")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_scale(amax: float) -> float:
    """The per-tensor (or per-head) scale that maps ``[-amax, amax]`` onto e4m3's finite range."""
    if not (math.isfinite(amax) and amax > 0):
        raise ValueError(f"amax must be a finite positive float, got {amax}")
    return float(amax) / FP8_E4M3_MAX


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """ALiBi's head slopes (Press et al., "Train Short, Test Long"): the geometric sequence
    ``2**(-8 i / n)``, i = 1..n, for the largest power of two n <= num_heads; the remaining heads
    take every other slope of the sequence for 2n heads, as BLOOM and MPT were trained."""
    num_heads = positive_int(num_heads, "num_heads")
    n = 1 << (num_heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    extra = [2.0 ** (-8.0 * i / (2 * n)) for i in range(1, 2 * n + 1, 2)]
    return tuple(slopes + extra[: num_heads - n])


def _float_tuple(values, name: str, length: int, positive: bool) -> tuple[float, ...]:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().flatten().tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of {length} floats, got {type(values).__name__}")
    out = []
    for x in values:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TypeError(f"{name} must hold floats, got {type(x).__name__}")
        if not math.isfinite(x) or (positive and x <= 0):
            raise ValueError(f"{name} must hold finite{' positive' if positive else ''} floats, got {x}")
        out.append(float(x))
    if len(out) != length:
        raise ValueError(f"{name} has {len(out)} values, expected {length}")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Shape and softmax settings of one attention layer (frozen, hashable: plans key on it)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None = None
    #: Tokens to the left a query may see (FlashAttention's window_size[0]); -1 = unlimited.
    sliding_window: int = -1
    #: tanh soft-capping of logits (Gemma-2); 0 = off.
    softcap: float = 0.0
    causal: bool = True
    #: ALiBi: head h adds ``-alibi_slopes[h] * |query position - key position|`` to its logits
    #: (after scale and softcap), FlashAttention's ``alibi_slopes``; None = off. A tuple (hashable:
    #: plans key on the spec); any sequence or tensor of num_heads floats is converted.
    alibi_slopes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "sliding_window"):
            value = getattr(self, name)
            if value.__class__ is int:
                continue
            index = as_int(value)  # numpy's integers as Python ints (hashable alike, printed alike)
            if index is None:
                raise TypeError(f"{name} must be an int, got {value!r}")
            object.__setattr__(self, name, index)
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {self.causal!r}")
        check_gqa(self.num_heads, self.num_kv_heads)
        check_head_dim(self.head_dim)
        if self.scale is None:
            object.__setattr__(self, "scale", 1.0 / math.sqrt(self.head_dim))
        elif isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)):
            raise TypeError(f"scale must be a float (or None for 1/sqrt(head_dim)), got {type(self.scale).__name__}")
        elif not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a finite positive float (the softmax scale), got {self.scale}")
        if self.sliding_window < -1:
            raise ValueError(f"sliding_window must be -1 (off) or >= 0, got {self.sliding_window}")
        if isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float)):
            raise TypeError(f"softcap must be a float, got {type(self.softcap).__name__}")
        if not (math.isfinite(self.softcap) and self.softcap >= 0):  # NaN read as "off", inf made NaN outputs
            raise ValueError(f"softcap must be a finite float >= 0 (0: off), got {self.softcap}")
        if self.alibi_slopes is not None:
            object.__setattr__(self, "alibi_slopes",
                               _float_tuple(self.alibi_slopes, "alibi_slopes", self.num_heads, positive=False))

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True, eq=False)
class KVCache:
    """One layer's paged cache: key/value of shape (num_blocks, block_size, kv_heads, head_dim).

    ``key_cache``/``value_cache`` are stored in the layer's ``query_dtype`` or, quantized, in
    float8_e4m3fn: then ``query_dtype`` (what queries, new K/V and the output are in) is required
    and ``k_scale``/``v_scale`` are the dequantization multipliers, one float for the layer or
    one per KV head (module docstring).

    Frozen, compared by identity: a step's prepared calls and captured graphs hold its tensors,
    checked once here; a layer given new tensors is a new ``KVCache`` (which the forward context
    sees as another cache).
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    spec: AttentionSpec
    k_scale: float | Sequence[float] = 1.0
    v_scale: float | Sequence[float] = 1.0
    #: The dtype of the layer's queries, new K/V and output; None = the caches' dtype (not fp8).
    query_dtype: torch.dtype | None = None
    #: (2, kv_heads) float32 on the caches' device: row 0 the K scale per head, row 1 the V scale.
    scales: torch.Tensor = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        k, v, spec = self.key_cache, self.value_cache, self.spec
        if k.shape != v.shape:
            raise ValueError(f"key_cache shape {tuple(k.shape)} and value_cache shape {tuple(v.shape)} disagree")
        if k.dtype != v.dtype:
            raise TypeError(f"key_cache dtype {k.dtype} and value_cache dtype {v.dtype} disagree")
        if k.device != v.device:
            raise ValueError(f"key_cache on {k.device} but value_cache on {v.device}")
        check_cache_dtype(k.dtype, "key_cache")
        if k.dim() != 4:
            raise ValueError(f"key_cache must be (num_blocks, block_size, kv_heads, head_dim), got {tuple(k.shape)}")
        check_num_blocks(k.shape[0], "key_cache's num_blocks (dim 0)")
        if k.shape[2] != spec.num_kv_heads or k.shape[3] != spec.head_dim:
            raise ValueError(
                f"key_cache shape {tuple(k.shape)} does not match the layer's "
                f"num_kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}"
            )
        if not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError("key_cache and value_cache must be contiguous")
        from .validation import check_no_overlap  # validation imports this module

        check_no_overlap("value_cache", v, (("key_cache", k),), "the write would store values over keys and "
                         "attention read them as keys")
        kvh = spec.num_kv_heads
        k_heads = _head_scales(self.k_scale, "k_scale", kvh)
        v_heads = _head_scales(self.v_scale, "v_scale", kvh)
        if is_fp8(k.dtype):
            if self.query_dtype is None:
                raise ValueError(f"query_dtype is required with a {k.dtype} cache: the dtype of the layer's "
                                 f"queries, new K/V and output (float16, bfloat16 or float32)")
            check_dtype(self.query_dtype, "query_dtype")
        else:
            if self.query_dtype not in (None, k.dtype):
                raise TypeError(f"query_dtype {self.query_dtype} differs from the {k.dtype} cache; only a "
                                f"float8_e4m3fn cache stores another dtype than the queries'")
            if any(x != 1.0 for x in k_heads + v_heads):
                raise ValueError(f"k_scale/v_scale apply to float8_e4m3fn caches only; this cache is {k.dtype}")
            object.__setattr__(self, "query_dtype", k.dtype)
        object.__setattr__(self, "scales", torch.tensor([k_heads, v_heads], dtype=torch.float32, device=k.device))

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[0]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (float8_e4m3fn for a quantized cache); queries use ``query_dtype``."""
        return self.key_cache.dtype

    @property
    def quantized(self) -> bool:
        return is_fp8(self.key_cache.dtype)

    @property
    def kv_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) per KV head as device tensors for the kernels; None unless quantized."""
        return (self.scales[0], self.scales[1]) if self.quantized else None

    @property
    def device(self) -> torch.device:
        return self.key_cache.device


def _head_scales(value, name: str, num_kv_heads: int) -> tuple[float, ...]:
    """One scale per KV head from one for the layer or one per head. One for the layer is any real
    scalar: a numpy float or a 0-dim tensor (what ``amax / 448`` computes) too, which as a sequence
    of one value would fit a one-KV-head layer only."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
        value = value.item()
    if isinstance(value, Real) and not isinstance(value, bool):
        value = [float(value)] * num_kv_heads
    return _float_tuple(value, name, num_kv_heads, positive=True)


def allocate_kv_caches(
    specs: Mapping[str, AttentionSpec],
    num_blocks: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
    *,
    kv_cache_dtype: torch.dtype | None = None,
    k_scale: float | Mapping[str, float] = 1.0,
    v_scale: float | Mapping[str, float] = 1.0,
) -> dict[str, KVCache]:
    """Zero-filled caches for every layer of ``specs`` (layer name -> spec).

    ``dtype`` is the model's (queries, new K/V); ``kv_cache_dtype`` the storage dtype (None: the
    same; ``torch.float8_e4m3fn`` for a quantized cache, with ``k_scale``/``v_scale`` per layer:
    one float for every layer or a mapping layer name -> float).
    """
    num_blocks = check_num_blocks(positive_int(num_blocks, "num_blocks"))
    block_size = positive_int(block_size, "block_size")
    # Read field by field below, anything else failed as an AttributeError naming no argument.
    if not isinstance(specs, Mapping):
        raise TypeError(f"specs must be a mapping of layer name -> AttentionSpec, got {type(specs).__name__}")
    for name, spec in specs.items():
        if not isinstance(name, str):
            raise TypeError(f"specs: layer names must be strings, got {name!r}")
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"specs[{name!r}] must be an AttentionSpec, got {type(spec).__name__}")
    check_dtype(dtype, "dtype")
    storage = dtype if kv_cache_dtype is None else kv_cache_dtype
    check_cache_dtype(storage, "kv_cache_dtype")
    if storage != dtype and not is_fp8(storage):  # the caches would serve kv_cache_dtype's queries, not dtype's
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype} with dtype={dtype}: only a float8_e4m3fn cache may be "
                         f"stored in another dtype than the model's (leave kv_cache_dtype None)")
    caches = {}
    for name, spec in specs.items():
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        scales = {}
        for arg, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if isinstance(value, Mapping):
                if name not in value:
                    raise ValueError(f"{arg} has no entry for layer {name!r}")
                value = value[name]
            scales[arg] = value
        caches[name] = KVCache(
            torch.zeros(shape, dtype=storage, device=device),
            torch.zeros(shape, dtype=storage, device=device),
            spec,
            query_dtype=dtype if is_fp8(storage) else None,
            **scales,
        )
    return caches
