"""A process forked while a compile pool runs (static pieces landing in the background when a
pre-forking server forks its workers) must not stop the parent's workers when it ends."""
import os
import time

import pytest

from compileattn.compilation import compile_pool, fork_server


def _ready(pool, timeout=120):
    deadline = time.monotonic() + timeout
    while any(r is None for r in pool.ready_after) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(r is not None for r in pool.ready_after), pool.failures


@pytest.mark.parametrize("workers", [1, 2], ids=["fresh-interpreter", "forked"])
def test_a_forked_child_closing_its_copy_of_a_pool_leaves_the_parents_workers(workers, monkeypatch):
    monkeypatch.setattr(compile_pool, "INJECT_FAILURE", "error")
    pool = compile_pool.CompilePool(workers)
    try:
        _ready(pool)
        pid = os.fork()
        if pid == 0:  # what a landing's atexit does in the child (StaticLanding.close)
            code = 1
            try:
                pool.close(kill=True)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.5)
        assert all(p.poll() is None for p in pool._procs), "the child killed the parent's workers"
        task = compile_pool.Task(0, "piece (2 tokens)", {"graph": b"", "inputs": None})
        pool.submit(task)
        deadline = time.monotonic() + 60
        while task.result is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert task.result is not None and "injected failure" in task.result[1], task.result
    finally:
        pool.close(wait=True, kill=True)


def test_a_landing_forked_into_a_child_settles_there_and_still_lands_in_the_parent(monkeypatch):
    """Static pieces still out in real workers when the process forks: the child answers them
    itself (compiled in-process, as for a worker that died) instead of waiting for workers whose
    answers only the parent gets, and its giving up at exit leaves the parent's workers alone."""
    from test_static_landing import STATIC, _Compiled

    start_worker = compile_pool._start_worker
    monkeypatch.setattr(compile_pool, "_start_worker", lambda *a: (time.sleep(5), start_worker(*a))[1])
    try:
        run = _Compiled(5, cudagraph_mode="none", compile_workers=2)
        runtime = run.runtime
        landing = runtime._landing
        assert landing is not None and runtime.pending_static_compiles() > 0
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(r)
                start = time.monotonic()
                landed = runtime.wait_for_static_pieces(timeout=20)
                took = time.monotonic() - start
                landing.close()  # what the child's exit runs
                os.write(w, f"{landed} {took:.1f}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r) as f:
            answer = f.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        landed, took = answer.split()
        assert landed == "True" and float(took) < 20, answer
        assert runtime.wait_for_static_pieces(timeout=300)
        assert all(set(by_size) == {STATIC} for by_size in runtime.static.values())
        assert not landing.pool.failures, landing.pool.failures
    finally:
        compile_pool.release()
