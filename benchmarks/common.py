"""Shared helpers of the benchmark scripts: environment record, result files, GPU timing.

Why the timing works the way it does:

- GPU time of a kernel is measured by capturing ``iters`` calls in one CUDA graph and timing its
  replays with CUDA events (``gpu_time_us``). Timing eager calls with events would measure the
  CPU's launch rate instead whenever a call's Python/launch cost exceeds its GPU time (FA4's
  Python entry costs ~100 µs, longer than most decode kernels), which is exactly what a decode
  benchmark must not hide. When capture fails, the fallback is events around ``iters`` eager
  calls, and the result says so (``method``).
- ``rotations``: the timed calls cycle over that many copies of the inputs, so that a small KV
  cache (4 MiB at batch 1 / context 1024) is not served from the 50 MiB L2 on every call after
  the first; in a model the other layers evict it between two calls of one layer.
- The memory floor of a kernel is the bytes it must read divided by the device-to-device copy
  bandwidth measured in the same process (``copy_bandwidth``), which counts bytes read plus bytes
  written, the convention of every "achieved bandwidth" figure.

No CUDA is needed to import this module (the scripts print "needs CUDA" and exit 0 on a CPU).
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
MiB = 1 << 20

#: Environment variables recorded with every result (they change what runs or how it compiles).
_ENV_PREFIXES = ("COMPILEATTN_", "TORCHINDUCTOR_", "TRITON_", "CUDA_VISIBLE_DEVICES", "PYTHONPATH",
                 "FLASHINFER_", "TORCH_COMPILE", "PYTORCH_CUDA_ALLOC_CONF")


def ensure_repo_on_path() -> None:
    """Make ``compileattn`` and ``passes`` importable when a script is run as ``python benchmarks/x.py``
    without ``PYTHONPATH=.``."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


class Log:
    """``log("...")`` prints with the seconds since start and flushes: the device run's output is
    read from a tail after the fact, and a stalled step must be visible as the last line."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)


class Budget:
    """A wall-clock budget: work past the deadline is skipped (and reported as skipped), so a run
    always ends in time to write what it measured. ``seconds`` <= 0 means no limit."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds if seconds and seconds > 0 else None
        self.start = time.monotonic()

    def left(self) -> float:
        if self.seconds is None:
            return math.inf
        return self.seconds - (time.monotonic() - self.start)

    def exceeded(self, reserve: float = 0.0) -> bool:
        return self.left() < reserve

    def reason(self) -> str:
        return f"skipped: time budget of {self.seconds:.0f} s used up (raise --budget-s)"


def cuda_missing_message(script: str) -> str | None:
    """None when CUDA is usable, else the one-line explanation the script prints before exiting 0."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return f"{script}: needs CUDA and PyTorch; torch is not importable ({exc}). Nothing measured."
    if torch.cuda.is_available():
        return None
    return (f"{script}: needs CUDA (torch {torch.__version__} sees no GPU); nothing measured. "
            f"Run it on a CUDA machine, see benchmarks/README.md.")


# ----------------------------------------------------------------------------------------------
# Environment record


def package_version(dists: Sequence[str], module: str | None = None) -> str | None:
    """Installed version of the first of ``dists`` found, else ``module.__version__`` if that module
    imports, else None. Packs unpacked onto PYTHONPATH keep their ``*.dist-info``, so
    ``importlib.metadata`` finds them without importing (FlashInfer's import JIT-loads kernels)."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # noqa: BLE001  (a broken dist-info is "unknown", not a crash)
            continue
    if module is not None:
        try:
            return str(getattr(importlib.import_module(module), "__version__", "unknown"))
        except Exception:  # noqa: BLE001
            return None
    return None


def git_commit() -> str | None:
    """``git rev-parse HEAD`` (+dirty), or ``$BENCH_COMMIT`` when set: the lent GPU machines get the
    working tree with a ``.git`` that can lag behind it, so a run there names its tree explicitly
    (``BENCH_COMMIT=$(git rev-parse HEAD)`` written into the command on this side)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"] + " (BENCH_COMMIT)"
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        commit = out.stdout.strip() if out.returncode == 0 else None
        if commit:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=10)
            if dirty.returncode == 0 and dirty.stdout.strip():
                commit += "+dirty"
        return commit
    except Exception:  # noqa: BLE001  (the device copy of the tree may have no .git)
        return None


def command_line(argv: Sequence[str] | None = None) -> str:
    argv = list(sys.argv if argv is None else argv)
    return shlex.join([os.path.basename(sys.executable), *argv])


def gpu_record(device: Any = None) -> dict[str, Any] | None:
    try:
        import torch
    except Exception:  # noqa: BLE001
        return None
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_GiB": round(props.total_memory / 2**30, 1),
        "l2_MiB": round(l2_cache_bytes(index) / MiB, 1),
        "device_count": torch.cuda.device_count(),
    }


def environment(argv: Sequence[str] | None = None, **extra: Any) -> dict[str, Any]:
    """Everything needed to reproduce or distrust a result: GPU, versions, the exact command."""
    try:
        import torch
        torch_version, cuda_version = torch.__version__, torch.version.cuda
    except Exception:  # noqa: BLE001
        torch_version = cuda_version = None
    env = {
        "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "command": command_line(argv),
        "cwd": os.getcwd(),
        "git_commit": git_commit(),
        "gpu": gpu_record(),
        "versions": {
            "torch": torch_version,
            "cuda": cuda_version,
            "triton": package_version(["triton"]),
            "flash-attn-4": package_version(["flash-attn-4", "fa4"]),
            "flash-attn (FA2)": package_version(["flash-attn", "flash_attn"]),
            "flashinfer": package_version(["flashinfer-python", "flashinfer"]),
            "compileattn": package_version([], "compileattn"),
        },
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
    }
    env.update(extra)
    return env


def environment_markdown(env: dict[str, Any]) -> str:
    gpu = env.get("gpu") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (env.get("versions") or {}).items() if v)
    lines = [
        f"- GPU: {gpu.get('name', 'none')} (sm {gpu.get('capability', '?')}, {gpu.get('sm_count', '?')} SMs, "
        f"{gpu.get('memory_GiB', '?')} GiB, L2 {gpu.get('l2_MiB', '?')} MiB)",
        f"- Versions: {versions}",
        f"- Command: `{env.get('command', '?')}`",
        f"- Commit: {env.get('git_commit') or 'unknown'}; host {env.get('host', '?')}; {env.get('time_utc', '?')}",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Goals


def goal(name: str, met: bool | None, measured: str, **detail: Any) -> dict[str, Any]:
    """One goal of an issue as a script checked it: ``met`` None when the run did not measure it
    (``measured`` then says why). Each report builds these from its own thresholds (the one place
    each threshold lives); ``goal_line`` renders one and ``goals.py`` gathers them across runs."""
    return {"goal": name, "met": met, "measured": measured, **detail}


def goal_line(g: dict[str, Any]) -> str:
    verdict = {True: "MET", False: "NOT MET", None: "not measured"}[g["met"]]
    return f"- {g['goal']}: {verdict} — {g['measured']}"


# ----------------------------------------------------------------------------------------------
# Result files


def write_json(path: str | os.PathLike, payload: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=False, default=_json_default) + "\n")
    os.replace(tmp, path)
    return path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    return repr(obj)


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def write_text(path: str | os.PathLike, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path


def output_paths(prefix: str | os.PathLike) -> dict[str, Path]:
    """``prefix`` -> prefix.json / .md / .png (an existing suffix on ``prefix`` is dropped)."""
    p = Path(prefix)
    if p.suffix in (".json", ".md", ".png"):
        p = p.with_suffix("")
    return {"json": p.with_name(p.name + ".json"), "md": p.with_name(p.name + ".md"),
            "png": p.with_name(p.name + ".png")}


def try_plot(path: str | os.PathLike, draw: Callable[[Any], Any]) -> str | None:
    """Draw with matplotlib (optional) into ``path``: ``draw(plt)`` returns the figure. Returns None
    on success, else why no plot was written (the JSON and markdown never depend on it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"no PNG: matplotlib unavailable ({type(exc).__name__}: {exc}); re-plot later with --merge"
    try:
        fig = draw(plt)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=130, bbox_inches="tight")
        plt.close(fig)
        return None
    except Exception as exc:  # noqa: BLE001
        return f"no PNG: plotting failed ({type(exc).__name__}: {exc})"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one char per column: l, r or c (default: l then r)."""
    headers = [str(h) for h in headers]
    rows = [["" if c is None else str(c).replace("|", "\\|") for c in r] for r in rows]
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"row {r} has {len(r)} cells, the table has {len(headers)} columns")
    align = align or ("l" + "r" * (len(headers) - 1))
    marks = {"l": ":--", "r": "--:", "c": ":-:"}
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def status_text(status: str) -> str:
    """How a result cell that did not run or failed reads in a table."""
    return {"unavailable": "n/a", "skipped": "skipped", "FAILED": "**FAILED**", "error": "error"}.get(status, status)


def fmt_num(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


# ----------------------------------------------------------------------------------------------
# Statistics


def percentile(values: Sequence[float], p: float) -> float:
    """``compileattn.engine.throughput.percentile`` (linear interpolation, numpy's default), strict:
    a benchmark asking for the percentile of nothing, or of a ``p`` outside [0, 100], has a bug."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"p must be in [0, 100], got {p}")
    from compileattn.engine.throughput import percentile as interpolated

    return interpolated(values, p)


def summarize_us(samples_s: Sequence[float]) -> dict[str, float]:
    """Per-step wall times in seconds -> p50/p90/p99/mean/min/max in µs."""
    us = [s * 1e6 for s in samples_s]
    return {"p50_us": percentile(us, 50), "p90_us": percentile(us, 90), "p99_us": percentile(us, 99),
            "mean_us": statistics.fmean(us), "min_us": min(us), "max_us": max(us), "steps": len(us)}


def rel_error(actual: Any, expected: Any) -> float:
    """``compileattn.testing.rel_error``: the norm-relative error every benchmark checks outputs by."""
    from compileattn.testing import rel_error as relative

    return relative(actual, expected)


# ----------------------------------------------------------------------------------------------
# GPU timing


def synchronize() -> None:
    """``torch.cuda.synchronize()`` where there is CUDA (the CPU tests drive the same code)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def l2_cache_bytes(device: Any = None) -> int:
    import torch

    index = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "L2_cache_size", 0) or 50 * MiB)


def rotations_for(bytes_per_copy: int, l2_bytes: int, factor: float = 4.0, max_copies: int = 64) -> int:
    """Input copies to cycle over so the working set is ``factor`` x L2 (1 when one copy already is)."""
    if bytes_per_copy <= 0:
        return 1
    return int(min(max_copies, max(1, math.ceil(factor * l2_bytes / bytes_per_copy))))


@dataclasses.dataclass
class TimingResult:
    us: float  # median GPU µs per call
    min_us: float
    method: str  # "cuda-graph" | "events"
    iters: int  # calls per timed sample
    reps: int
    spread: float  # (max - min) / median over the samples
    note: str = ""


def _events_us(fn: Callable[[int], Any], iters: int, rotations: int) -> float:
    import torch

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(i % rotations)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def gpu_time_us(fn: Callable[[int], Any], *, rotations: int = 1, target_ms: float = 3.0, reps: int = 7,
                min_iters: int = 4, max_iters: int = 1000, warmup: int = 2, use_graph: bool = True,
                after: Callable[[], Any] | None = None) -> TimingResult:
    """GPU µs per call of ``fn(r)`` (``r`` = which input copy, cycled modulo ``rotations``).

    ``iters`` calls are captured into one CUDA graph (so a replay costs one launch of CPU time and
    the kernels run back to back), sized so one replay lasts about ``target_ms``; the result is the
    median over ``reps`` replays. ``fn`` must not sync the host. If capture fails, events around
    ``iters`` eager calls are used instead (then CPU launch cost can show up as GPU time, and
    ``method`` says "events"). ``after()`` runs once after the timed calls, while the graph (and the
    outputs it wrote) is alive: the place to check that the captured calls computed the right thing.
    """
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture stream, as torch.cuda.graph wants
        for i in range(max(1, warmup)):
            fn(i % rotations)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    est = _events_us(fn, max(3, min(rotations, 16)), rotations)
    iters = int(min(max_iters, max(min_iters, math.ceil(target_ms * 1e3 / max(est, 0.5)))))
    if rotations > 1:
        iters = min(max(iters, rotations), max(max_iters, rotations))
        iters = math.ceil(iters / rotations) * rotations
    note = ""
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for i in range(iters):
                    fn(i % rotations)
        except Exception as exc:  # noqa: BLE001  (not capturable: fall back to events, say why)
            note = f"CUDA-graph capture failed ({short_error(exc, 200)})"
            graph = None
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                pass
        if graph is not None:
            graph.replay()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            samples = []
            for _ in range(reps):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3 / iters)
            med = statistics.median(samples)
            if after is not None:
                after()
            del graph
            return TimingResult(med, min(samples), "cuda-graph", iters, reps, (max(samples) - min(samples)) / med)
    samples = [_events_us(fn, iters, rotations) for _ in range(reps)]
    med = statistics.median(samples)
    if after is not None:
        after()
    return TimingResult(med, min(samples), "events", iters, reps, (max(samples) - min(samples)) / med, note)


def copy_bandwidth(nbytes: int = 1 << 30, device: Any = "cuda") -> dict[str, float]:
    """Device-to-device ``copy_`` bandwidth in GB/s (bytes read + bytes written, decimal GB), over a
    buffer far larger than L2; the memory floor every bandwidth-bound kernel is measured against."""
    import torch

    bufs = [torch.ones(nbytes, dtype=torch.uint8, device=device)]
    bufs.append(torch.empty_like(bufs[0]))
    t = gpu_time_us(lambda _r: bufs[1].copy_(bufs[0]), target_ms=20.0, reps=5, min_iters=3, max_iters=50)
    gbps = 2 * nbytes / (t.us * 1e-6) / 1e9
    bufs.clear()
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "us": t.us, "GBps": gbps, "method": t.method}


# ----------------------------------------------------------------------------------------------
# Misc


def parse_int_list(text: str) -> list[int]:
    """"1,4,16" -> [1, 4, 16] (argparse type): positive ints, order kept, duplicates dropped."""
    out: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = int(part)
        except ValueError:
            raise ValueError(f"not an integer: {part!r}") from None
        if v < 1:
            raise ValueError(f"must be >= 1: {v}")
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError("empty list")
    return out


def parse_name_list(text: str, allowed: Sequence[str]) -> list[str]:
    out: list[str] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if part not in allowed:
            raise ValueError(f"unknown name {part!r}; choose from {', '.join(allowed)}")
        if part not in out:
            out.append(part)
    if not out:
        raise ValueError("empty list")
    return out


def json_object(text: str) -> dict[str, Any]:
    """A JSON object from the command line (``null`` is None): e.g. ``--inductor-options``."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def argparse_type(parser_fn: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap a parser so argparse reports its ValueError message as a usage error."""
    import argparse

    def parse(text: str):
        try:
            return parser_fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = getattr(parser_fn, "__name__", "value")
    return parse


def short_error(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def concat_runs(payloads: Sequence[dict[str, Any]], benchmark: str) -> dict[str, Any]:
    """Several runs of one benchmark as one report: every run's rows, each tagged with its run
    (``row["run"]``, an index into ``runs``, so that ``run_pair`` pairs figures within one run),
    each run's environment, the last run's config. A merged report merges as its runs. ValueError
    for another benchmark's result."""
    if not payloads:
        raise ValueError("nothing to merge")
    for i, p in enumerate(payloads):
        if p.get("benchmark") != benchmark:
            raise ValueError(f"input {i} is not a {benchmark}.py result (benchmark={p.get('benchmark')!r})")
    merged = dict(payloads[-1])
    merged["rows"], merged["runs"] = tag_runs(payloads, "environment")
    return merged


def tag_runs(payloads: Sequence[dict[str, Any]], env_key: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """(every payload's rows, each tagged with its run, the runs): ``row["run"]`` indexes the runs,
    each a run's environment (``payload[env_key]``); a payload with ``runs`` of its own (merged
    before) brings them, its rows keeping their places among them."""
    rows: list[dict[str, Any]] = []
    runs: list[Any] = []
    for p in payloads:
        own = "runs" in p
        rows += [{**r, "run": len(runs) + (r.get("run", 0) if own else 0)} for r in p["rows"]]
        runs += p["runs"] if own else [p.get(env_key)]
    return rows, runs


def run_pair(rows: Iterable[dict[str, Any]], sides: dict[str, Callable[[dict[str, Any]], bool]],
             enough: Callable[[set[str]], bool] | None = None) -> tuple[dict[str, dict[str, Any]], bool] | None:
    """The rows a ratio between measurements divides, and whether they come from one run: every
    report that compares two measurements of one cell (a merged report's rows carry ``run``, see
    ``tag_runs``) picks them here, so that all of them pick alike.

    ``sides``: name -> whether a row measures that side; a row counts only when its status is ok.
    ``enough``: whether a set of side names is enough for the ratio (default: every side; e.g. a
    numerator and any one of several denominators). Returns ``(picked, same_run)``, ``picked``
    mapping each side present to its row; None where even the rows of all runs are not enough.

    - The latest run that measured enough sides wins, ``same_run`` True. A ratio divides two
      figures of one run because GPU clocks, host load and often the machine differ between runs
      by more than the margins a goal is checked to; of several runs that measured both, the
      latest measured the newest code (a cell is rerun because something changed).
    - Within that run, each side's last row: a run that measured a side twice ended on the later
      figure, so what a run reports is what it finished with.
    - Where no run measured enough, each side's row from the latest run that measured it (its last
      row there), ``same_run`` False: a report shows such a ratio marked ``*`` and gives it no
      verdict, since its two figures are minutes or sessions apart."""
    by_run: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r.get("status") != "ok":
            continue
        for name, measures in sides.items():
            if measures(r):
                by_run.setdefault(r.get("run", 0), {})[name] = r
    enough = enough or (lambda names: names >= set(sides))
    for run in sorted(by_run, reverse=True):
        if enough(set(by_run[run])):
            return dict(by_run[run]), True
    latest = {name: r for run in sorted(by_run) for name, r in by_run[run].items()}
    return (latest, False) if enough(set(latest)) else None


def latest_rows(rows: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[Any, dict[str, Any]]:
    """key -> the row a merged report's table shows for it: the latest ok row, else the latest
    row; the rows ``run_pair`` divides where that run measured both sides, so a table row shows
    the figures its ratios come from."""
    chosen: dict[Any, dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r.get("run", 0)):
        k = key(r)
        if k not in chosen or r["status"] == "ok" or chosen[k]["status"] != "ok":
            chosen[k] = r
    return chosen


def write_outputs(payload: dict, prefix: str, no_plot: bool, log, markdown: str, draw, alt: str) -> str:
    """Write PREFIX.json, PREFIX.md and (matplotlib permitting) PREFIX.png; returns the markdown."""
    paths = output_paths(prefix)
    write_json(paths["json"], payload)
    if not no_plot:
        why = try_plot(paths["png"], draw)
        if why:
            log(why)
        else:
            markdown += f"\n![{alt}]({paths['png'].name})\n"
    write_text(paths["md"], markdown)
    log(f"wrote {paths['json']} and {paths['md']}")
    return markdown


def tp_main(script: str, args: Any, body: Callable[[Any, Any, "Log"], list], render: Callable[[dict], str],
            **payload: Any) -> int:
    """The frame of a benchmark run under torchrun, one process per GPU: without CUDA, say so and
    exit 0; else per-rank logs (``args.log_dir``), the TP group, ``rows = body(args, tp, log)``
    under a hang guard (``args.hang_timeout_s``: a hang ends with every thread's traceback in the
    rank log), rank 0 writes ``args.out``.{json,md}, and a bounded shutdown."""
    missing = cuda_missing_message(script)
    if missing:
        print(missing, flush=True)
        return 0
    import torch

    from compileattn.parallel import init_tp, shutdown_tp
    from compileattn.parallel.logs import hang_guard, setup_rank_logging

    setup_rank_logging(args.log_dir, int(os.environ.get("RANK", "0")))
    log = Log()
    tp = init_tp(device="cuda")
    name = script.removesuffix(".py")
    payload = {"benchmark": name, "world_size": tp.world_size, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
               "config": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir")},
               "env": environment(), **payload, "rows": []}
    hang_guard(args.hang_timeout_s, name)
    try:
        payload["rows"] = body(args, tp, log)
    except Exception as exc:  # noqa: BLE001  (reported in the results)
        payload["error"] = short_error(exc)
        log(traceback.format_exc(limit=8))
    hang_guard(None)
    if tp.is_driver:
        print(write_outputs(payload, args.out, True, log, render(payload), None, name))
    code = 0 if "error" not in payload else 1
    if not shutdown_tp(timeout_s=20):
        os._exit(code)  # the results are written; do not wait on a stuck NCCL teardown
    return code

