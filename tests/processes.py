"""Waiting in tests for processes that must end on their own (orphans of a compiling process)."""
from __future__ import annotations

import os
import signal
import time
from typing import Sequence

from compileattn.compilation.fork_server import _alive


def assert_all_end(pids: Sequence[int], within_s: float, what: str) -> None:
    """Fail with ``what`` unless every process of ``pids`` ends within ``within_s``; kill what is
    left either way, so a failing test leaves no process behind (only the test's own: a pid ended
    may be reused, so only those still alive at the deadline are killed, at once)."""
    deadline = time.monotonic() + within_s
    try:
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids if _alive(p)], what
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
