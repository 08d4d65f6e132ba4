"""compileattn::all_reduce's choice of algorithm (compileattn/parallel/comm.py), on the CPU.

The symmetric-memory kernels need GPUs with P2P access (``.ci/gpu-tp``: the smoke checks one-shot,
two-shot and NCCL eagerly and inside one CUDA graph, the TP check and the benchmark use them);
here fake CUDA tensors (FakeTensorMode needs no GPU) drive the choice, which is the part every
rank must make alike.
The op through gloo, inside compiled pieces and under opcheck: tests/test_parallel.py (the TP
checks and the smoke's CPU run).
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from compileattn.parallel import comm
from compileattn.parallel.group import init_tp

GROUP = "test-group"


@pytest.fixture
def symmetric_group():
    """A 2-rank group registered as if ``enable_symmetric_memory`` had set it up (its buffers are
    never touched)."""
    comm._symmetric[GROUP] = comm.SymmetricBuffers(GROUP, 2, {d: None for d in comm.SYMMETRIC_DTYPES})
    yield GROUP
    comm.forget(GROUP)


def _cuda(*shape, dtype=torch.bfloat16):
    with FakeTensorMode():
        return torch.empty(*shape, device="cuda", dtype=dtype)


@pytest.mark.parametrize("shape,dtype,expected", [
    ((1, 4096), torch.bfloat16, "one-shot"),                     # a decode step's hidden state
    ((64, 4096), torch.float32, "one-shot"),
    ((comm.ONE_SHOT_MAX_BYTES // 2 // 4096, 4096), torch.bfloat16, "one-shot"),   # exactly the limit
    ((comm.ONE_SHOT_MAX_BYTES // 2 // 4096 + 1, 4096), torch.bfloat16, "two-shot"),
    ((comm.TWO_SHOT_MAX_BYTES // 2 // 4096, 4096), torch.bfloat16, "two-shot"),
    ((comm.TWO_SHOT_MAX_BYTES // 2 // 4096 + 1, 4096), torch.bfloat16, "nccl"),   # prefill sizes
    ((comm.ONE_SHOT_MAX_BYTES // 2 + 8,), torch.bfloat16, "nccl"),   # 16-byte multiple, not 32: no equal parts
    ((1, 4096), torch.float16, "nccl"),                          # the symm_mem kernels do not reduce fp16
    ((1, 4), torch.bfloat16, "nccl"),                            # 8 bytes: not a multiple of 16
])
def test_choice_by_size_dtype_and_alignment(symmetric_group, shape, dtype, expected):
    assert comm.algorithm(_cuda(*shape, dtype=dtype), symmetric_group) == expected


def test_non_contiguous_and_cpu_tensors_take_nccl(symmetric_group):
    assert comm.algorithm(_cuda(64, 4096).t(), symmetric_group) == "nccl"
    assert comm.algorithm(torch.empty(1, 4096, dtype=torch.bfloat16), symmetric_group) == "nccl"


def test_groups_without_one_shot_take_nccl(symmetric_group):
    assert comm.algorithm(_cuda(1, 4096), "another-group") == "nccl"


def test_switching_one_shot_off_and_on(symmetric_group):
    x = _cuda(1, 4096)
    comm.set_symmetric_memory(symmetric_group, False)
    assert comm.algorithm(x, symmetric_group) == "nccl"
    comm.set_symmetric_memory(symmetric_group, False)  # idempotent
    comm.set_symmetric_memory(symmetric_group, True)
    assert comm.algorithm(x, symmetric_group) == "one-shot"
    comm.forget(symmetric_group)
    comm.set_symmetric_memory(symmetric_group, True)  # nothing to restore after forget
    assert comm.algorithm(x, symmetric_group) == "nccl"


def test_fake_output_is_a_fresh_contiguous_tensor():
    with FakeTensorMode():
        x = torch.empty(8, 64, device="cuda", dtype=torch.bfloat16).t()
        out = torch.ops.compileattn.all_reduce(x, GROUP)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()


def test_symmetric_memory_is_for_cuda_groups_only():
    assert comm.enable_symmetric_memory(GROUP, torch.device("cpu"), cpu_group=None) is False
    assert comm.symmetric_groups() == ()


def test_init_tp_names_a_bad_all_reduce_choice():
    with pytest.raises(ValueError, match="all_reduce must be one of"):
        init_tp(all_reduce="ring")
