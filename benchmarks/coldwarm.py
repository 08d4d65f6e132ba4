#!/usr/bin/env python
"""Cold and warm start of ``@compileattn.compile``, where each second goes (issue 12).

Per model (an OPT-125m-shaped decoder in fp16, a Llama-3-8B-shaped one in bf16, random weights),
each phase is a fresh process that imports compileattn, decorates the model class (which starts
Inductor's import in the background when a cache dir is set), builds the model, and makes one
8-token decode step with piecewise CUDA graphs; its output is checked against the same weights
run eagerly. Phases:

- ``cold``: empty compileattn, Inductor and Triton cache dirs; the default config, so
  ``compile_sizes="auto"`` compiles the distinct pieces also for the small decode sizes (in
  ``compile_workers`` worker processes, ``--compile-workers``, which take the dynamic-shape
  compiles the compiling process has not started too; the ``static in workers`` and ``dynamic in
  workers`` columns count the compiles they did);
- ``warm``: a second process on the same dirs: loads Dynamo's code and the pieces, no Dynamo;
- ``cold, dynamic only``: empty dirs again with ``compile_sizes=()``, to put the static compiles'
  cost beside the cold start (the difference of the two cold rows);
- ``cold, waiting for static``: empty dirs again with ``background_static_compiles=False``: the
  first call waits for every static piece (what ``compileattn.LLM`` does before capturing);
- ``cold, layers traced flat``: empty dirs again with ``trace_layers_once=False``: Dynamo traces
  every decoder layer rather than one for all (``compilation/regions.py``); the two rows' Dynamo
  columns are the trace time the regions save;
- ``cold, attention kernels at first launch``: empty dirs again with ``compile_kernels_ahead=False``:
  the first run compiles the attention kernels itself rather than other processes while Dynamo
  traces (``compilation/kernel_warmup.py``);
- ``cold, fork server at first call``: empty dirs again with ``compile_workers_start="first_call"``:
  the workers' fork server starts as a fresh interpreter with the first call, rather than (the
  default, "auto") as a fork of the benchmark's process when the model class is decorated, before
  CUDA is initialised;
- ``cold, workers after dynamic``: empty dirs again with ``compile_workers_start="after_dynamic"``:
  the workers start once the dynamic-shape pieces are compiled, so nothing competes with those
  compiles (the cold row's difference to this one is what the competition costs).

The table gives the first call (``first call s``: what the goals measure, compile or load plus
the first run) and its parts from ``compile_stats``: Dynamo, backend (of which static-shape
pieces), saving, loading, waiting for the background Inductor import, the first run itself (of
which CUDA-graph capture), and outside the first call the process's import and model build.
Each row's timeline (compileattn's log records during the first call, DEBUG included: when each
compile worker (and the fork server) became ready, each compile or load, where it ran and how long it took, each
capture, each Triton kernel variant a prepared call compiled at its first launch) follows the
table. Goals: warm start <= 2 s (Llama-8B shape), cold <= 10 s (OPT-125m) and <= 15 s (Llama-8B).

    PYTHONPATH=. python benchmarks/coldwarm.py --out $OUT/coldwarm     # ~2-3 min on an H200

Under ``--budget-s`` (default 170) phases run in priority order (OPT cold, OPT warm, Llama cold,
Llama warm, then the rows that turn one cold-start measure off, then the flat-trace cold rows and
the dynamic-only ones, Llama first); what is past the budget is reported as skipped.
On a machine without CUDA it prints why and exits 0 (``--device cpu`` runs the plumbing on a tiny
config, for tests).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402

MODELS = {"opt": "OPT-125m shape", "llama": "Llama-3-8B shape"}
#: (model, phase) in priority order under the budget.
PHASES = [("opt", "cold"), ("opt", "warm"), ("llama", "cold"), ("llama", "warm"),
          ("opt", "cold, fork server at first call"), ("llama", "cold, fork server at first call"),
          ("opt", "cold, attention kernels at first launch"), ("llama", "cold, attention kernels at first launch"),
          ("llama", "cold, layers traced flat"), ("opt", "cold, layers traced flat"), ("llama", "cold, dynamic only"), ("llama", "cold, workers after dynamic"), ("opt", "cold, dynamic only"),
          ("opt", "cold, workers after dynamic"), ("opt", "cold, waiting for static")]
#: Phases that start the compile workers other than by default (``compile_workers_start``).
WORKERS_START = {"cold, workers after dynamic": "after_dynamic", "cold, fork server at first call": "first_call"}
GOALS = {("opt", "cold"): 10.0, ("llama", "cold"): 15.0, ("llama", "warm"): 2.0, ("opt", "warm"): 2.0}
#: Norm-relative difference to eager allowed (latency.py's TOLERANCE: fused kernels round differently).
TOLERANCE = {"float16": 5e-2, "bfloat16": 1e-1, "float32": 1e-3}
PHASE_RESERVE_S = 25.0
TOKENS, BLOCK = 8, 16
DEFAULT_OUT = common.RESULTS_DIR / "coldwarm"
#: compile_stats keys shown, in order, with their column titles.
BREAKDOWN = [("dynamo_s", "Dynamo"), ("backend_s", "backend"), ("static_s", "of which static"),
             ("save_s", "save"), ("load_s", "load"), ("import_wait_s", "Inductor import wait"),
             ("run_s", "first run"), ("capture_s", "of which capture")]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="opt,llama", type=common.argparse_type(
        lambda s: common.parse_name_list(s, list(MODELS))))
    p.add_argument("--llama-layers", type=int, default=None, help="override the Llama shape's 32 layers")
    p.add_argument("--backend", default="triton", help="attention backend (default triton: capturable)")
    p.add_argument("--compile-workers", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="CompileConfig.compile_workers: processes for the static-shape compiles (0: in-process)")
    p.add_argument("--budget-s", type=float, default=170.0)
    p.add_argument("--triton-cache-dir", default="per-row", choices=["per-row", "unset"],
                   help="per-row: TRITON_CACHE_DIR set to each row's own directory; unset: left unset, as most "
                        "programs do (the first call sets it; TRITON_HOME points at the row's directory)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output prefix (PREFIX.json, PREFIX.md)")
    p.add_argument("--merge", nargs="+", default=None, help="combine result JSONs into one report (no GPU)")
    p.add_argument("-o", "--output", default=None, help="output prefix for --merge")
    p.add_argument("--_probe", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# One phase: the body of a fresh process


def _model_class_and_config(name: str, device: str, layers: int | None):
    import torch

    if name == "opt":
        from compileattn.models.opt import OPTConfig, OPTForCausalLM

        cfg = OPTConfig.opt_125m() if device == "cuda" else OPTConfig.tiny()
        return OPTForCausalLM, cfg, torch.float16 if device == "cuda" else torch.float32
    from compileattn.models.llama import LlamaConfig, LlamaForCausalLM

    over = {"num_layers": layers} if layers is not None else {}
    cfg = LlamaConfig.llama3_8b(**over) if device == "cuda" else LlamaConfig.tiny(**over)
    return LlamaForCausalLM, cfg, torch.bfloat16 if device == "cuda" else torch.float32


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Import, decorate, build, one step; what it cost. Runs in a fresh process."""
    t0 = time.perf_counter()
    import torch

    import compileattn as ca

    import_s = time.perf_counter() - t0
    device = spec["device"]
    cls, model_cfg, dtype = _model_class_and_config(spec["model"], device, spec.get("layers"))
    config = ca.CompileConfig(cache_dir=spec["cache_dir"], attention_backend=spec["backend"],
                              cudagraph_mode="piecewise" if device == "cuda" else "none",
                              **({"compile_sizes": ()} if spec["dynamic_only"] else {}),
                              background_static_compiles=not spec.get("wait_static", False),
                              compile_workers=spec.get("compile_workers", "auto"),
                              **({"compile_workers_start": spec["workers_start"]} if "workers_start" in spec else {}),
                              compile_kernels_ahead=not spec.get("kernels_at_launch", False),
                              trace_layers_once=not spec.get("flat_trace", False),
                              **({} if device == "cuda" else {"piece_compiler": "eager"}))
    from compileattn.compilation import fork_server

    # what decides whether the fork server may be a fork of this process (FORK_MAX_RESIDENT_BYTES)
    rss_at_decoration = fork_server.resident_bytes()
    with TimelineRecorder(time.perf_counter()) as decoration:
        compiled_cls = ca.compile(type(f"Compiled{cls.__name__}", (cls,), {}),
                                  dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=config)
    t = time.perf_counter()
    model = compiled_cls(model_cfg, dtype=dtype, device=device, seed=0)
    caches = ca.allocate_kv_caches(model.attention_specs(), 2 * TOKENS, BLOCK, dtype=dtype, device=device)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=2 * TOKENS, max_num_tokens=TOKENS,
                                          max_blocks_per_seq=2, device=device, backend=spec["backend"])
    md = builder.build([ca.SequenceStep(1, BLOCK, [2 * i, 2 * i + 1]) for i in range(TOKENS)])
    ids = torch.zeros(TOKENS, dtype=torch.long, device=device)
    pos = torch.full((TOKENS,), BLOCK, dtype=torch.long, device=device)
    common.synchronize()
    build_s = time.perf_counter() - t
    landed = None
    with ca.set_forward_context(md, caches), torch.no_grad():
        t = time.perf_counter()
        with TimelineRecorder(t) as timeline:
            out = model(ids, pos).float()
            common.synchronize()
            first = time.perf_counter() - t
            compile_phases = torch_compile_times()  # the first call's alone: landings compile later
            t2 = time.perf_counter()
            model(ids, pos)
            common.synchronize()
            second = time.perf_counter() - t2
            if model.forward.compile_stats.get("static_pending"):
                # static pieces compiling in the background: wait, then a step that installs them
                # (and captures this size's graphs again), checked against eager like the first
                if not model.forward.wait_for_static_pieces(timeout=300):
                    raise RuntimeError("static pieces did not land within 300 s")
                landed = model(ids, pos).float()
                common.synchronize()
        ref = cls.forward(model, ids, pos).float()  # the same weights, eagerly
    stats = model.forward.compile_stats
    runtimes = model.forward.runtimes
    return {"import_s": import_s, "build_s": build_s, "first_call_s": first, "second_call_s": second,
            "path": stats.get("path"), "regions": stats.get("regions"), **{k: v for k, v in stats.items() if k.endswith("_s") and k != "first_call_s"},
            "run_s": stats.get("first_call_s"), "static_pending": stats.get("static_pending"),
            "capture_s": sum(rt.capture_seconds() for rt in runtimes),
            "rel_err": common.rel_error(out, ref), "dtype": str(dtype).replace("torch.", ""),
            "rel_err_landed": common.rel_error(landed, ref) if landed is not None else None,
            "counters": ca.counters.snapshot(), "torch": torch.__version__, "timeline": timeline.events,
            "torch_compile_times": compile_phases, "rss_at_decoration_bytes": rss_at_decoration,
            "decoration_log": decoration.events, "triton_cache_dir_set": spec.get("triton_cache_dir") != "unset"}


def torch_compile_times() -> dict[str, float]:
    """torch's own seconds per compile phase so far in this process (its ``dynamo_timed``
    metrics, summed over calls; static compiles in workers are not in them): what inside Dynamo
    and Inductor the dynamic-shape compile of a cold start spends."""
    try:
        from torch._dynamo.utils import compile_times

        headers, values = compile_times(repr="csv", aggregate=True)
    except Exception:  # noqa: BLE001  (a private API: its absence must not fail the measurement)
        return {}
    return {h: float(v) for h, v in zip(headers, values)}


#: torch's compile phases shown (``torch_compile_times`` keys; the JSON keeps them all), with
#: their column titles. Nested: bytecode tracing inside Dynamo's capture; AOTAutograd + Inductor
#: and Inductor's own compile summed over pieces, lowering, codegen, module load and the wait for
#: Triton kernel compiles inside Inductor's.
TORCH_PHASES = [("fullgraph_capture", "Dynamo capture"), ("bytecode_tracing", "of which tracing"),
                ("create_aot_dispatcher_function", "AOTAutograd + Inductor"), ("compile_fx_inner", "Inductor"),
                ("GraphLowering.run", "lowering"), ("Scheduler.codegen", "codegen"),
                ("PyCodeCache.load_by_key_path", "module load"), ("async_compile.wait", "Triton compile wait")]


def torch_phase_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Where the compile's seconds went inside torch, per row that compiled."""
    measured = [r for r in rows if r.get("status") == "ok" and r.get("torch_compile_times")]
    if not measured:
        return []
    table = [[MODELS[r["model"]], r["phase"]] + [common.fmt_num(r["torch_compile_times"].get(key), 2) if key in
                                                  r["torch_compile_times"] else "—" for key, _ in TORCH_PHASES]
             for r in measured]
    return ["", "## Inside torch's compile (first call, seconds)", "",
            "torch's `dynamo_timed` metrics in the row's process after its first call, summed over calls (static "
            "compiles in workers are not in them). Nested: tracing inside Dynamo's capture; lowering, codegen, module "
            "load and the Triton compile wait inside Inductor, summed over pieces. — : the phase did not run.", "",
            common.markdown_table(["model", "phase"] + [title for _, title in TORCH_PHASES], table)]


class TimelineRecorder(logging.Handler):
    """compileattn's log records during the first call, DEBUG included (worker readiness, each
    compile and where it ran), as (seconds since ``start``, message): where a cold start's
    seconds go, piece by piece."""

    def __init__(self, start: float):
        super().__init__(logging.DEBUG)
        self.start = start
        self.events: list[tuple[float, str]] = []
        self._logger = logging.getLogger("compileattn")
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append((round(time.perf_counter() - self.start, 3), record.getMessage()[:240]))

    def __enter__(self) -> "TimelineRecorder":
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


class PhaseDirs:
    """The phases' cache roots, each made under ``root`` at its first use: a warm phase gets its
    model's cold phase's (what it loads), every other cold phase empty ones of its own."""

    def __init__(self, root: Path):
        self.root = root
        self._made: dict[tuple[str, str], Path] = {}

    def __call__(self, model: str, phase: str) -> Path:
        key = (model, phase if phase.startswith("cold, ") else "cold")
        if key not in self._made:
            self._made[key] = Path(tempfile.mkdtemp(prefix=f"{model}_", dir=self.root))
        return self._made[key]


@contextlib.contextmanager
def phase_dirs():
    """``PhaseDirs`` under one temporary root, removed with everything the phases cached when the
    run ends, also on an error: nothing reads the caches after their phases."""
    with tempfile.TemporaryDirectory(prefix="compileattn_coldwarm_", ignore_cleanup_errors=True) as root:
        yield PhaseDirs(Path(root))


def run_phase(model: str, phase: str, dirs: PhaseDirs, args, budget: common.Budget, log) -> dict[str, Any]:
    rec: dict[str, Any] = {"model": model, "phase": phase, "status": None, "reason": ""}
    left = budget.left()
    if left < PHASE_RESERVE_S:
        rec.update(status="skipped", reason=budget.reason())
        log(f"{model} {phase}: skipped")
        return rec
    root = dirs(model, phase)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"), TRITON_CACHE_DIR=str(root / "triton"))
    if args.triton_cache_dir == "unset":
        # a program that leaves it unset: the first call sets it (Inductor's rule, under the row's
        # TORCHINDUCTOR_CACHE_DIR); Triton's home moves to the row so nothing is read from ~/.triton
        del env["TRITON_CACHE_DIR"]
        env["TRITON_HOME"] = str(root / "triton_home")
    env["PYTHONPATH"] = os.pathsep.join([str(common.ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    spec = {"model": model, "device": args.device, "backend": args.backend, "cache_dir": str(root / "compileattn"),
            "layers": args.llama_layers if model == "llama" else None, "dynamic_only": phase.startswith("cold, dynamic"),
            "wait_static": phase == "cold, waiting for static",
            **({"workers_start": WORKERS_START[phase]} if phase in WORKERS_START else {}),
            "kernels_at_launch": phase == "cold, attention kernels at first launch",
            "flat_trace": phase == "cold, layers traced flat",
            "compile_workers": args.compile_workers, "triton_cache_dir": args.triton_cache_dir}
    t = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_probe", json.dumps(spec)],
                              capture_output=True, text=True, env=env, timeout=min(420.0, left))
        rec["process_s"] = round(time.monotonic() - t, 2)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE_RESULT ")]
        if proc.returncode != 0 or not lines:
            rec.update(status="error", reason=f"exit {proc.returncode}: " + (proc.stderr or proc.stdout)[-800:])
        else:
            rec.update(status="ok", **json.loads(lines[-1][len("PROBE_RESULT "):]))
            tol = TOLERANCE.get(rec["dtype"], 1e-3)
            if not rec["rel_err"] <= tol:
                rec.update(status="FAILED", reason=f"differs from eager: rel. error {rec['rel_err']:.3g} > {tol}")
            elif rec.get("rel_err_landed") is not None and not rec["rel_err_landed"] <= tol:
                rec.update(status="FAILED", reason=f"after the static pieces landed it differs from eager: rel. "
                                                   f"error {rec['rel_err_landed']:.3g} > {tol}")
    except subprocess.TimeoutExpired:
        rec.update(status="error", reason="timed out", process_s=round(time.monotonic() - t, 2))
    if rec["status"] == "ok":
        log(f"{model} {phase}: first call {rec['first_call_s']:.2f} s ({rec['path']}), process {rec['process_s']:.1f} s; "
            + ", ".join(f"{title} {rec[key]:.2f}" for key, title in BREAKDOWN if rec.get(key) is not None))
    else:
        log(f"{model} {phase}: {rec['status']}: {rec['reason']}")
    return rec


def run_benchmark(args, log, checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every phase of ``PHASES`` for ``args.models``; ``checkpoint(payload so far)`` after each one,
    so a run killed at its time limit keeps the phases it finished."""
    budget = common.Budget(args.budget_s)
    env = common.environment()
    log(f"GPU {env.get('gpu')}; versions {env.get('versions')}")
    rows: list[dict[str, Any]] = []
    run = {"env": env, "budget_s": args.budget_s}
    payload = {"benchmark": "coldwarm", "config": {"models": args.models, "backend": args.backend, "device": args.device,
                                                  "llama_layers": args.llama_layers, "tokens": TOKENS,
                                                  "compile_workers": args.compile_workers, "triton_cache_dir": args.triton_cache_dir},
               "runs": [run], "rows": rows}
    with phase_dirs() as dirs:
        for m, phase in PHASES:
            if m not in args.models:
                continue
            rows.append(run_phase(m, phase, dirs, args, budget, log))
            run["elapsed_s"] = round(log.elapsed(), 1)
            if checkpoint is not None:
                checkpoint(payload)
    run["elapsed_s"] = round(log.elapsed(), 1)
    return payload


# ----------------------------------------------------------------------------------------------
# Report (CPU-only code)


def start_goal_records(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cold and warm start goals of ``GOALS`` for the rows that measured them (``common.goal``
    records; ``latency.py``'s cold/warm subprocesses report through this too)."""
    out = []
    for r in rows:
        limit = GOALS.get((r["model"], r["phase"]))
        if limit is None:
            continue
        label = f"{MODELS.get(r['model'], r['model'])}, {r['phase']} start ≤ {limit:g} s"
        if r["status"] != "ok":
            reason = r.get("reason") or ""
            why = reason if reason.startswith(r["status"]) else f"{r['status']}: {reason}" if reason else r["status"]
            out.append(common.goal(label, None, why, model=r["model"]))
        elif r["phase"] == "warm" and r.get("path") not in ("warm", None):  # (None: a file without paths)
            # A cold phase that failed or was cut leaves nothing (or a stale key) to load: its warm
            # process compiles cold, which timed a cold start under the warm start's name.
            out.append(common.goal(label, None, f"the warm phase compiled instead of loading (path "
                                                f"{r.get('path')!r}), {r['first_call_s']:.2f} s", model=r["model"]))
        else:
            out.append(common.goal(label, r["first_call_s"] <= limit, f"{r['first_call_s']:.2f} s", model=r["model"],
                                   seconds=r["first_call_s"]))
    return out


def phase_pair(rows: Sequence[dict[str, Any]], model: str, phase: str,
               other: str) -> tuple[dict[str, Any], dict[str, Any], str] | None:
    """Two phases of ``model`` compared in a line, picked by ``common.run_pair``: the ok rows of
    the latest run that measured both, with "" for a mark; where no run did, each phase's latest ok
    row and a mark naming their runs. None where a phase was never measured ok."""
    pr = common.run_pair([r for r in rows if r["model"] == model],
                         {p: (lambda r, p=p: r["phase"] == p) for p in (phase, other)})
    if pr is None:
        return None
    picked, same_run = pr
    a, b = picked[phase], picked[other]
    return a, b, "" if same_run else f" (* runs {a.get('run', 0)} and {b.get('run', 0)}: not one run)"


def goal_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    out = [common.goal_line(g) for g in start_goal_records(rows)]
    for model in MODELS:
        cold = {r["phase"]: r for r in rows if r["model"] == model and r["status"] == "ok"}
        if cold.get("cold", {}).get("static_landed_s") is not None:
            out.append(f"- {MODELS[model]}: the first call returned after {cold['cold']['first_call_s']:.2f} s with "
                       f"{cold['cold'].get('static_pending')} static compiles still in the workers; every static "
                       f"piece was in place {cold['cold']['static_landed_s']:.2f} s after it started")
        if "cold, waiting for static" in cold:
            out.append(f"- {MODELS[model]}: waiting for every static piece (`background_static_compiles=False`), "
                       f"the first call took {cold['cold, waiting for static']['first_call_s']:.2f} s")
        if pr := phase_pair(rows, model, "cold", "cold, dynamic only"):
            full, dyn, mark = pr
            out.append(f"- {MODELS[model]}: static compiles (compile_sizes='auto') add "
                       f"{full['first_call_s'] - dyn['first_call_s']:.2f} s to the cold "
                       f"start ({full.get('static_s', 0):.2f} s of compiling){mark}")
        pr = phase_pair(rows, model, "cold", "cold, layers traced flat")
        if pr is not None and pr[0].get("dynamo_s") is not None:
            one, flat, mark = pr
            out.append(f"- {MODELS[model]}: Dynamo {one['dynamo_s']:.2f} s with the layers traced once "
                       f"(regions {one.get('regions')}) against {flat.get('dynamo_s', 0):.2f} s traced flat; "
                       f"first call {one['first_call_s']:.2f} against {flat['first_call_s']:.2f} s{mark}")
        for phase, what in (("cold, fork server at first call", "with the fork server a fresh interpreter "
                                                                "started at the first call rather than a fork "
                                                                "at decoration"),
                            ("cold, attention kernels at first launch", "with the attention kernels compiled at "
                                                                        "their first launch rather than ahead")):
            if pr := phase_pair(rows, model, phase, "cold"):
                other, default, mark = pr
                out.append(f"- {MODELS[model]}: {what}, the first call took {other['first_call_s']:.2f} s "
                           f"(default: {default['first_call_s']:.2f} s){mark}")
        after = cold.get("cold, workers after dynamic")
        if after is not None:
            landed = (f"; every static piece in place {after['static_landed_s']:.2f} s after it started"
                      if after.get("static_landed_s") is not None else "")
            out.append(f"- {MODELS[model]}: workers started after the dynamic-shape compiles "
                       f"(`compile_workers_start='after_dynamic'`): the first call took {after['first_call_s']:.2f} s"
                       f"{landed}")
    return out


def render(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    lines = ["# compileattn cold and warm start", ""]
    if payload.get("runs"):
        lines += [common.environment_markdown(payload["runs"][0]["env"]), ""]
    lines += ["Seconds, one fresh process per row (cold: empty compileattn, Inductor and Triton caches; warm: "
              "the same dirs again). `first call` = compile or load + the first run; its parts are "
              "`compile_stats`. 8-token decode step, piecewise CUDA graphs. With static compiles left to "
              "land in the background (`background_static_compiles`, the default), the first call runs the "
              "dynamic-shape pieces; `static landed` is when the last static piece was in place (seconds "
              "from the first call's start; the process waited for it, then ran a step with them, whose "
              "difference to eager is `rel. err after`).", ""]
    workers = payload.get("config", {}).get("compile_workers")
    if workers is not None:
        lines += [f"Piece compiles in `compile_workers={workers!r}` worker processes (`static in workers`, "
                  f"`dynamic in workers`: how many of each they did; the compiling process did the rest).", ""]
    triton_dir = payload.get("config", {}).get("triton_cache_dir", "per-row")
    lines += [("`TRITON_CACHE_DIR` left unset in every row, as most programs leave it (`--triton-cache-dir unset`: "
               "the first call sets it, under the row's Inductor cache; Triton's home is the row's directory)."
               if triton_dir == "unset" else "`TRITON_CACHE_DIR` set to each row's own directory by the benchmark."), ""]
    if payload.get("config", {}).get("device") == "cpu":
        lines += ["**CPU plumbing run** (`--device cpu`): tiny fp32 configs, eager pieces; no number here is a "
                  "measurement of the shapes named.", ""]
    headers = ["model", "dtype", "phase", "path", "first call", *(title for _, title in BREAKDOWN), "import", "build",
               "process", "pieces compiled", "static in workers", "dynamic in workers", "reused", "rel. err",
               "static landed",
               "rel. err after"]
    table = []
    for r in rows:
        phase = r["phase"] + (f" (run {r.get('run', 0)})" if len(payload.get("runs") or []) > 1 else "")
        if r["status"] != "ok":
            table.append([MODELS[r["model"]], "", phase, common.status_text(r["status"]), r["reason"][:100]] + [""] * (len(headers) - 5))
            continue
        c = r.get("counters", {})
        table.append([MODELS[r["model"]], r["dtype"], phase, r["path"], common.fmt_num(r["first_call_s"], 2),
                      *(common.fmt_num(r.get(k), 2) if r.get(k) is not None else "—" for k, _ in BREAKDOWN),
                      common.fmt_num(r["import_s"], 2), common.fmt_num(r["build_s"], 2),
                      common.fmt_num(r.get("process_s"), 1), c.get("backend_compiles", "—"),
                      c.get("static_compiles_in_workers", "—"), c.get("dynamic_compiles_in_workers", "—"),
                      c.get("piece_reuses", "—"), f"{r['rel_err']:.2g}",
                      common.fmt_num(r.get("static_landed_s"), 2) if r.get("static_landed_s") is not None else "—",
                      f"{r['rel_err_landed']:.2g}" if r.get("rel_err_landed") is not None else "—"])
    lines += [common.markdown_table(headers, table), "", "## Goals (issue 12)", "", *(goal_lines(rows) or ["- nothing measured"])]
    lines += torch_phase_lines(rows)
    lines += timeline_lines(rows)
    return "\n".join(lines) + "\n"


def timeline_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Each row's compileattn log during the first call (seconds from its start)."""
    out = []
    for r in rows:
        events = r.get("timeline") if r["status"] == "ok" else None
        if not events:
            continue
        out += ["", f"## Timeline: {MODELS[r['model']]}, {r['phase']}", "",
                "compileattn's log during the first call (DEBUG included), seconds from its start:", "", "```"]
        out += [f"{t:8.2f}  {message}" for t, message in events]
        if r.get("decoration_log") is not None:
            rss = r.get("rss_at_decoration_bytes")
            out += ["```", "", "At decoration (the process's resident memory "
                    + (f"{rss / 2**30:.2f} GiB" if rss is not None else "not read") + "; TRITON_CACHE_DIR "
                    + ("set by the benchmark" if r.get("triton_cache_dir_set", True) else "unset") + "):", "", "```"]
            out += [f"{t:8.2f}  {message}" for t, message in r["decoration_log"]] or ["(nothing logged)"]
        out += ["```"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args._probe:
        common.ensure_repo_on_path()
        print("PROBE_RESULT " + json.dumps(probe(json.loads(args._probe))), flush=True)
        return 0
    log = common.Log()
    if args.merge:
        payloads = [common.read_json(p) for p in args.merge]
        # rows tagged with their run: a line comparing two phases pairs them within one run
        merged = {**common.concat_runs(payloads, "coldwarm"), "config": payloads[0].get("config", {})}
        prefix = args.output or args.out
        md = render(merged)
        common.write_json(prefix + ".json", merged)
        common.write_text(prefix + ".md", md)
        print(md, flush=True)
        return 0
    if args.device == "cuda":
        missing = common.cuda_missing_message("coldwarm.py")
        if missing:
            print(missing, flush=True)
            return 0
    def write(pl: dict[str, Any]) -> str:
        md = render(pl)
        common.write_json(args.out + ".json", pl)
        common.write_text(args.out + ".md", md)
        return md

    payload = run_benchmark(args, log, checkpoint=write)
    md = write(payload)
    log(f"wrote {args.out}.json and {args.out}.md")
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
