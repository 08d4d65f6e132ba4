"""Autotuning of the paged decode launch at plan time, per decode shape, cached.

The heuristics of ``config.py`` are starting points measured on one GPU; the autotuner times the
heuristic launch and its neighbours on the GPU it runs on and keeps the fastest whose output
matches the heuristic's. It is opt-in (``TritonBackend.enable_autotune``, before the engine plans
its steps: launches already bound keep their configuration): every candidate is a Triton
compile, which a cold start pays once per decode shape unless the choice is cached.

What a choice may depend on: a CUDA graph captured for a batch size replays at every context
length, so a launch configuration may depend only on what is fixed for a capture: the number of
sequences (a capture size), the layer's head counts, head dim and softmax flags, the page size,
the dtypes, ALiBi, fp8 scales and the GPU, and the backend's own overrides (``DecodeShape``). Not
on the context: candidates are timed on a decode step of ``context`` keys per sequence (default
1024), and the choice then serves every context. (A choice per context bucket would need a graph
per (batch, context bucket).)

Candidates (``candidates``): the heuristic configuration and its neighbours one step away in each
knob the backend's tuning leaves free: keys per tile x1/2 and x2 (16..128), the other pipeline
depth (2 <-> 3), the other warp count (4 <-> 8), split-KV count x1/2 and x2 (1..``MAX_SPLITS``).

Each candidate is checked before it is timed, and again after: its output on a small step over a
private random cache (the layer's own cache may still be all zeros, which every launch "gets
right") must match the heuristic's, with the output filled with NaN first (a launch that writes
nothing fails). It is timed as the GPU runs it in serving, inside a CUDA graph of back-to-back
calls (no host launch cost between them), over the layer's own caches, each call reading other
pages (rotations past the L2 cache), so the time is HBM's, not L2's. A candidate must beat the
heuristic by ``MARGIN`` to be chosen: noise does not flip the choice from run to run.

Choices are kept per process and, with a ``cache_dir`` (a directory only this user can write, as
every compileattn cache), in ``triton_decode_autotune.json`` there, keyed with this file's schema
and Triton's version; entries that do not validate are ignored.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .config import MAX_SPLITS, DecodeConfig, Tuning

logger = logging.getLogger("compileattn")

CACHE_FILE = "triton_decode_autotune.json"
#: Bumped when a key's meaning or the kernels' knobs change.
SCHEMA = 1
#: A candidate replaces the heuristic only if it is this much faster.
MARGIN = 0.03
#: Tuning fields a choice sets, and the values each may take.
_KNOBS: dict[str, Callable[[Any], bool]] = {
    "decode_block_n": lambda v: v in (16, 32, 64, 128),
    "decode_num_warps": lambda v: v in (4, 8),
    "decode_num_stages": lambda v: v in (1, 2, 3, 4),
    "num_splits": lambda v: isinstance(v, int) and 1 <= v <= MAX_SPLITS,
}


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """Everything a decode launch configuration may depend on (see the module docstring)."""

    device_name: str
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    cache_dtype: str
    has_alibi: bool
    kv_scaled: bool
    #: The softmax's compile-time flags (sliding window, softcap).
    softmax: str
    #: The backend's own overrides, which candidates keep.
    base: Tuning

    def key(self) -> str:
        try:
            import triton

            version = triton.__version__
        except ImportError:  # pragma: no cover (the backend needs triton)
            version = "?"
        fields = [str(v) for v in dataclasses.astuple(self)[:-1]] + [describe(self.base)]
        return "|".join([f"v{SCHEMA}", f"triton {version}", *fields])


def candidates(base: Tuning, cfg: DecodeConfig, splits: int) -> list[Tuning]:
    """The heuristic (``base`` as it is, first) and its neighbours in the knobs ``base`` leaves
    free, without repeats."""
    options = [base]
    if base.decode_block_n is None:
        options += [dataclasses.replace(base, decode_block_n=n) for n in (cfg.block_n // 2, cfg.block_n * 2)
                    if 16 <= n <= 128]
    if base.decode_num_stages is None:
        options.append(dataclasses.replace(base, decode_num_stages=2 if cfg.num_stages >= 3 else 3))
    if base.decode_num_warps is None:
        options.append(dataclasses.replace(base, decode_num_warps=8 if cfg.num_warps == 4 else 4))
    if base.num_splits is None:
        options += [dataclasses.replace(base, num_splits=s) for s in (splits // 2, splits * 2)
                    if 1 <= s <= MAX_SPLITS and s != splits]
    unique: list[Tuning] = []
    for t in options:
        if t not in unique:
            unique.append(t)
    return unique


def cuda_graph_timer(fn: Callable[[int], None], calls: int = 16, replays: int = 5) -> float:
    """GPU µs per call of ``fn(i)`` (call ``i`` of a run; callers rotate inputs by it), as a CUDA
    graph replays it: ``calls`` calls captured back to back in one graph (after an eager call,
    which compiles, and a warm-up on the capture stream), ``replays`` replays between two events."""
    fn(0)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    from ...compilation.cudagraph import replay_gpu_us

    return replay_gpu_us(graph, replays, warmup=1) / calls


@dataclasses.dataclass
class Candidate:
    """One prepared candidate: ``check()`` runs it on the small private step and returns its
    output; ``timed(i)`` runs call ``i`` of the timed step."""

    check: Callable[[], torch.Tensor]
    timed: Callable[[int], None]


@dataclasses.dataclass
class Trial:
    """One candidate's result (``us`` None when it failed or disagreed with the heuristic)."""

    tuning: Tuning
    us: float | None
    note: str = ""


class DecodeAutotuner:
    """Chooses a ``Tuning`` per ``DecodeShape``; see the module docstring."""

    def __init__(self, cache_dir: str | Path | None = None, context: int = 1024,
                 timer: Callable[[Callable[[int], None]], float] = cuda_graph_timer, tolerance: float = 1e-2):
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        self.context = context
        self.timer = timer
        self.tolerance = tolerance
        self.path: Path | None = None
        if cache_dir is not None:
            from ...compilation.cache import secure_dir

            self.path = secure_dir(cache_dir) / CACHE_FILE
        self._chosen: dict[str, Tuning] = {}
        self._stored: dict[str, dict[str, Any]] = self._load()
        #: Every tuning run of this process: key -> trials (benchmarks and logs report them).
        self.trials: dict[str, list[Trial]] = {}

    def cached(self, shape: DecodeShape) -> Tuning | None:
        """The choice for ``shape`` made before (this process or the cache file), else None."""
        key = shape.key()
        if key not in self._chosen and key in self._stored:
            self._chosen[key] = dataclasses.replace(shape.base, **self._stored[key])
        return self._chosen.get(key)

    def tuning_for(self, shape: DecodeShape, options: Sequence[Tuning],
                   prepare: Callable[[Tuning], Candidate]) -> Tuning:
        """The choice for ``shape`` among ``options`` (the first is the heuristic): cached, else
        tried (``prepare(tuning)`` makes a candidate) and timed."""
        chosen = self.cached(shape)
        if chosen is not None:
            return chosen
        key = shape.key()
        trials, reference = [], None
        for tuning in options:
            try:
                candidate = prepare(tuning)
                out = candidate.check().float().clone()
                if reference is None:
                    reference = out
                elif not _close(out, reference, self.tolerance):
                    trials.append(Trial(tuning, None, "output differs from the heuristic's"))
                    logger.warning("decode autotune %s: candidate %s gives a different output; not used", key,
                                   describe(tuning))
                    continue
                us = self.timer(candidate.timed)
                if not _close(candidate.check().float(), reference, self.tolerance):
                    trials.append(Trial(tuning, None, "output differs from the heuristic's after timing"))
                    continue
                trials.append(Trial(tuning, us))
            except Exception as exc:  # noqa: BLE001  (a candidate that cannot run is not chosen)
                if reference is None:
                    raise  # the heuristic itself: what every untuned launch runs
                trials.append(Trial(tuning, None, f"{type(exc).__name__}: {exc}"))
                logger.info("decode autotune %s: candidate %s failed: %s", key, describe(tuning), exc)
        self.trials[key] = trials
        heuristic = trials[0]
        if heuristic.us is None:
            logger.warning("decode autotune %s: the heuristic itself failed its check (%s); keeping it", key,
                           heuristic.note)
            return options[0]
        best = min((t for t in trials if t.us is not None), key=lambda t: t.us)
        if best.us > heuristic.us * (1 - MARGIN):
            best = heuristic
        logger.info("decode autotune %s: %s at %.1f µs (heuristic %.1f µs, %d candidates)", key,
                    describe(best.tuning), best.us, heuristic.us, len(options))
        self._chosen[key] = best.tuning
        self._save(key, best.tuning)
        return best.tuning

    # -- the cache file ----------------------------------------------------------------------

    def _read(self) -> dict[str, Any]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("decode autotune: ignoring unreadable %s (%s)", self.path, exc)
            return {}
        if not isinstance(raw, dict):
            logger.warning("decode autotune: ignoring %s (not a JSON object)", self.path)
            return {}
        return raw

    def _load(self) -> dict[str, dict[str, Any]]:
        """The file's valid entries: every knob present, each None or an allowed value."""
        valid = {}
        for key, entry in self._read().items():
            if (isinstance(entry, dict) and set(entry) == set(_KNOBS)
                    and all(v is None or ok(v) for ok, v in ((_KNOBS[k], entry[k]) for k in _KNOBS))):
                valid[key] = entry
            else:
                logger.warning("decode autotune: ignoring invalid entry %r in %s", key, self.path)
        return valid

    def _save(self, key: str, tuning: Tuning) -> None:
        if self.path is None:
            return
        from ...compilation.cache import write_atomic

        current = self._read()
        current[key] = _knobs(tuning)
        try:
            write_atomic(self.path, json.dumps(current, indent=1, sort_keys=True).encode())
        except OSError as exc:
            logger.warning("decode autotune: could not write %s (%s)", self.path, exc)


def describe(tuning: Tuning) -> str:
    """The knobs a tuning sets, e.g. "decode_block_n=32 num_splits=8" ("heuristic" for none)."""
    return " ".join(f"{f}={v}" for f, v in dataclasses.asdict(tuning).items() if v is not None) or "heuristic"


def _knobs(tuning: Tuning) -> dict[str, Any]:
    return {f: getattr(tuning, f) for f in _KNOBS}


def _close(out: torch.Tensor, reference: torch.Tensor, tolerance: float) -> bool:
    """Norm-relative agreement on the finite entries, and non-finite entries in the same places."""
    finite = torch.isfinite(reference)
    if not torch.equal(torch.isfinite(out), finite):
        return False
    out, reference = out[finite], reference[finite]
    scale = reference.norm().clamp_min(1e-30)
    return float((out - reference).norm() / scale) <= tolerance
