"""Every private torch API compileattn uses, behind one door.

torch keeps no promise about underscore names, so each one is reached only through this module,
with the torch versions it was checked on and a clear error if a torch version lacks it. The
project supports torch 2.11-2.13 (``pyproject.toml``);
``tests/test_house.py::test_private_torch_apis_resolve`` resolves every entry of ``PRIVATE_APIS``
on the torch it runs with, so a torch upgrade that moves one fails there, by name, rather than
deep inside a compile.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

#: Checked on: 2.11 (the GPU machine's 2.11.0+cu130), 2.12 (source of the release branch), 2.13
#: (the CPU machines' 2.13.0+cpu). "dotted.path": what compileattn uses it for.
PRIVATE_APIS = {
    "torch._dynamo.backends.registry._BACKENDS": "is the backend name registered yet (a PYTHONPATH checkout "
                                                 "has no entry point)",
    "torch._dynamo.convert_frame.register_bytecode_hook": "the decorator reads the code Dynamo generated",
    "torch._dynamo.eval_frame._debug_get_cache_entry_list": "the decorator keeps Dynamo's code objects alive",
    "torch._dynamo.backends.debugging.aot_eager": "piece_compiler='aot_eager'",
    "torch._dynamo.mark_dynamic": "marking the token dim of a step's inputs dynamic (documented, but private)",
    "torch._dynamo.lookup_backend": "@compileattn.compile(backend='inductor') and the like",
    "torch._dynamo.register_backend": "registering the name \"compileattn\" on import",
    "torch._inductor.standalone_compile": "compiling one piece with Inductor outside Dynamo",
    "torch._inductor.CompiledArtifact": "saving and loading compiled pieces (the compile cache)",
    "torch._guards.detect_fake_mode": "the fake mode of the graph's example inputs",
    "torch._subclasses.fake_tensor.unset_fake_temporarily": "compiling a piece for static shapes",
    "torch._subclasses.fake_tensor.FakeTensorMode": "fake inputs with every size fixed",
    "torch._ops.OpOverload": "matching splitting ops in FX graphs",
    "torch._ops.OpOverloadPacket": "matching splitting ops in FX graphs (Dynamo records packets)",
    "torch._C._AutoDispatchBelowAutograd": "the inference-only ops' Autograd kernel redispatches below it",
    "torch._C._len_torch_dispatch_stack": "whether a dispatch mode is active (then the Autograd kernel redispatches)",
}


def resolve(dotted: str) -> Any:
    """The object at ``dotted``; ImportError naming it if missing. An attribute wins over a
    submodule of the same name (``torch._inductor.standalone_compile`` is both)."""
    obj = _RESOLVED.get(dotted)
    if obj is not None:
        return obj
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except (ImportError, AttributeError):
            continue
        _RESOLVED[dotted] = obj
        return obj
    raise ImportError(f"torch {torch.__version__} has no {dotted} ({PRIVATE_APIS.get(dotted, 'private API')}); "
                      f"compileattn supports torch 2.11-2.13")


_RESOLVED: dict[str, Any] = {}


def registered_backends() -> dict:
    return resolve("torch._dynamo.backends.registry._BACKENDS")


def register_bytecode_hook(hook: Callable):
    return resolve("torch._dynamo.convert_frame.register_bytecode_hook")(hook)


def cache_entry_codes(code) -> list:
    """Code objects of Dynamo's cache entries for ``code`` ([] if this torch cannot say)."""
    try:
        get = resolve("torch._dynamo.eval_frame._debug_get_cache_entry_list")
    except ImportError:
        return []
    return [entry.code for entry in get(code)]


def mark_dynamic(tensor, dims) -> None:
    resolve("torch._dynamo.mark_dynamic")(tensor, dims)


def lookup_backend(name: str):
    return resolve("torch._dynamo.lookup_backend")(name)


def aot_eager(gm, example_inputs):
    return resolve("torch._dynamo.backends.debugging.aot_eager")(gm, example_inputs)


def standalone_compile(gm, example_inputs, dynamic_shapes: str, options: dict):
    """Inductor on one FX graph: ``dynamic_shapes`` is "from_tracing_context" (the shapes Dynamo
    traced, symbols included) or "from_example_inputs" (every size as given)."""
    return resolve("torch._inductor.standalone_compile")(gm, example_inputs, dynamic_shapes=dynamic_shapes,
                                                         options=options)


def load_compiled_artifact(path: str):
    return resolve("torch._inductor.CompiledArtifact").load(path=path, format="binary")


def detect_fake_mode(example_inputs):
    return resolve("torch._guards.detect_fake_mode")(example_inputs)


def unset_fake_temporarily():
    return resolve("torch._subclasses.fake_tensor.unset_fake_temporarily")()


def static_fake_mode():
    """A FakeTensorMode without a ShapeEnv: tensors made in it have plain int sizes."""
    return resolve("torch._subclasses.fake_tensor.FakeTensorMode")()



def op_names(target) -> tuple[str, ...]:
    """Names a call_function target answers to: ("ns::op",) for a packet, plus "ns::op.overload"."""
    if isinstance(target, resolve("torch._ops.OpOverloadPacket")):
        return (target._qualified_op_name,)
    if isinstance(target, resolve("torch._ops.OpOverload")):
        packet = target.overloadpacket._qualified_op_name
        return (packet, f"{packet}.{target._overloadname}")
    return ()


def op_schemas(target) -> list:
    """The schemas of an op target (every overload of a packet)."""
    if isinstance(target, resolve("torch._ops.OpOverloadPacket")):
        return [getattr(target, name)._schema for name in target.overloads()]
    if isinstance(target, resolve("torch._ops.OpOverload")):
        return [target._schema]
    return []


def call_schema(target):
    """The schema of the overload a call of ``target`` runs (a packet's ``default``), or None for a
    target that is not an op. Dynamo records packets, AOT graphs record overloads."""
    if isinstance(target, resolve("torch._ops.OpOverloadPacket")):
        target = target.default
    return target._schema if isinstance(target, resolve("torch._ops.OpOverload")) else None


def below_autograd_guard() -> type:
    """The guard class whose instances, used as context managers, dispatch below Autograd."""
    return resolve("torch._C._AutoDispatchBelowAutograd")


def symbolic_size_value(size, symbol, value: int) -> int:
    """``size`` (an int or a SymInt) with ``symbol`` set to ``value`` and other symbols at their hints."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    import sympy

    expr = sympy.sympify(size.node.expr)
    values = {s: sympy.Integer(value if s == symbol else size.node.shape_env.size_hint(s))
              for s in expr.free_symbols}
    return int(expr.xreplace(values))


def symbol_of(size):
    """The sympy expression of a SymInt size."""
    return size.node.expr
