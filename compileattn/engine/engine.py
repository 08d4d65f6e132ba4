"""The step loop: requests in, one scheduled step at a time through the model, tokens out.

``Engine`` is the low-level interface (token ids in and out, one ``step`` at a time, or
``generate`` for greedy token lists); ``compileattn.LLM`` puts loading, tokenization, KV-cache
sizing and result objects on top of it.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ..argtypes import as_int, integer_as_int, is_bool
from ..metadata import AttentionMetadata, SequenceStep
from ..refusals import ServingRefused
from .block_allocator import BlockAllocator
from .model_runner import ModelRunner, PreparedStep
from .request import Request, SamplingParams
from .sampler import sample, uniform
from .scheduler import PrefixCacheStats, ScheduledStep, Scheduler

if TYPE_CHECKING:
    from ..config import CompileConfig

#: How many steps ``Engine.history`` keeps (the latest): a record for tests and benchmarks, whose
#: runs are shorter, that must not grow for a server's whole life.
HISTORY_STEPS = 100_000

#: sampler(logits fp32 (N, vocab), seq_ids) -> one token per row: a caller's own choice of tokens
#: (tests and the demo feed fixed streams so two engines see identical inputs).
Sampler = Callable[[torch.Tensor, Sequence[int]], Sequence[int]]


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
    #: Requests that finished in this step.
    finished: list[Request]
    #: Requests preempted (to be recomputed) while this step was scheduled.
    preempted: list[Request]

    def count(self, kind: str) -> int:
        return self.kinds.count(kind)


@dataclasses.dataclass
class _Launched:
    """A step on the device: its plan, outputs and the sampled tokens (a host tensor being filled
    until ``copied`` fires, or a list)."""

    step: ScheduledStep
    hidden: torch.Tensor
    logits: torch.Tensor | None
    tokens: torch.Tensor | list[int] | None
    copied: "torch.cuda.Event | None"
    num_padded: int


def check_positive_ints(**values) -> None:
    """Each value a positive int (not a bool), or a ValueError naming it."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class Engine:
    """Continuous batching over a paged KV cache: chunked prefills mixed with decodes under a
    per-step token budget, blocks allocated as sequences grow, preemption by recompute when they
    run out, EOS/stop handling, and sampling on the model's device.

    ``model``: see ``model_runner``. ``compile_config``: compile the forward with compileattn and
    capture its CUDA graphs (at construction), and pad steps to its capture sizes; ``forward``: run
    this callable instead of ``model.forward`` (``compile_config`` then only names the attention
    backend and the padding).

    ``enable_prefix_caching``: sequences whose known tokens start alike share the KV-cache blocks
    of their common whole blocks, and a request computes only what the cache does not hold (see
    ``scheduler``); finished requests' blocks stay findable until their room is needed. Off by
    default: a prefix served from the cache was computed in another step, as part of another
    batch, so in half precision its K/V (and the tokens that follow) can differ in rounding from
    a full prefill of the same prompt: within tolerance, not bit for bit.

    ``on_step_done``: when set, called with each step's plan once its sampled tokens are on the
    host (a step that samples nothing does not wait for the device): what a per-step timing needs,
    and nothing when it is None.
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
        compile_config: "CompileConfig | None" = None,
        eos_token_ids: Sequence[int] = (),
        enable_prefix_caching: bool = False,
    ):
        if compile_config is not None:
            if attention_backend not in ("auto", compile_config.attention_backend):
                raise ValueError(f"attention_backend={attention_backend!r} contradicts "
                                 f"compile_config.attention_backend={compile_config.attention_backend!r}")
            attention_backend = compile_config.attention_backend
        # numpy's integers as ints (``argtypes``): they size the cache and the steps.
        block_size, num_blocks, max_num_tokens, max_num_seqs = map(
            integer_as_int, (block_size, num_blocks, max_num_tokens, max_num_seqs))
        check_positive_ints(block_size=block_size, num_blocks=num_blocks, max_num_tokens=max_num_tokens,
                            max_num_seqs=max_num_seqs)
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
        limit = min(model.max_position, num_blocks * block_size)
        max_model_len = limit if max_model_len is None else integer_as_int(max_model_len)
        if not isinstance(max_model_len, int) or is_bool(max_model_len) or not 1 <= max_model_len <= limit:
            # The arguments against the model and the cache they size: a refusal of the caller's
            # input that only the build can make (an LLM's num_blocks and max_model_len meet here).
            raise ServingRefused(f"max_model_len must be in [1, {limit}] (the model's max_position "
                                 f"{model.max_position}, and the cache's num_blocks * block_size "
                                 f"{num_blocks * block_size}), got {max_model_len!r}")
        self.max_model_len = max_model_len
        self.vocab_size = model.vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        self.allocator = BlockAllocator(num_blocks, enable_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, block_size=block_size, max_num_seqs=max_num_seqs,
                                   max_num_tokens=max_num_tokens)
        self.runner = ModelRunner(model, block_size=block_size, num_blocks=num_blocks, max_num_tokens=max_num_tokens,
                                  max_model_len=max_model_len, dtype=self.dtype, device=self.device,
                                  attention_backend=attention_backend, compile_config=compile_config,
                                  forward=forward, pad_fn=pad_fn, mark_dynamic=mark_dynamic)
        if (forward is None and compile_config is not None
                and compile_config.resolved_cudagraph_mode(self.device.type) != "none"):
            # Captured now, so no served step pays for a capture.
            self.runner.capture_cuda_graphs(compile_config.capture_sizes, max_num_seqs)
        self._requests: dict[int, Request] = {}
        self._next_id = 0
        #: Page-locked host buffer the sampled tokens are copied into (CUDA), made on first use.
        self._pinned: torch.Tensor | None = None
        #: Per step, the last ``HISTORY_STEPS``: (decodes, prefills, chunked prefills, tokens,
        #: padded tokens). Bounded: a served engine runs steps for its whole life.
        self.history: collections.deque[tuple[int, int, int, int, int]] = collections.deque(maxlen=HISTORY_STEPS)
        self.on_step_done: Callable[[ScheduledStep], None] | None = None

    # -- the runner's state, for callers and tests ------------------------------------------------

    @property
    def kv_caches(self):
        return self.runner.kv_caches

    @property
    def builder(self):
        return self.runner.builder

    @property
    def pad_fn(self) -> Callable[[int], int]:
        return self.runner.pad_fn

    @property
    def last_metadata(self) -> AttentionMetadata | None:
        return self.runner.last_metadata

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_caching(self) -> bool:
        return self.allocator.enable_caching

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Tokens of admitted requests looked up in the prefix cache, and those it supplied."""
        return self.scheduler.prefix_stats

    def set_prefix_caching(self, enabled: bool) -> None:
        """Switch prefix caching on or off between runs; either way the prefix cache starts empty
        (a benchmark's runs then each start cold, on the same compiled forward)."""
        if self.has_unfinished():
            raise ValueError("set_prefix_caching needs an idle engine: requests are unfinished")
        self.allocator.set_caching(enabled)

    def run_step(self, seqs: Sequence[SequenceStep], input_ids, positions) -> torch.Tensor:
        """Run the forward on one step given by the caller (see ``ModelRunner.execute``). It writes
        its tokens' K/V into the blocks it names, so with prefix caching on it must not name a
        block the prefix cache holds."""
        return self.runner.execute(seqs, input_ids, positions)

    # -- requests ----------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], max_new_tokens: int | None = None,
                    params: SamplingParams | None = None) -> int:
        """Queue a prompt (token ids); returns its seq_id. Greedy with ``max_new_tokens`` unless
        ``params`` are given."""
        if params is None:
            params = SamplingParams(max_new_tokens=16 if max_new_tokens is None else max_new_tokens)
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        elif max_new_tokens is not None:
            raise ValueError("pass max_new_tokens inside params, not both")
        return self._queue(self.check_prompt(prompt, params), params)

    def _queue(self, prompt: list[int], params: SamplingParams) -> int:
        """Queue a checked prompt (``check_prompt``'s list); its seq_id."""
        req = Request.create(self._next_id, prompt, params, self.eos_token_ids)
        self._next_id += 1
        self._requests[req.seq_id] = req
        if not req.finished:
            self.scheduler.add(req)
        return req.seq_id

    def check_prompt(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """``prompt`` as a list of ints, or the TypeError or ValueError ``add_request`` raises for it:
        token ids of this engine's vocabulary, and room within ``max_model_len`` for the prompt and
        ``params.max_new_tokens``. Public so that a caller can refuse its requests before it runs
        anything (``check_prompts``, ``LLM.check_requests``)."""
        if not hasattr(prompt, "__iter__"):
            raise TypeError(f"prompt must be a sequence of token ids, got {prompt!r}")
        # The int rule (``argtypes``): int() would truncate a float into another token, and a bool
        # is no token id.
        prompt = list(prompt)
        tokens = [t if type(t) is int else as_int(t) for t in prompt]  # as_int costs 10x a type check
        if None in tokens:
            bad = prompt[tokens.index(None)]
            raise TypeError(f"prompt tokens must be ints, got {type(bad).__name__} {bad!r}")
        prompt = tokens
        if not prompt:
            raise ValueError("prompt must have at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token {bad[0]} out of range [0, {self.vocab_size})")
        # The last sampled token is never fed back, so its K/V never needs a slot.
        kv_len = len(prompt) + max(params.max_new_tokens - 1, 0)
        if kv_len > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) needs {kv_len} "
                             f"positions > max_model_len {self.max_model_len}")
        return prompt

    def request(self, seq_id: int) -> Request:
        return self._requests[seq_id]

    def pop_request(self, seq_id: int) -> Request:
        """Forget a finished request (the engine keeps every request until popped or reset)."""
        req = self._requests[seq_id]
        if not req.finished:
            raise ValueError(f"request {seq_id} is not finished")
        return self._requests.pop(seq_id)

    def reset(self) -> None:
        """Drop every request and return its blocks. Buffers, caches and the forward stay, so a
        compiled forward (and its captured CUDA graphs) keeps serving this engine; so does the
        prefix cache (what it registered was computed by launched steps, so its K/V is whole)."""
        self.scheduler.reset()
        self._requests.clear()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def schedule(self, max_tokens_per_step: int | None = None) -> ScheduledStep | None:
        return self.scheduler.schedule(max_tokens_per_step)

    # -- steps ------------------------------------------------------------------------------------

    def step(self, max_tokens_per_step: int | None = None, sampler: Sampler | None = None) -> StepResult:
        """Schedule and run one step, and wait for it: sample a token for every sequence that
        computed all of its known tokens (with its own ``SamplingParams``, on the device, unless a
        ``sampler`` is given); free the blocks of sequences that finish."""
        sched = self.scheduler.schedule(max_tokens_per_step)
        if sched is None:
            raise RuntimeError("nothing can be scheduled although requests are pending (and no step is in flight)")
        launched = self._launch(sched, self._prepare(sched), sampler)
        sampled, finished = self._complete(launched)
        return StepResult([r.seq_id for r in sched.requests], sched.kinds, sched.num_tokens, launched.num_padded,
                          launched.hidden, launched.logits, sampled, finished, sched.preempted)

    def run(self, on_finished: Callable[[list[Request]], None] | None = None,
            max_tokens_per_step: int | None = None) -> None:
        """Step until every request has finished, planning and preparing each step (scheduling,
        metadata, input copies) while the previous one runs on the device: the host waits for a
        step's tokens only after the next step is ready to launch. ``on_finished`` gets the
        requests that finish, as they do."""
        launched: _Launched | None = None
        while True:
            sched = self.scheduler.schedule(max_tokens_per_step) if self.scheduler.has_unfinished() else None
            prepared = self._prepare(sched) if sched else None
            if launched is not None:
                _, finished = self._complete(launched)
                if finished and on_finished is not None:
                    on_finished(finished)
            elif sched is None:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("nothing can be scheduled although requests are pending (and no step is in "
                                       "flight)")
                return
            launched = self._launch(sched, prepared) if sched is not None else None

    def _prepare(self, sched: ScheduledStep) -> PreparedStep:
        """The runner's ``prepare`` for a planned step. A step with pending rows (tokens still on
        their way to the host when it was planned) gets its ids at ``_launch``, so they are copied
        to the device once, not once here and again there."""
        ids = None if sched.pending_rows else sched.input_ids
        # A request's k-th output token draws its k-th uniform. Here, while the previous step may
        # still run on the device (its token pending, counted in k), so the host's ~1 us per
        # sampled row overlaps the device's work instead of delaying the launch.
        sched.sample_uniforms = [uniform(r.sampling_key, r.num_output_tokens + r.num_pending)
                                 if r.params.temperature else 0.0 for r in sched.sample_requests]
        return self.runner.prepare(sched.seqs, ids, sched.positions)

    def _launch(self, sched: ScheduledStep, prepared: PreparedStep, sampler: Sampler | None = None) -> "_Launched":
        """Put a planned step on the device: its pending tokens into the inputs, the forward, the
        logits and the sampling (a caller's ``sampler`` runs on the host, so it waits for them);
        the sampled tokens start their copy to the host."""
        if sched.pending_rows:  # tokens that reached the host after the step was planned
            for row, req in sched.pending_rows:
                sched.input_ids[row] = req.token_ids[sched.positions[row]]
            n = prepared.num_tokens
            prepared.input_ids[:n].copy_(torch.as_tensor(sched.input_ids, dtype=torch.long), non_blocking=True)
        hidden = self.runner.run(prepared)
        logits = tokens = copied = None
        reqs = sched.sample_requests
        if reqs:
            logits = self.runner.compute_logits(hidden, sched.sample_rows)
            if sampler is not None:
                tokens = self._checked_tokens(sampler(logits, [r.seq_id for r in reqs]), len(reqs))
            else:
                on_device = sample(logits, [r.params.temperature for r in reqs], [r.params.top_p for r in reqs],
                                   sched.sample_uniforms)
                tokens, copied = self._to_host(on_device)
        for req, seq in zip(sched.requests, sched.seqs):
            req.num_computed += seq.query_len
        self.scheduler.register_computed(sched.requests)
        for req in reqs:
            req.num_pending += 1
        padded = prepared.metadata.num_tokens
        self.history.append((sched.kinds.count("decode"), sched.kinds.count("prefill"),
                             sched.kinds.count("chunked_prefill"), sched.num_tokens, padded))
        return _Launched(sched, hidden, logits, tokens, copied, padded)

    def _checked_tokens(self, tokens, num_rows: int) -> list[int]:
        """A caller's sampler's tokens as ints, one per sampled row and each in the vocabulary: they
        are given to the rows' requests in order and fed back as the next step's inputs, checked
        here before any request is advanced."""
        tokens = [t if type(t) is int else as_int(t) for t in tokens]  # int() would truncate a float
        if None in tokens:
            raise TypeError("sampler must return integer token ids")
        if len(tokens) != num_rows:
            raise ValueError(f"sampler returned {len(tokens)} tokens for {num_rows} rows; it must return one per row")
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"sampler returned token {bad} out of range [0, {self.vocab_size})")
        return tokens

    def _to_host(self, tokens: torch.Tensor):
        """(host tensor, event) for an asynchronous copy on CUDA; (list, None) elsewhere."""
        if tokens.device.type != "cuda":
            return tokens.tolist(), None
        n = tokens.shape[0]
        if self._pinned is None:
            self._pinned = torch.empty(self.runner.builder.max_num_tokens, dtype=torch.long, pin_memory=True)
        self._pinned[:n].copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return self._pinned[:n], copied

    def _wait_for(self, copied: torch.cuda.Event) -> None:
        """Block until a step's tokens have reached the host (``TPEngine`` watches its peers meanwhile)."""
        copied.synchronize()

    def _complete(self, launched: "_Launched") -> tuple[dict[int, int], list[Request]]:
        """Wait for a launched step's tokens and give them to their requests; release the requests
        that finish. A request that stopped while this step was planned gets no token from it."""
        sched = launched.step
        if launched.copied is not None:
            self._wait_for(launched.copied)
        tokens = launched.tokens.tolist() if isinstance(launched.tokens, torch.Tensor) else launched.tokens
        sampled: dict[int, int] = {}
        finished: list[Request] = []
        now = time.perf_counter()
        for req, token in zip(sched.sample_requests, tokens or ()):
            req.num_pending -= 1
            if req.finished:
                continue
            req.append(token, now)
            sampled[req.seq_id] = token
            if req.finished:
                self.scheduler.finish(req)
                finished.append(req)
        if self.on_step_done is not None:
            self.on_step_done(sched)
        return sampled, finished

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, max_tokens_per_step: int,
                 sampler: Sampler | None = None) -> list[list[int]]:
        """Greedy-decode up to ``max_new_tokens`` for every prompt (stopping at EOS as configured);
        returns the new tokens per prompt."""
        budget = as_int(max_tokens_per_step)
        if budget is None or budget < 1:
            raise ValueError(f"max_tokens_per_step must be a positive int, got {max_tokens_per_step!r}")
        max_tokens_per_step = budget
        ids = self.add_requests([SamplingParams(max_new_tokens=max_new_tokens)] * len(prompts), prompts)
        if sampler is None:
            self.run(max_tokens_per_step=max_tokens_per_step)
        else:
            while any(not self._requests[i].finished for i in ids):
                self.step(max_tokens_per_step, sampler)
        return [self._requests.pop(i).output for i in ids]

    def add_requests(self, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]]) -> list[int]:
        """Queue several prompts, all or none: every one is checked (``check_prompts``) before the
        first is queued."""
        params = list(params)
        return [self._queue(prompt, p) for p, prompt in zip(params, self.check_prompts(params, prompts))]

    def check_prompts(self, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """``check_prompt`` of each prompt with its ``SamplingParams``: the prompts as lists of ints,
        or the TypeError or ValueError of the first bad one, its message naming its index
        (``prompts[i]: ...``)."""
        params, prompts = list(params), list(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        checked = []
        for i, (p, prompt) in enumerate(zip(params, prompts)):
            try:
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"params must be a SamplingParams, got {type(p).__name__}")
                checked.append(self.check_prompt(prompt, p))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from None
        return checked
