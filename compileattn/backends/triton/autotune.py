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
on the context. So candidates are timed at several contexts (``contexts``, default 1024 and 4096
keys per sequence) and one choice must serve them all: a candidate replaces the heuristic when its
time relative to the heuristic's, geometric mean over the contexts, is at least ``MARGIN`` lower
and it is nowhere more than ``WORST_SLOWDOWN`` slower (H200, S9-1: 16 splits beat the heuristic's
32 for one sequence of 8 KV heads at 1024 keys, 8.3 against 9.5 µs, and lost at 4096, 14.4
against 13.2). The contexts are part of the cache key.

Candidates (``candidates``): the heuristic configuration and its neighbours one step away in each
knob the backend's tuning leaves free: keys per tile x1/2 and x2 (16..128), the other pipeline
depth (2 <-> 3), the other warp count (4 <-> 8), split-KV count x1/2 and x2 (1..``MAX_SPLITS``).

Each candidate is checked before it is timed, and again after: its output on a small step over a
private random cache (the layer's own cache may still be all zeros, which every launch "gets
right") must match the heuristic's, with the output filled with NaN first (a launch that writes
nothing fails). It is timed at each context as the GPU runs it in serving, inside a CUDA graph
of back-to-back calls (no host launch cost between them), over the layer's own caches, each call
reading other pages (rotations past the L2 cache), so the time is HBM's, not L2's; a context
longer than the cache holds for every sequence without reading a page twice is timed at what it
holds. A candidate must beat the heuristic by ``MARGIN`` to be chosen: noise does not flip the
choice from run to run.

Choices are kept per process and, with a ``cache_dir`` (a directory only this user can write, as
every compileattn cache), in ``triton_decode_autotune.json`` there, keyed with this file's schema,
Triton's version and the contexts timed; entries that do not validate are ignored. A choice is
stored as explicit knobs (tile keys, warps, stages, tail stages, splits: the configuration that
was timed), never as "the heuristic", whose meaning changes with ``config.py``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .config import MAX_SPLITS, DecodeConfig, Tuning

logger = logging.getLogger("compileattn")

CACHE_FILE = "triton_decode_autotune.json"
#: Bumped when a key's meaning or the kernels' knobs change.
SCHEMA = 2
#: A candidate replaces the heuristic only if it is this much faster (geometric mean over the
#: contexts: noise does not flip the choice from run to run) ...
MARGIN = 0.03
#: ... and at no context slower than this.
WORST_SLOWDOWN = 0.01
#: Keys per sequence of the timed steps.
DEFAULT_CONTEXTS = (1024, 4096)
#: Tuning fields a choice sets, and the values each may take.
_KNOBS: dict[str, Callable[[Any], bool]] = {
    "decode_block_n": lambda v: v in (16, 32, 64, 128),
    "decode_num_warps": lambda v: v in (4, 8),
    "decode_num_stages": lambda v: v in (1, 2, 3, 4),
    "decode_tail_stages": lambda v: v in (0, 1, 2, 3, 4),
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
    which compiles, and ``warm_up_for_capture`` on a side stream), ``replays`` replays between two
    events."""
    from ...compilation.cudagraph import replay_gpu_us, warm_up_for_capture

    fn(0)
    torch.cuda.synchronize()
    warm_up_for_capture(functools.partial(fn, 0), times=calls)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA call (an NCCL watchdog, a second planner) must not
    # invalidate this capture, as the default global mode lets it (compilation/cudagraph.py).
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(calls):
            fn(i)
    return replay_gpu_us(graph, replays, warmup=1) / calls


@dataclasses.dataclass
class Candidate:
    """One prepared candidate: ``check()`` runs it on the small private step and returns its
    output; ``timed(context, i)`` runs call ``i`` of the timed step at ``context`` keys."""

    check: Callable[[], torch.Tensor]
    timed: Callable[[int, int], None]


@dataclasses.dataclass
class Trial:
    """One candidate's result: µs per call at each context (None when it failed or disagreed
    with the heuristic) and, once the heuristic's are known, ``ratio``: the geometric mean over
    the contexts of its time ÷ the heuristic's."""

    tuning: Tuning
    us: dict[int, float] | None
    note: str = ""
    ratio: float | None = None


class DecodeAutotuner:
    """Chooses a ``Tuning`` per ``DecodeShape``; see the module docstring."""

    def __init__(self, cache_dir: str | Path | None = None, contexts: Sequence[int] = DEFAULT_CONTEXTS,
                 timer: Callable[[Callable[[int], None]], float] = cuda_graph_timer, tolerance: float = 1e-2):
        contexts = (contexts,) if isinstance(contexts, int) else tuple(contexts)
        if not contexts or not all(isinstance(c, int) and c >= 1 for c in contexts):
            raise ValueError(f"contexts must be positive key counts, got {contexts!r}")
        self.contexts = tuple(sorted(set(contexts)))
        self.timer = timer
        self.tolerance = tolerance
        self.path: Path | None = None
        if cache_dir is not None:
            from ...compilation.cache import secure_dir

            self.path = secure_dir(cache_dir) / CACHE_FILE
        #: key -> the choice (this process: tuned, or read from the cache file).
        self.chosen: dict[str, Tuning] = {}
        self._stored: dict[str, dict[str, Any]] = self._load()
        # One tuning at a time: concurrent planners would repeat the work and the cache file's
        # read-modify-write would lose entries.
        self._lock = threading.RLock()
        #: Every tuning run of this process: key -> trials (benchmarks and logs report them).
        self.trials: dict[str, list[Trial]] = {}

    def timed_contexts(self, num_seqs: int, cache_blocks: int | None = None, page: int = 1) -> tuple[int, ...]:
        """The contexts a shape's candidates are timed at: ``contexts``, each capped at what a
        layer cache of ``cache_blocks`` pages of ``page`` keys holds for ``num_seqs`` sequences
        without reading a page twice in a call (pages shared by sequences of one wave come from
        L2: S9-3 timed 64 sequences at 4096 keys over a 1024-key cache at 6.2 TB/s, past HBM's
        4.8), without repeats."""
        if cache_blocks is None:
            return self.contexts
        fits = max(1, cache_blocks // max(1, num_seqs)) * page
        return tuple(sorted({min(c, fits) for c in self.contexts}))

    def key(self, shape: DecodeShape, contexts: Sequence[int] | None = None) -> str:
        """``shape``'s key with the contexts its choice is timed at (default ``contexts``)."""
        contexts = self.contexts if contexts is None else contexts
        return f"{shape.key()}|contexts={','.join(map(str, contexts))}"

    def cached(self, shape: DecodeShape, contexts: Sequence[int] | None = None) -> Tuning | None:
        """The choice for ``shape`` made before (this process or the cache file), else None."""
        key = self.key(shape, contexts)
        with self._lock:
            if key not in self.chosen and key in self._stored:
                self.chosen[key] = dataclasses.replace(shape.base, **self._stored[key])
            return self.chosen.get(key)

    def tuning_for(self, shape: DecodeShape, options: Sequence[Tuning], prepare: Callable[[Tuning], Candidate],
                   contexts: Sequence[int] | None = None,
                   resolve: Callable[[Tuning], Tuning] = lambda t: t) -> Tuning:
        """The choice for ``shape`` among ``options`` (the first is the heuristic): cached, else
        tried (``prepare(tuning)`` makes a candidate; ``candidate.timed`` takes each of
        ``contexts``, default ``contexts``) and timed. ``resolve`` turns the winner into
        explicit knobs (the backend resolves every knob its heuristics would fill), so a cached
        choice stays the configuration that was timed when the heuristics change. One tuning at
        a time per tuner."""
        if not options:
            raise ValueError("options: at least the heuristic is needed")
        contexts = self.contexts if contexts is None else tuple(contexts)
        with self._lock:
            chosen = self.cached(shape, contexts)
            if chosen is not None:
                return chosen
            return self._tune(shape, options, prepare, contexts, resolve)

    def _tune(self, shape, options, prepare, contexts, resolve) -> Tuning:
        key = self.key(shape, contexts)
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
                us = {c: self.timer(functools.partial(candidate.timed, c)) for c in contexts}
                if not all(math.isfinite(t) and t > 0 for t in us.values()):
                    trials.append(Trial(tuning, None, f"the timer gave {us}"))
                    continue
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
            self.chosen[key] = options[0]  # not tried again in this process; not saved
            return options[0]
        for t in trials:
            if t.us is not None:
                t.ratio = math.prod(t.us[c] / heuristic.us[c] for c in contexts) ** (1 / len(contexts))
        eligible = [t for t in trials[1:] if t.us is not None and t.ratio <= 1 - MARGIN
                    and all(t.us[c] <= heuristic.us[c] * (1 + WORST_SLOWDOWN) for c in contexts)]
        best = min(eligible, key=lambda t: t.ratio) if eligible else heuristic
        logger.info("decode autotune %s: %s (%.3f of the heuristic's time over contexts %s; %d candidates)", key,
                    describe(best.tuning), best.ratio, contexts, len(options))
        choice = resolve(best.tuning)
        self.chosen[key] = choice
        self._save(key, choice)
        return choice

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


def summarize(trials: Sequence[Trial], chosen: Tuning | None = None) -> str:
    """One line per tuning run for reports: each candidate's µs at each context (or why it has
    none) and the choice, e.g. "µs at 1024/4096 keys: heuristic 9.5/13.2, num_splits=16
    8.3/14.4 (0.98); chosen heuristic"."""
    timed = [t for t in trials if t.us is not None]
    contexts = sorted(timed[0].us) if timed else []
    parts = []
    for t in trials:
        if t.us is None:
            parts.append(f"{describe(t.tuning)} not used ({t.note})")
        else:
            ratio = "" if t is trials[0] or t.ratio is None else f" ({t.ratio:.2f})"
            parts.append(f"{describe(t.tuning)} {'/'.join(f'{t.us[c]:.1f}' for c in contexts)}{ratio}")
    head = f"µs at {'/'.join(map(str, contexts))} keys: " if contexts else ""
    tail = f"; chosen {describe(chosen)}" if chosen is not None else ""
    return head + ", ".join(parts) + tail


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
