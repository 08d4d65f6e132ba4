"""What a compiled function reaches besides its arguments: the models among its arguments, its
closure and the module globals its code reads (``modules_in``, ``global_modules``), where it looks a
model up at each call (``model_bindings``), the tensors it reaches there (``tensors_reached``),
which of its tensor arguments the first call also held there (``held_elsewhere``) and which other
tensors a written argument must not come to share memory with (``other_tensors``). Dynamo's trace
reads all of these; the decorator skips the guards that would have watched them, so it finds them
once, at the first call, and checks what they hold per call (``model_tensors.py``,
``argcheck.ArgChecker``).
"""
from __future__ import annotations

import dis
import functools
import types
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from .argcheck import _VALUE_TYPES, _is_mapping, _is_sequence, leaves, value_at


def modules_in(values: Iterable[Any], depth: int = 2) -> Iterator[torch.nn.Module]:
    """The modules among ``values``, inside the containers the argument check walks too (the
    trace bakes in a module found there alike), and those held by what is not a module, ``depth``
    holders deep: a plain object's attributes (``self.model`` of a runner class whose method is
    decorated), a bound method's instance (a closed-over ``model.forward``), a function's closure
    (a helper closing over the model), a ``functools.partial``'s function and arguments. Dynamo
    reads through each of them alike; found nowhere, such a model was neither watched nor keyed.
    A module is not walked into (its submodules are its own). One such a holder has but the trace
    never reads is watched and keyed too: converting it after the first call is refused."""
    seen: set[int] = set()

    def walk(v: Any, left: int) -> Iterator[torch.nn.Module]:
        for _, leaf in leaves(v):
            if isinstance(leaf, torch.nn.Module):
                yield leaf
            elif left > 0 and id(leaf) not in seen:
                seen.add(id(leaf))
                for held in _held_by(leaf):
                    yield from walk(held, left - 1)

    for v in values:
        yield from walk(v, depth)


def _held_by(v: Any) -> list:
    """What a bound method, function, partial or plain object holds (``modules_in``); nothing for
    tensors, plain values, classes and Python modules."""
    if isinstance(v, (torch.Tensor, type, types.ModuleType, *_VALUE_TYPES)):
        return []
    if isinstance(v, types.MethodType):
        return [v.__self__, v.__func__]
    if isinstance(v, types.FunctionType):
        return closure_values(v)
    if isinstance(v, functools.partial):
        return [v.func, v.args, v.keywords]
    try:  # an object's __getattr__ / __dict__ may raise anything (a lazy proxy)
        attributes = vars(v)
    except Exception:  # noqa: BLE001
        return []
    return list(attributes.values()) if isinstance(attributes, dict) else []


def cell_filled(cell) -> bool:
    """Whether a closure cell holds a value (empty: a name the enclosing function binds later)."""
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def closure_values(fn: Any) -> list[Any]:
    """What ``fn`` closes over: its filled closure cells' contents."""
    return [cell.cell_contents for cell in getattr(fn, "__closure__", None) or () if cell_filled(cell)]


def global_modules(fn: Any, depth: int = 2) -> list[torch.nn.Module]:
    """The modules among the module globals ``fn``'s code loads (``LOAD_GLOBAL``, in nested
    functions' and comprehensions' code too), and those of the functions among them, ``depth``
    calls deep: where a script's model lives (``model = Llama(...)`` beside ``@compileattn.compile
    def step(ids): return model(ids)``). Attribute names (``self.model``) are not globals; globals
    are not walked into (a module's containers can be large, or hold themselves)."""
    return [v for _, _, v in globals_read(fn, depth) if isinstance(v, torch.nn.Module)]


def globals_read(fn: Any, depth: int = 2) -> list[tuple[dict, str, Any]]:
    """(the globals dict, the name, the value) of each distinct value among the module globals
    ``fn``'s code loads, and the functions among them, ``depth`` calls deep (``global_modules``)."""
    found: dict[int, tuple[dict, str, Any]] = {}
    seen: set[int] = set()
    todo = [(fn, depth)]
    while todo:
        f, left = todo.pop()
        try:  # an object's __getattr__ may raise anything (a lazy proxy)
            code, scope = getattr(f, "__code__", None), getattr(f, "__globals__", None)
        except Exception:  # noqa: BLE001
            continue
        if not isinstance(code, types.CodeType) or not isinstance(scope, dict) or id(f) in seen:
            continue
        seen.add(id(f))
        codes = [code]
        while codes:
            c = codes.pop()
            codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
            for ins in dis.get_instructions(c):
                if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in scope:
                    value = scope[ins.argval]
                    if id(value) in found:
                        continue
                    found[id(value)] = (scope, ins.argval, value)
                    if left > 0 and isinstance(value, (types.FunctionType, types.MethodType)):
                        todo.append((value, left - 1))
    return list(found.values())


def model_bindings(fn: Any, instance: tuple = ()) -> list[tuple[str, Callable[[], Any], torch.nn.Module]]:
    """Where Dynamo's code looks a model up again at every call, so that another model put there
    after the first call is the one it runs (with code traced for the first): a closure variable
    of ``fn``, an attribute of the instance of a decorated method when it is not a module (a
    runner's ``self.model``; a module's attribute replaced registers, ``module_watch.py``). Each as
    (its name, a function reading what it holds now, the model it held at the first call). Not:
    module globals (the compiled code keeps the first call's model: frozen, as the README says of
    globals), objects among the other arguments (checked for type only: each call may pass
    another), closure variables of other functions."""
    found: list[tuple[str, Callable[[], Any], torch.nn.Module]] = []
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, getattr(fn, "__closure__", None) or ()):
        if cell_filled(cell) and isinstance(cell.cell_contents, torch.nn.Module):
            found.append((f"closure variable {name!r}", functools.partial(_cell_path, cell, ()), cell.cell_contents))
    for obj in instance:
        if isinstance(obj, torch.nn.Module):
            continue
        try:
            attributes, ref = vars(obj), weakref.ref(obj)
        except TypeError:  # no __dict__, or no weak references: not followed
            continue
        for name, value in attributes.items():
            if isinstance(value, torch.nn.Module):
                found.append((f"{type(obj).__qualname__}'s attribute {name!r}",
                              functools.partial(_attribute_path, ref, (name,)), value))
    return found


def tensors_reached(models: Iterable[torch.nn.Module], fn: Any, instance: tuple = ()
                    ) -> Iterator[tuple[torch.Tensor, str, Callable[[], Any], bool]]:
    """(the tensor, where it is, a function reading what is there now, whether it is a parameter or
    buffer) of every tensor the first call reaches outside its arguments, where Dynamo's trace may
    read it: a parameter, buffer or plain attribute (inside its lists and dicts) of a module of
    ``models`` (``modules_in``: the instance, modules among the arguments, closure and globals), a
    closure variable of ``fn``, a module global its code reads (``globals_read``), an attribute of
    a decorated method's instance."""
    def module_name(model: torch.nn.Module, prefix: str) -> Callable[[tuple], str]:
        def name(path: tuple) -> str:
            kind = {"_parameters": "parameter", "_buffers": "buffer"}.get(path[0])
            shown = f"{prefix}{path[1]}{_keys(path[2:])}" if kind else f"{prefix}{path[0]}{_keys(path[1:])}"
            return f"{type(model).__qualname__}'s {kind or 'attribute'} {shown!r}"
        return name

    def found(path_leaves: Iterable[tuple[tuple, Any]], name: Callable[[tuple], str],
              read: Callable[[tuple], Callable[[], Any]], in_module: bool = False):
        for path, leaf in path_leaves:
            if isinstance(leaf, torch.Tensor):
                yield leaf, name(path), read(path), in_module and path[0] in ("_parameters", "_buffers")

    for model in models:
        for prefix, module in model.named_modules():
            ref = weakref.ref(module)
            attributes = {k: v for k, v in vars(module).items() if k != "_modules"}
            yield from found(leaves(attributes), module_name(model, f"{prefix}." if prefix else ""),
                             lambda path, ref=ref: functools.partial(_attribute_path, ref, path), in_module=True)
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, getattr(fn, "__closure__", None) or ()):
        if cell_filled(cell):
            yield from found(leaves(cell.cell_contents),
                             lambda path, name=name: f"closure variable {name!r}{_keys(path)}",
                             lambda path, cell=cell: functools.partial(_cell_path, cell, path))
    for scope, name, value in globals_read(fn):
        yield from found(leaves(value), lambda path, name=name: f"global {name!r}{_keys(path)}",
                         lambda path, scope=scope, name=name: functools.partial(_global_path, scope, name, path))
    for obj in instance:
        if isinstance(obj, torch.nn.Module):
            continue  # among ``models``
        try:
            attributes, ref = vars(obj), weakref.ref(obj)
        except TypeError:  # no __dict__, or no weak references: not followed
            continue
        yield from found(leaves(attributes), lambda path, cls=type(obj): f"{cls.__qualname__}'s attribute "
                                                                         f"{path[0]!r}{_keys(path[1:])}",
                         lambda path, ref=ref: functools.partial(_attribute_path, ref, path))


def held_elsewhere(values: Mapping[str, Any], places: tuple[tuple[tuple, ...], ...],
                   reached: Iterable[tuple[torch.Tensor, str, Callable[[], Any], bool]]
                   ) -> tuple[tuple[tuple, str, Callable[[], Any]], ...]:
    """(its first place, where else, a function reading what is there now) of each tensor of the
    arguments (``values``; ``places``: ``tensor_places``) that the first call also holds outside
    them (``reached``: ``tensors_reached``). Dynamo traces one tensor met in two places as one
    graph input, which the compiled code reads from one of them for both (``ArgChecker.check``: a
    later call must pass what is held there then). Looked for once, at the first call; per call
    nothing where none was found, else one identity per such argument."""
    firsts = [(group[0], value_at(values, group[0])) for group in places]
    wanted = {id(t) for _, t in firsts}
    found: dict[int, tuple[str, Callable[[], Any]]] = {}
    for t, where, read, _ in reached:
        if id(t) in wanted and id(t) not in found:
            found[id(t)] = (where, read)
    return tuple((place, *found[id(t)]) for place, t in firsts if id(t) in found)


def other_tensors(reached: Iterable[tuple[torch.Tensor, str, Callable[[], Any], bool]]
                  ) -> tuple[tuple[str, Callable[[], Any]], ...]:
    """(where, a function reading what is there now) of each tensor of ``reached`` that is not a
    model's parameter or buffer (those are ``ModelTensors.storages``): a global, a closure
    variable, a plain tensor attribute. Read again at each check, since rebinding one registers
    nothing."""
    reached = list(reached)
    seen = {id(t) for t, _, _, is_model_tensor in reached if is_model_tensor}  # an attribute naming a buffer
    out = []
    for t, where, read, is_model_tensor in reached:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((where, read))
    return tuple(out)


def reads_a_global_name(read: Callable[[], Any]) -> bool:
    """Whether ``read`` (of ``other_tensors``) reads a module global itself, not an item of one:
    Dynamo's ahead-of-time code, saved or not, runs with its own copy of the module globals
    (``forward_callable`` in ``torch._dynamo``), so it keeps reading the first call's tensor after
    the name is rebound (an item of a global list or dict it reads through the shared container)."""
    return isinstance(read, functools.partial) and read.func is _global_path and read.args[2] == ()


def _keys(path: tuple) -> str:
    return "".join(f"[{key!r}]" for key in path)


def _attribute_path(ref: weakref.ref, path: tuple) -> Any:
    """What an object (held weakly) holds now at ``path`` (an attribute, then container keys); None
    where it holds nothing there."""
    try:
        return value_at(vars(ref())[path[0]], path[1:])
    except (KeyError, IndexError, TypeError):
        return None


def _cell_path(cell, path: tuple) -> Any:
    """What a closure cell holds now at ``path``; None where it holds nothing there (emptied by
    ``del``, or another structure)."""
    try:
        return value_at(cell.cell_contents, path)
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def _global_path(scope: dict, name: str, path: tuple) -> Any:
    try:
        return value_at(scope[name], path)
    except (KeyError, IndexError, TypeError):
        return None
