"""Runs a model on one step: persistent inputs, padding, metadata, forward context, the forward.

The model is anything with ``forward(input_ids, positions) -> hidden`` over the step's packed
tokens, ``compute_logits(hidden)``, ``attention_specs()`` (layer name -> ``AttentionSpec``) and
``vocab_size``/``max_position``: compileattn's own models and ``compileattn.hf.HFCausalLM``.

Two properties the compiled paths depend on:

- Inputs live in persistent buffers and each step passes views ``[:num_tokens]`` of them, so the
  addresses a CUDA graph captured stay the addresses of the next step's inputs.
- ``pad_fn`` picks the padded token count (compiled: the next CUDA-graph capture size); padded
  tokens have input id 0 and position 0, and the metadata makes them write and read nothing.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import torch

from .. import _torch_compat
from ..context import set_forward_context
from ..kv_cache import allocate_kv_caches
from ..metadata import AttentionMetadata, AttentionMetadataBuilder, SequenceStep

if TYPE_CHECKING:
    from ..config import CompileConfig

logger = logging.getLogger("compileattn")

#: The compiled forward's dynamic dims: the token dim of both inputs.
DYNAMIC_ARG_DIMS = {"input_ids": 0, "positions": 0}


class PreparedStep(NamedTuple):
    """A step ready to run: its metadata and the views of the persistent inputs it reads."""

    metadata: AttentionMetadata
    input_ids: torch.Tensor
    positions: torch.Tensor
    num_tokens: int


class ModelRunner:
    """Owns the KV caches, the metadata builder and the (eager or compiled) forward of one model.

    ``compile_config``: compile ``model.forward`` with ``@compileattn.compile`` (the compileattn
    backend, Dynamo's guards skipped) and pad steps to its capture sizes; the compile happens here,
    on a two-token warm-up step, so no served step pays it and the first real step may have one
    token (Dynamo specialises a dynamic dim first seen with size 1). ``forward``: a caller's own
    callable instead (e.g. ``torch.compile(model.forward, backend="compileattn")``), with the token
    dim marked dynamic on every step unless ``mark_dynamic=False``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        block_size: int,
        num_blocks: int,
        max_num_tokens: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "auto",
        compile_config: "CompileConfig | None" = None,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        pad_fn: Callable[[int], int] | None = None,
        mark_dynamic: bool | None = None,
    ):
        if pad_fn is None and compile_config is not None:
            pad_fn = compile_config.padded_num_tokens
        self.pad_fn = pad_fn or (lambda n: n)
        # The decorator marks its own dynamic dims; a caller's torch.compile'd forward needs them marked.
        self.mark_dynamic = forward is not None if mark_dynamic is None else mark_dynamic
        self.model = model
        self.device = device
        #: Buffers hold the largest padded step (a capture size may exceed the token budget).
        buffer_tokens = max(max_num_tokens, self.pad_fn(max_num_tokens))
        self.kv_caches = allocate_kv_caches(model.attention_specs(), num_blocks, block_size, dtype, device)
        self.builder = AttentionMetadataBuilder(
            block_size=block_size, num_blocks=num_blocks, max_num_tokens=buffer_tokens,
            max_blocks_per_seq=-(-max_model_len // block_size), device=device, backend=attention_backend)
        # One spare row: Dynamo guards a view input's size against its base's, so a first step that
        # used the whole buffer would specialise "view == base" and the next, shorter step would
        # recompile.
        self.input_ids = torch.zeros(buffer_tokens + 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(buffer_tokens + 1, dtype=torch.long, device=device)
        self.last_metadata: AttentionMetadata | None = None
        if forward is not None:
            self.forward = forward
        elif compile_config is not None:
            from ..compilation.decorator import compile as compile_forward

            self.forward = compile_forward(model.forward, dynamic_arg_dims=DYNAMIC_ARG_DIMS, config=compile_config)
            self._warm_up()
        else:
            self.forward = model.forward

    def _warm_up(self) -> None:
        """Compile on a two-token step: one sequence in block 0 (it holds nothing yet, and a block
        is only read up to what its sequence wrote)."""
        self.execute([SequenceStep(2, 0, list(range(-(-2 // self.builder.block_size))))], [0, 0], [0, 1])
        logger.info("compiled the model's forward on a %d-token warm-up step", self.last_metadata.num_tokens)
        # Served steps run the static pieces from the first one, graphs captured or not: tokens do
        # not depend on when a piece landed.
        self.forward.wait_for_static_pieces()

    def prepare(self, seqs: Sequence[SequenceStep], input_ids, positions, dummy: bool = False) -> PreparedStep:
        """Host side of a step: metadata (and the backend's plan), inputs copied into the persistent
        buffers, padded to ``pad_fn(num_tokens)``. ``input_ids``/``positions`` are the real tokens
        (lists or 1-D tensors). ``input_ids=None``: the caller writes the real tokens' ids into
        ``PreparedStep.input_ids`` before ``run`` (an engine that plans a step while the previous
        one still computes some of its tokens), so they are copied to the device once. ``dummy``: a
        capture's dummy step, whose writes may land where its sequences read (``build``'s
        ``dummy_writes``)."""
        n = sum(s[0] for s in seqs)
        padded = self.pad_fn(n)
        if not isinstance(padded, int) or padded < n:
            raise ValueError(f"pad_fn({n}) returned {padded!r}; it must be an int >= {n}")
        for name, values in (("input_ids", input_ids), ("positions", positions)):
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries but seqs have {n} query tokens")
        md = self.builder.build(seqs, pad_to=padded, dummy_writes=dummy)
        ids = self.input_ids[:padded]
        pos = self.positions[:padded]
        if input_ids is not None:
            ids[:n].copy_(torch.as_tensor(input_ids, dtype=torch.long), non_blocking=True)
        pos[:n].copy_(torch.as_tensor(positions, dtype=torch.long), non_blocking=True)
        if padded > n:
            ids[n:].zero_()
            pos[n:].zero_()
        if self.mark_dynamic:
            _torch_compat.mark_dynamic(ids, 0)
            _torch_compat.mark_dynamic(pos, 0)
        return PreparedStep(md, ids, pos, n)

    def run(self, step: PreparedStep) -> torch.Tensor:
        """Device side of a step: the forward in the step's context; hidden (num_tokens, hidden) of
        the real tokens, valid only until the next step (a CUDA-graph runtime returns a view of
        its static output buffer)."""
        self.last_metadata = step.metadata
        with torch.no_grad(), set_forward_context(step.metadata, self.kv_caches):
            hidden = self.forward(step.input_ids, step.positions)
        return hidden[: step.num_tokens]

    def execute(self, seqs: Sequence[SequenceStep], input_ids, positions, dummy: bool = False) -> torch.Tensor:
        """``run(prepare(...))``: one step, host and device side."""
        return self.run(self.prepare(seqs, input_ids, positions, dummy))

    def capture_cuda_graphs(self, sizes: Sequence[int], max_num_seqs: int) -> None:
        """Capture every graph a served step can replay, before serving: for each size, a uniform
        decode step (the full graph, up to ``max_num_seqs`` sequences) and a mixed step (the
        piecewise graphs). Dummy steps over the first blocks, each token in its own slot (a step
        may not write a slot twice): captured kernels' grids depend only on the token and sequence
        counts, and nothing is served yet, so what the dummies write is never read (their sequences
        share blocks: one writes where another reads, which ``build`` otherwise refuses)."""
        start = time.perf_counter()
        wait = getattr(self.forward, "wait_for_static_pieces", None)
        if wait is not None:  # graphs captured before their static pieces land would be captured again mid-serving
            wait()
        bs = self.builder.block_size

        def table(tokens: int) -> list[int]:
            return list(range(-(-tokens // bs)))

        for size in sorted((s for s in sizes if s <= self.builder.max_num_tokens), reverse=True):
            if size <= max_num_seqs:
                self.execute([SequenceStep(1, i, table(i + 1)) for i in range(size)], [0] * size, list(range(size)),
                             dummy=True)
            if size >= 2:
                self.execute([SequenceStep(2, 0, table(2))] + [SequenceStep(1, 2 + j, table(3 + j))
                                                               for j in range(size - 2)],
                             [0] * size, list(range(size)), dummy=True)
        logger.info("captured CUDA graphs for %d step sizes in %.1f s", len(sizes), time.perf_counter() - start)

    def compute_logits(self, hidden: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """fp32 logits of ``rows`` of ``hidden`` (all rows when ``rows`` covers them in order)."""
        if len(rows) != hidden.shape[0] or rows[-1] != len(rows) - 1:
            index = torch.tensor(rows, dtype=torch.long).to(hidden.device, non_blocking=True)
            hidden = hidden.index_select(0, index)
        with torch.no_grad():
            return self.model.compute_logits(hidden)
