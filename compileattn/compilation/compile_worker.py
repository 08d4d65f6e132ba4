"""A compile worker's side of ``compile_pool.py``: what runs in the worker process.

A worker (forked by the fork server, or a fresh interpreter running ``main``) imports compileattn
and Inductor, says "ready", then compiles one task at a time: a piece's graph and its sizes in, the
compiled artifact's bytes and the guards its code relies on out. The compiling process's side
(scheduling, failures, lifetime) is ``compile_pool.py``; the wire format is ``wire.py``.
"""
from __future__ import annotations

import os
import select
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO

from .. import _torch_compat
from . import inductor_piece, wire
from .compile_pool import static_args_from_specs


def import_for_worker() -> None:
    """What a worker imports before it is ready: compileattn (its custom ops must be registered to
    unpickle a piece) and Inductor (seconds; once, in the fork server, for forked workers)."""
    import compileattn  # noqa: F401

    _torch_compat.import_inductor()


def main(answers_fd: int) -> None:
    """A fresh-interpreter worker: stdin brings messages, ``answers_fd`` (the original stdout)
    takes the answers; stdout itself already goes to stderr."""
    with os.fdopen(answers_fd, "wb") as out:
        serve_tasks(sys.stdin.buffer, out)


def serve_tasks(inp: BinaryIO, out: BinaryIO) -> None:
    """A worker's life: the compiling process's ``sys.path``, the imports (none left to do in a
    forked worker), "ready", then one answer per task until ``inp`` closes."""
    try:
        init = wire.receive(inp)
    except EOFError:
        return
    sys.path[:] = init["sys_path"]
    busy = _exit_when_orphaned_while_busy(inp)
    start = time.perf_counter()
    busy.set()
    import_for_worker()
    busy.clear()
    wire.send(out, ("ready", os.getpid(), time.perf_counter() - start))
    while True:
        try:
            message = wire.receive(inp)
        except EOFError:
            return
        start = time.perf_counter()
        busy.set()
        try:
            if message.get("inject") == "exit":
                os._exit(3)
            if message.get("inject") == "hang":
                time.sleep(3600)
            if message.get("inject") == "error":
                raise RuntimeError("injected failure (compile_pool.INJECT_FAILURE)")
            data, guards = compile_message(message)
            reply = ("ok", data, time.perf_counter() - start, os.getpid(), guards)
        except Exception as exc:  # noqa: BLE001 (the compiling process compiles it itself)
            first = str(exc).strip().splitlines()
            reply = ("error", f"{type(exc).__name__}: {first[0] if first else ''}", traceback.format_exc())
        busy.clear()
        try:
            wire.send(out, reply)
        except (BrokenPipeError, OSError):
            return


def _exit_when_orphaned_while_busy(inp: BinaryIO) -> threading.Event:
    """Exit the worker at once if the write end of its task pipe closes while it imports or
    compiles (the returned event is set then): the compiling process exited or was killed, and
    nobody will read the answer. The pipe's end is otherwise seen only at the next read, after a
    compile that may run for minutes, or for good where it is stuck (no watchdog is left to kill
    it), with a fork server waiting for it. An idle worker's read sees the end itself. A thread
    polling for POLLHUP, not a parent-death signal: a forked worker's parent is the fork server,
    and the signal follows the thread that started a process, not the process."""
    busy = threading.Event()
    try:
        fd = inp.fileno()
    except (AttributeError, OSError, ValueError):  # not a real pipe (a test's stream)
        return busy

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, 0)  # POLLHUP and POLLERR are reported whatever the mask
        while not poller.poll():
            pass
        busy.wait()
        os._exit(0)

    threading.Thread(target=watch, name="compileattn-worker-orphan-watch", daemon=True).start()
    return busy


class SizeAssumptionsAdded(RuntimeError):
    """Inductor's compile of a dynamic-shape piece replaced a symbol of its sizes (by another, or
    a constant) or deferred a runtime assertion on them: what the code computes then depends on
    the compiling process's ShapeEnv, which a worker's copy cannot change. Such a piece is
    compiled in the compiling process instead (the task answers this error). A plain guard
    travels back with the answer instead (``compile_message``)."""


def compile_message(message: dict[str, Any]) -> tuple[bytes, tuple]:
    """Compile one task's piece (in a worker): the artifact's bytes, and the guards on the piece's
    symbolic sizes that its code relies on (sympy expressions; none for a static task): every guard
    of the worker's ShapeEnv after the compile, those it started with (the compiling process's,
    which travelled with the graph and may have let the compile decide something statically) and
    those the compile added (32-bit indexing below a size, say), which would be lost with the
    worker's copy. The compiling process assumes them in its own ShapeEnv (``piecewise.py``), where
    an in-process compile would have put them. A static task's inputs are specs
    (``static_input_specs``); a dynamic one's (``"inputs": None``) are the placeholders' own example
    values, fake tensors with the graph's symbolic sizes in that ShapeEnv, compiled under a tracing
    context of its fake mode, as Dynamo's is around the backend; a replacement or a deferred
    runtime assertion refuses the answer (``SizeAssumptionsAdded``)."""
    gm = _torch_compat.piece_unpickle(message["graph"])
    guards: tuple = ()
    with _torch_compat.compile_settings_applied(message["settings"]):
        if message["inputs"] is None:
            args = [_torch_compat.node_example_value(node) for node in gm.graph.nodes if node.op == "placeholder"]
            fake_mode = _torch_compat.detect_fake_mode(args)
            before = _torch_compat.size_assumptions(fake_mode.shape_env)
            with _torch_compat.tracing_fake_mode(fake_mode):
                artifact = inductor_piece.compile_piece(gm, args, "from_tracing_context", message["options"])
            after = _torch_compat.size_assumptions(fake_mode.shape_env)
            if after[1:] != before[1:]:
                added = _torch_compat.size_assumptions_added(fake_mode.shape_env, before)
                raise SizeAssumptionsAdded(f"the compile changed the piece's symbolic sizes, which the compiling "
                                           f"process's Dynamo would not see ({added})")
            guards = tuple(_torch_compat.size_guard_expressions(fake_mode.shape_env))
        else:
            args = static_args_from_specs(message["inputs"])
            artifact = inductor_piece.compile_piece(gm, args, "from_example_inputs", message["options"])
    return _torch_compat.artifact_bytes(artifact), guards
