"""Split an FX graph at the splitting ops (by default compileattn's unified attention op).

Dynamo records a custom op call as the OpOverloadPacket (``torch.ops.compileattn.attention``)
while AOT/Inductor graphs hold the overload (``.default``): both are matched, by name, so a
user's own op "ns::op" or "ns::op.overload" can be a splitting op too.
The pieces between splitting ops keep the original node order (``keep_original_order``), which
matters because the attention op mutates its ``output`` argument: a reorder could read it early.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Sequence

import torch.fx
from torch.fx.passes.split_module import split_module

from .._torch_compat import op_names


def is_splitting_node(node: torch.fx.Node, splitting_ops: Sequence[str]) -> bool:
    if node.op != "call_function":
        return False
    names = op_names(node.target)
    return any(name in splitting_ops for name in names)


def op_arguments(node: torch.fx.Node, names: Sequence[str]) -> list:
    """A call's arguments in schema order, ``names`` being the schema's argument names: Dynamo
    records some of them as keywords."""
    return list(node.args) + [node.kwargs[k] for k in names[len(node.args):] if k in node.kwargs]


def is_collective(node: torch.fx.Node) -> bool:
    """A collective: compileattn's all-reduce, or a functional collective
    (``_c10d_functional::all_reduce`` etc., not counting its wait)."""
    return node.op == "call_function" and any(
        name.startswith("compileattn::all_reduce")
        or (name.startswith("_c10d_functional::") and not name.startswith("_c10d_functional::wait_tensor"))
        for name in op_names(node.target))


@dataclasses.dataclass
class Piece:
    """One submodule of the split graph: a compiled piece, or a lone splitting op run eagerly."""

    name: str
    index: int
    is_splitting_op: bool
    module: torch.fx.GraphModule

    def collectives(self) -> int:
        return sum(is_collective(n) for n in self.module.graph.nodes)


def split_graph(
    gm: torch.fx.GraphModule, splitting_ops: Sequence[str]
) -> tuple[torch.fx.GraphModule, list[Piece]]:
    """Returns the split graph (calling ``submod_i`` in order) and its pieces, in call order.

    Each splitting op lands alone in its own submodule; runs of other nodes form the pieces.
    """
    partition = 0
    assignment: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting_node(node, splitting_ops):
            partition += 1
            assignment[node] = partition
            partition += 1
        else:
            assignment[node] = partition
    split_gm = split_module(gm, None, lambda n: assignment[n], keep_original_order=True)

    names = {f"submod_{assignment[n]}" for n in assignment if is_splitting_node(n, splitting_ops)}
    pieces = []
    for node in list(split_gm.graph.nodes):
        if node.op == "call_module":
            sub = getattr(split_gm, node.target)
            is_split = node.target in names
            if not is_split:
                _return_tuple(split_gm, node, sub)
            pieces.append(Piece(node.target, len(pieces), is_split, sub))
    split_gm.recompile()
    return split_gm, pieces


def _return_tuple(split_gm: torch.fx.GraphModule, call: torch.fx.Node, sub: torch.fx.GraphModule) -> None:
    """Make a piece return a tuple even for one output: AOT/Inductor insist on tuple outputs.
    (``split_module(tuple_return=True)`` does this too, but not in every supported torch.)"""
    output = next(n for n in sub.graph.nodes if n.op == "output")
    value = output.args[0]
    if isinstance(value, (tuple, list)):
        return
    output.args = ((value,),)
    sub.recompile()
    users = list(call.users)
    with split_gm.graph.inserting_after(call):
        first = split_gm.graph.call_function(operator.getitem, (call, 0))
    for user in users:
        user.replace_input_with(call, first)
