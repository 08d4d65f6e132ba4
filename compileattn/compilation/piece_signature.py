"""Which pieces can share compiled code: the same computation on inputs of the same kind.

The pieces between two attention ops of a transformer are one computation (the end of layer i and
the start of layer i+1) on different weights, which Dynamo passes in as graph inputs. An N-layer
model has N + 1 pieces but only three or four distinct ones (first, middle, the last middle one,
last), so compiling each distinct piece once makes a 32-layer cold compile compile 4 pieces
instead of 33 and a warm start load 4. vLLM did the same (PR #34003: "llama-3.1-70b cold
compilation time from 24s to 16s").

Two things make identical pieces print differently, and are taken out:

- Node and placeholder names differ per layer (``l_self_modules_layers_modules_7_...``): the
  signature hashes a canonical rendering instead (nodes numbered in order, targets by qualified
  name, constants by ``repr``).
- With the KV write captured (``passes/kv_write.py``) each piece calls
  ``write_layer_kv(k, v, "model.layers.7.attn")``, a per-layer string the compiled code bakes in.
  ``parametrize_layer_names`` replaces it by a per-piece slot (``compileattn:piece_layer:0``) and
  returns the real names; the dispatcher publishes a piece's names in
  ``context.piece_layer_names`` before it runs the piece, and the op resolves the slot there. Under
  CUDA-graph capture that lookup runs at capture time, once per piece and size, so each captured
  graph holds its own layer's cache addresses.

Two pieces share only if, after that, their canonical code and every input's dtype, device (its
index too: Inductor's code sets and allocates on the GPU it was compiled for), symbolic shape,
stride and storage offset match: the compiled code specialises on all of those. And its type: a
tensor subclass (``__torch_dispatch__``: a quantized weight, say) is compiled through its inner
tensors, so their description and its flatten context count too; a Parameter, and the fake tensor
Dynamo traces a tensor as, are plain tensors to the compiled code.
A piece that text cannot identify shares with no other: one that reads module state
(``get_attr``), holds a tensor constant in an argument (its repr can be truncated), or calls a
lambda or closure (one qualified name for different code). The signature of such a piece is its
own printed code plus its index.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch
import torch.fx

from .. import _torch_compat
from ..context import PIECE_LAYER_PREFIX

#: Modules whose functions a qualified name identifies (no closures, no per-call lambdas).
_NAMED_BY_QUALNAME = ("torch", "_operator", "operator", "math", "builtins", "_functools")
_WRITE_KV = ("compileattn::write_layer_kv",)


class _Ref:
    """A node reference in the canonical text (its repr can never equal a string constant's)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __repr__(self) -> str:
        return f"%{self.i}"


def _target_name(node: torch.fx.Node) -> str | None:
    """The target as text, or None when text cannot tell it apart from another callable."""
    t = node.target
    if isinstance(t, str):
        return t
    names = _torch_compat.op_names(t)
    if names:
        return names[-1]
    module = getattr(t, "__module__", None) or ""
    qualname = getattr(t, "__qualname__", None) or getattr(t, "__name__", None)
    if qualname is None or "<" in qualname or module.split(".")[0] not in _NAMED_BY_QUALNAME:
        return None
    return f"{module}.{qualname}"


def _holds_tensor(value: Any) -> bool:
    found = []
    torch.fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else v)
    return bool(found)


def canonical_code(gm: torch.fx.GraphModule) -> str | None:
    """The graph as text that does not depend on node names: equal for the same computation.
    None when the graph holds something text cannot identify (state, closures, tensor constants)."""
    index: dict[torch.fx.Node, _Ref] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        if node.op in ("get_attr", "call_module"):
            return None
        index[node] = _Ref(i)
        args = torch.fx.node.map_arg(node.args, lambda n: index[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: index[n])
        if _holds_tensor(args) or _holds_tensor(kwargs):
            return None
        target = "" if node.op == "placeholder" else _target_name(node)  # a placeholder's target is its name
        if target is None:
            return None
        lines.append(f"%{i} = {node.op} {target} {args!r} {kwargs!r}")
    return "\n".join(lines)


def _describe(arg: Any) -> str:
    if isinstance(arg, torch.Tensor):
        text = (f"T({_torch_compat.tensor_type_name(arg)},{arg.dtype},{arg.device},{[str(s) for s in arg.shape]},"
                f"{[str(s) for s in arg.stride()]},{arg.storage_offset()},{arg.requires_grad})")
        flat = _torch_compat.tensor_flatten(arg)
        if flat is not None:  # a context whose repr holds an address costs sharing, never shares wrongly
            attrs, ctx = flat
            text += f"[{','.join(f'{a}={_describe(getattr(arg, a))}' for a in attrs)};{ctx!r}]"
        return text
    if isinstance(arg, torch.SymInt):
        return f"S({_torch_compat.symbol_of(arg)})"
    return f"V({type(arg).__name__},{arg!r})"


def piece_signature(module: torch.fx.GraphModule, args: Sequence[Any], index: int) -> str:
    """A hex digest, equal for pieces whose compiled code is interchangeable and stable across
    processes (it names the piece's compile-cache file)."""
    code = canonical_code(module)
    h = hashlib.sha256(code.encode() if code is not None else f"piece {index}\n{module.code}".encode())
    for a in args:
        h.update(_describe(a).encode())
    return h.hexdigest()[:20]


def parametrize_layer_names(module: torch.fx.GraphModule) -> dict[str, str]:
    """Replace the layer-name strings of the piece's KV writes by per-piece slots, in place;
    return {slot: real layer name} (empty if the piece writes no KV)."""
    names: dict[str, str] = {}
    for node in module.graph.nodes:
        if node.op != "call_function" or not any(n in _WRITE_KV for n in _torch_compat.op_names(node.target)):
            continue
        if "layer_name" in node.kwargs and isinstance(node.kwargs["layer_name"], str):
            slot = f"{PIECE_LAYER_PREFIX}{len(names)}"
            names[slot] = node.kwargs["layer_name"]
            node.kwargs = {**node.kwargs, "layer_name": slot}
        elif len(node.args) == 3 and isinstance(node.args[2], str):
            slot = f"{PIECE_LAYER_PREFIX}{len(names)}"
            names[slot] = node.args[2]
            node.args = (*node.args[:2], slot)
    if names:
        module.recompile()
    return names
