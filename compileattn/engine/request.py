"""A request's sampling parameters and its state while the engine serves it."""
from __future__ import annotations

import dataclasses
import math
import time
from numbers import Real
from typing import Literal, Sequence

from ..argtypes import integer_as_int, is_bool, non_negative_int
from .sampler import sampling_key

FinishReason = Literal["length", "stop"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. ``temperature`` 0 is greedy; ``top_p`` < 1 samples from the
    smallest set of tokens whose probability reaches ``top_p``. ``seed`` (an int) fixes the
    request's draws whatever else the engine serves beside it, so the same seed, prompt and
    parameters give the same tokens wherever the logits are the same (in low precision, a
    batch's rounding can still move a near-tie); None: random draws. A request stops after ``max_new_tokens``, or at
    an EOS token (unless ``ignore_eos``) or one of ``stop_token_ids``; the token that stopped it is
    the last of its output."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        # numpy's integers as ints (``argtypes``): they count tokens, seed a generator, name token ids.
        object.__setattr__(self, "max_new_tokens", non_negative_int(self.max_new_tokens, "max_new_tokens"))
        object.__setattr__(self, "seed", integer_as_int(self.seed))
        # A string's characters or a bytes object's values are not token ids, and None or a bare
        # int has no items: refused by name rather than failing inside ``map``.
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes, bytearray, dict)) or not hasattr(stop, "__iter__"):
            raise TypeError(f"stop_token_ids must be a sequence of token ids, got {stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(map(integer_as_int, stop)))
        # Read as a truth value: a string such as "false" would silently ignore EOS.
        if not is_bool(self.ignore_eos):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        # Any real number (numpy's float32 too), as a Python float; a bool is not a number here.
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, Real) and not is_bool(value):
                object.__setattr__(self, name, float(value))
        if not isinstance(self.temperature, float) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, float) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        stop = tuple(self.stop_token_ids)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in stop):
            raise TypeError(f"stop_token_ids must be ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence: its known tokens (prompt, then output), how many of them have K/V in the
    cache, and the blocks holding them. After a preemption ``num_computed`` is 0 and ``blocks``
    empty: the known tokens (output included) are recomputed as a prefill (from the prefix cache
    where it has them)."""

    seq_id: int
    #: Prompt then generated tokens, one list: slicing a step's tokens out of it costs no copy of
    #: the whole sequence, which matters at hundreds of sequences per step.
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    stop_ids: frozenset[int]
    #: The key its sampled tokens are drawn with (``sampler.uniform``): from ``params.seed``, else random.
    sampling_key: int
    num_computed: int = 0
    #: Tokens sampled by a launched step whose values have not reached the host yet (0 or 1):
    #: the engine schedules the next step while the previous one runs on the device.
    num_pending: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    #: Prefix caching: leading ``blocks`` registered (or found) in the prefix cache, and the
    #: content id of the last of them, the parent of the next one's key.
    num_registered_blocks: int = 0
    last_content_id: int | None = None
    #: Chained hashes of its leading full blocks of known tokens, extended as the scheduler needs
    #: them (the tokens of a full block never change): which blocks a step is filling, a hint only.
    block_hashes: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    #: time.perf_counter() when the request was added, its first token sampled, it finished.
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @classmethod
    def create(cls, seq_id: int, prompt: Sequence[int], params: SamplingParams,
               eos_token_ids: Sequence[int]) -> "Request":
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(eos_token_ids)
        req = cls(seq_id, list(prompt), len(prompt), params, frozenset(stop), sampling_key(params.seed))
        if params.max_new_tokens == 0:
            req.finish_reason = "length"
        return req

    @property
    def prompt(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_known(self) -> int:
        """Prompt and output tokens, the pending one included."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncomputed(self) -> int:
        """Known tokens whose K/V are not in the cache: 1 for a decode, more for a prefill."""
        return self.num_known - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Past its prompt, with one token to compute."""
        return self.num_computed >= self.num_prompt_tokens and self.num_uncomputed == 1

    @property
    def schedulable(self) -> bool:
        """Not finished, and not waiting only for the token that will finish it by length."""
        return self.finish_reason is None and self.num_output_tokens + self.num_pending < self.params.max_new_tokens

    def append(self, token: int, now: float) -> None:
        """Add a sampled token and decide whether the request is finished."""
        self.token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.num_output_tokens >= self.params.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.finish_time = now
