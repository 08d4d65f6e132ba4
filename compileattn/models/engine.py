"""A step driver for real generation loops over a paged KV cache: just enough to drive the compiler.

Not a serving engine: no preemption, no sampling beyond greedy (or a caller's sampler), no EOS.
What it does do is produce the steps a compiled model meets in serving: decodes (q_len 1), whole
prefills and chunked prefills over a cached prefix, mixed in one step, over block tables that grow
one block at a time from a shared free list (so sequences' blocks interleave and freed blocks,
still holding stale K/V, are reused).

Two properties the compiled paths depend on:

- Inputs live in persistent buffers and each step passes views ``[:num_tokens]`` of them, so the
  addresses a CUDA graph captured stay the addresses of the next step's inputs.
- ``pad_fn`` picks the padded token count (a CUDA-graph runtime rounds up to a capture size);
  padded tokens have input id 0 and position 0, and the metadata makes them write and read nothing.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import torch

from .. import _torch_compat
from ..context import set_forward_context
from ..kv_cache import allocate_kv_caches
from ..metadata import AttentionMetadata, AttentionMetadataBuilder, SequenceStep

logger = logging.getLogger("compileattn")

#: sampler(logits fp32 (N, vocab), seq_ids) -> one token per row.
Sampler = Callable[[torch.Tensor, Sequence[int]], Sequence[int]]


if TYPE_CHECKING:
    from ..config import CompileConfig


class OutOfBlocksError(RuntimeError):
    """The KV cache has fewer free blocks than asked for."""


class BlockAllocator:
    """A free list of KV-cache block ids. Blocks come out lowest id first from a fresh allocator;
    freed blocks are reused before untouched ones (LIFO), which is what makes stale cache contents
    reachable by a wrong block table or slot mapping, and so testable."""

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"asked for {n} KV-cache blocks but only {len(self._free)} of {self.num_blocks} are free; "
                f"give the engine more num_blocks or run fewer/shorter sequences at once")
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated (double free, or not from this allocator)")
        for b in blocks:
            self._used.discard(b)
            self._free.append(b)


@dataclasses.dataclass
class _Request:
    seq_id: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    #: Tokens whose K/V are in the cache.
    num_computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    #: Blocks this request will hold at its longest (reserved at admission, allocated as it grows).
    max_blocks: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= len(self.prompt)


@dataclasses.dataclass
class ScheduledStep:
    """One step's plan: sequences in order (decodes first), their tokens, and the rows to sample."""

    requests: list[_Request]
    seqs: list[SequenceStep]
    kinds: list[str]  # "decode" | "prefill" | "chunked_prefill"
    input_ids: list[int]
    positions: list[int]
    #: Token rows whose logits are sampled: the last row of each sequence that has now computed all
    #: of its known tokens (a finished prompt or a decode).
    sample_rows: list[int]
    sample_requests: list[_Request]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclasses.dataclass
class StepResult:
    seq_ids: list[int]
    kinds: list[str]
    num_tokens: int
    num_padded_tokens: int
    #: (num_tokens, hidden): valid only until the next step (a CUDA-graph runtime may return a view
    #: of its static output buffer, which the next replay overwrites).
    hidden: torch.Tensor
    #: fp32 (len(sampled), vocab) for the sampled rows, in ``sampled``'s order; None if none sampled.
    logits: torch.Tensor | None
    #: seq_id -> new token.
    sampled: dict[int, int]

    def count(self, kind: str) -> int:
        return self.kinds.count(kind)


def greedy(logits: torch.Tensor, seq_ids: Sequence[int]) -> list[int]:
    return logits.argmax(dim=-1).tolist()


class Engine:
    """Greedy generation over mixed prefill/decode steps with a paged KV cache.

    ``forward`` defaults to ``model.forward``; pass a compiled callable (``torch.compile(model.forward,
    backend="compileattn")``) to drive the compiler. ``model`` needs ``forward(input_ids, positions)``,
    ``compute_logits(hidden)``, ``attention_specs()`` and ``config.vocab_size``/``config.max_position``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        block_size: int = 16,
        num_blocks: int,
        max_num_tokens: int,
        max_num_seqs: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        attention_backend: str = "auto",
        pad_fn: Callable[[int], int] | None = None,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        max_model_len: int | None = None,
        mark_dynamic: bool | None = None,
        config: "CompileConfig | None" = None,
    ):
        if config is not None:
            # The compile config names the attention backend and the capture sizes steps pad to.
            if attention_backend not in ("auto", config.attention_backend):
                raise ValueError(f"attention_backend={attention_backend!r} contradicts "
                                 f"config.attention_backend={config.attention_backend!r}")
            attention_backend = config.attention_backend
            if pad_fn is None:
                pad_fn = config.padded_num_tokens
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks),
                            ("max_num_tokens", max_num_tokens), ("max_num_seqs", max_num_seqs)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        param = next(model.parameters())
        self.model = model
        self.dtype = param.dtype if dtype is None else dtype
        self.device = param.device if device is None else torch.device(device)
        if param.dtype != self.dtype:
            raise TypeError(f"dtype={self.dtype} but the model's parameters are {param.dtype}")
        if param.device != self.device:
            raise ValueError(f"device={self.device} but the model's parameters are on {param.device}")
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        limit = min(model.config.max_position, num_blocks * block_size)
        if max_model_len is None:
            max_model_len = limit
        if not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] (max_position, and the cache's "
                             f"num_blocks * block_size), got {max_model_len!r}")
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.allocator = BlockAllocator(num_blocks)
        self.kv_caches = allocate_kv_caches(model.attention_specs(), num_blocks, block_size,
                                            self.dtype, self.device)
        self.builder = AttentionMetadataBuilder(
            block_size=block_size, num_blocks=num_blocks, max_num_tokens=max_num_tokens,
            max_blocks_per_seq=-(-max_model_len // block_size), device=self.device,
            backend=attention_backend)
        # Persistent: every step's inputs are views of these, at fixed addresses. One spare row:
        # Dynamo guards a view input's size against its base's, so a first step that used the whole
        # buffer would specialise "view == base" and the next, shorter step would recompile.
        self.input_ids = torch.zeros(max_num_tokens + 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_num_tokens + 1, dtype=torch.long, device=self.device)
        self.pad_fn = pad_fn if pad_fn is not None else (lambda n: n)
        self.forward = forward if forward is not None else model.forward
        #: Mark the token dim of each step's inputs dynamic, so ``torch.compile(model.forward)`` traces
        #: one graph for every token count >= 2 (Dynamo still specialises size 1: pad it with
        #: ``pad_fn``). Marking beats ``torch.compile(dynamic=True)``, which also makes every float
        #: module attribute (RMSNorm eps, Embedding.norm_type) symbolic; Inductor then cannot
        #: tensorify them and Dynamo restarts its analysis, compiling the model twice.
        #: Default: on when a ``forward`` is given (importing Dynamo costs an eager-only user seconds).
        self.mark_dynamic = forward is not None if mark_dynamic is None else mark_dynamic
        self.last_metadata: AttentionMetadata | None = None
        self._requests: dict[int, _Request] = {}
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._next_id = 0
        #: Per step: (decodes, prefills, chunked prefills, tokens, padded tokens).
        self.history: list[tuple[int, int, int, int, int]] = []

    # -- one given step ------------------------------------------------------------------------

    def run_step(self, seqs: Sequence[SequenceStep], input_ids, positions) -> torch.Tensor:
        """Run ``forward`` on one step given by the caller; returns hidden (num_tokens, hidden).

        ``input_ids``/``positions`` are the step's real tokens (lists or 1-D tensors); padding to
        ``pad_fn(num_tokens)`` happens here. The result is valid only until the next step.
        """
        n = sum(s[0] for s in seqs)
        padded = self.pad_fn(n)
        if not isinstance(padded, int) or padded < n:
            raise ValueError(f"pad_fn({n}) returned {padded!r}; it must be an int >= {n}")
        for name, values in (("input_ids", input_ids), ("positions", positions)):
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries but seqs have {n} query tokens")
        md = self.builder.build(seqs, pad_to=padded)
        ids = self.input_ids[:padded]
        pos = self.positions[:padded]
        ids[:n].copy_(torch.as_tensor(input_ids, dtype=torch.long), non_blocking=True)
        pos[:n].copy_(torch.as_tensor(positions, dtype=torch.long), non_blocking=True)
        if padded > n:
            ids[n:].zero_()
            pos[n:].zero_()
        if self.mark_dynamic:
            _torch_compat.mark_dynamic(ids, 0)
            _torch_compat.mark_dynamic(pos, 0)
        self.last_metadata = md
        with torch.no_grad(), set_forward_context(md, self.kv_caches):
            hidden = self.forward(ids, pos)
        return hidden[:n]

    # -- requests and scheduling ---------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        """Queue a prompt; returns its seq_id."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt must have at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token {bad[0]} out of range [0, {self.vocab_size})")
        # The last sampled token is never fed back, so its K/V never needs a slot.
        kv_len = len(prompt) + max(max_new_tokens - 1, 0)
        if kv_len > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) needs {kv_len} "
                             f"positions > max_model_len {self.max_model_len}")
        req = _Request(self._next_id, prompt, max_new_tokens, max_blocks=-(-kv_len // self.block_size))
        self._next_id += 1
        self._requests[req.seq_id] = req
        if not req.finished:
            self._waiting.append(req)
        return req.seq_id

    def reset(self) -> None:
        """Drop every request and return its blocks. Buffers, caches and ``forward`` stay, so a
        compiled forward (and its captured CUDA graphs) keeps serving this engine."""
        for req in self._running:
            self.allocator.free(req.blocks)
            req.blocks = []
        self._requests.clear()
        self._waiting.clear()
        self._running.clear()

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def _outstanding_blocks(self) -> int:
        return sum(r.max_blocks - len(r.blocks) for r in self._running)

    def _grow(self, req: _Request, q: int) -> None:
        need = -(-(req.num_computed + q) // self.block_size) - len(req.blocks)
        if need > 0:
            req.blocks.extend(self.allocator.allocate(need))

    def schedule(self, max_tokens_per_step: int) -> ScheduledStep:
        """Decodes first, then continuing prefills, then newly admitted prompts, within the budget.

        A prompt is admitted only while the free blocks cover every running sequence's worst case
        plus its own, so allocation never fails mid-generation (there is no preemption).
        """
        if not self.has_unfinished():
            raise ValueError("no unfinished requests to schedule; add_request() first")
        budget = min(max_tokens_per_step, self.max_num_tokens)
        if budget < 1:
            raise ValueError(f"max_tokens_per_step must be >= 1, got {max_tokens_per_step}")
        plan: list[tuple[_Request, int, str]] = []
        for req in self._running:
            if req.prefill_done and budget > 0:
                plan.append((req, 1, "decode"))
                budget -= 1
        for req in self._running:
            if not req.prefill_done and budget > 0:
                q = min(len(req.prompt) - req.num_computed, budget)
                plan.append((req, q, "prefill"))
                budget -= q
        while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            req = self._waiting[0]
            if req.max_blocks > self.allocator.num_free - self._outstanding_blocks():
                break
            self._running.append(self._waiting.pop(0))
            q = min(len(req.prompt), budget)
            plan.append((req, q, "prefill"))
            budget -= q
        if not plan:
            raise OutOfBlocksError(
                f"nothing can be scheduled: {len(self._waiting)} waiting prompt(s) need more KV-cache blocks "
                f"than the {self.allocator.num_free} free ones, or max_num_seqs={self.max_num_seqs} is reached")

        step = ScheduledStep([], [], [], [], [], [], [])
        row = 0
        for req, q, kind in plan:
            ctx = req.num_computed
            if kind == "prefill" and (ctx > 0 or q < len(req.prompt)):
                kind = "chunked_prefill"
            self._grow(req, q)
            step.requests.append(req)
            step.seqs.append(SequenceStep(q, ctx, list(req.blocks)))
            step.kinds.append(kind)
            step.input_ids.extend(req.tokens[ctx: ctx + q])
            step.positions.extend(range(ctx, ctx + q))
            row += q
            if ctx + q == len(req.tokens):
                step.sample_rows.append(row - 1)
                step.sample_requests.append(req)
        return step

    def step(self, max_tokens_per_step: int | None = None, sampler: Sampler | None = None) -> StepResult:
        """Schedule and run one step; sample (greedy by default) a token for every sequence that
        computed all of its known tokens; free the blocks of sequences that finish."""
        sched = self.schedule(self.max_num_tokens if max_tokens_per_step is None else max_tokens_per_step)
        hidden = self.run_step(sched.seqs, sched.input_ids, sched.positions)
        logits = None
        sampled: dict[int, int] = {}
        if sched.sample_rows:
            rows = torch.tensor(sched.sample_rows, dtype=torch.long, device=hidden.device)
            with torch.no_grad():
                logits = self.model.compute_logits(hidden.index_select(0, rows))
            seq_ids = [r.seq_id for r in sched.sample_requests]
            tokens = (sampler or greedy)(logits, seq_ids)
            sampled = dict(zip(seq_ids, (int(t) for t in tokens)))
        for req, seq in zip(sched.requests, sched.seqs):
            req.num_computed += seq.query_len
        for req in sched.sample_requests:
            req.output.append(sampled[req.seq_id])
            if req.finished:
                self._running.remove(req)
                self.allocator.free(req.blocks)
                req.blocks = []
        padded = self.last_metadata.num_tokens
        self.history.append((sched.kinds.count("decode"), sched.kinds.count("prefill"),
                             sched.kinds.count("chunked_prefill"), sched.num_tokens, padded))
        return StepResult([r.seq_id for r in sched.requests], sched.kinds, sched.num_tokens, padded,
                          hidden, logits, sampled)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, max_tokens_per_step: int,
                 sampler: Sampler | None = None) -> list[list[int]]:
        """Greedy-decode ``max_new_tokens`` for every prompt; returns the new tokens per prompt."""
        if not isinstance(max_tokens_per_step, int) or max_tokens_per_step < 1:
            raise ValueError(f"max_tokens_per_step must be a positive int, got {max_tokens_per_step!r}")
        ids: list[int] = []
        try:
            for p in prompts:
                ids.append(self.add_request(p, max_new_tokens))
        except ValueError as exc:
            for i in ids:  # leave the engine as it was
                req = self._requests.pop(i)
                if req in self._waiting:
                    self._waiting.remove(req)
            raise ValueError(f"prompts[{len(ids)}]: {exc}") from None
        while any(not self._requests[i].finished for i in ids):
            self.step(max_tokens_per_step, sampler)
        return [self._requests.pop(i).output for i in ids]
