"""A step (or a build) that fails on one rank ends the group on every rank, promptly and with the
reason.

Each step's forward holds collectives, so a rank whose step raises (an out-of-memory error in its
forward, a bad plan) leaves its peers waiting inside one of them, for the group's timeout (10
minutes by default), and a peer that then gives up has only "connection closed" to say. So the
failing rank writes its reason to the group's store under a key of its own and shuts its process
groups down: a peer blocked in a gloo collective gets an error at once, reads the reason from the
store, shuts down its side too and raises ``TPGroupFailed`` naming the rank and its exception
(measured on the CPU, two ranks over gloo: the failing ``generate`` returned its error on both
ranks 0.07 s after it began; with the failing rank's groups left open, and its program calling
``generate`` again, both waited past a 60 s limit, for the 600 s timeout). A rank whose
collective fails with no reason in the store publishes its own error, so no rank is left without
one; unless the collective lost a peer (gloo's "connection closed/reset by peer": a peer process
that ended, killed or ``os._exit``, and published nothing), which names that peer, not the rank
that saw the loss. gloo's error names the peer's address, not its rank: with two ranks the peer is
the other one; with more, the ranks that saw the loss mark themselves alive in the store and name
the ones that stay silent (``LOST_PEER_WAIT_S``).

An ``LLM``'s build is guarded alike (``building_in_step``): the load-time probe of a sharded model,
the KV-cache agreement and the captures hold collectives too.

The group cannot be used after this: a collective that half the ranks left is unrecoverable
without new processes, and which steps the captured graphs were in the middle of is unknown.

On GPUs only rank 0's host waits for a step (for its sampled tokens); the others go on to the
next broadcast, a gloo call that fails as above when rank 0 shuts down. Rank 0's wait is for a
CUDA graph whose collective kernel spins until every peer joins, and nothing interrupts it: NCCL's
watchdog does not track collectives captured in a graph (pytorch/pytorch#103503) and the
symmetric-memory all-reduce spins on its peers' flags. So rank 0 waits by polling the step's
event and, every ``PEER_POLL_S``, the store (``wait_watching_peers``); its GPU work stays stuck,
but its program gets the reason and can exit; a peer that publishes none (it ended, or hangs)
ends the wait at the group's timeout. (Not run on two GPUs.)
"""
from __future__ import annotations

import contextlib
import logging
import re
import time
from typing import Iterator

from .group import CallMismatch, TPGroup, shutdown_tp

logger = logging.getLogger("compileattn")


#: How often rank 0 reads the store for a peer's failure while it waits for a step on the GPU: a
#: read is a TCP round trip (~0.1 ms), so only waits longer than this pay one.
PEER_POLL_S = 0.05
#: How long ranks that lost a peer (of more than one) wait for the others to mark themselves alive
#: before naming the silent ones: a live rank marks itself once its own collective fails, which
#: the survivors' shutdown makes prompt, unless it is busy outside collectives (compiling, say).
LOST_PEER_WAIT_S = 10.0
#: gloo's errors for a peer whose connection went away (``gloo/transport/tcp/pair.cc``).
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe")
#: How long a failed rank waits for its process groups' teardown: NCCL's can hang with a
#: collective of the failed step still on the device (``group.shutdown_tp``).
SHUTDOWN_S = 5.0


class TPGroupFailed(RuntimeError):
    """A tensor-parallel step (or build) failed on some rank; this rank's process groups are shut
    down. ``ranks``: the ranks whose failures it names."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = ranks


class PeerFailed(RuntimeError):
    """A peer published a failure while this rank waited for its own step."""


def _key(tp: TPGroup, rank: int, what: str = "failed") -> str:
    return tp.store_key(what, rank)


def failure_reasons(tp: TPGroup) -> dict[int, str]:
    """The reasons ranks published, by rank (empty while none has failed). One store round trip
    per rank: read only after a collective has failed."""
    store = tp.store
    if store is None:
        return {}
    reasons = {}
    for rank in range(tp.world_size):
        key = _key(tp, rank)
        try:
            if store.check([key]):
                reasons[rank] = store.get(key).decode(errors="replace")
        except Exception:  # the store went with the launcher: nothing more to learn
            break
    return reasons


def wait_watching_peers(tp: TPGroup, event, poll_s: float = PEER_POLL_S) -> None:
    """Wait for ``event`` (a CUDA event) as ``event.synchronize()`` does, but raise ``PeerFailed``
    if a rank publishes a failure meanwhile, and ``TimeoutError`` after the group's timeout
    (``tp.timeout_s``): a peer that ended or hangs without publishing a reason never joins the
    step's collectives, and nothing else ends this wait. Polls with ``time.sleep(0)`` between
    queries, so the process's other Python threads (compile workers' readers, landing pieces) keep
    the GIL."""
    if tp.store is None:
        event.synchronize()
        return
    now = time.monotonic()
    next_look, deadline = now + poll_s, now + tp.timeout_s
    while not event.query():
        if time.monotonic() >= next_look:
            if failure_reasons(tp):
                raise PeerFailed("a peer rank failed while this rank waited for its step on the device")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rank {tp.rank}'s step did not complete on the device in {tp.timeout_s:.0f} s "
                                   f"(the group's timeout) and no rank published a failure: a peer that ended or "
                                   f"hangs never joined the step's collectives")
            next_look = time.monotonic() + poll_s
        time.sleep(0)


def fail_group(tp: TPGroup, exc: BaseException, during: str = "in a step") -> TPGroupFailed:
    """``exc`` ended this rank's part ``during`` a collective phase: name its cause (the peers'
    published reasons if there are any; else, where ``exc`` is a collective's lost peer, the peers
    that ended; else ``exc``; published for the peers), shut this rank's process groups down, and
    return the error for the caller to raise from ``exc``."""
    peers = {r: why for r, why in failure_reasons(tp).items() if r != tp.rank}
    shut_down = False
    if not peers and _lost_a_peer(exc):
        shutdown_tp(SHUTDOWN_S)  # first: peers blocked on this rank fail and answer at once
        shut_down = True
        silent = _silent_peers(tp)
        peers = {r: why for r, why in failure_reasons(tp).items() if r != tp.rank}  # another survivor's verdict
        if not peers:
            seen = f"rank {tp.rank}'s collective lost it: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            peers = {r: f"{during}: its process ended with no reason given ({seen})" for r in silent}
            for r, why in peers.items():  # so a rank failing later names it too
                _publish(tp, r, why)
    if peers:
        ranks = tuple(sorted(peers))
        reason = "; ".join(f"rank {r} failed {why}" for r, why in sorted(peers.items()))
    else:
        ranks = (tp.rank,)
        own = f"{during}: {type(exc).__name__}: {exc}"
        _publish(tp, tp.rank, own)
        reason = f"rank {tp.rank} failed {own}"
    logger.error("tensor parallel group shut down: %s", reason)
    if not shut_down:
        shutdown_tp(SHUTDOWN_S)
    return TPGroupFailed(f"{reason}; the tensor-parallel group is shut down on every rank (start the processes "
                         f"again to serve)", ranks)


def _publish(tp: TPGroup, rank: int, reason: str) -> None:
    if tp.store is not None:
        try:
            tp.store.set(_key(tp, rank), reason)
        except Exception:
            logger.warning("rank %d could not publish a failure to the TP group's store", tp.rank)


def _lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or what raised it) is a collective's report of a peer gone away."""
    seen = 0
    while exc is not None and seen < 8:
        if _LOST_PEER.search(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _silent_peers(tp: TPGroup) -> list[int]:
    """The peers that ended, for a rank whose collective lost one and found no reason published:
    the other rank of two; of more, this rank marks itself alive and waits (``LOST_PEER_WAIT_S``) for
    the peers to mark themselves, and returns those that did not; it waits no longer once one peer
    alone is left (at least one ended) or a reason is published (another survivor named the
    ended ones first, or a peer failed on its own: the caller reads it)."""
    others = [r for r in range(tp.world_size) if r != tp.rank]
    if len(others) == 1 or tp.store is None:
        return others
    store, deadline = tp.store, time.monotonic() + LOST_PEER_WAIT_S
    try:
        store.set(_key(tp, tp.rank, "alive"), "1")
        while True:
            silent = [r for r in others if not store.check([_key(tp, r, "alive")])]
            if len(silent) <= 1 or time.monotonic() >= deadline or any(store.check([_key(tp, r)]) for r in others):
                return silent or others
            time.sleep(PEER_POLL_S)
    except Exception:  # the store went with the launcher
        return others


@contextlib.contextmanager
def building_in_step(tp: TPGroup) -> Iterator[None]:
    """Around what every rank builds in step (loading and sharding a model, whose load-time probe
    runs its collectives; the KV-cache agreement; compiles and captures holding collectives): an
    exception on one rank would leave the others in a collective, so the group is shut down as for
    a failed step. This rank's own exception is raised as it is (as without tensor parallelism: an
    unsupported model's ``UnsupportedModelError`` on every rank alike); a peer's failure, seen here
    as a collective's ``RuntimeError``, raises ``TPGroupFailed`` naming it."""
    try:
        yield
    except (TPGroupFailed, CallMismatch):  # the group is gone already, or intact
        raise
    except BaseException as exc:
        failed = fail_group(tp, exc, during="while building the LLM")
        if tp.rank in failed.ranks or not isinstance(exc, RuntimeError):
            raise
        raise failed from exc
