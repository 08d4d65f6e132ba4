"""A fork server started from inside a torch.compile trace (``torch.compile(model,
backend="compileattn")``: the backend starts the pool while Dynamo traces) must not be a fork of
this process: the fork's thread is the tracing one, and every worker forked from it inherited
Dynamo's tracing context (its fake mode and ShapeEnv of the moment of the fork), in which each
dynamic-shape compile failed ("vr must not be None for symbol s7") and was done again in-process,
or would have compiled against a stale ShapeEnv."""
import os
import subprocess
import sys

from compileattn.compilation import compile_pool, fork_server

_SCRIPT = """
import sys
sys.path.insert(0, "tests")
import compileattn as ca
from compileattn.compilation import compile_pool, fork_server
import test_compile_pool as t
assert fork_server.why_not_fork_here() is None, fork_server.why_not_fork_here()
compile_pool.COMPILE_UNSTARTED_HERE = False  # the workers compile every piece
runtime, _, sources = t._compile_and_run(workers=2)
distinct = sum(size is not None for _, size in sources)
print("dynamic in workers:", ca.counters.dynamic_compiles_in_workers, "of", distinct, flush=True)
"""


def test_a_pool_started_inside_a_trace_compiles_the_dynamic_pieces_in_its_workers(tmp_path):
    env = compile_pool._worker_env()
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("dynamic in workers"))
    _, counts = line.split(":")
    done, _, distinct = counts.split()
    assert done == distinct, (line, out.stderr[-3000:])


def test_no_fork_here_inside_a_tracing_context():
    import torch
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode())):
        why = fork_server._tracing_here()  # (why_not_fork_here may name another reason first)
        assert fork_server.why_not_fork_here() is not None
    assert why is not None and "trac" in why, why
    assert fork_server._tracing_here() is None
    assert torch  # imported for the tracing context's types
