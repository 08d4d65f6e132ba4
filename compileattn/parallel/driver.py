"""Driving a tensor-parallel model: rank 0 decides every step, the other ranks run what it says.

The choice: rank 0 schedules and broadcasts, rather than every rank scheduling the same way on
its own. Each step's forward holds collectives (inside CUDA graphs), and a graph of each padded
size is captured the first time a step of that size runs, so every rank must run the same padded
steps in the same order or the collectives (and the captures) pair up wrongly and hang. Replaying
the scheduler on every rank would make that depend on every rank sampling the same tokens from
its logits; a broadcast makes it hold by construction, costs one small gloo message per step, and
lets only rank 0 compute logits and sample.

``TPEngine`` is ``models.engine.Engine`` with that broadcast in ``run_step``: on rank 0 use it as
an ``Engine`` (``generate``, ``step``, ``run_step``) and call ``stop_workers()`` at the end; on the
other ranks call ``serve()``, which runs the broadcast steps until rank 0 stops it.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch

from ..metadata import SequenceStep
from ..models.engine import Engine
from .group import TPGroup, get_tp

logger = logging.getLogger("compileattn")


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What rank 0 tells the others to run: one step, already padded."""

    seqs: tuple[SequenceStep, ...]
    input_ids: tuple[int, ...]
    positions: tuple[int, ...]
    padded: int


class TPEngine(Engine):
    """An ``Engine`` whose steps rank 0 decides and broadcasts (over the TP group's gloo group)."""

    def __init__(self, model: torch.nn.Module, *, tp: TPGroup | None = None, **kwargs):
        super().__init__(model, **kwargs)
        self.tp = tp or get_tp()
        #: Steps this rank ran, as StepPlans (the test of "every rank ran the same steps").
        self.steps_run: list[StepPlan] = []

    def run_step(self, seqs: Sequence[SequenceStep], input_ids, positions) -> torch.Tensor:
        if not self.tp.is_driver:
            raise RuntimeError(f"rank {self.tp.rank} does not schedule: only rank 0 drives a TPEngine; "
                               f"the other ranks call serve()")
        n = sum(s[0] for s in seqs)
        plan = StepPlan(tuple(SequenceStep(int(s[0]), int(s[1]), tuple(s[2])) for s in seqs), tuple(int(t) for t in input_ids),
                        tuple(int(p) for p in positions), self.pad_fn(n))
        self.tp.broadcast_object(plan)
        return self._run(plan)

    def _run(self, plan: StepPlan) -> torch.Tensor:
        n = len(plan.input_ids)
        if self.pad_fn(n) != plan.padded:
            # Only a differently configured rank gets here; running anyway would pair collectives wrongly.
            raise ValueError(f"rank {self.tp.rank} pads {n} tokens to {self.pad_fn(n)}, rank 0 to {plan.padded}: "
                             f"every rank needs the same CompileConfig (capture sizes)")
        self.steps_run.append(plan)
        return super().run_step(plan.seqs, plan.input_ids, plan.positions)

    def serve(self) -> int:
        """Ranks other than 0: run rank 0's steps until it calls ``stop_workers``; returns the count."""
        if self.tp.is_driver:
            raise RuntimeError("rank 0 drives; serve() is for the other ranks")
        count = 0
        while True:
            plan = self.tp.broadcast_object(None)
            if plan is None:
                return count
            self._run(plan)
            count += 1

    def stop_workers(self) -> None:
        """Rank 0: end the other ranks' ``serve()``."""
        if self.tp.is_driver:
            self.tp.broadcast_object(None)
