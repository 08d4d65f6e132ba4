"""The graph inputs' dynamic sizes other than the step's token count, pinned at the first call's.

CUDA graphs and static-shape pieces are keyed by the step's token count alone. A graph whose
inputs carry another dynamic size (a second ``dynamic_arg_dims`` entry, a sequence length beside
the batch, a buffer size Dynamo lifted as a symbol) would otherwise replay the graph captured at
that token count with the other size it was captured with (a wrong answer: the replay reads the
captured shapes), or run a static piece compiled for the first call's other sizes (Inductor's
``assert_size_stride`` fails). So the dispatcher uses graphs and static pieces only for calls
whose other sizes equal the first call's, which the static pieces were compiled for; every other
call runs the dynamic-shape pieces without graphs. Serving steps vary only in the token count,
so they keep their graphs.

A symbol that no input carries as a plain size or stride (it appears only inside an expression,
such as a stride ``2*s1``) cannot be read back from a call's inputs: such a graph gets neither
graphs nor static pieces.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .. import _torch_compat

logger = logging.getLogger("compileattn")


#: how a call's input carries a size: its shape, its strides, or the input is the size itself
_READ = {"shape": "args[{i}].shape[{d}]", "stride": "args[{i}].stride({d})", "value": "args[{i}]"}


@dataclass(frozen=True)
class PinnedSizes:
    """Each other dynamic size as (input index, "shape" / "stride" / "value", dim, the first
    call's value, the input's name); ``unreadable``: symbols no input carries as a plain size."""

    sizes: tuple[tuple[int, str, int, int, str], ...] = ()
    unreadable: tuple[str, ...] = ()

    @property
    def keyed_by_token_count(self) -> bool:
        """Whether graphs and static pieces can be keyed by the token count at all."""
        return not self.unreadable

    def checker(self) -> Callable[[Sequence[Any]], bool] | None:
        """``check(args)``: whether a call's other sizes are the pinned ones; None when there are
        none to check (every call qualifies, at no cost)."""
        if self.unreadable:
            return lambda args: False
        if not self.sizes:
            return None
        terms = [f"{_READ[kind].format(i=i, d=d)} == {v}" for i, kind, d, v, _ in self.sizes]
        return eval(f"lambda args: {' and '.join(terms)}")  # noqa: S307 (built from ints only)

    def describe(self, args: Sequence[Any] | None = None) -> str:
        """The pinned sizes (with a call's own values, given its ``args``), for a log line."""
        if self.unreadable:
            return f"symbols {', '.join(self.unreadable)} appear in no input as a plain size"
        parts = []
        for i, kind, d, v, name in self.sizes:
            read = _READ[kind].format(i=i, d=d)
            now = "" if args is None else f" (this call: {eval(read, {'args': args})})"  # noqa: S307
            parts.append(f"{read.replace(f'args[{i}]', name)} = {v}{now}")
        return ", ".join(parts)


def pin_other_sizes(fake_args: Sequence[Any], names: Sequence[str], token_symbol) -> PinnedSizes:
    """The dynamic sizes of ``fake_args`` (Dynamo's inputs, with symbolic sizes) other than
    ``token_symbol``, at their hints (the first call's values), with where a call carries each:
    a tensor's dim or stride, or a SymInt input, that is exactly the symbol."""
    found: dict[Any, tuple[int, str, int, int, str]] = {}
    seen: set = set()

    def note(size, index: int, kind: str, dim: int) -> None:
        if not isinstance(size, torch.SymInt):
            return
        expr = _torch_compat.symbol_of(size)
        seen.update(expr.free_symbols)
        if expr.is_Symbol and expr not in found:
            found[expr] = (index, kind, dim, _torch_compat.symbolic_size_value(size, None, 0), names[index])

    # shapes first, then strides, then SymInt inputs: the clearest place to name a symbol
    for kind in ("shape", "stride"):
        for i, a in enumerate(fake_args):
            if isinstance(a, torch.Tensor):
                for d, size in enumerate(a.shape if kind == "shape" else a.stride()):
                    note(size, i, kind, d)
    for i, a in enumerate(fake_args):
        if not isinstance(a, torch.Tensor):
            note(a, i, "value", 0)
    seen.discard(token_symbol)
    found.pop(token_symbol, None)
    unreadable = tuple(sorted(str(s) for s in seen - set(found)))
    pinned = PinnedSizes(tuple(found[s] for s in sorted(found, key=str)), unreadable)
    if pinned.sizes or pinned.unreadable:
        logger.info("compileattn: CUDA graphs and static pieces serve calls whose other dynamic sizes are the first "
                    "call's: %s", pinned.describe())
    return pinned
