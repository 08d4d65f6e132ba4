"""Compile workers forked, ready, from one process that imported torch, compileattn and Inductor.

A compile worker (``compile_pool.py``, ``compile_worker.py``) is useful only once it has imported torch, compileattn and
Inductor: several seconds of CPU per interpreter. Eight fresh interpreters importing at once, beside
the compiling process's Dynamo trace, were ready only 10-16 s after they started on the H200's
16-CPU host (runs S7-1, S11-5), when the compile had long done its own work. A **fork server** pays
the import once: one process imports everything a worker needs, says it is ready, and then forks a
worker per request; a forked worker shares the imported modules' pages and is ready at once.
Inductor's own compile subprocess does the same (it imports, then forks its pool).

- **Where the server comes from**: a fork of this process where that is safe (``why_not_fork_here``:
  one Python thread, CUDA's driver not initialised, at most ``FORK_MAX_RESIDENT_BYTES`` resident,
  Linux, not inside a torch.compile trace, whose thread-local tracing state a fork would carry into
  every worker), else a fresh interpreter
  (``python -c``). The fork has torch imported already, so it is ready one Inductor import after
  its start; a fresh interpreter first imports torch, which took 9-15 s on the H200's host beside
  the model's build and Dynamo's trace (runs S13-1, S13-2, S15-1): later than the compiling process
  needed the workers for its dynamic-shape compiles. ``@compileattn.compile`` starts it at
  decoration where it can fork then (before the model is built, CUDA is untouched), and at the
  first call otherwise, when a CUDA context usually exists and only a fresh interpreter can serve.
  A forked server closes the pipes and sockets it inherited (a copy of one of this process's pipe
  ends would keep its reader from ever seeing EOF), freezes the garbage collector (an inherited
  object collected there would close a descriptor number the server has reused) and never returns
  into the code it was forked from (``os._exit``); the user's signal handlers and signal wakeup
  descriptor are dropped there. Regular files and other descriptors stay open in it, except those
  holding a file lock (``_drop_inherited_file_locks``). Native thread pools may run beside the one
  Python thread: numpy's OpenBLAS starts one at import and re-creates
  its threads in a fork; GNU OpenMP's (torch's CPU kernels, once one ran in parallel) does not, and
  a parallel CPU kernel in the fork would hang. The server and its workers run none: they compile
  on fake tensors (a CPU piece's compile in a worker was checked not to hang after a parallel op
  here), which is why Python's warning about forking a process with native threads is silenced.

- **No CUDA before the fork**: a process forked after CUDA's driver was initialised cannot use
  CUDA, and a worker compiling a GPU piece does (device properties, Triton's target). The server
  asks torch whether a GPU exists through NVML only (``PYTORCH_NVML_BASED_CUDA_CHECK``) and, after
  its imports, checks that neither torch nor anything else initialised the driver (``cuda_touched``:
  its imports do load the driver library, Triton's CUDA utilities link it, as run S12-3 found);
  if one did, it refuses to fork, saying why, and the pool starts fresh interpreters instead
  (``compile_pool._start_worker``).
- **Priority**: the server imports at normal priority (at niceness 10, beside Inductor's own
  compile subprocesses, it was ready only 12 s after its start in run S12-3: too late to take any
  of the compiling process's work); each forked worker lowers its own priority.
- **Protocol**: the compiling process gives the server its ``sys.path`` on stdin; the server
  answers on a Unix socket ("ready" with the clock times of its first statement and of its
  readiness, or why it cannot fork), then serves fork requests on that socket: each carries
  the two pipe ends (SCM_RIGHTS) the worker talks over,
  made by the compiling process, so a forked worker is reached exactly like a fresh one (its
  stdin/stdout), and the answer is the worker's pid.
- **Children**: the server ignores SIGCHLD, so the kernel reaps its exited workers (no zombies);
  a worker restores the default at once (its compiles run ``ptxas`` and ``subprocess`` must see
  their exit status). A worker exits when its stdin closes, as a fresh one does; the server exits
  when its socket closes (the pool's ``close``, or the compiling process's exit), also while it
  still imports (``_exit_if_closed_meanwhile``).
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

from . import wire

logger = logging.getLogger("compileattn")

_PID = struct.Struct("<q")
#: The request byte of a fork (its two pipe ends ride along as SCM_RIGHTS).
_FORK = b"F"
#: The largest process forked into the server: a fork shares its pages until either side writes
#: or frees them, so memory the process frees after the fork (a model built on the CPU, then moved
#: to the GPU) or rewrites (weights loaded in place) stays held, or is copied, until the server
#: exits with its pool. torch, transformers and compileattn imported hold a few hundred MiB on
#: the CPU machine (not measured on the GPU host, whose CUDA libraries add to it: the limit leaves
#: room for them), a model of a billion parameters built on the CPU holds 2-4 GiB.
FORK_MAX_RESIDENT_BYTES = 4 << 30
#: Seconds a ready server may take to answer a fork with the worker's pid. It answers in
#: milliseconds (one ``fork``); without a bound, a server stopped or wedged (SIGSTOP, a debugger)
#: blocked every pool thread on the lock ``fork`` holds, and a landing's wait ran to its exit
#: bound. Past it the server is given up as one that died: its compiles run in-process.
FORK_ANSWER_TIMEOUT_S = 30.0
#: What a CUDA driver call returns before ``cuInit``.
_CUDA_ERROR_NOT_INITIALIZED = 3


class ForkError(RuntimeError):
    """The server cannot (or can no longer) fork workers; the pool starts fresh interpreters."""


class ForkServerClosed(ForkError):
    """The pool closed the server: no worker is wanted any more."""


class ForkedWorker:
    """A worker forked by the server, reached over two pipes; what the pool needs of a
    ``subprocess.Popen`` (``stdin``, ``stdout``, ``pid``, ``poll``, ``kill``, ``wait``). It is the
    server's child, not this process's, so its exit status is unknown (``poll`` says -1 once it
    has ended), and the server's kernel-side reaping frees its pid at once: it is held through a
    pidfd (Linux 5.3+), which a reused pid cannot redirect; without one, by its pid."""

    def __init__(self, pid: int, stdin, stdout):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None
        #: the pool's worker thread, its watchdog and ``close`` may all poll or kill it
        self._lock = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd here, or the worker is gone already
            self._pidfd = None

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                if self._pidfd is not None:
                    watch = select.poll()  # not select.select: fd numbers past 1024
                    watch.register(self._pidfd, select.POLLIN)
                    ended = bool(watch.poll(0))
                else:
                    ended = not _alive(self.pid)
                if ended:
                    self.returncode = -1
                    if self._pidfd is not None:
                        os.close(self._pidfd)
                        self._pidfd = None
            return self.returncode

    def kill(self) -> None:
        if self.poll() is not None:
            return
        with self._lock:
            try:
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                elif self.returncode is None:
                    os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"compile worker {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode


class ForkServer:
    """The server process, seen from the compiling process. ``fork`` blocks until the server is
    ready (the first call after its start waits for its imports) and is safe from several threads."""

    def __init__(self, env: dict[str, str], niceness: int, ready_timeout: float, fork_here: bool = False):
        """``niceness``: the forked workers'; the server itself imports at normal priority, since
        until it is ready no worker can help. ``fork_here``: the server is a fork of this process
        (the caller has checked ``why_not_fork_here``), not a fresh interpreter."""
        parent_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(env, PYTORCH_NVML_BASED_CUDA_CHECK="1")
        self._started = time.perf_counter()
        self.forked_here = fork_here
        try:
            if fork_here:
                self._proc = _fork_server_here(server_end, env, niceness)
            else:
                code = ("import os, time; started = time.perf_counter(); os.dup2(2, 1); "
                        "from compileattn.compilation.fork_server import serve; "
                        f"serve({server_end.fileno()}, {niceness}, started)")
                self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, env=env,
                                              stdout=subprocess.DEVNULL, pass_fds=(server_end.fileno(),))
        finally:
            server_end.close()
        self._sock = parent_end
        self._ready_timeout = ready_timeout
        self._lock = threading.Lock()
        self._ready: bool | None = None
        self._why_not: str | None = None
        self._closed = False
        #: seconds from the server's start to its readiness; of that, the interpreter's start (to
        #: its first statement) and its imports; and how late this process read the answer
        self.ready_after: float | None = None
        self.interpreter_seconds: float | None = None
        self.import_seconds: float | None = None
        self.read_lag: float | None = None
        if not fork_here:
            wire.send(self._proc.stdin, {"sys_path": list(sys.path)})
            self._proc.stdin.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def fork(self) -> ForkedWorker:
        with self._lock:
            if self._ready is None and not self._closed:
                self._handshake()
            if self._closed:
                raise ForkServerClosed("the compile-worker pool is closing")
            if not self._ready:
                raise ForkError(self._why_not)
            worker_in, to_worker = os.pipe()
            from_worker, worker_out = os.pipe()
            try:
                socket.send_fds(self._sock, [_FORK], [worker_in, worker_out])
                answer = wire.recv_exact(self._sock, _PID.size)
            except (OSError, EOFError) as exc:
                for fd in (to_worker, from_worker):
                    os.close(fd)
                if self._closed:
                    raise ForkServerClosed("the compile-worker pool is closing") from exc
                self._fail(f"the fork server stopped ({type(exc).__name__}: {exc})")
                raise ForkError(self._why_not) from exc
            finally:
                os.close(worker_in)
                os.close(worker_out)
            pid = _PID.unpack(answer)[0]
            if pid < 0:
                os.close(to_worker)
                os.close(from_worker)
                raise ForkError(f"the fork server's fork failed (errno {-pid})")
            return ForkedWorker(pid, os.fdopen(to_worker, "wb"), os.fdopen(from_worker, "rb"))

    def _handshake(self) -> None:
        self._sock.settimeout(self._ready_timeout)
        try:
            _, first_statement, ready_at, why_not = wire.receive_from_socket(self._sock)
        except (OSError, EOFError, pickle.UnpicklingError) as exc:  # socket.timeout is an OSError
            self._fail(f"the fork server did not start ({type(exc).__name__}: {exc}; exit status "
                       f"{self._proc.poll()})")
            return
        self._sock.settimeout(FORK_ANSWER_TIMEOUT_S)  # every later exchange is a fork's request and answer
        now = time.perf_counter()  # perf_counter is the system-wide monotonic clock: comparable
        self.ready_after = now - self._started
        self.interpreter_seconds = first_statement - self._started
        self.import_seconds = ready_at - first_statement
        self.read_lag = now - ready_at
        if why_not is not None:
            self._fail(why_not)
            return
        self._ready = True
        logger.debug("compile-worker fork server (pid %d, %s) ready after %.2f s (interpreter start %.2f s, its "
                     "imports %.2f s, answer read %.2f s after it was sent)", self.pid,
                     "a fork of this process" if self.forked_here else "a fresh interpreter", self.ready_after,
                     self.interpreter_seconds, self.import_seconds, self.read_lag)

    def forget(self) -> None:
        """In a fork of the process that started the server: close this process's copy of the
        socket, leaving the server to the process that started it (no shutdown, which would cut
        that process's connection too)."""
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _fail(self, why: str) -> None:
        self._ready, self._why_not = False, why
        self._stop()

    def close(self) -> None:
        """Stop the server: one still importing is killed; a ready one forks no more and exits
        once its workers have (each when its own stdin closes), reaped here by a daemon thread."""
        self._closed = True
        self._stop()

    def _stop(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self.ready_after is None and self._proc.poll() is None:  # still importing; a ready one's
            self._proc.kill()                                          # workers outlive it
        threading.Thread(target=self._proc.wait, name="compileattn-fork-server-reaper", daemon=True).start()


class _ServerChild:
    """A fork server forked from this process: what ``ForkServer`` needs of a ``subprocess.Popen``
    (``pid``, ``poll``, ``kill``, ``wait``), through ``waitpid`` on this process's own child."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _reaped(self, flags: int) -> int | None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped by someone else's wait(): ended, status unknown
            return -1
        return os.waitstatus_to_exitcode(status) if pid else None

    def poll(self) -> int | None:
        if not self._lock.acquire(blocking=False):  # a wait() is reaping it (as Popen's waitpid lock)
            return None
        try:
            if self.returncode is None:
                self.returncode = self._reaped(os.WNOHANG)
            return self.returncode
        finally:
            self._lock.release()

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            with self._lock:  # held across the blocking reap: a poll() meanwhile must not reap it
                if self.returncode is None:
                    self.returncode = self._reaped(0)
                return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"compile-worker fork server {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode


def why_not_fork_here() -> str | None:
    """Why this process cannot become the fork server by forking (module docstring), or None."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return f"forking this process is done on Linux only (this is {sys.platform})"
    if threading.active_count() > 1:
        return (f"{threading.active_count()} Python threads run in this process (a fork would copy locks they "
                f"may hold)")
    tracing = _tracing_here()
    if tracing is not None:
        return tracing
    resident = resident_bytes()
    if resident is None or resident > FORK_MAX_RESIDENT_BYTES:
        return (f"this process holds {'an unknown amount of' if resident is None else f'{resident >> 20} MiB of'} "
                f"memory (more than {FORK_MAX_RESIDENT_BYTES >> 20} MiB: what it frees or rewrites after a fork "
                f"would stay held by the server)")
    return cuda_touched()


def _tracing_here() -> str | None:
    """Why this thread's state would follow a fork into the server and its workers, or None: a
    pool started while Dynamo traces (``torch.compile(model, backend="compileattn")`` starts it in
    the backend) forked from the tracing thread, and every worker inherited Dynamo's tracing
    context, whose fake mode and ShapeEnv (of the moment of the fork) a dynamic-shape compile takes
    before the graph's own: each failed ("vr must not be None for symbol s7") and was compiled
    again in-process, or would have been compiled against a stale ShapeEnv. Likewise an active
    dispatch mode (a fake mode entered around the backend)."""
    guards = sys.modules.get("torch._guards")
    context = getattr(guards, "TracingContext", None)
    if context is not None and context.try_get() is not None:
        return "this thread is inside a torch.compile trace (a fork would carry its tracing context into the workers)"
    torch = sys.modules.get("torch")
    depth = getattr(getattr(torch, "_C", None), "_len_torch_dispatch_stack", None)
    if depth is not None and depth():
        return "a torch dispatch mode is active in this thread (a fork would carry it into the workers)"
    return None


def resident_bytes() -> int | None:
    """This process's resident memory (Linux ``/proc``), None where it cannot be read."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _fork_server_here(server_end: socket.socket, env: dict[str, str], niceness: int) -> _ServerChild:
    """Fork this process into a fork server talking over ``server_end``; the child never returns."""
    for stream in (sys.stdout, sys.stderr):  # what is buffered here would be written twice
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    started = time.perf_counter()
    # Signals stay pending across the fork until the child has dropped the user's handlers (one
    # delivered before would run them there, or be lost once they are reset).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns of native threads (numpy's OpenBLAS pool): see the module docstring.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return _ServerChild(pid)
    code = 1
    try:
        _drop_inherited_signal_handlers()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        gc.freeze()
        _close_inherited_pipes_and_sockets(keep=server_end.fileno())
        _drop_inherited_file_locks()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(2, 1)
        os.environ.clear()
        os.environ.update(env)
        inductor_config = sys.modules.get("torch._inductor.config")
        if inductor_config is not None:  # imported before the fork: it read the environment then
            inductor_config.compile_threads = inductor_config.decide_compile_threads()
        _serve_on(server_end, niceness, started)
        code = 0
    except BaseException:  # noqa: BLE001 (the server's end: the pool sees its socket close)
        try:
            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(code)


def _drop_inherited_signal_handlers() -> None:
    """The user's Python signal handlers are the compiling process's: in the server (and its
    workers) a SIGTERM ends the process, as in a fresh interpreter, rather than running the user's
    code. A signal wakeup descriptor (asyncio sets one) would be written to after its pipe or socket
    was closed here, into whatever pipe reuses its number (a worker's answers). An ignored signal
    stays ignored, as a fresh interpreter inherits it."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread: no wakeup descriptor can be set from here either
        pass
    for signum in signal.valid_signals():
        if callable(signal.getsignal(signum)):
            try:
                signal.signal(signum, signal.SIG_DFL)
            except (OSError, ValueError):
                pass


def _close_inherited_pipes_and_sockets(keep: int) -> None:
    """Close the pipes and sockets a fork inherited: a copy of a pipe's write end (a subprocess's
    stdin, another pool's worker) keeps its reader from seeing EOF, of a socket its connection
    from closing. Other descriptors stay: CUDA's driver and NVML keep theirs (device files) from
    their load, and with those closed the driver answered ``cuDeviceGetCount`` as if initialised
    (H200, driver 580)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd < 3 or fd == keep:
            continue
        try:
            kind = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            continue
        if kind.startswith(("pipe:", "socket:")):
            os.close(fd)


def _drop_inherited_file_locks() -> None:
    """Point at ``/dev/null`` the descriptors a fork inherited that hold an ``flock`` or
    open-file-description lock (``/proc/self/fdinfo`` lists the locks held through a descriptor):
    such a lock belongs to the open file, which the fork shares, so the compiling process releasing
    it by closing its descriptor (or by exiting) would leave it held by the server and its workers,
    and whoever waits for it blocked while they live. The number stays taken, so nothing that still
    holds it (a file object of this process) reaches another file; the lock stays the compiling
    process's."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd < 3:
            continue
        try:
            with open(f"/proc/self/fdinfo/{fd}") as info:
                locked = any(line.startswith("lock:") and ("FLOCK" in line or "OFDLCK" in line) for line in info)
        except OSError:  # the listing's own descriptor, closed since
            continue
        if locked:
            point_at_devnull(fd)


def point_at_devnull(fd: int) -> None:
    """Make descriptor ``fd`` refer to ``/dev/null`` (not inheritable): what it referred to is
    dropped here while the number stays taken, so nothing that still holds the number (a file
    object) reaches a file opened later under it."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which an orphan becomes under a PID 1 that does not reap,
    has ended)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # PermissionError: the pid now is another user's
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


# -- the server process ------------------------------------------------------------------------------


def cuda_touched() -> str | None:
    """Why a fork of this process could not use CUDA, or None. Loading the driver library is
    harmless (Triton's CUDA utilities link it); initialising the driver is not, and a driver call
    made before ``cuInit`` answers CUDA_ERROR_NOT_INITIALIZED without initialising anything."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch initialised CUDA during the imports"
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "libcuda.so" in line}
    except OSError:
        return "its memory map cannot be read to check that CUDA is untouched"
    for path in paths:
        try:
            driver = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            return f"the loaded CUDA driver library {path} cannot be queried"
        count = ctypes.c_int()
        if driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED:
            return "the CUDA driver was initialised during the imports"
    return None


def serve(sock_fd: int, worker_niceness: int, started: float) -> None:
    """The server: import, answer ready (with ``started``, the ``perf_counter`` of the interpreter's
    first statement, and that of its readiness: torch's import lies between), fork a worker per
    request until the socket closes."""
    sock = socket.socket(fileno=sock_fd)
    try:
        init = wire.receive(sys.stdin.buffer)
    except EOFError:
        return
    sys.path[:] = init["sys_path"]
    _serve_on(sock, worker_niceness, started)


def _serve_on(sock: socket.socket, worker_niceness: int, started: float) -> None:
    from .compile_worker import import_for_worker

    with _exit_if_closed_meanwhile(sock):
        import_for_worker()
    why_not = cuda_touched()
    if why_not is None and threading.active_count() > 1:
        why_not = f"{threading.active_count()} Python threads run after the imports"
    sock.sendall(wire.frame(("ready", started, time.perf_counter(), why_not)))
    if why_not is not None:
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1, 2)
        except OSError:
            message, fds = b"", []
        if message != _FORK or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            _outlive_workers()
            return
        try:
            pid = os.fork()
        except OSError as exc:
            pid = -(exc.errno or 1)
        if pid == 0:
            _forked_worker(sock, fds, worker_niceness)
        for fd in fds:
            os.close(fd)
        try:
            sock.sendall(_PID.pack(pid))
        except OSError:  # the pool closed meanwhile
            _outlive_workers()
            return


@contextlib.contextmanager
def _exit_if_closed_meanwhile(sock: socket.socket):
    """Exit the server at once if the compiling process closes its end of ``sock`` while the
    block runs (the imports: seconds for a fresh interpreter, 9-15 s on the H200's host): it
    exited or was killed, or the pool closed, and nobody will ask for a worker. The end is seen
    otherwise only at the "ready" answer, after the imports. Nothing arrives on the socket before
    that answer, so anything it reports (data, hang-up) means the end. A thread that stops
    with the block: the server forks only while it runs a single Python thread."""
    stop = threading.Event()
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)

    def watch() -> None:
        while not stop.is_set():
            if poller.poll(100):
                os._exit(0)

    watcher = threading.Thread(target=watch, name="compileattn-fork-server-parent-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


def _outlive_workers() -> None:
    """Block until every forked worker has exited: with SIGCHLD ignored, ``wait`` returns (with
    ECHILD) only then. The server stays their parent, so they are reaped on exit rather than left
    to a PID 1 that may not reap."""
    try:
        while True:
            os.wait()
    except ChildProcessError:
        pass


def _forked_worker(sock: socket.socket, fds: list[int], niceness: int) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()
    os.nice(niceness)
    code = 0
    try:
        from .compile_worker import serve_tasks

        with os.fdopen(fds[0], "rb") as inp, os.fdopen(fds[1], "wb") as out:
            serve_tasks(inp, out)
    except BaseException:  # noqa: BLE001 (a worker's end; the pool sees its pipe close)
        code = 1
    finally:
        os._exit(code)


def package_root() -> str:
    """The directory holding the compileattn package (a child's ``PYTHONPATH``)."""
    return str(Path(__file__).resolve().parents[2])
