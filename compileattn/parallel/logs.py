"""Per-rank logging and hang guards for the TP command-line modules.

Each record goes to stderr and, when a directory is given, to ``DIR/rank{r}.log`` (appended;
handlers flush every record), so a run killed by its timeout still leaves each rank's last words.
``hang_guard(seconds)`` arms ``faulthandler``'s watchdog: a C thread that needs no GIL (a rank
stuck inside an NCCL or CUDA call may hold it), which after ``seconds`` writes every thread's
Python traceback to the rank's log and exits the process, so one hang costs its guard's seconds,
not the whole run's time limit, and says where it hung.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
from pathlib import Path
from typing import IO

_fault_file: IO | None = None


def setup_rank_logging(log_dir: str | os.PathLike | None, rank: int, level: int = logging.INFO) -> logging.Logger:
    global _fault_file
    logger = logging.getLogger("compileattn")
    logger.setLevel(level)
    fmt = logging.Formatter(f"%(asctime)s.%(msecs)03d [rank{rank}] %(message)s", "%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        path = Path(log_dir) / f"rank{rank}.log"
        handlers.append(logging.FileHandler(path, mode="a"))
        _fault_file = open(path, "a")  # noqa: SIM115  (kept open for faulthandler's C thread)
    for h in handlers:
        h.setFormatter(fmt)
        logger.addHandler(h)
    logger.propagate = False
    return logger


def hang_guard(seconds: float | None, what: str = "") -> None:
    """Exit with every thread's traceback if the next ``hang_guard`` call (or ``None``, which
    disarms) does not come within ``seconds``."""
    if seconds is None:
        faulthandler.cancel_dump_traceback_later()
        return
    if what:
        logging.getLogger("compileattn").info("%s (hang guard: %.0f s)", what, seconds)
    target = _fault_file or sys.stderr
    target.flush()
    faulthandler.dump_traceback_later(seconds, exit=True, file=target)
