"""Driving a tensor-parallel model: rank 0 decides every step, the other ranks run what it says.

The choice: rank 0 schedules and broadcasts, rather than every rank scheduling the same way on
its own. Each step's forward holds collectives (inside CUDA graphs), and a graph of each padded
size is captured the first time a step of that size runs, so every rank must run the same padded
steps in the same order or the collectives (and the captures) pair up wrongly and hang. Replaying
the scheduler on every rank would make that depend on every rank sampling the same tokens from
its logits; a broadcast makes it hold by construction, costs one small gloo message per step, and
lets only rank 0 compute logits and sample.

``TPEngine`` is ``engine.Engine`` with that broadcast where a step's inputs are decided, in front
of the model runner's ``prepare``: every path that runs a step (``step``, ``run``, ``generate``,
``run_step``) goes through it. On rank 0 use it as an ``Engine`` and call ``stop_workers()`` at
the end; on the other ranks call ``serve()``, which runs the broadcast steps until rank 0 stops it.
Each ``stop_workers()`` ends one ``serve()``, whatever ran in between: the other ranks cannot see
rank 0's requests, so whether a step ran (a round with no requests, or all refused) cannot decide
which calls they make. ``serve()`` opens with an agreement (``TPGroup.agree``) that rank 0 meets
before its first step or stop after a stop, so a rank in another call (a barrier, ``LLM.generate``,
a second ``stop_workers`` with no ``serve()`` to end) raises ``CallMismatch`` on every rank instead
of leaving a peer in a receive. Construction (compile, CUDA-graph capture of every size) is the
same on every rank, in the same order, so the captured collectives pair up too.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import torch

from ..metadata import SequenceStep
from ..engine import Engine
from .failure import TPGroupFailed, fail_group, wait_watching_peers
from .group import CallMismatch, TPGroup, get_tp


#: The agreement each ``serve()`` opens with; rank 0 makes it too (``TPEngine._meet_serve``).
SERVE_CALL = "TPEngine.serve"


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What rank 0 tells the others to run: one step, already padded."""

    seqs: tuple[SequenceStep, ...]
    input_ids: tuple[int, ...]
    positions: tuple[int, ...]
    padded: int


class TPEngine(Engine):
    """An ``Engine`` whose steps rank 0 decides and broadcasts (over the TP group's gloo group)."""

    def __init__(self, model: torch.nn.Module, *, tp: TPGroup | None = None, record_steps: bool = False, **kwargs):
        self.tp = tp or get_tp()
        #: Steps this rank ran, as StepPlans (the test of "every rank ran the same steps"), kept only
        #: with ``record_steps``: a served LLM runs steps for its whole life.
        self.steps_run: list[StepPlan] | None = [] if record_steps else None
        #: Why the group was shut down (``failure.py``), once a step failed on some rank.
        self.failure: TPGroupFailed | None = None
        #: Rank 0 broadcast a step whose forward it has not run yet: the other ranks are inside that
        #: step's collectives, so a failure now cannot end ``generate`` cleanly (``LLM.generate``).
        self.step_unrun = False
        #: Rank 0: it met the other ranks' ``serve()`` (the agreement it opens with) and has not
        #: stopped it since; the next step or stop meets the next ``serve()`` first.
        self.workers_serving = False
        super().__init__(model, **kwargs)
        self._runner_prepare = self.runner.prepare
        self.runner.prepare = self._prepare_step
        self._runner_run = self.runner.run
        self.runner.run = self._run_step

    def _run_step(self, prepared):
        """The runner's ``run``, ending the group on every rank if it raises."""
        with self.group_ends_on_error():
            hidden = self._runner_run(prepared)
            self.step_unrun = False
            return hidden

    @contextlib.contextmanager
    def group_ends_on_error(self, during: str = "in a step"):
        """Around a step's broadcast, its forward and rank 0's wait for its tokens, and around
        ``LLM.generate``'s own collectives (its agreement, the end of ``serve`` and the outputs'
        broadcast): an exception there leaves the peers inside the step's collectives (or in the
        next broadcast), and a peer that failed after its last collective of a step is seen only
        there, as a bare "connection closed"; so it shuts the group down on every rank and names
        the failed rank (``failure.py``). A group already shut down raises its reason."""
        if self.failure is not None:
            raise self.failure
        try:
            yield
        except (TPGroupFailed, CallMismatch):  # the group is gone already, or intact
            raise
        except BaseException as exc:
            self.failure = fail_group(self.tp, exc, during)
            raise self.failure from exc

    def _wait_for(self, copied) -> None:
        """Rank 0's wait for a step's tokens, watching for a peer's failure (``failure.py``)."""
        with self.group_ends_on_error():
            wait_watching_peers(self.tp, copied)

    def _prepare_step(self, seqs: Sequence[SequenceStep], input_ids, positions, dummy: bool = False):
        """Rank 0: decide (broadcast) the step, then prepare it (the other ranks prepare it in
        ``serve``). Steps the engine runs at construction (warm-up, captures) are the same on every
        rank and are not broadcast: ``runner.prepare`` is wrapped only afterwards, so a capture's
        ``dummy`` step never comes here."""
        if dummy:
            raise RuntimeError("a CUDA-graph capture's dummy step runs at construction, on every rank at once")
        if not self.tp.is_driver:
            raise RuntimeError(f"rank {self.tp.rank} does not schedule: only rank 0 drives a TPEngine; "
                               f"the other ranks call serve()")
        n = sum(s[0] for s in seqs)
        plan = StepPlan(tuple(SequenceStep(int(s[0]), int(s[1]), tuple(s[2])) for s in seqs),
                        tuple(int(t) for t in input_ids), tuple(int(p) for p in positions), self.pad_fn(n))
        with self.group_ends_on_error():
            self._meet_serve()
            self.tp.broadcast_object(plan)
            self.step_unrun = True
            return self._prepare_plan(plan)

    def _prepare_plan(self, plan: StepPlan):
        if self.steps_run is not None:
            self.steps_run.append(plan)
        return self._runner_prepare(plan.seqs, plan.input_ids, plan.positions)

    def run(self, on_finished=None, max_tokens_per_step: int | None = None) -> None:
        """Step by step, without ``Engine.run``'s overlap: there a step's inputs are completed at
        launch (tokens still on the device when it was planned), after rank 0 broadcast them. On
        rank 0 the other ranks are in ``serve()`` for it, as for ``generate``."""
        while self.scheduler.has_unfinished():
            result = self.step(max_tokens_per_step)
            if result.finished and on_finished is not None:
                on_finished(result.finished)

    def _meet_serve(self) -> None:
        """Rank 0, before a step or a stop: the other ranks' ``serve()`` opening agreement, once per
        ``serve()``."""
        if not self.workers_serving:
            self.tp.agree(SERVE_CALL)
            self.workers_serving = True

    def serve(self) -> int:
        """Ranks other than 0: run rank 0's steps until it calls ``stop_workers``; returns the count."""
        if self.tp.is_driver:
            raise RuntimeError("rank 0 drives; serve() is for the other ranks")
        with self.group_ends_on_error():
            self.tp.agree(SERVE_CALL)  # met by rank 0's next step or stop
        count = 0
        while True:
            with self.group_ends_on_error():  # rank 0 shuts the group down when its own step fails
                plan = self.tp.broadcast_object(None)
                if plan is None:
                    return count
                padded = self.pad_fn(len(plan.input_ids))
                if padded != plan.padded:
                    # Only a differently configured rank gets here; running anyway would pair collectives wrongly.
                    raise ValueError(f"rank {self.tp.rank} pads {len(plan.input_ids)} tokens to {padded}, rank 0 "
                                     f"to {plan.padded}: every rank needs the same CompileConfig (capture sizes)")
                prepared = self._prepare_plan(plan)
            self.runner.run(prepared)
            count += 1

    def stop_workers(self) -> None:
        """Rank 0: end the other ranks' ``serve()`` (which a shut-down group has ended already);
        one call per ``serve()``, even where no step ran since the last one (module docstring)."""
        if self.tp.is_driver and self.failure is None:
            self._meet_serve()
            self.tp.broadcast_object(None)
            self.workers_serving = False
