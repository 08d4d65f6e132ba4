#!/usr/bin/env python
"""Offline throughput: compileattn's LLM against transformers' own continuous batching.

Models (random weights, built from configs directly on the GPU in bf16; nothing downloaded): a
Llama-3-8B shape (GQA 32/8, head dim 128, vocab 128256) and an MHA 7B shape (Llama-2-7B: 32/32
heads, vocab 32000), as transformers ``LlamaForCausalLM``. Workload: ``--num-prompts`` prompts
(1000; 100 with ``--quick``) of random tokens, prompt and output lengths drawn uniformly from
``--input-len``/``--output-len`` (128:512; ``--quick`` caps outputs at 256) with a fixed seed,
every output generated to its full length (``ignore_eos``). The same prompts for every column.

Columns:

- ``ca-full``: ``compileattn.LLM`` compiled (``CompileConfig()``, ``auto`` attention backend):
  full CUDA graphs for uniform decode steps, piecewise graphs for mixed steps;
- ``ca-piecewise``: the same with ``cudagraph_mode="piecewise"``;
- ``ca-eager``: the same engine, no compile;
- ``hf-cb``: transformers' continuous batching (``continuous_batching_context_manager``, what
  ``generate_batch`` runs, with per-request ``max_new_tokens``), CUDA graphs on
  (``use_cuda_graph=True``), its own choice of paged attention (flash-attn 3 or 2 when installed,
  else paged sdpa; the table names the one it ran).

Each column reports output tokens/s and requests/s over one timed serving of the whole workload
(compileattn: a ``generate`` after a warm-up, compile and CUDA-graph capture done at construction
and reported separately; transformers: from the first request to the last result, its manager's
setup and graph warm-up done before), and p50/p99 time per output token (per request: decode
time / (tokens - 1)).

Correctness before timing: each compileattn column is teacher-forced through ``--check-tokens``
steps on ``--check-prompts`` prompts and its logits compared (norm-relative, bf16 tolerance 0.1 as
in latency.py) with the transformers model's own forward (sdpa) on the same sequences; a column
that disagrees is reported FAILED and not timed. ``hf-cb`` returns tokens, not logits, so its greedy
tokens on the same prompts are checked teacher-forced: each must be the model's own greedy choice
given hf-cb's own prefix, up to a near-tie (``compileattn.testing.near_tie``, with the bf16 noise
taken as the difference between the model's sdpa and eager attention logits); below 90 % it is
FAILED. Plain agreement with ``generate()`` is reported beside it: with random weights the logits
are nearly flat, so one near-tie early in a sequence makes every later token differ.

GPU-time floor (the issue's definition: the sum of the per-step GPU times of compileattn's own
steps): every step of the timed run is recorded, then replayed one at a time with its host work
(metadata, inputs) done first and the GPU held by a ``torch.cuda._sleep`` kernel while the step is
enqueued, so the events around the step time GPU work only. A step whose enqueueing outlasted the
sleep is re-measured with a longer one. ``e2e / floor`` is the timed run's wall time over that sum.

Run: see benchmarks/README.md. On a machine without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
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

#: Where everything runs. Only "cuda" is a benchmark; "cpu" exists so the plumbing can be smoke-run
#: on a machine without a GPU (by a test setting this attribute).
DEVICE = "cuda"
DTYPE = "bfloat16"
TOLERANCE = 0.1
MODELS = {
    "llama8b": {"label": "Llama-3-8B shape (GQA 32/8)", "config": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)},
    "mha7b": {"label": "MHA 7B shape (32/32 heads)", "config": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=128, max_position_embeddings=4096)},
}
COLUMNS = ["ca-full", "hf-cb", "ca-piecewise", "ca-eager"]  # also the priority order under the budget
CA_COLUMNS = {"ca-full": "full_and_piecewise", "ca-piecewise": "piecewise", "ca-eager": None}
GOALS = {"speedup_vs_hf_cb": 8.0, "e2e_over_floor": 1.10}
#: Budget seconds a column needs left to be started, for the --quick workload on an H200: about
#: 1.5x what each took there (ca-full 51-55 s with compile and capture, hf-cb 39 s, ca-piecewise
#: 25-29 s, ca-eager 11-15 s; benchmarks/results/gpu_tests.md, S4-3).
COLUMN_RESERVE_S = {"ca-full": 80.0, "hf-cb": 60.0, "ca-piecewise": 45.0, "ca-eager": 25.0}
#: The issue's figures (H200, transformers 5.17 generate_batch, paged|sdpa, CUDA graphs requested,
#: Llama-8B shape, 100 prompts of 128-512 tokens generating ~509 each): printed beside ours for
#: scale only; not measurements of this run.
ISSUE_REFERENCE = {"hf generate_batch output tokens/s": 805, "full-graph decode step, batch 64 (ms)": 5.9}
DEFAULT_OUT = common.RESULTS_DIR / "throughput"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from compileattn.cli import length_range

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=common.argparse_type(lambda s: common.parse_name_list(s, list(MODELS))),
                   default=list(MODELS), help="llama8b,mha7b (default both)")
    p.add_argument("--columns", type=common.argparse_type(lambda s: common.parse_name_list(s, COLUMNS)),
                   default=list(COLUMNS), help=f"subset of {','.join(COLUMNS)}")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per column (default 1000, quick 100)")
    p.add_argument("--input-len", type=length_range, default=(128, 512), help="LO:HI prompt tokens (default 128:512)")
    p.add_argument("--output-len", type=length_range, default=None,
                   help="LO:HI output tokens (default 128:512; --quick 128:256)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-gib", type=float, default=80.0,
                   help="KV cache of each compileattn LLM, GiB (default 80: the MHA shape's 256 sequences of ~640 "
                        "tokens need ~82 GiB)")
    p.add_argument("--layers", type=int, default=None, help="override the shapes' 32 layers (debugging)")
    p.add_argument("--check-prompts", type=int, default=4)
    p.add_argument("--check-tokens", type=int, default=16)
    p.add_argument("--no-floor", action="store_true", help="skip the GPU-time floor replay")
    p.add_argument("--quick", action="store_true",
                   help="100 prompts per column, outputs of 128-256 tokens: both models in one 10-minute command")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock budget; work past it is reported as skipped (0 = none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output prefix: writes PREFIX.json/.md/.png")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="merge result files of several runs into one report (no GPU needed)")
    p.add_argument("-o", "--output", default=None, help="output prefix for --merge (default: --out)")
    args = p.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = 100 if args.quick else 1000
    if args.output_len is None:
        args.output_len = (128, 256) if args.quick else (128, 512)
    for name in ("num_prompts", "max_num_seqs", "max_num_batched_tokens", "check_prompts", "check_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if args.kv_gib <= 0:
        p.error("--kv-gib must be > 0")
    return args


# ----------------------------------------------------------------------------------------------
# Models, workload, checks


def build_model(name: str, layers: int | None = None):
    """A transformers LlamaForCausalLM of the shape, random weights, made on DEVICE in bf16."""
    import torch
    import transformers

    cfg = dict(MODELS[name]["config"])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    config = transformers.LlamaConfig(**cfg, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPE),
                                                              attn_implementation="sdpa")
    return model.eval()


def forced_tokens(seq: int, count: int, vocab: int) -> list[int]:
    """A fixed token stream per check sequence: every implementation sees the same inputs."""
    return [(7919 * seq + 104729 * (k + 1)) % vocab for k in range(count)]


def reference_logits(model, prompts: Sequence[Sequence[int]], count: int) -> list[Any]:
    """The model's own forward (its sdpa attention) over prompt + forced tokens: fp32 logits of the
    ``count`` positions that predict the forced tokens (on the CPU)."""
    import torch

    vocab = model.get_input_embeddings().num_embeddings
    out = []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            seq = list(p) + forced_tokens(i, count - 1, vocab)
            ids = torch.tensor([seq], device=model.device)
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            out.append(logits[len(p) - 1:].cpu())
    return out


def engine_logits(llm, prompts: Sequence[Sequence[int]], count: int) -> list[Any]:
    """The same sequences teacher-forced through an LLM's engine: fp32 logits per step (CPU)."""
    import torch

    from compileattn.engine import SamplingParams

    engine = llm.engine
    ids = engine.add_requests([SamplingParams(max_new_tokens=count)] * len(prompts), prompts)
    index = {seq_id: i for i, seq_id in enumerate(ids)}
    rows: dict[int, list] = {i: [] for i in ids}
    streams = {i: forced_tokens(index[i], count, engine.vocab_size) for i in ids}

    def forced(logits, seq_ids):
        for s, row in zip(seq_ids, logits):
            rows[s].append(row.float().cpu())
        return [streams[s][len(rows[s]) - 1] for s in seq_ids]

    while engine.has_unfinished():
        engine.step(sampler=forced)
    for i in ids:
        engine.pop_request(i)
    return [torch.stack(rows[i]) for i in ids]


def worst_rel_error(actual: Sequence[Any], expected: Sequence[Any]) -> float:
    return max(common.rel_error(a, e) for a, e in zip(actual, expected))


# ----------------------------------------------------------------------------------------------
# GPU-time floor


class StepRecorder:
    """Wraps an engine's scheduler to keep every scheduled step (the lists it built anyway)."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: list = []
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self._record  # an instance attribute over the method

    def _record(self, max_tokens=None):
        step = self._schedule(max_tokens)
        if step is not None:
            self.steps.append(step)
        return step

    def close(self) -> None:
        del self.engine.scheduler.schedule  # the instance attribute; the method shows again


def sleep_cycles_per_ms() -> float:
    import torch

    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / start.elapsed_time(end)


def gpu_floor(llm, steps: Sequence[Any], budget: common.Budget, log: common.Log) -> dict[str, Any]:
    """Sum of the GPU times of ``steps``, each replayed with its host work first and the stream held
    by a sleep kernel while it is enqueued (see the module docstring)."""
    import torch

    runner = llm.engine.runner
    cycles = sleep_cycles_per_ms()
    sleep_ms = 2.0
    total_ms, measured, retries = 0.0, 0, 0
    start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step in steps:
        if budget.exceeded(reserve=20.0):
            break
        prepared = runner.prepare(step.seqs, step.input_ids, step.positions)
        rows = torch.tensor(step.sample_rows, dtype=torch.long, device=runner.device)
        while True:
            torch.cuda.synchronize()
            torch.cuda._sleep(int(sleep_ms * cycles))
            start_evt.record()
            hidden = runner.run(prepared)
            if step.sample_rows:
                runner.model.compute_logits(hidden.index_select(0, rows)).argmax(-1)
            end_evt.record()
            enqueued_in_time = not start_evt.query()
            end_evt.synchronize()
            if enqueued_in_time or sleep_ms >= 1000:
                break
            sleep_ms *= 2
            retries += 1
        total_ms += start_evt.elapsed_time(end_evt)
        measured += 1
    log(f"  floor: {measured}/{len(steps)} steps replayed, sleep {sleep_ms:.0f} ms ({retries} retries)")
    complete = measured == len(steps)
    return {"floor_s": total_ms / 1e3 if complete else None, "floor_steps": measured, "steps": len(steps),
            "floor_partial_s": total_ms / 1e3, "floor_sleep_ms": sleep_ms}


# ----------------------------------------------------------------------------------------------
# Columns


def base_row(model: str, column: str) -> dict[str, Any]:
    return {"model": model, "column": column, "status": "skipped", "reason": None}


def ca_llm(model, column: str, args, max_model_len: int):
    import compileattn as ca

    mode = CA_COLUMNS[column]
    config = None if mode is None else ca.CompileConfig(
        cudagraph_mode=mode, max_capture_size=min(max(256, args.max_num_seqs), args.max_num_batched_tokens))
    return ca.LLM(model, compile_config=config, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
                  kv_cache_memory=int(args.kv_gib * 2**30))


def run_ca_column(model, column: str, workload, checks, args, budget, log, row) -> None:
    from compileattn.engine import throughput

    check_prompts, reference = checks
    max_model_len = args.input_len[1] + args.output_len[1]
    t = time.monotonic()
    llm = ca_llm(model, column, args, max_model_len)
    row["build_s"] = time.monotonic() - t
    log(f"  {column}: built in {row['build_s']:.1f} s (load, probe, compile, CUDA-graph capture)")
    try:
        err = worst_rel_error(engine_logits(llm, check_prompts, args.check_tokens), reference)
        row["check_rel_err"] = err
        if not err <= TOLERANCE:
            row.update(status="FAILED", reason=f"logits differ from the model's own forward by {err:.3f} "
                                               f"(norm-relative) > {TOLERANCE}")
            log(f"  {column}: FAILED check ({err:.3f})")
            return
        warm = throughput.random_workload(16, args.input_len, (4, 8), llm.engine.vocab_size, args.seed + 1)
        throughput.measure(llm, warm)
        recorder = StepRecorder(llm.engine)
        try:
            result, _ = throughput.measure(llm, workload)
        finally:
            recorder.close()
        row.update(status="ok", **dataclasses.asdict(result), num_steps=len(recorder.steps),
                   decode_steps=sum(all(k == "decode" for k in s.kinds) for s in recorder.steps))
        log(f"  {column}: {throughput.describe(result)}")
        if not args.no_floor and CA_COLUMNS[column] is not None:
            floor = gpu_floor(llm, recorder.steps, budget, log)
            row.update(floor)
            if floor["floor_s"]:
                row["e2e_over_floor"] = result.elapsed_s / floor["floor_s"]
                log(f"  {column}: GPU-time floor {floor['floor_s']:.2f} s, e2e / floor "
                    f"{row['e2e_over_floor']:.3f}")
    finally:
        del llm
        release()


def cb_generate(model, prompts, output_lens):
    """transformers' continuous batching on ``prompts`` as ``generate_batch`` runs it (workload hints
    for its sizing, CUDA graphs pre-captured by its warm-up): (outputs in order, seconds from the
    first request to the last result, the attention it ran). The model is handed over with sdpa;
    the manager switches it to its best paged attention itself (flash-attn 3 or 2 when installed,
    else paged sdpa)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model.set_attn_implementation("sdpa")
    gen = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(output_lens))
    # On CUDA its own sizing (the cache from free memory) and CUDA graphs; on the CPU (smoke runs)
    # a small fixed cache, since it cannot measure host memory.
    cb = (ContinuousBatchingConfig(use_cuda_graph=True) if DEVICE == "cuda" else
          ContinuousBatchingConfig(use_cuda_graph=False, block_size=16, num_blocks=64, max_batch_tokens=64))
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max(output_lens),
                          num_requests=len(prompts))
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb, block=True,
                                                   timeout=5, workload_hints=hints) as manager:
        attention = model.config._attn_implementation
        start = time.perf_counter()
        ids = [manager.add_request(list(p), max_new_tokens=n, record_timestamps=True)
               for p, n in zip(prompts, output_lens)]
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
        elapsed = time.perf_counter() - start
    outs = [results[i] for i in ids]
    failed = [o.error for o in outs if o.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return outs, elapsed, attention


def teacher_forced_greedy(model, prompts, outputs) -> float:
    """The fraction of ``outputs``' tokens that are the model's greedy choice given the same
    prefix, or a near-tie with it: the logits of the model's sdpa and eager attention on the whole
    sequence give the reference and the arithmetic noise a different kernel may add."""
    import torch

    from compileattn.testing import near_tie

    good = total = 0
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([list(prompt) + list(out)], device=model.device)
        rows = slice(len(prompt) - 1, len(prompt) - 1 + len(out))
        logits = []
        for impl in ("sdpa", "eager"):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                logits.append(model(ids).logits[0, rows].float())
        for ref, other, token in zip(*logits, out):
            best = int(ref.argmax())
            good += best == token or near_tie(ref, other, best, token)[0]
            total += 1
    model.set_attn_implementation("sdpa")
    return good / max(total, 1)


def run_hf_cb(model, workload, checks, args, log, row) -> None:
    from compileattn.engine import throughput

    import torch

    check_prompts, _ = checks

    expected = []
    model.set_attn_implementation("sdpa")
    for p in check_prompts:
        ids = torch.tensor([list(p)], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.check_tokens,
                             do_sample=False, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    got, _, row["attention"] = cb_generate(model, check_prompts, [args.check_tokens] * len(check_prompts))
    generated = [list(o.generated_tokens) for o in got]
    same = sum(a == b for o, e in zip(generated, expected) for a, b in zip(o, e))
    row["check_token_agreement"] = same / sum(map(len, expected))
    row["check_greedy_fraction"] = teacher_forced_greedy(model, check_prompts, generated)
    if row["check_greedy_fraction"] < 0.9:
        row.update(status="FAILED", reason=f"only {row['check_greedy_fraction']:.0%} of its greedy tokens are the "
                                           f"model's greedy choice (up to a near-tie) given its own prefix")
        return
    outs, elapsed, _ = cb_generate(model, workload.prompts, workload.output_lens)
    out_tokens = sum(len(o.generated_tokens) for o in outs)
    tpots = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) * 1e3
             for o in outs if o.timestamps and len(o.timestamps) > 1]
    row.update(status="ok", num_requests=len(outs), input_tokens=workload.input_tokens, output_tokens=out_tokens,
               elapsed_s=elapsed, output_tokens_per_s=out_tokens / elapsed, requests_per_s=len(outs) / elapsed,
               tpot_p50_ms=throughput.percentile(tpots, 50), tpot_p99_ms=throughput.percentile(tpots, 99))
    log(f"  hf-cb ({row['attention']}): {out_tokens} output tokens in {elapsed:.2f} s, {out_tokens / elapsed:,.1f} tokens/s")


def release() -> None:
    """Drop what a finished column compiled and captured (Dynamo's caches hold compiled code and,
    through it, CUDA-graph pools) before the next one allocates its cache."""
    import torch

    torch._dynamo.reset()
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_model(name: str, args, budget: common.Budget, log: common.Log, rows: list[dict[str, Any]]) -> None:
    from compileattn.engine import throughput

    if budget.exceeded(reserve=min(COLUMN_RESERVE_S[c] for c in args.columns)):
        rows.extend(dict(base_row(name, c), reason=budget.reason()) for c in args.columns)
        log(f"{name}: {budget.reason()}")
        return
    t = time.monotonic()
    model = build_model(name, args.layers)
    log(f"{name}: {MODELS[name]['label']} built on {DEVICE} in {time.monotonic() - t:.1f} s")
    vocab = model.config.vocab_size
    workload = throughput.random_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    check_prompts = workload.prompts[: args.check_prompts]
    checks = (check_prompts, reference_logits(model, check_prompts, args.check_tokens))
    for column in args.columns:
        row = base_row(name, column)
        rows.append(row)
        if budget.exceeded(reserve=COLUMN_RESERVE_S[column]):
            row["reason"] = budget.reason()
            log(f"  {column}: {row['reason']}")
            continue
        try:
            if column == "hf-cb":
                run_hf_cb(model, workload, checks, args, log, row)
            else:
                run_ca_column(model, column, workload, checks, args, budget, log, row)
        except Exception as exc:  # noqa: BLE001  (fail-soft: one column's error does not end the run)
            row.update(status="error", reason=common.short_error(exc))
            log(f"  {column}: error {row['reason']}")
            traceback.print_exc()
        finally:
            release()
            if DEVICE == "cuda":
                import torch

                log(f"  after {column}: {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated (the model's "
                    f"weights; more means the column left something alive)")
    del model
    release()


# ----------------------------------------------------------------------------------------------
# Report


def goal_lines(payload: dict[str, Any]) -> list[str]:
    """The goals per model. The speed-up divides the two columns ``common.run_pair`` picks (the
    latest run in which both are ok); where no run measured both, it is shown marked * with no
    verdict. The floor line reads the compileattn row of that pair, else the last run's."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in payload["rows"]):
        label = MODELS.get(model, {}).get("label", model)
        rows = [r for r in payload["rows"] if r["model"] == model]
        pr = common.run_pair(rows, {c: (lambda r, c=c: r["column"] == c) for c in ("ca-full", "hf-cb")})
        if pr is not None:
            picked, same_run = pr
            goal = GOALS["speedup_vs_hf_cb"]
            ca, hf = picked["ca-full"], picked["hf-cb"]
            x = ca["output_tokens_per_s"] / hf["output_tokens_per_s"]
            verdict = (("MET" if x >= goal else "NOT MET") if same_run else
                       f"not checked (ca-full run {ca.get('run', 0)}, hf-cb run {hf.get('run', 0)}: not one run)")
            lines.append(f"- {label}: compileattn (full + piecewise) ≥ {goal:.0f}× transformers' "
                         f"continuous batching in output tokens/s: {x:.1f}×{'' if same_run else '*'} — {verdict}")
        else:
            last = max(r.get("run", 0) for r in rows)
            cols = {r["column"]: r for r in rows if r.get("run", 0) == last}
            ca, hf = cols.get("ca-full"), cols.get("hf-cb")
            lines.append(f"- {label}: speedup over transformers' continuous batching: not measured "
                         f"(ca-full {ca and ca['status']}, hf-cb {hf and hf['status']})")
        if ca and ca.get("e2e_over_floor"):
            r = ca["e2e_over_floor"]
            met = "MET" if r <= GOALS["e2e_over_floor"] else "NOT MET"
            lines.append(f"- {label}: end-to-end time ≤ {GOALS['e2e_over_floor']:.2f}× the GPU-time floor of its steps: "
                         f"{ca['elapsed_s']:.2f} s / {ca['floor_s']:.2f} s = {r:.2f}× — {met}")
        elif ca:
            lines.append(f"- {label}: GPU-time floor not measured (ca-full {ca['status']}"
                         f"{', floor replay incomplete' if ca.get('floor_steps') else ''})")
    return lines


def render_markdown(payload: dict[str, Any]) -> str:
    cfg = payload.get("config", {})
    lines = ["# Offline throughput: compileattn LLM vs transformers continuous batching", ""]
    if "environment" in payload:
        lines += [common.environment_markdown(payload["environment"]), ""]
    lines += [f"Workload: {cfg.get('num_prompts')} prompts, input {cfg.get('input_len')} and output "
              f"{cfg.get('output_len')} tokens (uniform, seed {cfg.get('seed')}), ignore_eos, bf16, random weights; "
              f"compileattn: max_num_seqs {cfg.get('max_num_seqs')}, max_num_batched_tokens "
              f"{cfg.get('max_num_batched_tokens')}, KV cache {cfg.get('kv_gib')} GiB.", ""]
    headers = ["model", "column", "status", "output tok/s", "req/s", "TPOT p50 ms", "TPOT p99 ms", "e2e s",
               "GPU floor s", "e2e / floor", "build s", "check"]
    table = []
    for r in payload["rows"]:
        ok = r["status"] == "ok"
        check = (f"rel err {r['check_rel_err']:.3f}" if r.get("check_rel_err") is not None else
                 f"{r['check_greedy_fraction']:.0%} greedy, {r['check_token_agreement']:.0%} = generate()"
                 if r.get("check_greedy_fraction") is not None else "")
        status = r["status"] if ok else f"**{r['status']}**"
        table.append([MODELS.get(r["model"], {}).get("label", r["model"]),
                      r["column"] + (f" ({r['attention']})" if r.get("attention") else ""), status,
                      common.fmt_num(r.get("output_tokens_per_s")) if ok else "—",
                      common.fmt_num(r.get("requests_per_s"), 2) if ok else "—",
                      common.fmt_num(r.get("tpot_p50_ms"), 2) if ok else "—",
                      common.fmt_num(r.get("tpot_p99_ms"), 2) if ok else "—",
                      common.fmt_num(r.get("elapsed_s"), 2) if ok else "—",
                      common.fmt_num(r.get("floor_s"), 2), common.fmt_num(r.get("e2e_over_floor"), 2),
                      common.fmt_num(r.get("build_s"), 1), check])
    lines += [common.markdown_table(headers, table, "ll" + "l" + "r" * 8 + "l"), ""]
    notes = [f"- {r['model']} / {r['column']}: {r['reason']}" for r in payload["rows"] if r.get("reason")]
    if notes:
        lines += ["Notes:", "", *notes, ""]
    lines += ["## Goal check", "", *goal_lines(payload), ""]
    lines += ["The issue's figures, for scale (not measured here): " +
              "; ".join(f"{k} {v}" for k, v in ISSUE_REFERENCE.items()) + ".", ""]
    return "\n".join(lines)


def draw(payload: dict[str, Any]):
    def plot(plt):
        ok = [r for r in payload["rows"] if r["status"] == "ok"]
        models = list(dict.fromkeys(r["model"] for r in ok))
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / max(1, len(COLUMNS))
        for j, col in enumerate(COLUMNS):
            vals = [next((r["output_tokens_per_s"] for r in ok if r["model"] == m and r["column"] == col), 0)
                    for m in models]
            ax.bar([i + j * width for i in range(len(models))], vals, width, label=col)
        ax.set_xticks([i + width * (len(COLUMNS) - 1) / 2 for i in range(len(models))])
        ax.set_xticklabels([MODELS.get(m, {}).get("label", m) for m in models])
        ax.set_ylabel("output tokens/s")
        ax.set_title("Offline throughput (H200, bf16)")
        ax.legend()
        return fig
    return plot


def write_outputs(payload: dict[str, Any], prefix: str, no_plot: bool, log) -> str:
    return common.write_outputs(payload, prefix, no_plot, log, render_markdown(payload), draw(payload),
                                "offline throughput")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log = common.Log()
    if args.merge:
        merged = common.concat_runs([common.read_json(p) for p in args.merge], "throughput")
        print(write_outputs(merged, args.output or args.out, args.no_plot, log), flush=True)
        return 0
    missing = common.cuda_missing_message("throughput.py") if DEVICE == "cuda" else None
    if missing:
        print(missing, flush=True)
        return 0
    common.ensure_repo_on_path()
    budget = common.Budget(args.budget_s)
    config = {k: v for k, v in vars(args).items() if k not in ("merge", "output")}
    import transformers

    payload = {"benchmark": "throughput", "config": config,
               "environment": common.environment(transformers=transformers.__version__), "rows": []}
    for name in args.models:
        run_model(name, args, budget, log, payload["rows"])
        common.write_json(common.output_paths(args.out)["json"], payload)  # a checkpoint per model
    print(write_outputs(payload, args.out, args.no_plot, log), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
