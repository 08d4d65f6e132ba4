"""The all-reduce of row-parallel layers: ``compileattn::all_reduce``, one op that the compiled
graph keeps inside its pieces and that picks its algorithm per call.

Two algorithms, both plain ``torch.distributed``:

- **one-shot over symmetric memory** (``torch.ops.symm_mem.one_shot_all_reduce_copy_out``): each
  rank copies its partial sum into its symmetric buffer, a signal-pad barrier, each rank loads
  every peer's buffer over NVLink (P2P loads, no multicast) and sums, a closing barrier (so no
  buffer is overwritten while a peer still reads it). One kernel on the caller's stream, no
  proxy thread: what a decode step's all-reduce of a few KiB needs, where NCCL's latency is the
  cost. It needs a group whose buffers were set up (``enable_one_shot``, done by ``init_tp`` on
  GPUs) and a tensor of at most ``ONE_SHOT_MAX_BYTES``.
- **NCCL** (gloo on CPUs): torch's functional pair ``_c10d_functional.all_reduce`` +
  ``wait_tensor``, for everything else (prefill-sized tensors, CPUs, groups without symmetric
  memory).

Why one opaque custom op and not the functional pair in the graph: the same piece runs decode
sizes and prefill sizes (dynamic shapes), so the choice is per call, by size; and Inductor's own
one-shot lowering (``enable_symm_mem_for_group``) plans the input into symmetric memory at compile
time, which the static-compile workers (processes without the group) cannot do. Dynamo and the
split pass see one op (``passes/split.is_collective`` counts it; only attention splits);
Inductor calls it as an extern kernel. Every rank makes the same choice for the same call: it
depends only on the tensor's size and dtype and on the group's set-up, which ``enable_one_shot``
makes on all ranks or on none.

CUDA-graph capture records the one-shot kernel like any other, with the buffer addresses baked
in; its barriers pair up exactly when every rank replays the same graphs in the same order, the
condition NCCL inside graphs already imposes (``group.py``).

The group is named by a string (``TPGroup.group_name``) so the traced graph holds a constant, not
a ProcessGroup object; every rank's group has the same name, so ranks compile identical pieces.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

logger = logging.getLogger("compileattn")

#: Largest tensor (bytes) the one-shot algorithm takes; larger ones go to NCCL. A decode step's
#: hidden state is batch x hidden x 2 bytes (Llama-3-70B shape, batch 256: 4 MiB); one-shot reads
#: every peer's whole buffer, which stops paying against NCCL's bandwidth-optimal algorithms as
#: tensors grow. Also the size of each symmetric buffer.
ONE_SHOT_MAX_BYTES = 1 << 20
#: dtypes the one-shot kernel reduces (torch's symm_mem kernels dispatch float and bfloat16;
#: float16 is not among them).
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)
#: The kernel loads 16-byte vectors where the size allows; smaller multiples of 4 work but take
#: its slower paths.
_ALIGN_BYTES = 16

_lib = torch.library.Library("compileattn", "FRAGMENT")  # noqa: TOR901 (an op library, not a test)
_lib.define("all_reduce(Tensor x, str group_name) -> Tensor")


@dataclasses.dataclass
class OneShot:
    """A group's symmetric buffers, one per dtype (each rendezvoused on every rank)."""

    group_name: str
    buffers: dict[torch.dtype, torch.Tensor]
    #: torch >= 2.9 fuses the copy into the kernel; older builds copy first.
    fused_copy: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        staging = self.buffers[x.dtype][: x.numel()].view_as(x)
        if self.fused_copy:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", self.group_name, out)
        else:
            staging.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(staging, "sum", self.group_name, out)
        return out


_one_shot: dict[str, OneShot] = {}
_switched_off: dict[str, OneShot] = {}


def algorithm(x: torch.Tensor, group_name: str) -> str:
    """"one-shot" or "nccl" (gloo on CPUs): the choice ``all_reduce`` makes for ``x`` (the one
    place it is made)."""
    one_shot = _one_shot.get(group_name)
    if (one_shot is not None and x.is_cuda and x.dtype in one_shot.buffers and x.is_contiguous()
            and x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES
            and (x.numel() * x.element_size()) % _ALIGN_BYTES == 0):
        return "one-shot"
    return "nccl"


def _all_reduce_impl(x: torch.Tensor, group_name: str) -> torch.Tensor:
    if algorithm(x, group_name) == "one-shot":
        return _one_shot[group_name](x.contiguous())
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _all_reduce_fake(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_lib.impl("all_reduce", _all_reduce_impl, "CompositeExplicitAutograd")
torch.library.register_fake("compileattn::all_reduce", _all_reduce_fake, lib=_lib)


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``x`` over the group's ranks (a new tensor; ``x`` is not modified)."""
    return torch.ops.compileattn.all_reduce(x, group_name)


def enable_one_shot(group_name: str, device: torch.device, cpu_group: Any,
                    dtypes: tuple[torch.dtype, ...] = ONE_SHOT_DTYPES) -> bool:
    """Set up the one-shot algorithm for a CUDA group, on every rank or on none; True if on.

    Collective over the group (every rank must call it, before anything is captured: the buffers
    are allocated and exchanged here, which a capture forbids). Each rank first checks what it
    can (the ops exist, its device reaches every peer's); the ranks agree over ``cpu_group``
    (gloo) before any symmetric allocation, so a rank that cannot never leaves the others waiting
    in a rendezvous. A one-shot all-reduce of a known value is then checked on every rank.
    """
    import torch.distributed as dist

    if device.type != "cuda":
        return False
    world = dist.get_world_size(cpu_group)
    devices: list[Any] = [None] * world
    dist.all_gather_object(devices, device.index, group=cpu_group)
    reason = _cannot_one_shot(device, [d for d in devices if d != device.index], world)
    reasons: list[Any] = [None] * world
    dist.all_gather_object(reasons, reason, group=cpu_group)
    refused = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why]
    if refused:
        logger.info("TP all-reduce: NCCL (one-shot not available: %s)", "; ".join(refused))
        return False
    from torch.distributed import _symmetric_memory as symm_mem

    buffers = {}
    for dtype in dtypes:
        numel = ONE_SHOT_MAX_BYTES // torch.empty((), dtype=dtype).element_size()
        buf = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group_name)
        buffers[dtype] = buf
    one_shot = OneShot(group_name, buffers, hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"))
    ok = True
    for dtype in dtypes:
        probe = torch.full((64,), float(dist.get_rank(cpu_group) + 1), dtype=dtype, device=device)
        total = one_shot(probe)
        torch.cuda.synchronize(device)
        ok = ok and bool((total == world * (world + 1) / 2).all().item())
    agreed = [None] * world
    dist.all_gather_object(agreed, ok, group=cpu_group)
    if not all(agreed):
        logger.warning("TP all-reduce: NCCL (a one-shot check all-reduce gave a wrong sum on ranks %s)",
                       [r for r, good in enumerate(agreed) if not good])
        return False
    _one_shot[group_name] = one_shot
    logger.info("TP all-reduce: one-shot over symmetric memory up to %d KiB, NCCL above",
                ONE_SHOT_MAX_BYTES >> 10)
    return True


def _cannot_one_shot(device: torch.device, peers: list[int], world: int) -> str | None:
    """Why this rank cannot take part in the one-shot algorithm, or None. ``peers``: the other
    ranks' device indices."""
    import os

    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        return "this torch build has no symm_mem one-shot all-reduce"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory does not import ({exc})"
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        return "the group spans several hosts (one-shot loads every peer's memory directly)"
    blocked = [p for p in peers if not torch.cuda.can_device_access_peer(device.index, p)]
    if blocked:
        return f"GPU {device.index} cannot access GPU(s) {blocked} directly (no P2P)"
    return None


def set_one_shot(group_name: str, enabled: bool) -> None:
    """Turn a set-up group's one-shot algorithm off (NCCL for every size) or back on; call on every
    rank at the same point (benchmarks compare the two). Graphs captured earlier keep the
    algorithm they were captured with."""
    if enabled and group_name in _switched_off:
        _one_shot[group_name] = _switched_off.pop(group_name)
    elif not enabled and group_name in _one_shot:
        _switched_off[group_name] = _one_shot.pop(group_name)


def one_shot_group_names() -> tuple[str, ...]:
    """The groups whose small all-reduces run one-shot now."""
    return tuple(_one_shot)


def forget(group_name: str) -> None:
    """Drop a group's buffers (its process group is being destroyed)."""
    _one_shot.pop(group_name, None)
    _switched_off.pop(group_name, None)
