"""Piece compiles in worker processes, beside the compiling process's own work.

``compile_sizes`` compiles every distinct piece once more per size with static shapes
(``piecewise.py``): 12 (OPT-125m shape) to 16 (Llama-3-8B shape) independent Inductor compiles of
0.8-1.8 s each in the compiling process on the H200 (run S7-1), which one after another took 7-12 s
of a cold start; the distinct pieces' dynamic-shape compiles, which the compile cannot return
without, took 5-11 s more one after another (3 to 4 pieces of 0.8-4.7 s, run S11-5). Inductor's
lowering is Python, so threads would share one GIL: the compiles run in worker *processes*.

- **Workers** never are forks of the compiling process while it compiles (it has CUDA
  initialised by then, threads and gigabytes of memory), nor made by multiprocessing's spawn,
  which re-runs the user's ``__main__`` module in each child. A pool of two or more forks them from
  a **fork server** (``fork_server.py``), one process that has imported torch, compileattn (its
  custom ops must be registered to unpickle a piece) and Inductor once: a fork of this process
  where that is safe (one Python thread, CUDA untouched: at decoration, before the model is built),
  else a fresh interpreter. Eight fresh interpreters importing at once were ready only 10-16 s after
  they started (S7-1, S11-5). A pool of one, or one whose server cannot fork (it says why, logged),
  starts fresh interpreters (``python -c``). Either kind talks to the compiling process over two
  pipes (length-prefixed pickles), its stdin and stdout; whatever a worker prints goes to its
  stderr.
- **Start early**: the fork server at ``@compileattn.compile``'s decoration
  (``start_fork_server_early``; by default only where it can be a fork then), its import
  overlapping the model's build; the workers at ``prestart`` (``@compileattn.compile`` calls it
  when its first call will compile, before Dynamo traces) or, at the latest, the backend's
  ``acquire``.
- **A task** is one (piece, size) compile: the piece's graph (GraphPickler, node metadata other
  than stack traces and example values dropped: Dynamo's other metadata holds sources that do not
  pickle), the Inductor options, and the settings that steer Inductor: the non-default entries of
  ``torch._inductor.config`` and ``torch._functorch.config`` (patched around the compile), the
  float32 matmul precision, reduced-precision reductions, deterministic algorithms, the default
  dtype (grad mode is off: pieces are compiled for inference). A static size's inputs go as
  (shape, stride, dtype, device), from which the worker makes fake tensors exactly as the
  in-process path does; a dynamic-shape compile (an **urgent** task) uses the graph's own example
  values, whose symbolic sizes travel with their ShapeEnv, under a tracing context of their fake
  mode, as Dynamo's is around the backend. The answer is the compiled artifact's bytes, the format
  the compile cache and warm start save, which the compiling process loads.
- **Scheduling**: a task goes to a worker only once that worker is ready and idle, urgent tasks
  first. The compiling process, once it has sent a graph's tasks, compiles the urgent tasks no
  worker has started (the newest first, while the workers take the oldest), then, rather than
  wait, those a worker is still on, keeping the first answer (``drain(urgent_only=True)``); when
  the compile waits for the static pieces too, it then compiles those no worker has started. So
  slow-starting or slow workers never hold it up. Every guard on the piece's symbolic sizes that a
  worker's dynamic-shape piece may rely on comes back with its answer, and the compiling process
  assumes them in its ShapeEnv, where an in-process compile would have left them (a replacement or
  a deferred runtime assertion is refused instead: ``compile_worker.SizeAssumptionsAdded``).
- **Failures**: a worker that does not start, answers an error, dies or runs past
  ``TASK_TIMEOUT_S`` leaves its task to the compiling process, which compiles it itself (the
  serial path; logged at INFO with why), at once while the compile waits, at the next step when the
  pieces land in the background (``landing.py``; a watchdog, ``watch``, then enforces the timeouts):
  never a wrong piece (one that fails here too keeps the dynamic-shape piece, logged).
- **Size**: ``CompileConfig.compile_workers``: "auto" is two less than the usable CPUs (per rank,
  under ``LOCAL_WORLD_SIZE`` ranks per host), at most ``MAX_AUTO_WORKERS``, and none below
  ``MIN_AUTO_WORKERS``; 0 compiles in-process. Workers are started only where there are static
  sizes to compile (``compile_sizes``).
- **Lifetime**: ``release`` (the end of every backend call) closes the workers' stdin; they exit.
  With ``CompileConfig.background_static_compiles`` (the default) the backend instead hands the
  pool, with the tasks still out, to a ``landing.StaticLanding`` (``detach``), which closes it once
  every task has its answer, or at the process's exit.
- **Priority**: workers run at niceness ``WORKER_NICENESS``, below the compiling process (a fork
  server imports at normal priority: until it is ready, no worker helps).

Inductor's own out-of-process compile (``torch._inductor.config.fx_compile_mode``, torch 2.11-2.13)
was not used: it is set process-wide from an environment variable at import, works below
AOTAutograd on one graph at a time through a pool of one subprocess, and so compiles nothing in
parallel.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch

from .. import _torch_compat
from . import fork_server, wire

logger = logging.getLogger("compileattn")

#: Upper bound of compile_workers="auto": 16 static compiles (Llama shape, 4 sizes) need no more to
#: finish in about two rounds, and every worker costs ~1 GB of host memory while it lives.
MAX_AUTO_WORKERS = 8
#: Fewer than this (a host of under 4 CPUs per rank) and "auto" compiles in-process: the compiling
#: process and Inductor's own compile subprocesses need the cores, and a worker's import (5-9 s of
#: CPU) does not pay for itself (2-core CPU box: 19.6 s vs 22.2 s idle, 32-36 s vs 29-30 s loaded).
MIN_AUTO_WORKERS = 2
#: Seconds ``close`` waits for a worker to exit before killing it: an idle one exits at once on
#: its closed stdin; one still importing would read it only seconds later, and left alone it took
#: CPU from whatever the process (or the next one) did next.
EXIT_WAIT_S = 0.5

#: Seconds one static compile may take in a worker before the worker is killed and the compiling
#: process compiles that piece itself (a worker alive but stuck, on a lock or a hung file system,
#: must not hang the compile, nor a landing in the background). A static piece compiles in 1-5 s
#: in a worker on the H200.
TASK_TIMEOUT_S = 300.0
#: Seconds a worker may take to become ready before the watchdog of a landing in the background
#: kills it (``watch``); ready after 10-16 s on the H200. While the compile waits, the compiling
#: process takes the tasks no worker started instead.
READY_TIMEOUT_S = 300.0
#: The compiling process compiles the tasks no worker has started once it has nothing else to do
#: (off in tests that must see the workers compile).
COMPILE_UNSTARTED_HERE = True
#: Tests only: "error" makes every worker answer each task with an error, "exit" makes it die
#: mid-task (what a crash looks like), "hang" makes it never answer; read when a task is sent.
INJECT_FAILURE: str | None = None

#: Workers run at this niceness: the compiling process's Dynamo trace and dynamic-shape compiles
#: (and, with background static compiles, the model's first steps) are what the user waits for.
#: H200 host, 16 CPUs, 8 workers importing torch at normal priority: Dynamo's trace of the OPT-125m
#: shape took 3.6 s instead of 1.3 s without workers, the Llama-3-8B shape's 6.9 s instead of 4.4 s
#: (run S7-1); niced, 1.5 s against 1.3 and 4.2 s against 3.9 (S7-3).
WORKER_NICENESS = 10

#: Pools of at least this many workers fork them from one process that imported once
#: (``fork_server.py``); below, each worker is a fresh interpreter (a fork server is one more
#: process importing torch, which one worker does not amortise). Off (False): always fresh.
FORK_MIN_WORKERS = 2
FORK_WORKERS = True

def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_count(setting: int | str) -> int:
    """Workers for ``CompileConfig.compile_workers``."""
    if setting != "auto":
        return max(0, int(setting))
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    workers = min(MAX_AUTO_WORKERS, usable_cpus() // ranks - 2)
    return workers if workers >= MIN_AUTO_WORKERS else 0


@dataclasses.dataclass
class Task:
    """One piece compile (a static size, or dynamic shapes). ``message`` is what the worker gets; ``result`` is set once it is done:
    ("ok", artifact bytes, seconds, worker pid, the guards its code relies on, ``compile_worker.compile_message``)
    or ("error", why[, the worker's traceback])."""

    id: int
    label: str
    message: dict[str, Any]
    result: tuple | None = None
    #: ``time.monotonic()`` when a worker took it
    started: float | None = None
    #: A dynamic-shape compile: the compile cannot return without it, so workers take urgent tasks
    #: first and ``drain(urgent_only=True)`` waits for these alone.
    urgent: bool = False
    #: The compiling process compiles it too (``drain``): whichever answer comes first is kept.
    duplicated: bool = False


class CompilePool:
    """Worker processes compiling ``Task``s; see the module docstring."""

    def __init__(self, workers: int, start: bool = True):
        """``start=False``: the worker processes start at ``start()``; tasks submitted before wait."""
        self.size = workers
        self._cond = threading.Condition()
        self._pending: collections.deque[Task] = collections.deque()
        self._urgent: collections.deque[Task] = collections.deque()
        #: every task submitted, and the urgent ones: ``drain`` returns once these have results
        self._submitted: list[Task] = []
        self._submitted_urgent: list[Task] = []
        self._live = workers
        self._closing = False
        self._procs: list[subprocess.Popen] = []
        #: worker index -> its process, and the task it is compiling
        self._proc_of: dict[int, subprocess.Popen] = {}
        self._running: dict[int, Task] = {}
        self._started = time.perf_counter()
        #: seconds from the pool's start to each worker's readiness (None: never became ready)
        self.ready_after: list[float | None] = [None] * workers
        self.failures: list[str] = []
        #: Called on a worker's thread after each result and when a worker stops (``landing.py``).
        self.on_result: Callable[[], None] | None = None
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"compileattn-compile-worker-{i}",
                                          daemon=True) for i in range(workers)]
        self.started = False
        self._fork_server: fork_server.ForkServer | None = None
        _pools.add(self)
        if start:
            self.start()

    def _forget_after_fork(self) -> None:
        """In a fork of the process that runs this pool (a pre-forking server forking while static
        pieces land in the background): the workers, their threads and the fork server are the
        parent's. The child keeps no copy of what reaches them (a copy of a worker's stdin kept it
        from seeing EOF, of the server's socket kept the server alive while the child lived), and
        its own ``close`` at its exit (``StaticLanding.close``) must not kill the parent's workers
        (a ``ForkedWorker``'s pidfd reaches them from any process) nor shut down the parent's
        connection to the server. No thread serves the pool here, so every task without an
        answer is answered with an error: a landing in the child compiles it in-process, as for a
        worker that died, rather than waiting for an answer that never comes (its exit waited the
        whole ``EXIT_WAIT_FOR_STATIC_S`` for nothing). Locks are made anew: a thread of the parent
        may have held them at the fork."""
        self._cond = threading.Condition()
        self._closing, self._live, self.started = True, 0, True
        self._threads = []
        procs, self._procs, self._proc_of, self._running = self._procs, [], {}, {}
        for proc in procs:
            for stream in (getattr(proc, "stdin", None), getattr(proc, "stdout", None)):
                _orphan_stream(stream)
            pidfd = getattr(proc, "_pidfd", None)
            if pidfd is not None:
                proc._pidfd = None
                try:
                    os.close(pidfd)
                except OSError:
                    pass
            proc.kill = lambda: None  # the parent's worker, whatever still holds this handle here
        # Kept, not collected: closing a buffered pipe whose lock a thread of the parent held at
        # the fork (in the middle of a message) would block here for good.
        _inherited_handles.extend(procs)
        server, self._fork_server = self._fork_server, None
        if server is not None:
            server.forget()
        why = "the compile pool belongs to the process this one was forked from"
        for task in self._submitted:
            if task.result is None:
                task.result = ("error", why)
        self._urgent.clear()
        self._pending.clear()

    def start(self) -> None:
        """Start the worker processes (once)."""
        if self.started:
            return
        self.started = True
        self._started = time.perf_counter()
        self._fork_server = _start_fork_server(self.size)
        for index, t in enumerate(self._threads):
            try:
                t.start()
            except RuntimeError as exc:  # "can't start new thread": a thread or memory limit
                # The threads started serve (with none, everything is compiled in-process); the
                # pool must not raise with them running, or nobody would close it and its workers.
                logger.info("compileattn: %d of %d compile workers not started (%s)", self.size - index,
                            self.size, exc)
                with self._cond:
                    self._threads = self._threads[:index]
                    self._live -= self.size - index
                    self._cond.notify_all()
                break

    # -- the compiling process's side ------------------------------------------------------------

    def submit(self, task: Task) -> None:
        with self._cond:
            (self._urgent if task.urgent else self._pending).append(task)
            self._submitted.append(task)
            if task.urgent:
                self._submitted_urgent.append(task)
            self._cond.notify()

    def settle(self, task: Task, result: tuple) -> bool:
        """Give ``task`` its result unless it has a usable one (a worker's or the compiling
        process's answer to a duplicated task came first; a worker's error is replaced);
        whether this one was kept."""
        with self._cond:
            if task.result is not None and task.result[0] != "error":
                return False
            task.result = result
            self._cond.notify_all()
            return True

    def drain(self, compile_here: Callable[[Task], None], urgent_only: bool = False) -> None:
        """Return once every submitted task (``urgent_only``: every urgent one) has a result.
        ``compile_here`` compiles a task here and ``settle``s it: the tasks no worker took, urgent
        ones first, the newest first, while the workers go on from the oldest (only once no worker
        is left, if ``COMPILE_UNSTARTED_HERE`` is off); then, rather than wait idle, the urgent
        tasks still running in a worker, the oldest first, whichever answer comes first being
        kept. A worker compiles one piece at a time with Inductor's Triton compiles one after
        another, beside the other workers' compiles: the Llama-3-8B shape's first piece took 6.0 s
        in a worker against 2.8 s here (runs S12-4, S12-3), the compiling process waiting for it."""
        tasks = self._submitted_urgent if urgent_only else self._submitted
        while True:
            with self._cond:
                while True:
                    queue = self._urgent or (None if urgent_only else self._pending)
                    if queue and (COMPILE_UNSTARTED_HERE or self._live == 0):
                        task = queue.pop()
                        break
                    if all(t.result is not None for t in tasks):
                        return
                    straggler = next((t for t in self._submitted_urgent if t.result is None and t.started is not None
                                      and not t.duplicated), None) if COMPILE_UNSTARTED_HERE else None
                    if straggler is not None:
                        task = straggler
                        task.duplicated = True
                        break
                    self._cond.wait(self._kill_overdue())
            compile_here(task)

    def _kill_overdue(self) -> float:
        """Kill the workers whose task has run past ``TASK_TIMEOUT_S`` (their threads then hand the
        task back as failed, and ``finish`` compiles it here); seconds until the next deadline.
        Called with ``_cond`` held."""
        now, wait = time.monotonic(), TASK_TIMEOUT_S
        for index, task in list(self._running.items()):
            left = task.started + TASK_TIMEOUT_S - now
            if left <= 0:
                proc = self._proc_of.get(index)
                if proc is not None and proc.poll() is None:
                    logger.info("compileattn: compile worker %d (pid %d) took over %.0f s on %s; killed, "
                                "the compiling process compiles it", index, proc.pid, TASK_TIMEOUT_S, task.label)
                    proc.kill()
                self._running.pop(index, None)
            else:
                wait = min(wait, left)
        return max(wait, 0.05)

    @property
    def live_workers(self) -> int:
        return self._live

    def fail_pending(self, why: str) -> None:
        """Answer every task no worker has taken with an error (no worker is left to take it)."""
        with self._cond:
            self._fail_pending(why)
            self._cond.notify_all()

    def _fail_pending(self, why: str) -> None:
        """``fail_pending`` with ``_cond`` held."""
        for queue in (self._urgent, self._pending):
            while queue:
                queue.popleft().result = ("error", why)

    def watch(self) -> None:
        """Enforce ``TASK_TIMEOUT_S`` and ``READY_TIMEOUT_S`` from a thread of its own until the
        pool closes: with nobody in ``drain`` (static pieces landing in the background), a worker
        stuck on a task or in its import would otherwise hold its tasks for good."""
        threading.Thread(target=self._watch, name="compileattn-compile-watchdog", daemon=True).start()

    def _watch(self) -> None:
        with self._cond:
            while not self._closing:
                wait = min(self._kill_overdue(), self._kill_unready())
                self._cond.wait(wait)

    def _kill_unready(self) -> float:
        """Kill the workers not ready ``READY_TIMEOUT_S`` after the pool started (their threads
        then stop serving); seconds until the next such deadline. Called with ``_cond`` held."""
        left = READY_TIMEOUT_S - (time.perf_counter() - self._started)
        unready = [(i, proc) for i, proc in self._proc_of.items() if self.ready_after[i] is None and proc.poll() is None]
        if not unready:
            return READY_TIMEOUT_S
        if left > 0:
            return max(left, 0.05)
        for index, proc in unready:
            logger.info("compileattn: compile worker %d (pid %d) not ready after %.0f s; killed", index,
                        proc.pid, READY_TIMEOUT_S)
            proc.kill()
        return READY_TIMEOUT_S

    def _notify(self) -> None:
        callback = self.on_result
        if callback is not None:
            callback()

    def close(self, wait: bool = False, kill: bool = False) -> None:
        """Tell the workers to exit (closing their stdin; one still importing, which would read
        that only seconds later, is killed, and with ``kill`` one still compiling too); ``wait``:
        until they have. Tasks no worker took are answered with an error."""
        with self._cond:
            self._closing = True
            self._fail_pending("the compile pool was closed")
            self._cond.notify_all()
            unready = [proc for index, proc in self._proc_of.items()
                       if kill or self.ready_after[index] is None]
        if self._fork_server is not None:
            self._fork_server.close()
        for proc in unready:
            if proc.poll() is None:
                proc.kill()
        if wait:
            self.join()

    def join(self, timeout: float = EXIT_WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads if self.started else ():  # an unstarted pool has no thread to join
            t.join(max(0.0, deadline - time.monotonic()))
        for proc in list(self._procs):
            if proc.poll() is None:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- one thread per worker ---------------------------------------------------------------------

    def _next(self, index: int) -> Task | None:
        with self._cond:
            while not self._urgent and not self._pending and not self._closing:
                self._cond.wait()
            if self._closing:
                return None
            task = (self._urgent or self._pending).popleft()
            task.started = time.monotonic()
            self._running[index] = task
            self._cond.notify_all()  # drain's wait now has a deadline
            return task

    def _done(self, index: int, task: Task, result: tuple) -> None:
        logger.debug("compile worker %d finished %s (%s) after %.2f s", index, task.label, result[0],
                     time.monotonic() - task.started)
        with self._cond:
            if task.result is None:  # else the compiling process's duplicate came first
                task.result = result
            self._running.pop(index, None)
            self._cond.notify_all()
        self._notify()

    def _serve(self, index: int) -> None:
        proc = None
        try:
            proc = _start_worker(self._fork_server)
            with self._cond:
                self._procs.append(proc)
                self._proc_of[index] = proc
                closing = self._closing
            if not closing:
                wire.send(proc.stdin, {"sys_path": list(sys.path)})
                kind, pid, seconds = wire.receive(proc.stdout)
                self.ready_after[index] = time.perf_counter() - self._started
                logger.debug("compile worker %d (pid %d) ready after %.2f s (its imports %.2f s)", index, pid,
                             self.ready_after[index], seconds)
                while (task := self._next(index)) is not None:
                    message = dict(task.message, inject=INJECT_FAILURE)
                    try:
                        wire.send(proc.stdin, message)
                        reply = wire.receive(proc.stdout)
                    except BaseException as exc:
                        self._done(index, task, ("error", f"worker pid {proc.pid} died ({_exit_note(proc, exc)})"))
                        raise
                    self._done(index, task, reply)
        except BaseException as exc:  # noqa: BLE001 (a worker that fails just stops serving)
            why = _exit_note(proc, exc) if proc is not None else f"{type(exc).__name__}: {exc}"
            with self._cond:
                if not self._closing:
                    self.failures.append(why)
                    logger.info("compileattn: compile worker %d stopped (%s); the compiling process "
                                "compiles what the workers do not", index, why)
        finally:
            with self._cond:
                self._live -= 1
                self._cond.notify_all()
            if proc is not None:
                _close_worker(proc)
            self._notify()


def _orphan_stream(stream) -> None:
    """Point a file object's descriptor at ``/dev/null`` (in a forked child, for a pipe to a
    worker of the parent): the pipe's copy is gone at once, and the object's own close later (or a
    flush of what a parent thread had buffered) touches ``/dev/null``, never a descriptor number
    the child has reused since."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # None, or closed already
        return
    fork_server.point_at_devnull(fd)


def _exit_note(proc: subprocess.Popen | None, exc: BaseException) -> str:
    code = proc.poll() if proc is not None else None
    note = f"{type(exc).__name__}: {exc}"
    return note if code is None else f"{note}; exit status {code}"


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (fork_server.package_root(), env.get("PYTHONPATH", "")) if p)
    # One compile at a time, its Triton kernels compiled in the worker itself: no pool of pools
    # (the environment variable wins over a config patch, so it is set here too).
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    return env


def _start_worker(server: fork_server.ForkServer | None = None):
    """A worker process: forked by ``server`` when there is one that can fork, else a fresh
    interpreter (a ``subprocess.Popen``)."""
    if server is not None:
        try:
            return server.fork()
        except fork_server.ForkServerClosed:
            raise
        except fork_server.ForkError as exc:
            _note_no_fork(str(exc))
    # The answers' pipe is set aside before any import: whatever an import prints to stdout (a
    # sitecustomize, a library's banner) goes to stderr and cannot be read as a message header.
    code = (f"import os; os.nice({WORKER_NICENESS}); answers = os.dup(1); os.dup2(2, 1); "
            "from compileattn.compilation.compile_worker import main; main(answers)")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=_worker_env(), close_fds=True)


_no_fork_noted: set[str] = set()


def _note_no_fork(why: str) -> None:
    if why not in _no_fork_noted:
        _no_fork_noted.add(why)
        logger.info("compileattn: compile workers start as fresh interpreters: %s", why)


def _forks(workers: int) -> bool:
    """Whether a pool of ``workers`` forks them from a fork server."""
    return workers >= FORK_MIN_WORKERS and FORK_WORKERS and hasattr(socket, "send_fds") and os.name == "posix"


def _new_fork_server(env: dict[str, str], why_not_here: str | None) -> fork_server.ForkServer | None:
    """``why_not_here``: ``fork_server.why_not_fork_here()``, as the caller found it just now."""
    if why_not_here is not None:
        logger.debug("compileattn: the compile workers' fork server starts as a fresh interpreter: %s", why_not_here)
    try:
        return fork_server.ForkServer(env, WORKER_NICENESS, READY_TIMEOUT_S, fork_here=why_not_here is None)
    except Exception as exc:  # noqa: BLE001 (spawning failed): fresh interpreters, as without it
        _note_no_fork(f"the fork server did not start ({type(exc).__name__}: {exc})")
        return None


def _start_fork_server(workers: int) -> fork_server.ForkServer | None:
    """The fork server of a pool of ``workers`` (the one started early, if its environment is
    still the workers'), or None where forking does not pay or work (an early server then stays
    for the compile it was started for)."""
    if not _forks(workers):
        return None
    early = _take_early_fork_server()
    env = _worker_env()
    if early is not None:
        server, early_env, _ = early
        changed = _changed_since(early_env, env)
        if not changed:
            return server
        logger.debug("compileattn: the fork server started at decoration is not used: the environment changed "
                     "since (%s); starting another", ", ".join(changed[:8]))
        server.close()  # its workers would inherit the old environment
    return _new_fork_server(env, fork_server.why_not_fork_here())


#: Set by Inductor in every process before it loads a compiled C++ library: an address of this
#: process's own, which a worker's Inductor sets to its own before using it.
_INDUCTOR_PROCESS_LOCAL = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


def _changed_since(before: dict[str, str], now: dict[str, str]) -> list[str]:
    """The variables whose change since ``before`` a fork server started under ``before`` would
    not see. Not one that was unset then and has since been set to what Inductor sets it to in
    every process, which a worker's Inductor sets alike: ``TRITON_CACHE_DIR`` as compileattn
    settles it (``kernel_warmup.settled_environment``: the first call on a GPU), and what any
    Inductor compile or cache access of this process sets (``TORCHINDUCTOR_CACHE_DIR`` to its
    default, a process-local address): one compile with ``torch.compile`` between decoration and
    the first call threw the server made at decoration away."""
    from . import kernel_warmup

    settled = dict(kernel_warmup.settled_environment)
    if "TORCHINDUCTOR_CACHE_DIR" not in before and "TORCHINDUCTOR_CACHE_DIR" in now:
        default = _torch_compat.inductor_default_cache_dir()
        if default is not None:
            settled["TORCHINDUCTOR_CACHE_DIR"] = default

    def set_by_inductor(k: str) -> bool:
        return k not in before and (k == _INDUCTOR_PROCESS_LOCAL or (k in settled and now.get(k) == settled[k]))

    return sorted(k for k in set(now) | set(before) if now.get(k) != before.get(k) and not set_by_inductor(k))


#: The fork server ``start_fork_server_early`` started before any pool wanted one, with the
#: environment it was started under and (a weak reference to) the compiled function it was started
#: for; the next pool takes it. Its own lock: a pool starts (and takes it) under ``_lock``.
_early: tuple[fork_server.ForkServer, dict[str, str], Any] | None = None
_early_lock = threading.Lock()


#: Every pool not yet collected (the process-wide one, and those handed to a landing): a fork of
#: this process forgets them (``CompilePool._forget_after_fork``).
_pools: "weakref.WeakSet[CompilePool]" = weakref.WeakSet()
#: In a fork: the handles of the parent's workers, their descriptors pointed at /dev/null.
_inherited_handles: list = []


def _forget_inherited_early_server() -> None:
    """In a fork of this process (a pre-forking server's workers, multiprocessing's fork start
    method), the early fork server is the parent's, over a socket the parent shares: requests and
    answers of two processes would interleave on it (each then waited forever for an answer the
    other had read, and no static piece landed). The child forgets it, closing only its own copy
    of the socket, and starts its own when it compiles. The lock may have been held by the thread
    that forked."""
    global _early, _early_lock, _pool, _owner, _lock
    _early_lock = threading.Lock()
    early, _early = _early, None
    if early is not None:
        early[0].forget()
    # The pools too (a fork while static pieces land in the background): the workers are the
    # parent's, and so was the compile that claimed the process-wide one.
    _lock = threading.Lock()
    _pool, _owner = None, None
    for pool in list(_pools):
        pool._forget_after_fork()
    _torch_compat.forget_inductor_compile_pools()  # the child compiles what its landings still await


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_early_server)


def start_fork_server_early(workers: int, only_forked: bool = False, owner: Any = None) -> bool:
    """Start the fork server now, before the first call (``@compileattn.compile`` at decoration),
    so that its imports overlap the model's build and weight loading rather than the first call:
    started with the first call as a fresh interpreter, it was ready only 9-13 s in on the H200
    (runs S12-3..5), after the compiling process had done every dynamic-shape compile itself.
    ``only_forked``: only if it can be a fork of this process (``fork_server.why_not_fork_here``),
    ready one Inductor import later. ``owner``: the compiled function it is started for, whose
    first call drops it if no pool takes it (``drop_early_fork_server``). Whether one runs now."""
    global _early
    if not _forks(workers):
        return False
    why_not_here = fork_server.why_not_fork_here()
    if only_forked and why_not_here is not None:
        logger.debug("compileattn: the compile workers' fork server starts with the first call: %s", why_not_here)
        return False
    with _early_lock:
        if _early is not None or _pool is not None:
            return _early is not None
        env = _worker_env()
        server = _new_fork_server(env, why_not_here)
        if server is None:
            return False
        _early = (server, env, None if owner is None else weakref.ref(owner))
    logger.debug("compileattn: the compile workers' fork server (pid %d, %s) started before the first call",
                 server.pid, "a fork of this process" if server.forked_here else "a fresh interpreter")
    atexit.register(drop_early_fork_server)
    return True


def _take_early_fork_server(owner: Any = None) -> tuple[fork_server.ForkServer, dict[str, str], Any] | None:
    """The early server, taken: any (``owner`` None), or only if started for ``owner``."""
    global _early
    with _early_lock:
        early = _early
        if early is not None and owner is not None and (early[2] is None or early[2]() is not owner):
            return None
        _early = None
        return early


def drop_early_fork_server(owner: Any = None) -> None:
    """Close the early fork server if no pool took it: at ``owner``'s first call (a warm start, a
    first call without static compiles: another function's server stays for that function), or
    at the process's exit (``owner`` None): killed if still importing."""
    early = _take_early_fork_server(owner)
    if early is not None:
        early[0].close()


def _close_worker(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    try:
        proc.stdout.close()
    except OSError:
        pass


def static_input_specs(args: Sequence[Any], token_symbol, size: int) -> list[tuple]:
    """The piece's inputs with the token count fixed to ``size``, as plain data: ("tensor", shape,
    stride, dtype, device) or ("value", v). Other symbols (a lifted buffer size) take their hints."""
    def concrete(x) -> int:
        return _torch_compat.symbolic_size_value(x, token_symbol, size)

    specs = []
    for a in args:
        if isinstance(a, torch.Tensor):
            specs.append(("tensor", tuple(concrete(d) for d in a.shape), tuple(concrete(d) for d in a.stride()),
                          a.dtype, str(a.device)))
        else:
            specs.append(("value", concrete(a) if isinstance(a, torch.SymInt) else a))
    return specs


def static_args_from_specs(specs: Sequence[tuple]) -> list[Any]:
    """Example inputs of ``static_input_specs``: fresh fake tensors of a FakeTensorMode without a
    ShapeEnv (so Inductor specialises every shape), no real memory. A compile worker makes
    them the same way."""
    out = []
    with _torch_compat.unset_fake_temporarily(), _torch_compat.static_fake_mode():
        for spec in specs:
            if spec[0] == "tensor":
                _, shape, stride, dtype, device = spec
                out.append(torch.empty_strided(shape, stride, dtype=dtype, device=device))
            else:
                out.append(spec[1])
    return out


def unsendable_context() -> str | None:
    """Why this thread's static compiles must stay in-process, or None: state that steers
    Inductor's re-trace of a piece (it applies autocast, for one, where Dynamo's graph has no
    casts) but is not sent to a worker."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            return f"autocast is on for {device_type}"
    if _torch_compat.dispatch_stack_depth()():
        return "a torch dispatch mode is active"
    return None


# -- the process-wide pool ---------------------------------------------------------------------------

_pool: CompilePool | None = None
#: The thread whose compile is using ``_pool`` (``acquire``), None while unclaimed. One compile at
#: a time: task ids are per compile and ``drain`` takes any pending task, so two compiles (two
#: threads making first calls) sharing the workers would get each other's pieces.
_owner: int | None = None
_lock = threading.Lock()


def prestart(workers: int, start: bool = True) -> CompilePool | None:
    """Start the workers (if none run and ``workers`` > 0): their import overlaps what the
    compiling process does until the first static compile. ``start=False``: make the pool, its
    processes started later by ``CompilePool.start``."""
    global _pool
    if workers <= 0:
        return None
    with _lock:
        if _pool is None:
            try:
                _pool = CompilePool(workers, start=start)
            except Exception as exc:  # noqa: BLE001 (threads unavailable, ...): compile in-process
                logger.info("compileattn: compile workers not started (%s: %s); compiling in-process",
                            type(exc).__name__, exc)
                return None
        elif start:
            _pool.start()  # one made unstarted earlier, now wanted running
        return _pool


def acquire(workers: int, start: bool = True) -> CompilePool | None:
    """The running pool (``prestart``'s), else a new one of ``workers``, claimed by this thread's
    compile; None for in-process, which is also what a compile gets while another thread's uses
    the workers."""
    global _owner
    me = threading.get_ident()
    with _lock:
        if _owner is not None and _owner != me:
            logger.info("compileattn: another thread's compile is using the compile workers; this one "
                        "compiles its static pieces in-process")
            return None
    pool = prestart(workers, start=start)
    with _lock:
        if pool is None or _pool is not pool or (_owner is not None and _owner != me):
            return None
        _owner = me
        return pool


def release(wait: bool = False) -> None:
    """Stop the pool, unless another thread's compile has claimed it (its workers exit once idle;
    one still importing is killed)."""
    global _pool, _owner
    with _lock:
        if _owner is not None and _owner != threading.get_ident():
            return
        pool, _pool, _owner = _pool, None, None
    if pool is not None:
        pool.close(wait=wait)


def current() -> CompilePool | None:
    return _pool


def detach() -> CompilePool | None:
    """Hand this thread's claimed pool over to the caller (``landing.py``), who closes it: it is
    no longer the process-wide pool, so ``release`` leaves it running and the next compile starts
    its own."""
    global _pool, _owner
    with _lock:
        if _pool is None or _owner != threading.get_ident():
            return None
        pool, _pool, _owner = _pool, None, None
        return pool
