"""Clean-up: drop dead nodes before splitting.

Dynamo keeps the results of symbolic shape comparisons that the model code evaluated for its own
checks (``s77 == s77`` / ``not_``); they are pure and unused, and left in place they would add
SymInt traffic across piece boundaries.

This is a hand-written DCE rather than ``Graph.eliminate_dead_code()``: in torch 2.11 that treats a
call of an OpOverloadPacket (how Dynamo records custom ops) as pure, so it deleted the attention
op (it returns nothing; its effect is the write into ``output``). Here a node with a mutable schema
is never removed, whatever torch version decides about packets, nor a torch function that writes
in place (``torch.relu_(h)``, ``F.relu(h, inplace=True)``, ``torch.add(h, 1, out=h)``), whose
result Dynamo's later code does not read (it reads ``h``) and which FX does not count impure, nor
the entry into and exit from ``torch.inference_mode()`` (the exit's result is unused, and FX's
impure list has ``_set_grad_enabled`` but not these): dropped, the region ran outside inference
mode and its results recorded autograd.
"""
from __future__ import annotations

import torch.fx

from .._torch_compat import op_schemas, switches_inference_mode
from .split import writes_in_place


def _has_side_effects(node: torch.fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return True  # placeholders, outputs, get_attr and call_module are left alone
    if any(schema.is_mutable for schema in op_schemas(node.target)) or writes_in_place(node):
        return True  # torch.relu_(h), torch.add(h, 1, out=h): Dynamo's later code reads h, not the result
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")  # in-place: add_, copy_, ...
    return node.is_impure() or switches_inference_mode(node.target)


def cleanup(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and not _has_side_effects(node):
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm
