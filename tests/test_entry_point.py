"""``torch.compile(m, backend="compileattn")`` works in a process that never imports compileattn.

The name resolves through the ``torch_dynamo_backends`` entry point of the installed distribution
(pyproject.toml), so this must run in a fresh interpreter: in the pytest process compileattn is
already imported and a registration by import would hide a broken entry point. Entry points exist
only for an installed distribution (``pip install -e .``); without one the test is skipped.

The toy module has no attention op, so the test depends only on the backend accepting and running
an ordinary graph, not on the attention machinery, and agrees with eager up to Inductor's
reordering of float32 reductions.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(r'''
    import json, sys
    import torch

    assert "compileattn" not in sys.modules, "the test must start without compileattn"

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(16, 32)
            self.down = torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.up(x))) + x * 0.5

    torch.manual_seed(0)
    model = Toy().eval()
    options = json.loads(sys.argv[1])
    compiled = torch.compile(model, backend="compileattn", fullgraph=True, options=options)
    worst = 0.0
    with torch.no_grad():
        for tokens in (5, 9, 5, 17):  # a second size exercises the dynamic token dimension
            x = torch.randn(tokens, 16)
            want, got = model(x), compiled(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            worst = max(worst, float((got - want).abs().max()))

    import compileattn
    print(json.dumps({
        "dynamo_graphs": compileattn.counters.dynamo_graphs,
        "worst": worst,
    }))
''')


def _installed() -> bool:
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    return any(ep.name == "compileattn" for ep in eps)


pytestmark = pytest.mark.skipif(
    not _installed(),
    reason="compileattn is not pip-installed, so its torch_dynamo_backends entry point does not exist "
           "(run `pip install -e .`)",
)


def test_entry_point_names_the_backend_function():
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="torch_dynamo_backends") if ep.name == "compileattn"]
    assert ep.value == "compileattn.compilation.backend:compileattn_backend"
    from compileattn.compilation.backend import compileattn_backend

    assert ep.load() is compileattn_backend


@pytest.mark.parametrize("options", [
    {"piece_compiler": "eager"},
    pytest.param({}, marks=pytest.mark.skipif(
        shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None,
        reason="Inductor on the CPU needs a C++ compiler")),
], ids=["eager-pieces", "inductor-pieces"])
def test_compile_by_name_in_a_fresh_process(tmp_path, options):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # found only as installed
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(options)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # Counted by the compileattn backend itself: proof that the name reached it, not some fallback.
    assert report["dynamo_graphs"] >= 1, report
