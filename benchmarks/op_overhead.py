"""CPU cost per attention call on CUDA: what the per-layer op costs the host, beside an empty
kernel launch and FlashAttention-4's own Python entry (issue 5, item 2; issue 4's <= 15 µs goal).

In piecewise CUDA-graph mode the attention op runs eagerly once per layer per step, so its host
time, not its GPU time, is what it adds to a decode step. Each variant is called ``--calls`` times
in a Python loop while the GPU is kept busy by a preceding ``torch.cuda._sleep`` (so the loop never
waits on the device and the launch queue never drains); host µs/call = loop wall time / calls
(median of ``--reps``). GPU µs/call is measured separately: the same calls queued behind a sleep,
timed with CUDA events from the first to the last, so they run back to back.

Variants (decode, GQA 64/8, head dim 128, bf16, page 16, context 1024, batch 1..64, one layer):
  empty launch           torch.add on a 1-element tensor; an empty Triton kernel
  FA4 public             flash_attn.cute.flash_attn_varlen_func (argument processing + key + launch)
  FA4 entry (out=)       interface._flash_attn_fwd with a caller-owned out (below the autograd Function)
  FA4 direct             the compiled kernel FA4 cached, called with the learned argument list
  KV write               the flash backend's writers alone (triton kernel; torch index_copy_)
  op ...                 compileattn.ops.attention_impl under set_forward_context (what the
                         piecewise runtime calls), and through the torch.ops dispatcher
  op, shape logic inside what hoisting saves: views, contiguity, argument checks, output
                         allocation and FA4's public entry, all per call

Run (on the GPU machine, FA4 on PYTHONPATH):
  python benchmarks/op_overhead.py
Writes benchmarks/results/op_overhead.{json,md} (and .png with matplotlib). On a machine without
CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--calls", type=int, default=64,
                   help="calls per timed loop; calls x launches per call must fit CUDA's launch queue (~1000)")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--out", default=str(RESULTS / "op_overhead"))
    return p.parse_args()


# -- timing ----------------------------------------------------------------------------------

class Timer:
    """Host and device µs per call of a zero-argument callable (see module docstring)."""

    def __init__(self, calls: int, reps: int):
        self.calls, self.reps = calls, reps
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        torch.cuda._sleep(20_000_000)
        e.record()
        torch.cuda.synchronize()
        self.cycles_per_us = 20_000_000 / (s.elapsed_time(e) * 1e3)

    def _sleep_for(self, us: float) -> None:
        torch.cuda._sleep(int(self.cycles_per_us * us))

    def __call__(self, fn) -> dict:
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


# -- setup -----------------------------------------------------------------------------------

def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("triton", "flash-attn-4", "nvidia-cutlass-dsl", "apache-tvm-ffi", "quack-kernels", "flash-attn"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    out["torch_dlpack_c_exchange_api"] = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    return out


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class Setup:
    """One batch size: a layer's cache, a decode step built for a given backend, q/k/v/out."""

    def __init__(self, args, batch: int):
        from compileattn.kv_cache import AttentionSpec, allocate_kv_caches

        self.args, self.batch = args, batch
        self.spec = AttentionSpec(args.heads, args.kv_heads, args.head_dim)
        bs = args.block_size
        self.blocks_per_seq = math.ceil((args.context + 1) / bs)
        self.num_blocks = batch * self.blocks_per_seq + 1
        self.cache = allocate_kv_caches({"layer0": self.spec}, self.num_blocks, bs, torch.bfloat16, "cuda")["layer0"]
        self.cache.key_cache.normal_()
        self.cache.value_cache.normal_()
        g = torch.Generator(device="cuda").manual_seed(batch)
        h, kvh, d = args.heads, args.kv_heads, args.head_dim
        self.q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        self.k = torch.randn(batch, kvh, d, device="cuda", dtype=torch.bfloat16, generator=g)
        self.v = torch.randn(batch, kvh, d, device="cuda", dtype=torch.bfloat16, generator=g)
        self.out = torch.empty_like(self.q)

    def metadata(self, backend):
        from compileattn.metadata import AttentionMetadataBuilder, SequenceStep

        builder = AttentionMetadataBuilder(block_size=self.args.block_size, num_blocks=self.num_blocks,
                                           max_num_tokens=max(self.batch, 8), max_blocks_per_seq=self.blocks_per_seq,
                                           device="cuda", backend=backend)
        perm = torch.randperm(self.num_blocks - 1).tolist()
        seqs = [SequenceStep(1, self.args.context, perm[i * self.blocks_per_seq:(i + 1) * self.blocks_per_seq])
                for i in range(self.batch)]
        return builder.build(seqs)


def _variants(args, st: Setup) -> tuple[dict, dict]:
    """({name: (zero-arg callable, metadata to run it under or None)}, {name: why not measured})."""
    from compileattn import ops
    from compileattn.backends import flash as flash_mod
    from compileattn.backends import flash_fa4
    from compileattn.backends.registry import get_backend
    from compileattn.context import get_forward_context, set_forward_context
    from compileattn.validation import check_kv_write_args, check_varlen_args

    fns, skipped = {}, {}
    x1, y1 = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    fns["empty launch: torch.add (1 element)"] = (lambda: torch.add(x1, 1, out=y1), None)
    try:
        from compileattn.backends.triton._empty import empty_kernel

        fns["empty launch: Triton kernel"] = (lambda: empty_kernel[(1,)](x1, 1), None)
    except Exception as exc:  # noqa: BLE001
        skipped["empty launch: Triton kernel"] = f"triton unusable: {exc}"

    q, k, v, out, cache, spec = st.q, st.k, st.v, st.out, st.cache, st.spec
    kc, vc = cache.key_cache, cache.value_cache
    layers = {"layer0": cache}

    def op_variants(label, backend):
        md = st.metadata(backend)
        with set_forward_context(md, layers):
            ops.attention_impl(q, k, v, out, "layer0")  # warm up; the flash backend learns its kernel
        fns[f"op {label}: attention_impl"] = (lambda: ops.attention_impl(q, k, v, out, "layer0"), md)
        # What the piecewise runtime calls per layer by default: the K/V write is captured in the
        # preceding CUDA-graph piece (passes/kv_write.py), so the eager op is attention only.
        fns[f"op {label}: attend_impl (piecewise, KV write captured)"] = (
            lambda: ops.attend_impl(q, out, "layer0"), md)
        fns[f"op {label}: torch.ops dispatcher"] = (
            lambda: torch.ops.compileattn.attention.default(q, k, v, out, "layer0"), md)
        return md

    try:
        fa = flash_mod._load_impl("fa4")
    except ImportError as exc:
        skipped["FA4 and the flash op"] = str(exc)
        fa = None
    if fa is not None:
        base = flash_mod.FlashBackend("cuda", impl="fa4", call_mode="compiled", kv_writer="torch")
        md = st.metadata(base)
        cu_q, used_k, table = md.query_start_loc, md.seq_lens, md.block_table
        fns["FA4 public flash_attn_varlen_func"] = (lambda: fa.fa.flash_attn_varlen_func(
            q, kc, vc, cu_seqlens_q=cu_q, max_seqlen_q=1, max_seqlen_k=args.context + 1, seqused_k=used_k,
            page_table=table, softmax_scale=spec.scale, causal=True), None)
        if fa.fwd is not None:
            fns["FA4 entry _flash_attn_fwd(out=)"] = (lambda: fa.fwd(
                q, kc, vc, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=used_k, page_table=table,
                softmax_scale=spec.scale, causal=True, num_splits=1, out=out), None)
        base.forward(q, k, v, out, cache, md)  # learns the kernel
        fn, tail = base.prepared_call(md, cache)
        if getattr(fn, "__func__", None) is flash_fa4.FA4Impl.fwd_public:
            skipped["FA4 direct"] = "direct call unavailable for this shape (see the logged warning)"
        else:
            fns["FA4 direct: compiled kernel object"] = (lambda: fn(q, kc, vc, out, *tail), None)
            # The direct call must compute what FA4's entry computes (a benchmark of a wrong call is void).
            want, got = torch.empty_like(out), torch.empty_like(out)
            fa.fwd_public(q, kc, vc, want, cu_q, used_k, table, 1, spec.scale, True, -1, 0.0)
            fn(q, kc, vc, got, *tail)
            torch.cuda.synchronize()
            if not torch.equal(got, want):
                raise SystemExit("FA4 direct call differs from FA4's entry: refusing to benchmark a wrong call")

        for writer in ("triton", "torch"):
            try:
                b = flash_mod.FlashBackend("cuda", impl="fa4", kv_writer=writer)
                b.writer_kind()
            except ImportError as exc:
                skipped[f"KV write: {writer}, op flash (kv={writer})"] = str(exc)
                continue
            wmd = op_variants(f"flash (kv={writer})", b)
            call = wmd.plan_for(b).calls[id(spec)]
            wfn, wtail = call[3], call[4]
            fns[f"KV write: {writer}"] = (lambda wfn=wfn, wtail=wtail: wfn(k, v, kc, vc, *wtail), None)
        op_variants("flash, FA4 entry per call", flash_mod.FlashBackend("cuda", impl="fa4", call_mode="public"))

        def unhoisted(q2d, k2d, v2d, layer):
            ctx = get_forward_context()
            m, c = ctx.metadata, ctx.kv_caches[layer]
            sp = c.spec
            n = q2d.shape[0]
            qq = q2d.view(n, sp.num_heads, sp.head_dim).contiguous()
            kk = k2d.view(n, sp.num_kv_heads, sp.head_dim).contiguous()
            vv = v2d.view(n, sp.num_kv_heads, sp.head_dim).contiguous()
            check_kv_write_args(kk, vv, c.key_cache, c.value_cache, m.slot_mapping, check_values=False)
            flash_mod.write_kv_any(kk, vv, c.key_cache, c.value_cache, m.slot_mapping)
            o = torch.empty_like(qq)
            check_varlen_args(qq, c.key_cache, c.value_cache, o, m.query_start_loc, None, m.seq_lens,
                              m.block_table, m.max_query_len, m.max_seq_len, sp.sliding_window, sp.softcap,
                              check_values=False)
            res = fa.fa.flash_attn_varlen_func(
                qq, c.key_cache, c.value_cache, cu_seqlens_q=m.query_start_loc, max_seqlen_q=m.max_query_len,
                max_seqlen_k=m.max_seq_len, seqused_k=m.seq_lens, page_table=m.block_table,
                softmax_scale=sp.scale, causal=sp.causal,
                window_size=(None if sp.sliding_window < 0 else sp.sliding_window, None), softcap=sp.softcap)
            return res[0].view(n, -1)

        q2d, k2d, v2d = q.view(st.batch, -1), k.view(st.batch, -1), v.view(st.batch, -1)
        fns["op, shape logic inside (views, checks, generic write, alloc, FA4 public)"] = (
            lambda: unhoisted(q2d, k2d, v2d, "layer0"), md)

    try:
        tb = get_backend("triton", "cuda")
    except Exception as exc:  # noqa: BLE001
        skipped["op triton"] = f"triton backend unusable: {exc}"
    else:
        op_variants("triton", tb)
    return fns, skipped


def main() -> int:
    args = _parse()
    if not torch.cuda.is_available():
        print("op_overhead: no CUDA device here; this benchmark measures host cost per CUDA kernel call "
              "and only runs on a GPU machine. Nothing written.")
        return 0
    from compileattn.context import set_forward_context

    batches = [int(b) for b in args.batches.split(",")]
    timer = Timer(args.calls, args.reps)
    rows, skipped_all = [], {}
    for batch in batches:
        st = Setup(args, batch)
        fns, skipped = _variants(args, st)
        skipped_all.update(skipped)
        for name, (fn, md) in fns.items():
            if md is not None:
                with set_forward_context(md, {"layer0": st.cache}):
                    r = timer(fn)
            else:
                r = timer(fn)
            rows.append({"variant": name, "batch": batch, **r})
            print(f"batch {batch:3d}  {name:60s} cpu {r['cpu_us']:7.2f} µs  gpu {r['gpu_us']:8.2f} µs")
        del st, fns
        torch.cuda.empty_cache()

    meta = {
        "gpu": torch.cuda.get_device_name(), "cpu": _cpu_name(), "versions": _versions(),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "bfloat16",
                  "block_size": args.block_size, "context": args.context, "batches": batches},
        "method": {"calls_per_loop": args.calls, "reps": args.reps,
                   "cpu": "median over reps of (Python loop wall time / calls), GPU kept busy by torch.cuda._sleep",
                   "gpu": "median over reps of CUDA-event time of calls queued behind a sleep / calls"},
        "skipped": skipped_all,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    md_text = _markdown(meta, rows, batches)
    out.with_suffix(".md").write_text(md_text)
    print()
    print(md_text)
    _plot(rows, batches, out.with_suffix(".png"))
    return 0


def _markdown(meta, rows, batches) -> str:
    names = list(dict.fromkeys(r["variant"] for r in rows))
    cell = {(r["variant"], r["batch"]): r for r in rows}
    v = meta["versions"]
    lines = [
        "# CPU cost per attention call",
        "",
        f"Decode, GQA {meta['shape']['heads']}/{meta['shape']['kv_heads']}, head dim {meta['shape']['head_dim']}, "
        f"bf16, page {meta['shape']['block_size']}, context {meta['shape']['context']}, one layer.",
        f"GPU {meta['gpu']}; CPU {meta['cpu']}; torch {v['torch']}, triton {v['triton']}, "
        f"flash-attn-4 {v['flash-attn-4']}, cutlass-dsl {v['nvidia-cutlass-dsl']}, tvm-ffi {v['apache-tvm-ffi']}; "
        f"{meta['date']}.",
        f"Command: `{meta['command']}`",
        "",
        "Host µs per call (median; the GPU never makes the loop wait), then GPU µs per call (back to back).",
        "",
        "| variant | " + " | ".join(f"CPU µs b={b}" for b in batches) + " | "
        + " | ".join(f"GPU µs b={b}" for b in batches) + " |",
        "|---|" + "---:|" * (2 * len(batches)),
    ]
    for name in names:
        cpu = [f"{cell[(name, b)]['cpu_us']:.1f}" if (name, b) in cell else "–" for b in batches]
        gpu = [f"{cell[(name, b)]['gpu_us']:.1f}" if (name, b) in cell else "–" for b in batches]
        lines.append(f"| {name} | " + " | ".join(cpu) + " | " + " | ".join(gpu) + " |")
    empty = "empty launch: torch.add (1 element)"
    ops = [n for n in names if n.startswith("op flash") and ("attention_impl" in n or "attend_impl" in n)]
    if ops and all((empty, b) in cell for b in batches):
        lines += ["", "Ratios (host µs): the flash op in piecewise mode against an empty launch and FA4's entry.", ""]
        lines.append("| op | " + " | ".join(f"b={b}: ×empty / ×FA4 public" for b in batches) + " |")
        lines.append("|---|" + "---:|" * len(batches))
        pub = "FA4 public flash_attn_varlen_func"
        for name in ops:
            parts = []
            for b in batches:
                if (name, b) not in cell:
                    parts.append("–")
                    continue
                c = cell[(name, b)]["cpu_us"]
                p = cell.get((pub, b), {}).get("cpu_us")
                parts.append(f"{c / cell[(empty, b)]['cpu_us']:.2f} / " + (f"{c / p:.2f}" if p else "–"))
            lines.append(f"| {name} | " + " | ".join(parts) + " |")
    if meta["skipped"]:
        lines += ["", "Not measured:", ""] + [f"- {k}: {why}" for k, why in meta["skipped"].items()]
    late = sorted({r["variant"] for r in rows if r["loops_longer_than_sleep"]})
    if late:
        lines += ["", "Loops that outlived the GPU sleep (host figure may include waiting): " + ", ".join(late)]
    return "\n".join(lines) + "\n"


def _plot(rows, batches, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written")
        return
    names = list(dict.fromkeys(r["variant"] for r in rows))
    cell = {(r["variant"], r["batch"]): r["cpu_us"] for r in rows}
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(names) + 1.5))
    height = 0.8 / len(batches)
    for i, b in enumerate(batches):
        ys = [j + i * height for j in range(len(names))]
        ax.barh(ys, [cell.get((n, b), 0) for n in names], height=height, label=f"batch {b}")
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(names))])
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(15, color="k", linestyle="--", linewidth=1, label="goal 15 µs")
    ax.set_xlabel("host µs per call")
    ax.set_title("CPU cost per attention call (decode, GQA 64/8, d128, bf16, page 16)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
