#!/usr/bin/env python
"""Where a tensor-parallel decode step's GPU time goes: kernel time by kind in the full-decode
CUDA graph of the Llama-3-8B shape at TP=1 and TP=2 (symmetric-memory all-reduces, and the same
TP=2 model with every all-reduce on NCCL).

Run under torchrun, one process per GPU (on nvidia-h200-x2)::

    timeout 300 torchrun --nproc-per-node 2 benchmarks/tp_step_profile.py --out $OUT/tp_step_profile --log-dir $OUT

Models, caches and steps are latency_tp.py's (same seeds, same check against eager first). For
each bench and batch the captured graph is replayed ``--replays`` times under torch.profiler
(CUDA activity only), the ranks lined up first; kernels are grouped by name into matmul
(cuBLAS/cuBLASLt GEMV/GEMM and their split-K reductions), all-reduce (NCCL and symmetric-memory
kernels, their waits for the peer included), attention (the decode and combine kernels), and
other (norms, rotary, activation, copies). ``idle`` is the traced replays' GPU span minus the time some kernel was running (the GPU
waiting between kernels), per replay; ``graph GPU`` is the untraced replay's time (CUDA events),
for scale: tracing adds a little to each kernel. Rank 0's numbers are reported.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402

KINDS = ("matmul", "all-reduce", "attention", "other")
#: (bench, latency_tp bench it builds, TP size, all-reduces over symmetric memory)
BENCHES = [("tp1", "llama8b-tp1", 1, False), ("tp2", "llama8b-tp2", 2, True), ("tp2-nccl", "llama8b-tp2", 2, False)]
DEFAULT_OUT = common.RESULTS_DIR / "tp_step_profile"


def kernel_kind(name: str) -> str:
    n = name.lower()
    if "nccl" in n or "all_reduce" in n or "allreduce" in n:
        return "all-reduce"
    if any(k in n for k in ("gemv", "gemm", "nvjet", "cutlass", "splitk", "sm90_xmma")):
        return "matmul"
    if any(k in n for k in ("decode_kernel", "combine_kernel", "attn", "attention", "flash")):
        return "attention"
    return "other"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ints = common.argparse_type(common.parse_int_list)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=ints, default=[8, 1], help="the first must be >= 2 (it compiles)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--log-dir", default=None)
    p.add_argument("--hang-timeout-s", type=float, default=280.0)
    return p.parse_args(argv)


def busy_union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: time some kernel was running."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def profile_graph(graph, replays: int, line_up: Callable[[], None] | None) -> dict[str, Any]:
    """Kernel time by kind per replay, and idle = the traced replays' GPU span minus the time some
    kernel ran, per replay. The ranks line up first: a symmetric-memory or NCCL kernel waits for
    its peers, and a rank that starts tracing early would count that wait as all-reduce time
    (``line_up``: the TP group's barrier; None on one rank)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import latency as lat

    gpu_us = lat.replay_gpu_us(graph)
    torch.cuda.synchronize()
    if line_up is not None:
        line_up()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    by_kind = dict.fromkeys(KINDS, 0.0)
    counts = dict.fromkeys(KINDS, 0.0)
    top: dict[str, list[float]] = {}
    intervals = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = kernel_kind(e.name)
        by_kind[kind] += e.device_time / replays
        counts[kind] += 1 / replays
        top.setdefault(e.name, [0.0, 0.0])
        top[e.name][0] += e.device_time / replays
        top[e.name][1] += 1 / replays
        intervals.append((e.time_range.start, e.time_range.end))
    span = (max(i[1] for i in intervals) - min(i[0] for i in intervals)) if intervals else 0.0
    return {"graph_gpu_us": gpu_us, "kernel_us": {k: round(v, 1) for k, v in by_kind.items()},
            "kernels": {k: round(v) for k, v in counts.items()},
            "traced_us": round(span / replays, 1), "idle_us": round((span - busy_union_us(intervals)) / replays, 1),
            "top": [[n[:100], round(t, 1), round(c)] for n, (t, c) in sorted(top.items(), key=lambda kv: -kv[1][0])[:10]]}


def warm_up_profiler() -> None:
    """Start and stop the profiler once: its first start (CUPTI attaching) takes milliseconds, and
    a rank tracing for the first time while its peer already traces would make the peer's
    all-reduce kernels wait that long, counted as all-reduce time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]):
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()


def run(args, tp, log) -> list[dict[str, Any]]:
    import latency as lat
    import latency_tp as ltp

    from compileattn.parallel import comm

    largs = ltp.parse_args(["--batches", ",".join(map(str, args.batches)), "--context", str(args.context),
                            "--columns", "ca-full"])
    cells = [lat.Cell("decode", b, args.context) for b in args.batches]
    warm_up_profiler()
    tp.barrier()
    rows = []
    built: dict[str, Any] = {}
    for i, (name, key, size, symmetric) in enumerate(BENCHES):
        if size == tp.world_size or (size == 1 and tp.is_driver):
            if size > 1:
                comm.set_symmetric_memory(tp.group_name, symmetric)
            rows += profile_bench(name, key, size, symmetric, built, cells, largs, args, tp, log)
            if key in built and all(later[1] != key for later in BENCHES[i + 1:]):
                built.pop(key).close()
        tp.barrier()
    return rows


def profile_bench(name, key, size, symmetric, built, cells, largs, args, tp, log) -> list[dict[str, Any]]:
    """One bench's cells. On several ranks, every step that runs collectives (the compile's and
    capture's, the replays) is entered only once every rank got that far: a rank that failed
    before must not leave its peer's all-reduces waiting."""
    import latency as lat
    import latency_tp as ltp

    def everyone(ok: bool) -> bool:
        return all(tp.all_gather_object(ok)) if size > 1 else ok

    try:
        bench = built.get(key) or built.setdefault(key, ltp.build_bench(key, "llama8b", size, cells, largs, tp, log))
        group = lat.CompileattnGroup(bench, "ca-full")
        ready = True
    except Exception:  # noqa: BLE001
        log(traceback.format_exc(limit=8))
        ready = False
    if not everyone(ready):
        return []
    label = ("symmetric-memory" if symmetric else "nccl") if size > 1 else "—"
    rows = []
    for c in cells:
        row = {**ltp.base(key, c, "ca-full", size), "bench": name, "all_reduce": label,
               "padded_tokens": bench.padded(c)}
        lat.measure_cell(bench, group, "ca-full", c, row, largs, log)
        graph = group.captured_graph("ca-full", bench.padded(c)) if row["status"] == "ok" else None
        if everyone(graph is not None):
            row.update(profile_graph(graph, args.replays, tp.barrier if size > 1 else None))
            log(f"{name} b{c.batch}: graph {row['graph_gpu_us']:.0f} µs, kernels {row['kernel_us']}, "
                f"idle {row['idle_us']:.0f} µs")
        del graph
        rows.append(row)
    del group
    lat._reset_compilers()
    return rows


def render_markdown(payload: dict[str, Any]) -> str:
    out = ["# Tensor-parallel decode step: GPU time by kernel kind (Llama-3-8B shape, full-decode graph, rank 0)",
           "", common.environment_markdown(payload.get("env", {})),
           f"- ranks {payload.get('world_size')}; context {payload['config']['context']}; "
           f"{payload['config']['replays']} traced replays per cell; `graph GPU`: an untraced replay (CUDA events); "
           "`traced`: a traced replay's GPU span; `idle`: that span minus the time some kernel ran.", ""]
    table = []
    for r in payload["rows"]:
        if r.get("status") != "ok" or "kernel_us" not in r:
            table.append([r["bench"], r["batch"], r.get("status", "?"), "", "", "", "", "", "", ""])
            continue
        k = r["kernel_us"]
        table.append([r["bench"], r["batch"], f"{r['p50_us']:.0f}", f"{r['graph_gpu_us']:.0f}", f"{r['traced_us']:.0f}",
                      *(f"{k[kind]:.0f} ({r['kernels'][kind]})" for kind in KINDS), f"{r['idle_us']:.0f}"])
    out.append(common.markdown_table(["bench", "batch", "step p50", "graph GPU", "traced", *(f"{k} µs (kernels)" for k in KINDS),
                                      "idle µs"], table))
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return common.tp_main("tp_step_profile.py", parse_args(argv), run, render_markdown)

if __name__ == "__main__":
    sys.exit(main())
