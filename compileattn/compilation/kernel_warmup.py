"""The first step's Triton attention kernels, compiled while the first call compiles the model.

A cold start's first run launched the KV-write, decode and combine kernels for the first time and
compiled them then, one after another: 1.7-1.8 s of it on the H200 (OPT-125m and Llama-3-8B shapes,
run S12-5), after Dynamo and Inductor were done. The step's prepared calls exist before the model
runs (``set_forward_context`` builds them) and know every argument but the query and output,
whose likely form they record (``backends/triton/direct.py``: ``DirectKernel.expect``), so a
background thread started at the first call compiles those variants while Dynamo traces and
Inductor compiles. What it compiles goes into Triton's own caches (in memory and on disk), where
the first launch finds it; a first launch that comes while it still compiles waits for it
(``direct.precompile_awaiting`` holds the lock a first launch takes) rather than compiling the
same variant twice.

A thread, not a compile worker: the workers are ready seconds after the first call starts, by
which time the thread is done; Triton's compile spends much of its time in ``ptxas`` and the C
compiler (subprocesses, the GIL released), so it costs the trace little.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

log = logging.getLogger("compileattn")

_thread: threading.Thread | None = None


def start() -> threading.Thread | None:
    """Start compiling the current forward context's awaiting kernels in a daemon thread, where
    there are any (compiled Triton on CUDA); the thread, or None."""
    global _thread
    from .. import context

    current = context._current
    if current is None or current.metadata.device.type != "cuda":
        return None
    from ..backends.triton import _mode, direct

    if _mode.interpreting() or not direct.has_awaiting():
        return None
    device = current.metadata.device
    _thread = threading.Thread(target=_compile_awaiting, args=(device,), name="compileattn-kernel-warmup",
                               daemon=True)
    _thread.start()
    return _thread


def _compile_awaiting(device: torch.device) -> None:
    from ..backends.triton import direct

    start = time.perf_counter()
    count = direct.precompile_awaiting(device)
    log.debug("compileattn: %d attention kernel variants compiled ahead of the first run in %.2f s", count,
              time.perf_counter() - start)
