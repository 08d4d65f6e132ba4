"""Continuous batching: which requests run in a step, how many tokens each, and their blocks.

Every step has a token budget. Running requests come first, decodes before prefills (a decode
is one token and its sequence waits on it), then continuing prefills take what is left, in chunks
if the budget is smaller than the prompt, then waiting requests are admitted in arrival order.
Blocks are allocated as sequences grow, one step at a time. When the free list cannot supply a
running request's next block, the newest running request not yet scheduled in this step is
preempted: its blocks are freed and it goes back to the front of the queue, to recompute its
known tokens (prompt and output so far) as a prefill when it is readmitted. Preempting the newest
keeps the oldest requests moving, so the engine cannot livelock; the cost is recomputation, which
is what vLLM's default preemption mode pays as well.
"""
from __future__ import annotations

import collections
import dataclasses
import logging

from ..metadata import SequenceStep
from .block_allocator import BlockAllocator
from .request import Request

logger = logging.getLogger("compileattn")


@dataclasses.dataclass
class ScheduledStep:
    """One step's plan: sequences in order (decodes first), their tokens, and the rows to sample."""

    requests: list[Request]
    seqs: list[SequenceStep]
    kinds: list[str]  # "decode" | "prefill" | "chunked_prefill"
    input_ids: list[int]
    positions: list[int]
    #: Token rows whose logits are sampled: the last row of each sequence that has now computed all
    #: of its known tokens (a finished prompt or a decode).
    sample_rows: list[int]
    sample_requests: list[Request]
    #: Requests preempted while this step was planned.
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, *, block_size: int, max_num_seqs: int, max_num_tokens: int):
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        #: Free blocks kept back when admitting (not when growing running requests), so that a
        #: fresh admission does not make the next step preempt it straight away.
        self.watermark = max(1, allocator.num_blocks // 100)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def reset(self) -> None:
        for req in self.running:
            self.allocator.free(req.blocks)
            req.blocks = []
        self.running.clear()
        self.waiting.clear()

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self.allocator.free(req.blocks)
        req.blocks = []

    def _blocks_needed(self, req: Request, q: int) -> int:
        return -(-(req.num_computed + q) // self.block_size) - len(req.blocks)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.allocator.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted request %d (%d known tokens) for lack of KV-cache blocks", req.seq_id,
                     len(req.token_ids))

    def _grow(self, req: Request, q: int, scheduled: set[int], preempted: list[Request]) -> bool:
        """Allocate ``req``'s blocks for ``q`` more tokens, preempting the newest running requests not
        scheduled in this step as needed; False if ``req`` itself had to be preempted."""
        need = self._blocks_needed(req, q)
        while need > self.allocator.num_free:
            victim = next((r for r in reversed(self.running) if r.seq_id not in scheduled and r is not req), req)
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        if need > 0:
            req.blocks.extend(self.allocator.allocate(need))
        return True

    def schedule(self, max_tokens: int | None = None) -> ScheduledStep:
        """Plan one step of at most ``max_tokens`` tokens (default: the engine's maximum)."""
        if not self.has_unfinished():
            raise ValueError("no unfinished requests to schedule; add a request first")
        budget = self.max_num_tokens if max_tokens is None else min(max_tokens, self.max_num_tokens)
        if budget < 1:
            raise ValueError(f"max_tokens_per_step must be >= 1, got {max_tokens}")
        plan: list[tuple[Request, int]] = []
        scheduled: set[int] = set()
        preempted: list[Request] = []
        # Decodes first, then prefills; a request preempted meanwhile has left self.running.
        candidates = [r for r in self.running if r.is_decoding] + [r for r in self.running if not r.is_decoding]
        for req in candidates:
            if budget == 0:
                break
            if preempted and req in preempted:
                continue
            q = min(req.num_uncomputed, budget)
            if self._grow(req, q, scheduled, preempted):
                plan.append((req, q))
                scheduled.add(req.seq_id)
                budget -= q
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req in preempted:  # readmitting it now would undo the preemption that made room
                break
            q = min(req.num_uncomputed, budget)
            reserve = self.watermark if self.running else 0
            if self._blocks_needed(req, q) + reserve > self.allocator.num_free:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.blocks.extend(self.allocator.allocate(self._blocks_needed(req, q)))
            plan.append((req, q))
            scheduled.add(req.seq_id)
            budget -= q
        if not plan:
            raise RuntimeError("the scheduler planned an empty step with requests pending: a request does not fit "
                               "the KV cache even alone (the engine's max_model_len check should prevent this)")
        plan.sort(key=lambda rq: rq[1] != 1)  # stable: one-token sequences first, as the metadata wants
        return self._build(plan, preempted)

    def _build(self, plan: list[tuple[Request, int]], preempted: list[Request]) -> ScheduledStep:
        step = ScheduledStep([], [], [], [], [], [], [], preempted)
        row = 0
        for req, q in plan:
            ctx = req.num_computed
            if ctx >= req.num_prompt_tokens and q == 1:
                kind = "decode"
            elif ctx == 0 and q == len(req.token_ids):
                kind = "prefill"
            else:
                kind = "chunked_prefill"
            step.requests.append(req)
            step.seqs.append(SequenceStep(q, ctx, tuple(req.blocks)))
            step.kinds.append(kind)
            step.input_ids.extend(req.token_ids[ctx: ctx + q])
            step.positions.extend(range(ctx, ctx + q))
            row += q
            if ctx + q == len(req.token_ids):
                step.sample_rows.append(row - 1)
                step.sample_requests.append(req)
        return step
