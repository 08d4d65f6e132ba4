#!/usr/bin/env python
"""How long Dynamo takes to trace a deep decoder with and without nested compile regions.

Dynamo's trace of ``@compileattn.compile``'s first call grows with the layer count; with each
decoder layer a ``torch.compiler.nested_compile_region`` (``compilation/regions.py``), torch 2.13
traces one layer and reuses it, torch 2.11 traces every call and only deduplicates the subgraphs.
This script measures the trace alone (from ``aot_compile``'s start to the graph reaching the
backend, which stops there) of a tiny-width compileattn Llama, per row:

- ``flat``: every layer traced, the attention op named by its layer's name (a per-layer constant);
- ``regions, layer ids``: what compileattn traces (attention layers pass a layer-id tensor);
- ``regions, layer names``: the same regions with the names as constants: a name per layer means a
  variant per layer, which shows whether torch re-checks a region for each call (2.13 keeps at
  most 8 variants and raises; 2.11 traces every call, so each gets its own subgraph).

CPU only (tracing is Python); the numbers depend on the host, not on a GPU.

    PYTHONPATH=. python benchmarks/region_trace.py --layers 32 --out benchmarks/results/region_trace_cpu
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Sequence

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402

ROWS = (("flat", False, False), ("regions, layer ids", True, True), ("regions, layer names", True, False))
#: (row, nested compile regions, attention by layer id)


class _Traced(Exception):
    """Raised by the measuring backend once Dynamo hands it the graph: nothing is compiled."""


def trace(num_layers: int, region: bool, by_id: bool) -> dict[str, Any]:
    import torch

    import contextlib

    from compileattn import _torch_compat, layer_ids
    from compileattn.compilation import regions
    from compileattn.models import llama

    seen: dict[str, Any] = {}

    def backend(gm, example_inputs):
        seen["gm"], seen["at"] = gm, time.perf_counter()
        raise _Traced

    model = llama.LlamaForCausalLM(llama.LlamaConfig.tiny(num_layers=num_layers))
    ids, pos = torch.zeros(8, dtype=torch.long), torch.arange(8)
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    # torch's region whatever compileattn would use on this torch (the point is to measure it)
    patch = regions.patched([llama.LlamaDecoderLayer], torch.compiler.nested_compile_region) if region else \
        contextlib.nullcontext()
    with patch:
        if not by_id:
            layer_ids.tracing_regions = False  # restored by the patch
        start = time.perf_counter()
        try:
            _torch_compat.aot_compile(llama.LlamaForCausalLM.forward, (model, ids, pos), {}, backend)
        except Exception as exc:  # noqa: BLE001
            if "gm" not in seen:
                return {"status": "error", "reason": common.short_error(exc)}
    gm = seen["gm"]
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is invoke_subgraph]
    return {"status": "ok", "trace_s": seen["at"] - start, "region_calls": len(calls),
            "subgraphs": len({n.args[0].target for n in calls}), "top_nodes": len(gm.graph.nodes)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="32", type=common.argparse_type(common.parse_int_list))
    p.add_argument("--out", default=str(common.RESULTS_DIR / "region_trace_cpu"))
    return p.parse_args(argv)


def render(payload: dict[str, Any]) -> str:
    lines = ["# Dynamo's trace with and without nested compile regions", "",
             common.environment_markdown(payload["env"]), "",
             "Seconds from `aot_compile`'s start to the graph reaching the backend, one trace per row in one "
             "process after a warm-up trace, a tiny-width compileattn Llama (`benchmarks/region_trace.py`).", ""]
    table = []
    for r in payload["rows"]:
        if r["status"] != "ok":
            table.append([r["layers"], r["row"], common.status_text(r["status"]), r["reason"][:160], "", "", ""])
        else:
            table.append([r["layers"], r["row"], "ok", common.fmt_num(r["trace_s"], 2), r["region_calls"],
                          r["subgraphs"], r["top_nodes"]])
    lines.append(common.markdown_table(["layers", "row", "status", "trace s", "region calls", "subgraphs",
                                        "top-level nodes"], table))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    trace(2, False, False)  # warm-up: the first trace in a process also pays Dynamo's lazy imports
    rows = [{"layers": n, "row": name, **trace(n, region, by_id)} for n in args.layers for name, region, by_id in ROWS]
    payload = {"benchmark": "region_trace", "env": common.environment(), "rows": rows}
    paths = common.output_paths(args.out)
    common.write_json(paths["json"], payload)
    common.write_text(paths["md"], render(payload))
    print(render(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
