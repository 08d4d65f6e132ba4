"""Static-shape pieces that land after the compile returned (``background_static_compiles``,
compilation/landing.py), on the CPU with Inductor and simulated CUDA graphs.

A held pool stands in for the worker processes, so each test decides when a task's answer arrives
(compiled for real, in-process, from the message a worker would get): before the landing, steps of
a static size run the dynamic-shape pieces; the step after it installs the static ones and captures
that size's graphs again; a failed task is compiled in-process, one per step; the warm start file is written
only once nothing is left out. Five tests run real worker processes (held back 5 s where the test
needs them still out when the first call returns).
"""
from __future__ import annotations

import os
import random
import time

import pytest
import torch

import compileattn as ca
from compileattn.compilation import compile_pool, compile_worker, decorator
from compileattn.models.llama import LlamaConfig, LlamaForCausalLM
from compileattn.testing import PersistentInputs, RecordingBackend, assert_matches_eager, random_step

BLOCK, NUM_BLOCKS, MAX_TOKENS = 16, 256, 32
CAPTURE = [1, 2, 4, 8]
STATIC = 4


class HeldPool:
    """``CompilePool``'s interface without processes: static tasks wait for ``answer``;
    urgent (dynamic-shape) ones are left to the compiling process, as no worker takes them."""

    made: list["HeldPool"] = []

    def __init__(self, workers: int, start: bool = True):
        self.size = workers
        self.tasks: list[compile_pool.Task] = []
        self.urgent: list[compile_pool.Task] = []
        #: how many tasks had been submitted when the workers started (None: not started)
        self.started_after: int | None = 0 if start else None
        self.on_result = None
        self.closed = False
        self.live = workers
        HeldPool.made.append(self)

    @property
    def live_workers(self) -> int:
        return self.live

    @property
    def started(self) -> bool:
        return self.started_after is not None

    def submit(self, task) -> None:
        (self.urgent if task.urgent else self.tasks).append(task)

    def start(self) -> None:
        if self.started_after is None:
            self.started_after = len(self.tasks)

    def fail_pending(self, why: str) -> None:
        for task in self.tasks:
            if task.result is None:
                task.result = ("error", why)

    def close(self, wait: bool = False, kill: bool = False) -> None:
        self.closed = True

    def watch(self) -> None:
        pass

    def settle(self, task, result) -> bool:
        if task.result is not None:
            return False
        task.result = result
        return True

    def drain(self, here, urgent_only: bool = False) -> None:  # CompilePool.drain with no worker taking
        for task in self.urgent + ([] if urgent_only else self.tasks):
            if task.result is None:
                here(task)

    def answer(self, task, error: str | None = None) -> None:
        task.result = (("error", error) if error else
                       ("ok", *_answer_of(compile_worker.compile_message(task.message))))
        self.on_result()


def _answer_of(compiled: tuple) -> tuple:
    data, guards = compiled
    return data, 0.0, os.getpid(), guards


@pytest.fixture
def held(monkeypatch):
    HeldPool.made = []
    monkeypatch.setattr(compile_pool, "CompilePool", HeldPool)
    yield HeldPool.made
    compile_pool.release()


def _setup(device: str = "cpu", **config):
    dtype = torch.float16 if device == "cuda" else torch.float32
    backend = "triton" if device == "cuda" else "auto"
    model = LlamaForCausalLM(LlamaConfig.tiny(num_layers=2, head_dim=64), dtype=dtype, device=device, seed=0)
    caches = ca.allocate_kv_caches(model.attention_specs(), NUM_BLOCKS, BLOCK, dtype=dtype, device=device)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_TOKENS,
                                          max_blocks_per_seq=8, device=device, backend=backend)
    make_inputs = PersistentInputs(model.config.vocab_size, MAX_TOKENS, positions=(0, 100), device=device)
    config.setdefault("attention_backend", backend)

    cfg = ca.CompileConfig(**{"cudagraph_mode": "full_and_piecewise", "cudagraph_capture_sizes": CAPTURE,
                              "compile_sizes": (STATIC,), "compile_workers": 1, **config})
    return model, caches, builder, make_inputs, cfg


def _step(rng, model, compiled, builder, caches, make_inputs, *, decode: bool, tokens: int = STATIC):
    if decode:
        seqs = random_step(rng, num_seqs=tokens, block_size=BLOCK, num_blocks=NUM_BLOCKS, max_context_len=40,
                           decode_fraction=1.0)
    else:  # one 2-token prefill chunk and decodes: a mixed step of ``tokens`` tokens (piecewise graphs)
        seqs = random_step(rng, num_seqs=tokens - 1, block_size=BLOCK, num_blocks=NUM_BLOCKS, max_context_len=40,
                           decode_fraction=1.0)
        last = seqs[-1]
        seqs[-1] = last._replace(query_len=2, context_len=min(last.context_len, len(last.block_table) * BLOCK - 2))
    assert sum(s.query_len for s in seqs) == tokens
    return assert_matches_eager(model, compiled, builder, caches, seqs, make_inputs, pad_to=tokens)


class _Compiled:
    """The tiny Llama compiled through the backend by a first 4-token decode step (checked against
    eager), and what the tests drive next: ``step``, the dispatcher ``runtime``."""

    def __init__(self, seed: int, device: str = "cpu", **config):
        self.model, self.caches, self.builder, self.make_inputs, cfg = _setup(device, **config)
        backend = RecordingBackend(config=cfg)
        self.compiled = torch.compile(self.model, backend=backend, fullgraph=True)
        self.rng = random.Random(seed)
        self.step(decode=True)
        (self.runtime,) = backend.built

    def step(self, decode: bool, tokens: int = STATIC):
        return _step(self.rng, self.model, self.compiled, self.builder, self.caches, self.make_inputs,
                     decode=decode, tokens=tokens)


def test_static_pieces_land_between_steps_and_their_graphs_are_captured_again(held, simulated_graphs):
    with ca.counters.expect(static_landings=0, static_compiles_in_workers=0):
        run = _Compiled(0)
    runtime, (pool,) = run.runtime, held
    distinct = len(set(runtime.compiled.signatures.values()))
    assert len(pool.tasks) == distinct and runtime.pending_static_compiles() == distinct
    assert all(not by_size for by_size in runtime.static.values())  # size 4 runs the dynamic pieces
    run.step(decode=False)  # piecewise graphs of size 4
    assert runtime.full_graph_count() == 1
    piece_graphs = runtime.piece_graph_count()
    assert piece_graphs > 0

    for task in pool.tasks:
        pool.answer(task)
    assert pool.closed and runtime.pending_static_compiles() == distinct  # answered, installed by the next step only
    captures = ca.counters.cudagraph_captures
    with ca.counters.expect(static_landings=1, static_compiles_in_workers=distinct, full_graph_steps=1):
        run.step(decode=True)
    assert runtime.pending_static_compiles() == 0 and pool.closed
    assert runtime.static_settled_after is not None
    assert all(set(by_size) == {STATIC} for by_size in runtime.static.values())
    assert ca.counters.cudagraph_captures == captures + 1  # the full graph of size 4, captured again
    assert runtime.piece_graph_count() == 0  # the piecewise graphs of size 4 were dropped ...
    # ... kept by the pool until the full graph was captured again (a real pool dies without a graph)
    assert not runtime.pool.retired
    run.step(decode=False)
    assert runtime.piece_graph_count() == piece_graphs  # ... and captured again at the next mixed step
    with ca.counters.expect(cudagraph_captures=0, static_landings=0):  # nothing more to land or capture
        run.step(decode=True)
        run.step(decode=False)


def test_a_failed_static_compile_is_compiled_in_process_when_it_lands(held, simulated_graphs, caplog):
    run = _Compiled(1)
    runtime, (pool,) = run.runtime, held
    failed, *others = pool.tasks
    pool.answer(failed, error="RuntimeError: injected")
    for task in others:
        pool.answer(task)
    with caplog.at_level("INFO", logger="compileattn"), \
            ca.counters.expect(static_compiles_in_workers=len(others), backend_compiles=len(pool.tasks)):
        run.step(decode=True)
    assert f"no compile worker's answer for {failed.label} (RuntimeError: injected); compiling it in-process" \
        in caplog.text
    assert runtime.pending_static_compiles() == 0
    assert all(set(by_size) == {STATIC} for by_size in runtime.static.values())
    run.step(decode=False)


def _no_compiling_here(monkeypatch, landing):
    """The landing adopts workers' artifacts as before, but compiling a piece here fails."""
    resolve = landing.resolve

    def adopt_only(key, task):
        if task.result is not None and task.result[0] == "ok":
            return resolve(key, task)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(landing, "resolve", adopt_only)


def test_a_static_compile_that_cannot_be_compiled_here_either_keeps_the_dynamic_piece(held, simulated_graphs,
                                                                                    caplog, monkeypatch):
    run = _Compiled(10)
    runtime, (pool,) = run.runtime, held
    landing = runtime._landing
    _no_compiling_here(monkeypatch, landing)
    failed, *others = pool.tasks
    pool.answer(failed, error="RuntimeError: injected")
    for task in others:
        pool.answer(task)
    with caplog.at_level("INFO", logger="compileattn"):
        run.step(decode=True)
    assert f"the static compile of {failed.label} did not land (RuntimeError: no compiler)" in caplog.text
    failed_name = failed.label.split()[0]
    failed_sig = runtime.compiled.signatures[failed_name]
    for name, by_size in runtime.static.items():
        assert (STATIC in by_size) == (runtime.compiled.signatures[name] != failed_sig), name
    run.step(decode=False)


def test_tasks_no_worker_is_left_to_take_are_compiled_here(held, simulated_graphs):
    run = _Compiled(2)
    runtime, (pool,) = run.runtime, held
    pool.live = 0
    pool.on_result()  # what a stopping worker's thread does
    for left in range(len(pool.tasks) - 1, -1, -1):  # every task failed: compiled here, one per step
        with ca.counters.expect(static_landings=1, static_compiles_in_workers=0, backend_compiles=1):
            run.step(decode=True)
        assert runtime.pending_static_compiles() == left
    assert pool.closed and all(set(by_size) == {STATIC} for by_size in runtime.static.values())


def test_wait_for_static_pieces_installs_them(held):
    run = _Compiled(3, cudagraph_mode="none")
    runtime, (pool,) = run.runtime, held
    assert runtime.wait_for_static_pieces(timeout=0.05) is False
    first, *others = pool.tasks
    pool.answer(first)
    with ca.counters.expect(static_compiles_in_workers=1, backend_compiles=len(pool.tasks)):
        assert runtime.wait_for_static_pieces() is True  # no timeout: what no worker took is compiled here
    assert runtime.pending_static_compiles() == 0
    assert all(set(by_size) == {STATIC} for by_size in runtime.static.values())
    run.step(decode=True)  # mode "none": the static code runs


def test_the_warm_start_file_waits_for_the_landing(held, simulated_graphs, tmp_path, caplog):
    caplog.set_level("INFO", logger="compileattn")
    model, caches, builder, make_inputs, cfg = _setup(cache_dir=str(tmp_path / "cache"))
    forward = ca.compile(model.forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=cfg)
    rng = random.Random(4)
    _step(rng, model, forward, builder, caches, make_inputs, decode=True)
    (pool,) = held
    saved = lambda: sorted((tmp_path / "cache").glob("**/warm_start/*.bin"))  # noqa: E731
    assert saved() == []  # it would hold only the dynamic-shape pieces
    stats = forward.compile_stats
    assert stats["static_pending"] == len(pool.tasks) and "static_landed_s" not in stats
    for task in pool.tasks:
        pool.answer(task)
    _step(rng, model, forward, builder, caches, make_inputs, decode=True)
    assert len(saved()) == 1, caplog.text[-3000:]
    stats = forward.compile_stats
    assert stats["static_landed_s"] > 0 and stats["late_save_s"] > 0


@pytest.mark.parametrize("when", ["first_call", "after_dynamic"])
def test_real_workers_land_in_the_background(slow_workers, when):
    """End to end with one worker process (started at the first call, or once the dynamic pieces
    are compiled): the compile returns, the worker's static pieces land, the next step installs
    them, and the worker exits."""
    try:
        run = _Compiled(5, cudagraph_mode="none", compile_workers_start=when)
        runtime = run.runtime
        pool = runtime._landing.pool
        assert runtime.pending_static_compiles() > 0
        assert runtime.wait_for_static_pieces(timeout=600)
        assert all(set(by_size) == {STATIC} for by_size in runtime.static.values())
        run.step(decode=True)
        pool.join(timeout=30)
        assert all(p.poll() is not None for p in pool._procs)
    finally:
        compile_pool.release()


@pytest.fixture
def slow_workers(monkeypatch):
    """Real workers that start 5 s late: still out when the first call returns."""
    start_worker = compile_pool._start_worker
    monkeypatch.setattr(compile_pool, "_start_worker", lambda *a: (time.sleep(5), start_worker(*a))[1])


def test_a_worker_stuck_in_the_background_is_killed_and_its_pieces_compiled_here(slow_workers, monkeypatch, caplog):
    """Nobody drains a landing in the background, so its watchdog enforces the task timeout."""
    monkeypatch.setattr(compile_pool, "INJECT_FAILURE", "hang")
    monkeypatch.setattr(compile_pool, "TASK_TIMEOUT_S", 2.0)
    with caplog.at_level("INFO", logger="compileattn"):
        run = _Compiled(11, cudagraph_mode="none")
        runtime = run.runtime
        pool = runtime._landing.pool
        assert runtime.wait_for_static_pieces(timeout=120)
    assert "killed, the compiling process compiles it" in caplog.text
    assert all(set(by_size) == {STATIC} for by_size in runtime.static.values())
    run.step(decode=True)
    pool.join(timeout=30)
    assert all(p.poll() is not None for p in pool._procs)


def test_closing_a_pool_answers_the_tasks_it_still_held():
    pool = compile_pool.CompilePool(0)
    task = compile_pool.Task(0, "piece (2 tokens)", {})
    pool.submit(task)
    pool.close()
    assert task.result == ("error", "the compile pool was closed")


def test_a_static_artifact_that_does_not_load_falls_back_to_the_dynamic_piece(caplog):
    from compileattn.compilation.piecewise import PieceCode, _LoadOnFirstCall

    table = {}
    table[2] = _LoadOnFirstCall(table, 2, PieceCode("inductor", None, b"not an artifact"), lambda x: x + 1)
    with caplog.at_level("WARNING", logger="compileattn"):
        assert table[2](1) == 2
    assert table[2](5) == 6 and "does not load" in caplog.text


def test_a_process_ending_before_the_landing_waits_for_it_to_save(held, simulated_graphs, tmp_path, monkeypatch):
    """A short script exits before the workers finish: at exit it waits for them (bounded) and
    writes the warm start file, which would otherwise never exist."""
    import threading
    from compileattn.compilation import decorator

    registered = []

    class Exit:
        register = staticmethod(registered.append)
        unregister = staticmethod(registered.remove)

    monkeypatch.setattr(decorator, "_at_exit", Exit)
    model, caches, builder, make_inputs, cfg = _setup(cache_dir=str(tmp_path / "cache"))
    forward = ca.compile(model.forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=cfg)
    _step(random.Random(6), model, forward, builder, caches, make_inputs, decode=True)
    (pool,) = held
    (at_exit,) = registered
    answering = threading.Thread(target=lambda: [pool.answer(task) for task in pool.tasks])
    answering.start()
    at_exit()  # what the interpreter runs at exit
    answering.join()
    assert len(sorted((tmp_path / "cache").glob("**/warm_start/*.bin"))) == 1
    assert registered == [] and forward.compile_stats["late_save_s"] > 0


@pytest.mark.cuda
def test_cuda_static_pieces_land_and_real_graphs_are_captured_again(held):
    """The CPU test above with real CUDA graphs and Triton attention: the graphs of the landed
    size are captured again from the static code and replay right, before and after."""
    run = _Compiled(7, "cuda")
    runtime, (pool,) = run.runtime, held
    for decode in (False, True):
        run.step(decode=decode)
    assert runtime.pending_static_compiles() == len(pool.tasks) > 0
    for task in pool.tasks:
        pool.answer(task)
    with ca.counters.expect(static_landings=1):
        for decode in (True, False, True, False):
            run.step(decode=decode)
    assert runtime.pending_static_compiles() == 0
    assert all(set(by_size) == {STATIC} for by_size in runtime.static.values())
    assert runtime.full_graph_count() == 1 and runtime.piece_graph_count() > 0


def test_a_loaded_split_deserializes_a_static_size_when_it_first_runs():
    """A warm start loads each static size's pieces at that size's first step, not all up front."""
    from compileattn.compilation import artifact
    from compileattn.compilation.backend import compileattn_backend

    model, caches, builder, make_inputs, _ = _setup()
    loaded = []

    def backend(gm, example_inputs):
        compiled = compileattn_backend(gm, example_inputs, options={"compile_sizes": (2, STATIC),
                                                                    "compile_workers": 0})
        loaded.append(artifact.loads(artifact.dumps(getattr(compiled, "__self__", compiled))))
        return loaded[-1]

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    rng = random.Random(8)
    _step(rng, model, compiled, builder, caches, make_inputs, decode=True, tokens=3)  # neither static size
    (runtime,) = loaded
    codes = runtime.compiled.code
    assert all(not codes[key].loaded for key in codes if key[1] is not None)
    assert all(codes[key].loaded for key in codes if key[1] is None)
    _step(rng, model, compiled, builder, caches, make_inputs, decode=True)  # size 4: its pieces load now
    assert all(codes[key].loaded == (key[1] == STATIC) for key in codes if key[1] is not None)
    for by_size in runtime.static.values():
        assert type(by_size[STATIC]).__name__ != "_LoadOnFirstCall"  # replaced by the loaded code
        assert type(by_size[2]).__name__ == "_LoadOnFirstCall"
    _step(rng, model, compiled, builder, caches, make_inputs, decode=True, tokens=2)
    assert all(code.loaded for code in codes.values())


EXIT_SCRIPT = """
import random, sys, time
sys.path.insert(0, sys.argv[2])
import compileattn as ca
from compileattn.compilation import compile_pool
from test_static_landing import _setup, _step
start_worker = compile_pool._start_worker
compile_pool._start_worker = lambda *a: (time.sleep(5), start_worker(*a))[1]  # still out when the first call returns
model, caches, builder, make_inputs, cfg = _setup(cudagraph_mode="none", cache_dir=sys.argv[1])
forward = ca.compile(model.forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=cfg)
_step(random.Random(9), model, forward, builder, caches, make_inputs, decode=True)
print("PENDING", forward.compile_stats.get("static_pending", 0), flush=True)
"""


def test_a_real_process_exit_waits_for_the_workers_and_writes_the_warm_start(tmp_path):
    """The at-exit wait at a real interpreter exit, with a real worker: the script ends right after
    its first step and the warm start file exists once it has exited."""
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(tests).parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path / "cache"), tests], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split("PENDING")[-1].split()[0]) > 0  # the file was not written before the exit
    assert len(sorted((tmp_path / "cache").glob("**/warm_start/*.bin"))) == 1, proc.stderr[-3000:]


@pytest.fixture
def first_task_fails(monkeypatch):
    """The held pool's first task is answered with an error as soon as it is sent: failed before
    the compile hands the pool over."""
    submit = HeldPool.submit

    def submit_failing_first(pool, task):
        submit(pool, task)
        if len(pool.tasks) == 1:
            task.result = ("error", "RuntimeError: injected")

    monkeypatch.setattr(HeldPool, "submit", submit_failing_first)


def test_a_task_failed_before_the_hand_over_is_compiled_at_once(held, first_task_fails, simulated_graphs):
    """A worker answered an error before the compile returned: the compile compiles it itself."""
    with ca.counters.expect(static_compiles_in_workers=0):
        run = _Compiled(12)
    runtime, (pool,) = run.runtime, held
    first = pool.tasks[0].label.split()[0]
    assert runtime.pending_static_compiles() == len(pool.tasks) - 1
    assert [name for name, by_size in runtime.static.items() if by_size] == [first]


def test_a_drain_that_cannot_compile_a_task_still_settles(held, simulated_graphs, monkeypatch, caplog):
    run = _Compiled(13, cudagraph_mode="none")
    runtime, (pool,) = run.runtime, held
    _no_compiling_here(monkeypatch, runtime._landing)
    with caplog.at_level("INFO", logger="compileattn"):
        assert runtime.wait_for_static_pieces() is True
    assert runtime.pending_static_compiles() == 0 and pool.closed
    assert all(not by_size for by_size in runtime.static.values())
    assert "did not land (RuntimeError: no compiler)" in caplog.text
    assert runtime.wait_for_static_pieces() is True  # and again: nothing left to wait for
    run.step(decode=True)


def test_a_failing_callback_after_the_landing_does_not_stop_the_others(held, simulated_graphs, caplog):
    run = _Compiled(14)
    runtime, (pool,) = run.runtime, held
    ran = []
    runtime.when_static_settled(lambda: 1 / 0)
    runtime.when_static_settled(lambda: ran.append(True))
    for task in pool.tasks:
        pool.answer(task)
    with caplog.at_level("WARNING", logger="compileattn"):
        run.step(decode=True)
    assert ran == [True] and "ZeroDivisionError" in caplog.text


def test_waiting_compiles_here_what_slow_workers_did_not_start_and_the_workers_exit(slow_workers):
    """The engine's wait before capturing: nothing is left for the workers, which exit, with the
    watchdog, rather than idle for the rest of the process."""
    import threading

    try:
        run = _Compiled(15, cudagraph_mode="none")
        runtime = run.runtime
        pool = runtime._landing.pool
        with ca.counters.expect(static_compiles_in_workers=0):
            assert runtime.wait_for_static_pieces() is True
        assert all(set(by_size) == {STATIC} for by_size in runtime.static.values())
        pool.join(timeout=30)
        assert all(p.poll() is not None for p in pool._procs)
        deadline = time.monotonic() + 10
        while any(t.name == "compileattn-compile-watchdog" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the watchdog outlived its pool"
            time.sleep(0.05)
    finally:
        compile_pool.release()


def test_a_worker_that_never_gets_ready_is_killed_in_the_background(slow_workers, monkeypatch, caplog):
    monkeypatch.setattr(compile_pool, "READY_TIMEOUT_S", 1.0)
    with caplog.at_level("INFO", logger="compileattn"):
        run = _Compiled(16, cudagraph_mode="none")
        assert run.runtime.wait_for_static_pieces(timeout=120)
    assert "not ready after 1 s; killed" in caplog.text
    assert all(set(by_size) == {STATIC} for by_size in run.runtime.static.values())


def test_pieces_with_collectives_wait_for_their_static_pieces(held, simulated_graphs, monkeypatch, caplog):
    """Tensor-parallel pieces hold all-reduces: a rank recapturing after a landing would run them
    twice while the others run them once. So their compile waits (every rank captures in step)."""
    from compileattn.passes.split import Piece

    monkeypatch.setattr(Piece, "collectives", lambda self: 1)
    with caplog.at_level("INFO", logger="compileattn"):
        run = _Compiled(17)
    assert "holds collectives" in caplog.text
    assert run.runtime.pending_static_compiles() == 0
    assert all(set(by_size) == {STATIC} for by_size in run.runtime.static.values())


@pytest.mark.parametrize("where", ["splits", "ranks"])
def test_collectives_at_splits_or_several_ranks_also_wait(held, simulated_graphs, monkeypatch, where):
    from compileattn import _torch_compat
    from compileattn.passes.split import Piece

    if where == "splits":
        monkeypatch.setattr(Piece, "collectives", lambda self: int(self.is_splitting_op))
    else:
        monkeypatch.setattr(_torch_compat, "distributed_world_size", lambda: 2)
    run = _Compiled(18)
    assert run.runtime.pending_static_compiles() == 0
    assert all(set(by_size) == {STATIC} for by_size in run.runtime.static.values())


def test_a_failed_hand_over_stops_the_workers(held, first_task_fails, monkeypatch):
    from compileattn.compilation import piecewise

    compile_here = piecewise._PieceCompiler._compile_here

    def static_fails_here(self, piece, signature, args, size):
        if size is None:
            return compile_here(self, piece, signature, args, size)
        raise RuntimeError("cannot compile here either")

    monkeypatch.setattr(piecewise._PieceCompiler, "_compile_here", static_fails_here)
    with pytest.raises(Exception, match="cannot compile here either"):
        _Compiled(19, cudagraph_mode="none")
    (pool,) = held
    assert pool.closed


def test_no_warm_start_file_when_a_static_piece_never_landed(held, simulated_graphs, tmp_path, monkeypatch, caplog):
    model, caches, builder, make_inputs, cfg = _setup(cache_dir=str(tmp_path / "cache"))
    forward = ca.compile(model.forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=cfg)
    rng = random.Random(20)
    _step(rng, model, forward, builder, caches, make_inputs, decode=True)
    (pool,) = held
    (runtime,) = forward.runtimes
    _no_compiling_here(monkeypatch, runtime._landing)
    failed, *others = pool.tasks
    pool.answer(failed, error="RuntimeError: injected")
    for task in others:
        pool.answer(task)
    with caplog.at_level("WARNING", logger="compileattn"):
        _step(rng, model, forward, builder, caches, make_inputs, decode=True)
    assert runtime.pending_static_compiles() == 0 and runtime.static_incomplete
    assert sorted((tmp_path / "cache").glob("**/warm_start/*.bin")) == []
    assert "no warm start file saved" in caplog.text


@pytest.mark.parametrize("when", ["decoration", "first_call", "after_dynamic"])
def test_workers_start_when_configured(held, simulated_graphs, when):
    """"after_dynamic": the pool is made unstarted (no prestart before Dynamo either) and its
    workers start only once every task is submitted, i.e. after the last dynamic-shape compile
    (each piece's static tasks are sent just before its dynamic compile)."""
    run = _Compiled(0, compile_workers_start=when)
    (pool,) = held
    assert pool.tasks and pool.started_after == (len(pool.tasks) if when == "after_dynamic" else 0)
    for task in pool.tasks:
        pool.answer(task)
    run.step(decode=True)
    assert run.runtime.pending_static_compiles() == 0


def test_an_unknown_workers_start_is_refused():
    with pytest.raises(ValueError, match="compile_workers_start"):
        ca.CompileConfig(compile_workers_start="later")


# The exit's wait for static pieces still out is bounded for the whole process
# (``EXIT_WAIT_FOR_STATIC_S``), not once per compiled function.


def test_two_functions_waiting_at_exit_share_one_bound(held, monkeypatch, tmp_path):
    registered = []

    class Exit:
        register = staticmethod(registered.append)
        unregister = staticmethod(registered.remove)

    monkeypatch.setattr(decorator, "_at_exit", Exit)
    monkeypatch.setattr(decorator, "_exit_wait_started", None, raising=False)
    monkeypatch.setattr(decorator, "EXIT_WAIT_FOR_STATIC_S", 1.0)
    for seed in (0, 1):
        model, caches, builder, make_inputs, cfg = _setup(cache_dir=str(tmp_path / f"cache{seed}"),
                                                          cudagraph_mode="none")
        forward = ca.compile(model.forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=cfg)
        _step(random.Random(seed), model, forward, builder, caches, make_inputs, decode=True)
    assert len(registered) == 2 and len(held) == 2  # nothing answered: both wait
    start = time.monotonic()
    for at_exit in reversed(list(registered)):  # what the interpreter runs at exit
        at_exit()
    assert time.monotonic() - start < 1.8


# ``wait_for_static_pieces(timeout)`` (and the exit's wait, ``EXIT_WAIT_FOR_STATIC_S``) is bounded:
# static compiles the workers failed are compiled in-process only while time is left.


def test_a_timed_wait_compiles_failed_pieces_here_only_while_time_is_left(held):
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
