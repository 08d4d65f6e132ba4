"""Inline nested compile regions and name each attention layer again.

A trace with regions (``compileattn/compilation/regions.py``) gives a graph whose decoder layers
are ``invoke_subgraph`` calls of one shared subgraph, and whose attention ops are
``attention_by_id(q, k, v, out, layer_id)`` with the layer id a graph input. The later passes
(KV-write capture, hoist, split, piece signatures) work on a flat graph with ``attention(..., layer_name)``:
this pass makes one, so their output is what a flat trace gives them. Each call is copied in
with its own operands (another layer's weights) and each layer id replaced by the layer name its
example input holds.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx

from .split import is_splitting_node, op_arguments

BY_ID = ("compileattn::attention_by_id",)


class RegionInlineError(ValueError):
    """A region call this pass cannot flatten: the decorator then traces the model flat."""


def _inline_calls(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """Copy every ``invoke_subgraph`` call's subgraph into ``gm`` in its place (nested ones first),
    and drop the subgraphs no longer called. -> (calls inlined, distinct subgraphs)."""
    inlined = subgraphs = 0
    graph = gm.graph
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph
    done: set[str] = set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not invoke_subgraph:
            continue
        holder, _identifier, *operands = node.args
        if holder.op != "get_attr":
            raise RegionInlineError(f"invoke_subgraph {node.name}: its subgraph is {holder.op} {holder.target}, "
                                    f"not a get_attr of a submodule")
        sub = gm.get_submodule(holder.target)
        if holder.target not in done:
            nested_calls, nested_subgraphs = _inline_calls(sub)
            inlined, subgraphs = inlined + nested_calls, subgraphs + nested_subgraphs + 1
            done.add(holder.target)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(operands):
            raise RegionInlineError(f"invoke_subgraph {node.name}: {len(operands)} operands for "
                                    f"{len(placeholders)} subgraph inputs")
        env: dict[torch.fx.Node, Any] = dict(zip(placeholders, operands))
        results: Any = None
        with graph.inserting_before(node):
            for inner in sub.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    results = torch.fx.map_arg(inner.args[0], env.__getitem__)
                    continue
                if inner.op == "get_attr":
                    raise RegionInlineError(f"invoke_subgraph {node.name}: its subgraph reads attribute "
                                            f"{inner.target}; only subgraphs that take everything as inputs "
                                            f"can be inlined")
                env[inner] = graph.node_copy(inner, env.__getitem__)
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise RegionInlineError(f"invoke_subgraph {node.name} is used by {user.format_node()}, not by indexing")
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not holder.users:
            graph.erase_node(holder)
        inlined += 1
    for target in done:
        if not any(n.op == "get_attr" and n.target == target for n in graph.nodes):
            gm.delete_submodule(target)
    return inlined, subgraphs


def inline_regions(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                   layer_of_id: Callable[[torch.Tensor], str]) -> tuple[torch.fx.GraphModule, int, int]:
    """-> (gm flattened, region calls inlined, distinct subgraphs they called: Dynamo traced
    each subgraph once). ``layer_of_id`` maps a layer-id tensor (the example input an
    ``attention_by_id`` reads) to its layer's name."""
    inlined, subgraphs = _inline_calls(gm)
    renamed = 0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {node: i for i, node in enumerate(placeholders)}
    for node in list(gm.graph.nodes):
        if not is_splitting_node(node, BY_ID):
            continue
        query, key, value, output, layer_id = op_arguments(node, ("query", "key", "value", "output", "layer_id"))
        if len(placeholders) != len(example_inputs):
            raise RegionInlineError(f"the graph has {len(placeholders)} inputs but Dynamo gave {len(example_inputs)} "
                                    f"example inputs: the layer ids cannot be read")
        if layer_id not in index:
            raise RegionInlineError(f"{node.format_node()}: its layer_id is not an input of the graph (a layer's "
                                    f"layer_id attribute), so the layer it names cannot be read at compile time")
        with gm.graph.inserting_before(node):
            named = gm.graph.call_function(torch.ops.compileattn.attention.default,
                                           (query, key, value, output, layer_of_id(example_inputs[index[layer_id]])))
        named.meta = dict(node.meta)
        node.replace_all_uses_with(named)
        gm.graph.erase_node(node)
        renamed += 1
    if not inlined and not renamed:
        return gm, 0, 0
    gm.graph.lint()
    gm.recompile()
    return gm, inlined, subgraphs
