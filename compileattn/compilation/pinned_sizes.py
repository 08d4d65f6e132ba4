"""The graph inputs' dynamic sizes other than the step's token count, pinned at the compile's.

CUDA graphs and static-shape pieces are keyed by the step's token count alone. A graph whose
inputs carry another dynamic size (a second ``dynamic_arg_dims`` entry, a sequence length beside
the batch, a buffer size Dynamo lifted as a symbol) would otherwise replay the graph captured at
that token count with the other size it was captured with (a wrong answer once the graph's first
replay has checked its inputs: later replays read the captured shapes), or run a static piece
compiled for the compile's other sizes (Inductor's ``assert_size_stride`` fails). So the
dispatcher uses graphs and static pieces only for calls whose other sizes equal those of the call
that was compiled (the first call of the compiling process, also after a warm start: its static
pieces were compiled for them); every other call runs the dynamic-shape pieces without graphs.
Serving steps vary only in the token count, so they keep their graphs.

A symbol no input carries as a plain size, stride, storage offset or integer input (it appears
only inside an expression, such as a stride ``2*s1``, or is a float) cannot be read back from a
call's inputs: such a graph gets neither graphs nor static pieces.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .. import _torch_compat
from .size_reads import SizeRead


@dataclass(frozen=True)
class PinnedSizes:
    """Each other dynamic size as (input index, where the input carries it, the compiled call's
    value, the input's name); ``unreadable``: symbols no input carries where a call can be read."""

    sizes: tuple[tuple[int, SizeRead, int, str], ...] = ()
    unreadable: tuple[str, ...] = ()

    @property
    def keyed_by_token_count(self) -> bool:
        """Whether graphs and static pieces can be keyed by the token count at all."""
        return not self.unreadable

    @property
    def values(self) -> tuple[int, ...]:
        return tuple(v for _, _, v, _ in self.sizes)

    def checker(self) -> Callable[[Sequence[Any]], bool] | None:
        """``check(args)``: whether a call's other sizes are the pinned ones; None when there are
        none to check (every call qualifies, at no cost)."""
        if self.unreadable:
            return lambda args: False
        if not self.sizes:
            return None
        terms = [f"{read.code(f'args[{i}]')} == {v}" for i, read, v, _ in self.sizes]
        return eval(f"lambda args: {' and '.join(terms)}")  # noqa: S307 (built from ints only)

    def describe(self, args: Sequence[Any] | None = None) -> str:
        """The pinned sizes (with a call's own values, given its ``args``), for a log line."""
        if self.unreadable:
            return f"symbols {', '.join(self.unreadable)} appear in no input where a call can be read"
        parts = []
        for i, read, v, name in self.sizes:
            now = "" if args is None else f" (this call: {read.value(args[i])})"
            parts.append(f"{read.spelled(name)} = {v}{now}")
        return ", ".join(parts)


def pin_other_sizes(fake_args: Sequence[Any], names: Sequence[str], token_symbol) -> PinnedSizes:
    """The dynamic sizes of ``fake_args`` (Dynamo's inputs, with symbolic sizes) other than
    ``token_symbol``, at their hints (the compiled call's values, which ``compile_pool``'s static
    input specs take too), with where a call carries each: a tensor's dim, stride or storage
    offset, or an integer input, that is exactly the symbol."""
    found: dict[Any, tuple[int, SizeRead, int, str]] = {}
    seen: set = set()

    def note(size, index: int, read: SizeRead) -> None:
        if isinstance(size, torch.SymFloat):
            seen.update(_torch_compat.symbol_of(size).free_symbols)  # never read back: unreadable
            return
        if not isinstance(size, torch.SymInt):
            return
        expr = _torch_compat.symbol_of(size)
        seen.update(expr.free_symbols)
        if expr.is_Symbol and expr not in found:
            found[expr] = (index, read, _torch_compat.symbolic_size_value(size, None, 0), names[index])

    # shapes first, then strides and offsets, then integer inputs: the clearest name for a symbol
    tensors = [(i, a) for i, a in enumerate(fake_args) if isinstance(a, torch.Tensor)]
    for i, a in tensors:
        for d, size in enumerate(a.shape):
            note(size, i, SizeRead("shape", d))
    for i, a in tensors:
        for d, stride in enumerate(a.stride()):
            note(stride, i, SizeRead("stride", d))
        note(a.storage_offset(), i, SizeRead("offset"))
    for i, a in enumerate(fake_args):
        if not isinstance(a, torch.Tensor):
            note(a, i, SizeRead("value"))
    seen.discard(token_symbol)
    found.pop(token_symbol, None)
    unreadable = tuple(sorted(str(s) for s in seen - set(found)))
    return PinnedSizes(tuple(found[s] for s in sorted(found, key=str)), unreadable)
