"""An Inductor compile between decoration and the first call (another function compiled with
``torch.compile`` first) sets ``TORCHINDUCTOR_CACHE_DIR`` (and a process-local pointer variable),
as Inductor does in every process: not a change of environment that throws the fork server made
at decoration away (its workers' Inductor sets them alike)."""
import os

import torch

from compileattn.compilation import compile_pool

_SET_BY_INDUCTOR = ("TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")


def test_what_inductor_sets_in_every_process_is_not_a_change():
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    before = {k: v for k, v in compile_pool._worker_env().items() if k not in _SET_BY_INDUCTOR}
    now = dict(before, TORCHINDUCTOR_CACHE_DIR=os.path.abspath(default_cache_dir()),
               _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR="140000000000")
    assert compile_pool._changed_since(before, now) == []
    # a directory the program chose, or one changed since the server started, is a change
    assert compile_pool._changed_since(before, dict(now, TORCHINDUCTOR_CACHE_DIR="/elsewhere")) == \
        ["TORCHINDUCTOR_CACHE_DIR"]
    assert compile_pool._changed_since(dict(before, TORCHINDUCTOR_CACHE_DIR="/mine"), now) == \
        ["TORCHINDUCTOR_CACHE_DIR"]


def test_a_torch_compile_after_decoration_keeps_the_early_server(monkeypatch):
    compile_pool.drop_early_fork_server()
    for name in _SET_BY_INDUCTOR:
        monkeypatch.delenv(name, raising=False)
    assert compile_pool.start_fork_server_early(2)
    early = compile_pool._early[0]
    pool = None
    try:
        torch.compile(lambda x: x * 3 + 1)(torch.randn(4))  # Inductor sets its variables here
        assert "TORCHINDUCTOR_CACHE_DIR" in os.environ
        pool = compile_pool.CompilePool(2, start=False)
        pool.start()
        assert pool._fork_server is early
    finally:
        if pool is not None:
            pool.close(wait=True)
        compile_pool.drop_early_fork_server()
        early.close()
