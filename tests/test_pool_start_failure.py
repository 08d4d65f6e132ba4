"""A pool whose worker threads cannot all start (a thread limit) raised from ``start`` with the
threads it had started running and their workers started: ``prestart`` then compiled in-process
and nobody ever closed that pool, its threads or its worker processes (~1 GB each). Now the
threads that started serve, and closing the pool stops them."""
import threading
import time

from compileattn.compilation import compile_pool


def test_a_pool_that_cannot_start_all_its_threads_is_still_closed(monkeypatch):
    real_start = threading.Thread.start
    started = []

    def limited(thread):
        if thread.name.startswith("compileattn-compile-worker-"):
            if started:
                raise RuntimeError("can't start new thread")
            started.append(thread)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", limited)
    monkeypatch.setattr(compile_pool, "FORK_WORKERS", False)  # a fresh interpreter per worker
    compile_pool.release()
    pool = compile_pool.prestart(2)
    try:
        assert started, "no worker thread started"
        if pool is not None:
            assert pool.live_workers == 1
    finally:
        compile_pool.release(wait=True)
    deadline = time.monotonic() + 30
    while started[0].is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not started[0].is_alive(), "the started worker thread still serves a pool nobody holds"
