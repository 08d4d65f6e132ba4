"""TP=N against TP=1 on the same random weights: eager, compiled, and with CUDA graphs.

Run under torchrun, one process per rank (the tests and the GPU script do)::

    torchrun --nproc-per-node 2 -m compileattn.parallel.check --model llama --modes eager,piecewise \\
        --graphs simulated --piece-compiler eager          # CPU / gloo, CUDA graphs simulated
    torchrun --nproc-per-node 2 -m compileattn.parallel.check --device cuda --dtype bfloat16 \\
        --modes eager,piecewise,full_and_piecewise --graphs real --log-dir $OUT   # 2 GPUs / NCCL

Every rank builds the unsharded model (seeded: same weights everywhere) and runs the same fixed
sequence of steps through it (TP=1, eager, and in each compiled mode), then shards a copy and
runs the sequence again in each mode. The steps mix prefills, decodes, a 1-token step and one
step larger than every capture size, so captured graphs (with their all-reduces) replay between
eagerly-run collectives. Checked per mode: each step's hidden states against TP=1 eager and TP=1
in the same mode (norm-relative), equality across ranks, and the compile counters: every
all-reduce inside a piece (2 per layer), none at a split point, one Dynamo graph, and (graph
modes) captures, replays and at least one step run without graphs.

``--modes engine`` checks the driver: rank 0 generates with ``TPEngine`` while the others
``serve()``; the tokens must equal TP=1 generation and every rank must have run the same steps.
``--model hf-llama`` checks a Hugging Face Llama sharded by its ``base_model_tp_plan``, with its
own attention, on full-sequence logits.

Each rank logs one ``TPCHECK {json}`` line (to stderr and ``--log-dir``'s ``rank{r}.log``); the exit
status is 1 if any rank found a problem.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import sys
import time
from typing import Any, Sequence

import torch

from ..testing import near_tie, recording_greedy, rel_error

MODES = ("eager", "compiled", "piecewise", "full_and_piecewise", "engine")
GRAPH_MODES = ("piecewise", "full_and_piecewise")
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32)
BLOCK, NUM_BLOCKS, MAX_TOKENS = 16, 48, 64
#: Norm-relative tolerance against TP=1, by dtype: a sharded matmul sums its partial products in
#: another order (and, in bf16, rounds each rank's partial sum before the all-reduce).
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 1e-2}

logger = logging.getLogger("compileattn")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("llama", "opt", "hf-llama"), default="llama")
    p.add_argument("--modes", default="eager,piecewise,full_and_piecewise",
                   help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(TOLERANCE), default="float32")
    p.add_argument("--graphs", choices=("simulated", "real"), default="simulated",
                   help="CUDA graphs of the graph modes: simulated (CPU) or real (GPU)")
    p.add_argument("--piece-compiler", choices=("eager", "aot_eager", "inductor"), default="eager")
    p.add_argument("--backend", default="auto", help="attention backend")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--tolerance", type=float, default=None)
    p.add_argument("--timeout-s", type=float, default=300.0, help="process-group timeout")
    p.add_argument("--log-dir", default=None, help="also log to DIR/rank{r}.log")
    p.add_argument("--hang-timeout-s", type=float, default=None,
                   help="exit with every thread's traceback in the rank log after this long")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes:  # no mode run would still report PASS
        p.error(f"--modes names no mode; choose from {MODES}")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {MODES}")
    if args.graphs == "real" and args.device != "cuda":
        p.error("--graphs real needs --device cuda")
    if args.model == "hf-llama" and args.modes != ["eager"]:
        p.error("--model hf-llama runs with its own attention: --modes eager only")
    args.tol = args.tolerance if args.tolerance is not None else TOLERANCE[args.dtype]
    return args


# -- models and steps ----------------------------------------------------------------------------


def build_model(args, device: torch.device) -> torch.nn.Module:
    dtype = getattr(torch, args.dtype)
    if args.model == "llama":
        from ..models.llama import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=512, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                          num_kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate_size=2 * args.hidden)
        return LlamaForCausalLM(cfg, dtype=dtype, device=device, seed=0)
    from ..models.opt import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=512, hidden_size=args.heads * args.head_dim, num_layers=args.layers,
                    num_heads=args.heads, ffn_dim=4 * args.heads * args.head_dim)
    return OPTForCausalLM(cfg, dtype=dtype, device=device, seed=0)


def make_steps(vocab: int) -> list[tuple[list, list[int], list[int]]]:
    """A fixed step sequence (the same on every rank): prefills, decodes, a 1-token decode, a step
    above the largest capture size, a chunked prefill. Sequence i owns blocks [8i, 8i + 8)."""
    from ..metadata import SequenceStep

    rng = random.Random(1234)
    done = [0, 0, 0, 0]
    plan = [[(0, 12), (1, 7)], [(0, 1), (1, 1)], [(0, 1)], [(0, 1), (1, 1), (2, 40)],
            [(0, 1), (1, 1), (2, 1)], [(0, 1), (3, 9)], [(0, 1), (1, 1), (2, 1), (3, 1)], [(3, 5), (1, 1)]]
    steps = []
    for step in plan:
        step = sorted(step, key=lambda s: s[1] != 1)  # decodes first, as the metadata builder wants
        seqs, ids, pos = [], [], []
        for seq, q in step:
            ctx = done[seq]
            seqs.append(SequenceStep(q, ctx, list(range(8 * seq, 8 * seq + 8))))
            ids += [rng.randrange(vocab) for _ in range(q)]
            pos += list(range(ctx, ctx + q))
            done[seq] += q
        steps.append((seqs, ids, pos))
    return steps


def engine_for(model, args, forward=None, config=None, cls=None, **kw):
    from ..engine import Engine

    return (cls or Engine)(model, block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_TOKENS,
                           max_num_seqs=8, forward=forward, compile_config=config, attention_backend=args.backend,
                           mark_dynamic=False, **kw)


def compiled_forward(model, mode: str, args):
    """(forward, RecordingBackend, CompileConfig) for a compiled mode."""
    import compileattn as ca
    from compileattn.testing import RecordingBackend

    cfg = ca.CompileConfig(cudagraph_mode=mode if mode in GRAPH_MODES else "none", piece_compiler=args.piece_compiler,
                           attention_backend=args.backend, cudagraph_capture_sizes=CAPTURE_SIZES)
    rec = RecordingBackend(config=cfg)

    def forward(input_ids, positions):
        return model(input_ids, positions)

    return ca.compile(forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=cfg, backend=rec), rec, cfg


def graphs_context(args, mode: str):
    import contextlib

    from compileattn.testing import simulated_cuda_graphs

    if mode in GRAPH_MODES and args.graphs == "simulated":
        return simulated_cuda_graphs()
    return contextlib.nullcontext()


def run_mode(model, mode: str, args, steps) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Hidden states of every step (fp32 copies on the CPU) and what the run counted."""
    from compileattn import counters

    torch.compiler.reset()
    before = counters.snapshot()
    info: dict[str, Any] = {}
    with graphs_context(args, mode):
        if mode == "eager":
            engine, rec = engine_for(model, args), None
        else:
            fn, rec, cfg = compiled_forward(model, mode, args)
            engine = engine_for(model, args, forward=fn, config=cfg)
        outs = []
        for seqs, ids, pos in steps:
            outs.append(engine.run_step(seqs, ids, pos).float().cpu().clone())
    after = counters.snapshot()
    info.update({k: after[k] - before[k] for k in after})
    if rec is not None and rec.built:
        info["full_graphs"] = sum(rt.full_graph_count() for rt in rec.built)
        info["piece_graphs"] = sum(rt.piece_graph_count() for rt in rec.built)
    return outs, info


# -- checks --------------------------------------------------------------------------------------


def check_counts(mode: str, info: dict[str, Any], layers: int, sharded: bool) -> list[str]:
    problems = []
    if mode == "eager":
        return problems
    if info["dynamo_graphs"] != 1:
        problems.append(f"{info['dynamo_graphs']} Dynamo graphs, expected 1 (a recompile)")
    expected = 2 * layers if sharded else 0
    if info["collectives_in_pieces"] != expected:
        problems.append(f"{info['collectives_in_pieces']} all-reduces inside pieces, expected {expected}")
    if info["collectives_at_splits"]:
        problems.append(f"{info['collectives_at_splits']} all-reduces at split points, expected 0")
    if mode in GRAPH_MODES:
        if not info["cudagraph_captures"] or not info["cudagraph_replays"]:
            problems.append(f"graph mode without graphs: {info['cudagraph_captures']} captures, "
                            f"{info['cudagraph_replays']} replays")
        if not info["eager_steps"]:
            problems.append("no step ran without graphs (the >32-token step should)")
        if mode == "full_and_piecewise" and not info.get("full_graphs"):
            problems.append("full_and_piecewise captured no full graph")
    return problems


def check_model(tp, args) -> dict[str, Any]:
    from .shard import shard_model

    steps = make_steps(512)
    full = build_model(args, tp.device)
    t = time.perf_counter()
    reference, _ = run_mode(full, "eager", args, steps)
    logger.info("TP=1 eager reference: %d steps in %.1f s", len(steps), time.perf_counter() - t)
    sharded = shard_model(copy.deepcopy(full), tp=tp)
    specs = {name: (s.num_heads, s.num_kv_heads) for name, s in sharded.attention_specs().items()}
    logger.info("sharded for rank %d of %d: local (heads, kv heads) %s", tp.rank, tp.world_size,
                sorted(set(specs.values())))
    results: dict[str, Any] = {"model": args.model, "local_heads": sorted(set(specs.values())), "modes": {}}
    for mode in args.modes:
        t = time.perf_counter()
        if mode == "engine":
            res = check_engine(tp, args, full, sharded)
        else:
            res = check_mode(tp, args, mode, full, sharded, steps, reference)
        res["seconds"] = round(time.perf_counter() - t, 2)
        results["modes"][mode] = res
        logger.info("%s: %s", mode, "ok" if not res["problems"] else "; ".join(res["problems"]))
    return results


def check_mode(tp, args, mode: str, full, sharded, steps, reference) -> dict[str, Any]:
    problems: list[str] = []
    same_mode_ref, ref_info = (reference, {}) if mode == "eager" else run_mode(full, mode, args, steps)
    problems += [f"TP=1 {p}" for p in check_counts(mode, ref_info, args.layers, sharded=False)] if ref_info else []
    outs, info = run_mode(sharded, mode, args, steps)
    problems += check_counts(mode, info, args.layers, sharded=True)
    err_eager = max(rel_error(o, r) for o, r in zip(outs, reference))
    err_same = max(rel_error(o, r) for o, r in zip(outs, same_mode_ref))
    if not err_eager <= args.tol:
        problems.append(f"differs from TP=1 eager: rel. error {err_eager:.3g} > {args.tol}")
    if not err_same <= args.tol:
        problems.append(f"differs from TP=1 {mode}: rel. error {err_same:.3g} > {args.tol}")
    everyone = tp.all_gather_object(outs)
    cross = max(float((o - other).abs().max()) for peer in everyone for o, other in zip(outs, peer))
    if not cross <= args.tol:
        problems.append(f"ranks disagree by up to {cross:.3g}")
    return {"rel_err_vs_tp1_eager": err_eager, "rel_err_vs_tp1_same_mode": err_same, "cross_rank_max_abs": cross,
            "counters": info, "problems": problems}


def _divergences(got, expected, got_logits, want_logits, dtype) -> list[str]:
    """Token differences between TP=N and TP=1 generation that are not near-ties
    (``testing.near_tie``, the TP=1 run as the reference). In fp32 any difference counts; in half
    precision the two runs' logits differ by reduction order, and what follows a near-tie is not
    compared."""
    problems = []
    for i, (a, b) in enumerate(zip(got, expected)):
        if a == b:
            continue
        j = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
        tie, margin = near_tie(want_logits[i][j], got_logits[i][j], b[j], a[j])
        if dtype == torch.float32 or not tie:
            problems.append(f"prompt {i}: token {j} is {a[j]} at TP, {b[j]} at TP=1 (TP=1 margin {margin:.3g})")
    return problems


def _by_sequence(record: dict[int, list[torch.Tensor]], num: int) -> list[list[torch.Tensor]]:
    return [record[k] for k in sorted(record)][:num]


def check_engine(tp, args, full, sharded) -> dict[str, Any]:
    """Rank 0 generates through TPEngine (piecewise graphs when the run has graphs), the others
    serve; tokens must equal TP=1 generation (up to near-ties of the logits in half precision)
    and every rank must have run the same steps."""
    from .driver import TPEngine

    rng = random.Random(7)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 9, 14)]
    want_record: dict = {}
    expected = engine_for(full, args).generate(prompts, max_new_tokens=4, max_tokens_per_step=16,
                                               sampler=recording_greedy(want_record))
    mode = "piecewise" if args.graphs == "real" or args.device == "cpu" else "eager"
    torch.compiler.reset()
    problems: list[str] = []
    with graphs_context(args, mode):
        fn, rec, cfg = compiled_forward(sharded, mode, args)
        engine = engine_for(sharded, args, forward=fn, config=cfg, cls=TPEngine, tp=tp, record_steps=True)
        if tp.is_driver:
            got_record: dict = {}
            got = engine.generate(prompts, max_new_tokens=4, max_tokens_per_step=16,
                                  sampler=recording_greedy(got_record))
            engine.stop_workers()
            problems += _divergences(got, expected, _by_sequence(got_record, len(prompts)),
                                     _by_sequence(want_record, len(prompts)), next(full.parameters()).dtype)
        else:
            engine.serve()
    runs = tp.all_gather_object([(len(p.input_ids), p.padded, p.input_ids) for p in engine.steps_run])
    if any(r != runs[0] for r in runs):
        problems.append(f"ranks ran different steps: {[len(r) for r in runs]} steps")
    if not runs[0]:
        problems.append("no steps ran")
    return {"steps": len(runs[0]), "padded_sizes": sorted({r[1] for r in runs[0]}), "graph_mode": mode,
            "problems": problems}


def check_hf(tp, args) -> dict[str, Any]:
    """A transformers Llama, sharded by its config's base_model_tp_plan, own (sdpa) attention."""
    import transformers

    from .shard import shard_model

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                                   max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    full = transformers.LlamaForCausalLM(cfg).to(device=tp.device, dtype=getattr(torch, args.dtype)).eval()
    sharded = shard_model(copy.deepcopy(full), tp=tp)
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(3)).to(tp.device)
    with torch.no_grad():
        ref = full(ids).logits.float().cpu()
        got = sharded(ids).logits.float().cpu()
    err = rel_error(got, ref)
    attn = sharded.model.layers[0].self_attn
    problems = [] if err <= args.tol else [f"logits differ from TP=1: rel. error {err:.3g} > {args.tol}"]
    return {"model": "hf-llama", "transformers": transformers.__version__, "modes": {"eager": {
        "rel_err_vs_tp1_eager": err, "local_q_rows": attn.q_proj.out_features, "local_kv_rows": attn.k_proj.out_features,
        "num_key_value_groups": getattr(attn, "num_key_value_groups", None), "problems": problems}}}


def main(argv: Sequence[str] | None = None) -> int:
    import datetime
    import os

    from .group import init_tp, shutdown_tp
    from .logs import hang_guard, setup_rank_logging

    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    setup_rank_logging(args.log_dir, rank)
    logger.info("check: %s", " ".join(sys.argv[1:] if argv is None else argv))
    if args.hang_timeout_s:
        hang_guard(args.hang_timeout_s, "check")
    t = time.perf_counter()
    tp = init_tp(device=args.device, timeout=datetime.timedelta(seconds=args.timeout_s))
    logger.info("TP group ready in %.1f s: rank %d of %d on %s, small all-reduces: %s", time.perf_counter() - t,
                tp.rank, tp.world_size, tp.device, tp.all_reduce)
    try:
        results = check_hf(tp, args) if args.model == "hf-llama" else check_model(tp, args)
    except Exception as exc:  # noqa: BLE001  (reported, then every rank agrees on the verdict)
        logger.exception("check failed")
        results = {"error": f"{type(exc).__name__}: {exc}"}
    problems = [p for m in results.get("modes", {}).values() for p in m["problems"]]
    if "error" in results:
        problems.append(results["error"])
    results.update(rank=tp.rank, world_size=tp.world_size, torch=torch.__version__, all_reduce=tp.all_reduce,
                   ok=not problems)
    logger.info("TPCHECK %s", json.dumps(results, default=str))
    verdicts = tp.all_gather_object(not problems)  # every rank, failed or not, so none waits alone
    hang_guard(None)
    if not shutdown_tp():
        os._exit(0 if all(verdicts) else 1)  # the verdict is logged; do not wait on a stuck NCCL teardown
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
