"""What a decorated function's compile assumed of its dynamic sizes, checked on every call.

``@compileattn.compile`` runs Dynamo's code with every Dynamo guard skipped, and its argument
check (``argcheck.py``) compares each call with the first one in everything but the dynamic dims.
The trace and the compile may still have assumed something of those: a branch on ``x.shape[0] >
100`` took one side; Inductor chose 32-bit indexing for a kernel whose buffers fit at the traced
size and guarded ``numel <= 2**31 - 1`` (the Llama-3-8B shape's pieces: ``6144*tokens <=
2147483647`` and four more, run S14-3); on the CPU it summed without its accuracy helper up to 4096
terms.
Dynamo would check each guard per call and recompile; a call past one without the check ran the
code anyway (the other branch's answer, or indices that wrap).

So after the compile the decorator reads the guards Dynamo's ShapeEnv holds over the dynamic dims'
symbols (Inductor's among them, and those a compile worker or the compile cache brought,
``piecewise.assume_guards``), and the bounds of their ranges no guard states, as Python
comparisons of the arguments' sizes: ``SizeGuards``, plain data, saved in the warm start file with
the compiled code. ``ArgChecker`` turns them, per call layout, into one generated function (0.2 µs
for the Llama-3-8B shape's five 32-bit-indexing guards on the 2-core CPU box); a call that breaks
one raises ``RecompileError`` naming the argument and the assumption, before any kernel runs. A
symbol Dynamo made for two argument dims (equal on the first call) also checks that they are
still equal.

Not checked: Dynamo's lower bound of every dynamic dim, 2 (it specializes 0 and 1 and traces the
rest as >= 2, with no guard for it). A later call of size 1 runs code traced for sizes >= 2, as
``decorator.py`` allows: right for code that computes the same per row (every model here; vLLM
assumes the same), wrong for code that branches on a size being > 1, which Dynamo decides without
a guard. Keep such branches out of a decorated forward.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
from typing import Any, Callable, Mapping

from .. import _torch_compat
from .size_reads import SizeRead


#: Dynamo's lower bound of a dynamic size (it specializes 0 and 1), not checked (see above).
DYNAMO_MIN_SIZE = 2


def _namespace() -> dict[str, Any]:
    """What torch's PythonPrinter may print beside the symbols and operators (``math.floor``,
    ``torch.sym_float``, ``round``...), and nothing else."""
    functions = {"min": min, "max": max, "abs": abs, "int": int, "float": float, "round": round}
    stand_in = types.SimpleNamespace(sym_float=float, sym_int=int, sym_max=max, sym_min=min, sym_sqrt=math.sqrt,
                                     sym_ite=lambda c, a, b: a if c else b)
    return {"__builtins__": functions, "math": math, "torch": stand_in}


class UncheckableGuard(RuntimeError):
    """A compile assumed something of the sizes the decorator cannot check per call: of a size that
    is not a dynamic argument dim, or in an expression Python cannot evaluate."""


@dataclasses.dataclass(frozen=True)
class SizeGuards:
    """``symbols``: (symbol, argument, read) of each symbol the guards use, its first place in the
    arguments (``read``: a ``SizeRead``, a dim or a stride); ``equal``: (symbol, argument, read) of
    further places Dynamo gave the same symbol; ``guards``: Python expressions over the symbols'
    names, each of which must hold.

    Strides: a non-contiguous argument with a dynamic dim is traced with some strides as symbols
    of their own (a column slice's step, a padded row's length), which Dynamo may share with a size
    of the same value or guard (a padded row's ``Ne(s7, 8)``); the argument check pins the others
    (``argcheck._TensorSpec``), and these places are mapped here like the dims."""

    symbols: tuple[tuple, ...] = ()
    equal: tuple[tuple, ...] = ()
    guards: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.guards or self.equal)

    @classmethod
    def from_shape_env(cls, shape_env, dynamic: Mapping[str, tuple[int, ...]],
                       strided: Mapping[str, int] | None = None) -> "SizeGuards":
        """The guards of ``shape_env`` (Dynamo's, after the compile) over the dims ``dynamic``
        (argument name -> dynamic dims, as ``decorator._mark_dynamic`` marked them) and the
        strides of the arguments ``strided`` (name -> ndim: those whose strides the trace may have
        made symbols), and the bounds of their ranges that no guard states (``torch._check``
        narrows a range alone). Each is evaluated at the first call's sizes here: one that Python
        cannot evaluate, or that is false there, raises ``UncheckableGuard`` now rather than at a
        later call."""
        if shape_env is None:
            return cls()
        wanted = {_torch_compat.dynamo_size_source(name, dim): (name, SizeRead("shape", dim))
                  for name, dims in dynamic.items() for dim in dims}
        wanted.update({_torch_compat.dynamo_stride_source(name, i): (name, SizeRead("stride", i))
                       for name, ndim in (strided or {}).items() for i in range(ndim)})
        dims_of: dict[str, list[tuple[str, Any]]] = {}
        for symbol, sources in _torch_compat.symbol_sources(shape_env).items():
            found = [wanted[s] for s in sources if s in wanted]
            if found:
                dims_of[symbol] = list(dict.fromkeys(found))
        guards, used = [], set()
        for expr in _torch_compat.size_guard_expressions(shape_env):
            names = {str(s) for s in expr.free_symbols}
            if not names:
                continue
            unknown = sorted(names - set(dims_of))
            if unknown:
                raise UncheckableGuard(
                    f"the compile assumed {expr}, of {', '.join(unknown)}, which is not a dynamic dim of an argument "
                    f"(dynamic_arg_dims: {dict(dynamic)}); @compileattn.compile cannot check it per call")
            guards.append(_torch_compat.python_code_of(expr))
            used |= names
        bounds = _torch_compat.symbol_bounds(shape_env)
        for symbol in sorted(dims_of):
            lower, upper = bounds.get(symbol, (None, None))
            if lower is not None and lower > DYNAMO_MIN_SIZE:
                guards.append(f"{lower} <= {symbol}")
                used.add(symbol)
            if upper is not None:
                guards.append(f"{symbol} <= {upper}")
                used.add(symbol)
        used |= {s for s, dims in dims_of.items() if len(dims) > 1}
        symbols = tuple((s, *dims_of[s][0]) for s in sorted(used))
        equal = tuple((s, *d) for s in sorted(used) for d in dims_of[s][1:])
        made = cls(symbols, equal, tuple(dict.fromkeys(guards)))
        hints = {str(k): int(v) for k, v in _torch_compat.size_hints(shape_env).items()}
        for guard in made.guards:
            try:
                holds = _holds(guard, {s: hints[s] for s, _, _ in symbols})
            except Exception as exc:  # noqa: BLE001
                raise UncheckableGuard(f"the compile assumed {guard}, which Python cannot evaluate per call "
                                       f"({type(exc).__name__}: {exc})") from None
            if not holds:
                raise UncheckableGuard(f"the compile assumed {guard}, which is false at the first call's sizes")
        return made

    def checker(self, sources: Mapping[str, int | str], defaults: Mapping[str, Any]) -> Callable[[tuple, dict], bool]:
        """A function of (args, kwargs) of one call layout, true when every guard holds.
        ``sources``: argument name -> its position in args or key in kwargs in this layout;
        ``defaults``: the values of arguments this layout leaves at their default."""
        def value_of(name: str) -> str:
            src = sources.get(name)
            if src is None:
                return f"d[{name!r}]"
            return f"a[{src}]" if isinstance(src, int) else f"k[{src!r}]"

        lines = [f"    {symbol} = {read.code(value_of(name))}" for symbol, name, read in self.symbols]
        conditions = [f"({g})" for g in self.guards]
        conditions += [f"({symbol} == {read.code(value_of(name))})" for symbol, name, read in self.equal]
        code = "def check(a, k):\n" + "\n".join(lines) + f"\n    return {' and '.join(conditions) or 'True'}\n"
        namespace: dict[str, Any] = {"d": dict(defaults), **_namespace()}
        exec(compile(code, "<compileattn size guards>", "exec"), namespace)  # noqa: S102 (our own comparisons)
        return namespace["check"]

    def explain(self, argument: Callable[[str], Any]) -> tuple[str, str]:
        """(the first argument a broken guard names, what it assumed), given ``argument(name)``,
        the call's value of each argument a symbol is read from."""
        values = {symbol: read.value(argument(name)) for symbol, name, read in self.symbols}
        spelled = {symbol: read.spelled(name) for symbol, name, read in self.symbols}
        for guard in self.guards:
            if not _holds(guard, values):
                names = [s for s in values if _mentions(guard, s)]
                readable = guard
                for s in sorted(names, key=len, reverse=True):
                    readable = _replace_symbol(readable, s, spelled[s])
                shown = ", ".join(f"{spelled[s]} = {values[s]}" for s in names)
                first = next(name for symbol, name, _ in self.symbols if symbol in names) if names else None
                return first, (f"has {shown}, but the compiled code assumes {readable} (a guard of the first "
                               f"call's trace or compile)")
        for symbol, name, read in self.equal:
            value = read.value(argument(name))
            if values[symbol] != value:
                return name, (f"has {read.spelled(name)} = {value}, but the compiled code assumes it "
                              f"equals {spelled[symbol]} ({values[symbol]}), as on the first call")
        return None, "a size guard failed"


def _holds(guard: str, values: Mapping[str, int]) -> bool:
    """``guard`` evaluated at the symbols' ``values`` (what the generated check does per call)."""
    return bool(eval(guard, _namespace(), dict(values)))  # noqa: S307 (our own comparisons)


def _mentions(code: str, symbol: str) -> bool:
    return re.search(rf"\b{re.escape(symbol)}\b", code) is not None


def _replace_symbol(code: str, symbol: str, text: str) -> str:
    return re.sub(rf"\b{re.escape(symbol)}\b", text, code)
