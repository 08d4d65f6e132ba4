"""The compile workers' fork server (compilation/fork_server.py): forked workers are ready at once
and serve tasks like fresh ones; a server that cannot fork leaves the pool to fresh interpreters;
nothing outlives the pool."""
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from compileattn.compilation import compile_pool, fork_server
from processes import assert_all_end


def _ready(pool: compile_pool.CompilePool, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while any(r is None for r in pool.ready_after) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(r is not None for r in pool.ready_after), pool.failures


def test_a_pool_of_several_forks_its_workers_from_one_server():
    pool = compile_pool.CompilePool(3)
    try:
        _ready(pool)
        server = pool._fork_server
        assert server is not None and server.ready_after is not None
        assert all(isinstance(p, fork_server.ForkedWorker) for p in pool._procs)
        assert len(set(pool.pids())) == 3 and server.pid not in pool.pids()
        # ready when the server is: the imports were the server's, once
        assert max(pool.ready_after) - server.ready_after < 5
    finally:
        pool.close(wait=True)
    deadline = time.monotonic() + 10
    while any(p.poll() is None for p in pool._procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(p.poll() is not None for p in pool._procs)
    assert server._proc.wait(timeout=10) == 0  # the server too, once its workers are gone


def test_a_forked_worker_answers_a_task_like_a_fresh_one(monkeypatch):
    """An injected error goes through the whole path: the task reaches the forked worker, which
    answers with its error and traceback (the pool then compiles it here)."""
    monkeypatch.setattr(compile_pool, "INJECT_FAILURE", "error")
    pool = compile_pool.CompilePool(2)
    try:
        task = compile_pool.Task(0, "piece (2 tokens)", {"graph": b"", "inputs": None})
        pool.submit(task)
        deadline = time.monotonic() + 120
        while task.result is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert task.result is not None and task.result[0] == "error"
        assert "injected failure" in task.result[1]
        assert pool._fork_server is not None and all(isinstance(p, fork_server.ForkedWorker) for p in pool._procs)
    finally:
        pool.close(wait=True)


def test_a_server_that_cannot_start_leaves_the_pool_to_fresh_interpreters(monkeypatch, caplog):
    """A server that dies before it is ready (here: an interpreter that cannot start) answers
    nothing; the workers start as fresh interpreters, saying why once."""
    real = fork_server.ForkServer

    def broken(env, niceness, ready_timeout, fork_here=False):
        return real(dict(env, PYTHONHOME=os.devnull), niceness, ready_timeout, fork_here=False)

    monkeypatch.setattr(fork_server, "ForkServer", broken)
    monkeypatch.setattr(compile_pool, "_no_fork_noted", set())
    with caplog.at_level(logging.INFO, logger="compileattn"):
        pool = compile_pool.CompilePool(2)
        try:
            _ready(pool)
            assert all(not isinstance(p, fork_server.ForkedWorker) for p in pool._procs)
        finally:
            pool.close(wait=True)
    assert caplog.text.count("compile workers start as fresh interpreters: the fork server did not start") == 1


_FORKED_HERE = """
import atexit, os, sys, time
from compileattn.compilation import compile_pool, fork_server
atexit.register(lambda: print("atexit", flush=True))
assert fork_server.why_not_fork_here() is None, fork_server.why_not_fork_here()
read_end, write_end = os.pipe()
pool = compile_pool.CompilePool(2)
print("after the pool", flush=True)
deadline = time.monotonic() + 120
while any(r is None for r in pool.ready_after) and time.monotonic() < deadline:
    time.sleep(0.02)
server = pool._fork_server
print("forked here:", server.forked_here, "workers forked:",
      all(isinstance(p, fork_server.ForkedWorker) for p in pool._procs), "ready:", server.ready_after is not None)
os.close(write_end)  # the server and its workers must not hold a copy of it
print("EOF with the server alive:", os.read(read_end, 1) == b"" and server._proc.poll() is None, flush=True)
pool.close(wait=True)
print("server exit status:", server._proc.wait(timeout=30), flush=True)
"""


def _run_forking(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh single-threaded process, with the workers' environment (and no
    ``TRITON_CACHE_DIR``, as a program that sets none)."""
    env = compile_pool._worker_env()
    env.pop("TRITON_CACHE_DIR", None)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env)


def test_the_fork_server_is_a_fork_of_a_single_threaded_process():
    """Torch is imported already, so the fork is ready one Inductor import after its start. It
    keeps none of this process's pipes (a copy of a pipe's write end would keep its reader from
    seeing EOF), never returns into the code it was forked from (no second "after the
    pool"), runs none of this process's exit handlers, and exits 0 once its workers have."""
    out = _run_forking(_FORKED_HERE)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines.count("after the pool") == 1 and lines.count("atexit") == 1, out.stdout
    assert "forked here: True workers forked: True ready: True" in lines, out.stdout
    assert "EOF with the server alive: True" in lines, out.stdout
    assert "server exit status: 0" in lines, out.stdout


def test_a_forked_servers_exit_status_is_not_lost_to_a_concurrent_poll():
    """The reaper thread (``ForkServer._stop``) waits for the server while ``wait(timeout)``,
    ``kill`` or the handshake poll it: a poll must not reap it between the reaper's ``waitpid``
    and its record (a clean exit was recorded as -1, a few in 300 before the reaper held the lock)."""
    wrong = 0
    for _ in range(300):
        pid = os.fork()
        if pid == 0:
            time.sleep(0.005)
            os._exit(0)
        child = fork_server._ServerChild(pid)
        threading.Thread(target=child.wait, daemon=True).start()
        wrong += child.wait(timeout=30) != 0
    assert wrong == 0, f"{wrong} of 300 clean exits recorded as another status"


_LOCK_HELD_AT_THE_FORK = """
import fcntl, sys, time
from compileattn.compilation import compile_pool
lock = open(sys.argv[1], "w")
fcntl.flock(lock, fcntl.LOCK_EX)
pool = compile_pool.CompilePool(2)
deadline = time.monotonic() + 120
while any(r is None for r in pool.ready_after) and time.monotonic() < deadline:
    time.sleep(0.02)
assert pool._fork_server.forked_here and all(r is not None for r in pool.ready_after)
lock.close()  # released by closing its descriptor, as at a process's exit
other = open(sys.argv[1], "w")
try:
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free once closed: True", flush=True)
except BlockingIOError:
    print("free once closed: False", flush=True)
pool.close(wait=True)
"""


def test_a_file_lock_held_at_the_fork_is_not_held_by_the_server(tmp_path):
    """An ``flock`` belongs to the open file, which a fork shares: one the compiling process held
    when the server was forked from it, and released by closing its descriptor, stayed held by the
    server and its workers (a program's lock file, released at its exit, blocked its next start)."""
    out = _run_forking(_LOCK_HELD_AT_THE_FORK, str(tmp_path / "lock"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "free once closed: True" in out.stdout.splitlines(), out.stdout


_USERS_SIGTERM = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda signum, frame: open(sys.argv[1], "a").write(f"ran in {os.getpid()}\\n"))
import compileattn as ca
from compileattn.compilation import compile_pool
ca.compile(lambda x: x + 1, dynamic_arg_dims={"x": 0}, config=ca.CompileConfig(compile_sizes=(1, 2), compile_workers=2))
server = compile_pool._early[0]
assert server.forked_here
os.kill(server.pid, signal.SIGTERM)
deadline = time.monotonic() + 30
while server._proc.poll() is None and time.monotonic() < deadline:
    time.sleep(0.02)
print("server ended by SIGTERM:", server._proc.poll() == -signal.SIGTERM, flush=True)
"""


def test_the_users_signal_handlers_do_not_run_in_the_forked_server(tmp_path):
    """A SIGTERM ends the server as it ends a fresh interpreter, rather than running the user's
    handler there (which may only set a flag and leave the server running)."""
    ran = tmp_path / "handler.log"
    out = _run_forking(_USERS_SIGTERM, str(ran))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "server ended by SIGTERM: True" in out.stdout.splitlines(), out.stdout
    assert not ran.exists(), ran.read_text()


_WAKEUP_FD = """
import os, select, signal, socket, time
a, b = socket.socketpair()
a.setblocking(False)
b.setblocking(False)
signal.signal(signal.SIGTERM, lambda *_: None)  # as asyncio's loop.add_signal_handler does
signal.set_wakeup_fd(b.fileno())
from compileattn.compilation import compile_pool
pool = compile_pool.CompilePool(2)
deadline = time.monotonic() + 120
while any(r is None for r in pool.ready_after) and time.monotonic() < deadline:
    time.sleep(0.05)
assert pool._fork_server.forked_here
stray = []
for proc in pool._procs:
    os.kill(proc.pid, signal.SIGTERM)
time.sleep(1)
for proc in pool._procs:
    if select.select([proc.stdout], [], [], 0)[0]:
        stray.append(os.read(proc.stdout.fileno(), 16))
print("stray bytes on the answer pipes:", [s for s in stray if s], flush=True)
pool.close(kill=True, wait=True)
"""


def test_a_signal_wakeup_descriptor_does_not_write_into_a_workers_answers():
    """The wakeup socket's number, closed in the fork, is reused by a worker's pipe: a handled
    signal must not write its byte there (it broke the answers' length framing)."""
    out = _run_forking(_WAKEUP_FD)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stray bytes on the answer pipes: []" in out.stdout.splitlines(), out.stdout


_SETTLED_CACHE_DIR = """
import torch
import compileattn as ca
from compileattn.compilation import compile_pool, kernel_warmup
ca.compile(lambda x: x + 1, dynamic_arg_dims={"x": 0}, config=ca.CompileConfig(compile_sizes=(1, 2), compile_workers=2))
early = compile_pool._early[0]
kernel_warmup._settle_cache_dir(torch.device("cuda", 0))  # what a first call on a GPU does first
pool = compile_pool.prestart(2)
print("the first call's pool forks from the server made at decoration:", pool._fork_server is early, flush=True)
compile_pool.release(wait=True)
"""


def test_the_triton_cache_dir_a_first_call_settles_keeps_the_server_made_at_decoration():
    """The first call on a GPU sets ``TRITON_CACHE_DIR`` (``kernel_warmup``) to what Inductor sets it
    to in every process: not a change of environment that would throw the forked server away for a
    fresh interpreter (CUDA is initialised by then)."""
    out = _run_forking(_SETTLED_CACHE_DIR)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the first call's pool forks from the server made at decoration: True" in out.stdout.splitlines(), out.stdout


_LARGE_PROCESS = """
import torch
import compileattn as ca
from compileattn.compilation import compile_pool, fork_server
fork_server.FORK_MAX_RESIDENT_BYTES = fork_server.resident_bytes() + (64 << 20)
weights = torch.ones(256 << 20, dtype=torch.uint8)  # a model built on the CPU before decoration
print("why not:", fork_server.why_not_fork_here(), flush=True)
ca.compile(lambda x: x + 1, dynamic_arg_dims={"x": 0}, config=ca.CompileConfig(compile_sizes=(1, 2), compile_workers=2))
print("early server:", compile_pool._early is not None, flush=True)
"""


def test_a_process_holding_much_memory_is_not_forked():
    """What it frees or rewrites after a fork would stay held by the server until its pool closes."""
    out = _run_forking(_LARGE_PROCESS)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MiB of memory (more than" in out.stdout and "early server: False" in out.stdout.splitlines(), out.stdout


def test_a_process_running_another_python_thread_starts_a_fresh_server():
    """A fork would copy the locks another thread may hold: the server is a fresh interpreter."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        assert "Python threads run in this process" in fork_server.why_not_fork_here()
        pool = compile_pool.CompilePool(2)
        try:
            assert pool._fork_server is not None and not pool._fork_server.forked_here
        finally:
            pool.close(wait=True)
    finally:
        stop.set()
        thread.join()


def test_one_worker_is_a_fresh_interpreter():
    pool = compile_pool.CompilePool(1, start=False)
    pool.start()
    try:
        assert pool._fork_server is None
    finally:
        pool.close(wait=True)


def test_this_process_is_untouched_by_cuda_only_without_a_gpu():
    """The check the server makes before it forks: on a CPU box nothing loads CUDA's driver; where
    torch has initialised CUDA, a fork could not use it and the check says so."""
    if torch.cuda.is_available():
        torch.cuda.init()
        assert fork_server.cuda_touched() is not None
    else:
        assert fork_server.cuda_touched() is None


_SERVER_CHECK = """
import ctypes, os
from compileattn.compilation import compile_worker, fork_server
compile_worker.import_for_worker()
print("after imports:", fork_server.cuda_touched())
ctypes.CDLL("libcuda.so.1").cuInit(0)
print("after cuInit:", fork_server.cuda_touched())
"""


@pytest.mark.cuda
def test_the_servers_imports_leave_cuda_uninitialised_and_the_check_sees_cuinit():
    """What the server relies on, on a GPU machine: its imports (with torch's NVML-only GPU check)
    do not initialise the CUDA driver, so forked workers can; and ``cuda_touched`` tells an
    initialised driver from a merely loaded library."""
    env = dict(compile_pool._worker_env(), PYTORCH_NVML_BASED_CUDA_CHECK="1")
    out = subprocess.run([sys.executable, "-c", _SERVER_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "after imports: None" in out.stdout
    assert "after cuInit: the CUDA driver was initialised during the imports" in out.stdout


@pytest.mark.cuda
def test_cuda_initialised_here_is_seen_by_the_check():
    torch.zeros(1, device="cuda")
    assert fork_server.cuda_touched() is not None


# -- the fork server started at decoration (compile_workers_start="decoration") -----------------------


@pytest.fixture
def no_early_server():
    compile_pool.drop_early_fork_server()
    yield
    compile_pool.drop_early_fork_server()


def test_a_pool_takes_the_fork_server_started_early(no_early_server):
    assert compile_pool.start_fork_server_early(2)
    early = compile_pool._early[0]
    pool = compile_pool.CompilePool(2)
    try:
        assert pool._fork_server is early and compile_pool._early is None
        _ready(pool)
        assert all(isinstance(p, fork_server.ForkedWorker) for p in pool._procs)
    finally:
        pool.close(wait=True)


def test_a_fork_server_started_under_another_environment_is_not_used(no_early_server, monkeypatch):
    """Its workers would inherit the old environment (a cache dir, a setting): closed, and the
    pool starts its own."""
    assert compile_pool.start_fork_server_early(2)
    early = compile_pool._early[0]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nonexistent/changed")
    pool = compile_pool.CompilePool(2, start=False)
    pool.start()
    try:
        assert pool._fork_server is not None and pool._fork_server is not early
        assert early._closed and early._proc.wait(timeout=30) is not None
    finally:
        pool.close(wait=True)


def test_an_unused_early_server_is_dropped(no_early_server):
    assert not compile_pool.start_fork_server_early(1)  # one worker is a fresh interpreter: no server
    assert compile_pool.start_fork_server_early(2)
    early = compile_pool._early[0]
    compile_pool.drop_early_fork_server()
    assert compile_pool._early is None and early._closed
    assert early._proc.wait(timeout=30) is not None  # killed while importing, or exits once ready


_FORKED_CHILDREN = r"""
import os, torch
import compileattn as ca
from compileattn.compilation import compile_pool
config = ca.CompileConfig(compile_sizes=(1, 2), compile_workers=2, cudagraph_mode="none")
f = ca.compile(lambda x: x * 2 + 1, dynamic_arg_dims={"x": 0}, config=config)
assert compile_pool._early is not None
kids = []
for i in range(2):  # a pre-forking server's workers (gunicorn --preload), multiprocessing's fork
    pid = os.fork()
    if pid == 0:
        x = torch.randn(3)
        assert torch.equal(f(x), x * 2 + 1)
        landed = f.wait_for_static_pieces(timeout=120)
        print(f"child {i}: landed={landed} in_workers={ca.counters.static_compiles_in_workers}", flush=True)
        os._exit(0)
    kids.append(pid)
for kid in kids:
    os.waitpid(kid, 0)
"""


def test_processes_forked_after_decoration_do_not_share_its_fork_server():
    """Each child forgets the parent's early server (their requests and answers interleaved on its
    one socket: each waited forever and no static piece landed) and compiles with its own workers."""
    out = _run_forking(_FORKED_CHILDREN)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("child"))
    assert lines == ["child 0: landed=True in_workers=2", "child 1: landed=True in_workers=2"], out.stdout


def test_another_functions_first_call_keeps_the_early_fork_server(no_early_server):
    """The early server is dropped at the first call of the function it was started for (if no
    pool took it), not at another's that wants no workers."""
    import compileattn as ca

    f = ca.compile(lambda x: x * 2 + 1, dynamic_arg_dims={"x": 0},
                   config=ca.CompileConfig(compile_sizes=(1, 2), compile_workers=2,
                                           compile_workers_start="decoration", cudagraph_mode="none"))
    early = compile_pool._early
    assert early is not None
    g = ca.compile(lambda x: x - 1, dynamic_arg_dims={"x": 0},
                   config=ca.CompileConfig(compile_sizes=(), cudagraph_mode="none"))
    x = torch.randn(3)
    assert torch.equal(g(x), x - 1)
    assert compile_pool._early is early and not early[0]._closed
    assert torch.equal(f(x), x * 2 + 1) and compile_pool._early is None  # f's pool took it
    assert f.wait_for_static_pieces(timeout=300)


def _forward(x):
    return x + 1


def _decorate(config):
    import compileattn as ca

    return ca.compile(_forward, dynamic_arg_dims={"x": 0}, config=config)


@pytest.mark.parametrize("case", ["decoration", "first_call", "no static sizes", "warm start file"])
def test_decoration_starts_the_fork_server_only_where_a_compile_will_fork_workers(no_early_server, tmp_path,
                                                                                   case):
    import compileattn as ca
    from compileattn.compilation import warm_start

    config = ca.CompileConfig(compile_sizes=() if case == "no static sizes" else (1, 2), compile_workers=2,
                              cache_dir=str(tmp_path / "cache"),
                              compile_workers_start="first_call" if case == "first_call" else "decoration")
    if case == "warm start file":
        saved = tmp_path / "cache" / "warm_start" / f"{warm_start.function_tag(_forward)}-0123.bin"
        saved.parent.mkdir(parents=True)
        saved.write_bytes(b"")
        assert warm_start.saved_for(config, _forward)
    _decorate(config)
    assert (compile_pool._early is not None) == (case == "decoration")


_AUTO_AT_DECORATION = """
import sys, threading
import compileattn as ca
from compileattn.compilation import compile_pool
stop = threading.Event()
if sys.argv[1] == "thread":
    threading.Thread(target=stop.wait, daemon=True).start()
config = ca.CompileConfig(compile_sizes=(1, 2), compile_workers=2)
assert config.compile_workers_start == "auto"
ca.compile(lambda x: x + 1, dynamic_arg_dims={"x": 0}, config=config)
early = compile_pool._early
print("early server:", early is not None and early[0].forked_here, flush=True)
stop.set()
"""


@pytest.mark.parametrize("threads", ["one", "thread"])
def test_auto_starts_the_fork_server_at_decoration_only_as_a_fork(threads):
    """``compile_workers_start="auto"`` (the default): a fork of a single-threaded process at
    decoration; with another Python thread running, nothing until the first call (a fresh
    interpreter then, as with "first_call")."""
    out = _run_forking(_AUTO_AT_DECORATION, threads)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"early server: {threads == 'one'}" in out.stdout.splitlines(), out.stdout


def test_the_first_calls_pool_forks_from_the_early_server(no_early_server, monkeypatch):
    import compileattn as ca

    taken = []
    start = compile_pool.CompilePool.start
    monkeypatch.setattr(compile_pool.CompilePool, "start", lambda pool: (start(pool), taken.append(pool))[0])
    config = ca.CompileConfig(compile_sizes=(1, 2), compile_workers=2, compile_workers_start="decoration",
                              cudagraph_mode="none")
    compiled = _decorate(config)
    early = compile_pool._early[0]
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    assert compile_pool._early is None and taken and all(pool._fork_server is early for pool in taken)
    assert compiled.wait_for_static_pieces(timeout=300)


def test_a_first_call_without_workers_closes_the_early_server(no_early_server, monkeypatch):
    """No pool takes the server (here: another thread's compile holds the workers): the first
    call closes it rather than leave a process importing for nothing."""
    import compileattn as ca

    monkeypatch.setattr(compile_pool, "acquire", lambda *a, **k: None)
    monkeypatch.setattr(compile_pool, "prestart", lambda *a, **k: None)
    config = ca.CompileConfig(compile_sizes=(1, 2), compile_workers=2, compile_workers_start="decoration",
                              cudagraph_mode="none")
    compiled = _decorate(config)
    early = compile_pool._early[0]
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    assert compile_pool._early is None and early._closed


def test_saved_for_reads_only_this_functions_files(tmp_path):
    import compileattn as ca
    from compileattn.compilation import warm_start

    def first(x):
        return x

    def second(x):
        return x

    config = ca.CompileConfig(cache_dir=str(tmp_path))
    assert not warm_start.saved_for(config, first)
    (tmp_path / "warm_start").mkdir()
    (tmp_path / "warm_start" / f"{warm_start.function_tag(first)}-abc.bin").write_bytes(b"")
    assert warm_start.saved_for(config, first) and not warm_start.saved_for(config, second)
    assert not warm_start.saved_for(ca.CompileConfig(), first)


# A function decorated inside ``torch.autocast`` starts its fork server then, as a fork of this
# thread: the workers forked from it inherited autocast, and compiled every piece with its casts
# (bf16 outputs the KV-cache write refused: a RuntimeError at the first call). A worker compiles
# with autocast off, as the compiling process does (it sends no task under autocast).


_AUTOCAST_SCRIPT = """
import random, sys
sys.path.insert(0, "tests")
import torch
import compileattn as ca
from compileattn.compilation import compile_pool
import test_static_landing as t

compile_pool.COMPILE_UNSTARTED_HERE = False  # the workers compile every piece
model, caches, builder, make_inputs, cfg = t._setup(compile_workers=2, compile_workers_start="decoration",
                                                    cudagraph_mode="none")
with torch.autocast("cpu", dtype=torch.bfloat16):
    forward = ca.compile(model.forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=cfg)
assert compile_pool._early is not None and compile_pool._early[0].forked_here
rng = random.Random(4)
t._step(rng, model, forward, builder, caches, make_inputs, decode=True)
assert forward.wait_for_static_pieces(timeout=200)
t._step(rng, model, forward, builder, caches, make_inputs, decode=True)
print("in workers:", ca.counters.dynamic_compiles_in_workers, ca.counters.static_compiles_in_workers, flush=True)
"""


def test_workers_forked_from_a_server_started_under_autocast_compile_without_it(tmp_path):
    env = compile_pool._worker_env()
    env.pop("TRITON_CACHE_DIR", None)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    out = subprocess.run([sys.executable, "-c", _AUTOCAST_SCRIPT], capture_output=True, text=True, timeout=400, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("in workers"))
    dynamic, static = map(int, line.split(":")[1].split())
    assert dynamic > 0 and static > 0, line


# A fork server started from inside a torch.compile trace (``torch.compile(model,
# backend="compileattn")``: the backend starts the pool while Dynamo traces) must not be a fork of
# this process: the fork's thread is the tracing one, and every worker forked from it inherited
# Dynamo's tracing context (its fake mode and ShapeEnv of the moment of the fork), in which each
# dynamic-shape compile failed ("vr must not be None for symbol s7") and was done again in-process,
# or would have compiled against a stale ShapeEnv.


_TRACE_SCRIPT = """
import sys
sys.path.insert(0, "tests")
import compileattn as ca
from compileattn.compilation import compile_pool, fork_server
import test_compile_pool as t
assert fork_server.why_not_fork_here() is None, fork_server.why_not_fork_here()
compile_pool.COMPILE_UNSTARTED_HERE = False  # the workers compile every piece
runtime, _, sources = t._compile_and_run(workers=2)
distinct = sum(size is not None for _, size in sources)
print("dynamic in workers:", ca.counters.dynamic_compiles_in_workers, "of", distinct, flush=True)
"""


def test_a_pool_started_inside_a_trace_compiles_the_dynamic_pieces_in_its_workers(tmp_path):
    env = compile_pool._worker_env()
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    out = subprocess.run([sys.executable, "-c", _TRACE_SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("dynamic in workers"))
    _, counts = line.split(":")
    done, _, distinct = counts.split()
    assert done == distinct, (line, out.stderr[-3000:])


def test_no_fork_here_inside_a_tracing_context():
    import torch
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode())):
        why = fork_server._tracing_here()  # (why_not_fork_here may name another reason first)
        assert fork_server.why_not_fork_here() is not None
    assert why is not None and "trac" in why, why
    assert fork_server._tracing_here() is None
    assert torch  # imported for the tracing context's types


def test_a_server_that_stops_answering_fails_the_fork_within_its_bound(monkeypatch):
    """A ready server answers a fork in milliseconds; one stopped (SIGSTOP) blocked ``fork``, and
    with it every pool thread waiting on its lock, for good. Past ``FORK_ANSWER_TIMEOUT_S`` the
    fork fails as for a server that died (the pool then compiles in-process)."""
    import signal

    monkeypatch.setattr(fork_server, "FORK_ANSWER_TIMEOUT_S", 1.0)
    server = fork_server.ForkServer(dict(os.environ), 0, 120.0)
    workers = []
    try:
        workers.append(server.fork())  # the handshake, and a fork answered
        os.kill(server.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(fork_server.ForkError, match="the fork server stopped"):
            server.fork()
        assert time.monotonic() - start < 10
    finally:
        try:
            os.kill(server.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        for w in workers:
            w.stdin.close()
        server.close()


# A worker busy on a task when the compiling process ends (killed, or a normal exit with the pool
# still open) sees its task pipe close only at its next read: after a compile of minutes, or never
# where the compile is stuck (here: the "hang" injection), since the watchdog that would have
# killed it ended with the compiling process; a fork server waits for it meanwhile.


_ORPHANED = """
import os, signal, sys, time
from compileattn.compilation import compile_pool
compile_pool.FORK_WORKERS = sys.argv[1] == "forked"
compile_pool.INJECT_FAILURE = "hang"
pool = compile_pool.CompilePool(2)
deadline = time.monotonic() + 200
while any(r is None for r in pool.ready_after) and time.monotonic() < deadline:
    time.sleep(0.05)
for i in range(2):
    pool.submit(compile_pool.Task(i, "piece", {"graph": b"", "inputs": None}))
while any(t.started is None for t in pool._submitted) and time.monotonic() < deadline:
    time.sleep(0.05)
server = pool._fork_server
print("pids", *([server.pid] if server is not None else []), *pool.pids(), flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("workers, end", [("forked", "kill"), ("forked", "exit"), ("fresh", "kill")])
def test_no_worker_outlives_the_compiling_process(workers, end, tmp_path):
    env = compile_pool._worker_env()
    env.pop("TRITON_CACHE_DIR", None)
    # stderr to a file: the server and workers write theirs there, and outlive the process without the fix
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", _ORPHANED, workers, end], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert proc.wait(timeout=300) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    assert line.startswith("pids"), (tmp_path / "stderr").read_text()[-3000:]
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == (3 if workers == "forked" else 2), line
    assert_all_end(pids, 30, f"still running after the {end}: {line}")


# A fresh-interpreter server (the compiling process had threads or CUDA when it started one) whose
# compiling process ends while the server imports: it saw the end only at its "ready" answer, and
# so outlived the process by its imports (seconds; 9-15 s on the H200's host). Here its import of
# Inductor is made to take two minutes (a sitecustomize's import hook) so the two are told apart.

_SLOW_INDUCTOR = """
import sys, time

class _Slow:
    def find_spec(self, name, path=None, target=None):
        if name == "torch._inductor.compile_fx":
            sys.meta_path.remove(self)
            time.sleep(120)
        return None

sys.meta_path.insert(0, _Slow())
"""

_SERVER_ORPHANED = """
import os, signal, sys
from compileattn.compilation import compile_pool, fork_server
env = compile_pool._worker_env()
env["PYTHONPATH"] = os.pathsep.join([sys.argv[1], env["PYTHONPATH"]])
server = fork_server.ForkServer(env, 10, 300, fork_here=False)
print(server.pid, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(0)
"""


@pytest.mark.parametrize("end", ["kill", "exit"])
def test_a_server_still_importing_does_not_outlive_the_compiling_process(end, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_SLOW_INDUCTOR)
    # stderr to a file: the server writes its own there, and would hold a pipe open while it lives
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.run([sys.executable, "-c", _SERVER_ORPHANED, str(tmp_path), end], stdout=subprocess.PIPE,
                              stderr=err, text=True, timeout=120)
    assert proc.stdout.strip().isdigit(), (tmp_path / "stderr").read_text()[-3000:]
    pid = int(proc.stdout)
    # its interpreter's start and torch's import come first (the watch starts with the imports it serves for)
    assert_all_end([pid], 30, f"the fork server still runs after the compiling process's {end}")
