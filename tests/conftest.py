"""Suite-wide rules: what may be skipped, and the mode the Triton kernels run in.

- Without CUDA, Triton's kernels run under its interpreter. ``TRITON_INTERPRET`` must be set
  before ``triton`` is first imported (its own ``tl`` helpers are decorated at import), so it is
  set here, before any test module (or Inductor) can import triton.
- Every test starts from random seeds of its own (a hash of its node id), so a tolerance failure
  seen once, in CI or here, comes back on every run of that test; Hypothesis draws its examples
  from a fixed seed per test for the same reason (``HYPOTHESIS_PROFILE=explore`` draws new ones).
- Without CUDA, the only acceptable skip is a ``cuda``-marked test. A skip for any other reason
  (typically a missing package) fails the run: every package the tests use is declared in the
  ``test`` extra, so a missing one is a broken install, and a skip would hide it.
"""
import importlib.metadata
import os
import random
import re
import zlib

import numpy
import pytest
import torch
from hypothesis import settings

settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

CUDA_SKIP_REASON = "needs a CUDA GPU (run on the device; see README)"
_unexpected_skips: list[str] = []


def _declared_test_packages() -> list[str]:
    """Distribution names of the ``test`` extra, or [] when compileattn is not installed (a
    PYTHONPATH checkout, as on the GPU machine)."""
    try:
        requires = importlib.metadata.requires("compileattn") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    names = []
    for req in requires:
        if re.search(r"""extra\s*==\s*['"]test['"]""", req):
            names.append(re.match(r"[A-Za-z0-9_.\-]+", req).group(0))
    return names


def pytest_sessionstart(session):
    missing = []
    for name in _declared_test_packages():
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        raise pytest.UsageError(f"declared test dependencies are not installed: {missing}; "
                                f"install with: pip install -e '.[test]'")


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason=CUDA_SKIP_REASON)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    if report.skipped and not CUDA:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if CUDA_SKIP_REASON not in reason:
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _unexpected_skips:
        terminalreporter.section("skips that fail the run (only cuda-marked tests may skip without CUDA)")
        for line in _unexpected_skips:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _seeded(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test starts with a clean Dynamo cache so compile counts are per test."""
    import torch._dynamo

    torch._dynamo.reset()
    yield


@pytest.fixture
def simulated_graphs():
    """CUDA-graph modes on the CPU (``compileattn.testing.simulated_cuda_graphs``), with the
    reference backend standing in for a capturable one; for the runtime and engine tests."""
    from compileattn.testing import simulated_cuda_graphs

    with simulated_cuda_graphs():
        yield
