"""Reporting of ``op_overhead.py`` results: reading both result layouts, merging runs, the
after ÷ before table, markdown and the plot. CPU-only and torch-free (the tests and ``--merge``
run it anywhere).

Two layouts are read, so the benchmark of the code before the package redesign (commit 51ed29a,
whose own ``op_overhead.py`` is run unchanged from an exported tree) sits beside this one's:

- this script's: ``{"benchmark": "op_overhead", "config", "runs", "rows"}``, rows carrying ``run``;
- the pre-redesign script's: ``{"meta", "results"}``, one run, every row measured (it had no
  status); or, when that run was cut short before writing its JSON, its stdout, whose lines
  ``batch   1  <variant>  cpu 11.02 µs  gpu 1.79 µs`` are the same numbers (``parse_log``).

The two scripts time the same way (same loop behind a ``torch.cuda._sleep``, same events), but
their variants are named after what each version of the package calls, so ``PAIRS`` says which
row of one is which row of the other.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import common

EMPTY_ADD = "empty launch: torch.add (1 element)"
EMPTY_TRITON = "empty launch: Triton kernel"
FA4_PUBLIC = "FA4 public flash_attn_varlen_func"
FA4_ENTRY = "FA4 entry _flash_attn_fwd(out=)"
FA4_PREPARED = "FA4 prepared call: FA4Backend.prepare_attend(...)(q, out)"
KV_TRITON = "KV write: triton kernel, prepared"
KV_TORCH = "KV write: torch padded writer, prepared"
UNHOISTED = "op, shape logic inside (views, checks, generic write, alloc, FA4 public)"


def op_caller(backend: str) -> str:
    """The compiled runtime's per-layer call: ``ops.attend_caller(layer, 0, 1)(q, out)``."""
    return f"op {backend}: attend_caller (compiled runtime, per layer)"


def op_dispatcher(backend: str) -> str:
    """The eager op through the dispatcher: ``torch.ops.compileattn.attention`` (write + attend)."""
    return f"op {backend}: torch.ops.compileattn.attention (eager, write + attend)"


#: (row of the comparison, variant of the pre-redesign script, variant of this script). The
#: controls do not involve compileattn: their ratio is the noise between the two processes.
PAIRS = [
    ("control: empty torch.add launch", EMPTY_ADD, EMPTY_ADD),
    ("control: empty Triton launch", EMPTY_TRITON, EMPTY_TRITON),
    ("control: FA4 public entry", FA4_PUBLIC, FA4_PUBLIC),
    ("control: FA4 entry with out=", FA4_ENTRY, FA4_ENTRY),
    ("FA4 direct call", "FA4 direct: compiled kernel object", FA4_PREPARED),
    ("flash op per layer, compiled runtime", "op flash (kv=triton): attend_impl (piecewise, KV write captured)",
     op_caller("flash")),
    ("triton op per layer, compiled runtime", "op triton: attend_impl (piecewise, KV write captured)",
     op_caller("triton")),
    ("flash eager op, dispatcher (write + attend)", "op flash (kv=triton): torch.ops dispatcher",
     op_dispatcher("flash")),
    ("triton eager op, dispatcher (write + attend)", "op triton: torch.ops dispatcher", op_dispatcher("triton")),
    ("KV write: triton kernel", "KV write: triton", KV_TRITON),
    ("KV write: torch", "KV write: torch", KV_TORCH),
    ("shape logic inside the op", UNHOISTED, UNHOISTED),
]
#: Issue 12: host µs of the Triton op's per-layer call from the compiled runtime, every batch.
HOST_GOAL_US = 15.0
#: The shape fields two runs must share for their rows to be compared.
SHAPE_KEYS = ("heads", "kv_heads", "head_dim", "dtype", "block_size", "context")
_LOG_LINE = re.compile(r"^batch\s+(\d+)\s+(.+?)\s+cpu\s+([\d.]+) µs\s+gpu\s+([\d.]+) µs\s*$")
PRE_REDESIGN = "pre-redesign op_overhead.py"


# -- layouts -----------------------------------------------------------------------------------

def parse_log(text: str) -> list[dict[str, Any]]:
    """Rows from the pre-redesign script's progress lines (its JSON is written only at the end)."""
    rows = []
    for line in text.splitlines():
        m = _LOG_LINE.match(line.strip())
        if m:
            rows.append({"variant": m.group(2), "batch": int(m.group(1)), "cpu_us": float(m.group(3)),
                         "gpu_us": float(m.group(4))})
    return rows


def as_payload(data: Any, source: str = "") -> dict[str, Any]:
    """Any layout -> this script's payload. ``data`` is a parsed JSON object, or the text of the
    pre-redesign script's stdout."""
    if isinstance(data, str):
        rows = parse_log(data)
        if not rows:
            raise ValueError(f"{source or 'text'}: no 'batch N <variant> cpu X µs gpu Y µs' lines in it")
        batches = sorted({r["batch"] for r in rows})
        run = {"label": PRE_REDESIGN, "layout": "stdout (the run ended before writing its JSON)", "source": source,
               "env": {}, "skipped": {}}
        return {"benchmark": "op_overhead", "config": {"shape": {"batches": batches}}, "runs": [run],
                "rows": [{"run": 0, "status": "ok", "reason": "", **r} for r in rows]}
    if not isinstance(data, dict):
        raise ValueError(f"{source or 'input'}: not an op_overhead result")
    if data.get("benchmark") == "op_overhead":
        return data
    if "meta" in data and "results" in data:
        meta = data["meta"]
        env = {"gpu": {"name": meta.get("gpu")}, "versions": meta.get("versions", {}),
               "command": meta.get("command"), "time_utc": meta.get("date"), "cpu": meta.get("cpu")}
        run = {"label": PRE_REDESIGN, "layout": "meta/results", "source": source, "env": env,
               "skipped": meta.get("skipped", {})}
        return {"benchmark": "op_overhead", "config": {"shape": meta.get("shape", {}), "method": meta.get("method")},
                "runs": [run], "rows": [{"run": 0, "status": "ok", "reason": "", **r} for r in data["results"]]}
    raise ValueError(f"{source or 'input'}: not an op_overhead result (benchmark={data.get('benchmark')!r})")


def read_result(path: str | Path) -> dict[str, Any]:
    """A result file of either script: JSON, or the pre-redesign script's saved stdout."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = text
    return as_payload(data, str(path))


def merge_payloads(payloads: Sequence[dict[str, Any]], labels: Sequence[str] | None = None) -> dict[str, Any]:
    """One payload holding every run, labelled ``labels`` in order if given; ValueError if their
    shapes differ (nothing would compare)."""
    if not payloads:
        raise ValueError("nothing to merge")
    payloads = [as_payload(p) for p in payloads]
    merged = {"benchmark": "op_overhead", "config": dict(payloads[0].get("config", {})), "runs": [], "rows": []}
    shape0 = merged["config"].get("shape", {})
    for i, pl in enumerate(payloads):
        shape = pl.get("config", {}).get("shape", {})
        differ = [k for k in SHAPE_KEYS if k in shape and k in shape0 and shape[k] != shape0[k]]
        if differ:
            raise ValueError(f"input {i} measured another shape ({', '.join(f'{k}={shape[k]}' for k in differ)}); "
                             f"its rows cannot be compared with input 0's")
        offset = len(merged["runs"])
        merged["runs"] += [dict(r) for r in pl["runs"]]
        merged["rows"] += [{**r, "run": r.get("run", 0) + offset} for r in pl["rows"]]
        for k in SHAPE_KEYS:  # a run parsed from stdout knows only its batches
            if k not in shape0 and k in shape:
                shape0 = merged["config"]["shape"] = {**shape0, k: shape[k]}
    merged["config"]["shape"] = {**shape0, "batches": sorted({r["batch"] for r in merged["rows"]})}
    if labels:
        if len(labels) != len(merged["runs"]):
            raise ValueError(f"{len(labels)} labels for {len(merged['runs'])} runs")
        for run, label in zip(merged["runs"], labels):
            run["label"] = label
    return merged


# -- comparison ---------------------------------------------------------------------------------

def cells(payload: dict[str, Any]) -> dict[tuple[int, str, int], dict[str, Any]]:
    """(run, variant, batch) -> row."""
    return {(r["run"], r["variant"], r["batch"]): r for r in payload["rows"]}


def _ok(row: dict[str, Any] | None) -> bool:
    return row is not None and row.get("status", "ok") == "ok" and row.get("cpu_us") is not None


def comparison(payload: dict[str, Any], before: int = 0, after: int | None = None) -> list[dict[str, Any]]:
    """The ``PAIRS`` rows both runs measured: host and GPU µs of each and after ÷ before."""
    after = len(payload["runs"]) - 1 if after is None else after
    cell = cells(payload)
    out = []
    for label, old, new in PAIRS:
        for b in payload["config"]["shape"]["batches"]:
            x, y = cell.get((before, old, b)), cell.get((after, new, b))
            if _ok(x) and _ok(y):
                out.append({"row": label, "batch": b, "before_variant": old, "after_variant": new,
                            "before_cpu_us": x["cpu_us"], "after_cpu_us": y["cpu_us"],
                            "cpu_ratio": y["cpu_us"] / x["cpu_us"], "before_gpu_us": x.get("gpu_us"),
                            "after_gpu_us": y.get("gpu_us"), "after_py_frames": y.get("py_frames")})
    return out


# -- markdown -----------------------------------------------------------------------------------

def _num(x: float | None) -> str:
    return common.fmt_num(x, 1)


def _range(counts: Sequence[int | None]) -> str:
    """Python frame counts of one variant over the batches: '12', or '12–14' where they differ."""
    known = sorted({c for c in counts if c is not None})
    return "–" if not known else str(known[0]) if len(known) == 1 else f"{known[0]}–{known[-1]}"


def run_heading(i: int, run: dict[str, Any]) -> list[str]:
    env = run.get("env") or {}
    v = env.get("versions") or {}
    stack = ", ".join(f"{k} {val}" for k, val in {**v, **(env.get("fa4_stack") or {})}.items()
                      if val and not isinstance(val, bool))
    lines = [f"## Run {i}: {run.get('label', '?')}" + (f" (from {run['source']}, {run['layout']} layout)"
                                                      if run.get("layout") else ""), ""]
    gpu = (env.get("gpu") or {}).get("name", "?")
    lines.append(f"- GPU {gpu}; CPU {env.get('cpu', '?')}; {stack or 'versions not recorded'}")
    lines.append(f"- Command: `{env.get('command', '?')}`; {env.get('time_utc', '?')}"
                 + (f"; commit {env['git_commit']}" if env.get("git_commit") else ""))
    return lines + [""]


def run_table(payload: dict[str, Any], run: int) -> list[str]:
    batches = payload["config"]["shape"]["batches"]
    rows = [r for r in payload["rows"] if r["run"] == run]
    names = list(dict.fromkeys(r["variant"] for r in rows))
    cell = {(r["variant"], r["batch"]): r for r in rows}
    has_frames = any(r.get("py_frames") is not None for r in rows)

    def text(r, key):
        if r is None:
            return "–"
        if r.get("status", "ok") != "ok":
            return {"FAILED": "**FAILED**"}.get(r["status"], r["status"])
        return _num(r.get(key))

    table = []
    for name in names:
        line = [name] + [text(cell.get((name, b)), "cpu_us") for b in batches]
        line += [text(cell.get((name, b)), "gpu_us") for b in batches]
        if has_frames:
            line.append(_range([cell[(name, b)].get("py_frames") for b in batches if (name, b) in cell]))
        table.append(line)
    headers = (["variant"] + [f"CPU µs b={b}" for b in batches] + [f"GPU µs b={b}" for b in batches]
               + (["Python frames"] if has_frames else []))
    out = [common.markdown_table(headers, table), ""]
    info = payload["runs"][run]
    notes = {**(info.get("skipped") or {}), **(info.get("notes") or {})}
    problems = [(r["variant"], r["batch"], r["status"], r.get("reason", "")) for r in rows
                if r.get("status", "ok") != "ok"]
    if notes or problems:
        out += ["Not measured or remarked:", ""]
        out += [f"- {k}: {why}" for k, why in notes.items()]
        out += [f"- {v} (batch {b}): {status}: {why}" for v, b, status, why in problems]
        out.append("")
    late = sorted({r["variant"] for r in rows if r.get("loops_longer_than_sleep")})
    if late:
        out += ["Loops that outlived the GPU sleep (their host figure may include waiting): " + ", ".join(late), ""]
    frames = info.get("frames") or {}
    if frames:
        out += ["Python frames per call (`sys.setprofile` 'call' events during one call, after warm-up; "
                f"batch {info.get('frames_batch', '?')}):", ""]
        out += [f"- {name}: {len(chain)}: " + " → ".join(f"`{f}`" for f in chain) for name, chain in frames.items()]
        out.append("")
    return out


def comparison_lines(payload: dict[str, Any]) -> list[str]:
    runs = payload["runs"]
    if len(runs) < 2:
        return []
    comp = comparison(payload)
    title = f"## After ÷ before: run {len(runs) - 1} ({runs[-1].get('label', '?')}) ÷ run 0 ({runs[0].get('label', '?')})"
    if not comp:
        return [title, "", "No row was measured in both runs.", ""]
    batches = [b for b in payload["config"]["shape"]["batches"] if any(c["batch"] == b for c in comp)]
    by = {(c["row"], c["batch"]): c for c in comp}
    labels = [p[0] for p in PAIRS if any(c["row"] == p[0] for c in comp)]
    host, gpu = [], []
    for label in labels:
        host.append([label] + [f"{_num(c['before_cpu_us'])} → {_num(c['after_cpu_us'])} ({c['cpu_ratio']:.2f}×)"
                               if (c := by.get((label, b))) else "–" for b in batches]
                    + [_range([c["after_py_frames"] for c in comp if c["row"] == label])])
        gpu.append([label] + [f"{_num(c['before_gpu_us'])} → {_num(c['after_gpu_us'])}"
                              if (c := by.get((label, b))) else "–" for b in batches])
    out = [title, "",
           "Host µs per call, before → after (after ÷ before). Both processes ran in the same GPU session, one "
           "after the other; the controls (no compileattn code in them) show how far the two processes differ "
           "by themselves.", "",
           common.markdown_table(["per call"] + [f"b={b}" for b in batches] + ["Python frames, after"], host), "",
           "GPU µs per call, before → after (the same kernels should take the same time):", "",
           common.markdown_table(["per call"] + [f"b={b}" for b in batches], gpu), "",
           "Which variant each row is:", ""]
    out += [f"- {label}: before `{old}`; after `{new}`" for label, old, new in PAIRS if label in labels]
    return out + [""]


def goal_records(payload: dict[str, Any], run: int | None = None) -> list[dict[str, Any]]:
    """The Triton op's host cost per layer (``op_caller("triton")``) against ``HOST_GOAL_US`` at
    every batch of one run (default: the last), as ``common.goal`` records."""
    run = len(payload["runs"]) - 1 if run is None else run
    rows = sorted((r for r in payload["rows"] if r["run"] == run and r["variant"] == op_caller("triton")),
                  key=lambda r: r["batch"])
    what = f"Triton attention op host cost ≤ {HOST_GOAL_US:g} µs per call (compiled runtime, per layer)"
    ok = [r for r in rows if _ok(r)]
    if not ok:
        return [common.goal(what, None, "no triton per-layer row in this run")]
    # Every batch of the run: those with any row, and those whose setup failed (no row at all, only
    # run["skipped"]["batch N"]); a batch without an ok triton row is not a batch met.
    info = payload["runs"][run] if run < len(payload["runs"]) else {}
    batches = {r["batch"] for r in payload["rows"] if r["run"] == run}
    batches |= {int(k.split()[1]) for k in (info.get("skipped") or {})
                if k.startswith("batch ") and k.split()[1].isdigit()}
    unmeasured = len(batches - {r["batch"] for r in ok})
    worst = max(ok, key=lambda r: r["cpu_us"])
    met = False if worst["cpu_us"] > HOST_GOAL_US else (True if not unmeasured else None)
    return [common.goal(what, met,
                        ", ".join(f"{r['cpu_us']:.1f} µs at batch {r['batch']}" for r in ok)
                        + (f" ({unmeasured} batch(es) not measured)" if unmeasured else ""),
                        worst=worst["cpu_us"])]


def render_markdown(payload: dict[str, Any]) -> str:
    shape = payload["config"].get("shape", {})
    out = ["# CPU cost per attention call", "",
           f"Decode, GQA {shape.get('heads', '?')}/{shape.get('kv_heads', '?')}, head dim "
           f"{shape.get('head_dim', '?')}, {shape.get('dtype', '?')}, page {shape.get('block_size', '?')}, context "
           f"{shape.get('context', '?')}, one layer. Host µs per call: median over repetitions of a Python loop's "
           f"wall time ÷ calls, the GPU kept busy by a preceding `torch.cuda._sleep` so the loop never waits on it. "
           f"GPU µs per call: the same calls queued behind a sleep, CUDA events from the first to the last.", ""]
    out += comparison_lines(payload)
    out += ["## Goal (issue 12)", "", *(common.goal_line(g) for g in goal_records(payload)), ""]
    for i, run in enumerate(payload["runs"]):
        out += run_heading(i, run) + run_table(payload, i)
    return "\n".join(out).rstrip() + "\n"


def plot(payload: dict[str, Any]):
    """Host µs per call: the compared rows (before and after) when there are two runs, else every
    variant of the one run; one panel per batch."""
    batches = payload["config"]["shape"]["batches"]
    comp = comparison(payload) if len(payload["runs"]) > 1 else []
    if comp:
        names = [p[0] for p in PAIRS if any(c["row"] == p[0] for c in comp)]
        by = {(c["row"], c["batch"]): c for c in comp}
        series = [(payload["runs"][0].get("label", "before"), lambda n, b: (by.get((n, b)) or {}).get("before_cpu_us")),
                  (payload["runs"][-1].get("label", "after"), lambda n, b: (by.get((n, b)) or {}).get("after_cpu_us"))]
    else:
        cell = cells(payload)
        run = len(payload["runs"]) - 1
        names = list(dict.fromkeys(r["variant"] for r in payload["rows"] if r["run"] == run))
        series = [(payload["runs"][run].get("label", "run"),
                   lambda n, b: (cell.get((run, n, b)) or {}).get("cpu_us"))]

    def draw(plt):
        fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 0.4 * len(names) + 1.8),
                                 squeeze=False, sharey=True)
        height = 0.8 / len(series)
        for ax, b in zip(axes[0], batches):
            for j, (label, get) in enumerate(series):
                ax.barh([i + j * height for i in range(len(names))], [get(n, b) or 0 for n in names],
                        height=height, label=label)
            ax.axvline(HOST_GOAL_US, color="k", linestyle="--", linewidth=1, label=f"goal {HOST_GOAL_US:g} µs")
            ax.set_xscale("log")
            ax.set_title(f"batch {b}")
            ax.set_xlabel("host µs per call")
        axes[0][0].set_yticks([i + 0.4 - height / 2 for i in range(len(names))])
        axes[0][0].set_yticklabels(names, fontsize=7)
        axes[0][0].invert_yaxis()
        axes[0][0].legend(fontsize=7)
        fig.suptitle("CPU cost per attention call (decode, one layer)")
        fig.tight_layout()
        return fig

    return draw


def write_outputs(payload: dict[str, Any], prefix: str, no_plot: bool, log: Callable[[str], None]) -> str:
    return common.write_outputs(payload, prefix, no_plot, log, render_markdown(payload), plot(payload),
                                "op overhead")
