import types

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device; see README)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test starts with a clean Dynamo cache so compile counts are per test."""
    import torch._dynamo

    torch._dynamo.reset()
    yield


# Simulated CUDA graphs (see tests/test_runtime_simulated.py's docstring): used there and by the engine's
# compiled-path tests (tests/test_hf_models.py), which run full-decode and piecewise modes on the CPU.
# compileattn is imported inside, not here: it imports triton, and test_triton_backend's interpreter
# tests need TRITON_INTERPRET set before that happens.
class SimulatedGraph:
    def __init__(self, fn, args, outputs):
        self.fn, self.args, self.outputs = fn, list(args), outputs

    def replay(self):
        fresh = self.fn(*self.args)
        outs = self.outputs if isinstance(self.outputs, (tuple, list)) else (self.outputs,)
        fresh = fresh if isinstance(fresh, (tuple, list)) else (fresh,)
        for o, f in zip(outs, fresh):
            if isinstance(o, torch.Tensor):
                o.copy_(f)


class SimulatedPool:
    def __init__(self, device):
        self.capture_seconds = 0.0

    def capture(self, fn, args, name, size):
        import compileattn as ca
        import compileattn.cudagraph as cudagraph

        outputs = fn(*args)
        ca.counters.cudagraph_captures += 1
        return cudagraph.CapturedGraph(SimulatedGraph(fn, args, outputs), outputs, cudagraph._tensor_layout(args),
                                       name, size)

    def pool_bytes(self):
        return 0


@pytest.fixture
def simulated_graphs(monkeypatch):
    """CUDA graphs on a CPU model: the runtime believes it is on CUDA, the pool simulates graphs."""
    import compileattn.cudagraph as cudagraph
    import compileattn.piecewise as piecewise

    monkeypatch.setattr(cudagraph, "GraphPool", SimulatedPool)
    real_init = piecewise.PiecewiseRuntime.__init__

    def init(self, split_gm, pieces, compiled, config, device, *rest, **kw):
        real_init(self, split_gm, pieces, compiled, config, types.SimpleNamespace(type="cuda"), *rest, **kw)
        self.device = device

    monkeypatch.setattr(piecewise.PiecewiseRuntime, "__init__", init)
