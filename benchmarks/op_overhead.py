#!/usr/bin/env python
"""CPU cost per attention call on CUDA: what the per-layer attention call costs the host, beside an
empty kernel launch and FlashAttention-4's own Python entry (issue 10; issue 4's <= 15 µs goal).

In piecewise CUDA-graph mode the attention op runs eagerly once per layer per step, so its host
time, not its GPU time, is what it adds to a decode step. Each variant is called ``--calls`` times
in a Python loop while the GPU is kept busy by a preceding ``torch.cuda._sleep`` (so the loop never
waits on the device and the launch queue never drains); host µs/call = loop wall time / calls
(median of ``--reps``). GPU µs/call is measured separately: the same calls queued behind a sleep,
timed with CUDA events from the first to the last, so they run back to back.

Variants (decode, GQA 64/8, head dim 128, bf16, page 16, context 1024, batches 1/16/64, one layer):
  empty launch            torch.add on a 1-element tensor; an empty Triton kernel (triton_empty.py)
  FA4 public              flash_attn.cute.flash_attn_varlen_func (argument processing + key + launch)
  FA4 entry (out=)        interface._flash_attn_fwd with a caller-owned out (below the autograd Function)
  FA4 prepared call       what FA4Backend.prepare_attend returns: the cached kernel, arguments bound
  op <backend>: attend_caller
                          the compiled runtime's per-layer call, ops.attend_caller(layer, 0, 1)(q, out),
                          under set_forward_context: context lookup + prepared call (flash, triton)
  op <backend>: torch.ops.compileattn.attention
                          the eager op through the dispatcher: checks, prepared write, prepared attend
  KV write                the prepared writers alone: Triton's kernel; the torch padded writer
  op, shape logic inside  what preparing per step shape saves: views, contiguity, argument checks,
                          the generic write, output allocation and FA4's public entry, all per call

Every variant's output is checked before it is timed: attention against the plain-PyTorch
reference backend (norm-relative, bf16 tolerance), KV writes against the rows they must write, and
the FA4 prepared call bitwise against FA4's own entry (a benchmark of a wrong call is void: a
variant that fails its check is reported FAILED and not timed). For each variant the Python frames
entered during one call are counted (``sys.setprofile``), the benchmark's own lambda excluded: for
``attend_caller`` that is the path from ``call_attend`` to the kernel launch.

Before/after: ``before_after.sh`` runs the pre-redesign tree's own ``op_overhead.py`` (exported
with ``make_before.sh``) and this one in the same GPU session; ``--merge BEFORE AFTER`` puts them in
one table with after ÷ before per compared row (``op_overhead_report.py``, which also reads the
pre-redesign JSON layout and, if that run was cut short, its stdout).

Run (on the GPU machine, FA4 on PYTHONPATH): ``python benchmarks/op_overhead.py --out PREFIX``.
Writes PREFIX.json/.md (.png with matplotlib). On a machine without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402
import op_overhead_report as report  # noqa: E402
from op_overhead_report import (EMPTY_ADD, EMPTY_TRITON, FA4_ENTRY, FA4_PREPARED, FA4_PUBLIC, KV_TORCH,  # noqa: E402
                                KV_TRITON, UNHOISTED, op_caller, op_dispatcher)

LAYER = "layer0"
#: Where the variants run. Only "cuda" is a benchmark; "cpu" (with a dtype Triton's interpreter
#: computes right, see the README) exists so the plumbing can be smoke-run without a GPU by a test.
DEVICE = "cuda"
DTYPE = "bfloat16"
#: Norm-relative error allowed against the fp32 reference (bf16 output rounding is ~0.4 %).
TOLERANCE = 2e-2
DEFAULT_OUT = common.RESULTS_DIR / "op_overhead"
#: Backends whose op variants can be measured (``reference`` is for the CPU plumbing test).
OP_BACKENDS = ("flash", "triton", "reference")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ints = common.argparse_type(common.parse_int_list)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=ints, default=[1, 16, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backends", type=common.argparse_type(lambda s: common.parse_name_list(s, OP_BACKENDS)),
                   default=["flash", "triton"], help="backends whose per-layer op is measured (default flash,triton)")
    p.add_argument("--calls", type=int, default=64,
                   help="calls per timed loop; calls x launches per call must fit CUDA's launch queue (~1000)")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="wall-clock budget; variants past it are reported as skipped (0 = none)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output prefix: writes PREFIX.json/.md/.png")
    p.add_argument("--label", default=None, help="name of this run in merged tables")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--merge", nargs="+", metavar="RESULT", default=None,
                   help="merge result files (this script's or the pre-redesign one's JSON, or the latter's "
                        "stdout) into one report, after ÷ before = last ÷ first (no GPU needed)")
    p.add_argument("-o", "--output", default=None, help="output prefix for --merge (default: --out)")
    p.add_argument("--labels", nargs="+", default=None, help="with --merge: a label for each merged run, in order")
    p.add_argument("--quick", action="store_true", help="batch 1 and 64, 5 repetitions (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.reps = [1, 64], 5
    if args.calls < 1 or args.reps < 1 or args.context < 1:
        p.error("--calls, --reps and --context must be >= 1")
    return args


# -- timing ----------------------------------------------------------------------------------

class Timer:
    """Host and device µs per call of a zero-argument callable (see module docstring)."""

    def __init__(self, calls: int, reps: int):
        import torch

        self.calls, self.reps = calls, reps
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        torch.cuda._sleep(20_000_000)
        e.record()
        torch.cuda.synchronize()
        self.cycles_per_us = 20_000_000 / (s.elapsed_time(e) * 1e3)

    def _sleep_for(self, us: float) -> None:
        import torch

        torch.cuda._sleep(int(self.cycles_per_us * us))

    def __call__(self, fn: Callable[[], Any]) -> dict[str, Any]:
        import torch

        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(self.calls):
            fn()
        rough_us = (time.perf_counter_ns() - t0) / 1e3
        torch.cuda.synchronize()
        sleep_us = 3 * rough_us + 2000
        host, dev, late = [], [], 0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(self.reps):
            self._sleep_for(sleep_us)
            t0 = time.perf_counter_ns()
            for _ in range(self.calls):
                fn()
            loop_us = (time.perf_counter_ns() - t0) / 1e3
            torch.cuda.synchronize()
            late += loop_us > sleep_us  # the loop outlived the sleep: the GPU may have idled
            host.append(loop_us / self.calls)
            self._sleep_for(sleep_us)
            start.record()
            for _ in range(self.calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            dev.append(start.elapsed_time(end) * 1e3 / self.calls)
        return {"cpu_us": statistics.median(host), "cpu_us_min": min(host), "gpu_us": statistics.median(dev),
                "loops_longer_than_sleep": late}


def python_frames(fn: Callable[[], Any]) -> list[str]:
    """``module/file.py:qualname`` of every Python frame entered during one ``fn()``, in order,
    except frames of this file (the variant's own lambda)."""
    here = str(Path(__file__).resolve())
    seen: list[str] = []

    def profile(frame, event, _arg):
        if event == "call":
            code = frame.f_code
            if str(Path(code.co_filename).resolve()) != here:
                path = Path(code.co_filename)
                seen.append(f"{path.parent.name}/{path.name}:{getattr(code, 'co_qualname', code.co_name)}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


# -- setup -----------------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class Setup:
    """One batch size: a layer's cache, q/k/v/out, and per backend a metadata builder and step."""

    def __init__(self, args, batch: int):
        import torch

        from compileattn.kv_cache import AttentionSpec, allocate_kv_caches
        from compileattn.metadata import SequenceStep

        self.args, self.batch = args, batch
        self.spec = AttentionSpec(args.heads, args.kv_heads, args.head_dim)
        bs = args.block_size
        per_seq = math.ceil((args.context + 1) / bs)
        self.num_blocks = batch * per_seq + 1
        dtype = getattr(torch, DTYPE)
        self.layers = allocate_kv_caches({LAYER: self.spec}, self.num_blocks, bs, dtype, DEVICE)
        self.cache = self.layers[LAYER]
        self.cache.key_cache.normal_()
        self.cache.value_cache.normal_()
        g = torch.Generator(device=DEVICE).manual_seed(batch)
        h, kvh, d = args.heads, args.kv_heads, args.head_dim
        self.q = torch.randn(batch, h, d, device=DEVICE, dtype=dtype, generator=g)
        self.k = torch.randn(batch, kvh, d, device=DEVICE, dtype=dtype, generator=g)
        self.v = torch.randn(batch, kvh, d, device=DEVICE, dtype=dtype, generator=g)
        self.out = torch.empty_like(self.q)
        perm = torch.randperm(self.num_blocks - 1, generator=torch.Generator().manual_seed(batch)).tolist()
        self.seqs = [SequenceStep(1, args.context, perm[i * per_seq:(i + 1) * per_seq]) for i in range(batch)]
        self.per_seq = per_seq

    def step(self, backend: str):
        """(metadata, builder) of this batch's decode step for ``backend``."""
        from compileattn.metadata import AttentionMetadataBuilder

        builder = AttentionMetadataBuilder(block_size=self.args.block_size, num_blocks=self.num_blocks,
                                           max_num_tokens=max(self.batch, 8), max_blocks_per_seq=self.per_seq,
                                           device=DEVICE, backend=backend)
        return builder.build(self.seqs), builder


class Variant(NamedTuple):
    name: str
    fn: Callable[[], Any]
    #: The step's metadata to run it under ``set_forward_context`` with (None: no context).
    metadata: Any
    #: Runs the variant once and returns None if it computed the right thing, else why not.
    check: Callable[[], str | None] | None


def _attention_check(run: Callable[[], Any], expected) -> Callable[[], str | None]:
    """``run()`` returns the variant's output (or writes it where the closure reads it)."""

    def check():
        got = run()
        err = common.rel_error(got.reshape(expected.shape), expected)
        return None if err <= TOLERANCE else f"output differs from the reference: rel. error {err:.3g} > {TOLERANCE}"

    return check


def _into(fn: Callable[[], Any], out) -> Callable[[], Any]:
    def run():
        out.zero_()
        fn()
        return out

    return run


def _returned(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run():
        res = fn()
        return res[0] if isinstance(res, tuple) else res

    return run


def _kv_check(fn: Callable[[], Any], st: Setup, slots) -> Callable[[], str | None]:
    """With the step's slots cleared first, the write must leave exactly the step's K/V there."""
    from compileattn.backends.kv_write import write_kv_padded

    flat_k = st.cache.key_cache.view(-1, *st.cache.key_cache.shape[2:])
    flat_v = st.cache.value_cache.view(-1, *st.cache.value_cache.shape[2:])

    def check():
        flat_k.index_fill_(0, slots, 0)
        flat_v.index_fill_(0, slots, 0)
        fn()
        ok = flat_k[slots].equal(st.k) and flat_v[slots].equal(st.v)
        # whatever the writer did, the other variants read the step's K/V
        write_kv_padded(st.k, st.v, st.cache.key_cache, st.cache.value_cache, slots)
        return None if ok else "the cache rows at the step's slots do not hold the step's K/V after the write"

    return check


def build_variants(args, st: Setup, notes: dict[str, str]) -> tuple[list[Variant], dict[str, str]]:
    """The variants of one batch (in table order) and {variant: why it is not measured}."""
    import torch

    from compileattn import ops
    from compileattn.backends.flash_fa4 import FA4Backend
    from compileattn.backends.kv_write import StepWriteIndices, prepare_torch_write, write_kv_padded
    from compileattn.backends.selector import get_backend
    from compileattn.context import get_forward_context
    from compileattn.validation import check_kv_write_args, check_varlen_args

    variants: list[Variant] = []
    skipped: dict[str, str] = {}
    q, k, v, out, spec = st.q, st.k, st.v, st.out, st.spec
    kc, vc = st.cache.key_cache, st.cache.value_cache
    flash_md, flash_builder = st.step("flash")
    steps = {name: flash_md if name == "flash" else st.step(name)[0] for name in args.backends}
    slots = flash_md.slot_mapping  # every builder lays the same sequences out alike

    dtype = q.dtype
    x1, y1 = torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    variants.append(Variant(EMPTY_ADD, lambda: torch.add(x1, 1, out=y1), None, None))
    try:
        from triton_empty import empty_kernel

        variants.append(Variant(EMPTY_TRITON, lambda: empty_kernel[(1,)](x1, 1), None, None))
    except Exception as exc:  # noqa: BLE001  (no usable triton: a reason, not a crash)
        skipped[EMPTY_TRITON] = f"triton unusable: {common.short_error(exc)}"

    # The step's K/V go into the cache once (the write is idempotent), then the reference output.
    write_kv_padded(k, v, kc, vc, slots)
    expected = torch.empty_like(q)
    get_backend("reference", DEVICE).varlen_attention(
        q, kc, vc, expected, flash_md.query_start_loc, None, flash_md.seq_lens, flash_md.block_table, 1,
        args.context + 1, spec.scale, True, -1, 0.0)

    fa4 = None
    try:
        backend = get_backend("flash", DEVICE)
        if isinstance(backend, FA4Backend):
            fa4 = backend
        else:
            why = f"'flash' is {getattr(backend, 'label', backend.name)} here, not FlashAttention-4"
    except ImportError as exc:
        why = str(exc)
    fa4_rows = [FA4_PUBLIC, FA4_ENTRY, FA4_PREPARED, op_caller("flash"), op_dispatcher("flash"), UNHOISTED]
    if fa4 is None:
        skipped.update({name: why for name in fa4_rows})
    else:
        chosen = flash_md.selector.backend_for(spec, dtype, args.block_size, uniform_decode=True)
        if chosen is not fa4:  # the selector refused FA4 for this layer and fell back
            skipped.update({name: f"the selector runs this layer on {chosen.name}, not FlashAttention-4"
                            for name in (op_caller("flash"), op_dispatcher("flash"))})
        cu_q, used_k, table = flash_md.query_start_loc, flash_md.seq_lens, flash_md.block_table

        def public():
            return fa4.fa.flash_attn_varlen_func(
                q, kc, vc, cu_seqlens_q=cu_q, max_seqlen_q=1, max_seqlen_k=args.context + 1, seqused_k=used_k,
                page_table=table, softmax_scale=spec.scale, causal=True)

        variants.append(Variant(FA4_PUBLIC, public, None, _attention_check(_returned(public), expected)))
        if fa4.fwd is not None:
            def entry():
                fa4.fwd(q, kc, vc, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=used_k, page_table=table,
                        softmax_scale=spec.scale, causal=True, num_splits=1, out=out)

            variants.append(Variant(FA4_ENTRY, entry, None, _attention_check(_into(entry, out), expected)))
        else:
            skipped[FA4_ENTRY] = f"this flash-attn-4 has no _flash_attn_fwd with {fa4.fwd_missing}"
        attend = fa4.prepare_attend(flash_md.shape, flash_md.tensors, spec, dtype, kc, vc, flash_builder.buffers)
        if fa4._templates.get(fa4.kernel_key(spec, dtype, flash_md.shape, kc.device)) is None:
            notes[FA4_PREPARED] = "FA4's direct call is unavailable for this shape (see the logged warning): " \
                                  "the prepared call is FA4's entry"

        def prepared_equals_entry():
            want, got = torch.empty_like(q), torch.empty_like(q)
            fa4.fwd_public(q, kc, vc, want, cu_q, used_k, table, 1, spec.scale, True, -1, 0.0)
            attend(q, got)
            common.synchronize()
            if not torch.equal(got, want):
                return "the prepared call's output differs from FA4's entry (bitwise): refusing to time a wrong call"
            return _attention_check(lambda: got, expected)()

        variants.append(Variant(FA4_PREPARED, lambda: attend(q, out), None, prepared_equals_entry))

    caller = ops.attend_caller(LAYER, 0, 1)
    dispatcher = torch.ops.compileattn.attention.default
    for name, md in steps.items():
        if op_caller(name) in skipped:
            continue
        variants.append(Variant(op_caller(name), lambda: caller(q, out), md,
                                _attention_check(_into(lambda: caller(q, out), out), expected)))

        def dispatched():
            dispatcher(q, k, v, out, LAYER)

        variants.append(Variant(op_dispatcher(name), dispatched, md,
                                _attention_check(_into(dispatched, out), expected)))

    try:
        write_triton = get_backend("triton", DEVICE).prepare_write(flash_md.shape, flash_md.tensors, spec, kc, vc)
    except Exception as exc:  # noqa: BLE001
        skipped[KV_TRITON] = f"triton backend unusable: {common.short_error(exc)}"
    else:
        variants.append(Variant(KV_TRITON, lambda: write_triton(k, v), None,
                                _kv_check(lambda: write_triton(k, v), st, slots)))
    indices = StepWriteIndices(flash_md.num_tokens, flash_md.tensors, flash_md.selector.buffers)
    indices.refresh()  # once per step (set_forward_context does it); the write is per layer
    write_torch = prepare_torch_write(kc, vc, indices, flash_md.slot_mapping)
    variants.append(Variant(KV_TORCH, lambda: write_torch(k, v), None, _kv_check(lambda: write_torch(k, v), st, slots)))

    if fa4 is not None:
        def unhoisted():
            ctx = get_forward_context()
            m, c = ctx.metadata, ctx.kv_caches[LAYER]
            sp = c.spec
            n = q.shape[0]
            q2d, k2d, v2d = q.view(n, -1), k.view(n, -1), v.view(n, -1)
            qq = q2d.view(n, sp.num_heads, sp.head_dim).contiguous()
            kk = k2d.view(n, sp.num_kv_heads, sp.head_dim).contiguous()
            vv = v2d.view(n, sp.num_kv_heads, sp.head_dim).contiguous()
            check_kv_write_args(kk, vv, c.key_cache, c.value_cache, m.slot_mapping, check_values=False)
            write_kv_padded(kk, vv, c.key_cache, c.value_cache, m.slot_mapping)
            o = torch.empty_like(qq)
            check_varlen_args(qq, c.key_cache, c.value_cache, o, m.query_start_loc, None, m.seq_lens,
                              m.block_table, m.max_query_len, m.max_seq_len, sp.sliding_window, sp.softcap,
                              check_values=False)
            res = fa4.fa.flash_attn_varlen_func(
                qq, c.key_cache, c.value_cache, cu_seqlens_q=m.query_start_loc, max_seqlen_q=m.max_query_len,
                max_seqlen_k=m.max_seq_len, seqused_k=m.seq_lens, page_table=m.block_table,
                softmax_scale=sp.scale, causal=sp.causal,
                window_size=(None if sp.sliding_window < 0 else sp.sliding_window, None), softcap=sp.softcap)
            return res[0].view(n, -1)

        variants.append(Variant(UNHOISTED, unhoisted, flash_md, _attention_check(unhoisted, expected)))
    return variants, skipped




def measure(v: Variant, st: Setup, timer: Timer, budget: common.Budget) -> tuple[dict[str, Any], list[str]]:
    """One variant of one batch: check, count frames, time. (row, frame chain)."""
    from compileattn.context import set_forward_context

    row = {"run": 0, "variant": v.name, "batch": st.batch, "status": None, "reason": ""}
    if budget.exceeded():
        row.update(status="skipped", reason=budget.reason())
        return row, []
    chain: list[str] = []
    ctx = set_forward_context(v.metadata, st.layers) if v.metadata is not None else contextlib.nullcontext()
    try:
        with ctx:
            why = v.check() if v.check is not None else None
            common.synchronize()
            if why is not None:
                row.update(status="FAILED", reason=why)
                return row, []
            v.fn()  # warm: a first call may compile or fill caches; frames are those of a steady call
            common.synchronize()
            chain = python_frames(v.fn)
            row["py_frames"] = len(chain)
            row.update(status="ok", **timer(v.fn))
    except Exception as exc:  # noqa: BLE001  (one broken variant must not cost the table)
        row.update(status="error", reason=common.short_error(exc))
        with contextlib.suppress(Exception):
            common.synchronize()
    return row, chain


def run_benchmark(args, log: common.Log, checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    import torch

    budget = common.Budget(args.budget_s)
    versions = {name: common.package_version([name]) for name in
                ("nvidia-cutlass-dsl", "apache-tvm-ffi", "quack-kernels")}
    env = common.environment(cpu=_cpu_name(), fa4_stack=versions)
    log(f"GPU {env['gpu']}; versions {env['versions']} {versions}")
    run = {"label": args.label or "this tree", "env": env, "skipped": {}, "notes": {}, "frames": {},
           "frames_batch": args.batches[0]}
    rows: list[dict[str, Any]] = []
    payload = {"benchmark": "op_overhead",
               "config": {"shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                                    "dtype": DTYPE, "block_size": args.block_size, "context": args.context,
                                    "batches": list(args.batches)},
                          "method": {"calls_per_loop": args.calls, "reps": args.reps,
                                     "cpu": "median over reps of (Python loop wall time / calls), GPU kept busy by "
                                            "torch.cuda._sleep",
                                     "gpu": "median over reps of CUDA-event time of calls queued behind a sleep / "
                                            "calls",
                                     "check_tolerance": TOLERANCE}},
               "runs": [run], "rows": rows}
    timer = Timer(args.calls, args.reps)
    for batch in args.batches:
        st = Setup(args, batch)
        try:
            variants, skipped = build_variants(args, st, run["notes"])
        except Exception as exc:  # noqa: BLE001
            run["skipped"][f"batch {batch}"] = f"setup failed: {common.short_error(exc)}"
            log(f"batch {batch}: setup failed: {common.short_error(exc)}")
            continue
        run["skipped"].update(skipped)
        for v in variants:
            row, chain = measure(v, st, timer, budget)
            rows.append(row)
            # the chain of each per-layer call (counts are in every row)
            if batch == args.batches[0] and (v.name == FA4_PREPARED or v.name in map(op_caller, args.backends)):
                run["frames"][v.name] = chain
            if row["status"] == "ok":
                print(f"batch {batch:3d}  {v.name:60s} cpu {row['cpu_us']:7.2f} µs  gpu {row['gpu_us']:8.2f} µs"
                      f"  ({row['py_frames']} Python frames)", flush=True)
            else:
                log(f"batch {batch:3d}  {v.name}: {row['status']}: {row['reason']}")
        del st, variants
        torch.cuda.empty_cache()
        run["elapsed_s"] = round(log.elapsed(), 1)
        if checkpoint is not None:
            checkpoint(payload)
    run["elapsed_s"] = round(log.elapsed(), 1)
    return payload


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log = common.Log()
    if args.merge:
        merged = report.merge_payloads([report.read_result(p) for p in args.merge], args.labels)
        print(report.write_outputs(merged, args.output or args.out, args.no_plot, log), flush=True)
        return 0
    missing = common.cuda_missing_message("op_overhead.py")
    if missing:
        print(missing, flush=True)
        return 0
    common.ensure_repo_on_path()
    payload = run_benchmark(args, log, checkpoint=lambda pl: report.write_outputs(pl, args.out, True, lambda _m: None))
    print(report.write_outputs(payload, args.out, args.no_plot, log), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
