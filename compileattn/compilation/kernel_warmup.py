"""The first step's Triton attention kernels, compiled in other processes while the first call
compiles the model.

A cold start's first run launched the KV-write, decode and combine kernels for the first time and
compiled them then, one after another: 1.7-1.8 s of it on the H200 (OPT-125m and Llama-3-8B shapes,
run S12-5), after Dynamo and Inductor were done. The step's prepared calls exist before the model
runs (``set_forward_context`` builds them) and know every argument but the query and output,
whose likely form they record (``backends/triton/direct.py``: ``DirectKernel.expect``). So the
first call, before Dynamo traces, computes each awaiting variant's compile spec and starts one
process per variant (``backends/triton/compile_ahead.py``: it imports only Triton and the kernel
modules, a fraction of a second) that compiles it into Triton's disk cache, where the first
launch finds it. A first launch that comes while they still compile waits for them
(``direct.wait_for_ahead``), at most ``WAIT_S``, rather than compiling the same variant twice:
any first launch, the first one to come, once (a variant that was not compiled ahead, a
quantized KV write, say, waits too, as long as they run, about 2 s). A compile process exits as
soon as the compiling process is gone (killed, or exited first): it compiles for nobody then.

Processes, not a thread: in a thread of the compiling process the compiles held the GIL most of
the time, and on the H200 they stretched from 1.7 to 6.9 s (OPT) and 9.8 s (Llama) beside Dynamo's
trace, slowing it (run S13-1).
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time

from .. import _torch_compat
from ..backends.triton import compile_ahead

log = logging.getLogger("compileattn")

#: Seconds a first launch waits for the compiles ahead before compiling its variant itself (they
#: take 1-2 s; a stuck one must not hold the model up).
WAIT_S = 60.0
#: At most this many variants compiled ahead (distinct variants of a first step: 2-3 per kind of
#: layer); the rest are left to their first launch. The processes run at normal priority, beside
#: the compiling process's one busy core: niced, they would risk finishing after the compile,
#: which then waits for them.
MAX_PROCESSES = 8

#: Run by path: importing it here imports only the standard library (the package ``__init__``
#: imports nothing).
_SCRIPT = compile_ahead.__file__


def start() -> int:
    """Start compiling the current forward context's awaiting kernel variants (compiled Triton on
    CUDA) in other processes, into the Triton cache this process reads (``settle_cache_dir``,
    which the first call ran first); how many were started. Never raises: whatever fails here
    leaves the kernels to their first launch (logged at DEBUG)."""
    from .. import context

    current = context._current
    # No prepared Triton call can exist unless its module was imported: do not import Triton here.
    direct = sys.modules.get("compileattn.backends.triton.direct")
    if current is None or current.metadata.device.type != "cuda" or direct is None:
        return 0
    try:
        from ..backends.triton import _mode

        if _mode.interpreting() or not direct.has_awaiting():
            return 0
        from triton.runtime import driver

        specs = direct.awaiting_specs(driver.active.get_current_target(), limit=MAX_PROCESSES)
        return launch(specs) if specs else 0
    except Exception as exc:  # noqa: BLE001 (an optimisation: the first launches compile instead)
        log.debug("compileattn: the attention kernels are not compiled ahead (%s: %s)", type(exc).__name__, exc)
        return 0


#: The environment variables ``_settle_cache_dir`` set, with their values: what Inductor sets them
#: to itself, in any process, at its first Triton kernel (``compile_pool`` does not count them as a
#: change of the environment a fork server started under).
settled_environment: dict[str, str] = {}


def settle_cache_dir() -> None:
    """At the start of a first call on a GPU, cold or warm, before any Triton kernel launches: the
    attention kernels must be looked up where the cold run compiled them. Without it a program
    that leaves ``TRITON_CACHE_DIR`` unset compiles the KV-write, decode and combine kernels again
    on every warm start (2.05 s of the OPT shape's 4.74 s first call, run S19-1): a cold run's
    launches come after Inductor (or this module) has set it, a warm run's, with no compile, before. With
    any piece compiler (eager pieces, another backend too): the attention kernels live in
    Inductor's cache directory then, one rule for every first call."""
    from .. import context

    current = context._current
    if current is not None and current.metadata.device.type == "cuda":
        _settle_cache_dir(current.metadata.device)


def _settle_cache_dir(device) -> None:
    """Fix ``TRITON_CACHE_DIR`` now if it is unset, to what Inductor sets it to when it builds its
    first Triton kernel (later in this first call): otherwise the compile processes would write to
    Triton's default directory and the first launches, after Inductor's change, read another."""
    if os.environ.get("TRITON_CACHE_DIR") is None:
        directory = _torch_compat.inductor_triton_cache_dir(device.index or 0)
        if directory is not None:
            os.environ["TRITON_CACHE_DIR"] = settled_environment["TRITON_CACHE_DIR"] = directory


def launch(specs: list[dict]) -> int:
    """One compile process per spec; the next first launch waits for them."""
    from ..backends.triton import direct

    from triton import knobs

    started = time.perf_counter()
    # The cache this process reads: a directory set through Triton's knobs rather than the
    # environment would otherwise not reach the compile processes.
    env = dict(os.environ, TRITON_CACHE_DIR=str(knobs.cache.dir))
    procs = []
    for spec in specs:
        try:
            payload = pickle.dumps(spec)
            # this process's pid: the compile process exits once it is gone (``compile_ahead``)
            proc = subprocess.Popen([sys.executable, "-c", f"import runpy; runpy.run_path({_SCRIPT!r}, "
                                     "run_name='__main__')", str(os.getpid())], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, close_fds=True)
        except Exception as exc:  # noqa: BLE001 (no process: the first launch compiles it)
            log.debug("compileattn: could not start compiling triton %s ahead (%s: %s)", spec["name"],
                      type(exc).__name__, exc)
            continue
        procs.append((spec["name"], proc, payload))
    if not procs:
        return 0
    done = threading.Event()
    threading.Thread(target=_collect, args=(procs, started, done), name="compileattn-kernels-ahead",
                     daemon=True).start()
    direct.set_ahead_wait(lambda: _wait(done))
    return len(procs)


def _collect(procs: list, started: float, done: threading.Event) -> None:
    """Feed each process its spec and wait for it (a thread each: they compile at once)."""
    try:
        threads = [threading.Thread(target=_feed, args=(name, proc, payload), daemon=True)
                   for name, proc, payload in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        log.debug("compileattn: %d attention kernel variants compiled ahead in other processes in %.2f s",
                  len(procs), time.perf_counter() - started)
    finally:
        done.set()


def _feed(name: str, proc: subprocess.Popen, payload: bytes) -> None:
    try:
        _, err = proc.communicate(payload, timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        log.debug("compileattn: compiling triton %s ahead took over %.0f s; killed", name, WAIT_S)
        return
    except OSError as exc:  # the process died before reading its spec
        proc.kill()
        proc.wait()
        log.debug("compileattn: compiling triton %s ahead failed (%s: %s)", name, type(exc).__name__, exc)
        return
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        log.debug("compileattn: compiling triton %s ahead failed (exit %d: %s); its first launch compiles it",
                  name, proc.returncode, tail[0])


def _wait(done: threading.Event) -> None:
    start = time.perf_counter()
    if not done.wait(WAIT_S):
        log.debug("compileattn: the attention kernels compiled ahead were not done after %.0f s", WAIT_S)
        return
    waited = time.perf_counter() - start
    if waited >= 1e-3:
        log.debug("compileattn: the first launch waited %.3f s for the kernels compiled ahead", waited)
