#!/usr/bin/env python
"""Issue 12's goals in one table, gathered from the result files of one GPU session.

Each goal is checked by the script that measures it, against its own threshold (one place each):
``latency_report`` (piecewise and full-decode ÷ the best full graph, per model and decode cell),
``coldwarm`` (cold and warm start, which ``latency.py`` runs in fresh processes after a model's
columns, and ``coldwarm.py`` alone), ``decode_attention`` (page-16 decode against FlashInfer, TB/s at batch >= 64, per shape)
and ``op_overhead_report`` (the Triton op's host cost per layer). This script only reads their
JSON files and lists every goal with its verdict and the run it came from, so "every row in one
run per model" is one table to read. CPU-only and torch-free.

    python benchmarks/goals.py --latency results/latency_opt_S11-4.json results/latency_llama_S11-4.json \\
        --decode results/decode_page16_S11-2.json --op-overhead results/op_overhead_S11-3.json -o results/goals_S11

A merged result file (several runs) is listed with its last run's environment.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import coldwarm  # noqa: E402
import common  # noqa: E402
import decode_attention  # noqa: E402
import latency_report  # noqa: E402
import op_overhead_report  # noqa: E402

#: kind -> (the script's name in the table, its result file's reader, records from its payload)
SOURCES = {
    "latency": ("latency.py", common.read_json, latency_report.goal_records),
    "decode": ("decode_attention.py", common.read_json, decode_attention.shape_goal_records),
    "op_overhead": ("op_overhead.py", op_overhead_report.read_result, op_overhead_report.goal_records),
    "coldwarm": ("coldwarm.py", common.read_json, lambda payload: coldwarm.start_goal_records(payload["rows"])),
}


def gather(files: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """``files``: (kind, path) pairs. Every record keeps the file and run it came from."""
    goals, sources = [], []
    for kind, path in files:
        script, read, records = SOURCES[kind]
        payload = read(path)
        runs = payload.get("runs") or [{}]
        env = runs[-1].get("env", {})
        sources.append({"kind": kind, "file": Path(path).name, "script": script, "env": env,
                        "label": runs[-1].get("label")})
        goals += [{**g, "source": Path(path).name} for g in records(payload)]
    return {"benchmark": "goals", "goals": goals, "sources": sources}


def render(payload: dict[str, Any]) -> str:
    goals = payload["goals"]
    met = sum(g["met"] is True for g in goals)
    missed = sum(g["met"] is False for g in goals)
    out = ["# Issue 12: every goal, as measured", "",
           f"{met} met, {missed} not met, {len(goals) - met - missed} not measured, of {len(goals)} goals. Each "
           "verdict is the measuring script's own check; the README's *Behind* list gives the measured reason "
           "of each miss.", "",
           common.markdown_table(["goal", "verdict", "measured", "from"],
                                 [[g["goal"], {True: "met", False: "**not met**", None: "not measured"}[g["met"]],
                                   g["measured"], f"`{g['source']}`"] for g in goals]), "", "## Runs", ""]
    for s in payload["sources"]:
        out += [f"`{s['file']}` ({s['script']}" + (f", {s['label']}" if s.get("label") else "") + "):",
                common.environment_markdown(s["env"]), ""]
    return "\n".join(out).rstrip() + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latency", nargs="*", default=[], metavar="JSON", help="latency.py results (one per model)")
    p.add_argument("--decode", nargs="*", default=[], metavar="JSON", help="decode_attention.py results")
    p.add_argument("--op-overhead", nargs="*", default=[], metavar="JSON", help="op_overhead.py results")
    p.add_argument("--coldwarm", nargs="*", default=[], metavar="JSON",
                   help="coldwarm.py results (cold and warm start, beside latency.py's own subprocesses)")
    p.add_argument("-o", "--output", required=True, help="output prefix: writes PREFIX.json and PREFIX.md")
    args = p.parse_args(argv)
    if not (args.latency or args.decode or args.op_overhead or args.coldwarm):
        p.error("give at least one result file")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    files = ([("latency", f) for f in args.latency] + [("decode", f) for f in args.decode]
             + [("op_overhead", f) for f in args.op_overhead] + [("coldwarm", f) for f in args.coldwarm])
    payload = gather(files)
    text = render(payload)
    paths = common.output_paths(args.output)
    common.write_json(paths["json"], payload)
    common.write_text(paths["md"], text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
