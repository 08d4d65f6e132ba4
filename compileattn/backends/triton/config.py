"""Tile sizes, warps, pipeline depth and the split-KV count: pure functions of shapes.

Nothing here reads sequence lengths: a CUDA graph captured for a batch size replays for every
context length, so the launch configuration may depend only on the batch shape, the layer shape,
the dtype and the GPU. Decode is HBM-bound; the tile choice aims at ~16 KiB per K (and V) tile,
enough bytes in flight per SM with ``num_stages`` tiles buffered in shared memory, while leaving
room for 2 programs per SM. These are starting points; benchmarks/triton_decode_quick.py sweeps
the neighbourhood on the target GPU.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

#: Resident decode programs per SM the split heuristic assumes. Compiled for sm90 (bf16, GQA 8,
#: head dim 128, 64-key tiles, 4 warps) the decode kernel takes 108 registers per thread and 38 KiB
#: of shared memory, so the register file holds 4 programs per SM.
PROGRAMS_PER_SM = 4
#: More splits mean more merge work and programs with only a tile or two of keys each.
MAX_SPLITS = 32
#: Up to this many splits the decode launch merges its own partials (decode.merge_splits); above
#: it the separate combine kernel does. H200, bf16, page 16, head dim 128, GPU µs per call, the
#: in-kernel merge against the combine kernel (benchmarks/results/decode_merge_S6.md): 4 splits
#: (GQA 64/8 batch 16, MHA 32/32 batch 4) 25.3 vs 27.7 and 71.6 vs 73.4 (GQA), 23.8 vs 24.8 and
#: 69.9 vs 70.2 (MHA), but 16 splits 15.9 vs 13.0 (GQA batch 4) and 14.7 vs 12.6 (MHA batch 1), 32
#: splits 16.5 vs 9.3 (GQA batch 1): one program merging 32 splits of 8 heads is slower than 64
#: programs of one head each.
MAX_SPLITS_MERGED_IN_KERNEL = 4
#: Stand-in SM count under the interpreter, small so default CPU tests exercise split-KV.
INTERPRETER_SM_COUNT = 4


def next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Overrides of the heuristics, for tests and benchmark sweeps; None = heuristic."""

    decode_block_n: int | None = None
    decode_num_warps: int | None = None
    decode_num_stages: int | None = None
    decode_tail_stages: int | None = None
    num_splits: int | None = None
    unified_block_m: int | None = None
    unified_block_n: int | None = None
    unified_num_warps: int | None = None
    unified_num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    block_m: int  # padded GQA group: the M of both tl.dots (>= 16)
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    #: 0: the last partial tile runs in the (then masked) body loop; n: its own n-stage loop.
    tail_stages: int = 0


@dataclasses.dataclass(frozen=True)
class UnifiedConfig:
    block_m: int  # rows of a tile = block_q tokens x group heads (padded up to a power of two)
    block_q: int
    block_n: int
    num_warps: int
    num_stages: int


def _tile_keys(d_pad: int, element_size: int, lo: int, hi: int) -> int:
    """Keys per tile so one K tile is ~16 KiB, as a power of two in [lo, hi]."""
    return max(lo, min(hi, next_pow2(16384 // (d_pad * element_size) + 1) // 2))


@functools.lru_cache(maxsize=None)
def decode_config(group: int, head_dim: int, dtype: torch.dtype, page: int = 16,
                  tuning: Tuning = Tuning(), full_waves: bool = False) -> DecodeConfig:
    """``full_waves``: the unsplit grid fills every resident-program slot (``fills_waves``).

    Two pipeline stages, not three, when the grid fills every slot (less shared memory per
    program, more programs resident, and the SM's memory pipeline kept busy by programs rather
    than stages; H200 sweep, GQA 64/8, bf16, page 16: batch 256 at context 1024 281 -> 253 µs, at
    4096 1073 -> 978 µs) and when a tile gathers several multi-key pages (page 16 with 64-key
    tiles): on the H200 (S9-3, bf16, head dim 128, GQA 64/8 batch 1-64 and MHA 32/32 batch 1-16,
    ``decode_attention.py``'s page-16 cells whose grid does not fill the slots) the autotuner
    timed two stages faster than three in all 14 of its runs, 0.88-0.99x (geometric mean over
    1024 and 4096 keys; the smallest cells' caches partly in L2), and in the benchmark's own
    L2-cold timings of the same run its choices took 0.91-1.00x of the three-stage heuristic's.
    The same rule serves other gathered tiles (fp32, other head dims), not measured. Three where a
    tile sits in one page, and at page 1 (its tail is folded into the body)."""
    d_pad = next_pow2(head_dim)
    esize = torch.empty((), dtype=dtype).element_size()
    block_m = max(16, next_pow2(group))
    block_n = tuning.decode_block_n or _tile_keys(d_pad, esize, 16, 128)
    # fp32 tiles are twice the registers; with 4 warps they spilled (sm90 compile, head dim 128).
    warps = tuning.decode_num_warps or (8 if block_m * d_pad >= 64 * 256 or esize == 4 else 4)
    # Fewest registers on sm90 (see tile.attend_range): a pipelined tail loop when tiles gather
    # from several pages, the tail folded into the body when a tile sits in one page (or page 1).
    gathered = page > 1 and page % block_n != 0
    stages = tuning.decode_num_stages or (2 if full_waves or gathered else 3)
    tail = tuning.decode_tail_stages if tuning.decode_tail_stages is not None else (stages if gathered else 0)
    return DecodeConfig(block_m, block_n, warps, stages, tail)


@functools.lru_cache(maxsize=None)
def unified_config(group: int, head_dim: int, dtype: torch.dtype, tuning: Tuning = Tuning()) -> UnifiedConfig:
    d_pad = next_pow2(head_dim)
    esize = torch.empty((), dtype=dtype).element_size()
    # fp32 runs IEEE dots on FMA units (no tensor cores): smaller tiles keep them out of local memory.
    block_m = tuning.unified_block_m or max(32 if esize == 4 else 64, next_pow2(group))
    block_m = max(block_m, next_pow2(group))
    block_q = block_m // group
    block_n = tuning.unified_block_n or _tile_keys(d_pad, esize, 16, 64)
    warps = tuning.unified_num_warps or (8 if d_pad >= 256 or esize == 4 else 4)
    stages = tuning.unified_num_stages or 2
    return UnifiedConfig(block_m, block_q, block_n, warps, stages)


def fills_waves(num_seqs: int, num_kv_heads: int, sm_count: int) -> bool:
    """The decode grid has at least one program per resident slot without splitting."""
    return num_seqs * num_kv_heads >= sm_count * PROGRAMS_PER_SM


def num_splits(num_seqs: int, num_kv_heads: int, sm_count: int, tuning: Tuning = Tuning()) -> int:
    """Splits per sequence so the decode grid fills about one wave of resident programs.

    From the batch shape and the GPU only (never from lengths): a short sequence simply leaves
    its surplus split programs with an empty key range, which costs one early exit each.
    """
    if tuning.num_splits is not None:
        return max(1, tuning.num_splits)
    if fills_waves(num_seqs, num_kv_heads, sm_count):
        return 1
    return max(1, min(MAX_SPLITS, sm_count * PROGRAMS_PER_SM // (num_seqs * num_kv_heads)))


def merges_in_kernel(splits: int) -> bool:
    """The split decode launch merges its partials itself (no combine launch)."""
    return 1 < splits <= MAX_SPLITS_MERGED_IN_KERNEL


def sm_count(device_type: str, index: int | None = None) -> int:
    """Multiprocessors of CUDA device ``index`` (None: the current device), the stand-in count
    off CUDA. Cached per device index, resolved before the lookup: a process driving GPUs of two
    kinds must plan each one's split-KV for its own SM count, not for the first one asked."""
    if device_type != "cuda":
        return INTERPRETER_SM_COUNT
    return _cuda_sm_count(index if index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def precision(dtype: torch.dtype) -> str:
    """fp32 dots in IEEE fp32, not TF32: fp32 callers want fp32 results (it is not a speed path)."""
    return "ieee" if dtype == torch.float32 else "tf32"
