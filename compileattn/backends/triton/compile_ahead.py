"""Compile one Triton kernel variant into Triton's disk cache, in a process that never imports torch.

Run by path (``run_path``: ``-m`` would import the compileattn package, and with it torch,
seconds of import on the H200 host) with one pickled *spec* on stdin:
the kernel's module and name and what ``JITFunction.run`` would hand ``triton.compile`` for that
variant (signature, constexprs, attributes, options, target; ``direct.DirectKernel.ahead_spec``
computes them in the compiling process), and the ptxas version that process's Triton keys on.
``triton.compile`` keys its disk cache on exactly those and the kernel's source, so the
compiling process's first launch of the variant finds it there and loads it (milliseconds)
instead of compiling it (0.4-1.1 s per kernel on the H200, S12-5).
It also builds the variant's C launcher, which Triton caches too. Stdout stays empty; a failure
exits non-zero with its traceback on stderr, and the launch then compiles the variant itself.
The compiling process's pid comes as the first argument: the process exits as soon as that
process is gone (``_exit_with_parent``).

The kernel modules import only ``triton`` and each other; their package is registered here as
an empty stand-in for ``compileattn.backends.triton`` (same module names: a kernel's cache key
includes its module-qualified name), so importing them runs none of compileattn.
"""
from __future__ import annotations

import importlib
import os
import pickle
import sys
import threading
import time
import types
from pathlib import Path

_PACKAGE = "compileattn.backends.triton"


def _stand_in_packages() -> None:
    """Register ``compileattn``, ``compileattn.backends`` and ``compileattn.backends.triton`` as
    empty packages over their directories, so their kernel modules import without the packages'
    ``__init__`` (which import torch)."""
    directory = Path(__file__).resolve().parent
    parts = _PACKAGE.split(".")
    for depth in range(len(parts), 0, -1):  # the innermost package lives in this file's directory
        name = ".".join(parts[:depth])
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(directory)]
            sys.modules[name] = package
        directory = directory.parent


def compile_spec(spec: dict) -> None:
    from triton import knobs
    from triton.compiler import ASTSource, compile

    if spec.get("ptxas_version") is not None:
        # The cache key's ptxas version must be the compiling process's (``direct._keyed_ptxas_version``),
        # which may have read another ptxas than TRITON_PTXAS_PATH names now: Triton reads the version
        # for the key alone and compiles with the ptxas the variable names, as that process would.
        knobs.nvidia.mock_ptx_version = spec["ptxas_version"]
    module = importlib.import_module(spec["module"])
    fn = getattr(module, spec["name"])
    src = ASTSource(fn, spec["signature"], spec["constexprs"], spec["attrs"])
    kernel = compile(src, target=spec["target"], options=spec["options"])
    if spec["target"].backend == "cuda":
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)  # compiles (and caches) the variant's C launcher


#: Seconds between two looks at whether the compiling process still runs.
PARENT_POLL_S = 0.1


def _exit_with_parent(parent: int) -> None:
    """Exit at once when the compiling process ``parent`` is gone (killed, or exited before its
    first launch): nobody reads the cache entry then, and the compile would otherwise run on to
    its end, or for good where it is stuck. A thread polling ``getppid`` (an orphan is reparented),
    not a parent-death signal, which follows the *thread* that started the process (the first
    call's, which may end while the process goes on), nor a pipe's end, which any fork of the
    compiling process would hold open. A process started after ``parent`` ended sees another
    parent on its first look."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="compile-ahead-parent-watch", daemon=True).start()


def main() -> int:
    if len(sys.argv) > 1:
        _exit_with_parent(int(sys.argv[1]))
    spec = pickle.load(sys.stdin.buffer)
    if spec["module"].startswith(_PACKAGE + "."):
        _stand_in_packages()
    compile_spec(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
