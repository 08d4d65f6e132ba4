"""Inductor's CPU code is generated for ``torch.get_num_threads()`` (``#pragma omp parallel
num_threads(N)``, its GEMM templates' blocking): a worker must compile with the compiling
process's thread count, not its own (a fresh interpreter's default, what a fork server inherited
at decoration), or a static piece ran with another number of threads than the program set
(oversubscribing the cores it left to others), and its code differed from an in-process compile's."""
import re
import time

import torch
import torch.fx

from compileattn import _torch_compat
from compileattn.compilation import compile_pool


def _piece(x):
    return (x * 2.0 + 1.0).sum(dim=1)


def _threads_in(data: bytes) -> set[str]:
    source = _torch_compat.artifact_source(_torch_compat.artifact_from_bytes(data))
    assert source is not None
    return set(re.findall(r"num_threads\(\d+\)", source))


def test_a_worker_compiles_for_the_compiling_processs_thread_count(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    before = torch.get_num_threads()
    threads = 3 if before != 3 else 2
    torch.set_num_threads(threads)
    pool = None
    try:
        gm = torch.fx.symbolic_trace(_piece)
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        mode = FakeTensorMode()
        FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.empty(4096, 512)))
        for node in gm.graph.nodes:  # as Dynamo's graph has them (a serialisable artifact needs them)
            if "val" in node.meta:
                node.meta["example_value"] = node.meta["val"]
        message = {"graph": _torch_compat.piece_pickle(gm),
                   "inputs": [("tensor", (4096, 512), (512, 1), torch.float32, "cpu")],
                   "options": {}, "settings": _torch_compat.compile_settings()}
        here, _ = compile_pool.compile_message(message)
        assert _threads_in(here) == {f"num_threads({threads})"}
        pool = compile_pool.CompilePool(1)
        task = compile_pool.Task(0, "piece (4096 tokens)", message)
        pool.submit(task)
        deadline = time.monotonic() + 240
        while task.result is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert task.result is not None and task.result[0] == "ok", task.result
        assert _threads_in(task.result[1]) == {f"num_threads({threads})"}
    finally:
        torch.set_num_threads(before)
        if pool is not None:
            pool.close(wait=True)
