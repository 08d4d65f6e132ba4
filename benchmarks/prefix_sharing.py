#!/usr/bin/env python
"""Prefix sharing: one shared-system-prompt workload served with prefix caching off and on.

Model: throughput.py's Llama-3-8B shape (GQA 32/8, head dim 128, bf16, random weights built on
the GPU; ``--layers`` shortens it). Workload: ``--num-requests`` prompts (64; 32 with ``--quick``)
that all start with one random system prompt of ``--prefix-len`` tokens (1024), then a unique
random suffix of ``--suffix-len`` tokens (32:128), each generating ``--output-len`` tokens
(64:128) to the end (``ignore_eos``), fixed seed.

One ``compileattn.LLM``, compiled as throughput.py's ``ca-full`` column (``--compile full``: full
CUDA graphs for uniform decode steps, piecewise graphs for mixed ones), serves both modes:
``Engine.set_prefix_caching`` switches between timed runs, and every run starts with an empty
prefix cache, so "on" pays for computing the system prompt once, in its first step, like a
server that has just seen it. Runs alternate off, on, off, on (``--repeats`` each, after one
warm-up per mode on another system prompt), so a budget cut leaves both modes measured.

Per mode: total wall time of ``generate`` and output tokens/s (median run), per-step wall time
p50/p90/p99 over every step of every run (the time between consecutive step completions, taken by
the engine's ``on_step_done`` hook: with steps planned ahead, a step completes when its sampled
tokens reach the host, so on a busy GPU that spacing is the step's device time; a step that
samples nothing does not wait, and its time shows up in the next), split into decode-only steps
and steps with prefill work (where a prefix hit's chunked prefill over a long cached context
lands), the slowest steps with their composition, tokens computed, and the prefix hit rate (hit
tokens / looked-up tokens of admitted requests).

Correctness before timing: ``--check-prompts`` prompts of the workload are generated greedily for
``--check-tokens`` tokens with caching off, then on (after one prompt has filled the cache, so the
others hit it), recording logits. Tokens must agree; in bf16 a divergence is allowed where it is a
near-tie (``compileattn.testing.near_tie``: a prefix hit is computed in another batch than a
full prefill, so its rounding differs), and what follows it is not compared. Any other
divergence marks "on" FAILED and it is not timed.

Run: see benchmarks/README.md. On a machine without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import statistics
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
import throughput as bench  # noqa: E402  (benchmarks/throughput.py: model, LLM, device)

MODEL = "llama8b"
MODES = ("off", "on")
COMPILE = {"full": "ca-full", "piecewise": "ca-piecewise", "eager": "ca-eager"}
#: Budget seconds one timed run needs left to be started (a --quick run is a few seconds on an H200).
RUN_RESERVE_S = 15.0
DEFAULT_OUT = common.RESULTS_DIR / "prefix_sharing"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from compileattn.cli import length_range

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=None, help="requests per run (default 64, quick 32)")
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens of the shared system prompt (default 1024)")
    p.add_argument("--suffix-len", type=length_range, default=(32, 128), help="LO:HI unique prompt tokens (32:128)")
    p.add_argument("--output-len", type=length_range, default=(64, 128), help="LO:HI output tokens (64:128)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per mode (default 3, quick 2)")
    p.add_argument("--compile", choices=list(COMPILE), default="full",
                   help="full: full + piecewise CUDA graphs (throughput.py's ca-full); piecewise; eager")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-gib", type=float, default=16.0,
                   help="KV cache, GiB (default 16: 64 requests of up to 1280 tokens need ~10 GiB without sharing)")
    p.add_argument("--layers", type=int, default=None, help="override the shape's 32 layers (debugging)")
    p.add_argument("--check-prompts", type=int, default=None, help="prompts of the on/off check (default 4, quick 2)")
    p.add_argument("--check-tokens", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="32 requests, 2 runs per mode, 2 check prompts")
    p.add_argument("--budget-s", type=float, default=230.0,
                   help="wall-clock budget; runs past it are reported as skipped (0 = none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output prefix: writes PREFIX.json/.md/.png")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="merge result files of several runs into one report (no GPU needed)")
    p.add_argument("-o", "--output", default=None, help="output prefix for --merge (default: --out)")
    args = p.parse_args(argv)
    defaults = {"num_requests": (64, 32), "repeats": (3, 2), "check_prompts": (4, 2)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name in ("num_requests", "prefix_len", "repeats", "max_num_seqs", "max_num_batched_tokens",
                 "check_prompts", "check_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.check_prompts > args.num_requests:
        p.error("--check-prompts must be <= --num-requests")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if args.kv_gib <= 0:
        p.error("--kv-gib must be > 0")
    return args


# ----------------------------------------------------------------------------------------------
# Building and measuring


def build_model(layers: int | None):
    return bench.build_model(MODEL, layers)


def build_llm(model, args):
    """throughput.py's compileattn LLM for the ``--compile`` column, caching switched per run."""
    max_model_len = args.prefix_len + args.suffix_len[1] + args.output_len[1]
    return bench.ca_llm(model, COMPILE[args.compile], args, max_model_len)


class StepTimer:
    """Completion times of an engine's steps, with what each step held (its ``on_step_done``)."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: list[tuple[float, int, int, int]] = []  # (time, tokens, decodes, with prefill)
        engine.on_step_done = self._done

    def _done(self, step) -> None:
        decodes = step.kinds.count("decode")
        self.steps.append((time.perf_counter(), step.num_tokens, decodes, len(step.kinds) - decodes))

    def close(self) -> None:
        self.engine.on_step_done = None

    def durations(self) -> list[tuple[float, int, int, int]]:
        """(seconds since the previous completion, tokens, decodes, sequences with prefill work) for
        every step after the first."""
        return [(b[0] - a[0], *b[1:]) for a, b in zip(self.steps, self.steps[1:])]


def timed_run(llm, workload, mode: str) -> dict[str, Any]:
    """One ``generate`` of the workload from an empty prefix cache, steps timed."""
    from compileattn.engine import throughput as serving

    engine = llm.engine
    engine.set_prefix_caching(mode == "on")
    before = engine.prefix_cache_stats
    queried, hits = before.queried_tokens, before.hit_tokens
    preempted = engine.num_preemptions
    timer = StepTimer(engine)
    try:
        result, _ = serving.measure(llm, workload)
    finally:
        timer.close()
    stats = engine.prefix_cache_stats
    return {"elapsed_s": result.elapsed_s, "output_tokens": result.output_tokens,
            "output_tokens_per_s": result.output_tokens_per_s, "steps": timer.durations(),
            "num_steps": len(timer.steps), "tokens_computed": sum(s[1] for s in timer.steps),
            "queried_tokens": stats.queried_tokens - queried, "hit_tokens": stats.hit_tokens - hits,
            "preemptions": engine.num_preemptions - preempted}


def step_summary(durations: Sequence[tuple[float, int, int, int]]) -> dict[str, Any] | None:
    return common.summarize_us([d[0] for d in durations]) if durations else None


def mode_row(mode: str, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pool a mode's runs: median run for totals, every step for the percentiles."""
    steps = [s for r in runs for s in r["steps"]]
    median = sorted(runs, key=lambda r: r["elapsed_s"])[(len(runs) - 1) // 2]
    queried = sum(r["queried_tokens"] for r in runs)
    slowest = sorted(steps, key=lambda s: -s[0])[:5]
    return {"mode": mode, "status": "ok", "reason": None, "runs": len(runs),
            "elapsed_s": median["elapsed_s"], "elapsed_all_s": [r["elapsed_s"] for r in runs],
            "output_tokens": median["output_tokens"], "output_tokens_per_s": median["output_tokens_per_s"],
            "steps_per_run": statistics.fmean(r["num_steps"] for r in runs),
            "tokens_computed_per_run": statistics.fmean(r["tokens_computed"] for r in runs),
            "step": step_summary(steps),
            "decode_step": step_summary([s for s in steps if s[3] == 0]),
            "prefill_step": step_summary([s for s in steps if s[3] > 0]),
            "slowest_steps": [{"ms": s[0] * 1e3, "tokens": s[1], "decodes": s[2], "with_prefill": s[3]}
                              for s in slowest],
            "hit_rate": sum(r["hit_tokens"] for r in runs) / queried if queried else 0.0,
            "preemptions": sum(r["preemptions"] for r in runs)}


def check_on_vs_off(llm, prompts: Sequence[Sequence[int]], count: int) -> dict[str, Any]:
    """Greedy tokens with caching on (the first prompt filling the cache) against off."""
    import torch

    from compileattn.testing import near_tie, recording_greedy

    engine = llm.engine
    runs: dict[str, tuple[list[list[int]], dict]] = {}
    hits = 0
    for mode in MODES:
        engine.set_prefix_caching(mode == "on")
        if mode == "on":
            engine.generate([prompts[0]], 1, engine.max_num_tokens)
        before = engine.prefix_cache_stats.hit_tokens
        record: dict = {}
        runs[mode] = engine.generate(prompts, count, engine.max_num_tokens, sampler=recording_greedy(record)), record
        hits = engine.prefix_cache_stats.hit_tokens - before if mode == "on" else hits
    (want, want_rec), (got, got_rec) = runs["off"], runs["on"]
    want_logits = [want_rec[k] for k in sorted(want_rec)]
    got_logits = [got_rec[k] for k in sorted(got_rec)]
    half = engine.dtype in (torch.float16, torch.bfloat16)
    same = sum(a == b for o, e in zip(got, want) for a, b in zip(o, e))
    near_ties, problems = 0, []
    for i, (a, b) in enumerate(zip(got, want)):
        if a == b:
            continue
        j = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
        tie, margin = near_tie(want_logits[i][j], got_logits[i][j], b[j], a[j])
        if half and tie:
            near_ties += 1
        else:
            problems.append(f"prompt {i}: token {j} is {a[j]} with caching on, {b[j]} off (margin {margin:.3g})")
    return {"token_agreement": same / sum(map(len, want)), "near_ties": near_ties, "problems": problems,
            "hit_tokens": hits}


def run_benchmark(args, budget: common.Budget, log: common.Log, out: dict[str, Any]) -> None:
    """Fill ``out``: the check, then a row per mode (``out["rows"]``, mode -> row) as runs finish."""
    from compileattn.engine import throughput as serving

    rows = out["rows"]
    t = time.monotonic()
    model = build_model(args.layers)
    vocab = model.config.vocab_size
    log(f"{bench.MODELS[MODEL]['label']} built on {bench.DEVICE} in {time.monotonic() - t:.1f} s")
    t = time.monotonic()
    llm = build_llm(model, args)
    out["build_s"] = time.monotonic() - t
    out["dtype"] = str(llm.engine.dtype).replace("torch.", "")
    log(f"LLM ({args.compile}) built in {out['build_s']:.1f} s (probe, compile, CUDA-graph capture)")
    workload = serving.shared_prefix_workload(args.num_requests, args.prefix_len, args.suffix_len,
                                                 args.output_len, vocab, args.seed)
    hi = args.output_len[1]
    warm = serving.shared_prefix_workload(min(8, args.num_requests), args.prefix_len, args.suffix_len,
                                          (min(4, hi), min(8, hi)), vocab, args.seed + 1)  # another system prompt
    check = out["check"] = check_on_vs_off(llm, workload.prompts[: args.check_prompts], args.check_tokens)
    log(f"check: {check['token_agreement']:.0%} of tokens agree, {check['near_ties']} near-ties, "
        f"{check['hit_tokens']} tokens from the prefix cache; problems: {check['problems'] or 'none'}")
    modes = list(MODES)
    if check["problems"] or not check["hit_tokens"]:
        why = check["problems"] or ["no prefix-cache hits in the check: caching did not engage"]
        rows["on"].update(status="FAILED", reason="; ".join(why))
        modes = ["off"]
    for mode in modes:
        llm.engine.set_prefix_caching(mode == "on")
        serving.measure(llm, warm)
    runs: dict[str, list] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in modes:
            if budget.exceeded(reserve=RUN_RESERVE_S):
                done = len(runs[mode])
                rows[mode]["reason"] = (f"{done} of {args.repeats} runs: " if done else "") + budget.reason()
                continue
            run = timed_run(llm, workload, mode)
            runs[mode].append(run)
            log(f"  {mode} run {r + 1}: {run['elapsed_s']:.2f} s, {run['output_tokens_per_s']:,.0f} output tokens/s, "
                f"{run['num_steps']} steps, hit rate "
                f"{run['hit_tokens'] / run['queried_tokens'] if run['queried_tokens'] else 0:.1%}")
            rows[mode].update(mode_row(mode, runs[mode]))  # after every run: an error keeps what was measured


# ----------------------------------------------------------------------------------------------
# Report


def _ms(summary: dict[str, Any] | None, key: str) -> str:
    return common.fmt_num(summary[key] / 1e3, 2) if summary else "—"


def on_off_pair(rows: Sequence[dict[str, Any]]) -> tuple[dict, dict, bool] | None:
    """(on row, off row, same run) for the on ÷ off ratios, picked by ``common.run_pair``: the
    latest run in which both modes are ok; where no run measured both, each mode's latest ok row,
    ``same run`` False. None where a mode was never measured."""
    pr = common.run_pair(rows, {m: (lambda r, m=m: r["mode"] == m) for m in MODES})
    if pr is None:
        return None
    picked, same_run = pr
    return picked["on"], picked["off"], same_run


def render_markdown(payload: dict[str, Any]) -> str:
    cfg = payload.get("config", {})
    lines = ["# Prefix sharing: prefix caching off vs on", ""]
    if "environment" in payload:
        lines += [common.environment_markdown(payload["environment"]), ""]
    lines += [f"Workload: {cfg.get('num_requests')} requests sharing a {cfg.get('prefix_len')}-token system prompt, "
              f"unique suffixes of {cfg.get('suffix_len')} tokens, outputs of {cfg.get('output_len')} (ignore_eos, "
              f"seed {cfg.get('seed')}); {bench.MODELS[MODEL]['label']}"
              f"{'' if cfg.get('layers') is None else ', ' + str(cfg.get('layers')) + ' layers'}, "
              f"{payload.get('dtype', '?')}, random weights; compile {cfg.get('compile')}; "
              f"max_num_seqs {cfg.get('max_num_seqs')}, max_num_batched_tokens {cfg.get('max_num_batched_tokens')}, KV cache {cfg.get('kv_gib')} GiB. "
              f"Each run starts with an empty prefix cache; {cfg.get('repeats')} runs per mode, alternating.", ""]
    headers = ["caching", "status", "output tok/s", "total s", "steps", "step p50 ms", "p90", "p99", "max",
               "decode-only p50 / p99", "with prefill p50 / p99", "tokens computed", "hit rate", "preemptions"]
    table = []
    for r in payload["rows"]:
        ok = r["status"] == "ok"
        step, dec, pre = r.get("step"), r.get("decode_step"), r.get("prefill_step")
        table.append([r["mode"] + (f" (run {r.get('run', 0)})" if len(payload.get("runs") or []) > 1 else ""),
                      r["status"] if ok else common.status_text(r["status"]),
                      common.fmt_num(r.get("output_tokens_per_s")) if ok else "—",
                      common.fmt_num(r.get("elapsed_s"), 2) if ok else "—",
                      common.fmt_num(r.get("steps_per_run"), 0) if ok else "—",
                      _ms(step, "p50_us"), _ms(step, "p90_us"), _ms(step, "p99_us"), _ms(step, "max_us"),
                      f"{_ms(dec, 'p50_us')} / {_ms(dec, 'p99_us')}", f"{_ms(pre, 'p50_us')} / {_ms(pre, 'p99_us')}",
                      common.fmt_num(r.get("tokens_computed_per_run"), 0) if ok else "—",
                      f"{r['hit_rate']:.1%}" if ok else "—", str(r.get("preemptions", "—")) if ok else "—"])
    lines += [common.markdown_table(headers, table, "ll" + "r" * 12), ""]
    pr = on_off_pair(payload["rows"])
    if pr is not None:
        on, off, same_run = pr
        mark = "" if same_run else "*"
        which = f" (run {on.get('run', 0)})" if same_run and len(payload.get("runs") or []) > 1 else ""
        lines += [f"Caching on ÷ off{which}: total time {on['elapsed_s'] / off['elapsed_s']:.2f}×{mark}, output tokens/s "
                  f"{on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}×{mark}, step p99 "
                  f"{on['step']['p99_us'] / off['step']['p99_us']:.2f}×{mark}."
                  + ("" if same_run else f" * No run measured both modes: on is run {on.get('run', 0)}'s, off run "
                                         f"{off.get('run', 0)}'s, whose clocks and host load differ."), ""]
    check = payload.get("check")
    if check:
        lines += [f"Check (greedy, {cfg.get('check_prompts')} prompts × {cfg.get('check_tokens')} tokens, on vs off): "
                  f"{check['token_agreement']:.0%} of tokens agree, {check['near_ties']} near-ties, "
                  f"{check['hit_tokens']} tokens served from the prefix cache"
                  f"{'; problems: ' + '; '.join(check['problems']) if check['problems'] else ''}.", ""]
    slow = [(r["mode"], s) for r in payload["rows"] for s in r.get("slowest_steps", [])[:3]]
    if slow:
        lines += ["Slowest steps (ms, tokens, decodes, sequences with prefill work): " +
                  "; ".join(f"{m}: {s['ms']:.1f} ({s['tokens']}, {s['decodes']}, {s['with_prefill']})"
                            for m, s in slow) + ".", ""]
    notes = [f"- {r['mode']}: {r['reason']}" for r in payload["rows"] if r.get("reason")]
    if payload.get("error"):
        notes.append(f"- run ended early: {payload['error']}")
    if notes:
        lines += ["Notes:", "", *notes, ""]
    return "\n".join(lines)


def draw(payload: dict[str, Any]):
    def plot(plt):
        ok = [r for r in payload["rows"] if r["status"] == "ok" and r.get("step")]
        fig, ax = plt.subplots(figsize=(7, 4))
        keys = ["p50_us", "p90_us", "p99_us"]
        width = 0.8 / max(1, len(ok))
        for j, r in enumerate(ok):
            ax.bar([i + j * width for i in range(len(keys))], [r["step"][k] / 1e3 for k in keys], width,
                   label=f"caching {r['mode']}")
        ax.set_xticks([i + width * (len(ok) - 1) / 2 for i in range(len(keys))])
        ax.set_xticklabels(["p50", "p90", "p99"])
        ax.set_ylabel("step wall time (ms)")
        ax.set_title("Per-step wall time, shared system prompt (H200, bf16)")
        ax.legend()
        return fig
    return plot


def write_outputs(payload: dict[str, Any], prefix: str, no_plot: bool, log) -> str:
    return common.write_outputs(payload, prefix, no_plot, log, render_markdown(payload), draw(payload),
                                "prefix sharing step times")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log = common.Log()
    if args.merge:
        merged = common.concat_runs([common.read_json(p) for p in args.merge], "prefix_sharing")
        print(write_outputs(merged, args.output or args.out, args.no_plot, log), flush=True)
        return 0
    missing = common.cuda_missing_message("prefix_sharing.py") if bench.DEVICE == "cuda" else None
    if missing:
        print(missing, flush=True)
        return 0
    common.ensure_repo_on_path()
    budget = common.Budget(args.budget_s)
    config = {k: v for k, v in vars(args).items() if k not in ("merge", "output")}
    import transformers

    payload: dict[str, Any] = {"benchmark": "prefix_sharing", "config": config,
                               "environment": common.environment(transformers=transformers.__version__), "rows": []}
    out: dict[str, Any] = {"rows": {m: {"mode": m, "status": "skipped", "reason": None} for m in MODES},
                           "check": None}
    try:
        run_benchmark(args, budget, log, out)
    except Exception as exc:  # noqa: BLE001  (fail-soft: the report keeps what was measured and says why)
        payload["error"] = common.short_error(exc)
        log(f"error: {payload['error']}")
        traceback.print_exc()
    payload.update(rows=list(out.pop("rows").values()), **out)
    print(write_outputs(payload, args.out, args.no_plot, log), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
