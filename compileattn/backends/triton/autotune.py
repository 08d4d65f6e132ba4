"""Autotuning of the paged decode launch at plan time, per decode shape, cached.

The heuristics of ``config.py`` are starting points measured on one GPU; the autotuner times the
heuristic launch and its neighbours on the GPU it runs on and keeps the fastest whose output
matches the heuristic's. It is opt-in (``TritonBackend.enable_autotune``): every candidate is a
Triton compile, which a cold start pays once per decode shape unless the choice is cached.

What a choice may depend on: a CUDA graph captured for a batch size replays at every context
length, so a launch configuration may depend only on what is fixed for a capture: the number of
sequences (a capture size), the layer's head counts and head dim, the page size, the dtypes, ALiBi
and the GPU (``DecodeShape``). Not on the context: candidates are timed on a synthetic decode step
of ``context`` keys per sequence (default 1024), and the choice then serves every context. (A
choice per context bucket would need a graph per (batch, context bucket).)

Candidates (``candidates``): the heuristic configuration and its neighbours one step away in each
knob: keys per tile x1/2 and x2 (within 16..128), the other pipeline depth (2 <-> 3), the other
warp count (4 <-> 8), split-KV count x1/2 and x2 (within 1..``MAX_SPLITS``): at most 8 launches.

Choices are kept per process and, with a ``cache_dir`` (a directory only this user can write, as
every compileattn cache), in ``triton_decode_autotune.json`` there, so a later process compiles
only the winner.
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
#: Tuning fields a choice sets (the rest of the backend's tuning is kept).
_CHOSEN_FIELDS = ("decode_block_n", "decode_num_warps", "decode_num_stages", "num_splits")


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

    def key(self) -> str:
        return "|".join(str(v) for v in dataclasses.astuple(self))


def candidates(base: Tuning, cfg: DecodeConfig, splits: int) -> list[Tuning]:
    """The heuristic (``base`` as it is, first) and its neighbours, without repeats."""
    options = [base]
    for block_n in (cfg.block_n // 2, cfg.block_n * 2):
        if 16 <= block_n <= 128:
            options.append(dataclasses.replace(base, decode_block_n=block_n))
    options.append(dataclasses.replace(base, decode_num_stages=2 if cfg.num_stages >= 3 else 3))
    options.append(dataclasses.replace(base, decode_num_warps=8 if cfg.num_warps == 4 else 4))
    for s in (splits // 2, splits * 2):
        if 1 <= s <= MAX_SPLITS and s != splits:
            options.append(dataclasses.replace(base, num_splits=s))
    unique: list[Tuning] = []
    for t in options:
        if t not in unique:
            unique.append(t)
    return unique


def cuda_event_timer(fn: Callable[[], None], reps: int = 20) -> float:
    """GPU µs per call of ``fn``: ``reps`` calls back to back between two CUDA events, after
    three warm-up calls (the first compiles)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


@dataclasses.dataclass
class Trial:
    """One candidate's result (``us`` None when it failed or disagreed with the heuristic)."""

    tuning: Tuning
    us: float | None
    note: str = ""


class DecodeAutotuner:
    """Chooses a ``Tuning`` per ``DecodeShape``; see the module docstring."""

    def __init__(self, cache_dir: str | Path | None = None, context: int = 1024,
                 timer: Callable[[Callable[[], None]], float] = cuda_event_timer, tolerance: float = 1e-2):
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        self.context = context
        self.timer = timer
        self.tolerance = tolerance
        self.path: Path | None = None
        if cache_dir is not None:
            from ...compilation.cache import secure_dir

            self.path = secure_dir(cache_dir) / CACHE_FILE
        self._chosen: dict[str, Tuning] = self._load()
        #: Every tuning run of this process: key -> trials (benchmarks and logs report them).
        self.trials: dict[str, list[Trial]] = {}

    def tuning_for(self, shape: DecodeShape, options: Sequence[Tuning],
                   run: Callable[[Tuning], Callable[[], torch.Tensor]]) -> Tuning:
        """The fastest of ``options`` (the first is the heuristic) for ``shape``: from the cache,
        else timed. ``run(tuning)`` prepares a candidate and returns a call that runs it on the
        synthetic step and returns its output."""
        key = shape.key()
        chosen = self._chosen.get(key)
        if chosen is not None:
            return _with_base(chosen, options[0])
        trials, reference = [], None
        for tuning in options:
            try:
                call = run(tuning)
                out = call().float().clone()
                if reference is None:
                    reference = out
                elif not _close(out, reference, self.tolerance):
                    trials.append(Trial(tuning, None, "output differs from the heuristic's"))
                    logger.warning("decode autotune %s: candidate %s gives a different output; not used", key, tuning)
                    continue
                trials.append(Trial(tuning, self.timer(call)))
            except Exception as exc:  # noqa: BLE001  (a candidate that cannot run is not chosen)
                if reference is None:
                    raise  # the heuristic itself: what every untuned launch runs
                trials.append(Trial(tuning, None, f"{type(exc).__name__}: {exc}"))
                logger.info("decode autotune %s: candidate %s failed: %s", key, tuning, exc)
        timed = [t for t in trials if t.us is not None]
        best = min(timed, key=lambda t: t.us)
        self.trials[key] = trials
        logger.info("decode autotune %s: %s at %.1f µs (heuristic %.1f µs, %d candidates)", key,
                    describe(best.tuning), best.us, timed[0].us, len(options))
        self._chosen[key] = best.tuning
        self._save(key, best.tuning)
        return best.tuning

    # -- the cache file ----------------------------------------------------------------------

    def _load(self) -> dict[str, Tuning]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            raw = json.loads(self.path.read_text())
            return {k: Tuning(**{f: v[f] for f in _CHOSEN_FIELDS}) for k, v in raw.items()}
        except (ValueError, TypeError, KeyError) as exc:
            logger.warning("decode autotune: ignoring unreadable %s (%s)", self.path, exc)
            return {}

    def _save(self, key: str, tuning: Tuning) -> None:
        if self.path is None:
            return
        from ...compilation.cache import write_atomic

        current: dict[str, Any] = {}
        if self.path.exists():
            try:
                current = json.loads(self.path.read_text())
            except ValueError:
                current = {}
        current[key] = _chosen_fields(tuning)
        write_atomic(self.path, json.dumps(current, indent=1, sort_keys=True).encode())


def describe(tuning: Tuning) -> str:
    """The knobs a choice set, e.g. "decode_block_n=32 num_splits=8" ("heuristic" for none)."""
    return " ".join(f"{f}={v}" for f, v in _chosen_fields(tuning).items() if v is not None) or "heuristic"


def _chosen_fields(tuning: Tuning) -> dict[str, Any]:
    return {f: getattr(tuning, f) for f in _CHOSEN_FIELDS}


def _with_base(chosen: Tuning, base: Tuning) -> Tuning:
    """``base`` with a cached choice's fields (a choice stores only what tuning decides)."""
    return dataclasses.replace(base, **_chosen_fields(chosen))


def _close(out: torch.Tensor, reference: torch.Tensor, tolerance: float) -> bool:
    """Norm-relative agreement on the finite entries, and non-finite entries in the same places
    (a cache not yet written may hold anything; a right kernel propagates it alike)."""
    finite = torch.isfinite(reference)
    if not torch.equal(torch.isfinite(out), finite):
        return False
    out, reference = out[finite], reference[finite]
    scale = reference.norm().clamp_min(1e-30)
    return float((out - reference).norm() / scale) <= tolerance
