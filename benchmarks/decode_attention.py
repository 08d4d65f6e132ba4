#!/usr/bin/env python
"""Paged decode attention, GPU time per call: compileattn's backends beside their peers.

Shapes (``--shapes``): GQA 64 query / 8 KV heads (Llama-70B's layout, and the shape of the
change compileattn grew out of) and MHA 32/32 (a 7B model), head dim 128, bf16, one query token
per sequence, every sequence ``context`` tokens long (the current token included), over batch
sizes and page sizes. Per cell and implementation: GPU µs per call, TB/s of KV read (K and V bytes
of all sequences' contexts / time) and the ratio to the memory floor (those bytes / the
device-to-device copy bandwidth measured in the same run).

Besides compileattn's bf16 backends and the peers (FlashInfer, Flex, SDPA):

- ``pa-baseline``: a PagedAttention-V1/V2-style kernel (``paged_attention_baseline.py``: one
  program per query head, no GQA packing, V2's partitions where vLLM's rule picks V2), the
  "before" of that change; the report's *kernel table* puts compileattn ÷ baseline beside
  compileattn ÷ FlashInfer, page 16 beside page 128.
- ``ca-triton-tuned``: compileattn's Triton decode with its launch autotuned per batch
  (``TritonBackend.enable_autotune()``: the heuristic and its neighbours timed at 1024 and 4096
  keys, or what the cell's cache holds, one choice kept for both, as a served model uses it at
  every context); every candidate's times and the choice are in the note.
- ``ca-triton-fp8``: compileattn's Triton decode over a float8_e4m3fn cache (per-layer scales
  from the data's amax); its TB/s count fp8 bytes, and the report's fp8 table gives fp8 ÷ bf16.
- A table of KV-cache memory wasted by the block size, for a stated length distribution (no GPU
  needed: ``--kv-waste`` writes it alone).

What is timed is attention only, with everything a real step does once per step done outside:
the compileattn metadata is built by ``AttentionMetadataBuilder`` (which also runs the backend's
``plan``), FlashInfer's ``plan`` runs before timing, FA4's first call (its compile) happens
before timing. For compileattn that is the attention half of ``backend.forward`` (the KV write
of the step's own token is excluded; ``attention_only`` explains how it is reached per backend).

Honesty checks: each implementation's output is compared with an fp32 oracle over the same
cache (itself checked against compileattn's ``reference`` backend on the first sequences of every
cell) before it is timed, and again after the timed graph replays; a disagreeing implementation
is reported FAILED without a time. A peer that cannot run (not installed, unsupported, failing
compile) is reported with its reason and the table goes on.

Timing: ``common.gpu_time_us`` (calls captured in a CUDA graph, replays timed with events, so the
CPU cost of a Python entry cannot hide or inflate GPU time). Unless ``--warm-l2``, the calls
cycle over enough copies of the KV cache that each call reads it from HBM, as in a model where
the other layers evict a layer's cache from L2 between its calls.

Two runs merge into one table (FlashAttention-4 and FlashInfer do not fit one transfer to the
GPU machine): ``--merge A.json B.json -o OUT``. Ratios against FlashInfer's tensor-core decode
are taken within the run that measured FlashInfer whenever that run has the row too.

Run: see benchmarks/README.md. On a machine without CUDA it prints why and exits 0 (``--merge``
and ``--kv-waste`` need no GPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 64, 8, 128
GROUP = NUM_HEADS // NUM_KV_HEADS
DTYPE_NAME = "bfloat16"
#: Norm-relative error allowed against the fp32 oracle (bf16 output rounding is ~4e-3).
TOLERANCE = 2e-2
#: The same for attention over an fp8 cache: compileattn's documented bound against bf16
#: (kv_cache.FP8_REL_ERROR_BOUND; measured 0.026-0.040).
FP8_TOLERANCE = 0.08


class Shape(NamedTuple):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    label: str


SHAPES = {
    "gqa64x8": Shape(64, 8, 128, "GQA 64/8 (Llama-70B-like)"),
    "mha32": Shape(32, 32, 128, "MHA 32/32 (7B)"),
}
DEFAULT_SHAPE = "gqa64x8"
#: The issue's bandwidth goal for compileattn's page-16 decode at batch >= GOAL_BATCH.
GOAL_TBPS, GOAL_BATCH, GOAL_PAGE = 4.2, 64, 16

#: impl key -> (table label, needs a paged cache)
IMPLS: dict[str, tuple[str, bool]] = {
    "ca-triton": ("compileattn triton", True),
    "ca-flash": ("compileattn flash", True),
    "ca-triton-fp8": ("compileattn triton, fp8 KV", True),
    "ca-triton-tuned": ("compileattn triton, autotuned", True),
    "pa-baseline": ("PagedAttention V1/V2-style", True),
    "fi-tc": ("FlashInfer tensor-core", True),
    "fi-cc": ("FlashInfer CUDA-core", True),
    "flex": ("Flex paged", True),
    "gather-sdpa": ("gather + SDPA", True),
    "sdpa-contig": ("SDPA contiguous", False),
}
COMPILEATTN_IMPLS = ("ca-triton", "ca-flash", "ca-triton-tuned")
FI_TC = "fi-tc"
FP8_IMPL = "ca-triton-fp8"
BASELINE = "pa-baseline"
#: Element size of the K/V an implementation reads (bytes), where it is not bf16's.
KV_ELEMENT_SIZE = {FP8_IMPL: 1}

DEFAULTS = {"contexts": [1024, 4096], "batches": [1, 4, 16, 64, 256], "pages": [16, 128],
            "shapes": list(SHAPES)}
QUICK = {"contexts": [1024], "batches": [1, 64], "pages": [16], "shapes": [DEFAULT_SHAPE]}
DEFAULT_OUT = common.RESULTS_DIR / "decode_attention"


class Unavailable(Exception):
    """This implementation cannot run here (the message says why); not a failure of the benchmark."""


# ----------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ints = common.argparse_type(common.parse_int_list)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=ints, default=None, help="tokens per sequence (default 1024,4096)")
    p.add_argument("--batches", type=ints, default=None, help="sequences per call (default 1,4,16,64,256)")
    p.add_argument("--pages", type=ints, default=None, help="KV page sizes (default 16,128)")
    p.add_argument("--shapes", type=common.argparse_type(lambda s: common.parse_name_list(s, list(SHAPES))),
                   default=None, help=f"head layouts, of {','.join(SHAPES)} (default all; quick {DEFAULT_SHAPE})")
    p.add_argument("--impls", type=common.argparse_type(lambda s: common.parse_name_list(s, list(IMPLS))),
                   default=list(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--quick", action="store_true",
                   help="context 1024, batch 1 and 64, page 16, GQA 64/8, 5 replays (a smoke run)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output prefix: writes PREFIX.json/.md/.png")
    p.add_argument("--label", default=None, help="name of this run in merged tables (default: from versions)")
    p.add_argument("--target-ms", type=float, default=3.0, help="GPU time of one timed graph replay")
    p.add_argument("--reps", type=int, default=None, help="timed replays per measurement (default 7, quick 5)")
    p.add_argument("--budget-s", type=float, default=280.0,
                   help="wall-clock budget; cells past it are reported as skipped (0 = none)")
    p.add_argument("--warm-l2", action="store_true", help="do not rotate cache copies (L2-warm timings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="merge result files of several runs into one table (no GPU needed)")
    p.add_argument("--kv-waste", action="store_true",
                   help="write only the KV-waste-by-block-size table to PREFIX.md (no GPU needed)")
    p.add_argument("-o", "--output", default=None, help="output prefix for --merge (default: --out)")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, list(value))
    if args.reps is None:
        args.reps = 5 if args.quick else 7
    if args.reps < 1 or args.target_ms <= 0:
        p.error("--reps must be >= 1 and --target-ms > 0")
    return args


# ----------------------------------------------------------------------------------------------
# Inputs: one cell's query, K/V (logical, contiguous), the oracle; paged copies per page size


@dataclasses.dataclass
class Case:
    context: int
    batch: int
    q: Any  # (B, H, D)
    k: Any  # (B, ctx, KVH, D): the logical contents every layout is built from
    v: Any
    scale: float
    expected: Any  # fp32 (B, H, D)
    rotations: int
    shape: str = DEFAULT_SHAPE  # a SHAPES key (for the report; the tensors carry the dims)

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclasses.dataclass
class PagedCase:
    page: int
    kcs: list  # per rotation: (num_blocks, page, KVH, D)
    vcs: list
    block_table: Any  # int32 (B, blocks per sequence) on the device
    num_blocks: int
    spec: Any  # compileattn AttentionSpec
    caches: list  # compileattn KVCache per rotation


def kv_bytes(batch: int, context: int, element_size: int = 2, shape: str = DEFAULT_SHAPE) -> int:
    """K and V bytes an exact decode must read: every token of every sequence, once."""
    dims = SHAPES[shape]
    return 2 * batch * context * dims.num_kv_heads * dims.head_dim * element_size


def make_case(context: int, batch: int, *, rotations: int, device: Any, dtype: Any, seed: int,
              shape: str = DEFAULT_SHAPE, num_heads: int | None = None, num_kv_heads: int | None = None,
              head_dim: int | None = None) -> Case:
    """A cell's inputs for head layout ``shape`` (explicit head counts override it: the CPU tests)."""
    import torch

    dims = SHAPES[shape]
    num_heads = num_heads or dims.num_heads
    num_kv_heads = num_kv_heads or dims.num_kv_heads
    head_dim = head_dim or dims.head_dim

    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + context * 1009 + batch)
    q = torch.randn(batch, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(batch, context, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(batch, context, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    scale = 1.0 / math.sqrt(head_dim)
    return Case(context, batch, q, k, v, scale, oracle(q, k, v, scale), rotations, shape)


def oracle(q, k, v, scale: float, chunk_bytes: int = 1 << 30):
    """fp32 attention of each sequence's one query over its whole context: (B, H, D) float32."""
    import torch

    b, ctx, kvh, d = k.shape
    h = q.shape[1]
    g = h // kvh
    out = torch.empty(b, h, d, dtype=torch.float32, device=q.device)
    step = max(1, chunk_bytes // max(1, 2 * ctx * kvh * d * 4))
    for s in range(0, b, step):
        e = min(b, s + step)
        qf = q[s:e].float().view(e - s, kvh, g, d)
        kf = k[s:e].float().transpose(1, 2)
        vf = v[s:e].float().transpose(1, 2)
        p = torch.softmax(torch.matmul(qf, kf.transpose(-1, -2)) * scale, dim=-1)
        out[s:e] = torch.matmul(p, vf).reshape(e - s, h, d)
    return out


def make_paged(case: Case, page: int, *, seed: int) -> PagedCase:
    """The case's K/V in a paged cache of ``page``-token blocks at randomly permuted block ids (as
    an allocator that has run a while would leave them), plus ``case.rotations - 1`` clones."""
    import torch

    from compileattn.kv_cache import AttentionSpec, KVCache

    b, ctx, kvh, d = case.k.shape
    nb = -(-ctx // page)
    num_blocks = b * nb + 1  # one spare block no sequence owns
    gen = torch.Generator().manual_seed(seed * 7919 + page * 31 + ctx + b)
    table = torch.randperm(num_blocks, generator=gen)[: b * nb].view(b, nb).to(torch.int32).to(case.k.device)
    spec = AttentionSpec(case.q.shape[1], kvh, d, scale=case.scale)
    kcs, vcs = [], []
    for src, dst_list in ((case.k, kcs), (case.v, vcs)):
        cache = torch.zeros(num_blocks, page, kvh, d, dtype=src.dtype, device=src.device)
        padded = src
        if nb * page != ctx:
            padded = torch.zeros(b, nb * page, kvh, d, dtype=src.dtype, device=src.device)
            padded[:, :ctx] = src
        cache[table.reshape(-1).long()] = padded.reshape(b * nb, page, kvh, d)
        dst_list.append(cache)
        dst_list.extend(cache.clone() for _ in range(case.rotations - 1))
    caches = [KVCache(kc, vc, spec) for kc, vc in zip(kcs, vcs)]
    return PagedCase(page, kcs, vcs, table, num_blocks, spec, caches)


def check_oracle_against_reference(case: Case, pc: PagedCase, n: int = 2) -> float:
    """The fp32 oracle equals compileattn's reference backend (the project's semantic oracle) on
    the first ``n`` sequences of this paged cache; returns the norm-relative error."""
    import torch

    from compileattn.backends.reference import ReferenceBackend

    n = min(n, case.batch)
    dev = case.q.device
    out = torch.empty(n, *case.q.shape[1:], dtype=case.q.dtype, device=dev)
    cu_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
    used = torch.full((n,), case.context, dtype=torch.int32, device=dev)
    ReferenceBackend().varlen_attention(case.q[:n], pc.kcs[0], pc.vcs[0], out, cu_q, None, used,
                                        pc.block_table[:n], 1, case.context, case.scale, True, -1, 0.0)
    return common.rel_error(out, case.expected[:n])


# ----------------------------------------------------------------------------------------------
# Implementations: each builder returns a Kernel whose fn(r) runs one call on cache copy r


@dataclasses.dataclass
class Kernel:
    fn: Callable[[int], Any]
    output: Callable[[], Any]  # the latest result, viewable as (B, H, D)
    note: str = ""
    #: K/V bytes one call reads, when not the case's bf16 bytes (an fp8 cache: half)
    kv_bytes: int | None = None


def attention_only(backend, md, pc: PagedCase, q, out, kv=None) -> tuple[Callable[[int], Any], str]:
    """``fn(r)``: the backend's prepared attention call for this step on cache copy ``r`` (what the
    eager op runs per layer; the step's KV write is not in it), and a note saying which path it is.
    ``kv``: (key caches, value caches, (k_scale, v_scale)) to read instead of ``pc``'s (fp8)."""
    shape, tensors = md.shape, md.tensors
    kcs, vcs, scales = kv if kv is not None else (pc.kcs, pc.vcs, None)
    calls = [backend.prepare_attend(shape, tensors, pc.spec, q.dtype, kcs[r], vcs[r], md.selector.buffers, scales)
             for r in range(len(kcs))]

    def fn(r):
        calls[r](q, out)

    return fn, f"{getattr(backend, 'label', backend.name)} prepared call ({call_name(calls[0])})"


def call_name(call) -> str:
    """What a prepared call is, for the notes: a function's qualified name, or a launch object's
    type and the kernel it launches (an unsplit Triton decode is a ``DirectKernel``, no function)."""
    name = getattr(call, "__qualname__", None)
    if name is not None:
        return name
    jit = getattr(call, "jit", None)
    kernel = getattr(jit, "__name__", None) or getattr(getattr(jit, "fn", None), "__name__", None)
    return f"{type(call).__qualname__}({kernel})" if kernel else type(call).__qualname__


def quantized_copies(case: Case, pc: PagedCase):
    """``pc``'s caches as float8_e4m3fn with one scale for K and one for V (the data's amax / 448,
    compileattn.fp8_scale): (key caches, value caches, (k_scale, v_scale) device tensors)."""
    import torch

    from compileattn import fp8_scale
    from compileattn.kv_cache import FP8_E4M3_MAX

    kvh = pc.spec.num_kv_heads
    scales = []
    for logical in (case.k, case.v):
        scales.append(torch.full((kvh,), fp8_scale(float(logical.abs().max())), dtype=torch.float32,
                                 device=logical.device))
    out = []
    for caches, scale in ((pc.kcs, scales[0]), (pc.vcs, scales[1])):
        copies = []
        for cache in caches:
            q8 = torch.empty(cache.shape, dtype=torch.float8_e4m3fn, device=cache.device)
            for s in range(0, cache.shape[0], 4096):  # in chunks: an fp32 copy of a whole cache is 8 GiB
                part = cache[s:s + 4096].float() / scale.view(1, 1, -1, 1)
                q8[s:s + 4096] = part.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
            copies.append(q8)
        out.append(copies)
    return out[0], out[1], (scales[0], scales[1])


def build_compileattn(name: str, case: Case, pc: PagedCase, fp8: bool = False, autotune: bool = False) -> Kernel:
    """``autotune``: a Triton backend of its own whose decode launches are autotuned
    (compileattn/backends/triton/autotune.py, timed at its default contexts, each capped at
    what the cell's cache holds, as a served model's graphs replay one choice at every context),
    so ``ca-triton`` beside it keeps the heuristics."""
    import torch

    from compileattn.backends.selector import get_backend
    from compileattn.metadata import AttentionMetadataBuilder, SequenceStep

    try:
        if autotune:
            from compileattn.backends.triton.backend import TritonBackend

            backend = TritonBackend(case.q.device.type)
            backend.enable_autotune()  # its default contexts, as in serving: one choice per batch for all
        else:
            backend = get_backend(name, case.q.device)
    except Exception as exc:  # noqa: BLE001  (ImportError, or a half-installed package failing later)
        raise Unavailable(f"backend {name!r} not usable here: {common.short_error(exc)}") from None
    cache_dtype = torch.float8_e4m3fn if fp8 else case.q.dtype
    reason = backend.unsupported_reason(pc.spec, case.q.dtype, case.q.device, pc.page, cache_dtype=cache_dtype)
    if reason is not None:
        raise Unavailable(f"backend {name!r}: {reason}")
    b, nb = pc.block_table.shape
    builder = AttentionMetadataBuilder(block_size=pc.page, num_blocks=pc.num_blocks, max_num_tokens=b,
                                       max_blocks_per_seq=nb, device=case.q.device, backend=backend)
    seqs = [SequenceStep(1, case.context - 1, row) for row in pc.block_table.tolist()]
    md = builder.build(seqs)  # shape work stays out of the timed region
    if not md.is_uniform_decode:
        raise RuntimeError("metadata of a decode step is not uniform decode")
    out = torch.empty_like(case.q)
    kv = quantized_copies(case, pc) if fp8 else None
    fn, note = attention_only(backend, md, pc, case.q, out, kv)
    if fp8:
        note += f"; fp8 KV, scales K {float(kv[2][0][0]):.4g} V {float(kv[2][1][0]):.4g}"
    if autotune:
        from compileattn.backends.triton.autotune import summarize

        for key, trials in backend.autotuner.trials.items():
            note += f"; autotune: {summarize(trials, backend.autotuner.chosen.get(key))}"
    return Kernel(fn, lambda: out, note, kv_bytes=2 * case.k.numel() if fp8 else None)  # fp8: a byte each


def build_baseline(case: Case, pc: PagedCase) -> Kernel:
    """The PagedAttention-V1/V2-style kernel as vLLM's rule would pick it for this batch."""
    import torch

    from paged_attention_baseline import baseline_for

    b = case.batch
    seq_lens = torch.full((b,), case.context, dtype=torch.int32, device=case.q.device)
    kernel = baseline_for(pc.spec.num_heads, pc.spec.num_kv_heads, pc.spec.head_dim, pc.page, seq_lens,
                          pc.block_table, case.context, scale=case.scale)
    out = torch.empty_like(case.q)
    kcs, vcs, q = pc.kcs, pc.vcs, case.q

    def fn(r):
        kernel(q, kcs[r], vcs[r], out)

    return Kernel(fn, lambda: out, f"{kernel.variant} (vLLM's V1/V2 rule), own Triton kernel, CUDA-core dots")


_FI_WORKSPACE: dict[Any, Any] = {}


def build_flashinfer(case: Case, pc: PagedCase, tensor_cores: bool) -> Kernel:
    import torch

    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"flashinfer not importable: {common.short_error(exc)}") from None
    dev = case.q.device
    b, nb = pc.block_table.shape
    page = pc.page
    indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * nb
    indices = pc.block_table.reshape(-1).contiguous()
    last = torch.full((b,), case.context - (nb - 1) * page, dtype=torch.int32, device=dev)
    ws = _FI_WORKSPACE.get(dev)
    if ws is None:
        ws = _FI_WORKSPACE[dev] = torch.zeros(256 * common.MiB, dtype=torch.uint8, device=dev)
    out = torch.empty_like(case.q)
    errors, wrapper, graph_mode = [], None, None
    for graph_mode in (True, False):  # the CUDA-graph wrapper first: the timed calls are captured
        try:
            extra = {}
            if graph_mode:
                extra = dict(use_cuda_graph=True, paged_kv_indptr_buffer=indptr.clone(),
                             paged_kv_indices_buffer=torch.empty_like(indices),
                             paged_kv_last_page_len_buffer=last.clone())
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores, **extra)
            wrapper.plan(indptr, indices, last, case.q.shape[1], pc.spec.num_kv_heads, pc.spec.head_dim, page,
                         q_data_type=case.q.dtype, kv_data_type=case.q.dtype, sm_scale=case.scale)
            break
        except Exception as exc:  # noqa: BLE001
            errors.append(f"use_cuda_graph={graph_mode}: {common.short_error(exc, 200)}")
            wrapper = None
    if wrapper is None:
        raise Unavailable("FlashInfer plan failed: " + "; ".join(errors))
    kcs, vcs, q = pc.kcs, pc.vcs, case.q

    def fn(r):
        wrapper.run(q, (kcs[r], vcs[r]), out=out)

    resolved = getattr(wrapper, "resolved_backend", None) or getattr(wrapper, "_backend", "?")
    return Kernel(fn, lambda: out, f"backend={resolved}, use_cuda_graph={graph_mode}")


_FLEX: dict[str, Any] = {}


def _compiled_flex():
    """One ``torch.compile(flex_attention)`` per process, shapes automatic-dynamic: recompiling for
    every batch size would cost ~10 s per cell (and hit Dynamo's recompile limit)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    fn = _FLEX.get("fn")
    if fn is None:
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
        fn = _FLEX["fn"] = torch.compile(flex_attention, fullgraph=True)
    return fn


def build_flex(case: Case, pc: PagedCase) -> Kernel:
    """FlexAttention's paged attention as ``torch.nn.attention.experimental._paged_attention``
    prescribes: a logical block mask converted to physical pages, plus its score_mod that maps
    physical to logical positions, run through compiled ``flex_attention`` over the cache viewed
    as one (1, KV heads, pages * page, D) sequence (PyTorch's own paged-attention tests do this)."""
    import torch

    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, noop_mask
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"FlexAttention paged attention not importable: {common.short_error(exc)}") from None
    dev = case.q.device
    b, nb = pc.block_table.shape
    page, n_pages = pc.page, pc.num_blocks
    kvh, d = pc.spec.num_kv_heads, pc.spec.head_dim
    pa = PagedAttention(n_pages, page, b, device=str(dev))
    table = pc.block_table.long()
    pa.page_table[:, :nb] = table
    pa.physical_to_logical.scatter_(1, table, torch.arange(nb, device=dev).expand(b, nb).contiguous())
    pa.capacity.fill_(nb * page)
    pa.empty_pages = []
    kv_len = torch.full((b,), case.context, dtype=torch.int64, device=dev)
    logical = create_block_mask(noop_mask, b, 1, 1, case.context, device=dev, BLOCK_SIZE=page)
    block_mask = pa.convert_logical_block_mask(logical, kv_len=kv_len)
    score_mod = pa.get_score_mod(None, kv_len=kv_len)
    flex = _compiled_flex()
    q4 = case.q.view(b, case.q.shape[1], 1, d)
    holder: list = [None]

    def views(contiguous: bool):
        def one(c):
            x = c.view(1, n_pages * page, kvh, d).transpose(1, 2)
            return x.contiguous() if contiguous else x
        return [one(c) for c in pc.kcs], [one(c) for c in pc.vcs]

    note = "cache viewed (1, KVH, pages*page, D) in place"
    ks, vs = views(False)

    def fn(r):
        holder[0] = flex(q4, ks[r], vs[r], score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                         scale=case.scale)

    try:
        fn(0)  # compiles
    except Exception as exc:  # noqa: BLE001  (a strided K/V view it does not take: try a dense copy)
        first = common.short_error(exc, 200)
        ks, vs = views(True)
        note = f"dense (1, KVH, N, D) copy of the cache; the in-place view failed: {first}"
        fn(0)
    return Kernel(fn, lambda: holder[0].reshape(b, -1, d), note)


def build_gather_sdpa(case: Case, pc: PagedCase) -> Kernel:
    """Index the pages into a contiguous (B, KVH, ctx, D) K and V, then SDPA: what a model without a
    paged kernel does. The query heads of a KV head are packed as query rows (exact for one query
    token: no causal mask applies), so SDPA reads each KV head once."""
    import torch.nn.functional as F

    b, nb = pc.block_table.shape
    page, ctx = pc.page, case.context
    kvh, d = pc.spec.num_kv_heads, pc.spec.head_dim
    flat = pc.block_table.reshape(-1).long()
    qg = case.q.view(b, kvh, -1, d)
    kcs, vcs, scale = pc.kcs, pc.vcs, case.scale
    holder: list = [None]

    def fn(r):
        k = kcs[r].index_select(0, flat).view(b, nb * page, kvh, d)[:, :ctx].transpose(1, 2)
        v = vcs[r].index_select(0, flat).view(b, nb * page, kvh, d)[:, :ctx].transpose(1, 2)
        holder[0] = F.scaled_dot_product_attention(qg, k, v, scale=scale)

    return Kernel(fn, lambda: holder[0].reshape(b, -1, d), "index_select pages, then SDPA (GQA heads packed)")


def build_sdpa_contig(case: Case) -> Kernel:
    """SDPA over a contiguous (B, KVH, ctx, D) cache: the non-paged ceiling (GQA heads packed as
    query rows, so each KV head is read once)."""
    import torch.nn.functional as F

    b, ctx, kvh, d = case.k.shape
    ks = [case.k.transpose(1, 2).contiguous()]
    vs = [case.v.transpose(1, 2).contiguous()]
    ks += [ks[0].clone() for _ in range(case.rotations - 1)]
    vs += [vs[0].clone() for _ in range(case.rotations - 1)]
    qg = case.q.view(b, kvh, -1, d)
    holder: list = [None]
    scale = case.scale

    def fn(r):
        holder[0] = F.scaled_dot_product_attention(qg, ks[r], vs[r], scale=scale)

    return Kernel(fn, lambda: holder[0].reshape(b, -1, d), "contiguous cache, GQA heads packed")


def builder_for(impl: str, case: Case, pc: PagedCase | None) -> Callable[[], Kernel]:
    if impl == "ca-triton":
        return lambda: build_compileattn("triton", case, pc)
    if impl == "ca-flash":
        return lambda: build_compileattn("flash", case, pc)
    if impl == FP8_IMPL:
        return lambda: build_compileattn("triton", case, pc, fp8=True)
    if impl == "ca-triton-tuned":
        return lambda: build_compileattn("triton", case, pc, autotune=True)
    if impl == BASELINE:
        return lambda: build_baseline(case, pc)
    if impl == "fi-tc":
        return lambda: build_flashinfer(case, pc, tensor_cores=True)
    if impl == "fi-cc":
        return lambda: build_flashinfer(case, pc, tensor_cores=False)
    if impl == "flex":
        return lambda: build_flex(case, pc)
    if impl == "gather-sdpa":
        return lambda: build_gather_sdpa(case, pc)
    if impl == "sdpa-contig":
        return lambda: build_sdpa_contig(case)
    raise ValueError(f"unknown impl {impl!r}")


# ----------------------------------------------------------------------------------------------
# Measuring one cell


def base_row(impl: str, context: int, batch: int, page: int | None, run: int = 0,
             shape: str = DEFAULT_SHAPE) -> dict[str, Any]:
    return {"run": run, "impl": impl, "label": IMPLS[impl][0], "shape": shape, "context": context, "batch": batch,
            "page": page, "kv_bytes": kv_bytes(batch, context, KV_ELEMENT_SIZE.get(impl, 2), shape), "status": None,
            "reason": "", "us": None, "tbps": None, "x_floor": None}


def row_shape(row: dict[str, Any]) -> str:
    """A row's head layout (rows written before shapes existed are the default one)."""
    return row.get("shape", DEFAULT_SHAPE)


def measure(impl: str, case: Case, pc: PagedCase | None, *, args, budget: common.Budget, copy_gbps: float,
            log: common.Log) -> dict[str, Any]:
    page = pc.page if pc is not None else None
    row = base_row(impl, case.context, case.batch, page, shape=case.shape)
    row["rotations"] = case.rotations
    if budget.exceeded():
        row.update(status="skipped", reason=budget.reason())
        return row
    start = time.monotonic()
    kernel = None
    try:
        kernel = builder_for(impl, case, pc)()
        row["note"] = kernel.note
        nbytes = kernel.kv_bytes or case.kv_bytes
        row["kv_bytes"] = nbytes
        tolerance = FP8_TOLERANCE if impl == FP8_IMPL else TOLERANCE
        kernel.fn(0)
        common.synchronize()
        err = common.rel_error(kernel.output().reshape(case.expected.shape), case.expected)
        row["rel_err"] = err
        if not err <= tolerance:
            row.update(status="FAILED", reason=f"output differs from the fp32 oracle: rel. error {err:.3g} "
                                               f"> {tolerance}")
            return row
        post: dict[str, float] = {}

        def after():  # the output of the timed (captured) calls, checked while the graph is alive
            post["err"] = common.rel_error(kernel.output().reshape(case.expected.shape), case.expected)

        t = common.gpu_time_us(kernel.fn, rotations=case.rotations, target_ms=args.target_ms, reps=args.reps,
                               after=after)
        row.update(method=t.method, iters=t.iters, spread=t.spread, min_us=t.min_us)
        if t.note:
            row["note"] = (row.get("note", "") + "; " + t.note).strip("; ")
        if post.get("err", 0.0) > tolerance:
            row.update(status="FAILED", us_invalid=t.us, reason=f"output after the timed replays differs from "
                                                                f"the oracle: rel. error {post['err']:.3g}")
            return row
        floor_us = nbytes / (copy_gbps * 1e9) * 1e6
        row.update(status="ok", us=t.us, tbps=nbytes / (t.us * 1e-6) / 1e12, floor_us=floor_us,
                   x_floor=t.us / floor_us)
    except Unavailable as exc:
        row.update(status="unavailable", reason=str(exc))
    except Exception as exc:  # noqa: BLE001  (one failing peer must not cost the table)
        row.update(status="error", reason=common.short_error(exc))
        log(f"    {impl}: {common.short_error(exc)}\n" + "".join(traceback.format_exc(limit=6)).rstrip())
        try:
            common.synchronize()
        except Exception:  # noqa: BLE001
            pass
    finally:
        row["setup_s"] = round(time.monotonic() - start, 2)
        kernel = None  # noqa: F841  (frees its buffers before the next implementation allocates)
    return row


def describe(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        return f"{row['us']:9.1f} µs  {row['tbps']:5.2f} TB/s  {row['x_floor']:5.2f}x floor  [{row.get('method')}]"
    return f"{row['status']}: {row['reason']}"


def run_benchmark(args, log: common.Log, checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """All cells; ``checkpoint(payload)`` after each one, so a run killed at its time limit still
    leaves every finished cell on disk."""
    import torch

    device = torch.device("cuda")
    dtype = getattr(torch, DTYPE_NAME)
    budget = common.Budget(args.budget_s)
    env = common.environment()
    log(f"GPU {env['gpu']}; versions {env['versions']}")
    bw = common.copy_bandwidth(device=device)
    log(f"device-to-device copy: {bw['GBps']:.0f} GB/s (read + write)")
    l2 = common.l2_cache_bytes()
    paged_impls = [i for i in args.impls if IMPLS[i][1]]
    rows: list[dict[str, Any]] = []
    run = {"label": args.label or default_label(env), "env": env, "copy_bandwidth": bw, "l2_bytes": l2,
           "warm_l2": bool(args.warm_l2), "budget_s": args.budget_s}
    payload = {"benchmark": "decode_attention",
               "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                         "dtype": DTYPE_NAME},
               "shapes": {name: SHAPES[name]._asdict() for name in args.shapes},
               "config": {"contexts": args.contexts, "batches": args.batches, "pages": args.pages,
                          "shapes": args.shapes, "impls": args.impls, "target_ms": args.target_ms, "reps": args.reps,
                          "tolerance": TOLERANCE, "fp8_tolerance": FP8_TOLERANCE},
               "runs": [run], "rows": rows}

    def cell_rows(shape, ctx, batch, status, reason, pages=None):
        return [{**base_row(impl, ctx, batch, page, shape=shape), "status": status, "reason": reason}
                for impl in args.impls for page in ((pages or args.pages) if IMPLS[impl][1] else [None])]

    for shape in args.shapes:  # the shape outermost: a run cut short by its budget has whole tables
        for ctx in args.contexts:
            for batch in args.batches:
                if budget.exceeded():
                    rows += cell_rows(shape, ctx, batch, "skipped", budget.reason())
                    continue
                done = len(rows)
                try:
                    run_cell(shape, ctx, batch, args, rows, paged_impls, budget, bw["GBps"], l2, device, dtype, log)
                except Exception as exc:  # noqa: BLE001  (e.g. out of memory building a cell's inputs)
                    log(f"  cell failed: {common.short_error(exc)}\n" + traceback.format_exc(limit=6).rstrip())
                    measured = {(r["impl"], r["page"]) for r in rows[done:]}
                    reason = f"cell setup failed: {common.short_error(exc)}"
                    rows += [r for r in cell_rows(shape, ctx, batch, "error", reason)
                             if (r["impl"], r["page"]) not in measured]
                torch.cuda.empty_cache()
                run["elapsed_s"] = round(log.elapsed(), 1)
                if checkpoint is not None:
                    checkpoint(payload)
    run["elapsed_s"] = round(log.elapsed(), 1)
    return payload


def run_cell(shape: str, ctx: int, batch: int, args, rows: list, paged_impls: Sequence[str], budget: common.Budget,
             copy_gbps: float, l2: int, device, dtype, log: common.Log) -> None:
    import torch

    nbytes = kv_bytes(batch, ctx, 2, shape)
    rot = 1 if args.warm_l2 else common.rotations_for(nbytes, l2)
    log(f"{shape}, context {ctx}, batch {batch}: KV {nbytes / common.MiB:.1f} MiB, "
        f"{rot} cache cop{'y' if rot == 1 else 'ies'}")
    case = make_case(ctx, batch, rotations=rot, device=device, dtype=dtype, seed=args.seed, shape=shape)
    if "sdpa-contig" in args.impls:
        row = measure("sdpa-contig", case, None, args=args, budget=budget, copy_gbps=copy_gbps, log=log)
        rows.append(row)
        log(f"  {'sdpa-contig':12s}          {describe(row)}")
    for page in args.pages:
        pc = make_paged(case, page, seed=args.seed)
        ref_err = check_oracle_against_reference(case, pc)
        if not ref_err <= 1e-2:
            for impl in paged_impls:
                rows.append({**base_row(impl, ctx, batch, page, shape=shape), "status": "error",
                             "reason": f"oracle disagrees with the reference backend ({ref_err:.3g})"})
            log(f"  page {page}: oracle vs reference backend rel. error {ref_err:.3g}; cell skipped")
            continue
        for impl in paged_impls:
            row = measure(impl, case, pc, args=args, budget=budget, copy_gbps=copy_gbps, log=log)
            rows.append(row)
            log(f"  {impl:12s} page {page:3d} {describe(row)}")
        del pc
        torch.cuda.empty_cache()


def default_label(env: dict[str, Any]) -> str:
    v = env.get("versions") or {}
    parts = [f"FA4 {v['flash-attn-4']}" if v.get("flash-attn-4") else None,
             f"FlashInfer {v['flashinfer']}" if v.get("flashinfer") else None]
    parts = [p for p in parts if p]
    return " + ".join(parts) if parts else "no FA4/FlashInfer"


# ----------------------------------------------------------------------------------------------
# Merging runs and reporting (CPU-only code: tested in tests/test_benchmarks_cpu.py)


def merge_payloads(payloads: Sequence[dict[str, Any]], labels: Sequence[str] | None = None) -> dict[str, Any]:
    """Concatenate runs; rows keep (re-numbered) run indices. Selection happens in ``select``."""
    if not payloads:
        raise ValueError("nothing to merge")
    runs, rows = [], []
    for i, pl in enumerate(payloads):
        if pl.get("benchmark") != "decode_attention":
            raise ValueError(f"input {i} is not a decode_attention result (benchmark={pl.get('benchmark')!r})")
        offset = len(runs)
        for j, run in enumerate(pl["runs"]):
            run = dict(run)
            if labels and len(pl["runs"]) == 1 and labels[i]:
                run.setdefault("source", labels[i])
            runs.append(run)
        for row in pl["rows"]:
            rows.append({**row, "run": row.get("run", 0) + offset})
    merged = {k: v for k, v in payloads[0].items() if k not in ("runs", "rows")}
    merged["runs"], merged["rows"] = runs, rows
    return merged


def cell_key(row: dict[str, Any]) -> tuple:
    return (row["context"], row["batch"], row["page"])


def select(rows: Sequence[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(context, batch, page, impl) -> the row shown, with ``ratio_fi_tc`` (µs / FlashInfer
    tensor-core µs) and ``other_runs`` (the same measurement from other runs, µs).

    Choice: an ok row over a non-ok one; among ok rows, the one from a run that also measured
    FlashInfer tensor-core decode in this cell (its ratio is then same-run); else the first.
    The page-independent SDPA row is shown in every page of its (context, batch)."""
    fi_runs: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        if r["impl"] == FI_TC and r["status"] == "ok":
            fi_runs.setdefault(cell_key(r), {})[r["run"]] = r
    pages = sorted({r["page"] for r in rows if r["page"] is not None})
    expanded = []
    for r in rows:
        if r["page"] is None:
            expanded += [{**r, "page": p, "page_independent": True} for p in (pages or [None])]
        else:
            expanded.append(r)
    groups: dict[tuple, list] = {}
    for r in expanded:
        groups.setdefault((*cell_key(r), r["impl"]), []).append(r)
    chosen: dict[tuple, dict[str, Any]] = {}
    for key, cands in groups.items():
        fis = fi_runs.get(key[:3], {})

        def rank(r):
            return (r["status"] != "ok", r["run"] not in fis, r["run"])

        top = min(cands, key=rank)
        best = dict(top)
        best["other_runs"] = [{"run": r["run"], "us": r["us"], "status": r["status"]} for r in cands if r is not top]
        fi = fis.get(best["run"]) or (next(iter(fis.values())) if fis else None)
        if best["status"] == "ok" and fi is not None:
            best["ratio_fi_tc"] = best["us"] / fi["us"]
            best["ratio_same_run"] = fi["run"] == best["run"]
            best["fi_tc_us"] = fi["us"]  # the FlashInfer time the ratio divides by (goal_check's too)
        chosen[key] = best
    return chosen


def goal_check(chosen: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per page-16 cell: the faster compileattn backend against FlashInfer tensor-core GPU time,
    and its TB/s at batch >= 64 (the issue's goals)."""
    cells = sorted({k[:3] for k in chosen if k[2] == GOAL_PAGE})
    out = []
    for cell in cells:
        cas = [chosen[(*cell, i)] for i in COMPILEATTN_IMPLS if (*cell, i) in chosen]
        ok = [r for r in cas if r["status"] == "ok"]
        fi = chosen.get((*cell, FI_TC))
        fi = fi if fi and fi["status"] == "ok" else None
        entry = {"context": cell[0], "batch": cell[1], "page": cell[2], "best": None, "us": None,
                 "fi_tc_us": fi["us"] if fi else None, "ratio": None, "time_ok": None, "tbps": None, "bw_ok": None}
        if ok:
            best = min(ok, key=lambda r: r["us"])
            entry.update(best=best["impl"], us=best["us"], tbps=best["tbps"])
            if best.get("ratio_fi_tc") is not None:
                # select's pairing: FlashInfer from the best row's own run whenever that run measured
                # it (the cell's shown FlashInfer row can be another run's)
                entry.update(fi_tc_us=best["fi_tc_us"], ratio=best["ratio_fi_tc"],
                             ratio_same_run=best["ratio_same_run"])
                # a ratio only across runs (marked * in the table) is no verdict: GPU clocks differ
                entry["time_ok"] = entry["ratio"] <= 1.0 if best["ratio_same_run"] else None
            if cell[1] >= GOAL_BATCH:
                entry["bw_ok"] = best["tbps"] >= GOAL_TBPS
        out.append(entry)
    return out


def goal_records(goals: Sequence[dict[str, Any]], shape_label: str = "") -> list[dict[str, Any]]:
    """``goal_check``'s cells as the two goals (``common.goal`` records): page-16 compileattn at or
    under FlashInfer tensor-core GPU time in every cell, and >= GOAL_TBPS at batch >= GOAL_BATCH."""
    prefix = f"{shape_label}: " if shape_label else ""
    records = []

    def verdict(passed: int, measured: int, expected: int) -> tuple[bool | None, str]:
        """Every cell: a cell without a measurement (no ok compileattn or FlashInfer row) is not a
        cell met, so with no measured miss the verdict is "not measured", never MET."""
        unmeasured = expected - measured
        met = False if passed < measured else (True if not unmeasured else None)
        return met, (f"; {unmeasured} cell(s) not measured" if unmeasured else "")

    timed = [g for g in goals if g["time_ok"] is not None]
    what = f"{prefix}page-{GOAL_PAGE} compileattn ≤ FlashInfer tensor-core GPU time in every cell"
    if timed:
        passed = sum(g["time_ok"] for g in timed)
        worst = max(timed, key=lambda g: g["ratio"])
        met, missing = verdict(passed, len(timed), len(goals))
        records.append(common.goal(
            what, met, f"{passed}/{len(timed)} cells ({min(g['ratio'] for g in timed):.3f}–"
            f"{worst['ratio']:.3f}×); worst at context {worst['context']}, batch {worst['batch']} "
            f"({worst['us']:.1f} vs {worst['fi_tc_us']:.1f} µs){missing}", cells=len(timed), cells_met=passed,
            cells_unmeasured=len(goals) - len(timed), worst=worst["ratio"]))
    else:
        records.append(common.goal(what, None, "no FlashInfer tensor-core or no compileattn result at page 16"))
    bw = [g for g in goals if g["bw_ok"] is not None]
    what = f"{prefix}≥ {GOAL_TBPS} TB/s at batch ≥ {GOAL_BATCH}, page {GOAL_PAGE}"
    if bw:
        passed = sum(g["bw_ok"] for g in bw)
        worst = min(bw, key=lambda g: g["tbps"])
        big = sum(g["batch"] >= GOAL_BATCH for g in goals)
        met, missing = verdict(passed, len(bw), big)
        records.append(common.goal(
            what, met, f"{passed}/{len(bw)} cells; lowest {worst['tbps']:.2f} TB/s at context "
            f"{worst['context']}, batch {worst['batch']}{missing}", cells=len(bw), cells_met=passed,
            cells_unmeasured=big - len(bw), worst=worst["tbps"]))
    else:
        records.append(common.goal(what, None, f"no page-{GOAL_PAGE} compileattn result at batch ≥ {GOAL_BATCH}"))
    return records


def shape_goal_records(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Both goals for every shape of the run that has page-16 cells."""
    records = []
    for shape in _ordered_shapes(payload["rows"]):
        goals = goal_check(select([r for r in payload["rows"] if row_shape(r) == shape]))
        if goals:
            records += [{**g, "shape": shape} for g in goal_records(goals, _shape_dims(shape, payload).label)]
    return records


def goal_summary(goals: Sequence[dict[str, Any]]) -> list[str]:
    lines = [common.goal_line(g) for g in goal_records(goals)]
    missing = [g for g in goals if g["best"] is None]
    if missing:
        lines.append(f"- {len(missing)} page-16 cell(s) have no compileattn result at all.")
    return lines


def cell_text(row: dict[str, Any] | None) -> str:
    if row is None:
        return "—"
    if row["status"] != "ok":
        return common.status_text(row["status"])
    text = f"{row['us']:.1f} · {row['tbps']:.2f} · {row['x_floor']:.2f}×"
    if row.get("method") == "events":
        text += " (ev)"
    return text


def _ordered_shapes(rows: Sequence[dict[str, Any]]) -> list[str]:
    present = {row_shape(r) for r in rows}
    return [s for s in SHAPES if s in present] + sorted(present - set(SHAPES))


def _shape_dims(shape: str, payload: dict[str, Any]) -> Shape:
    """A shape's dims: this script's, or those the result file recorded (a shape added later)."""
    dims = SHAPES.get(shape)
    if dims is None:
        dims = Shape(**payload.get("shapes", {}).get(shape, {"num_heads": "?", "num_kv_heads": "?", "head_dim": "?",
                                                                 "label": shape}))
    return dims


def _shape_label(shape: str, payload: dict[str, Any]) -> str:
    dims = _shape_dims(shape, payload)
    return f"{dims.label}: {dims.num_heads} query / {dims.num_kv_heads} KV heads, head dim {dims.head_dim}"


def _main_table(chosen: dict[tuple, dict[str, Any]], shape: str) -> list[str]:
    impls = [i for i in IMPLS if any(k[3] == i for k in chosen)]
    cells = sorted({k[:3] for k in chosen}, key=lambda c: (c[0], c[2] if c[2] is not None else 0, c[1]))
    headers = ["context", "batch", "page", "KV MiB"] + [IMPLS[i][0] for i in impls] + ["best ca ÷ FI-TC"]
    table = []
    for cell in cells:
        ctx, batch, page = cell
        ca = [chosen.get((*cell, i)) for i in COMPILEATTN_IMPLS]
        ca = [r for r in ca if r and r["status"] == "ok" and r.get("ratio_fi_tc") is not None]
        best = min(ca, key=lambda r: r["us"]) if ca else None
        ratio = "—" if best is None else f"{best['ratio_fi_tc']:.2f}" + ("" if best.get("ratio_same_run") else "*")
        mib = kv_bytes(batch, ctx, 2, shape) / common.MiB if shape in SHAPES else float("nan")
        table.append([ctx, batch, page if page is not None else "—", f"{mib:.0f}"]
                     + [cell_text(chosen.get((*cell, i))) for i in impls] + [ratio])
    return [common.markdown_table(headers, table)]


def _notes(chosen: dict[tuple, dict[str, Any]]) -> list[str]:
    first_page = min((k[2] for k in chosen if k[2] is not None), default=None)
    shown = [r for k, r in chosen.items() if not r.get("page_independent") or k[2] == first_page]
    notes: dict[tuple, list] = {}
    notes_ok: dict[tuple, int] = {}
    for r in shown:  # reasons of what the table shows (a row replaced by another run's ok row is not news)
        if r["status"] in ("unavailable", "error", "FAILED") and r.get("reason"):
            notes.setdefault((r["impl"], r["status"], r["reason"]), []).append(r)
        if r["status"] == "ok" and r.get("note"):
            notes_ok.setdefault((r["impl"], r["note"]), 0)
    out = []
    for (impl, status, reason), rs in sorted(notes.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        where = ", ".join(sorted({f"run {r['run']}" for r in rs}))
        out.append(f"- {IMPLS[impl][0]} — {status} in {len(rs)} cell(s) ({where}): {reason}")
    for impl, note in sorted(notes_ok):
        out.append(f"- {IMPLS[impl][0]}: {note}")
    return out


def render_markdown(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    runs = payload["runs"]
    out = ["# Decode attention: bf16, one query token per sequence", ""]
    for i, run in enumerate(runs):
        bw = run.get("copy_bandwidth", {}).get("GBps")
        out.append(f"Run {i} — {run.get('label', '?')}" + (f" (from {run['source']})" if run.get("source") else "")
                   + f": copy bandwidth {common.fmt_num(bw, 0)} GB/s (read + write), "
                   + ("L2-warm" if run.get("warm_l2") else "L2-cold (cache copies rotated)"))
        out.append(common.environment_markdown(run.get("env", {})))
        out.append("")
    out.append("Each cell: GPU µs per call · TB/s of K+V read · × the memory floor (K+V bytes ÷ copy bandwidth of "
               "the same run; an fp8 cache reads half the bytes). GPU time from CUDA-graph replays of many calls "
               "((ev): CUDA events around eager calls, capture failed). `n/a`: not runnable here, reason below. "
               "**FAILED**: output disagreed with the fp32 oracle, not timed. Last column: the faster compileattn "
               "backend (bf16) ÷ FlashInfer tensor-core (* = the two times come from different runs).")
    out.append("")
    for shape in _ordered_shapes(rows):
        chosen = select([r for r in rows if row_shape(r) == shape])
        out += [f"## {_shape_label(shape, payload)}", ""]
        out += _main_table(chosen, shape)
        goals = goal_check(chosen)
        if goals:
            out += ["", "### Goal check (issues 5 and 12)", ""]
            out.extend(goal_summary(goals))
            out.append("")
            out.append(common.markdown_table(
                ["context", "batch", "best compileattn", "µs", "FI-TC µs", "ratio", "TB/s", "time goal",
                 "TB/s goal"],
                [[g["context"], g["batch"], IMPLS[g["best"]][0] if g["best"] else "—", common.fmt_num(g["us"]),
                  common.fmt_num(g["fi_tc_us"]), common.fmt_num(g["ratio"], 2), common.fmt_num(g["tbps"], 2),
                  {True: "met", False: "**missed**", None: "—"}[g["time_ok"]],
                  {True: "met", False: "**missed**", None: "—"}[g["bw_ok"]]] for g in goals]))
        kt = kernel_table(chosen)
        if kt:
            out += ["", "### Kernel table: compileattn against the PagedAttention-style baseline and FlashInfer", ""]
            out += render_kernel_table(kt)
        ft = fp8_table(chosen)
        if ft:
            out += ["", "### fp8 KV cache against bf16 (compileattn triton)", ""]
            out += render_fp8_table(ft)
        notes = _notes(chosen)
        if notes:
            out += ["", "### Notes", ""] + notes
    out += ["", "## KV-cache memory wasted by the block size", ""] + render_kv_waste(kv_waste_rows())
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------
# The originating change's kernel table, the fp8 rows, the KV waste (CPU-only code, tested)

#: "page 16 as fast as page 128": at most this much slower (the spread of repeated timings).
PAGE16_SLACK = 1.03
#: The originating change's measured speedups of FlashAttention over PagedAttention V1/V2 (A100,
#: 64/8 heads, bf16, context 1024/4096, batch 1-256), for the report's comparison.
ORIGIN_SPEEDUP = (1.07, 3.39)


def _ok(row: dict[str, Any] | None) -> dict[str, Any] | None:
    return row if row is not None and row["status"] == "ok" else None


def _best_compileattn(chosen, ctx: int, batch: int, page: int) -> dict[str, Any] | None:
    ok = [_ok(chosen.get((ctx, batch, page, i))) for i in COMPILEATTN_IMPLS]
    ok = [r for r in ok if r is not None]
    return min(ok, key=lambda r: r["us"]) if ok else None


def kernel_table(chosen: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (context, batch) of one shape: the faster compileattn backend at page 16 and 128, the
    baseline (page 16, PagedAttention's block size) and FlashInfer tensor-core (page 16), with
    compileattn ÷ baseline, compileattn ÷ FlashInfer and page 16 ÷ page 128. Rows with neither a
    baseline nor a page-128 compileattn result are left out (the main table has them)."""
    out = []
    for ctx, batch in sorted({k[:2] for k in chosen}):
        ca16, ca128 = _best_compileattn(chosen, ctx, batch, 16), _best_compileattn(chosen, ctx, batch, 128)
        base = _ok(chosen.get((ctx, batch, 16, BASELINE)))
        fi = _ok(chosen.get((ctx, batch, 16, FI_TC)))
        if base is None and ca128 is None:
            continue
        us = lambda r: r["us"] if r else None  # noqa: E731
        ratio = lambda a, b: a["us"] / b["us"] if a and b else None  # noqa: E731
        out.append({"context": ctx, "batch": batch, "ca16_us": us(ca16), "ca16_impl": ca16["impl"] if ca16 else None,
                    "ca128_us": us(ca128), "p16_vs_p128": ratio(ca16, ca128), "baseline_us": us(base),
                    "baseline_note": base.get("note", "") if base else "", "vs_baseline": ratio(ca16, base),
                    "speedup": ratio(base, ca16), "fi_us": us(fi), "vs_fi": ratio(ca16, fi)})
    return out


def _span(values: Sequence[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}" if len(values) > 1 else f"{values[0]:.{digits}f}"


def render_kernel_table(entries: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    vs_base = [e["vs_baseline"] for e in entries if e["vs_baseline"] is not None]
    if vs_base:
        speed = [1 / x for x in vs_base]
        lines.append(f"- compileattn ÷ baseline at page 16: {_span(vs_base)}× (a speedup of {_span(speed)}×; the "
                     f"originating change measured {ORIGIN_SPEEDUP[0]}–{ORIGIN_SPEEDUP[1]}× for FlashAttention over "
                     f"PagedAttention V1/V2 on an A100 at 64/8 heads). The baseline is this repository's Triton "
                     f"imitation of V1/V2 (`benchmarks/paged_attention_baseline.py`), not vLLM's CUDA kernels.")
    pages = [e["p16_vs_p128"] for e in entries if e["p16_vs_p128"] is not None]
    if pages:
        within = sum(x <= PAGE16_SLACK for x in pages)
        lines.append(f"- compileattn page 16 ÷ page 128: {_span(pages)}×; at most {PAGE16_SLACK:.2f}× (as fast) in "
                     f"{within} of {len(pages)} cells.")
    vs_fi = [e["vs_fi"] for e in entries if e["vs_fi"] is not None]
    if vs_fi:
        lines.append(f"- compileattn ÷ FlashInfer tensor-core at page 16: {_span(vs_fi)}×.")
    lines.append("")
    fmt = common.fmt_num
    lines.append(common.markdown_table(
        ["context", "batch", "compileattn p16 µs", "p128 µs", "p16 ÷ p128", "baseline µs", "ca ÷ baseline",
         "FI-TC µs", "ca ÷ FI-TC"],
        [[e["context"], e["batch"], fmt(e["ca16_us"], 1), fmt(e["ca128_us"], 1), fmt(e["p16_vs_p128"], 2),
          fmt(e["baseline_us"], 1), fmt(e["vs_baseline"], 2), fmt(e["fi_us"], 1), fmt(e["vs_fi"], 2)]
         for e in entries]))
    variants = sorted({e["baseline_note"] for e in entries if e["baseline_note"]})
    if variants:
        lines += ["", "Baseline variants: " + "; ".join(variants) + "."]
    return lines


#: fp8 ÷ bf16 GPU time expected "to approach half" at batch >= this (HBM-bound cells).
FP8_BATCH = 64


def fp8_table(chosen: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (context, batch, page) with both: Triton over the fp8 cache against Triton over bf16."""
    out = []
    for key in sorted(k[:3] for k in chosen if k[3] == FP8_IMPL):
        fp8, bf16 = _ok(chosen.get((*key, FP8_IMPL))), _ok(chosen.get((*key, "ca-triton")))
        if fp8 is None and bf16 is None:
            continue
        out.append({"context": key[0], "batch": key[1], "page": key[2], "fp8_us": fp8["us"] if fp8 else None,
                    "bf16_us": bf16["us"] if bf16 else None, "fp8_tbps": fp8["tbps"] if fp8 else None,
                    "fp8_err": fp8.get("rel_err") if fp8 else None,
                    "ratio": fp8["us"] / bf16["us"] if fp8 and bf16 else None})
    return out


def render_fp8_table(entries: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    big = [e["ratio"] for e in entries if e["ratio"] is not None and e["batch"] >= FP8_BATCH]
    if big:
        lines.append(f"- At batch ≥ {FP8_BATCH} (HBM-bound), fp8 ÷ bf16 GPU time: {_span(big)}× (half the bytes: "
                     f"0.50× is the floor).")
    small = [e["ratio"] for e in entries if e["ratio"] is not None and e["batch"] < FP8_BATCH]
    if small:
        lines.append(f"- At batch < {FP8_BATCH}: {_span(small)}×.")
    lines.append("- Rel. error: the fp8 output's norm-relative distance to the fp32 oracle over the unquantized "
                 f"cache (allowed: {FP8_TOLERANCE}, compileattn's documented bound).")
    lines.append("")
    fmt = common.fmt_num
    lines.append(common.markdown_table(
        ["context", "batch", "page", "bf16 µs", "fp8 µs", "fp8 ÷ bf16", "fp8 TB/s", "rel. error"],
        [[e["context"], e["batch"], e["page"], fmt(e["bf16_us"], 1), fmt(e["fp8_us"], 1), fmt(e["ratio"], 2),
          fmt(e["fp8_tbps"], 2), fmt(e["fp8_err"], 3)] for e in entries]))
    return lines


#: The KV-waste table's model of the lengths in flight. Synthetic, stated rather than measured: a
#: chat-like mix with a lognormal prompt (median 512 tokens, sigma 1.0) and a lognormal answer
#: (median 256, sigma 0.9), each sequence seen at a uniformly random point of its answer.
LENGTH_MODEL = "prompt ~ lognormal(median 512, σ 1.0) + a uniform share of an answer ~ lognormal(median 256, σ 0.9)"
#: Llama-70B-like K+V bytes per token: 80 layers x 8 KV heads x 128 x 2 (K and V) x 2 (bf16).
BYTES_PER_TOKEN_70B = 80 * 8 * 128 * 2 * 2
WASTE_BLOCKS = (1, 16, 32, 64, 128, 256)


def sample_lengths(samples: int = 100_000, seed: int = 0, cap: int = 16384) -> list[int]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(samples):
        prompt = min(max(1, round(rng.lognormvariate(math.log(512), 1.0))), 8192)
        answer = min(max(1, round(rng.lognormvariate(math.log(256), 0.9))), 4096)
        out.append(min(cap, prompt + rng.randint(1, answer)))
    return out


def kv_waste_rows(lengths: Sequence[int] | None = None, blocks: Sequence[int] = WASTE_BLOCKS,
                  bytes_per_token: int = BYTES_PER_TOKEN_70B, concurrent: int = 256) -> list[dict[str, Any]]:
    """Per block size: tokens allocated (whole blocks) against tokens used, for ``lengths``
    (default: ``sample_lengths()``); the waste per sequence, as a share, in MiB for ``concurrent``
    sequences of the 70B-like model, and how many sequences fit in block-1's memory."""
    lengths = sample_lengths() if lengths is None else list(lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError("lengths must be positive")
    used = sum(lengths) / len(lengths)
    rows = []
    for b in blocks:
        allocated = sum(-(-n // b) * b for n in lengths) / len(lengths)
        waste = allocated - used
        rows.append({"block": b, "mean_tokens": used, "mean_allocated": allocated, "waste_tokens": waste,
                     "expected_waste": (b - 1) / 2, "waste_share": waste / allocated,
                     "waste_mib": waste * bytes_per_token * concurrent / common.MiB,
                     "fit_vs_block1": used / allocated})
    return rows


def render_kv_waste(rows: Sequence[dict[str, Any]], concurrent: int = 256) -> list[str]:
    fmt = common.fmt_num
    mean = rows[0]["mean_tokens"]
    return [
        f"A sequence's last block is partly empty: on average (B − 1) / 2 of a block of B tokens once lengths "
        f"spread over many blocks, whatever their distribution. Lengths in flight here: {LENGTH_MODEL}, clipped "
        f"(a synthetic model, stated, not measured; mean {mean:.0f} tokens). Memory: a Llama-70B-like model, "
        f"{BYTES_PER_TOKEN_70B // 1024} KiB of K+V per token, {concurrent} sequences in flight. The FlashAttention "
        f"the originating change used needed blocks of 256.",
        "",
        common.markdown_table(
            ["block size", "tokens allocated / used", "wasted tokens per sequence", "≈ (B − 1) / 2",
             "share of allocated", f"wasted MiB ({concurrent} seqs)", "sequences fitting vs block 1"],
            [[r["block"], f"{r['mean_allocated']:.1f} / {r['mean_tokens']:.1f}", fmt(r["waste_tokens"], 1),
              fmt(r["expected_waste"], 1), f"{100 * r['waste_share']:.1f} %", fmt(r["waste_mib"], 0),
              f"{100 * r['fit_vs_block1']:.1f} %"] for r in rows]),
    ]


def plot(payload: dict[str, Any]):
    """TB/s against batch: one row of panels per head layout, one panel per context."""
    shapes = _ordered_shapes(payload["rows"])
    chosen_by_shape = {shape: select([r for r in payload["rows"] if row_shape(r) == shape]) for shape in shapes}
    contexts = sorted({k[0] for chosen in chosen_by_shape.values() for k in chosen})
    runs = payload["runs"]
    bw = runs[0].get("copy_bandwidth", {}).get("GBps") if runs else None

    def draw(plt):
        fig, axes = plt.subplots(max(1, len(shapes)), max(1, len(contexts)),
                                 figsize=(6.5 * max(1, len(contexts)), 4.5 * max(1, len(shapes))), squeeze=False)
        for row_axes, shape in zip(axes, shapes):
            chosen = chosen_by_shape[shape]
            for ax, ctx in zip(row_axes, contexts):
                for color, impl in enumerate(IMPLS):
                    for page, style in ((16, "-"), (128, "--")):
                        pts = sorted((k[1], r["tbps"]) for k, r in chosen.items()
                                     if k[0] == ctx and k[2] == page and k[3] == impl and r["status"] == "ok"
                                     and not (r.get("page_independent") and page != 16))
                        if pts:
                            lab = IMPLS[impl][0] + ("" if not IMPLS[impl][1] else f" p{page}")
                            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=f"C{color}",
                                    label=lab)
                if bw:
                    ax.axhline(bw / 1e3, color="gray", linestyle=":", label="copy bandwidth (floor)")
                ax.axhline(GOAL_TBPS, color="red", linestyle=":", linewidth=0.8, label=f"goal {GOAL_TBPS} TB/s")
                ax.set_xscale("log", base=2)
                ax.set_xlabel("batch")
                ax.set_ylabel("TB/s of K+V read (fp8: its own bytes)")
                ax.set_title(f"{SHAPES[shape].label if shape in SHAPES else shape}, context {ctx}")
                ax.set_ylim(bottom=0)
                ax.grid(alpha=0.3)
        handles, labels = {}, []
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in handles:
                    handles[lab] = h
                    labels.append(lab)
        fig.legend([handles[lab] for lab in labels], labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.suptitle("Paged decode, head dim 128, bf16 queries")
        return fig

    return draw


def write_outputs(payload: dict[str, Any], prefix: str, no_plot: bool, log: Callable[[str], None]) -> str:
    return common.write_outputs(payload, prefix, no_plot, log, render_markdown(payload), plot(payload),
                                "decode attention")


def write_kv_waste(prefix: str) -> str:
    path = common.output_paths(prefix)["md"]
    text = "\n".join(["# KV-cache memory wasted by the block size", ""] + render_kv_waste(kv_waste_rows())
                     + ["", f"Command: `{common.command_line()}`"])
    common.write_text(path, text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log = common.Log()
    if args.kv_waste:
        print(write_kv_waste(args.output or args.out), flush=True)
        return 0
    if args.merge:
        payloads = [common.read_json(p) for p in args.merge]
        merged = merge_payloads(payloads, [Path(p).stem for p in args.merge])
        print(write_outputs(merged, args.output or args.out, args.no_plot, log), flush=True)
        return 0
    missing = common.cuda_missing_message("decode_attention.py")
    if missing:
        print(missing, flush=True)
        return 0
    common.ensure_repo_on_path()
    payload = run_benchmark(args, log, checkpoint=lambda pl: write_outputs(pl, args.out, True, lambda _m: None))
    print(write_outputs(payload, args.out, args.no_plot, log), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
