"""Static-shape pieces that land after the compile returned (``background_static_compiles``).

The static compiles of a cold start run in worker processes (``compile_pool.py``), and a worker is
ready only after a fresh interpreter has imported torch: 8.5-15.6 s after it started on the H200's
host (runs S7-1, S7-3, S7-4), longer than the whole dynamic-shape compile of the OPT-125m shape
(S7-1: 7.6 s cold start without static pieces, 20.4 s waiting for them; S7-3/S7-4: 7.0/11.0 s
landing in the background, 14.7/17.5 s waiting). So the compile returns once the dynamic-shape pieces are
ready, and the static ones land while the model already runs:

- the workers' threads set each task's result and flag ``changed`` (one attribute the dispatcher
  reads per step, ``StepDispatcher._land``), so loading an artifact and swapping it in happen on the
  thread that runs the model, between two steps, never under a running step;
- until a size's static pieces land its steps run the dynamic-shape pieces: the same results within
  the dtype's tolerance, only slower;
- a piece that lands makes the dispatcher drop the CUDA graphs of its size (each piece's and the
  full graph): they were captured with the dynamic-shape code, and the next step of that size
  captures them again, in order, as a first capture would;
- a task a worker fails (an error, a death, ``compile_pool.TASK_TIMEOUT_S``, or no worker left to
  take it) is compiled in-process when it lands (``resolve``, logged), one per step: a hitch of
  1-5 s in that step. Never a wrong piece; one that cannot be compiled here either keeps the
  dynamic-shape piece for its size (logged), and then no warm start file is written;
- ``drain`` (a caller that blocks anyway, such as an engine about to capture its graphs) also
  compiles in-process the tasks no worker has started, as a compile that waits would;
- once every task has its answer the pool's workers are told to exit (on the pool's thread), and
  whoever waits for the landing (the warm start's save, ``wait``) goes on.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

from . import compile_pool

logger = logging.getLogger("compileattn")


#: Every landing not yet collected: a fork of this process takes its pool's answers anew.
_landings: "weakref.WeakSet[StaticLanding]" = weakref.WeakSet()


def _forget_after_fork() -> None:
    for landing in list(_landings):
        landing._forget_after_fork()


if hasattr(os, "register_at_fork"):  # after compile_pool's own (imported above), which answers the tasks
    os.register_at_fork(after_in_child=_forget_after_fork)


class StaticLanding:
    """The static compiles still out in a detached pool: ``tasks`` maps each (signature, size) to
    its ``compile_pool.Task``."""

    def __init__(self, pool: compile_pool.CompilePool, tasks: dict[tuple[str, int], compile_pool.Task],
                 resolve: Callable[[tuple[str, int], compile_pool.Task], Any]):
        self.pool = pool
        #: ((signature, size), task) -> the piece's code: the worker's artifact, or compiled in this
        #: process (a task that failed, or that no worker started)
        self.resolve = resolve
        self.started = time.perf_counter()
        self._cond = threading.Condition()
        self._waiting = dict(tasks)
        #: Set by the pool's threads when a result arrived that ``take`` has not handed out; read
        #: once per step (a plain attribute: no lock on the step path).
        self.changed = False
        #: seconds from the landing's start until every task had settled (None before)
        self.settled_after: float | None = None
        self._on_settled: list[Callable[[], Any]] = []
        pool.on_result = self._result_arrived
        _landings.add(self)
        pool.watch()
        # A process that ends with compiles still out must not leave workers behind compiling.
        atexit.register(self.close)
        self._result_arrived()  # results that came before the hand-over

    def _forget_after_fork(self) -> None:
        """In a fork of the process: its pool's threads are not here, and the pool answered what
        was out with an error (``CompilePool._forget_after_fork``); the next step here takes those
        answers (compiling each in-process, as for a worker that died). The lock is made anew: a
        thread of the parent may have held it at the fork."""
        self._cond = threading.Condition()
        self.changed = True

    @property
    def pending(self) -> int:
        return len(self._waiting)

    def _result_arrived(self) -> None:
        """Called on a pool thread (and once here): a task finished, or a worker stopped. The
        workers are stopped as soon as every task has its answer, whether or not the model runs
        another step to install them."""
        if self.pool.live_workers == 0:
            self.pool.fail_pending("no compile worker is left to compile it")
        with self._cond:
            self.changed = True
            self._cond.notify_all()
            done = all(task.result is not None for task in self._waiting.values())
        if done:
            self.pool.close()

    def take(self, max_failed: int | None = 1) -> list[tuple[tuple[str, int], compile_pool.Task]]:
        """The tasks that have settled since the last call (on the thread that runs the model), of
        which at most ``max_failed`` failed ones: each is compiled in-process by the step that
        installs it, so a step pays for one, and the others wait for the next steps."""
        with self._cond:
            self.changed = False
            done, failed = [], 0
            for key, task in self._waiting.items():
                if task.result is None:
                    continue
                if task.result[0] == "error":  # compiled here when installed
                    if max_failed is not None and failed >= max_failed:
                        self.changed = True  # more for the next step
                        continue
                    failed += 1
                done.append((key, task))
            for key, _ in done:
                del self._waiting[key]
            if not self._waiting and self.settled_after is None:
                self.settled_after = time.perf_counter() - self.started
        return done

    @property
    def settled(self) -> bool:
        return self.settled_after is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every task has a result (not yet installed: the next step installs them);
        False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while any(task.result is None for task in self._waiting.values()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
        return True

    def drain(self) -> None:
        """Block until every task has an answer, compiling here those no worker has started (the
        newest first, as ``CompilePool.drain`` does while a compile waits)."""
        keys = {task.id: key for key, task in self._waiting.items()}

        def here(task: compile_pool.Task) -> None:
            try:
                result = ("here", self.resolve(keys[task.id], task))
            except Exception as exc:  # noqa: BLE001 (the task must be answered: the landing waits for it)
                result = ("here-failed", f"{type(exc).__name__}: {exc}")
            self.pool.settle(task, result)

        self.pool.drain(here)
        self._result_arrived()  # closes the pool when every task is answered (those compiled here too)
        self.wait()

    def when_settled(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` on the model's thread once every task has been installed or given up."""
        self._on_settled.append(callback)

    def finish(self) -> None:
        """Every task is taken: run the callbacks, each on its own (one that fails is logged and
        the others still run: they run inside a model step)."""
        atexit.unregister(self.close)
        self.pool.close()  # answered already; also after a drain whose last tasks were compiled here
        self.resolve = None
        callbacks, self._on_settled = self._on_settled, []
        for callback in callbacks:
            try:
                callback()
            except Exception as exc:  # noqa: BLE001
                logger.warning("compileattn: after the static pieces landed, %r failed (%s: %s)", callback,
                               type(exc).__name__, exc)

    def close(self) -> None:
        """Give up on what has not landed (the process ends): stop the workers now, compiling or
        not; what was out is answered with an error."""
        atexit.unregister(self.close)
        self.resolve = None  # what was out is given up, not compiled here at shutdown
        self.pool.close(kill=True)
