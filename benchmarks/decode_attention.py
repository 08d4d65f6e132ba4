#!/usr/bin/env python
"""Paged decode attention, GPU time per call: compileattn's backends beside their peers.

Shape (issue 5 item 1): GQA 64 query / 8 KV heads, head dim 128, bf16, one query token per
sequence, every sequence ``context`` tokens long (the current token included), over batch sizes
and page sizes. Per cell and implementation: GPU µs per call, TB/s of KV read (K and V bytes of
all sequences' contexts / time) and the ratio to the memory floor (those bytes / the
device-to-device copy bandwidth measured in the same run).

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

Run: see benchmarks/README.md. On a machine without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

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
#: The issue's bandwidth goal for compileattn's page-16 decode at batch >= GOAL_BATCH.
GOAL_TBPS, GOAL_BATCH, GOAL_PAGE = 4.2, 64, 16

#: impl key -> (table label, needs a paged cache)
IMPLS: dict[str, tuple[str, bool]] = {
    "ca-triton": ("compileattn triton", True),
    "ca-flash": ("compileattn flash", True),
    "fi-tc": ("FlashInfer tensor-core", True),
    "fi-cc": ("FlashInfer CUDA-core", True),
    "flex": ("Flex paged", True),
    "gather-sdpa": ("gather + SDPA", True),
    "sdpa-contig": ("SDPA contiguous", False),
}
COMPILEATTN_IMPLS = ("ca-triton", "ca-flash")
FI_TC = "fi-tc"

DEFAULTS = {"contexts": [1024, 4096], "batches": [1, 4, 16, 64, 256], "pages": [16, 128]}
QUICK = {"contexts": [1024], "batches": [1, 64], "pages": [16]}
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
    p.add_argument("--impls", type=common.argparse_type(lambda s: common.parse_name_list(s, list(IMPLS))),
                   default=list(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--quick", action="store_true",
                   help="context 1024, batch 1 and 64, page 16, 5 replays (a smoke run)")
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


def kv_bytes(batch: int, context: int, element_size: int = 2) -> int:
    """K and V bytes an exact decode must read: every token of every sequence, once."""
    return 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * element_size


def make_case(context: int, batch: int, *, rotations: int, device: Any, dtype: Any, seed: int,
              num_heads: int = NUM_HEADS, num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM) -> Case:
    import torch

    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + context * 1009 + batch)
    q = torch.randn(batch, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(batch, context, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(batch, context, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    scale = 1.0 / math.sqrt(head_dim)
    return Case(context, batch, q, k, v, scale, oracle(q, k, v, scale), rotations)


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


def attention_only(backend, md, pc: PagedCase, q, out) -> tuple[Callable[[int], Any], str]:
    """``fn(r)``: the backend's prepared attention call for this step on cache copy ``r`` (what the
    eager op runs per layer; the step's KV write is not in it), and a note saying which path it is."""
    shape, tensors = md.shape, md.tensors
    calls = [backend.prepare_attend(shape, tensors, pc.spec, q.dtype, pc.kcs[r], pc.vcs[r], md.selector.buffers)
             for r in range(len(pc.kcs))]

    def fn(r):
        calls[r](q, out)

    return fn, f"{getattr(backend, 'label', backend.name)} prepared call ({calls[0].__qualname__})"


def build_compileattn(name: str, case: Case, pc: PagedCase) -> Kernel:
    import torch

    from compileattn.backends.selector import get_backend
    from compileattn.metadata import AttentionMetadataBuilder, SequenceStep

    try:
        backend = get_backend(name, case.q.device)
    except Exception as exc:  # noqa: BLE001  (ImportError, or a half-installed package failing later)
        raise Unavailable(f"backend {name!r} not usable here: {common.short_error(exc)}") from None
    reason = backend.unsupported_reason(pc.spec, case.q.dtype, case.q.device, pc.page)
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
    fn, note = attention_only(backend, md, pc, case.q, out)
    return Kernel(fn, lambda: out, note)


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


def base_row(impl: str, context: int, batch: int, page: int | None, run: int = 0) -> dict[str, Any]:
    return {"run": run, "impl": impl, "label": IMPLS[impl][0], "context": context, "batch": batch, "page": page,
            "kv_bytes": kv_bytes(batch, context), "status": None, "reason": "", "us": None, "tbps": None,
            "x_floor": None}


def measure(impl: str, case: Case, pc: PagedCase | None, *, args, budget: common.Budget, copy_gbps: float,
            log: common.Log) -> dict[str, Any]:
    page = pc.page if pc is not None else None
    row = base_row(impl, case.context, case.batch, page)
    row["rotations"] = case.rotations
    if budget.exceeded():
        row.update(status="skipped", reason=budget.reason())
        return row
    start = time.monotonic()
    kernel = None
    try:
        kernel = builder_for(impl, case, pc)()
        row["note"] = kernel.note
        kernel.fn(0)
        common.synchronize()
        err = common.rel_error(kernel.output().reshape(case.expected.shape), case.expected)
        row["rel_err"] = err
        if not err <= TOLERANCE:
            row.update(status="FAILED", reason=f"output differs from the fp32 oracle: rel. error {err:.3g} "
                                               f"> {TOLERANCE}")
            return row
        post: dict[str, float] = {}

        def after():  # the output of the timed (captured) calls, checked while the graph is alive
            post["err"] = common.rel_error(kernel.output().reshape(case.expected.shape), case.expected)

        t = common.gpu_time_us(kernel.fn, rotations=case.rotations, target_ms=args.target_ms, reps=args.reps,
                               after=after)
        row.update(method=t.method, iters=t.iters, spread=t.spread, min_us=t.min_us)
        if t.note:
            row["note"] = (row.get("note", "") + "; " + t.note).strip("; ")
        if post.get("err", 0.0) > TOLERANCE:
            row.update(status="FAILED", us_invalid=t.us, reason=f"output after the timed replays differs from "
                                                                f"the oracle: rel. error {post['err']:.3g}")
            return row
        floor_us = case.kv_bytes / (copy_gbps * 1e9) * 1e6
        row.update(status="ok", us=t.us, tbps=case.kv_bytes / (t.us * 1e-6) / 1e12, floor_us=floor_us,
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
               "config": {"contexts": args.contexts, "batches": args.batches, "pages": args.pages,
                          "impls": args.impls, "target_ms": args.target_ms, "reps": args.reps,
                          "tolerance": TOLERANCE},
               "runs": [run], "rows": rows}

    def cell_rows(ctx, batch, status, reason, pages=None):
        return [{**base_row(impl, ctx, batch, page), "status": status, "reason": reason}
                for impl in args.impls for page in ((pages or args.pages) if IMPLS[impl][1] else [None])]

    for ctx in args.contexts:
        for batch in args.batches:
            if budget.exceeded():
                rows += cell_rows(ctx, batch, "skipped", budget.reason())
                continue
            done = len(rows)
            try:
                run_cell(ctx, batch, args, rows, paged_impls, budget, bw["GBps"], l2, device, dtype, log)
            except Exception as exc:  # noqa: BLE001  (e.g. out of memory building a cell's inputs)
                log(f"  cell failed: {common.short_error(exc)}\n" + traceback.format_exc(limit=6).rstrip())
                measured = {(r["impl"], r["page"]) for r in rows[done:]}
                rows += [r for r in cell_rows(ctx, batch, "error", f"cell setup failed: {common.short_error(exc)}")
                         if (r["impl"], r["page"]) not in measured]
            torch.cuda.empty_cache()
            run["elapsed_s"] = round(log.elapsed(), 1)
            if checkpoint is not None:
                checkpoint(payload)
    run["elapsed_s"] = round(log.elapsed(), 1)
    return payload


def run_cell(ctx: int, batch: int, args, rows: list, paged_impls: Sequence[str], budget: common.Budget,
             copy_gbps: float, l2: int, device, dtype, log: common.Log) -> None:
    import torch

    nbytes = kv_bytes(batch, ctx, 2)
    rot = 1 if args.warm_l2 else common.rotations_for(nbytes, l2)
    log(f"context {ctx}, batch {batch}: KV {nbytes / common.MiB:.1f} MiB, {rot} cache cop{'y' if rot == 1 else 'ies'}")
    case = make_case(ctx, batch, rotations=rot, device=device, dtype=dtype, seed=args.seed)
    if "sdpa-contig" in args.impls:
        row = measure("sdpa-contig", case, None, args=args, budget=budget, copy_gbps=copy_gbps, log=log)
        rows.append(row)
        log(f"  {'sdpa-contig':12s}          {describe(row)}")
    for page in args.pages:
        pc = make_paged(case, page, seed=args.seed)
        ref_err = check_oracle_against_reference(case, pc)
        if not ref_err <= 1e-2:
            for impl in paged_impls:
                rows.append({**base_row(impl, ctx, batch, page), "status": "error",
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
            if fi:
                entry["ratio"] = best["us"] / fi["us"]
                entry["time_ok"] = entry["ratio"] <= 1.0
            if cell[1] >= GOAL_BATCH:
                entry["bw_ok"] = best["tbps"] >= GOAL_TBPS
        out.append(entry)
    return out


def goal_summary(goals: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    timed = [g for g in goals if g["time_ok"] is not None]
    if timed:
        passed = sum(g["time_ok"] for g in timed)
        worst = max(timed, key=lambda g: g["ratio"])
        lines.append(f"- Time goal (page-16 compileattn ≤ FlashInfer tensor-core GPU time in every cell): "
                     f"{'MET' if passed == len(timed) else 'NOT MET'} — {passed}/{len(timed)} cells; worst "
                     f"{worst['ratio']:.2f}× at context {worst['context']}, batch {worst['batch']} "
                     f"({worst['us']:.1f} vs {worst['fi_tc_us']:.1f} µs).")
    else:
        lines.append("- Time goal: not checked (no FlashInfer tensor-core or no compileattn result at page 16).")
    bw = [g for g in goals if g["bw_ok"] is not None]
    if bw:
        passed = sum(g["bw_ok"] for g in bw)
        worst = min(bw, key=lambda g: g["tbps"])
        lines.append(f"- Bandwidth goal (≥ {GOAL_TBPS} TB/s at batch ≥ {GOAL_BATCH}, page {GOAL_PAGE}): "
                     f"{'MET' if passed == len(bw) else 'NOT MET'} — {passed}/{len(bw)} cells; lowest "
                     f"{worst['tbps']:.2f} TB/s at context {worst['context']}, batch {worst['batch']}.")
    else:
        lines.append(f"- Bandwidth goal: not checked (no page-{GOAL_PAGE} compileattn result at batch ≥ {GOAL_BATCH}).")
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


def render_markdown(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    chosen = select(rows)
    impls = [i for i in IMPLS if any(k[3] == i for k in chosen)]
    cells = sorted({k[:3] for k in chosen}, key=lambda c: (c[0], c[2] if c[2] is not None else 0, c[1]))
    runs = payload["runs"]
    shape = payload.get("shape", {})
    out = [f"# Decode attention: GQA {shape.get('num_heads', NUM_HEADS)}/{shape.get('num_kv_heads', NUM_KV_HEADS)}, "
           f"head dim {shape.get('head_dim', HEAD_DIM)}, {shape.get('dtype', DTYPE_NAME)}, one query token per sequence",
           ""]
    for i, run in enumerate(runs):
        bw = run.get("copy_bandwidth", {}).get("GBps")
        out.append(f"Run {i} — {run.get('label', '?')}" + (f" (from {run['source']})" if run.get("source") else "")
                   + f": copy bandwidth {common.fmt_num(bw, 0)} GB/s (read + write), "
                   + ("L2-warm" if run.get("warm_l2") else "L2-cold (cache copies rotated)"))
        out.append(common.environment_markdown(run.get("env", {})))
        out.append("")
    out.append("Each cell: GPU µs per call · TB/s of K+V read · × the memory floor (K+V bytes ÷ copy bandwidth of "
               "the same run). GPU time from CUDA-graph replays of many calls ((ev): CUDA events around eager calls, "
               "capture failed). `n/a`: not runnable here, reason below. **FAILED**: output disagreed with the fp32 "
               "oracle, not timed. Last column: the faster compileattn backend ÷ FlashInfer tensor-core "
               "(* = the two times come from different runs).")
    out.append("")
    headers = ["context", "batch", "page", "KV MiB"] + [IMPLS[i][0] for i in impls] + ["best ca ÷ FI-TC"]
    table = []
    for cell in cells:
        ctx, batch, page = cell
        ca = [chosen.get((*cell, i)) for i in COMPILEATTN_IMPLS]
        ca = [r for r in ca if r and r["status"] == "ok" and r.get("ratio_fi_tc") is not None]
        best = min(ca, key=lambda r: r["us"]) if ca else None
        ratio = "—" if best is None else f"{best['ratio_fi_tc']:.2f}" + ("" if best.get("ratio_same_run") else "*")
        table.append([ctx, batch, page if page is not None else "—", f"{kv_bytes(batch, ctx) / common.MiB:.0f}"]
                     + [cell_text(chosen.get((*cell, i))) for i in impls] + [ratio])
    out.append(common.markdown_table(headers, table))
    out.append("")
    out.append("## Goal check (issue 5)")
    out.append("")
    goals = goal_check(chosen)
    out.extend(goal_summary(goals))
    if goals:
        out.append("")
        out.append(common.markdown_table(
            ["context", "batch", "best compileattn", "µs", "FI-TC µs", "ratio", "TB/s", "time goal", "TB/s goal"],
            [[g["context"], g["batch"], IMPLS[g["best"]][0] if g["best"] else "—", common.fmt_num(g["us"]),
              common.fmt_num(g["fi_tc_us"]), common.fmt_num(g["ratio"], 2), common.fmt_num(g["tbps"], 2),
              {True: "met", False: "**missed**", None: "—"}[g["time_ok"]],
              {True: "met", False: "**missed**", None: "—"}[g["bw_ok"]]] for g in goals]))
    first_page = min((k[2] for k in chosen if k[2] is not None), default=None)
    shown = [r for k, r in chosen.items() if not r.get("page_independent") or k[2] == first_page]
    notes: dict[tuple, list] = {}
    notes_ok: dict[tuple, int] = {}
    for r in shown:  # reasons of what the table shows (a row replaced by another run's ok row is not news)
        if r["status"] in ("unavailable", "error", "FAILED") and r.get("reason"):
            notes.setdefault((r["impl"], r["status"], r["reason"]), []).append(r)
        if r["status"] == "ok" and r.get("note"):
            notes_ok.setdefault((r["impl"], r["note"]), 0)
    if notes or notes_ok:
        out += ["", "## Notes", ""]
        for (impl, status, reason), rs in sorted(notes.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            where = ", ".join(sorted({f"run {r['run']}" for r in rs}))
            out.append(f"- {IMPLS[impl][0]} — {status} in {len(rs)} cell(s) ({where}): {reason}")
        for impl, note in sorted(notes_ok):
            out.append(f"- {IMPLS[impl][0]}: {note}")
    return "\n".join(out) + "\n"


def plot(payload: dict[str, Any]):
    chosen = select(payload["rows"])
    contexts = sorted({k[0] for k in chosen})
    runs = payload["runs"]
    bw = runs[0].get("copy_bandwidth", {}).get("GBps") if runs else None

    def draw(plt):
        fig, axes = plt.subplots(1, len(contexts), figsize=(6.5 * len(contexts), 4.5), squeeze=False)
        for ax, ctx in zip(axes[0], contexts):
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
            ax.set_ylabel("TB/s of K+V read")
            ax.set_title(f"context {ctx}")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.suptitle("Paged decode, GQA 64/8, head dim 128, bf16")
        return fig

    return draw


def write_outputs(payload: dict[str, Any], prefix: str, no_plot: bool, log: Callable[[str], None]) -> str:
    return common.write_outputs(payload, prefix, no_plot, log, render_markdown(payload), plot(payload),
                                "decode attention")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log = common.Log()
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
