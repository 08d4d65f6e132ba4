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

The engine may schedule a step while the previous one still runs on the device: a request's
token sampled there is then *pending* (counted, its value unknown; the engine writes it into the
step's inputs before launching). A request whose pending token reaches ``max_new_tokens`` is not
scheduled again; one that a pending token will stop (EOS, stop ids) cannot be known to stop, so it
may run one step too many, whose result is dropped.

Prefix caching (``BlockAllocator(enable_caching=True)``): a request admitted with nothing computed
(new, or readmitted after a preemption) starts from the longest run of whole blocks of its known
tokens that the cache holds, shared with whoever computed them, and computes the rest as a chunked
prefill over that context. At least its last known token is always computed, since its logits are
what the request samples from. Shared blocks are whole, full blocks below ``num_computed``, so no
sequence ever writes into a block another one reads. A block is registered only after the step
that fills it has been put on the device (``register_computed``): a request planned into the same
step cannot read a block that step is still writing, while the next step, planned after this one
was launched and queued after it on the same stream, can. So that requests with one prefix
arriving together do not all compute it in the same step, a waiting request whose next uncached
block a planned sequence is filling in this step waits one step (admission stops there, keeping
arrival order) and then finds it in the cache.
"""
from __future__ import annotations

import collections
import dataclasses
import logging

from ..argtypes import as_int
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
    #: Token ids; a row in ``pending_rows`` holds 0 until the engine writes its pending token.
    input_ids: list[int]
    positions: list[int]
    #: Token rows whose logits are sampled: the last row of each sequence that has now computed all
    #: of its known tokens (a finished prompt or a decode).
    sample_rows: list[int]
    sample_requests: list[Request]
    #: Requests preempted while this step was planned.
    preempted: list[Request]
    #: (row, request): decodes of a token still pending when the step was planned.
    pending_rows: list[tuple[int, Request]] = dataclasses.field(default_factory=list)
    #: The uniform each sampled row draws with (``sampler.uniform``), set when the engine prepares
    #: the step (0.0 for a greedy row).
    sample_uniforms: list[float] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclasses.dataclass
class PrefixCacheStats:
    """Known tokens of the requests admitted with prefix caching on, and how many of them the
    prefix cache supplied (a readmission after a preemption counts again)."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    #: Admissions put off by a step because that step was filling the request's next block.
    deferred_admissions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


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
        #: seq_id -> request, in admission order (a dict: O(1) removal, ordered iteration).
        self.running: dict[int, Request] = {}
        self.num_preemptions = 0
        self.prefix_stats = PrefixCacheStats()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def reset(self) -> None:
        for req in self.running.values():
            self.allocator.free(req.blocks)
            req.blocks = []
        self.running.clear()
        self.waiting.clear()

    def finish(self, req: Request) -> None:
        """Release a finished request: out of the running set (or the queue), blocks freed. Blocks
        a launched step still writes may be handed out again at once: the next steps' kernels run
        after it on the same stream, and read only what they wrote."""
        if self.running.pop(req.seq_id, None) is None and req in self.waiting:
            self.waiting.remove(req)
        self.allocator.free(req.blocks)
        req.blocks = []

    def _blocks_needed(self, req: Request, q: int) -> int:
        return -(-(req.num_computed + q) // self.block_size) - len(req.blocks)

    def _preempt(self, req: Request) -> None:
        del self.running[req.seq_id]
        self.allocator.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_registered_blocks = 0
        req.last_content_id = None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted request %d (%d known tokens) for lack of KV-cache blocks", req.seq_id, req.num_known)

    def _grow(self, req: Request, q: int, scheduled: set[int], preempted: list[Request]) -> bool:
        """Allocate ``req``'s blocks for ``q`` more tokens, preempting the newest schedulable running
        requests not scheduled in this step as needed. False if ``req`` must wait: preempted itself,
        or skipped while requests about to finish still hold blocks."""
        need = self._blocks_needed(req, q)
        while need > self.allocator.num_free:
            victim = next((r for sid, r in reversed(self.running.items())
                           if sid not in scheduled and r is not req and r.schedulable), None)
            if victim is None:
                if any(not r.schedulable for r in self.running.values()):
                    return False  # their blocks come back when their last tokens arrive
                victim = req
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        if need > 0:
            req.blocks.extend(self.allocator.allocate(need))
        return True

    def schedule(self, max_tokens: int | None = None) -> ScheduledStep | None:
        """Plan one step of at most ``max_tokens`` tokens (default: the engine's maximum); None when
        nothing can run now (every running request waits for a pending token that ends it, or for
        blocks those requests still hold)."""
        if max_tokens is not None:
            # A float budget would make float chunk lengths and block counts: refused here, before
            # any request moves out of the queue.
            budget = as_int(max_tokens)
            if budget is None or budget < 1:
                raise ValueError(f"max_tokens_per_step must be a positive int, got {max_tokens!r}")
        if not self.has_unfinished():
            raise ValueError("no unfinished requests to schedule; add a request first")
        budget = self.max_num_tokens if max_tokens is None else min(budget, self.max_num_tokens)
        plan: list[tuple[Request, int]] = []
        scheduled: set[int] = set()
        preempted: list[Request] = []
        filling: set[int] = set()  # block hashes the planned sequences fill in this step
        live = [r for r in self.running.values() if r.schedulable]
        for req in [r for r in live if r.is_decoding] + [r for r in live if not r.is_decoding]:
            if budget == 0:
                break
            if preempted and req in preempted:
                continue
            q = min(req.num_uncomputed, budget)
            if self._grow(req, q, scheduled, preempted):
                plan.append((req, q))
                scheduled.add(req.seq_id)
                budget -= q
                self._note_filling(req, q, filling)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if preempted and req in preempted:  # readmitting it now would undo the preemption
                break
            hits = self._cached_prefix(req)
            if filling and self._next_block_filling(req, len(hits), filling):
                self.prefix_stats.deferred_admissions += 1
                break
            q = min(req.num_uncomputed - len(hits) * self.block_size, budget)
            need = -(-(len(hits) * self.block_size + q) // self.block_size) - len(hits)
            # Hits nobody holds sit in the free pool: taking them consumes free blocks too.
            free = self.allocator.num_free - sum(self.allocator.refcount(b) == 0 for b in hits)
            reserve = self.watermark if self.running else 0
            if need + reserve > free:
                break
            self.waiting.popleft()
            self.running[req.seq_id] = req
            if self.allocator.enable_caching:
                self._admit_cached(req, hits)
            req.blocks.extend(self.allocator.allocate(self._blocks_needed(req, q)))
            plan.append((req, q))
            scheduled.add(req.seq_id)
            budget -= q
            self._note_filling(req, q, filling)
        if not plan:
            return None
        plan.sort(key=lambda rq: rq[1] != 1)  # stable: one-token sequences first, as the metadata wants
        return self._build(plan, preempted)

    def _cached_prefix(self, req: Request) -> list[int]:
        """Blocks of the prefix cache holding ``req``'s leading known tokens, leaving at least the
        last one to compute; [] without caching or for a request that holds blocks already."""
        if not self.allocator.enable_caching or req.blocks or req.num_computed:
            return []
        return self.allocator.lookup(req.token_ids, self.block_size,
                                     max_blocks=(req.num_known - 1) // self.block_size)

    def _block_hashes(self, req: Request, n: int) -> list[int]:
        """``req``'s chained block hashes, at least ``n`` of them (``n`` full blocks of known
        tokens). A hint for scheduling only: a collision puts a request off by one step, while the
        prefix cache itself matches exact token keys."""
        hashes, bs = req.block_hashes, self.block_size
        while len(hashes) < n:
            i = len(hashes)
            hashes.append(hash((hashes[-1] if hashes else 0, tuple(req.token_ids[i * bs:(i + 1) * bs]))))
        return hashes

    def _note_filling(self, req: Request, q: int, filling: set[int]) -> None:
        """Add the hashes of the blocks ``req``'s ``q`` tokens of this step fill up."""
        if not self.allocator.enable_caching or q == 1:  # a decode's continuation is its own
            return
        first = req.num_computed // self.block_size
        end = min(req.num_computed + q, len(req.token_ids)) // self.block_size
        if end > first:
            filling.update(self._block_hashes(req, end)[first:end])

    def _next_block_filling(self, req: Request, num_hits: int, filling: set[int]) -> bool:
        """Whether block ``num_hits`` of waiting ``req`` (its first uncached one) is being filled in
        this step, and would be a hit for it in the next (within its cap of cached blocks)."""
        if req.blocks or req.num_computed or num_hits + 1 > (req.num_known - 1) // self.block_size:
            return False
        if (num_hits + 1) * self.block_size > len(req.token_ids):
            return False
        return self._block_hashes(req, num_hits + 1)[num_hits] in filling

    def _admit_cached(self, req: Request, hits: list[int]) -> None:
        """Start ``req`` from its cached prefix ``hits``: held, counted as computed."""
        self.prefix_stats.queried_tokens += req.num_known
        if not hits:
            return
        self.allocator.share(hits)
        req.blocks = list(hits)
        req.num_computed = len(hits) * self.block_size
        req.num_registered_blocks = len(hits)
        req.last_content_id = self.allocator.content_id(hits[-1])
        self.prefix_stats.hit_tokens += req.num_computed
        logger.debug("request %d: %d of its %d known tokens from the prefix cache", req.seq_id, req.num_computed,
                     req.num_known)

    def register_computed(self, requests: list[Request]) -> None:
        """Register the blocks of ``requests`` that are now full of computed tokens in the prefix
        cache; called once a step that computed them is on the device. Finished requests are
        skipped (their blocks are freed already; the step only fills what was left)."""
        if not self.allocator.enable_caching:
            return
        bs = self.block_size
        for req in requests:
            if req.finished:
                continue
            full = req.num_computed // bs
            if len(req.token_ids) < full * bs:
                raise RuntimeError(f"request {req.seq_id}: {req.num_computed} tokens computed but only "
                                   f"{len(req.token_ids)} known; a step's pending tokens must be in token_ids "
                                   f"before it is launched")
            while req.num_registered_blocks < full:
                i = req.num_registered_blocks
                req.last_content_id = self.allocator.register(req.blocks[i], req.last_content_id,
                                                              req.token_ids[i * bs:(i + 1) * bs])
                req.num_registered_blocks += 1

    def _build(self, plan: list[tuple[Request, int]], preempted: list[Request]) -> ScheduledStep:
        step = ScheduledStep([], [], [], [], [], [], [], preempted)
        row = 0
        for req, q in plan:
            ctx = req.num_computed
            known = req.num_known
            if ctx >= req.num_prompt_tokens and q == 1:
                kind = "decode"
            elif ctx == 0 and q == known:
                kind = "prefill"
            else:
                kind = "chunked_prefill"
            step.requests.append(req)
            step.seqs.append(SequenceStep(q, ctx, tuple(req.blocks)))
            step.kinds.append(kind)
            tokens = req.token_ids[ctx: ctx + q]
            if len(tokens) < q:  # the pending token: only ever the one token of a decode
                step.pending_rows.append((row, req))
                tokens.append(0)
            step.input_ids.extend(tokens)
            step.positions.extend(range(ctx, ctx + q))
            row += q
            if ctx + q == known:
                step.sample_rows.append(row - 1)
                step.sample_requests.append(req)
        return step
