"""Per-step attention metadata: built once per step on the host, read by every layer.

All shape logic and all validation of the step's sequences happen in ``AttentionMetadataBuilder
.build``; the per-layer attention op then only launches kernels. The builder writes its device
tensors into persistent buffers, so a CUDA graph captured with one step's metadata reads the next
step's metadata at the same addresses (the buffers are sized once, for ``max_num_tokens``).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import torch

from .backends.base import AttentionBackend, PersistentBuffers, StepShape, StepTensors
from .backends.selector import KernelSelector


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
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks),
                            ("max_num_tokens", max_num_tokens), ("max_blocks_per_seq", max_blocks_per_seq)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = torch.device(device)
        self.buffers = PersistentBuffers(self.device)
        self.selector = KernelSelector(backend, self.device, self.buffers)

    def build(self, seqs: Sequence[SequenceStep], pad_to: int | None = None) -> AttentionMetadata:
        if len(seqs) == 0:
            raise ValueError("seqs: a step needs at least one sequence")
        bs = self.block_size
        query_lens, seq_lens, tables = [], [], []
        for i, seq in enumerate(seqs):
            q, ctx, table = seq
            if not isinstance(q, int) or q < 1:
                raise ValueError(f"seqs[{i}].query_len must be an int >= 1, got {q!r}")
            if not isinstance(ctx, int) or ctx < 0:
                raise ValueError(f"seqs[{i}].context_len must be an int >= 0, got {ctx!r}")
            table = list(table)
            needed = -(-(ctx + q) // bs)
            if needed > len(table):
                raise ValueError(
                    f"seqs[{i}]: context_len {ctx} + query_len {q} = {ctx + q} tokens need {needed} blocks "
                    f"of {bs}, but its block_table has {len(table)}"
                )
            if len(table) > self.max_blocks_per_seq:
                raise ValueError(f"seqs[{i}].block_table has {len(table)} blocks > max_blocks_per_seq "
                                 f"{self.max_blocks_per_seq}")
            for b in table:
                if not 0 <= b < self.num_blocks:
                    raise ValueError(f"seqs[{i}].block_table entry {b} out of range [0, {self.num_blocks})")
            query_lens.append(q)
            seq_lens.append(ctx + q)
            tables.append(table)

        num_actual_tokens = sum(query_lens)
        num_tokens = num_actual_tokens if pad_to is None else pad_to
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
        for i, table in enumerate(tables):
            if table:
                bt_cpu[i, : len(table)] = torch.tensor(table, dtype=torch.int32)

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
        if real_slots.unique().numel() != num_actual_tokens:
            raise ValueError(f"seqs: {_duplicate_slot_message(real_slots, seq_of_token, bs)}; every token a step "
                             f"writes needs its own cache slot (two sequences may share only blocks they read)")
        md = AttentionMetadata(
            block_size=bs,
            num_blocks=self.num_blocks,
            num_actual_tokens=num_actual_tokens,
            num_tokens=num_tokens,
            num_actual_seqs=num_actual_seqs,
            num_seqs=num_seqs,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            is_uniform_decode=num_decodes == num_actual_seqs,
            query_start_loc=fill("query_start_loc", qsl_cpu, (n + 1,)),
            seq_lens=fill("seq_lens", k_cpu, (n,)),
            block_table=fill("block_table", bt_cpu, (n, self.max_blocks_per_seq)),
            slot_mapping=fill("slot_mapping", slots, (n,)),
            selector=self.selector,
        )
        return md


def _duplicate_slot_message(slots: torch.Tensor, seq_of_token: torch.Tensor, block_size: int) -> str:
    values, counts = slots.unique(return_counts=True)
    slot = int(values[counts > 1][0])
    seqs = sorted(set(seq_of_token[slots == slot].tolist()))
    who = f"sequences {seqs}" if len(seqs) > 1 else f"sequence {seqs[0]} (twice)"
    return (f"{who} write cache slot {slot} (block {slot // block_size}, row {slot % block_size}) in the same "
            f"step")
