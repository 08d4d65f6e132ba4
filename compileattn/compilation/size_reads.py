"""Where a call's input carries a dynamic size: a tensor's dim, stride or storage offset, or an
integer input that is the size itself.

Two places read sizes back from a call: the decorator's per-call size guards (``size_guards.py``,
over the named arguments) and the sizes a graph's static pieces and CUDA graphs were pinned at
(``pinned_sizes.py``, over the graph's inputs). Both generate Python source from a ``SizeRead``
once (``code``) and evaluate it per call, and name it in messages (``spelled``); both persist it
(warm-start files, compiled artifacts), so it is plain data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["shape", "stride", "offset", "value"]
_KINDS = ("shape", "stride", "offset", "value")


@dataclass(frozen=True)
class SizeRead:
    kind: Kind
    #: the dim of a shape or stride read (0 for the others)
    dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"SizeRead kind must be one of {_KINDS}, got {self.kind!r}")

    def code(self, expr: str) -> str:
        """Python source reading the size from what the source ``expr`` evaluates to."""
        if self.kind == "shape":
            return f"{expr}.shape[{self.dim}]"
        if self.kind == "stride":
            return f"{expr}.stride({self.dim})"
        if self.kind == "offset":
            return f"{expr}.storage_offset()"
        return expr

    def spelled(self, name: str) -> str:
        """How a message names the size on the input called ``name``."""
        return f"{name}.size({self.dim})" if self.kind == "shape" else self.code(name)

    def value(self, obj: Any) -> int:
        """The size on a call's input."""
        if self.kind == "shape":
            return obj.shape[self.dim]
        if self.kind == "stride":
            return obj.stride(self.dim)
        if self.kind == "offset":
            return obj.storage_offset()
        return obj
