"""``wait_for_static_pieces(timeout)`` (and the exit's wait, ``EXIT_WAIT_FOR_STATIC_S``) is bounded:
static compiles the workers failed are compiled in-process only while time is left."""
import time

import compileattn as ca
from test_static_landing import STATIC, _Compiled, held  # noqa: F401 (fixture)


def test_a_timed_wait_compiles_failed_pieces_here_only_while_time_is_left(held):  # noqa: F811
    run = _Compiled(3, cudagraph_mode="none")
    runtime, (pool,) = run.runtime, held
    assert len(pool.tasks) >= 2
    for task in pool.tasks:  # every worker died: each piece is compiled here when it lands
        pool.answer(task, error="worker pid 1 died (EOFError)")
    start = time.monotonic()
    with ca.counters.expect(backend_compiles=0):  # no time left: none compiled
        assert runtime.wait_for_static_pieces(timeout=0) is False
    compiled = ca.counters.backend_compiles
    assert runtime.wait_for_static_pieces(timeout=0.001) is False
    compiled = ca.counters.backend_compiles - compiled  # at most the one started before the deadline
    assert compiled <= 1 and runtime.pending_static_compiles() == len(pool.tasks) - compiled
    assert time.monotonic() - start < 60
    with ca.counters.expect(backend_compiles=len(pool.tasks) - compiled):
        assert runtime.wait_for_static_pieces(timeout=600) is True
    assert runtime.pending_static_compiles() == 0
    assert all(set(by_size) == {STATIC} for by_size in runtime.static.values())
    run.step(decode=True)
