#!/usr/bin/env python
"""All-reduce algorithms inside CUDA graphs, per message size: NCCL, one-shot and two-shot over
symmetric memory (compileattn/parallel/comm.py), side by side in one run.

Run under torchrun, one process per GPU (on nvidia-h200-x2)::

    timeout 120 torchrun --nproc-per-node 2 benchmarks/allreduce_tp.py --out $OUT/allreduce_tp --log-dir $OUT

For each size (rows of ``--hidden`` bf16 values: a decode step's hidden state has one row per
sequence) and algorithm, ``--chain`` dependent all-reduces (each followed by a multiply, as a
layer's matmul would follow it) are captured in one CUDA graph; the graph is replayed
``--replays`` times back to back and the GPU time per all-reduce is reported, the multiply's own
time (a graph of the same multiplies alone, at the same size) subtracted. Before timing, each algorithm's eager result is
checked against the sum computed from every rank's seeded input, and the graph's against eager.
The thresholds in comm.py (``ONE_SHOT_MAX_BYTES``, ``TWO_SHOT_MAX_BYTES``) come from this table.
An algorithm a size cannot take (two-shot needs 16-byte parts per rank) is reported as skipped.
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

ALGORITHMS = ("nccl", "one-shot", "two-shot")
DEFAULT_OUT = common.RESULTS_DIR / "allreduce_tp"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ints = common.argparse_type(common.parse_int_list)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=ints, default=[1, 8, 64, 128, 256, 512, 1024])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--chain", type=int, default=64, help="all-reduces per graph (a Llama-3-8B step has 64)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--log-dir", default=None)
    p.add_argument("--hang-timeout-s", type=float, default=100.0)
    return p.parse_args(argv)


def graph_us_per_call(fn: Callable[[Any], Any], x, chain: int, replays: int, tp) -> tuple[float, Any]:
    """GPU µs per call of ``fn`` in a graph of ``chain`` dependent calls; and the graph's output."""
    import torch

    from compileattn.compilation.cudagraph import GraphPool

    def body(inp):
        y = inp
        for _ in range(chain):
            y = fn(y) * 0.5
        return y

    captured = GraphPool(tp.device).capture(body, (x,), "allreduce_tp", x.shape[0])
    tp.barrier()
    for _ in range(3):
        captured.graph.replay()
    torch.cuda.synchronize()
    tp.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        captured.graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / chain, captured.outputs


def _stage(what: Callable[[], Any], log) -> tuple[Any, str | None]:
    try:
        return what(), None
    except Exception as exc:  # noqa: BLE001  (one algorithm failing must not cost the table)
        log("".join(traceback.format_exc(limit=6)))
        return None, common.short_error(exc)


def measure_one(fn, x, expected, mul_us: float, args, tp, log) -> dict[str, Any]:
    """One algorithm at one size: the eager result and an eager chain, then (only if every rank
    got that far: the graph's all-reduces wait for their peers) the graph, timed and compared."""
    import torch

    def eager():
        err = common.rel_error(fn(x).float(), expected)
        chain = x
        for _ in range(args.chain):
            chain = fn(chain) * 0.5
        torch.cuda.synchronize()
        return err, chain

    done, why = _stage(eager, log)
    failed = [r for r, reason in enumerate(tp.all_gather_object(why)) if reason]
    if failed:
        return {"status": "error", "reason": why or f"rank(s) {failed} failed the eager stage"}
    err, chain = done
    timed, why = _stage(lambda: graph_us_per_call(fn, x.clone(), args.chain, args.replays, tp), log)
    if why:
        return {"status": "error", "reason": why}
    us, graph_out = timed
    graph_err = common.rel_error(graph_out.float(), chain.float())
    ok = err <= 1e-2 and graph_err <= 1e-2
    return {"status": "ok" if ok else "FAILED", "us": round(us - mul_us, 2), "rel_err": err, "graph_vs_eager": graph_err}


def measure(args, tp, log) -> list[dict[str, Any]]:
    import torch

    from compileattn.parallel import comm

    sym = comm.symmetric_buffers(tp.group_name)
    if sym is None:
        raise RuntimeError("symmetric memory is not set up on this group (the log of init_tp says why)")

    def nccl(x):
        out = torch.ops._c10d_functional.all_reduce(x, "sum", tp.group_name)
        return torch.ops._c10d_functional.wait_tensor(out)

    impls = {"nccl": nccl, "one-shot": sym.one_shot, "two-shot": sym.two_shot}
    rows = []
    for n in args.rows:
        nbytes = n * args.hidden * 2
        row: dict[str, Any] = {"rows": n, "bytes": nbytes, "chosen": None}

        def seeded(rank: int):
            gen = torch.Generator(device=tp.device).manual_seed(1000 + rank)
            return torch.randn(n, args.hidden, dtype=torch.bfloat16, device=tp.device, generator=gen)

        x = seeded(tp.rank)
        expected = sum(seeded(r).float() for r in range(tp.world_size))
        row["chosen"] = comm.algorithm(x, tp.group_name)
        mul_us, _ = graph_us_per_call(lambda y: y, x.clone(), args.chain, args.replays, tp)  # the multiplies alone
        for name, fn in impls.items():
            if nbytes > comm.TWO_SHOT_MAX_BYTES and name != "nccl":
                row[name] = {"status": "skipped", "reason": "larger than the symmetric buffer"}
                continue
            if name == "two-shot" and nbytes % (16 * tp.world_size):
                row[name] = {"status": "skipped", "reason": "no equal 16-byte parts per rank"}
                continue
            row[name] = measure_one(fn, x, expected, mul_us, args, tp, log)
            tp.barrier()
        log(f"{n:5d} rows ({nbytes >> 10:6d} KiB): " + "  ".join(
            f"{a} {row[a]['us']:.2f} µs" if row[a].get("status") == "ok" else f"{a} {row[a]['status']}"
            for a in ALGORITHMS) + f"  (comm.py chooses {row['chosen']})")
        rows.append(row)
    return rows


def render_markdown(payload: dict[str, Any]) -> str:
    out = ["# All-reduce inside CUDA graphs: NCCL vs symmetric memory (GPU µs per all-reduce)", "",
           common.environment_markdown(payload.get("env", {})),
           f"- ranks {payload.get('world_size')}; NCCL {payload.get('nccl')}; bf16 rows of {payload['config']['hidden']}; "
           f"{payload['config']['chain']} dependent all-reduces per graph, {payload['config']['replays']} replays; "
           "the multiply between them subtracted; each result checked against the seeded sum and the graph "
           "against eager first.", ""]
    table = []
    for r in payload["rows"]:
        cells = []
        for a in ALGORITHMS:
            c = r.get(a, {})
            cells.append(f"{c['us']:.2f}" if c.get("status") == "ok" else c.get("status", "—"))
        nccl = r.get("nccl", {}).get("us")
        timed = sorted((r[a]["us"], a) for a in ALGORITHMS if r.get(a, {}).get("status") == "ok")
        if not timed:
            cells.append("—")
        elif nccl and timed[0][1] != "nccl":
            cells.append(f"{timed[0][1]} ({common.fmt_num(timed[0][0] / nccl, 2)}× NCCL)")
        else:
            cells.append(timed[0][1])
        table.append([r["rows"], f"{r['bytes'] >> 10} KiB", *cells, r["chosen"]])
    out.append(common.markdown_table(["rows", "size", *ALGORITHMS, "fastest", "comm.py chooses"], table))
    problems = [f"- {r['rows']} rows, {a}: {r[a].get('status')}: {r[a].get('reason', '')}" for r in payload["rows"]
                for a in ALGORITHMS if r.get(a, {}).get("status") not in ("ok", "skipped")]
    if problems or payload.get("error"):
        out += ["", "## Problems", ""] + problems + ([f"- {payload['error']}"] if payload.get("error") else [])
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return common.tp_main("allreduce_tp.py", parse_args(argv), measure, render_markdown)

if __name__ == "__main__":
    sys.exit(main())
