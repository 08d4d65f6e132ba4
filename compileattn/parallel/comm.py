"""The all-reduce of row-parallel layers, as an op the compiled graph keeps inside its pieces.

It is torch's functional collective pair ``_c10d_functional.all_reduce`` + ``wait_tensor``,
called as ops (not through ``funcol.all_reduce``, whose eager result is an
``AsyncCollectiveTensor`` subclass). Why this and not a ``compileattn::all_reduce`` custom op,
from checks on this repo's CPU box with gloo (torch 2.13, two processes):

- Dynamo traces both pairs into the FX graph, the split pass leaves them in the pieces (only
  attention ops split), and the pieces match eager exactly with every piece compiler
  (``eager``, ``aot_eager``, and Inductor through ``standalone_compile``).
- Inductor lowers the functional pair to ``_c10d_functional.all_reduce_`` *in place on the
  matmul's output buffer* followed by ``wait_tensor``: no copy. A mutating custom op got the
  same in-place call, but through functionalisation and re-inplacing, with a Python wrapper per
  call and a group registry of our own; the functional pair is what torch's own tensor
  parallelism and Inductor's collective scheduling understand.
- On the GPU both end in ``ProcessGroupNCCL::allreduce`` on the group's NCCL stream, which
  CUDA-graph capture records like a kernel (see ``group.py`` for what capture needs).

The group is named by a string (``TPGroup.group_name``) so the traced graph holds a constant,
not a ProcessGroup object; every rank's group has the same name, so ranks compile identical
pieces.
"""
from __future__ import annotations

import torch


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``x`` over the group's ranks (a new tensor; ``x`` is not modified)."""
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)
