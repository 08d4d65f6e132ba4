"""Static-shape compiles in worker processes (compilation/compile_pool.py), on the CPU with Inductor:
the same code and outputs as compiling in-process, a failing or dying worker leaves its compile to
the compiling process, and no worker outlives the compile."""
import os
import random
import re
import threading
import time
from typing import Callable

import pytest
import torch
import torch.fx

import compileattn as ca
from compileattn import _torch_compat
from compileattn.compilation import compile_pool, compile_worker, fork_server
from compileattn.compilation.backend import compileattn_backend
from compileattn.models.opt import OPTConfig, OPTForCausalLM
from compileattn.testing import assert_matches_eager, random_step
from test_piecewise import _inputs

BLOCK = 4
NUM_BLOCKS = 64
SIZES = (2,)


@pytest.fixture
def pools(monkeypatch):
    """Every pool the backend starts in the test; the workers must compile what they are given."""
    started = []
    real = compile_pool.CompilePool

    def recording(workers, start=True):
        pool = real(workers, start=start)
        started.append(pool)
        return pool

    monkeypatch.setattr(compile_pool, "CompilePool", recording)
    monkeypatch.setattr(compile_pool, "COMPILE_UNSTARTED_HERE", False)
    yield started
    compile_pool.release()


def _compile_and_run(workers: int, cache_dtype=torch.float32):
    """The tiny OPT compiled with static size 2, run on 2-token and 3-token steps and compared with
    eager; the dispatcher, the outputs of the 2-token steps and the generated code of each static piece."""
    model = OPTForCausalLM(OPTConfig.tiny(), seed=2)
    caches = ca.allocate_kv_caches(model.attention_specs(), NUM_BLOCKS, BLOCK, dtype=cache_dtype)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=16,
                                          max_blocks_per_seq=8)
    runtimes = []

    def backend(gm, example_inputs):
        # waiting for the workers (compilation/landing.py and tests/test_static_landing.py cover
        # the background landing)
        runtimes.append(compileattn_backend(gm, example_inputs, options={"compile_sizes": SIZES,
                                                                         "compile_workers": workers,
                                                                         "background_static_compiles": False}))
        return runtimes[-1]

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    rng = random.Random(7)
    torch.manual_seed(0)
    outs = []
    for pad in (3, 2, 2):
        seqs = random_step(rng, num_seqs=1, block_size=BLOCK, num_blocks=NUM_BLOCKS, max_query_len=2,
                           max_context_len=8)
        outs.append(assert_matches_eager(model, compiled, builder, caches, seqs, _inputs(model.config.vocab_size),
                                         pad_to=pad))
    (runtime,) = runtimes
    sources = {key: _torch_compat.artifact_source(code.artifact) for key, code in runtime.compiled.code.items()}
    return runtime, outs, sources


def _normalized(source: str | None) -> str | None:
    # the one process-dependent line: a per-process counter of AOTAutograd graphs
    return None if source is None else re.sub(r"# AOT ID: \[.*\]", "# AOT ID", source)


@pytest.mark.parametrize("workers", [1, 2], ids=["fresh-interpreter", "forked"])
def test_workers_compile_the_same_code_as_the_compiling_process(pools, workers, monkeypatch, tmp_path):
    """Static and dynamic-shape pieces alike (``COMPILE_UNSTARTED_HERE`` off: the workers compile
    them all); two workers are forked from a fork server, one is a fresh interpreter. Inductor's
    caches start empty (the workers inherit the directory): a cache entry of an earlier run can
    hold code compiled for another size hint of the token count."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with ca.counters.expect(static_compiles_in_workers=0, dynamic_compiles_in_workers=0):
        serial, serial_outs, serial_sources = _compile_and_run(workers=0)
    assert pools == []
    distinct = sum(size is not None for _, size in serial_sources)
    assert len(serial_sources) == 2 * distinct  # one dynamic and one static (size 2) each
    with ca.counters.expect(static_compiles_in_workers=distinct, dynamic_compiles_in_workers=distinct,
                            backend_compiles=2 * distinct):
        parallel, parallel_outs, parallel_sources = _compile_and_run(workers=workers)
    assert (pools[0]._fork_server is not None) == (workers > 1)
    assert len(pools) == 1 and compile_pool.current() is None
    assert set(parallel_sources) == set(serial_sources)
    for key, source in serial_sources.items():
        assert source is not None and _normalized(parallel_sources[key]) == _normalized(source), key
    for a, b in zip(serial_outs, parallel_outs):
        assert torch.equal(a, b)
    assert parallel.compiled.static_sizes == serial.compiled.static_sizes == SIZES
    assert parallel.compiled.static_seconds > 0
    # the pool is shut down with the compile: every worker has exited
    pools[0].join(timeout=30)
    assert pools[0].pids() and all(p.poll() is not None for p in pools[0]._procs)


@pytest.mark.parametrize("failure", ["error", "exit"])
def test_a_failing_worker_leaves_its_compile_to_the_compiling_process(pools, monkeypatch, caplog, failure):
    monkeypatch.setattr(compile_pool, "INJECT_FAILURE", failure)
    with caplog.at_level("INFO", logger="compileattn"):
        with ca.counters.expect(static_compiles_in_workers=0, dynamic_compiles_in_workers=0):
            runtime, _, sources = _compile_and_run(workers=1)
    assert set(sources) == {(sig, size) for sig in runtime.compiled.signatures.values() for size in (None, *SIZES)}
    assert all(s is not None for s in sources.values())
    assert "compiling it in-process" in caplog.text
    if failure == "exit":
        assert "stopped" in caplog.text  # the worker's death is logged too
    pools[0].join(timeout=30)
    assert all(p.poll() is not None for p in pools[0]._procs)


def test_worker_count():
    assert compile_pool.worker_count(0) == 0
    assert compile_pool.worker_count(3) == 3
    auto = compile_pool.worker_count("auto")
    assert auto == 0 or compile_pool.MIN_AUTO_WORKERS <= auto <= min(compile_pool.MAX_AUTO_WORKERS,
                                                                     compile_pool.usable_cpus() - 2)
    if compile_pool.usable_cpus() < 4:
        assert auto == 0  # small hosts compile in-process
    with pytest.raises(ValueError, match="compile_workers"):
        ca.CompileConfig(compile_workers=-1)


def test_autocast_keeps_static_compiles_in_process(pools, monkeypatch):
    """Inductor applies the ambient autocast when it re-traces a piece, and a worker would not see
    it: under autocast the pool is not even asked for."""
    asked = []
    monkeypatch.setattr(compile_pool, "acquire", lambda workers: asked.append(workers))
    assert compile_pool.unsendable_context() is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compile_pool.unsendable_context() == "autocast is on for cpu"
        with ca.counters.expect(static_compiles_in_workers=0):
            _compile_and_run(workers=1, cache_dtype=torch.bfloat16)
    assert asked == []


def test_one_compile_at_a_time_claims_the_workers():
    """Task ids are per compile and a pool serves whatever is pending, so a second thread's compile
    gets no pool while another's holds it (it compiles in-process), and cannot close it."""
    import threading

    claimed = compile_pool.acquire(1)
    try:
        assert claimed is not None and compile_pool.current() is claimed
        other = []
        thread = threading.Thread(target=lambda: (other.append(compile_pool.acquire(1)), compile_pool.release()))
        thread.start()
        thread.join()
        assert other == [None] and compile_pool.current() is claimed  # not closed by the other thread
    finally:
        compile_pool.release()
    assert compile_pool.current() is None
    claimed.join(timeout=30)
    assert all(p.poll() is not None for p in claimed._procs)


def test_release_kills_a_worker_still_importing():
    pool = compile_pool.prestart(1)
    try:
        deadline = time.monotonic() + 10
        while not pool.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.ready_after == [None]  # torch's import takes seconds
    finally:
        compile_pool.release()
    proc = pool._procs[0]
    proc.wait(timeout=5)  # killed at once, not after its import
    assert proc.returncode is not None


def test_a_stuck_worker_is_killed_and_its_piece_compiled_here(pools, monkeypatch, caplog):
    monkeypatch.setattr(compile_pool, "INJECT_FAILURE", "hang")
    monkeypatch.setattr(compile_pool, "TASK_TIMEOUT_S", 2.0)
    with caplog.at_level("INFO", logger="compileattn"):
        with ca.counters.expect(static_compiles_in_workers=0):
            runtime, _, sources = _compile_and_run(workers=1)
    assert all(s is not None for s in sources.values())
    assert "killed, the compiling process compiles it" in caplog.text


def test_an_unstarted_pool_closes_and_starts_when_wanted(monkeypatch):
    """A pool made unstarted (``compile_workers_start="after_dynamic"``) closes with a wait (no
    thread to join), and ``prestart`` asked to start hands back the same pool started."""
    alone = compile_pool.CompilePool(1, start=False)
    alone.close(wait=True)
    started = []
    monkeypatch.setattr(compile_pool.CompilePool, "start", lambda self: started.append(self))
    try:
        pool = compile_pool.prestart(1, start=False)
        assert not pool.started and not started
        assert compile_pool.prestart(1) is pool and started == [pool]
    finally:
        compile_pool.release()


def test_an_urgent_task_running_in_a_worker_is_compiled_here_too_rather_than_waited_for(monkeypatch):
    """With nothing left to start, the compiling process compiles an urgent task a worker is
    still on (here: a worker that never answers) instead of waiting; the first answer is kept."""
    monkeypatch.setattr(compile_pool, "INJECT_FAILURE", "hang")
    pool = compile_pool.CompilePool(1)
    try:
        task = compile_pool.Task(0, "piece (dynamic shapes)", {}, urgent=True)
        pool.submit(task)
        deadline = time.monotonic() + 120
        while task.started is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert task.started is not None  # the worker took it (and hangs)
        compiled_here = []

        def here(t):
            compiled_here.append(t)
            assert pool.settle(t, ("here", "code"))

        start = time.monotonic()
        pool.drain(here, urgent_only=True)
        assert time.monotonic() - start < 5
        assert compiled_here == [task] and task.duplicated and task.result == ("here", "code")
        assert not pool.settle(task, ("ok", b"", 0.0, 0, ()))  # a later answer does not replace it
    finally:
        pool.close(kill=True, wait=True)


def test_a_settled_task_keeps_its_answer_but_an_error_is_replaced():
    pool = compile_pool.CompilePool(0)
    task = compile_pool.Task(0, "piece (dynamic shapes)", {}, urgent=True)
    assert pool.settle(task, ("error", "the worker died"))
    assert pool.settle(task, ("here", "code"))  # the compiling process's duplicate still counts
    assert not pool.settle(task, ("ok", b"", 0.0, 0, ())) and task.result == ("here", "code")


def test_a_dynamic_compile_that_replaces_a_symbolic_size_is_refused_in_a_worker(monkeypatch):
    """A worker compiles a dynamic-shape piece as the compiling process does, but refuses the
    result if the compile replaced a symbol of the piece's ShapeEnv (here: said to, the CPU pieces
    of the tiny model make none): what the code computes then depends on a ShapeEnv the compiling
    process's Dynamo would not see. Guards alone travel back with the answer (the test below)."""
    messages = []
    real_send = compile_pool.CompilePool.submit

    def keep(self, task):
        messages.append(task.message)
        real_send(self, task)

    monkeypatch.setattr(compile_pool.CompilePool, "submit", keep)
    monkeypatch.setattr(compile_pool, "COMPILE_UNSTARTED_HERE", True)
    _compile_and_run(workers=1)
    compile_pool.release()
    dynamic = next(m for m in messages if m.get("inputs", ()) is None)
    data, guards = compile_worker.compile_message(dynamic)  # what a worker answers: the artifact, and every
    assert data and all(g.free_symbols for g in guards)     # size guard its code may rely on
    states = iter([(0, (), 0), (0, (("s0", "8"),), 0), (0, (("s0", "8"),), 0)])
    monkeypatch.setattr(_torch_compat, "size_assumptions", lambda shape_env: next(states))
    with pytest.raises(compile_worker.SizeAssumptionsAdded, match=r"replacement s0 -> 8\)$"):
        compile_worker.compile_message(dynamic)


def test_what_a_compile_assumed_is_said_on_one_line():
    import types

    def shape_env(guards, replacements, deferred):
        return types.SimpleNamespace(guards=[types.SimpleNamespace(expr=g) for g in guards],
                                     replacements=replacements, deferred_runtime_asserts={"s0": [None] * deferred})

    before = _torch_compat.size_assumptions(shape_env(["Eq(s0, s1)"], {}, 0))
    after = shape_env(["Eq(s0, s1)", "s0 < 2**31"], {"s2": 4}, 2)
    assert _torch_compat.size_assumptions_added(after, before) == ("guard s0 < 2**31; replacement s2 -> 4; "
                                                                   "2 deferred runtime assertions")


# An Inductor compile between decoration and the first call (another function compiled with
# ``torch.compile`` first) sets ``TORCHINDUCTOR_CACHE_DIR`` (and a process-local pointer variable),
# as Inductor does in every process: not a change of environment that throws the fork server made at
# decoration away (its workers' Inductor sets them alike).


_SET_BY_INDUCTOR = ("TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")


def test_what_inductor_sets_in_every_process_is_not_a_change():
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    before = {k: v for k, v in compile_pool._worker_env().items() if k not in _SET_BY_INDUCTOR}
    now = dict(before, TORCHINDUCTOR_CACHE_DIR=os.path.abspath(default_cache_dir()),
               _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR="140000000000")
    assert compile_pool._changed_since(before, now) == []
    # a directory the program chose, or one changed since the server started, is a change
    assert compile_pool._changed_since(before, dict(now, TORCHINDUCTOR_CACHE_DIR="/elsewhere")) == \
        ["TORCHINDUCTOR_CACHE_DIR"]
    assert compile_pool._changed_since(dict(before, TORCHINDUCTOR_CACHE_DIR="/mine"), now) == \
        ["TORCHINDUCTOR_CACHE_DIR"]


def test_a_torch_compile_after_decoration_keeps_the_early_server(monkeypatch):
    compile_pool.drop_early_fork_server()
    for name in _SET_BY_INDUCTOR:
        monkeypatch.delenv(name, raising=False)
    assert compile_pool.start_fork_server_early(2)
    early = compile_pool._early[0]
    pool = None
    try:
        torch.compile(lambda x: x * 3 + 1)(torch.randn(4))  # Inductor sets its variables here
        assert "TORCHINDUCTOR_CACHE_DIR" in os.environ
        pool = compile_pool.CompilePool(2, start=False)
        pool.start()
        assert pool._fork_server is early
    finally:
        if pool is not None:
            pool.close(wait=True)
        compile_pool.drop_early_fork_server()
        early.close()


# A process forked while a compile pool runs (static pieces landing in the background when a pre-
# forking server forks its workers) must not stop the parent's workers when it ends.


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


def answer_of_a_fork(child: Callable[[], str]) -> str:
    """What ``child()`` returns when run in a fork of this process (which must exit cleanly)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.write(w, child().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        answer = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, answer
    return answer


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

        def child() -> str:
            start = time.monotonic()
            landed = runtime.wait_for_static_pieces(timeout=20)
            took = time.monotonic() - start
            landing.close()  # what the child's exit runs
            return f"{landed} {took:.1f}"

        landed, took = answer_of_a_fork(child).split()
        assert landed == "True" and float(took) < 20, answer
        assert runtime.wait_for_static_pieces(timeout=300)
        assert all(set(by_size) == {STATIC} for by_size in runtime.static.values())
        assert not landing.pool.failures, landing.pool.failures
    finally:
        compile_pool.release()


# A pool whose worker threads cannot all start (a thread limit) raised from ``start`` with the
# threads it had started running and their workers started: ``prestart`` then compiled in-process
# and nobody ever closed that pool, its threads or its worker processes (~1 GB each). Now the
# threads that started serve, and closing the pool stops them.


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


# Inductor's CPU code is generated for ``torch.get_num_threads()`` (``#pragma omp parallel
# num_threads(N)``, its GEMM templates' blocking): a worker must compile with the compiling
# process's thread count, not its own (a fresh interpreter's default, what a fork server inherited
# at decoration), or a static piece ran with another number of threads than the program set
# (oversubscribing the cores it left to others), and its code differed from an in-process compile's.


def _piece(x):
    return (x * 2.0 + 1.0).sum(dim=1)


def _threads_in(data: bytes) -> set[str]:
    source = _torch_compat.artifact_source(_torch_compat.artifact_from_bytes(data))
    assert source is not None
    return set(re.findall(r"num_threads\(\d+\)", source))


def test_a_worker_compiles_for_the_compiling_processs_thread_count(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    before = torch.get_num_threads()
    threads = 3 if before != 3 else 2
    torch.set_num_threads(threads)
    pool = None
    try:
        gm = torch.fx.symbolic_trace(_piece)
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        mode = FakeTensorMode()
        FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.empty(4096, 512)))
        for node in gm.graph.nodes:  # as Dynamo's graph has them (a serialisable artifact needs them)
            if "val" in node.meta:
                node.meta["example_value"] = node.meta["val"]
        message = {"graph": _torch_compat.piece_pickle(gm),
                   "inputs": [("tensor", (4096, 512), (512, 1), torch.float32, "cpu")],
                   "options": {}, "settings": _torch_compat.compile_settings()}
        here, _ = compile_worker.compile_message(message)
        assert _threads_in(here) == {f"num_threads({threads})"}
        pool = compile_pool.CompilePool(1)
        task = compile_pool.Task(0, "piece (4096 tokens)", message)
        pool.submit(task)
        deadline = time.monotonic() + 240
        while task.result is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert task.result is not None and task.result[0] == "ok", task.result
        assert _threads_in(task.result[1]) == {f"num_threads({threads})"}
    finally:
        torch.set_num_threads(before)
        if pool is not None:
            pool.close(wait=True)


def test_a_worker_compiles_without_a_config_entry_the_compiling_process_set_back():
    """The settings a task carries are the compiling process's changed config entries only: one it
    set back to its default after the fork server was forked from it is absent from them, and a
    worker forked from that server, which still has it set, must compile with the default."""
    from torch._inductor import config as inductor_config

    settings = _torch_compat.compile_settings()  # the compiling process: max_autotune at its default
    assert "max_autotune" not in settings["configs"]["torch._inductor.config"]
    with inductor_config.patch(max_autotune=True):  # what a worker inherited from the fork
        with _torch_compat.compile_settings_applied(settings):
            assert inductor_config.max_autotune is False
        assert inductor_config.max_autotune is True


def test_a_fork_forgets_inductors_thread_pool_and_the_builds_in_flight():
    """A forked child's compile reused the parent's Inductor thread pool and the C++ builds it had
    in flight, whose futures no thread of the child finishes: a landing in the child hung for
    good (seen in CI). The child starts with neither."""
    from torch._inductor import codecache
    from torch._inductor.async_compile import AsyncCompile

    from compileattn.compilation import compile_pool  # noqa: F401 (registers the at-fork handler)

    codecache.CppCodeCache.cache["compileattn-test-in-flight"] = lambda: None
    try:
        answer = answer_of_a_fork(lambda: f"{'compileattn-test-in-flight' in codecache.CppCodeCache.cache} "
                                          f"{AsyncCompile.pool.cache_info().currsize}")
    finally:
        codecache.CppCodeCache.cache.pop("compileattn-test-in-flight", None)
    assert answer == "False 0"
