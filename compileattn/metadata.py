"""Per-step attention metadata: built once per step on the host, read by every layer.

All shape logic and all validation of the step's sequences happen in ``AttentionMetadataBuilder
.build``; the per-layer attention op then only launches kernels. The builder writes its device
tensors into persistent buffers, so a CUDA graph captured with one step's metadata reads the next
step's metadata at the same addresses (the buffers are sized once, for ``max_num_tokens``).
"""
from __future__ import annotations

import array
import dataclasses
import operator
from typing import NamedTuple, Sequence

import torch

from .argtypes import as_int, is_bool, positive_int
from .backends.base import AttentionBackend, PersistentBuffers, StepShape, StepTensors
from .backends.selector import KernelSelector
from .kv_cache import check_num_blocks
from .validation import MAX_TOKENS, check_token_count, context_write_clash


class SequenceStep(NamedTuple):
    """One sequence's share of a step: ``query_len`` new tokens after ``context_len`` cached ones,
    whose K/V live in the blocks listed by ``block_table`` (covering at least context+query)."""

    query_len: int
    context_len: int
    block_table: Sequence[int]


@dataclasses.dataclass
class AttentionMetadata:
    """What every attention layer of one step needs. Device tensors are views of persistent buffers.

    Padding: tokens ``num_actual_tokens:num_tokens`` are padding. Each is its own padding sequence
    with query length 1 and KV length 0: its slot is -1 (writes nowhere), it attends to nothing and
    its output row is zero. This keeps every kernel's grid a function of ``num_tokens`` alone, which
    is what a CUDA graph captured for that token count needs.
    """

    block_size: int
    #: Blocks the builder's caches hold (every cache of the step must have at least these).
    num_blocks: int
    num_actual_tokens: int
    num_tokens: int
    num_actual_seqs: int
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    #: Leading sequences with query length 1 (the scheduler puts decodes first).
    num_decodes: int
    is_uniform_decode: bool
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]  (cu_seqlens_q)
    seq_lens: torch.Tensor  # int32 [num_seqs]  K length = context + query (seqused_k)
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 = padding
    #: Which kernels run this step's layers (the builder's; see backends/selector.py).
    selector: KernelSelector
    #: The builder's build that wrote the persistent buffers these tensors view; the next build
    #: overwrites them, so only the latest metadata of a builder may run (None: not built by one).
    generation: int | None = None

    @property
    def current(self) -> bool:
        """Whether the persistent buffers still hold this step (no later build overwrote them)."""
        return self.generation is None or self.generation == self.selector.buffers.generation

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    @property
    def shape(self) -> StepShape:
        return StepShape(self.num_tokens, self.num_seqs, self.block_size, self.max_query_len,
                         self.is_uniform_decode)

    @property
    def tensors(self) -> StepTensors:
        return StepTensors(self.query_start_loc, self.seq_lens, self.block_table, self.slot_mapping)


class AttentionMetadataBuilder:
    """Turns a step's sequences into ``AttentionMetadata`` (validating them) and lets the backend plan.

    ``max_num_tokens`` bounds a step's (padded) token count and so the persistent buffers; every
    sequence has at least one query token, so it bounds the sequence count too.
    """

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        device: torch.device | str = "cpu",
        backend: AttentionBackend | str = "auto",
    ):
        self.block_size = positive_int(block_size, "block_size")
        self.num_blocks = check_num_blocks(positive_int(num_blocks, "num_blocks"))
        # A step's tokens, and so query_start_loc's total, are at most max_num_tokens: checked once here.
        self.max_num_tokens = check_token_count(positive_int(max_num_tokens, "max_num_tokens"), "max_num_tokens")
        self.max_blocks_per_seq = positive_int(max_blocks_per_seq, "max_blocks_per_seq")
        self.device = torch.device(device)
        self.buffers = PersistentBuffers(self.device)
        self.selector = KernelSelector(backend, self.device, self.buffers)

    def _block_ids(self, entries: list, table_lens: list[int]) -> tuple[torch.Tensor, array.array]:
        """Every sequence's block-table entries, concatenated, as int64, each checked to be an
        integer (a float would be truncated into another block) in range. ``array("q")`` converts
        the list in C and refuses what ``operator.index`` refuses (floats, float tensors): a
        quarter of ``torch.tensor``'s time for the 66k entries of 256 sequences of 4096 tokens. A
        bool (or a one-element integer tensor) passes as its integer value: refusing it would mean
        looking at each entry's type, which costs as much again. Also returns the packed ints
        (``_all_distinct`` compares those: a tensor entry hashes by identity)."""
        def out_of_range(k: int) -> ValueError:
            return ValueError(f"seqs[{_owner(table_lens, k)}].block_table entry {entries[k]} out of range "
                              f"[0, {self.num_blocks})")

        try:
            packed = array.array("q", entries)
        except TypeError:  # a float, a numpy bool, a tensor that is not one integer: named
            k = next(k for k, b in enumerate(entries) if as_int(b) is None)
            raise TypeError(f"seqs[{_owner(table_lens, k)}].block_table entry must be an int, got "
                            f"{_shown(entries[k])}") from None
        except OverflowError:
            raise out_of_range(next(k for k, b in enumerate(entries)
                                    if not -2 ** 63 <= operator.index(b) < 2 ** 63)) from None
        if not entries:
            return torch.empty(0, dtype=torch.int64), packed
        blocks = torch.frombuffer(packed, dtype=torch.int64).clone()
        low, high = blocks.aminmax()
        if int(low) < 0 or int(high) >= self.num_blocks:
            raise out_of_range(int(((blocks < 0) | (blocks >= self.num_blocks)).nonzero()[0]))
        return blocks, packed

    def build(self, seqs: Sequence[SequenceStep], pad_to: int | None = None, *,
              dummy_writes: bool = False) -> AttentionMetadata:
        """The step's metadata. ``dummy_writes``: the step's K/V writes may land where its
        sequences read context (a CUDA-graph capture's dummy step over shared blocks, whose
        outputs nobody reads); without it such a step is refused. Refused inside a forward context
        of this builder's metadata: the layers still to run there read the buffers a build rewrites."""
        if self.buffers.in_use:
            raise RuntimeError("build() inside set_forward_context of a step this builder built: it would overwrite "
                               "the persistent buffers that step's layers read (its slots, lengths and block "
                               "tables); build the next step after the context exits")
        if not is_bool(dummy_writes):  # it lifts a refusal: bool("no") is True
            raise TypeError(f"dummy_writes must be a bool, got {dummy_writes!r}")
        try:
            num_seqs_given = len(seqs)
        except TypeError:
            raise TypeError(f"seqs must be a sequence of SequenceStep, got {type(seqs).__name__}") from None
        if num_seqs_given == 0:
            raise ValueError("seqs: a step needs at least one sequence")
        bs = self.block_size
        query_lens, seq_lens, table_lens, entries = [], [], [], []
        for i, seq in enumerate(seqs):
            try:
                q, ctx, table = seq
            except (TypeError, ValueError):  # not three items: name the entry, not Python's unpacking
                raise TypeError(f"seqs[{i}] must be a SequenceStep(query_len, context_len, block_table), got "
                                f"{_shown(seq)}") from None
            if type(q) is not int:
                q = _index(q, f"seqs[{i}].query_len")
            if q < 1:
                raise ValueError(f"seqs[{i}].query_len must be an int >= 1, got {q!r}")
            if type(ctx) is not int:
                ctx = _index(ctx, f"seqs[{i}].context_len")
            if ctx < 0:
                raise ValueError(f"seqs[{i}].context_len must be an int >= 0, got {ctx!r}")
            if not isinstance(table, list):
                try:
                    table = list(table)
                except TypeError:  # None, an int, a 0-dim tensor: no entries to read
                    raise TypeError(f"seqs[{i}].block_table must be a sequence of block ids, got "
                                    f"{_shown(table)}") from None
            needed = -(-(ctx + q) // bs)
            if needed > len(table):
                raise ValueError(
                    f"seqs[{i}]: context_len {ctx} + query_len {q} = {ctx + q} tokens need {needed} blocks "
                    f"of {bs}, but its block_table has {len(table)}"
                )
            if len(table) > self.max_blocks_per_seq:
                raise ValueError(f"seqs[{i}].block_table has {len(table)} blocks > max_blocks_per_seq "
                                 f"{self.max_blocks_per_seq}")
            query_lens.append(q)
            seq_lens.append(ctx + q)
            table_lens.append(len(table))
            entries += table
        max_seq_len = max(seq_lens)
        if max_seq_len > MAX_TOKENS:
            i = seq_lens.index(max_seq_len)
            check_token_count(max_seq_len, f"seqs[{i}]: context_len {seq_lens[i] - query_lens[i]} + query_len "
                                           f"{query_lens[i]}")
        blocks, packed_blocks = self._block_ids(entries, table_lens)

        num_actual_tokens = sum(query_lens)
        num_tokens = num_actual_tokens if pad_to is None else as_int(pad_to)
        if num_tokens is None:
            raise TypeError(f"pad_to must be an int or None, got {pad_to!r}")
        if num_tokens < num_actual_tokens:
            raise ValueError(f"pad_to={pad_to} is smaller than the step's {num_actual_tokens} tokens")
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"step has {num_tokens} tokens > max_num_tokens {self.max_num_tokens}")
        num_actual_seqs = len(seqs)
        num_pad = num_tokens - num_actual_tokens
        num_seqs = num_actual_seqs + num_pad

        q_cpu = torch.tensor(query_lens + [1] * num_pad, dtype=torch.int32)
        k_cpu = torch.tensor(seq_lens + [0] * num_pad, dtype=torch.int32)
        qsl_cpu = torch.zeros(num_seqs + 1, dtype=torch.int32)
        torch.cumsum(q_cpu, 0, out=qsl_cpu[1:])
        bt_cpu = torch.zeros(num_seqs, self.max_blocks_per_seq, dtype=torch.int32)
        if entries:
            lens = torch.tensor(table_lens)
            row = torch.repeat_interleave(torch.arange(num_actual_seqs), lens)
            starts = torch.cumsum(lens, 0) - lens
            bt_cpu[row, torch.arange(len(entries)) - starts[row]] = blocks.to(torch.int32)

        # Slot of every real token: position p of sequence s goes to block_table[s][p // bs] * bs + p % bs.
        seq_of_token = torch.repeat_interleave(torch.arange(num_actual_seqs), q_cpu[:num_actual_seqs])
        pos = (torch.arange(num_actual_tokens) - qsl_cpu[:-1][seq_of_token].long()
               + (k_cpu - q_cpu)[seq_of_token].long())
        slots = torch.full((num_tokens,), -1, dtype=torch.int64)
        slots[:num_actual_tokens] = bt_cpu[seq_of_token, pos // bs].long() * bs + pos % bs

        num_decodes = 0
        for q in query_lens:
            if q != 1:
                break
            num_decodes += 1
        n = self.max_num_tokens
        fill = self.buffers.fill
        real_slots = slots[:num_actual_tokens]
        # With no block twice in the step's tables, every token writes its own slot in its own
        # sequence's blocks at or past its context: neither check below can fail.
        if not _all_distinct(packed_blocks, blocks):
            if real_slots.unique().numel() != num_actual_tokens:
                raise ValueError(f"seqs: {_duplicate_slot_message(real_slots, seq_of_token, bs)}; every token a "
                                 f"step writes needs its own cache slot (two sequences may share only blocks they "
                                 f"read)")
            if not dummy_writes:
                _check_writes_outside_context(real_slots, seq_of_token, bt_cpu[:num_actual_seqs],
                                              (k_cpu - q_cpu)[:num_actual_seqs], bs)
        generation = self.buffers.generation = self.buffers.generation + 1
        md = AttentionMetadata(
            block_size=bs,
            num_blocks=self.num_blocks,
            num_actual_tokens=num_actual_tokens,
            num_tokens=num_tokens,
            num_actual_seqs=num_actual_seqs,
            num_seqs=num_seqs,
            max_query_len=max(query_lens),
            max_seq_len=max_seq_len,
            num_decodes=num_decodes,
            is_uniform_decode=num_decodes == num_actual_seqs,
            query_start_loc=fill("query_start_loc", qsl_cpu, (n + 1,)),
            seq_lens=fill("seq_lens", k_cpu, (n,)),
            block_table=fill("block_table", bt_cpu, (n, self.max_blocks_per_seq)),
            slot_mapping=fill("slot_mapping", slots, (n,)),
            selector=self.selector,
            generation=generation,
        )
        return md


def _owner(table_lens: list[int], k: int) -> int:
    """The sequence whose block table holds entry ``k`` of the concatenated tables."""
    for i, n in enumerate(table_lens):
        if k < n:
            return i
        k -= n
    raise IndexError(k)


def _shown(value) -> str:
    return repr(value) if isinstance(value, (bool, torch.Tensor)) else f"{type(value).__name__} {value!r}"


def _index(value, name: str) -> int:
    """``value`` as an int (``as_int``), or a TypeError naming the argument."""
    out = as_int(value)
    if out is None:
        raise TypeError(f"{name} must be an int, got {_shown(value)}")
    return out


def _all_distinct(packed: array.array, blocks: torch.Tensor) -> bool:
    """No block appears twice in the step's tables: then a sequence writes only its own blocks, at
    or past its context, each token its own slot, and nothing it writes is read as context (the
    duplicate-slot and context checks need not run: ~100 us of a small step's build on the CPU box).
    ``packed``: the entries as ints (the caller's entries may be tensors, which hash by identity)."""
    if len(packed) <= 4096:
        return len(set(packed)) == len(packed)
    return torch.unique(blocks).numel() == blocks.numel()


def _check_writes_outside_context(slots: torch.Tensor, seq_of_token: torch.Tensor, tables: torch.Tensor,
                                  context_lens: torch.Tensor, block_size: int) -> None:
    """No token of the step may be written where a sequence of the step reads context
    (``validation.context_write_clash``): the kernels write the step's K/V before they read."""
    clash = context_write_clash(slots, tables, context_lens, block_size)
    if clash is not None:
        t, block, row, readers = clash
        raise ValueError(f"seqs[{int(seq_of_token[t])}] writes cache slot {int(slots[t])} (block {block}, row {row}), "
                         f"which seqs{readers} read as context in the same step; a step may write only slots no "
                         f"sequence reads (a block listed twice in a table, or a shared block still being filled)")


def _duplicate_slot_message(slots: torch.Tensor, seq_of_token: torch.Tensor, block_size: int) -> str:
    values, counts = slots.unique(return_counts=True)
    slot = int(values[counts > 1][0])
    seqs = sorted(set(seq_of_token[slots == slot].tolist()))
    who = f"sequences {seqs}" if len(seqs) > 1 else f"sequence {seqs[0]} (twice)"
    return (f"{who} write cache slot {slot} (block {slot // block_size}, row {slot % block_size}) in the same "
            f"step")
