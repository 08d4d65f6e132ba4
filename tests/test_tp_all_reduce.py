"""compileattn::all_reduce's choice of algorithm (compileattn/parallel/comm.py), on the CPU.

The symmetric-memory kernels need GPUs with P2P access (``.ci/gpu-tp``: ``init_tp`` checks one-shot
and two-shot eagerly, the smoke checks a one-shot call eagerly and all three algorithms inside one
CUDA graph, the TP check and the benchmark use them); here fake CUDA tensors (FakeTensorMode needs
no GPU) drive the choice, which is the part every rank must make alike, and two gloo processes
drive the set-up's agreement.
The op through gloo, inside compiled pieces and under opcheck: tests/test_parallel.py (the TP
checks and the smoke's CPU run).
"""
from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from compileattn.parallel import comm
from compileattn.parallel.group import TPGroup, init_tp

GROUP = "test-group"


@pytest.fixture
def symmetric_group():
    """A 2-rank group registered as if ``enable_symmetric_memory`` had set it up (its buffers are
    never touched)."""
    comm._symmetric[GROUP] = comm.SymmetricBuffers(GROUP, 2, {d: None for d in comm.SYMMETRIC_DTYPES})
    yield GROUP
    comm.forget_all()


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


def test_non_contiguous_empty_and_cpu_tensors_take_nccl(symmetric_group):
    assert comm.algorithm(_cuda(64, 4096).t(), symmetric_group) == "nccl"
    assert comm.algorithm(_cuda(0, 4096), symmetric_group) == "nccl"
    assert comm.algorithm(torch.empty(1, 4096, dtype=torch.bfloat16), symmetric_group) == "nccl"


def test_groups_without_one_shot_take_nccl(symmetric_group):
    assert comm.algorithm(_cuda(1, 4096), "another-group") == "nccl"


def test_switching_one_shot_off_and_on(symmetric_group):
    x = _cuda(1, 4096)
    comm.set_symmetric_memory(symmetric_group, False)
    assert comm.algorithm(x, symmetric_group) == "nccl" and comm.symmetric_buffers(symmetric_group) is None
    comm.set_symmetric_memory(symmetric_group, False)  # idempotent
    comm.set_symmetric_memory(symmetric_group, True)
    assert comm.algorithm(x, symmetric_group) == "one-shot"
    comm.forget_all()
    comm.set_symmetric_memory(symmetric_group, True)  # nothing to restore after forget_all
    assert comm.algorithm(x, symmetric_group) == "nccl"


@pytest.mark.parametrize("make", [lambda: torch.empty(8, 64).t(), lambda: torch.empty(64, 1).t()])
def test_fake_and_real_outputs_are_contiguous_like_the_input(make):
    """The fake's strides must be the real output's: (1, 64) with strides (1, 1) included, which
    ``empty_like`` would copy."""
    from compileattn.parallel.comm import _fresh_like

    x = make()
    with FakeTensorMode() as mode:
        fake = torch.ops.compileattn.all_reduce(mode.from_tensor(x), GROUP)
    real = _fresh_like(x)
    assert fake.shape == real.shape == x.shape and fake.stride() == real.stride() and real.is_contiguous()


def test_symmetric_memory_is_for_cuda_groups_only():
    assert comm.enable_symmetric_memory(TPGroup(0, 2, torch.device("cpu"))) is False
    assert comm.symmetric_groups() == ()


AGREEMENT_SCRIPT = r'''
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed import _symmetric_memory
from compileattn.parallel import comm
from compileattn.parallel.group import TPGroup

failure, out = sys.argv[1], sys.argv[2]
if failure == "demanded on CPUs":
    from compileattn.parallel import init_tp
    try:
        init_tp(device="cpu", all_reduce="symmetric-memory")
        said = None
    except ValueError as exc:
        said = str(exc)
    json.dump({"on": False, "groups": list(comm.symmetric_groups()), "said": said,
               "group_left": dist.is_initialized()}, open(f"{out}.{os.environ['RANK']}.json", "w"))
    sys.exit(0)
dist.init_process_group("gloo")
rank = dist.get_rank()
if failure == "refuses":  # rank 1 cannot; rank 0 could, and must not allocate anyway
    comm._cannot_use_symmetric_memory = lambda device, peers, world: "no P2P here" if rank == 1 else None
    _symmetric_memory.empty = lambda *a, **k: sys.exit("allocated although a rank refused")
if failure == "allocation":
    comm._cannot_use_symmetric_memory = lambda device, peers, world: None
    def empty(*args, **kwargs):
        if rank == 0:
            raise RuntimeError("out of symmetric memory")
        return torch.empty(8)
    _symmetric_memory.empty = empty
    _symmetric_memory.rendezvous = lambda *a, **k: sys.exit("rendezvous entered after a failed allocation")
# A CUDA device object on a CPU machine: nothing here may touch it before the ranks agree.
on = comm.enable_symmetric_memory(TPGroup(rank, 2, torch.device("cuda", rank), dist.group.WORLD, dist.group.WORLD))
json.dump({"on": on, "groups": list(comm.symmetric_groups())}, open(f"{out}.{rank}.json", "w"))
dist.destroy_process_group()
'''


def _agreement(failure: str, tmp_path) -> list[dict]:
    from test_parallel import torchrun

    script = tmp_path / "agree.py"
    script.write_text(AGREEMENT_SCRIPT)
    rc, out = torchrun(2, [str(script), failure, str(tmp_path / "r")], tmp_path, timeout=120)
    assert rc == 0, out[-3000:]
    return [json.loads((tmp_path / f"r.{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("failure", ["refuses", "allocation"])
def test_every_rank_falls_back_to_nccl_when_one_rank_cannot(failure, tmp_path):
    assert _agreement(failure, tmp_path) == [{"on": False, "groups": []}] * 2


def test_demanding_symmetric_memory_where_there_is_none_raises(tmp_path):
    """Refused on every rank, and the process group init_tp made for it is gone: left up, its gloo
    threads were torn down at exit, which aborted a rank now and then after it handled the error."""
    for result in _agreement("demanded on CPUs", tmp_path):
        assert result["groups"] == [] and "all_reduce='symmetric-memory' but" in result["said"]
        assert not result["group_left"]


def test_init_tp_names_a_bad_all_reduce_choice():
    with pytest.raises(ValueError, match="all_reduce must be one of"):
        init_tp(all_reduce="ring")
