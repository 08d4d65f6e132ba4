#!/usr/bin/env python
"""Host cost of one ``@compileattn.compile`` call with a backend that does nothing (CPU).

What a decorated model call costs besides the model's kernels: ``nn.Module.__call__``, the
decorator's argument check and Dynamo's generated code (which gathers every parameter as a graph
input, ~9 per Llama layer). The backend returns the outputs it computed at compile time, so
nothing else is timed. A Llama-shaped tiny model (``--layers``, default 32: the 8B shape's
parameter count per step) runs one 8-token decode step per call.

    python benchmarks/dispatch_overhead.py                       # this checkout: one JSON line
    python benchmarks/dispatch_overhead.py --compare A B -o OUT  # two checkouts (dirs on PYTHONPATH),
                                                                  # alternating processes; OUT.json/.md

Rows (median of ``--repeats`` rounds of ``--calls`` calls, µs per call): ``module call`` (what a
serving loop pays), ``argument check`` and ``generated code`` (the decorator's two parts, called
directly). Numbers on a shared 2-core box move by tens of percent between runs; compare
alternating runs, never one run against an old number.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
ROWS = ("module call", "argument check", "generated code")


def measure(layers: int, calls: int, repeats: int) -> dict:
    import torch

    import compileattn as ca
    from compileattn.models.llama import LlamaConfig, LlamaForCausalLM

    try:  # the base class aot_compile accepts; a plain callable elsewhere
        from torch._dynamo.aot_compile_types import SerializableCallable as Base
    except ImportError:
        Base = object

    class Noop(Base):
        """Runs the graph once (the first call's outputs), then returns those outputs."""

        def __init__(self, gm):
            self.gm, self.outputs = gm, None

        def __call__(self, *args):
            if self.outputs is None:
                self.outputs = self.gm(*args)
            return self.outputs

        @classmethod
        def serialize_compile_artifacts(cls, fn):
            raise NotImplementedError

        @classmethod
        def deserialize_compile_artifacts(cls, data):
            raise NotImplementedError

    def noop_backend(gm, example_inputs):
        return Noop(gm)

    cls = ca.compile(type("Timed", (LlamaForCausalLM,), {}), dynamic_arg_dims={"input_ids": 0, "positions": 0},
                     backend=noop_backend)
    model = cls(LlamaConfig.tiny(num_layers=layers), seed=0)
    caches = ca.allocate_kv_caches(model.attention_specs(), 64, 16, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=16, num_blocks=64, max_num_tokens=8, max_blocks_per_seq=2)
    md = builder.build([ca.SequenceStep(1, 16, [2 * i, 2 * i + 1]) for i in range(8)])
    ids, pos = torch.zeros(8, dtype=torch.long), torch.full((8,), 16, dtype=torch.long)
    with torch.no_grad(), ca.set_forward_context(md, caches):
        start = time.perf_counter()
        model(ids, pos)
        compile_s = time.perf_counter() - start
        last = type(model).forward._last
        site = last[1] if isinstance(last, tuple) else last._site  # the checkout before warm start kept a tuple
        fns = {"module call": lambda: model(ids, pos),
               "argument check": lambda: site.checker.check((ids, pos), {}),
               "generated code": lambda: site.fast(model, ids, pos)}
        rounds = {name: [] for name in ROWS}
        for _ in range(repeats):
            for name in ROWS:  # interleaved, so drift hits every row alike
                fn = fns[name]
                fn()
                t = time.perf_counter()
                for _ in range(calls):
                    fn()
                rounds[name].append((time.perf_counter() - t) / calls * 1e6)
    return {"torch": torch.__version__, "compileattn": str(Path(ca.__file__).parent), "layers": layers,
            "compile_s": round(compile_s, 2),
            **{name: round(statistics.median(v), 2) for name, v in rounds.items()}}


def compare(dirs: list[str], args) -> dict:
    results = {d: [] for d in dirs}
    for _ in range(args.processes):
        for d in dirs:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([d, os.environ.get("PYTHONPATH", "")]))
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--layers", str(args.layers),
                                   "--calls", str(args.calls), "--repeats", str(args.repeats)],
                                  capture_output=True, text=True, env=env, timeout=900)
            if proc.returncode != 0:
                raise SystemExit(f"{d}: {proc.stderr[-2000:]}")
            results[d].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(d, results[d][-1], flush=True)
    summary = {d: {name: round(statistics.median(r[name] for r in runs), 2) for name in ROWS}
               for d, runs in results.items()}
    return {"dirs": dirs, "runs": results, "median_us": summary}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--compare", nargs=2, metavar="DIR", help="two checkouts to compare (alternating processes)")
    p.add_argument("--processes", type=int, default=3, help="processes per checkout with --compare")
    p.add_argument("-o", "--out", default=None, help="with --compare: write OUT.json and OUT.md")
    args = p.parse_args(argv)
    if not args.compare:
        print(json.dumps(measure(args.layers, args.calls, args.repeats)), flush=True)
        return 0
    sys.path.insert(0, str(_HERE))
    import common

    payload = compare(args.compare, args)
    rows = [[name, *(common.fmt_num(payload["median_us"][d][name], 1) for d in args.compare)] for name in ROWS]
    md = common.markdown_table(["µs per call (median)", *args.compare], rows)
    print(md)
    if args.out:
        common.write_json(args.out + ".json", {**payload, "env": common.environment()})
        common.write_text(args.out + ".md", f"# Decorated-call host cost, no-op backend, {args.layers} layers\n\n{md}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
