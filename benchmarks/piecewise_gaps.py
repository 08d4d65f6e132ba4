#!/usr/bin/env python
"""Where a piecewise decode step's extra time goes: GPU idle gaps, extra kernels, host-bound stretches.

For a model shape of ``latency.py`` (``--model``: OPT-125m, fp16, 12 layers, by default, or the
Llama-3-8B shape, bf16, 32 layers; same model, caches, metadata and decode steps: this script
imports ``latency``'s ``Bench``, cells and column groups), and for the columns
``ca-piecewise``, ``ca-full`` and ``graph-inductor`` at each batch (default 1 and 8, context 512):

1. warm-up (compile + capture), then the output is compared with eager's (a column that disagrees
   is reported FAILED and not measured);
2. untraced: host wall time per step (``--wall-steps`` steps, each ended by a synchronize, as
   ``latency.py`` times them: p50/p90), and ``--pipelined-steps`` steps back to back without a
   synchronize: CUDA-event GPU µs per step (the GPU time when the host is never the bottleneck)
   and the host µs per step it took to issue them (the step's pure CPU cost);
3. traced: ``--steps`` steps (each ended by a synchronize) under ``torch.profiler.profile``
   (CPU + CUDA activities, 2 profiler warm-up steps first), each in a ``record_function`` range.
   From the trace's GPU events (kernels, memcpy, memset; kernels inside CUDA-graph replays are
   CUPTI records of their own, one per kernel node), each assigned to a step by the CPU launch call
   it correlates with, ``analyze_step`` gives per step: kernel count, the sum of kernel durations,
   the GPU span (first GPU event start to last end), idle = span - union of busy intervals, the
   gaps over ``--gap-us`` with their total, the gaps by kind of boundary, and the largest gaps
   with the kernels on either side. A gap's boundary kind comes from the launch calls of the
   events on either side: ``in-graph`` (both in one graph replay), ``graph->eager`` (a graph
   replay, then an eagerly launched kernel: attention between pieces), ``eager->graph``,
   ``graph->graph``, ``eager->eager``. ``host wait`` is the part of a gap before the next event's
   launch call even started on the CPU: the GPU waiting for the host (inflated by the profiler's
   own host cost; the untraced numbers of step 2 are the reference for host time).

If the profiler shows graph launches but no kernels inside them (CUPTI that does not report graph
kernel nodes), the column falls back to ``graph-spans`` mode, labelled so: every
``CUDAGraph.replay`` is bracketed by CUDA events in an untraced run, and the same analysis runs on
one event per graph replay (idle = GPU time outside any graph: eager kernels and launch gaps).

Run (H200, repository root): ``python benchmarks/piecewise_gaps.py --out $OUT/piecewise_gaps``
(``--backend flash`` is the default and needs FlashAttention-4: ``source .device/flash-attn-4.sh``
first, or pass ``--backend triton``). On a machine without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402
from latency_report import MODELS  # noqa: E402

COLUMNS = ("ca-piecewise", "ca-full", "graph-inductor")
#: latency.py's column group of each column; groups run in latency.py's order (so the compiled
#: objects are built in the same sequence as for its table).
GROUP_OF = {"ca-piecewise": "ca-piecewise", "graph-inductor": "inductor", "ca-full": "ca-full"}
GROUP_ORDER = ("ca-piecewise", "ca-full", "inductor")
#: Budget seconds a column group needs left to be started (OPT compiles: piecewise ~14 s, Inductor ~6 s;
#: the Llama shape's take longer: raise --budget-s).
GROUP_RESERVE_S = 15.0
STEP_PREFIX = "gaps_step_"
GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
DEFAULT_OUT = common.RESULTS_DIR / "piecewise_gaps"
#: latency.DEVICE for the run; "cuda" is the benchmark (a CPU smoke run of the plumbing sets "cpu").
DEVICE = "cuda"


# ----------------------------------------------------------------------------------------------
# The analysis: pure functions over GPU events (no torch, unit-tested on a CPU)


@dataclasses.dataclass
class GpuEvent:
    """One GPU activity. ``launch``: the correlation id of the CPU call that launched it (all
    kernels of one graph replay share their cudaGraphLaunch's); ``api``: that call's name;
    ``launch_start_us``: when that call began on the CPU (same clock as ``start_us``)."""

    name: str
    start_us: float
    dur_us: float
    kind: str = "kernel"  # kernel | memcpy | memset | graph (graph-spans mode)
    launch: Any = None
    api: str | None = None
    launch_start_us: float | None = None

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def as_event(e: Any) -> GpuEvent:
    if isinstance(e, GpuEvent):
        return e
    if isinstance(e, dict):
        return GpuEvent(**e)
    return GpuEvent(*e)


def launch_kind(e: GpuEvent) -> str:
    if e.kind == "graph" or (e.api and "graphlaunch" in e.api.lower()):
        return "graph"
    return "eager" if e.api else "?"


def boundary(prev: GpuEvent, nxt: GpuEvent) -> str:
    """What a gap between ``prev`` (the last event to finish before it) and ``nxt`` sits at."""
    if prev.launch is not None and prev.launch == nxt.launch:
        return "in-graph" if launch_kind(prev) == "graph" else "in-launch"
    return f"{launch_kind(prev)}->{launch_kind(nxt)}"


def analyze_step(events: Iterable[Any], gap_us: float = 2.0, top: int = 5) -> dict[str, Any]:
    """One step's GPU events -> counts, busy time, span, idle, gaps.

    ``events``: ``GpuEvent``s, dicts of its fields, or tuples ``(name, start_us, dur_us[, kind,
    launch, api, launch_start_us])``, in any order, possibly overlapping (concurrent streams).
    Idle is the span minus the union of the busy intervals; a gap is a stretch of the span covered
    by no event, attributed to the event that finished last before it and the first one after it.
    """
    evs = sorted((as_event(e) for e in events), key=lambda e: (e.start_us, e.end_us))
    out: dict[str, Any] = {"kernels": 0, "memcpy": 0, "memset": 0, "graphs": 0, "events": len(evs),
                           "kernel_sum_us": 0.0, "busy_sum_us": 0.0, "span_us": 0.0, "busy_union_us": 0.0,
                           "idle_us": 0.0, "gaps": 0, "gaps_over": 0, "gaps_over_us": 0.0, "host_wait_us": 0.0,
                           "by_boundary": {}, "largest": []}
    if not evs:
        return out
    for e in evs:
        if e.dur_us < 0:
            raise ValueError(f"negative duration: {e}")
        key = {"kernel": "kernels", "memcpy": "memcpy", "memset": "memset", "graph": "graphs"}.get(e.kind)
        if key:
            out[key] += 1
        if e.kind == "kernel":
            out["kernel_sum_us"] += e.dur_us
        out["busy_sum_us"] += e.dur_us
    start = evs[0].start_us
    end_ev = max(evs, key=lambda e: e.end_us)
    out["span_us"] = end_ev.end_us - start
    gaps = []
    union = 0.0
    cur_start, last = evs[0].start_us, evs[0]  # last: the event reaching furthest so far
    for e in evs[1:]:
        if e.start_us > last.end_us:  # a hole: [last.end, e.start]
            union += last.end_us - cur_start
            g = e.start_us - last.end_us
            wait = 0.0
            if e.launch_start_us is not None:
                wait = min(g, max(0.0, e.launch_start_us - last.end_us))
            gaps.append({"us": g, "at_us": last.end_us - start, "before": last.name, "after": e.name,
                         "boundary": boundary(last, e), "host_wait_us": wait})
            cur_start = e.start_us
        if e.end_us > last.end_us:
            last = e
    union += last.end_us - cur_start
    out["busy_union_us"] = union
    out["idle_us"] = out["span_us"] - union
    out["gaps"] = len(gaps)
    by: dict[str, dict[str, float]] = {}
    for g in gaps:
        out["host_wait_us"] += g["host_wait_us"]
        b = by.setdefault(g["boundary"], {"n": 0, "us": 0.0, "over": 0, "over_us": 0.0, "host_wait_us": 0.0})
        b["n"] += 1
        b["us"] += g["us"]
        b["host_wait_us"] += g["host_wait_us"]
        if g["us"] > gap_us:
            out["gaps_over"] += 1
            out["gaps_over_us"] += g["us"]
            b["over"] += 1
            b["over_us"] += g["us"]
    out["by_boundary"] = by
    out["largest"] = sorted(gaps, key=lambda g: -g["us"])[: max(0, top)]
    out["all_gaps"] = gaps
    return out


SCALARS = ("kernels", "memcpy", "memset", "graphs", "events", "kernel_sum_us", "busy_sum_us", "span_us",
           "busy_union_us", "idle_us", "gaps", "gaps_over", "gaps_over_us", "host_wait_us")


def aggregate_steps(steps: Sequence[dict[str, Any]], gap_us: float = 2.0, top: int = 8) -> dict[str, Any]:
    """Per-step analyses -> the median of every scalar, the mean µs per step of each boundary kind,
    and the recurring gaps grouped by (boundary, kernel before, kernel after): occurrences and mean
    µs per step, the largest single one; ordered by µs per step."""
    n = len(steps)
    if n == 0:
        return {"steps": 0}
    out: dict[str, Any] = {"steps": n}
    for k in SCALARS:
        out[k] = statistics.median(s[k] for s in steps)
    by: dict[str, dict[str, float]] = defaultdict(lambda: {"n": 0.0, "us": 0.0, "over": 0.0, "over_us": 0.0,
                                                           "host_wait_us": 0.0})
    groups: dict[tuple, dict[str, float]] = {}
    for s in steps:
        for name, b in s["by_boundary"].items():
            for k, v in b.items():
                by[name][k] += v / n
        for g in s.get("all_gaps", s["largest"]):
            if g["us"] <= gap_us:
                continue
            key = (g["boundary"], g["before"], g["after"])
            d = groups.setdefault(key, {"count": 0, "us": 0.0, "max_us": 0.0, "host_wait_us": 0.0})
            d["count"] += 1
            d["us"] += g["us"]
            d["host_wait_us"] += g["host_wait_us"]
            d["max_us"] = max(d["max_us"], g["us"])
    out["by_boundary"] = dict(sorted(by.items(), key=lambda kv: -kv[1]["us"]))
    rows = [{"boundary": k[0], "before": k[1], "after": k[2], "per_step": d["count"] / n,
             "us_per_step": d["us"] / n, "mean_us": d["us"] / d["count"], "max_us": d["max_us"],
             "host_wait_us_per_step": d["host_wait_us"] / n} for k, d in groups.items()]
    out["top_gaps"] = sorted(rows, key=lambda r: -r["us_per_step"])[:top]
    return out


# ----------------------------------------------------------------------------------------------
# The trace: chrome-trace events -> per-step GpuEvent lists (pure too)


def step_events_from_trace(trace: dict[str, Any], slack_us: float = 50.0) -> tuple[list[list[GpuEvent]], dict[str, Any]]:
    """A ``torch.profiler`` chrome trace -> the GPU events of each ``record_function``
    ``gaps_step_<i>`` range (in step order), and per step: CPU launch calls by API name
    (``launch_calls``), the range's duration (``window_us``: the traced step's wall time), and the
    GPU events dropped as impossible (``dropped``).

    A GPU event belongs to the step in whose CPU range its launch call (matched by correlation id)
    started; one with no matching call, to the step whose range contains its own start. Every step
    ends with a synchronize inside its range, so a real event lies inside the range (and after its
    launch call); one that does not, by more than ``slack_us`` of clock skew, has a corrupt
    timestamp (CUPTI hands back a few such records at the head of a profiling session, pytorch
    issue 192021) and is dropped."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    windows = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), int(e["name"][len(STEP_PREFIX):]))
                     for e in evs if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(STEP_PREFIX))
    calls: dict[Any, tuple[str, float]] = {}
    api_counts: list[dict[str, int]] = [defaultdict(int) for _ in windows]

    def window_of(ts: float) -> int | None:
        for i, (a, b, _) in enumerate(windows):
            if a <= ts <= b:
                return i
        return None

    for e in evs:
        if e.get("cat") in RUNTIME_CATS:
            ts = float(e["ts"])
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                calls[corr] = (str(e.get("name")), ts)
            w = window_of(ts)
            if w is not None:
                api_counts[w][str(e.get("name"))] += 1
    per_step: list[list[GpuEvent]] = [[] for _ in windows]
    dropped = [0] * len(windows)
    for e in evs:
        kind = GPU_CATS.get(e.get("cat"))
        if kind is None:
            continue
        corr = (e.get("args") or {}).get("correlation")
        api, launch_ts = calls.get(corr, (None, None))
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        w = window_of(launch_ts if launch_ts is not None else ts)
        if w is None:
            continue
        lo, hi, _ = windows[w]
        if dur < 0 or ts < max(lo, launch_ts if launch_ts is not None else lo) - slack_us or ts + dur > hi + slack_us:
            dropped[w] += 1
            continue
        per_step[w].append(GpuEvent(str(e.get("name")), ts, dur, kind, corr if api is not None else None, api,
                                    launch_ts))
    order = [w[2] for w in windows]

    def in_order(xs):
        return [x for _, x in sorted(zip(order, xs), key=lambda t: t[0])]

    return in_order(per_step), {"launch_calls": in_order([dict(c) for c in api_counts]),
                                "window_us": in_order([b - a for a, b, _ in windows]), "dropped": in_order(dropped)}


def median_calls(api_counts: Sequence[dict[str, int]]) -> dict[str, float]:
    names = sorted({k for c in api_counts for k in c})
    return {k: statistics.median(c.get(k, 0) for c in api_counts) for k in names} if api_counts else {}


def graph_kernels_missing(per_step: Sequence[Sequence[GpuEvent]], calls: dict[str, float]) -> bool:
    """The trace shows graph launches but no GPU event launched by one: kernel nodes not reported."""
    graph_calls = sum(v for k, v in calls.items() if "graphlaunch" in k.lower())
    graph_events = sum(1 for s in per_step for e in s if launch_kind(e) == "graph")
    return graph_calls > 0 and graph_events == 0


def short_name(name: str, limit: int = 70) -> str:
    """A kernel name for a table: no 'void ', no argument list, at most ``limit`` chars."""
    n = name.removeprefix("void ")
    depth, cut = 0, len(n)
    for i, ch in enumerate(n):  # cut at the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0 and i > 0:
            cut = i
            break
    n = n[:cut]
    return n if len(n) <= limit else n[: limit - 1] + "…"


# ----------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ints = common.argparse_type(common.parse_int_list)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=ints, default=[1, 8], help="decode batch sizes (default 1,8)")
    p.add_argument("--model", default="opt", choices=sorted(MODELS), help="latency.py's model shape (default opt)")
    p.add_argument("--llama-layers", type=int, default=None, help="override the Llama shape's 32 layers")
    p.add_argument("--context", type=int, default=512, help="tokens already cached per sequence (default 512)")
    p.add_argument("--columns", type=common.argparse_type(lambda s: common.parse_name_list(s, COLUMNS)),
                   default=list(COLUMNS), help=f"subset of {','.join(COLUMNS)}")
    p.add_argument("--steps", type=int, default=50, help="profiled steps per cell (default 50)")
    p.add_argument("--wall-steps", type=int, default=200, help="untraced synchronized steps for host wall time")
    p.add_argument("--pipelined-steps", type=int, default=20,
                   help="untraced steps back to back (no sync) for GPU µs/step and host µs/step")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per cell first (default 5)")
    p.add_argument("--backend", default="flash", help="attention backend (default flash: FlashAttention-4)")
    p.add_argument("--compile-sizes", default="auto", help="as latency.py's (CompileConfig.compile_sizes)")
    p.add_argument("--inductor-options", type=common.argparse_type(common.json_object), default={}, metavar="JSON",
                   help="as latency.py's (CompileConfig.inductor_options)")
    p.add_argument("--gap-us", type=float, default=2.0, help="gaps longer than this are counted (default 2 µs)")
    p.add_argument("--top", type=int, default=8, help="recurring gaps listed per cell (default 8)")
    p.add_argument("--graph-spans", action="store_true",
                   help="also measure per-graph-replay spans with CUDA events (automatic when the profiler "
                        "shows no kernels inside graph replays)")
    p.add_argument("--trace-dir", default=None, help="keep each cell's chrome trace here (default: not kept)")
    p.add_argument("--budget-s", type=float, default=90.0,
                   help="wall-clock budget; work past it is reported as skipped (0 = none)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="norm-relative error to eager allowed (default per dtype: fp16 0.05, bf16 0.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output prefix: writes PREFIX.json and PREFIX.md")
    args = p.parse_args(argv)
    if args.steps < 1 or args.wall_steps < 1 or args.pipelined_steps < 1 or args.warmup < 1:
        p.error("--steps, --wall-steps, --pipelined-steps and --warmup must be >= 1")
    if args.context < 1 or args.gap_us < 0:
        p.error("--context must be >= 1 and --gap-us >= 0")
    return args


# ----------------------------------------------------------------------------------------------
# Measuring (CUDA)


def check_backend(name: str) -> str | None:
    """None when ``name`` is usable here; else why not (flash must be FlashAttention-4)."""
    from compileattn.backends.selector import get_backend

    try:
        backend = get_backend(name, "cuda")
    except Exception as exc:  # noqa: BLE001
        return f"attention backend {name!r} unusable: {common.short_error(exc)}"
    if name == "flash":
        try:
            from compileattn.backends.flash_fa4 import FA4Backend
        except Exception as exc:  # noqa: BLE001
            return f"--backend flash needs FlashAttention-4, which does not import ({common.short_error(exc)})"
        if not isinstance(backend, FA4Backend):
            return (f"--backend flash needs FlashAttention-4; 'flash' is {getattr(backend, 'label', backend.name)} "
                    f"here")
    return None


def untraced(step: Callable[[], Any], args, lat) -> dict[str, Any]:
    """Host wall per synchronized step, and back-to-back GPU µs/step and host µs/step."""
    import torch

    res = {"wall": common.summarize_us(lat.timed_steps(step, args.wall_steps))}
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t = time.perf_counter()
    for _ in range(args.pipelined_steps):
        step()
    host = time.perf_counter() - t
    end.record()
    end.synchronize()
    res["pipelined_gpu_us"] = start.elapsed_time(end) * 1e3 / args.pipelined_steps
    res["pipelined_host_us"] = host * 1e6 / args.pipelined_steps
    return res


def profile_steps(step: Callable[[], Any], steps: int, trace_path: Path) -> dict[str, Any]:
    """``steps`` synchronized steps under the profiler (after 2 profiler warm-up steps), each in a
    ``record_function`` range; returns the chrome trace as a dict."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    def ready(p):
        p.export_chrome_trace(str(trace_path))

    sched = schedule(wait=0, warmup=2, active=steps, repeat=1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=sched, on_trace_ready=ready) as prof:
        for i in range(steps + 2):
            with record_function(f"{STEP_PREFIX}{i}"):
                step()
                torch.cuda.synchronize()
            prof.step()
    if not trace_path.exists():  # on_trace_ready not called (a profiler whose schedule ended differently)
        prof.export_chrome_trace(str(trace_path))
    return json.loads(trace_path.read_text())


def graph_span_steps(step: Callable[[], Any], steps: int) -> list[list[GpuEvent]]:
    """Untraced steps with every ``CUDAGraph.replay`` bracketed by CUDA events; per step, one
    ``graph`` event per replay (times in µs from the step's start event)."""
    import torch

    cls = torch.cuda.CUDAGraph
    original = cls.replay
    marks: list[tuple[Any, Any]] = []

    def replay(self, *a, **kw):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        r = original(self, *a, **kw)
        e.record()
        marks.append((s, e))
        return r

    out: list[list[GpuEvent]] = []
    cls.replay = replay
    try:
        for _ in range(steps):
            marks.clear()
            t0 = torch.cuda.Event(enable_timing=True)
            t0.record()
            step()
            torch.cuda.synchronize()
            out.append([GpuEvent(f"graph#{k}", t0.elapsed_time(s) * 1e3, s.elapsed_time(e) * 1e3, "graph", ("g", k),
                                 "cudaGraphLaunch") for k, (s, e) in enumerate(marks)])
    finally:
        cls.replay = original
    return out


def measure(bench, group, column: str, cell, args, log: common.Log, lat, trace_dir: Path) -> dict[str, Any]:
    import torch

    import compileattn as ca

    row: dict[str, Any] = {"column": column, "batch": cell.batch, "context": cell.context,
                           "padded_tokens": bench.padded(cell), "status": None, "reason": ""}
    try:
        md, ids, pos = bench.prepare(cell)
        with ca.set_forward_context(md, bench.caches), torch.no_grad():
            step = group.step(column, cell, ids, pos)
            first, out = lat.warm_up(step, args.warmup)
            row["first_call_s"] = round(first, 3)
            err = common.rel_error(out[: cell.tokens], bench.reference[cell])
            tol = args.tolerance if args.tolerance is not None else lat.TOLERANCE[str(bench.dtype).removeprefix("torch.")]
            row["rel_err"] = err
            del out
            if not err <= tol:
                row.update(status="FAILED", reason=f"output differs from eager: rel. error {err:.3g} > {tol}")
                return row
            row.update(untraced(step, args, lat))
            path = trace_dir / f"trace_{column}_b{cell.batch}_c{cell.context}.json"
            trace = profile_steps(step, args.steps, path)
            per_step, extra = step_events_from_trace(trace)
            del trace
            if not per_step:
                raise RuntimeError(f"the profiler trace has no {STEP_PREFIX}* ranges (torch.profiler recorded nothing?)")
            calls = median_calls(extra["launch_calls"])
            row["launch_calls_per_step"] = calls
            row["profiled_steps_found"] = len(per_step)
            row["traced_wall_p50_us"] = statistics.median(extra["window_us"]) if per_step else None
            row["dropped_gpu_events"] = sum(extra["dropped"])
            analyses = [analyze_step(s, args.gap_us, args.top) for s in per_step]
            row["mode"] = "kernels"
            if graph_kernels_missing(per_step, calls):
                row["mode"] = "graph-spans (CUDA events; the profiler showed no kernels inside graph replays)"
            if row["mode"] != "kernels" or args.graph_spans:
                spans = [analyze_step(s, args.gap_us, args.top) for s in graph_span_steps(step, args.steps)]
                row["graph_spans"] = aggregate_steps(spans, args.gap_us, args.top)
                if row["mode"] != "kernels":
                    analyses = spans
            row["profile"] = aggregate_steps(analyses, args.gap_us, args.top)
            row["median_step_largest_gaps"] = _median_step(analyses, "span_us").get("largest", [])
            row["status"] = "ok"
    except lat.Unavailable as exc:
        row.update(status="unavailable", reason=str(exc))
    except Exception as exc:  # noqa: BLE001
        row.update(status="error", reason=common.short_error(exc))
        log("".join(traceback.format_exc(limit=8)).rstrip())
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
    return row


def _median_step(analyses: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    if not analyses:
        return {}
    return sorted(analyses, key=lambda a: a[key])[len(analyses) // 2]


def run(args, log: common.Log, checkpoint: Callable[[dict], None]) -> dict[str, Any]:
    import torch

    import latency as lat

    budget = common.Budget(args.budget_s)
    lat.DEVICE = DEVICE
    env = common.environment()
    log(f"GPU {env['gpu']}; versions {env['versions']}")
    rows: list[dict[str, Any]] = []
    payload = {"benchmark": "piecewise_gaps", "environment": env,
               "config": {"model": args.model, "llama_layers": args.llama_layers, "batches": args.batches,
                          "context": args.context, "columns": args.columns,
                          "steps": args.steps, "wall_steps": args.wall_steps, "pipelined_steps": args.pipelined_steps,
                          "warmup": args.warmup, "backend": args.backend, "compile_sizes": args.compile_sizes,
                          "gap_us": args.gap_us, "budget_s": args.budget_s},
               "rows": rows}
    cells = sorted((lat.Cell("decode", b, args.context) for b in args.batches), key=lambda c: -c.tokens)
    try:
        bench = lat.Bench(args.model, cells, args, log)
        payload["decode_backend"] = sorted({b.name for b in lat.decode_backends(bench)})
        log(f"decode attention backend(s) after selection: {payload['decode_backend']}")
        for cell in cells:
            bench.reference[cell] = lat.eager_reference(bench, cell)
    except Exception as exc:  # noqa: BLE001  (e.g. the eager step fails: say so in the result files)
        log("".join(traceback.format_exc(limit=8)).rstrip())
        rows += [{"column": c, "batch": cell.batch, "context": cell.context, "status": "error",
                  "reason": f"model / eager reference failed: {common.short_error(exc)}"}
                 for c in args.columns for cell in cells]
        payload["elapsed_s"] = round(log.elapsed(), 1)
        return payload
    tmp = None
    if args.trace_dir:
        trace_dir = Path(args.trace_dir)
        trace_dir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="piecewise_gaps_")
        trace_dir = Path(tmp.name)
    try:
        for group_name in GROUP_ORDER:
            wanted = [c for c in args.columns if GROUP_OF[c] == group_name]
            if not wanted:
                continue
            if budget.exceeded(reserve=GROUP_RESERVE_S):
                rows += [{"column": c, "batch": cell.batch, "context": cell.context, "status": "skipped",
                          "reason": budget.reason()} for c in wanted for cell in cells]
                continue
            log(f"{group_name}: {', '.join(wanted)}")
            try:
                group = lat.make_group(group_name, bench)
            except Exception as exc:  # noqa: BLE001
                unavailable = isinstance(exc, lat.Unavailable)
                rows += [{"column": c, "batch": cell.batch, "context": cell.context,
                          "status": "unavailable" if unavailable else "error",
                          "reason": str(exc) if unavailable else common.short_error(exc)}
                         for c in wanted for cell in cells]
                continue
            for cell in cells:
                for column in wanted:
                    if budget.exceeded():
                        rows.append({"column": column, "batch": cell.batch, "context": cell.context,
                                     "status": "skipped", "reason": budget.reason()})
                        continue
                    row = measure(bench, group, column, cell, args, log, lat, trace_dir)
                    rows.append(row)
                    log(_row_line(row))
                    checkpoint(payload)
            del group
            lat._reset_compilers()
    finally:
        if tmp is not None:
            tmp.cleanup()
    bench.close()
    torch.cuda.empty_cache()
    payload["elapsed_s"] = round(log.elapsed(), 1)
    return payload


def _row_line(row: dict[str, Any]) -> str:
    head = f"  {row['column']:15s} b{row['batch']:<3d}"
    if row.get("status") != "ok":
        return f"{head} {row.get('status')}: {row.get('reason')}"
    p = row["profile"]
    return (f"{head} wall p50 {row['wall']['p50_us']:7.1f} (traced {row['traced_wall_p50_us']:7.1f}) µs | "
            f"pipelined GPU {row['pipelined_gpu_us']:7.1f} "
            f"host {row['pipelined_host_us']:7.1f} µs/step | traced: {p['kernels']:.0f} kernels, busy "
            f"{p['kernel_sum_us']:.1f}, span {p['span_us']:.1f}, idle {p['idle_us']:.1f} µs, "
            f"{p['gaps_over']:.0f} gaps > 2 µs ({p['gaps_over_us']:.1f} µs) [{row['mode'].split(' ')[0]}]")


# ----------------------------------------------------------------------------------------------
# Report (pure)


def markdown(payload: dict[str, Any]) -> str:
    cfg = payload.get("config", {})
    rows = payload.get("rows", [])
    gap = cfg.get("gap_us", 2.0)
    model = MODELS.get(cfg.get("model", "opt"), MODELS["opt"])
    layers = f" with {cfg['llama_layers']} layers" if cfg.get("model") == "llama" and cfg.get("llama_layers") else ""
    lines = [f"# Piecewise decode step: where the GPU time goes ({model['label']}{layers}, {model['dtype']}, "
             f"context {cfg.get('context')})",
             "", common.environment_markdown(payload.get("environment", {})),
             f"- Backend: {cfg.get('backend')} (decode runs on {', '.join(payload.get('decode_backend') or ['?'])}); "
             f"profiled steps per cell {cfg.get('steps')}, untraced {cfg.get('wall_steps')} (synchronized) + "
             f"{cfg.get('pipelined_steps')} (back to back); medians over steps", ""]
    ok = [r for r in rows if r.get("status") == "ok"]
    head = ["column", "batch", "wall p50 µs", "traced wall µs", "pipelined GPU µs/step", "host µs/step", "kernels",
            "memcpy+set",
            "kernel busy µs", "GPU span µs", "idle µs", f"gaps > {gap:g} µs", "in gaps µs", "host wait µs",
            "graph launches", "other launches", "mode"]
    body = []
    for r in rows:
        if r.get("status") != "ok":
            body.append([r["column"], r["batch"], common.status_text(r.get("status") or "?")] + [""] * (len(head) - 4)
                        + [common.short_error(RuntimeError(r.get("reason", "")), 80).removeprefix("RuntimeError: ")])
            continue
        p = r["profile"]
        calls = r.get("launch_calls_per_step", {})
        graphs = sum(v for k, v in calls.items() if "graphlaunch" in k.lower())
        others = sum(v for k, v in calls.items() if "launch" in k.lower() and "graphlaunch" not in k.lower())
        body.append([r["column"], r["batch"], common.fmt_num(r["wall"]["p50_us"]), common.fmt_num(r.get("traced_wall_p50_us")),
                     common.fmt_num(r["pipelined_gpu_us"]),
                     common.fmt_num(r["pipelined_host_us"]), f"{p['kernels']:.0f}", f"{p['memcpy'] + p['memset']:.0f}",
                     common.fmt_num(p["kernel_sum_us"]), common.fmt_num(p["span_us"]), common.fmt_num(p["idle_us"]),
                     f"{p['gaps_over']:.0f}", common.fmt_num(p["gaps_over_us"]), common.fmt_num(p["host_wait_us"]),
                     f"{graphs:g}", f"{others:g}", r["mode"].split(" ")[0]])
    lines += ["## Per step", "", common.markdown_table(head, body, "lr" + "r" * (len(head) - 3) + "l"), ""]
    lines += ["wall p50: untraced, each step ended by a synchronize (latency.py's timing); traced wall: the same "
              "under the profiler (its host overhead). pipelined: untraced "
              "steps back to back, GPU µs/step by CUDA events and host µs/step to issue them (the step's CPU "
              "cost). The rest is from the profiled steps (medians): kernel busy = sum of kernel durations; "
              "span = first GPU event start to last end; idle = span - union of busy; host wait = the part of "
              "the gaps before the next kernel's launch call began on the CPU (the GPU waiting for the host; "
              "the profiler inflates host time). launches: CPU launch calls per step from the trace. Boundary "
              "kinds: in-graph (inside one graph replay), graph->eager (a graph replay, then an eagerly launched "
              "kernel), eager->graph, graph->graph, eager->eager; '?' = the launch call is not in the trace.", ""]
    by_key = {(r["column"], r["batch"]): r for r in ok}
    delta = []
    for b in cfg.get("batches", []):
        ref = by_key.get(("graph-inductor", b))
        if ref is None:
            continue
        for col in ("ca-piecewise", "ca-full"):
            r = by_key.get((col, b))
            if r is None:
                continue
            p, q = r["profile"], ref["profile"]
            delta.append([col, b, _signed(r["wall"]["p50_us"] - ref["wall"]["p50_us"]),
                          _signed(r["pipelined_gpu_us"] - ref["pipelined_gpu_us"]),
                          f"{p['kernels'] - q['kernels']:+.0f}", _signed(p["kernel_sum_us"] - q["kernel_sum_us"]),
                          _signed(p["span_us"] - q["span_us"]), _signed(p["idle_us"] - q["idle_us"]),
                          _signed(p["host_wait_us"] - q["host_wait_us"]),
                          _signed((r["wall"]["p50_us"] - p["span_us"]) - (ref["wall"]["p50_us"] - q["span_us"]))])
    if delta:
        lines += ["## Minus graph-inductor (µs per step)", "",
                  common.markdown_table(["column", "batch", "wall p50", "pipelined GPU", "kernels", "kernel busy",
                                         "GPU span", "idle", "host wait", "wall - span"], delta), "",
                  "Reading: wall = span + the host time outside the GPU span (before the first kernel, after the "
                  "last); the span = kernel busy + idle. More kernel busy = extra or slower kernels; more idle = "
                  "gaps (by boundary below); more 'wall - span' = host work before/after the GPU's work. "
                  "'pipelined GPU' close to graph-inductor's while 'wall' is not means the step is host-bound.", ""]
    for r in ok:
        p = r["profile"]
        lines += [f"## {r['column']}, batch {r['batch']}: gaps by boundary and the largest recurring gaps", ""]
        if not p.get("by_boundary"):
            lines += ["No gaps: the GPU was busy from the step's first kernel to its last.", ""]
            continue
        lines.append(common.markdown_table(
            ["boundary", "gaps/step", "µs/step", f"> {gap:g} µs /step", "µs in those", "host wait µs/step"],
            [[k, f"{v['n']:.1f}", common.fmt_num(v["us"]), f"{v['over']:.1f}", common.fmt_num(v["over_us"]),
              common.fmt_num(v["host_wait_us"])] for k, v in p.get("by_boundary", {}).items()], "lrrrrr"))
        lines.append("")
        if p.get("top_gaps"):
            lines.append(common.markdown_table(
                ["µs/step", "per step", "mean µs", "max µs", "host wait µs/step", "boundary", "before", "after"],
                [[common.fmt_num(g["us_per_step"]), f"{g['per_step']:.1f}", common.fmt_num(g["mean_us"]),
                  common.fmt_num(g["max_us"]), common.fmt_num(g["host_wait_us_per_step"]), g["boundary"],
                  f"`{short_name(g['before'])}`", f"`{short_name(g['after'])}`"] for g in p["top_gaps"]],
                "rrrrrlll"))
            lines.append("")
        if r.get("graph_spans"):
            s = r["graph_spans"]
            lines += [f"graph-spans (CUDA events around each CUDAGraph.replay, untraced): {s['graphs']:.0f} graph "
                      f"replays/step, span {common.fmt_num(s['span_us'])} µs, outside graphs "
                      f"{common.fmt_num(s['idle_us'])} µs/step", ""]
    notes = [f"- {r['column']} b{r['batch']}: {r.get('status')}: {r.get('reason')}" for r in rows if r.get("status") != "ok"]
    notes += [f"- {r['column']} b{r['batch']}: {r['dropped_gpu_events']} GPU events with impossible timestamps dropped"
              for r in ok if r.get("dropped_gpu_events")]
    notes += [f"- {r['column']} b{r['batch']}: mode {r['mode']}" for r in ok if r.get("mode", "kernels") != "kernels"]
    if notes:
        lines += ["## Notes", "", *notes, ""]
    return "\n".join(lines)


def _signed(x: float) -> str:
    return ("+" if x > 0 else "") + common.fmt_num(x)


def write_outputs(payload: dict[str, Any], prefix: str, log: common.Log | None = None) -> str:
    paths = common.output_paths(prefix)
    common.write_json(paths["json"], payload)
    md = markdown(payload)
    common.write_text(paths["md"], md)
    if log is not None:
        log(f"wrote {paths['json']} and {paths['md']}")
    return md


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    missing = common.cuda_missing_message("piecewise_gaps.py")
    if missing:
        print(missing, flush=True)
        return 0
    common.ensure_repo_on_path()
    log = common.Log()
    why = check_backend(args.backend)
    if why:
        print(f"piecewise_gaps.py: {why}. Nothing measured. For FlashAttention-4: "
              f"`source .device/flash-attn-4.sh` first; or run with --backend triton.", flush=True)
        return 2
    payload = run(args, log, checkpoint=lambda pl: write_outputs(pl, args.out))
    print(write_outputs(payload, args.out, log), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
