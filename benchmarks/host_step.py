#!/usr/bin/env python
"""Host µs of one ``@compileattn.compile`` full-decode step, against a bare replay of its graph.

Issue 12's row: "a full-decode step's host time ≤ 15 µs above a bare replay of a hand-captured
graph". A step here is what ``latency.py``'s ``ca-full`` column times: ``fn(ids, pos)`` for
``fn = compileattn.compile(forward)`` with ``cudagraph_mode="full_and_piecewise"``, inside the
step's forward context (built once, outside the timed region), an OPT-125m-shaped model (148
parameter tensors, all gathered by Dynamo's code). Two compiles of the same model run side by
side: ``direct_full_replay=True`` (the decorator replays the graph itself, ``compilation/
replay.py``) and ``False`` (Dynamo's code and the dispatcher run every step, as before).

Host time of a call: on CUDA, ``synchronize``, then the wall time of the call alone (it returns
once the replay is launched), then ``synchronize`` again outside the timing; ``bare replay`` is
``CUDAGraph.replay()`` of the same captured graph, so "above bare" is our Python alone. On the CPU
(no GPU: OPT-125m's layer and parameter count at small widths, CUDA graphs simulated) a replay is
made a no-op, so every row is host Python only; CPU numbers are for comparing rows, not machines.

Rows (p50 over ``--rounds`` interleaved rounds of ``--calls`` calls; µs per call):

- ``step, direct replay``: the decorated call with the shortcut (what a serving loop pays now);
- ``step, Dynamo's code``: the decorated call without it (before);
- ``bare replay``: ``CUDAGraph.replay()`` alone;
- parts of the ordinary path: ``argument check`` (``argcheck``), ``Dynamo's code + dispatcher``
  (the generated function called directly), ``dispatcher`` (``StepDispatcher`` called with the
  graph inputs Dynamo's code gathered: checks, mode choice, wrapper, replay);
- ``shortcut`` (``FullStepShortcut.step``: its checks and the replay).

    python benchmarks/host_step.py                 # CPU or CUDA, batches 1 and 8; one table
    python benchmarks/host_step.py -o results/host_step_h200
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
import common  # noqa: E402

common.ensure_repo_on_path()

#: norm-relative error allowed against eager (``latency.py``'s)
TOLERANCE = {"float16": 5e-2, "bfloat16": 1e-1, "float32": 1e-3}

ROWS = ("step, direct replay", "step, Dynamo's code", "bare replay", "argument check", "Dynamo's code + dispatcher",
        "dispatcher", "shortcut")


def build(device: str, backend: str, piece_compiler: str, max_tokens: int, context: int):
    import torch

    import compileattn as ca
    from compileattn.models.opt import OPTConfig, OPTForCausalLM

    if device == "cuda":
        cfg, dtype = OPTConfig.opt_125m(max_position=context + 64), torch.float16
    else:  # OPT-125m's 12 layers and 148 parameter tensors, at widths a CPU runs quickly
        cfg, dtype = OPTConfig.opt_125m(hidden_size=64, num_heads=2, ffn_dim=128, vocab_size=256,
                                        max_position=context + 64), torch.float32
    model = OPTForCausalLM(cfg, dtype=dtype, device=device, seed=0)
    block = 16
    per_seq = -(-(context + 1) // block)
    num_blocks = max_tokens * per_seq + 1
    caches = ca.allocate_kv_caches(model.attention_specs(), num_blocks, block, dtype=dtype, device=device)
    builder = ca.AttentionMetadataBuilder(block_size=block, num_blocks=num_blocks, max_num_tokens=max_tokens,
                                          max_blocks_per_seq=per_seq, device=device, backend=backend)
    return model, caches, builder, block, per_seq


def measure(args, on_batch=None) -> dict:
    """Every batch of ``args.batches``; ``on_batch(results so far)`` after each one (the result
    files are written then, so a run killed at its time limit keeps the batches it finished)."""
    import torch

    import compileattn as ca
    from compileattn.testing import simulated_cuda_graphs

    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    batches = args.batches
    max_tokens = max(8, max(batches))
    sim = simulated_cuda_graphs() if device == "cpu" else None
    if sim is not None:
        sim.__enter__()
    try:
        model, caches, builder, block, per_seq = build(device, args.backend, args.piece_compiler, max_tokens,
                                                       args.context)
        ids_buf = torch.zeros(max_tokens, dtype=torch.long, device=device)
        pos_buf = torch.full((max_tokens,), args.context, dtype=torch.long, device=device)

        def forward(input_ids, positions):
            return model(input_ids, positions)

        fns = {}
        for direct in (True, False):
            config = ca.CompileConfig(cudagraph_mode="full_and_piecewise", attention_backend=args.backend,
                                      max_capture_size=max_tokens, piece_compiler=args.piece_compiler,
                                      direct_full_replay=direct, background_static_compiles=False)
            fns[direct] = ca.compile(forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=config)

        results = {"device": device, "torch": torch.__version__, "python": sys.version.split()[0],
                   "params": len(list(model.parameters())), "batches": {}}
        # The compile (first call) needs >= 2 tokens: compile on the largest batch first.
        for batch in sorted(batches, reverse=True):
            seqs = [ca.SequenceStep(1, args.context, list(range(i * per_seq, (i + 1) * per_seq)))
                    for i in range(batch)]
            n = ca.CompileConfig(max_capture_size=max_tokens).padded_num_tokens(batch)
            md = builder.build(seqs, pad_to=n)
            ids, pos = ids_buf[:n], pos_buf[:n]
            with torch.no_grad(), ca.set_forward_context(md, caches):
                outs = {}
                # compile/capture, first (checked) replay, a direct one; both compiled before either
                # replays: a compile builds GraphModules, whose registrations send the other's next
                # graph step through Dynamo's code once to compare parameters (module_watch.py)
                for _ in range(3):
                    for direct, fn in fns.items():
                        outs[direct] = fn(ids, pos)
                sync()
                outs = {direct: out.clone() for direct, out in outs.items()}
                # Every run writes the same K/V into the same slots, so all three see one cache.
                expected = model(ids, pos)
                tol = TOLERANCE[str(expected.dtype).removeprefix("torch.")]
                for direct, out in outs.items():
                    err = common.rel_error(out, expected)
                    if not err <= tol:
                        raise SystemExit(f"batch {batch}, direct_full_replay={direct}: output differs from eager: "
                                         f"rel. error {err:.3g} > {tol}")
                before = ca.counters.full_graph_direct_steps
                fns[True](ids, pos)
                fns[False](ids, pos)
                taken = ca.counters.full_graph_direct_steps - before
                if taken != 1:  # still measured: the "before" rows stand, "after" equals them
                    print(f"direct replay NOT taken ({taken}): {fns[True].compile_stats.get('direct_replay')}",
                          file=sys.stderr, flush=True)
                rt_off = fns[False].runtimes[0]
                entry = rt_off._full.graphs[n]
                site_on, site_off = fns[True]._site, fns[False]._site
                graph_args = []
                wrapper = rt_off._full
                wrapper.run = lambda size, a, fn=None: (graph_args.append(tuple(a)),
                                                        type(wrapper).run(wrapper, size, a, fn))[1]
                site_off.fast(ids, pos)
                del wrapper.run
                dargs = graph_args[0]
                if device == "cpu":  # host Python only: a simulated replay would re-run the model
                    for fn in fns.values():
                        fn.runtimes[0]._full.graphs[n].graph.replay = lambda: None
                rows = {
                    "step, direct replay": lambda: fns[True](ids, pos),
                    "step, Dynamo's code": lambda: fns[False](ids, pos),
                    "bare replay": entry.graph.replay,
                    "argument check": lambda: site_off.checker.check((ids, pos), {}),
                    "Dynamo's code + dispatcher": lambda: site_off.fast(ids, pos),
                    "dispatcher": lambda: rt_off(*dargs),
                    "shortcut": ((lambda: site_on.direct.step((ids, pos), {})) if site_on.direct is not None
                                 else (lambda: None)),
                }
                rounds = {name: [] for name in ROWS}
                for _ in range(args.rounds):
                    for name in ROWS:  # interleaved, so drift hits every row alike
                        f = rows[name]
                        f()
                        sync()
                        if device == "cuda":
                            total = 0.0
                            for _ in range(args.calls):
                                t = time.perf_counter()
                                f()
                                total += time.perf_counter() - t
                                sync()
                        else:
                            t = time.perf_counter()
                            for _ in range(args.calls):
                                f()
                            total = time.perf_counter() - t
                        rounds[name].append(total / args.calls * 1e6)
            med = {name: round(statistics.median(v), 2) for name, v in rounds.items()}
            results["batches"][batch] = {"tokens": n, "us": med, "direct_taken": taken == 1,
                                         "above_bare": {k: round(med[k] - med["bare replay"], 2)
                                                        for k in ("step, direct replay", "step, Dynamo's code")}}
            print(f"batch {batch}: " + ", ".join(f"{k} {v}" for k, v in med.items()), file=sys.stderr, flush=True)
            results["direct_replay"] = fns[True].compile_stats.get("direct_replay")
            if on_batch is not None:
                on_batch(results)
        return results
    finally:
        if sim is not None:
            sim.__exit__(None, None, None)


def markdown(res: dict) -> str:
    batches = sorted(res["batches"], key=int)
    rows = [[name, *(common.fmt_num(res["batches"][b]["us"][name], 2) for b in batches)] for name in ROWS]
    for k in ("step, direct replay", "step, Dynamo's code"):
        rows.append([f"{k}: above bare replay", *(common.fmt_num(res["batches"][b]["above_bare"][k], 2)
                                                  for b in batches)])
    head = [f"µs per call, p50 ({res['device']}, {res['params']} parameter tensors)",
            *(f"batch {b}" for b in batches)]
    return common.markdown_table(head, rows)


def report(res: dict, env: dict, md: str) -> str:
    return (f"# Full-decode step host time ({res['device']})\n\n{common.environment_markdown(env)}\n\n"
            f"direct replay: {res['direct_replay']}\n\n{md}\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda where available (cpu: simulated graphs, replays made no-ops)")
    p.add_argument("--batches", type=common.parse_int_list, default=[1, 8])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--backend", default="triton", help="attention backend (capturable: triton, flash)")
    p.add_argument("--piece-compiler", default=None, help="default: inductor on CUDA, eager on the CPU")
    p.add_argument("--calls", type=int, default=None, help="calls per round (default 200 CUDA, 5000 CPU)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("-o", "--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device == "cuda"
    if args.piece_compiler is None:
        args.piece_compiler = "inductor" if cuda else "eager"
    if args.calls is None:
        args.calls = 200 if cuda else 5000
    if not cuda:
        args.backend = "reference" if args.backend == "triton" else args.backend
        args.context = min(args.context, 64)
    env = common.environment() if args.out else None

    def write(res: dict) -> str:
        md = markdown(res)
        if args.out:
            common.write_json(args.out + ".json", {**res, "env": env})
            common.write_text(args.out + ".md", report(res, env, md))
        return md

    res = measure(args, on_batch=write)
    print(write(res))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
