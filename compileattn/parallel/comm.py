"""The all-reduce of row-parallel layers: ``compileattn::all_reduce``, one op that the compiled
graph keeps inside its pieces and that picks its algorithm per call.

Three algorithms, all plain ``torch.distributed``, chosen by size (``algorithm``):

- **one-shot over symmetric memory** (``torch.ops.symm_mem.one_shot_all_reduce_copy_out``), up to
  ``ONE_SHOT_MAX_BYTES``: each rank copies its partial sum into its symmetric buffer, a signal-pad
  barrier, each rank loads every peer's buffer over NVLink (P2P loads, no multicast) and sums, a
  closing barrier (so no buffer is overwritten while a peer still reads it). One kernel on the
  caller's stream, no proxy thread and no second stream: what a decode step's all-reduce of a few
  KiB needs, where NCCL's latency is the cost.
- **two-shot over symmetric memory** (``two_shot_all_reduce_out``: each rank reduces its 1/N of
  the buffer from every peer, then gathers the others' reduced parts), up to
  ``TWO_SHOT_MAX_BYTES``: it moves 2(N-1)/N of the data where one-shot moves N-1 times it.
- **NCCL** (gloo on CPUs): torch's functional pair ``_c10d_functional.all_reduce`` +
  ``wait_tensor``, for everything else (prefill-sized tensors, CPUs, groups without symmetric
  memory).

Measured on 2 x H200 (NVLink; ``benchmarks/allreduce_tp.py``, run S8-4: 64 dependent bf16
all-reduces in one CUDA graph, GPU µs per all-reduce, NCCL / one-shot / two-shot): 8 KiB 11.1 /
6.8 / 10.3; 512 KiB 15.0 / 11.6 / 13.6; 1 MiB 19.6 / 15.5 / 16.7; 2 MiB 33.6 / 23.1 / 20.2;
4 MiB 39.8 / 37.3 / 28.5; 8 MiB NCCL 61.0. On the Llama-3-8B shape (TP=2, batch 1, full-decode
graph, S8-2) they took the step from 3943 to 3415 µs. The symmetric buffers are set up by
``enable_symmetric_memory`` (``init_tp`` does it on GPUs).

Why one opaque custom op and not the functional pair in the graph: the same piece runs decode
sizes and prefill sizes (dynamic shapes), so the choice is per call, by size; and Inductor's own
one-shot lowering (``enable_symm_mem_for_group``) plans the input into symmetric memory at compile
time, which the compile workers (processes without the group) cannot do. Dynamo and the
split pass see one op (``passes/split.is_collective`` counts it; only attention splits);
Inductor calls it as an extern kernel. Every rank makes the same choice for the same call: it
depends only on the tensor's size, dtype, device and contiguity (the same on every rank, whose
pieces are the same) and on the group's set-up, which ``enable_symmetric_memory`` makes on all
ranks or on none.

CUDA-graph capture records the one-shot kernel like any other, with the buffer addresses baked
in; its barriers pair up exactly when every rank replays the same graphs in the same order, the
condition NCCL inside graphs already imposes (``group.py``).

The group is named by a string (``TPGroup.group_name``) so the traced graph holds a constant, not
a ProcessGroup object; every rank's group has the same name, so ranks compile identical pieces.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

logger = logging.getLogger("compileattn")

#: Largest tensor (bytes) the one-shot algorithm takes (the crossover with two-shot in the
#: measurements above). A decode step's hidden state is batch x hidden x 2 bytes: 1 MiB is batch
#: 128 of the 8B shape, 64 of the 70B shape.
ONE_SHOT_MAX_BYTES = 1 << 20
#: Largest tensor the two-shot algorithm takes, and the size of each symmetric buffer; larger
#: ones (prefill) go to NCCL.
TWO_SHOT_MAX_BYTES = 4 << 20
#: dtypes torch's symm_mem kernels reduce (float and bfloat16; float16 raises "not implemented
#: for 'Half'" on torch 2.11): float16 all-reduces take NCCL.
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)
#: A conservative rule of ours, not torch's: tensors whose size is a multiple of 16 bytes (and for
#: two-shot, of 16 bytes per rank), the sizes the kernels' 16-byte vector loads were measured
#: with; anything else takes NCCL.
_ALIGN_BYTES = 16

_lib = torch.library.Library("compileattn", "FRAGMENT")  # noqa: TOR901 (an op library, not a test)
_lib.define("all_reduce(Tensor x, str group_name) -> Tensor")


@dataclasses.dataclass
class SymmetricBuffers:
    """A group's symmetric buffers, one per dtype (each rendezvoused on every rank), and the two
    all-reduces over them."""

    group_name: str
    world_size: int
    buffers: dict[torch.dtype, torch.Tensor]

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        out = _fresh_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self._staging(x), x, "sum", self.group_name, out)
        return out

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        out = _fresh_like(x)
        staging = self._staging(x)
        staging.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(staging, "sum", self.group_name, out)
        return out

    def _staging(self, x: torch.Tensor) -> torch.Tensor:
        return self.buffers[x.dtype][: x.numel()].view_as(x)


def _fresh_like(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor shaped like ``x``: what the fake function promises (``empty_like``
    would copy odd strides of size-1 dimensions)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_symmetric: dict[str, SymmetricBuffers] = {}
_switched_off: dict[str, SymmetricBuffers] = {}


def algorithm(x: torch.Tensor, group_name: str) -> str:
    """"one-shot", "two-shot" or "nccl" (gloo on CPUs): the choice ``all_reduce`` makes for ``x``
    (the one place it is made)."""
    sym = _symmetric.get(group_name)
    if sym is None or not x.is_cuda or x.dtype not in sym.buffers or not x.is_contiguous() or x.numel() == 0:
        return "nccl"
    nbytes = x.numel() * x.element_size()
    if nbytes <= ONE_SHOT_MAX_BYTES and nbytes % _ALIGN_BYTES == 0:
        return "one-shot"
    if nbytes <= TWO_SHOT_MAX_BYTES and nbytes % (_ALIGN_BYTES * sym.world_size) == 0:
        return "two-shot"
    return "nccl"


def _all_reduce_impl(x: torch.Tensor, group_name: str) -> torch.Tensor:
    how = algorithm(x, group_name)
    if how == "one-shot":
        return _symmetric[group_name].one_shot(x)
    if how == "two-shot":
        return _symmetric[group_name].two_shot(x)
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _all_reduce_fake(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _fresh_like(x)


_lib.impl("all_reduce", _all_reduce_impl, "CompositeExplicitAutograd")
torch.library.register_fake("compileattn::all_reduce", _all_reduce_fake, lib=_lib)


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``x`` over the group's ranks (a new tensor; ``x`` is not modified)."""
    return torch.ops.compileattn.all_reduce(x, group_name)


def enable_symmetric_memory(tp: Any, dtypes: tuple[torch.dtype, ...] = SYMMETRIC_DTYPES) -> bool:
    """Set up the symmetric-memory all-reduces for the CUDA group of ``tp`` (a ``TPGroup``), on
    every rank or on none; True if on.

    Collective over the group (every rank must call it, before anything is captured: the buffers
    are allocated and exchanged here, which a capture forbids). The ranks agree over its gloo
    group (``tp.all_gather_object``) after each stage (what each can: the ops exist, its device
    reaches every peer's; the local allocation; the rendezvous; an all-reduce of a known value by
    each algorithm), and any rank's failure makes every rank return False (NCCL). A rank that raises inside the collective
    rendezvous itself can still leave its peers waiting there until the group's timeout.
    """
    device = tp.device
    if device.type != "cuda":
        return False
    group_name, world = tp.group_name, tp.world_size
    devices = tp.all_gather_object(device.index)
    reasons = tp.all_gather_object(_cannot_use_symmetric_memory(device, [d for d in devices if d != device.index],
                                                                world))
    refused = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why]
    if refused:
        logger.info("TP all-reduce: NCCL (symmetric memory not available: %s)", "; ".join(refused))
        return False
    from torch.distributed import _symmetric_memory as symm_mem

    def agree(ok: bool, what: str) -> bool:
        votes = tp.all_gather_object(ok)
        if not all(votes):
            logger.warning("TP all-reduce: NCCL (%s on ranks %s)", what, [r for r, v in enumerate(votes) if not v])
        return all(votes)

    buffers: dict[torch.dtype, torch.Tensor] = {}
    try:  # local: every rank reports before anyone enters the collective rendezvous
        for dtype in dtypes:
            numel = TWO_SHOT_MAX_BYTES // torch.empty((), dtype=dtype).element_size()
            buffers[dtype] = symm_mem.empty(numel, dtype=dtype, device=device)
        allocated = True
    except Exception as exc:  # noqa: BLE001  (any failure means NCCL, agreed on every rank)
        logger.info("symmetric allocation failed on this rank: %s", exc)
        allocated = False
    if not agree(allocated, "symmetric allocation failed"):
        return False
    try:  # collective: a rank failing inside it can leave its peers waiting until the group's timeout
        for buf in buffers.values():
            symm_mem.rendezvous(buf, group_name)
        exchanged = True
    except Exception as exc:  # noqa: BLE001
        logger.info("symmetric rendezvous failed on this rank: %s", exc)
        exchanged = False
    if not agree(exchanged, "symmetric rendezvous failed"):
        return False
    sym = SymmetricBuffers(group_name, world, buffers)
    expected = world * (world + 1) / 2
    ok = True
    try:  # every rank launches the same kernels: the ones that wait for peers find them
        for dtype in dtypes:
            for reduce, numel in ((sym.one_shot, 4096), (sym.two_shot, 4096 * world)):
                total = reduce(torch.full((numel,), float(tp.rank + 1), dtype=dtype, device=device))
                torch.cuda.synchronize(device)
                ok = ok and bool((total == expected).all().item())
    except Exception as exc:  # noqa: BLE001
        logger.info("symmetric check all-reduce failed on this rank: %s", exc)
        ok = False
    if not agree(ok, "a symmetric-memory check all-reduce failed or gave a wrong sum"):
        return False
    _symmetric[group_name] = sym
    logger.info("TP all-reduce: one-shot up to %d KiB, two-shot up to %d KiB (symmetric memory), NCCL above",
                ONE_SHOT_MAX_BYTES >> 10, TWO_SHOT_MAX_BYTES >> 10)
    return True


def _cannot_use_symmetric_memory(device: torch.device, peers: list[int], world: int) -> str | None:
    """Why this rank cannot take part in the symmetric-memory all-reduces, or None. ``peers``: the
    other ranks' device indices."""
    missing = [op for op in ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_out")
               if not hasattr(getattr(torch.ops, "symm_mem", None), op)]
    if missing:
        return f"this torch build lacks torch.ops.symm_mem.{', '.join(missing)}"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory does not import ({exc})"
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        return "the group spans several hosts (the kernels load every peer's memory directly)"
    try:
        blocked = [p for p in peers if not torch.cuda.can_device_access_peer(device.index, p)]
    except Exception as exc:  # noqa: BLE001  (a rank that cannot even ask must still vote)
        return f"cannot query peer access from GPU {device.index}: {exc}"
    if blocked:
        return f"GPU {device.index} cannot access GPU(s) {blocked} directly (no P2P)"
    return None


def set_symmetric_memory(group_name: str, enabled: bool) -> None:
    """Turn a set-up group's symmetric-memory all-reduces off (NCCL for every size) or back on;
    call on every rank at the same point (benchmarks compare the two). Graphs captured earlier
    keep the algorithms they were captured with."""
    if enabled and group_name in _switched_off:
        _symmetric[group_name] = _switched_off.pop(group_name)
    elif not enabled and group_name in _symmetric:
        _switched_off[group_name] = _symmetric.pop(group_name)


def symmetric_buffers(group_name: str) -> SymmetricBuffers | None:
    """The group's buffers and their all-reduces, when set up and switched on (benchmarks time
    each algorithm directly)."""
    return _symmetric.get(group_name)


def symmetric_groups() -> tuple[str, ...]:
    """The groups whose small all-reduces run over symmetric memory now."""
    return tuple(_symmetric)


def forget_all() -> None:
    """Drop every group's buffers (the process groups are being destroyed)."""
    _symmetric.clear()
    _switched_off.clear()
