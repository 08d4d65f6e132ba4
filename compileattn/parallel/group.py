"""The tensor-parallel group: one process per GPU, plain ``torch.distributed`` underneath.

``init_tp()`` joins the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and returns a ``TPGroup``; ``get_tp()`` returns
it afterwards (a one-rank group when none was initialised, so single-GPU code needs no branch).
Tensor parallelism spans the whole world: pipeline or data parallel groups do not exist yet.

Two process groups, two jobs:

- ``group``: NCCL on GPUs (gloo on CPUs). Names the all-reduce of every row-parallel layer,
  inside the compiled pieces and inside their CUDA graphs (``comm.all_reduce``), which runs on
  NCCL or, for decode-sized tensors on GPUs, over the group's symmetric memory (``comm.py``).
- ``cpu_group``: gloo. Carries host-side agreement (the step rank 0 scheduled, budget decisions,
  barriers) so no eager NCCL call ever sits between captured ones for the host's sake.

Why the set-up below, for CUDA graphs that contain NCCL collectives (sources at the end):

1. **NCCL is initialised and warmed up before any capture.** ``device_id`` makes
   ``init_process_group`` create the communicator eagerly, and one all-reduce through the very
   op the pieces use runs (and is synchronised) before anything is captured. A communicator
   created lazily by the first collective would be created inside a capture, where its
   allocations are illegal [R6].
2. **Every rank captures the same graphs in the same order and launches them in the same
   order.** NCCL treats "captured or not" as a collective property of each operation, and the
   launch of a graph containing NCCL operations as a collective of the ranks that captured it
   [R1]. compileattn captures lazily, at the first step of each size, so this holds exactly when
   every rank runs the same sequence of padded steps: ``driver.TPEngine`` makes rank 0 decide
   each step and broadcasts it over ``cpu_group``; benchmarks build identical steps on every rank.
3. **Captured and eager collectives may interleave on one communicator** (a warm-up run before
   a capture, a step too large for any graph, an eager reference): NCCL supports outstanding
   captured and non-captured operations in any combination (``NCCL_GRAPH_MIXING_SUPPORT``,
   default on) [R1, R2]; its caveat is graphs of *several* communicators launched from one thread
   [R1], so the TP group is the only NCCL communicator a process uses.
4. **Host-side agreement never uses NCCL.** ProcessGroupNCCL does not hand captured work to its
   watchdog [R3], but versions with the wait of [R4] hold ``capture_begin`` until every eager
   NCCL work the watchdog still tracks has completed. A rank that issued an eager NCCL call its
   peer has not matched yet (a schedule broadcast, say, while the peer is busy capturing) cannot
   begin its next capture, and if the peer then waits on the host for it, both wait for ever.
   gloo on ``cpu_group`` cannot block a capture.
5. **Capture mode "thread_local"** (``cudagraph.GraphPool``): in the default "global" mode an
   unsafe CUDA call from *another* thread, such as the NCCL watchdog polling an eager work's
   event, invalidates the capture [R5]; Inductor's own CUDA-graph trees capture with
   ``capture_error_mode="thread_local"`` for that reason.
6. **One capture stream.** ``torch.cuda.graph`` captures on one side stream per process (its
   class-level ``default_capture_stream``); ProcessGroupNCCL forks its NCCL stream off the
   capturing stream and joins it back at the wait, so the collective is a node of the graph,
   and replays run on the caller's stream. vLLM captures every graph on one stream too
   (``GroupCoordinator.graph_capture``) [R7]; its later move of the warm-up runs onto the capture
   stream is for NCCL window registration (``ncclMemAlloc`` buffers are per stream), which
   ProcessGroupNCCL's plain collectives here do not use.
7. **Environment.** ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` (the default in recent torch; set
   here for older builds): ``recordStream`` on captured tensors is what kept
   ``torch.distributed`` collectives out of CUDA graphs before [R8]. ``TORCH_NCCL_BLOCKING_WAIT``
   must stay unset: a blocking wait synchronises an event, which a capture forbids. NVLink
   multicast (NVLS) stays off on the lent machines (``NCCL_NVLS_ENABLE=0``).
8. **Shutdown is bounded.** ``destroy_process_group`` after captures can hang in
   ``ncclCommDestroy`` [R9]; ``shutdown_tp(timeout_s)`` gives it a deadline.

Sources: [R1] NCCL user guide, "Using NCCL with CUDA Graphs" (docs.nvidia.com/deeplearning/nccl/
user-guide/docs/usage/cudagraph.html); [R2] NCCL env docs, NCCL_GRAPH_MIXING_SUPPORT; [R3]
pytorch/pytorch#103503 (no workEnqueue while capturing); [R4] pytorch/pytorch#104487, #110665 and
the "Waiting for pending NCCL work to finish before starting graph capture" wait in
``CUDAGraph::capture_begin``; [R5] pytorch/pytorch#105182, and ``torch/_inductor/
cudagraph_trees.py``; [R6] ROCm/rccl#2022 (lazy communicator init inside a capture fails;
``device_id`` fixes it); [R7] vllm ``vllm/distributed/parallel_state.py`` ``graph_capture``, and
vllm-project/vllm#29207; [R8] vllm-project/vllm#2152; [R9] pytorch/pytorch#115388.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import threading
import uuid
from typing import Any

import torch
import torch.distributed as dist

from .. import _torch_compat
from . import comm

logger = logging.getLogger("compileattn")

#: Environment every process that joins a TP group on the lent GPUs must keep (see point 7).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}

#: How long a rank waits in an agreement (``TPGroup.agree``) before it logs which ranks have not
#: reached it. Only a warning: a rank may be late for reasons of its own (writing results), and one
#: in a collective no agreement sees (``torch.distributed.barrier()``) cannot be told from it.
ARRIVAL_WARN_S = 10.0
#: Marks an agreement's contribution in the gather, so a peer's other gathers are told apart.
_AGREEMENT = "compileattn.agreement"


class CallMismatch(ValueError):
    """The ranks' agreement paired up different calls (one rank in ``LLM.generate``, another in
    ``TPGroup.barrier``): raised on every rank; the gather paired up, so the group is intact."""


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    device: torch.device
    #: The device group (NCCL/gloo); None for a one-rank group.
    group: Any = None
    #: gloo group for host-side agreement; None for a one-rank group.
    cpu_group: Any = None
    #: How small all-reduces (a decode step's) run: "symmetric-memory" (one-shot / two-shot by
    #: size, see ``comm.py``), "nccl", or "gloo" (CPUs); prefill-sized ones always take NCCL.
    all_reduce: str = "nccl"
    #: The store the process group was set up with (host messages outside collectives: a failed
    #: step's reason, ``failure.py``); None for a one-rank group.
    store: Any = None
    #: Rank 0's random name for this group, so its store keys are not read by a later group that
    #: the same launcher's store serves.
    token: str = ""
    #: The process groups' timeout (``init_tp``'s ``timeout``): also the bound of rank 0's wait for a
    #: step on the device (``failure.wait_watching_peers``), which no collective's timeout covers.
    timeout_s: float = 600.0
    #: How many agreements this rank has entered (shared by the copies ``dataclasses.replace`` makes).
    agreements: list = dataclasses.field(default_factory=lambda: [0], repr=False, compare=False)

    def store_key(self, what: str, rank: int) -> str:
        """This group's key for ``what`` of ``rank`` in the store (host messages outside collectives)."""
        return f"compileattn/tp/{self.token}/{what}/{rank}"

    @property
    def group_name(self) -> str:
        """The name functional collectives (and so the compiled graphs) refer to the group by."""
        if self.group is None:
            raise ValueError("a one-rank TP group has no process group")
        return self.group.group_name

    @property
    def is_driver(self) -> bool:
        """Rank 0 decides what every rank runs."""
        return self.rank == 0

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank, over gloo (picklable objects; host only)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def agree(self, call: str, payload: Any = None) -> list[Any]:
        """Every rank's ``payload`` for ``call`` (one gather over gloo), each rank naming its call:
        ranks in different calls (``generate`` on one, ``barrier`` on another) paired no collective
        before and waited for the group's timeout; their gathers pair up, and every rank raises
        ``CallMismatch`` naming each rank's call. A rank waiting longer than ``ARRIVAL_WARN_S``
        logs which peers have not reached this agreement (one store write per call tells it)."""
        if self.world_size == 1:
            return [payload]
        self.agreements[0] += 1
        count = self.agreements[0]
        if self.store is not None:
            self.store.set(self.store_key("agreement", self.rank), f"{count} {call}")
        timer = threading.Timer(ARRIVAL_WARN_S, self._warn_waiting, (call, count))
        timer.daemon = True
        timer.start()
        try:
            answers = self.all_gather_object((_AGREEMENT, call, payload))
        finally:
            timer.cancel()
            timer.join()  # a timer thread still alive when the program exits aborted its rank (SIGABRT,
            # "terminate called without an active exception"; 2 of 3 runs of test_tp_all_reduce's refusal)
        calls = [a[1] if isinstance(a, tuple) and len(a) == 3 and a[0] == _AGREEMENT else "a gather of its own"
                 for a in answers]
        if len(set(calls)) > 1:
            raise CallMismatch("tensor parallel: the ranks are in different calls (" + "; ".join(
                f"rank {r}: {c}" for r, c in enumerate(calls)) + "); every rank must make the same calls (LLM(...), "
                "generate, TPGroup.barrier) in the same order; refused on every rank, the group is intact")
        return [a[2] for a in answers]

    def _warn_waiting(self, call: str, count: int) -> None:
        """The timer's warning: the peers whose last agreement (in the store) is an earlier one."""
        behind = []
        for rank in range(self.world_size):
            key = self.store_key("agreement", rank)
            try:  # get() would wait for a key never set
                last = self.store.get(key).decode() if self.store is not None and self.store.check([key]) else "0 none"
            except Exception:  # the store went with the launcher: name none
                break
            number, last_call = last.split(" ", 1)
            if rank != self.rank and int(number) < count:
                behind.append(f"rank {rank} (its last agreement: {last_call})")
        logger.warning("rank %d has waited %.0f s in %s for %s: every rank must make the same calls in the same "
                       "order; a rank in a collective of its own (torch.distributed.barrier(), say) leaves this one "
                       "waiting for the group's timeout", self.rank, ARRIVAL_WARN_S, call,
                       ", ".join(behind) or "the other ranks")

    def barrier(self) -> None:
        """Every rank waits for the others here (an agreement: it raises against another call)."""
        self.agree("TPGroup.barrier")

    def release(self) -> None:
        """Drop the process-group handles (engines keep this object after shutdown): a group is
        freed, and its gloo threads joined, only when nothing holds it any more; otherwise they
        live until interpreter exit, whose teardown can abort the process ("terminate called
        without an active exception", seen on gloo in CI after every rank had finished)."""
        object.__setattr__(self, "group", None)
        object.__setattr__(self, "cpu_group", None)


_tp: TPGroup | None = None


def get_tp() -> TPGroup:
    """The group ``init_tp`` made, else a one-rank group on the current device."""
    if _tp is not None:
        return _tp
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return TPGroup(0, 1, device)


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"{name} is not set: start the processes with torchrun --nproc-per-node N")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


ALL_REDUCE_CHOICES = ("auto", "symmetric-memory", "nccl")


def init_tp(tp_size: int | None = None, *, device: str | None = None, all_reduce: str = "auto",
            timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> TPGroup:
    """Join the process group torchrun set up and make it the TP group (idempotent).

    ``tp_size`` must equal ``WORLD_SIZE`` when given. ``device``: "cuda" (NCCL, one GPU per
    process: ``LOCAL_RANK``) or "cpu" (gloo); default cuda when available. The NCCL communicator
    is created eagerly and warmed up with one functional all-reduce before this returns.
    ``all_reduce``: the algorithms of small all-reduces on GPUs (``comm.py``): "auto" (over
    symmetric memory where every rank can, else NCCL), "symmetric-memory" (an error where it
    cannot) or "nccl".

    Called again, it returns the group it made, and refuses an argument that asks for another one
    (``tp_size``, ``device``, ``all_reduce``): a process joins one group, whose device every
    collective and captured graph of it runs on. A group this call made is destroyed at exit if
    ``shutdown_tp`` has not run by then (``_shutdown_at_exit``), before the ``atexit`` handlers
    registered ahead of this call: those must not use it.
    """
    if all_reduce not in ALL_REDUCE_CHOICES:
        raise ValueError(f"all_reduce must be one of {ALL_REDUCE_CHOICES}, got {all_reduce!r}")
    if device is not None and device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    global _tp
    if _tp is not None:
        if tp_size is not None and tp_size != _tp.world_size:
            raise ValueError(f"the TP group is already initialised with {_tp.world_size} ranks, not {tp_size}")
        if device is not None and device != _tp.device.type:
            raise ValueError(f"the TP group is already initialised on {_tp.device}, not device={device!r}")
        if all_reduce != "auto" and (all_reduce == "symmetric-memory") != (_tp.all_reduce == "symmetric-memory"):
            raise ValueError(f"the TP group is already initialised with all_reduce={_tp.all_reduce!r}, "
                             f"not {all_reduce!r}")
        return _tp
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if world < 1 or not 0 <= rank < world:
        # Checked here: the rendezvous takes such values and waits for the group's timeout (a rank
        # past the end connects to a store no rank hosts) before failing with a network error.
        raise ValueError(f"RANK={rank} is not a rank of WORLD_SIZE={world} (0 <= RANK < WORLD_SIZE, WORLD_SIZE >= 1)")
    if tp_size is not None and tp_size != world:
        raise ValueError(f"tp_size={tp_size} but WORLD_SIZE={world}: tensor parallelism spans the whole world "
                         f"(no pipeline or data parallel groups); launch with torchrun --nproc-per-node {tp_size}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if world == 1:
        _tp = TPGroup(0, 1, get_tp().device if device == "cuda" else torch.device("cpu"))
        return _tp
    if os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") not in ("", "0"):
        raise ValueError("TORCH_NCCL_BLOCKING_WAIT is set: a blocking wait synchronises an event, which CUDA-graph "
                         "capture forbids; unset it")
    for name, value in NCCL_ENV.items():
        os.environ.setdefault(name, value)
    if device == "cuda":
        local_rank = _env_int("LOCAL_RANK")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    joined = not dist.is_initialized()  # this call makes the process group, and so ends it if it fails
    if joined:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timeout,
                                **({"device_id": dev} if dev.type == "cuda" else {}))
    cpu_group = None
    try:
        cpu_group = dist.new_group(backend="gloo", timeout=timeout) if dev.type == "cuda" else dist.group.WORLD
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise ValueError(f"the initialised process group ({dist.get_rank()}/{dist.get_world_size()}) disagrees "
                             f"with RANK/WORLD_SIZE ({rank}/{world})")
        tp = TPGroup(rank, world, dev, dist.group.WORLD, cpu_group,
                     all_reduce="nccl" if dev.type == "cuda" else "gloo", store=_torch_compat.default_store(),
                     timeout_s=timeout.total_seconds())
        tp = dataclasses.replace(tp, token=tp.broadcast_object(uuid.uuid4().hex if rank == 0 else None))
        _warm_up(tp)
        if dev.type == "cuda" and all_reduce != "nccl" and comm.enable_symmetric_memory(tp):
            tp = dataclasses.replace(tp, all_reduce="symmetric-memory")
        if all_reduce == "symmetric-memory" and tp.all_reduce != all_reduce:
            raise ValueError("all_reduce='symmetric-memory' but symmetric memory is not available on every rank "
                             "(it needs CUDA devices with peer access; the log says why); use 'auto' or 'nccl'")
    except BaseException:
        # A refused or failed set-up leaves no group of its making: a live gloo group's threads,
        # torn down at interpreter exit, abort the process ("terminate called without an active
        # exception") after the caller handled the error.
        if joined:
            shutdown_tp()  # NCCL's destroy bounded, as at any shutdown
        elif cpu_group is not None and cpu_group is not dist.group.WORLD:
            dist.destroy_process_group(cpu_group)
        raise
    _tp = tp
    if joined:
        atexit.register(_shutdown_at_exit, os.getpid())
    logger.info("TP group: rank %d of %d on %s (%s, small all-reduces: %s)", rank, world, dev,
                dist.get_backend(), tp.all_reduce)
    return tp


def _warm_up(tp: TPGroup) -> None:
    """One all-reduce through the op the compiled pieces use, synchronised: the communicator is
    connected (and its first-use allocations made) before anything can be captured."""
    x = torch.ones(1, device=tp.device)
    total = comm.all_reduce(x, tp.group_name)
    if tp.device.type == "cuda":
        torch.cuda.synchronize(tp.device)
    if int(total.item()) != tp.world_size:
        raise RuntimeError(f"TP warm-up all-reduce gave {total.item()}, expected {tp.world_size}")
    tp.barrier()


def shutdown_tp(timeout_s: float = 30.0) -> bool:
    """Destroy the process groups, giving up after ``timeout_s`` (``destroy_process_group`` can
    hang after CUDA-graph captures of NCCL operations, pytorch/pytorch#115388, so NCCL's is
    destroyed on a helper thread). True if it finished; on False the caller should exit the
    process rather than wait."""
    global _tp
    atexit.unregister(_shutdown_at_exit)
    comm.forget_all()
    if _tp is not None:
        _tp.release()
    _tp = None
    if not dist.is_initialized():
        return True
    if dist.get_backend() == "gloo":  # the hang is NCCL's: gloo is torn down on the thread that used it
        dist.destroy_process_group()
        return True
    done = threading.Event()

    def destroy():
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, daemon=True, name="compileattn-tp-shutdown").start()
    finished = done.wait(timeout_s)
    if not finished:
        logger.warning("destroy_process_group did not finish in %.0f s; leaving it", timeout_s)
    return finished


#: How long the exit-time teardown waits for NCCL's destroy before letting the process exit.
EXIT_SHUTDOWN_S = 10.0


def _shutdown_at_exit(pid: int) -> None:
    """The group ``init_tp`` made, destroyed before the interpreter finalises (a script that ends
    without ``shutdown_tp``). Left to finalisation, a gloo worker thread still releasing its last
    work (the step's broadcast: its tensors' Python objects) takes the GIL of a finalising
    interpreter, which ends that thread by unwinding through a noexcept destructor: the rank
    aborted ("terminate called without an active exception", 1 run in 7 of a two-rank script on a
    2-core machine) after its work was done. Only in the process that made the group: a forked
    child inherits the handler, but the communicators are its parent's."""
    if os.getpid() == pid:
        shutdown_tp(EXIT_SHUTDOWN_S)
