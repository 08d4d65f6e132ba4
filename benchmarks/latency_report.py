"""Reporting of ``latency.py`` results: merging runs, ratios, goal checks, the roofline, markdown
and the plot. CPU-only and torch-free: ``latency.py --merge`` and the tests use it without a GPU,
and the committed ``results/latency*.json`` re-render with it.

The roofline: a step must at least read the model's weights and the K/V its attention attends
over, so no step can finish before those bytes have moved at the device's copy bandwidth. Bytes per
step = the decoder stack's parameter bytes (``forward`` returns hidden states: the LM head is not
run, and embedding tables are only gathered, a row per token, left out) + K/V bytes read (sum over
the step's sequences of the tokens attended, context + new tokens, x the per-token K/V bytes of
every layer: layers x kv_heads x head_dim x 2 x dtype size). The floor is those bytes ÷ the
device-to-device copy bandwidth ``latency.py`` measures in the same run (``common.copy_bandwidth``,
read + written bytes counted, the convention of ``decode_attention.py``'s ×floor). Runs recorded
before the roofline existed have neither the bandwidth nor the byte counts: their floor is n/a.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import coldwarm  # torch-free at import: the cold/warm start goals
import common

MODELS = {
    "opt": {"label": "OPT-125m shape", "dtype": "float16"},
    "llama": {"label": "Llama-3-8B shape", "dtype": "bfloat16"},
}
COLUMNS = ["eager", "inductor", "reduce-overhead", "ca-piecewise", "ca-full", "graph-eager", "graph-inductor"]
FULL_GRAPHS = ("graph-eager", "graph-inductor")

#: Issue 5's figures from the same H200 at context 512, batch 1 (µs per step); printed beside
#: ours for comparison only. They are not this code's measurements.
ISSUE_REFERENCE = {
    "opt": {"eager": 3442, "one full graph": 535, "hand-made piecewise runtime (29 µs attention op)": 598,
            "reduce-overhead with Inductor graph partition": 1804},
    "llama": {"eager": 13525, "full graph of eager kernels": 5133, "hand-made piecewise": 5342,
              "reduce-overhead": 4838},
}
#: Issue 12's step-time goals (ratios of p50s to the faster hand-captured full graph in the same
#: run, every decode cell), and issue 5's Llama goal against torch's reduce-overhead (checked
#: when that column ran). Cold and warm start goals live in ``coldwarm.GOALS``.
PIECEWISE_VS_BEST_GRAPH = {"opt": 1.05, "llama": 1.02}
FULL_DECODE_VS_BEST_GRAPH = 1.02
LLAMA_PIECEWISE_VS_REDUCE_OVERHEAD = 0.97
#: p50 ÷ baseline p50 above which a row is marked slower in the baseline comparison. Step p50s of
#: one cell move by a few per cent between processes on the same H200; 10 % is past that noise.
BASELINE_SLOWER = 1.10


def merge_payloads(payloads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if not payloads:
        raise ValueError("nothing to merge")
    merged = {k: v for k, v in payloads[0].items() if k not in ("runs", "rows", "stats", "probes")}
    merged.update(runs=[], rows=[], stats=[], probes=[])
    for i, pl in enumerate(payloads):
        if pl.get("benchmark") != "latency":
            raise ValueError(f"input {i} is not a latency result (benchmark={pl.get('benchmark')!r})")
        offset = len(merged["runs"])
        merged["runs"] += [dict(r) for r in pl["runs"]]
        for key in ("rows", "stats", "probes"):
            merged[key] += [{**r, "run": r.get("run", 0) + offset} for r in pl.get(key, [])]
    return merged


def row_key(r: dict[str, Any]) -> tuple:
    return (r["model"], r["kind"], r["batch"], r["context"], r["prefill"])


def select(rows: Sequence[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(model, kind, batch, context, prefill, column) -> the row shown (``common.latest_rows``)."""
    return common.latest_rows(rows, lambda r: (*row_key(r), r["column"]))


#: Each ratio of a table row: (numerator column, the columns whose fastest is the denominator).
RATIOS = {"piecewise_vs_best_graph": ("ca-piecewise", FULL_GRAPHS),
          "full_vs_best_graph": ("ca-full", FULL_GRAPHS),
          "piecewise_vs_reduce_overhead": ("ca-piecewise", ("reduce-overhead",))}


def interleaved_ratio(row: dict[str, Any] | None, num: str, dens: Sequence[str]) -> float | None:
    """``num``'s p50 ÷ the fastest of ``dens`` as timed side by side in ``row`` (its ``paired``
    record: ``latency.py`` interleaves a compileattn column's steps with the full graphs' replays),
    None where the row has no such timing of ``num`` and at least one of ``dens``."""
    p50 = ((row or {}).get("paired") or {}).get("p50_us") or {}
    floors = [p50[d] for d in dens if p50.get(d)]
    if not p50.get(num) or not floors:
        return None
    return p50[num] / min(floors)


def ratios(chosen: dict[tuple, dict[str, Any]], cell: tuple,
           rows: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The cell's ratios (``RATIOS``). Where the shown numerator row (``select``: the latest ok
    one) was timed interleaved with the denominator columns (``interleaved_ratio``), that ratio,
    its key listed in ``interleaved``: timed minutes apart, two columns of a sub-millisecond step
    differ by the host's and GPU's drift, a few per cent. Else each divides two p50s picked by
    ``common.run_pair`` (the latest run that measured the numerator and one of the denominator's
    columns; the fastest of those that run measured is the denominator). Where no run measured
    both, the latest rows of each, the ratio's key listed in ``cross_run`` (the table marks it
    ``*``; a goal does not count it). ``rows``: every row of the report (default: the shown ones,
    ``chosen``)."""
    in_cell = [r for r in (chosen.values() if rows is None else rows) if row_key(r) == cell]
    shown = {c: r for c in COLUMNS if (r := chosen.get((*cell, c))) and r["status"] == "ok"}

    def fastest(cols, names):
        vals = [cols[c]["p50_us"] for c in names if c in cols]
        return min(vals) if vals else None

    out: dict[str, Any] = {"best_graph_us": fastest(shown, FULL_GRAPHS), "cross_run": [], "interleaved": []}
    for key, (num, dens) in RATIOS.items():
        side_by_side = interleaved_ratio(shown.get(num), num, dens)
        if side_by_side is not None:
            out[key] = side_by_side
            out["interleaved"].append(key)
            continue
        pr = common.run_pair(in_cell, {c: (lambda r, c=c: r["column"] == c) for c in (num, *dens)},
                             lambda names, num=num, dens=dens: num in names and any(d in names for d in dens))
        if pr is None:
            out[key] = None
            continue
        cols, same_run = pr
        out[key] = cols[num]["p50_us"] / fastest(cols, dens)
        if not same_run:
            out["cross_run"].append(key)
    return out


def ratio_text(rt: dict[str, Any], key: str) -> str:
    """A ratio for the table, ``*`` after one whose two p50s come from different runs, ``†`` after
    one timed interleaved."""
    return (common.fmt_num(rt[key], 2) + ("*" if key in rt["cross_run"] else "")
            + ("†" if key in rt.get("interleaved", ()) else ""))


def interleaved_table(chosen: dict[tuple, dict[str, Any]], cells: Sequence[tuple]) -> list[str]:
    """Rows of the side-by-side timings (``paired``): per compileattn column and cell, the p50 of
    its steps and of each full graph's replays in the same rounds, and its ratio to the faster."""
    lines = []
    for cell in cells:
        for num in ("ca-piecewise", "ca-full"):
            r = chosen.get((*cell, num)) or {}
            p50 = (r.get("paired") or {}).get("p50_us") or {}
            ratio = interleaved_ratio(r, num, FULL_GRAPHS)
            if ratio is None:
                continue
            step = "decode" if cell[1] == "decode" else f"mixed (+{cell[4]} prefill)"
            lines.append([step, cell[2], cell[3], num, r["paired"].get("rounds", "—"), common.fmt_num(p50[num], 1)]
                         + [common.fmt_num(p50.get(g), 1) if p50.get(g) else "—" for g in FULL_GRAPHS]
                         + [f"{ratio:.3f}"])
    if not lines:
        return []
    return ["Side by side († in the table above): each round runs one step of the compileattn column and one "
            "replay of each full graph of the same cell, in rotating order, each ended by a synchronize; "
            "p50 µs over the rounds.", "",
            common.markdown_table(["step", "batch", "context", "column", "rounds", "column p50", *FULL_GRAPHS,
                                   "÷ faster graph"], lines), ""]


def goal_records(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Every goal this run measured (``common.goal`` records): per model, piecewise and full-decode
    against the best full graph over the decode cells, issue 5's piecewise against reduce-overhead
    where that column ran, and the cold/warm starts of the run's subprocesses. A cell whose ratio
    only exists across runs (``ratios``' ``cross_run``) is a cell not measured."""
    chosen = select(payload["rows"])
    cells = sorted({k[:5] for k in chosen if k[1] == "decode"})
    records = []

    def check(model, key, limit, what, required=True):
        model_cells = [c for c in cells if c[0] == model]
        rts = [(c, ratios(chosen, c, payload["rows"])) for c in model_cells]
        crossed = sum(rt[key] is not None and key in rt["cross_run"] for _, rt in rts)
        vals = [(c, rt[key]) for c, rt in rts if rt[key] is not None and key not in rt["cross_run"]]
        across = f"; {crossed} of them only across runs" if crossed else ""
        if not vals:
            if required or crossed:
                why = (f"no decode cell measured both columns in one run ({crossed} only across runs)" if crossed
                       else "missing columns")
                records.append(common.goal(what, None, why, model=model))
            return
        bad = [(c, v) for c, v in vals if v > limit]
        worst = max(vals, key=lambda cv: cv[1])
        # "every decode cell": a cell without the ratio (a column FAILED, errored or was skipped) is
        # not a cell met; with no measured miss the verdict is then "not measured", never MET
        unmeasured = len(model_cells) - len(vals)
        met = False if bad else (True if not unmeasured else None)
        records.append(common.goal(
            what, met, f"{len(vals) - len(bad)}/{len(vals)} decode cells ({min(v for _, v in vals):.3f}–{worst[1]:.3f}×); worst at batch "
            f"{worst[0][2]}, context {worst[0][3]}" + (f"; {unmeasured} decode cell(s) not measured{across}" if unmeasured else ""),
            model=model, cells=len(vals), cells_met=len(vals) - len(bad), cells_unmeasured=unmeasured,
            worst=worst[1], range=[min(v for _, v in vals), worst[1]]))

    for m in [m for m in MODELS if any(c[0] == m for c in cells)] + sorted({c[0] for c in cells} - set(MODELS)):
        label = MODELS.get(m, {}).get("label", m)
        if m in PIECEWISE_VS_BEST_GRAPH:
            check(m, "piecewise_vs_best_graph", PIECEWISE_VS_BEST_GRAPH[m],
                  f"{label}: compileattn piecewise ≤ {PIECEWISE_VS_BEST_GRAPH[m]}× the best full graph")
        check(m, "full_vs_best_graph", FULL_DECODE_VS_BEST_GRAPH,
              f"{label}: compileattn full-decode ≤ {FULL_DECODE_VS_BEST_GRAPH}× the best full graph")
        if m == "llama":
            check(m, "piecewise_vs_reduce_overhead", LLAMA_PIECEWISE_VS_REDUCE_OVERHEAD,
                  f"{label}: compileattn piecewise ≤ {LLAMA_PIECEWISE_VS_REDUCE_OVERHEAD}× reduce-overhead (issue 5)",
                  required=False)
    records += coldwarm.start_goal_records(payload.get("probes", []))
    return records


def goal_lines(payload: dict[str, Any]) -> list[str]:
    return [common.goal_line(g) for g in goal_records(payload)]


def step_bytes(counts: dict[str, Any], kind: str, batch: int, context: int, prefill: int) -> int:
    """Bytes a step must read (see the module docstring): weights + K/V of every attended token.
    Decode sequences attend their ``context`` cached tokens and the new one; the mixed step's
    prefill sequence (no cached context) attends its own ``prefill`` tokens."""
    attended = batch * (context + 1) + (prefill if kind == "mixed" else 0)
    return counts["weight_bytes"] + attended * counts["kv_bytes_per_token"]


def floor_us(payload: dict[str, Any], r: dict[str, Any]) -> float | None:
    """The roofline of row ``r``'s step in µs, from its own run's copy bandwidth and byte counts;
    None where that run did not record them."""
    runs = payload.get("runs", [])
    run = runs[r.get("run", 0)] if r.get("run", 0) < len(runs) else {}
    bandwidth = (run.get("copy_bandwidth") or {}).get("GBps")
    counts = (run.get("models") or {}).get(r["model"])
    if not bandwidth or not counts:
        return None
    return step_bytes(counts, r["kind"], r["batch"], r["context"], r["prefill"]) / (bandwidth * 1e9) * 1e6


def cell_floors_us(payload: dict[str, Any], chosen: dict[tuple, dict[str, Any]], cell: tuple) -> list[float]:
    """The distinct floors of a table row's shown rows, lowest first: one where its columns come
    from one run (or runs of one bandwidth), more where they come from runs whose measured
    bandwidths differ (each column is divided by its own run's floor, never another run's)."""
    return sorted({f for f in (floor_us(payload, r) for k, r in chosen.items() if k[:5] == cell) if f is not None})


def floor_text(floors: Sequence[float]) -> str:
    """'floor µs' of a table row: its one floor, 'lo–hi' where its columns' runs differ, else n/a."""
    if not floors:
        return "n/a"
    lo, hi = common.fmt_num(floors[0], 0), common.fmt_num(floors[-1], 0)
    return lo if lo == hi else f"{lo}–{hi}"


def cell_text(r: dict[str, Any] | None, floor: float | None = None) -> str:
    """'p50 / p90 / p99', and '(p50 ÷ floor ×)' when the step's floor is known."""
    if r is None:
        return "—"
    if r["status"] != "ok":
        return common.status_text(r["status"])
    text = f"{r['p50_us']:.0f} / {r['p90_us']:.0f} / {r['p99_us']:.0f}"
    return text + (f" ({r['p50_us'] / floor:.1f}×)" if floor else "")


def _tolerance_text(tol) -> str:
    if isinstance(tol, dict):
        return ", ".join(f"{dtype} {v}" for dtype, v in tol.items())
    return str(tol)


def gpu_host_table(chosen: dict[tuple, dict[str, Any]], cells: Sequence[tuple]) -> list[str]:
    """Rows 'GPU µs / host µs' for the columns that replay one graph per step."""
    cols = [c for c in ("ca-full", "graph-eager", "graph-inductor")
            if any((chosen.get((*cell, c)) or {}).get("graph_gpu_us") for cell in cells)]
    if not cols:
        return []
    rows = []
    for cell in cells:
        line = [cell[2], cell[3]]
        for c in cols:
            r = chosen.get((*cell, c)) or {}
            gpu = r.get("graph_gpu_us")
            host = r["p50_us"] - gpu if gpu else None
            # host = p50 - GPU of back-to-back replays: noisy by tens of µs in large cells, so < 0 happens
            line.append("—" if gpu is None else f"{gpu:.0f} / {host:.0f}" + (" (noise)" if host < 0 else ""))
        rows.append(line)
    return ["Where a full-graph step's time goes: GPU µs of one replay (timed over back-to-back replays, so "
            "no host work is in it) / host µs (step p50 minus that: Python dispatch, graph launch, sync).", "",
            common.markdown_table(["batch", "context"] + cols, rows), ""]


def baseline_lines(payload: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """Every row measured ok both here and in ``baseline``: both p50s and their ratio."""
    new, old = select(payload["rows"]), select(baseline.get("rows", []))
    order = {c: i for i, c in enumerate(COLUMNS)}
    keys = sorted((k for k, r in new.items() if r["status"] == "ok" and (old.get(k) or {}).get("status") == "ok"),
                  key=lambda k: (k[0], k[1] != "decode", k[3], k[2], order.get(k[5], len(order))))
    runs = baseline.get("runs") or [{}]
    label = "; ".join(f"{r.get('label', '?')} ({(r.get('env') or {}).get('time_utc', '?')})" for r in runs)
    out = [f"## Against the baseline: {label}", ""]
    if not keys:
        return out + ["No row was measured ok in both.", ""]
    table, slower = [], []
    for k in keys:
        ratio = new[k]["p50_us"] / old[k]["p50_us"]
        if ratio > BASELINE_SLOWER:
            slower.append(k)
        step = "decode" if k[1] == "decode" else f"mixed (+{k[4]} prefill)"
        table.append([MODELS.get(k[0], {}).get("label", k[0]), step, k[2], k[3], k[5], f"{old[k]['p50_us']:.0f}",
                      f"{new[k]['p50_us']:.0f}", f"{ratio:.2f}" + (" **slower**" if ratio > BASELINE_SLOWER else "")])
    worst = max(keys, key=lambda k: new[k]["p50_us"] / old[k]["p50_us"])
    out.append(f"p50 µs per step here ÷ the baseline's, {len(keys)} rows measured in both (another process, maybe "
               f"another session: a few per cent is noise). Slower by more than "
               f"{(BASELINE_SLOWER - 1) * 100:.0f} %: {len(slower)} row(s); the largest ratio is "
               f"{new[worst]['p50_us'] / old[worst]['p50_us']:.2f} ({worst[5]}, batch {worst[2]}, context {worst[3]}).")
    out += ["", common.markdown_table(["model", "step", "batch", "context", "column", "baseline p50", "p50",
                                       "÷ baseline"], table), ""]
    return out


def render_markdown(payload: dict[str, Any], baseline: dict[str, Any] | None = None) -> str:
    chosen = select(payload["rows"])
    runs = payload["runs"]
    out = ["# End-to-end step latency (µs per step, wall time incl. CPU, p50 / p90 / p99)", ""]
    for i, run in enumerate(runs):
        b = run.get("backend", {})
        out.append(f"Run {i} — {run.get('label', '?')}; attention backend {b.get('name', '?')}"
                   + (f" (unusable: {b['error']})" if b.get("error") else ""))
        out.append(common.environment_markdown(run.get("env", {})))
        out.append("")
    cfg = payload.get("config", {})
    out.append(f"Steps per cell: {cfg.get('steps')} timed after {cfg.get('warmup')} warm-up; every column's output "
               f"checked against eager first (norm-relative tolerance {_tolerance_text(cfg.get('tolerance'))}). Decode steps: each "
               f"sequence has `context` tokens cached; the mixed step adds one prefill chunk. Token counts are padded "
               f"to a capture size. Ratios use p50s of one run; 'best graph' = the faster hand-captured full graph; "
               f"† after a ratio: the two columns were timed side by side, interleaved (the table after); "
               f"* after a ratio: no run measured both of its columns, so it divides two runs' figures (not counted "
               f"in the goals). 'floor µs' is the roofline: the step's bytes (weights + K/V read) ÷ the copy "
               f"bandwidth measured in the run (lo–hi where the row's columns come from runs of different "
               f"bandwidth); (N×) after a cell is its p50 ÷ its own run's floor (n/a: the run did not record them).")
    out.append("")
    columns = [c for c in COLUMNS if any(k[5] == c for k in chosen)]
    present = {k[0] for k in chosen} | {x["model"] for x in payload.get("stats", []) + payload.get("probes", [])}
    models = [m for m in MODELS if m in present] + sorted(present - set(MODELS))
    for model in models:
        cells = sorted({k[:5] for k in chosen if k[0] == model}, key=lambda c: (c[1] != "decode", c[3], c[2]))
        out.append(f"## {MODELS.get(model, {}).get('label', model)} ({MODELS.get(model, {}).get('dtype', '?')})")
        out.append("")
        if not cells:
            out += ["No step timings in this run.", ""]
        headers = ["step", "batch", "context", "tokens", "floor µs"] + columns + [
            "pw ÷ best graph", "full ÷ best graph", "pw ÷ reduce-overhead"]
        table = []
        for cell in cells:
            any_row = next(chosen[(*cell, c)] for c in COLUMNS if (*cell, c) in chosen)
            rt = ratios(chosen, cell, payload["rows"])
            step = "decode" if cell[1] == "decode" else f"mixed (+{cell[4]} prefill)"
            table.append([step, cell[2], cell[3], f"{any_row['tokens']}→{any_row['padded_tokens']}",
                          floor_text(cell_floors_us(payload, chosen, cell))]
                         + [cell_text(r, floor_us(payload, r)) if (r := chosen.get((*cell, c))) else cell_text(None)
                            for c in columns]
                         + [ratio_text(rt, k) for k in RATIOS])
        if table:
            out.append(common.markdown_table(headers, table))
            out.append("")
            out += interleaved_table(chosen, cells)
            out += gpu_host_table(chosen, [c for c in cells if c[1] == "decode"])
        st = [s for s in payload.get("stats", []) if s["model"] == model]
        if st:
            out.append("Compile and capture: the first call of a column compiles (and captures, where that happens at "
                       "once); a later cell's first call recompiles (inductor at batch 1) or captures a new size.")
            out.append("")
            out.append(common.markdown_table(
                ["column", "first call s", "later first call, max s", "capture s", "graph pool MiB", "graphs"],
                [[s["column"], common.fmt_num(s.get("first_call_s"), 2),
                  common.fmt_num(s.get("later_first_call_max_s"), 2), common.fmt_num(s.get("capture_s"), 2),
                  common.fmt_num(s["graph_pool_bytes"] / common.MiB, 1) if s.get("graph_pool_bytes") is not None else "—",
                  s.get("graphs", s.get("full_graphs", "—"))] for s in st]))
            out.append("")
        pr = [p for p in payload.get("probes", []) if p["model"] == model]
        if pr:
            out.append("compileattn cold / warm start (fresh processes; cold: empty compileattn, Inductor and Triton "
                       "caches; warm: the same cache dirs again):")
            out.append("")
            out.append(common.markdown_table(
                ["phase", "first call s", "of which Dynamo s", "of which backend s", "of which load s",
                 "of which capture s", "process s", "pieces compiled", "path"],
                [[p["phase"], common.fmt_num(p.get("first_call_s"), 2), common.fmt_num(p.get("dynamo_s"), 2),
                  common.fmt_num(p.get("backend_s"), 2), common.fmt_num(p.get("load_s"), 2),
                  common.fmt_num(p.get("capture_s"), 2), common.fmt_num(p.get("process_s"), 1),
                  (p.get("counters") or {}).get("backend_compiles", "—") if p["status"] == "ok" else p["status"],
                  p.get("path", "—") if p["status"] == "ok" else p.get("reason", "")[:80]]
                 for p in pr]))
            out.append("")
        ref = ISSUE_REFERENCE.get(model)
        if ref:
            out.append("For comparison only — the issue's figures (same H200, context 512, batch 1, µs per step; not "
                       "measured by this script): " + "; ".join(f"{k} {v}" for k, v in ref.items()) + ".")
            out.append("")
    out.append("## Goal check (issue 12; issue 5 where its column ran)")
    out.append("")
    out.extend(goal_lines(payload) or ["- nothing to check"])
    if baseline is not None:
        out += [""] + baseline_lines(payload, baseline)
    problems = {}
    for r in payload["rows"]:
        if r["status"] in ("unavailable", "error", "FAILED") and r.get("reason"):
            problems.setdefault((r["column"], r["status"], r["reason"]), []).append(r)
        if r.get("paired_error"):  # the row stands; only its side-by-side timing is missing
            problems.setdefault((r["column"], "side-by-side timing failed", r["paired_error"]), []).append(r)
    if problems:
        out += ["", "## Notes", ""]
        for (col, status, reason), rs in sorted(problems.items()):
            out.append(f"- {col} — {status} in {len(rs)} cell(s): {reason}")
    return "\n".join(out) + "\n"


def plot(payload: dict[str, Any]):
    chosen = select(payload["rows"])
    models = [m for m in MODELS if any(k[0] == m for k in chosen)]

    def draw(plt):
        fig, axes = plt.subplots(1, max(1, len(models)), figsize=(7.5 * max(1, len(models)), 4.8), squeeze=False)
        for ax, model in zip(axes[0], models):
            cells = sorted({k[:5] for k in chosen if k[0] == model}, key=lambda c: (c[1] != "decode", c[3], c[2]))
            cols = [c for c in COLUMNS if any(k[0] == model and k[5] == c for k in chosen)]
            width = 0.8 / max(1, len(cols))
            for j, col in enumerate(cols):
                xs, ys, lo, hi = [], [], [], []
                for i, cell in enumerate(cells):
                    r = chosen.get((*cell, col))
                    if r and r["status"] == "ok":
                        xs.append(i + (j - (len(cols) - 1) / 2) * width)
                        ys.append(r["p50_us"])
                        lo.append(0)
                        hi.append(r["p99_us"] - r["p50_us"])
                ax.bar(xs, ys, width, yerr=[lo, hi], label=col, capsize=2)
            floors = [(i, f) for i, cell in enumerate(cells) for f in cell_floors_us(payload, chosen, cell)]
            if floors:
                ax.scatter([i for i, _ in floors], [f for _, f in floors], marker="_", s=600, color="k", zorder=3,
                           label="floor (bytes ÷ copy bandwidth)")
            ax.set_xticks(range(len(cells)))
            ax.set_xticklabels([f"b{c[2]}@{c[3]}" if c[1] == "decode" else f"mixed\n+{c[4]}" for c in cells],
                               fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel("µs per step (p50, bar to p99)")
            ax.set_title(MODELS[model]["label"])
            ax.grid(alpha=0.3, axis="y")
        axes[0][0].legend(fontsize=7)
        return fig

    return draw


def write_outputs(payload: dict[str, Any], prefix: str, no_plot: bool, log: Callable[[str], None],
                  baseline: dict[str, Any] | None = None) -> str:
    return common.write_outputs(payload, prefix, no_plot, log, render_markdown(payload, baseline), plot(payload),
                                "latency")


