"""The compile cache: compiled pieces saved to disk and loaded by a later process.

The key covers everything that changes the compiled result: the CompileConfig hash (its
compile-affecting fields only: kernel choice and CUDA-graph settings are run-time), the Dynamo
graph's code (which changes with the model), the contents of every source file the graph was
traced from (found through the nodes' stack traces), the torch version and the environment
variables that steer Inductor or compileattn. Dynamo still traces in the second process (its
bytecode transform is not cached); what is skipped is the piece compile, which dominates.
Pieces are Inductor ``standalone_compile`` artifacts, so only ``piece_compiler="inductor"`` caches.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx

from .. import _torch_compat
from ..config import CompileConfig

logger = logging.getLogger("compileattn")

_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE", "COMPILEATTN_", "TRITON_INTERPRET")
_FILE_RE = re.compile(r'File "([^"]+)", line \d+')


def traced_source_files(gm: torch.fx.GraphModule) -> list[str]:
    files = set()
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace") or ""
        files.update(_FILE_RE.findall(trace))
    return sorted(f for f in files if os.path.isfile(f))


def cache_key(config: CompileConfig, gm: torch.fx.GraphModule) -> str:
    h = hashlib.sha256()
    h.update(config.hash().encode())
    h.update(torch.__version__.encode())
    h.update(gm.code.encode())
    for name in sorted(os.environ):
        if name.startswith(_ENV_PREFIXES):
            h.update(f"{name}={os.environ[name]}".encode())
    for path in traced_source_files(gm):
        h.update(path.encode())
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:24]


class CompileCache:
    """One directory per key; one artifact per piece, named by index and the piece's code hash."""

    def __init__(self, root: str | os.PathLike, key: str):
        self.dir = Path(root) / key
        self.key = key

    def _path(self, index: int, piece: torch.fx.GraphModule, size: int | None) -> Path:
        digest = hashlib.sha256(piece.code.encode()).hexdigest()[:12]
        shape = "dynamic" if size is None else f"static{size}"
        return self.dir / f"piece_{index}_{shape}_{digest}.bin"

    def load(self, index: int, piece: torch.fx.GraphModule, size: int | None = None) -> Callable[..., Any] | None:
        path = self._path(index, piece, size)
        if not path.exists():
            return None
        try:
            return _torch_compat.load_compiled_artifact(str(path))
        except Exception as exc:  # a corrupt or incompatible entry is a miss, not a crash
            logger.warning("compile cache entry %s unusable (%s); recompiling", path, exc)
            return None

    def save(self, index: int, piece: torch.fx.GraphModule, artifact: Any, size: int | None = None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self._path(index, piece, size)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        artifact.save(path=str(tmp), format="binary")
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
