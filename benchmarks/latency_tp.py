#!/usr/bin/env python
"""Decode-step latency under tensor parallelism: the Llama-3-8B shape at TP=1 and TP=2, and the
Llama-3-70B shape (GQA 64/8, hidden 8192, FFN 28672; fewer layers so it fits) at TP=2.

Run under torchrun, one process per GPU (see benchmarks/README.md)::

    timeout 450 torchrun --nproc-per-node 2 benchmarks/latency_tp.py --out $OUT/latency_tp --log-dir $OUT

Benches: ``llama8b-tp1``, ``llama8b-tp2`` (small all-reduces by the algorithms ``init_tp`` chose:
one-shot / two-shot over symmetric memory where every rank can, see compileattn/parallel/comm.py),
``llama8b-tp2-nccl`` (the same model and cache with every all-reduce on NCCL), ``llama70b-tp2``.

Columns (latency.py's, same code): ``ca-piecewise`` and ``ca-full`` (compileattn with piecewise /
full-decode CUDA graphs; at TP=2 every row-parallel all-reduce is inside the captured pieces) and
``reduce-overhead`` (torch.compile's CUDA-graph trees; the all-reduce is the same functional
collective). Cells: decode steps of batch 1/8/64 at one context. A step is the model's forward
from the call to the end of ``torch.cuda.synchronize()``; rank 0's p50/p99 are reported (rank 1's
p50 beside it). TP=1 cells run on rank 0 while rank 1 waits.

Correctness before timing, as in latency.py: each column's output is compared with the same
model's eager output. The TP=2 models hold rank slices of the TP=1 model's weights and of its
random KV-cache contents (same seeds), so their eager output is also compared with TP=1 eager
(``TP=2 vs TP=1`` table): the bf16 check of the sharding at full size.

Every rank must run the same steps in the same order (their collectives pair up): rank 0 decides
every budget question and broadcasts the answer over gloo; a task past ``--budget-s`` is reported
as skipped. Priority: compileattn columns of 8B TP=1, 8B TP=2, 70B TP=2, then reduce-overhead
(whose whole-model Inductor compile takes minutes at these sizes) in the same order.

Goal (issue 14): TP=2 decode step <= 0.6x TP=1 on the 8B shape at batch 1.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402
import latency as lat  # noqa: E402
import latency_report as report  # noqa: E402

COLUMNS = ["ca-piecewise", "ca-full", "reduce-overhead"]
#: (bench key, model, TP size); TP=1 runs on rank 0 alone.
BENCHES = [("llama8b-tp1", "llama8b", 1), ("llama8b-tp2", "llama8b", 2), ("llama8b-tp2-nccl", "llama8b", 2),
           ("llama70b-tp2", "llama70b", 2)]
#: Benches whose small all-reduces run on NCCL even where the group set up symmetric memory
#: (one-shot / two-shot, compileattn/parallel/comm.py): the same TP=2 model and cache as the bench named here, so the
#: two algorithms are compared in one run.
NCCL_ONLY = {"llama8b-tp2-nccl": "llama8b-tp2"}
LABELS = {"llama8b": "Llama-3-8B shape", "llama70b": "Llama-3-70B shape"}
GOAL_RATIO = 0.6
DEFAULT_OUT = common.RESULTS_DIR / "latency_tp"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ints = common.argparse_type(common.parse_int_list)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=ints, default=[1, 8, 64])
    p.add_argument("--context", type=int, default=1024, help="tokens cached per sequence")
    p.add_argument("--columns", type=common.argparse_type(lambda s: common.parse_name_list(s, COLUMNS)),
                   default=list(COLUMNS))
    p.add_argument("--benches", type=common.argparse_type(lambda s: common.parse_name_list(s, [b[0] for b in BENCHES])),
                   default=[b[0] for b in BENCHES])
    p.add_argument("--layers-8b", type=int, default=32)
    p.add_argument("--layers-70b", type=int, default=10, help="layers of the 70B shape (80 do not fit)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--backend", default="auto", help="attention backend")
    p.add_argument("--budget-s", type=float, default=380.0)
    p.add_argument("--quick", action="store_true", help="batch 1 and 8, 8B shape only, compileattn columns")
    p.add_argument("--tolerance", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--log-dir", default=None, help="per-rank logs: DIR/rank{r}.log")
    p.add_argument("--hang-timeout-s", type=float, default=None,
                   help="exit with tracebacks in the rank log after this long (set it below the caller's timeout)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="merge result files of several runs (e.g. one with --columns reduce-overhead) into one report")
    p.add_argument("-o", "--output", default=None, help="output prefix for --merge (default: --out)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU over gloo with simulated CUDA graphs: checks this script's plumbing")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.benches = [1, 8], ["llama8b-tp1", "llama8b-tp2"]
        args.columns = [c for c in args.columns if c != "reduce-overhead"]
    if args.cpu_smoke:
        args.columns = [c for c in args.columns if c != "reduce-overhead"]
    # latency.py's helpers read these
    args.compile_sizes = ""
    args.llama_layers = None
    args.piece_compiler = "eager" if args.cpu_smoke else "inductor"
    return args


def model_config(model: str, args):
    from compileattn.models.llama import LlamaConfig

    if args.cpu_smoke:
        kv = 2 if model == "llama8b" else 4
        return LlamaConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4 if model == "llama8b" else 8,
                           num_kv_heads=kv, head_dim=32, intermediate_size=256, max_position=4096)
    if model == "llama8b":
        return LlamaConfig.llama3_8b(num_layers=args.layers_8b)
    return LlamaConfig.llama3_70b(num_layers=args.layers_70b)


def build(model: str, tp_size: int, tp, args):
    """The full model (seeded: every rank and TP size gets the same weights), sharded if tp_size > 1."""
    import torch

    from compileattn.models.llama import LlamaForCausalLM
    from compileattn.parallel import shard_model

    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    full = LlamaForCausalLM(model_config(model, args), dtype=dtype, device=tp.device, seed=0)
    return shard_model(full, tp=tp) if tp_size > 1 else full


def build_bench(key: str, model: str, size: int, cells, args, tp, log):
    """latency.py's ``Bench`` for ``model`` at TP ``size``: the (sharded) model, the rank's slice
    of the TP=1 cache contents, and each cell's eager reference."""
    bench = lat.Bench(key, cells, args, log, model=build(model, size, tp, args))
    if size > 1:
        fill_cache_slices(bench, args, tp)
    for cell in cells:
        bench.reference[cell] = lat.eager_reference(bench, cell)
    return bench


def fill_cache_slices(bench, args, tp) -> None:
    """Give a sharded bench the rank's KV heads of the TP=1 bench's random cache (same generator
    draws in the same order), so its outputs are comparable with TP=1's."""
    import torch

    from compileattn.parallel import HeadShard

    gen = torch.Generator(device=tp.device).manual_seed(args.seed)
    cfg = bench.model.config
    heads = HeadShard(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.world_size).kv_heads
    for cache in bench.caches.values():
        full_shape = (*cache.key_cache.shape[:2], cfg.num_kv_heads, cache.key_cache.shape[3])
        for part in (cache.key_cache, cache.value_cache):
            full = torch.empty(full_shape, dtype=part.dtype, device=part.device).normal_(generator=gen)
            part.copy_(full[:, :, heads.start:heads.stop])
            del full


class RankLog(common.Log):
    """latency.py's log interface, into the per-rank logger (stderr and DIR/rank{r}.log)."""

    def __call__(self, msg: str) -> None:
        import logging

        logging.getLogger("compileattn").info("[%7.1fs] %s", self.elapsed(), msg)


def graphs_context(args):
    import contextlib

    if args.cpu_smoke:
        from compileattn.testing import simulated_cuda_graphs

        return simulated_cuda_graphs()
    return contextlib.nullcontext()


def make_group(column: str, bench):
    # --cpu-smoke: inside simulated_cuda_graphs the CPU's reference backend stands in for a capturable one
    return lat.ReduceOverheadGroup(bench) if column == "reduce-overhead" else lat.CompileattnGroup(bench, column)


def run(args, tp, log: RankLog, payload: dict[str, Any], checkpoint) -> None:
    """Every task; results go into ``payload``'s rows/checks/stats as they finish (so a run that
    fails half-way still reports what it measured), ``checkpoint()`` after each task."""
    from compileattn.parallel import comm

    budget = common.Budget(args.budget_s)
    cells = sorted((lat.Cell("decode", b, args.context) for b in args.batches), key=lambda c: -c.tokens)
    rows, checks, stats = payload["rows"], payload["checks"], payload["stats"]
    benches: dict[str, Any] = {}
    mine = [b for b in BENCHES if b[0] in args.benches and (b[2] == tp.world_size or (b[2] == 1 and tp.is_driver))]
    for key, model, size in BENCHES:
        if key not in args.benches:
            continue
        if size not in (1, tp.world_size):
            raise ValueError(f"{key} needs {size} ranks; this run has {tp.world_size}")
        if (key, model, size) in mine and key in NCCL_ONLY and NCCL_ONLY[key] in benches:
            benches[key] = benches[NCCL_ONLY[key]]
        elif (key, model, size) in mine:
            t = time.monotonic()
            bench = benches[key] = build_bench(key, model, size, cells, args, tp, log)
            payload.setdefault("layers", {})[key] = bench.model.config.num_layers
            log(f"{key}: built, sharded and eager references in {time.monotonic() - t:.1f} s")
        tp.barrier()
    tp1 = benches.get("llama8b-tp1")
    tp2 = benches.get("llama8b-tp2")
    if tp.is_driver and tp1 is not None and tp2 is not None:
        for cell in cells:
            err = common.rel_error(tp2.reference[cell], tp1.reference[cell])
            tol = args.tolerance if args.tolerance is not None else lat.TOLERANCE[str(tp2.dtype).removeprefix("torch.")]
            checks.append({"check": "8B eager TP=2 vs TP=1", "batch": cell.batch, "context": cell.context,
                           "rel_err": err, "tolerance": tol, "ok": err <= tol})
            log(f"8B eager TP=2 vs TP=1, batch {cell.batch}: rel. error {err:.3g} ({'ok' if err <= tol else 'FAILED'})")
    tasks = [(key, col) for col in ("ca-piecewise", "ca-full") for key, _, _ in BENCHES]
    tasks += [(key, "reduce-overhead") for key, _, _ in BENCHES]
    for key, column in tasks:
        if key not in args.benches or column not in args.columns:
            continue
        size = next(b[2] for b in BENCHES if b[0] == key)
        skip = tp.broadcast_object(budget.exceeded(reserve=lat.GROUP_RESERVE_S) if tp.is_driver else None)
        if skip:
            rows += [dict(base(key, cell, column, size), status="skipped", reason=budget.reason()) for cell in cells]
            continue
        if key in benches:
            if size > 1:
                comm.set_symmetric_memory(tp.group_name, key not in NCCL_ONLY)
            with graphs_context(args):
                rows += measure_task(benches[key], key, column, size, cells, args, tp, budget, log, stats)
        tp.barrier()
        lat._reset_compilers()
        if tp.is_driver:
            checkpoint()
    for bench in {id(b): b for b in benches.values()}.values():
        bench.close()
    benches.clear()
    gc.collect()


def base(key: str, cell, column: str, size: int) -> dict[str, Any]:
    model = key.split("-")[0]
    return {**lat.base_row(model, cell, column, 0), "bench": key, "tp": size}


def measure_task(bench, key, column, size, cells, args, tp, budget, log, stats) -> list[dict[str, Any]]:
    """One column on one bench: every cell, in step on every rank of the bench."""
    rows = []
    try:
        group = make_group(column, bench)
    except Exception as exc:  # noqa: BLE001
        status = "unavailable" if isinstance(exc, lat.Unavailable) else "error"
        return [dict(base(key, c, column, size), status=status, reason=common.short_error(exc)) for c in cells]
    log(f"{key}: {column}")
    for cell in cells:
        row = base(key, cell, column, size)
        row["padded_tokens"] = bench.padded(cell)
        stop = budget.exceeded() if tp.is_driver else None
        if size > 1:
            stop = tp.broadcast_object(stop)
        if stop:
            row.update(status="skipped", reason=budget.reason())
        else:
            lat.measure_cell(bench, group, column, cell, row, args, log)
        if size > 1:
            row = merge_ranks(tp.all_gather_object(row))
        rows.append(row)
    try:
        extra = group.stats(column)
    except Exception as exc:  # noqa: BLE001
        extra = {"stats_error": common.short_error(exc)}
    stats.append({"bench": key, "column": column, **extra})
    del group
    return rows


def merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's row, with the other ranks' p50 beside it and their failures in it."""
    row = dict(per_rank[0])
    for r, other in enumerate(per_rank[1:], start=1):
        if other.get("p50_us") is not None:
            row[f"rank{r}_p50_us"] = other["p50_us"]
        if other["status"] != "ok" and row["status"] == "ok":
            row.update(status=other["status"], reason=f"rank {r}: {other['reason']}")
    return row


# ----------------------------------------------------------------------------------------------
# Report (CPU-only: tested in tests/test_benchmarks_cpu.py)


def merge_payloads(payloads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report from several runs: every run's rows, each tagged with its run (``row["run"]``, an
    index into ``runs``, each run's environment; a merged report merges as its runs), so that a
    ratio pairs rows of one run (``pair``); the table shows ``shown``'s row per cell. Checks and
    stats of every run; the config of the first."""
    if not payloads:
        raise ValueError("nothing to merge")
    for i, pl in enumerate(payloads):
        if pl.get("benchmark") != "latency_tp":
            raise ValueError(f"input {i} is not a latency_tp result (benchmark={pl.get('benchmark')!r})")
    rows, runs = common.tag_runs(payloads, "env")
    merged = {**payloads[0], "rows": rows, "runs": runs,
              "checks": [c for pl in payloads for c in pl.get("checks", [])],
              "stats": [st for pl in payloads for st in pl.get("stats", [])],
              "layers": {k: v for pl in payloads for k, v in pl.get("layers", {}).items()}}
    return merged


def shown(rows: Sequence[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(bench, column, batch) -> the row shown (``common.latest_rows``)."""
    return common.latest_rows(rows, lambda r: (r["bench"], r["column"], r["batch"]))


def _p50(rows, key, column, batch):
    """The p50 the table shows (``shown``), None where that row is not ok."""
    r = shown(rows).get((key, column, batch))
    return r["p50_us"] if r is not None and r["status"] == "ok" else None


def pair(rows: Sequence[dict[str, Any]], one_key: str, two_key: str, column: str,
         batch: int) -> tuple[float, float, bool] | None:
    """(TP=1 p50, TP=2 p50, same run) for a ratio, picked by ``common.run_pair``: the latest run
    that measured both; where no run did, each bench's latest row, ``same run`` False. None where
    either was never measured."""
    cell = [r for r in rows if r["column"] == column and r["batch"] == batch]
    pr = common.run_pair(cell, {k: (lambda r, k=k: r["bench"] == k) for k in (one_key, two_key)})
    if pr is None:
        return None
    picked, same_run = pr
    return picked[one_key]["p50_us"], picked[two_key]["p50_us"], same_run


def render_markdown(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    chosen = shown(rows)
    cfg = payload.get("config", {})
    out = ["# Decode-step latency under tensor parallelism (µs per step, rank 0, p50 / p90 / p99)", ""]
    if cfg.get("cpu_smoke"):
        out += ["**CPU smoke run** (tiny shapes, gloo, simulated CUDA graphs): it checks the script, its "
                "numbers measure nothing.", ""]
    runs = payload.get("runs") or [payload.get("env") or {}]
    for i, env in enumerate(runs):
        out.append((f"Run {i}:\n" if len(runs) > 1 else "") + common.environment_markdown(env or {}))
    out.append(f"- NCCL {payload.get('nccl', '?')}; ranks {payload.get('world_size', '?')}; attention backend "
               f"{cfg.get('backend', '?')}; context {cfg.get('context')}; {cfg.get('steps')} steps after "
               f"{cfg.get('warmup')} warm-up; every column checked against the same model's eager output first.")
    out.append("")
    benches = [b for b, _, _ in BENCHES if any(r["bench"] == b for r in rows)]
    batches = sorted({r["batch"] for r in rows})
    for key in benches:
        layers = payload.get("layers", {})
        layers = layers.get(key) or layers.get(NCCL_ONLY.get(key, key), "?")
        tp_size = next(s for b, _, s in BENCHES if b == key)
        suffix = ", every all-reduce on NCCL" if key in NCCL_ONLY else ""
        out += [f"## {LABELS[key.split('-')[0]]}, {layers} layers, TP={tp_size}{suffix}", ""]
        cols = [c for c in COLUMNS if any(r["bench"] == key and r["column"] == c for r in rows)]
        table = []
        for b in batches:
            line = [b]
            for c in cols:
                r = chosen.get((key, c, b))
                line.append(report.cell_text(r) + (f" (rank 1 p50 {r['rank1_p50_us']:.0f})"
                                                 if r and r.get("rank1_p50_us") is not None else ""))
            table.append(line)
        out += [common.markdown_table(["batch"] + cols, table), ""]
    for two_key, what in (("llama8b-tp2", ""), ("llama8b-tp2-nccl", ", every all-reduce on NCCL")):
        if not (any(r["bench"] == "llama8b-tp1" for r in rows) and any(r["bench"] == two_key for r in rows)):
            continue
        out += [f"## TP=2 ÷ TP=1, Llama-3-8B shape (p50){what}", ""]
        if len(runs) > 1:
            out += ["Each ratio divides two p50s of one run; * after one: no run measured both, so it divides "
                    "two runs' figures (not counted in the goal).", ""]
        table = []
        for b in batches:
            line = [b]
            for c in COLUMNS:
                pr = pair(rows, "llama8b-tp1", two_key, c, b)
                line.append("—" if pr is None else common.fmt_num(pr[1] / pr[0], 2) + ("" if pr[2] else "*"))
            table.append(line)
        out += [common.markdown_table(["batch"] + COLUMNS, table), ""]
    out += ["## Goal check (issue 14)", ""]
    out += goal_lines(rows)
    checks = payload.get("checks", [])
    if checks:
        out += ["", "## TP=2 vs TP=1 (eager, same weights and cache contents, norm-relative)", ""]
        out.append(common.markdown_table(["check", "batch", "rel. error", "tolerance", "ok"],
                                         [[c["check"], c["batch"], f"{c['rel_err']:.3g}", c["tolerance"],
                                           "yes" if c["ok"] else "**NO**"] for c in checks]))
    problems = sorted({(r["bench"], r["column"], r["status"], r["reason"]) for r in chosen.values()
                       if r["status"] not in ("ok",) and r.get("reason")})  # what the table shows
    if problems:
        out += ["", "## Notes", ""]
        out += [f"- {b} {c} — {s}: {why}" for b, c, s, why in problems]
    return "\n".join(out) + "\n"


def goal_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Issue 14's goal per column, TP=2 ÷ TP=1 at batch 1 within one run (``pair``): a ratio only
    across runs is shown but neither MET nor NOT MET."""
    lines = []
    for c in COLUMNS:
        pr = pair(rows, "llama8b-tp1", "llama8b-tp2", c, 1)
        if pr is None:
            lines.append(f"- {c}: not checked (a batch-1 cell of the 8B shape is missing at TP=1 or TP=2).")
            continue
        one, two, same_run = pr
        ratio = two / one
        verdict = ("MET" if ratio <= GOAL_RATIO else "NOT MET") if same_run else "not checked (measured in different runs)"
        lines.append(f"- {c}: TP=2 {two:.0f} µs / TP=1 {one:.0f} µs = {ratio:.2f}×{'' if same_run else '*'} at batch 1 — "
                     f"{verdict} (goal ≤ {GOAL_RATIO}×).")
    return lines


def plot(payload: dict[str, Any]):
    rows = payload["rows"]

    def draw(plt):
        keys = [b for b, _, _ in BENCHES if any(r["bench"] == b for r in rows)]
        batches = sorted({r["batch"] for r in rows})
        fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(5.5 * max(1, len(keys)), 4.2), squeeze=False)
        for ax, key in zip(axes[0], keys):
            width = 0.8 / len(COLUMNS)
            for j, c in enumerate(COLUMNS):
                xs, ys = [], []
                for i, b in enumerate(batches):
                    v = _p50(rows, key, c, b)
                    if v:
                        xs.append(i + (j - (len(COLUMNS) - 1) / 2) * width)
                        ys.append(v)
                ax.bar(xs, ys, width, label=c)
            ax.set_xticks(range(len(batches)))
            ax.set_xticklabels([f"b{b}" for b in batches])
            ax.set_ylabel("µs per decode step (p50)")
            ax.set_title(key)
            ax.grid(alpha=0.3, axis="y")
        axes[0][0].legend(fontsize=7)
        return fig

    return draw


def write_outputs(payload: dict[str, Any], prefix: str, no_plot: bool, log) -> str:
    return common.write_outputs(payload, prefix, no_plot, log, render_markdown(payload), plot(payload), "latency_tp")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        merged = merge_payloads([common.read_json(p) for p in args.merge])
        print(write_outputs(merged, args.output or args.out, args.no_plot, print), flush=True)
        return 0
    if not args.cpu_smoke:
        missing = common.cuda_missing_message("latency_tp.py")
        if missing:
            print(missing, flush=True)
            return 0
    common.ensure_repo_on_path()
    import torch

    from compileattn.parallel import init_tp, shutdown_tp
    from compileattn.parallel.logs import hang_guard, setup_rank_logging

    setup_rank_logging(args.log_dir, int(os.environ.get("RANK", "0")))
    log = RankLog()
    if args.cpu_smoke:
        lat.DEVICE = "cpu"
        lat.replay_gpu_us = lambda graph, replays=20: None  # no CUDA events to time simulated graphs with
    tp = init_tp(device="cpu" if args.cpu_smoke else "cuda")
    payload = {"benchmark": "latency_tp", "world_size": tp.world_size,
               "nccl": ".".join(map(str, torch.cuda.nccl.version())) if tp.device.type == "cuda" else None,
               "config": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir", "hang_timeout_s")},
               "env": common.environment(tp_env={k: v for k, v in sorted(os.environ.items())
                                                 if k.startswith(("NCCL_", "TORCH_NCCL_", "TORCH_SYMM", "NVSHMEM"))}),
               "rows": [], "checks": [], "stats": []}
    log(f"rank {tp.rank} of {tp.world_size} on {tp.device}; {payload['env'].get('versions')}")

    def checkpoint() -> None:
        write_outputs(payload, args.out, True, lambda _m: None)

    # A hang past this point ends the process with every thread's traceback in the rank log
    # before the caller's own timeout would kill it silently.
    hang_guard(args.hang_timeout_s, "benchmark")
    try:
        run(args, tp, log, payload, checkpoint)
    except Exception as exc:  # noqa: BLE001
        log(f"benchmark failed: {common.short_error(exc)}\n{traceback.format_exc(limit=8)}")
        payload["error"] = common.short_error(exc)
    hang_guard(None)
    if tp.is_driver:
        log(write_outputs(payload, args.out, args.no_plot, log))
    finished = shutdown_tp(timeout_s=30)
    if not finished:
        os._exit(0)  # results are written; do not wait on a stuck NCCL teardown
    return 1 if "error" in payload else 0


if __name__ == "__main__":
    sys.exit(main())
