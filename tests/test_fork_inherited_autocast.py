"""A function decorated inside ``torch.autocast`` starts its fork server then, as a fork of this
thread: the workers forked from it inherited autocast, and compiled every piece with its casts
(bf16 outputs the KV-cache write refused: a RuntimeError at the first call). A worker compiles
with autocast off, as the compiling process does (it sends no task under autocast)."""
import os
import subprocess
import sys

from compileattn.compilation import compile_pool

_SCRIPT = """
import random, sys
sys.path.insert(0, "tests")
import torch
import compileattn as ca
from compileattn.compilation import compile_pool
import test_static_landing as t

compile_pool.COMPILE_UNSTARTED_HERE = False  # the workers compile every piece
model, caches, builder, make_inputs, cfg = t._setup(compile_workers=2, compile_workers_start="decoration",
                                                    cudagraph_mode="none")
with torch.autocast("cpu", dtype=torch.bfloat16):
    forward = ca.compile(model.forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=cfg)
assert compile_pool._early is not None and compile_pool._early[0].forked_here
rng = random.Random(4)
t._step(rng, model, forward, builder, caches, make_inputs, decode=True)
assert forward.wait_for_static_pieces(timeout=200)
t._step(rng, model, forward, builder, caches, make_inputs, decode=True)
print("in workers:", ca.counters.dynamic_compiles_in_workers, ca.counters.static_compiles_in_workers, flush=True)
"""


def test_workers_forked_from_a_server_started_under_autocast_compile_without_it(tmp_path):
    env = compile_pool._worker_env()
    env.pop("TRITON_CACHE_DIR", None)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=400, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("in workers"))
    dynamic, static = map(int, line.split(":")[1].split())
    assert dynamic > 0 and static > 0, line
