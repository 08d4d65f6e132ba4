"""Split an FX graph at the splitting ops (by default compileattn's unified attention op).

Dynamo records a custom op call as the OpOverloadPacket (``torch.ops.compileattn.attention``)
while AOT/Inductor graphs hold the overload (``.default``): both are matched, by name, so a
user's own op "ns::op" or "ns::op.overload" can be a splitting op too.
The pieces between splitting ops keep the original node order (``keep_original_order``), which
matters because the attention op mutates its ``output`` argument: a reorder could read it early.
Only views move, later, to the piece that uses them, past no in-place op on their input
(``_sink_views``): they read no data. For the same reason a piece that writes in place into one of
two inputs sharing storage gets their base instead and makes the views itself
(``_unalias_piece_inputs``): Inductor's compile of such a piece failed at its first call. A float
of the sizes (``1.0 / n``) is computed again in each piece that uses it (``_recompute_floats``).
"""
from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import Sequence

import torch.fx
from torch.fx.passes.split_module import split_module

from .._torch_compat import call_schema, node_example_value, op_names, storage_key


def is_splitting_node(node: torch.fx.Node, splitting_ops: Sequence[str]) -> bool:
    """A call of one of ``splitting_ops`` ("ns::op" or "ns::op.overload"). Dynamo records the op's
    packet, not the overload it will run: a packet call answers to the names of all its overloads
    (splitting where an overload other than the named one may run is still right, only slower)."""
    if node.op != "call_function":
        return False
    names = op_names(node.target)
    if any(name in splitting_ops for name in names):
        return True
    return len(names) == 1 and any(op.partition(".")[0] == names[0] for op in splitting_ops)


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
    _sink_views(gm, assignment, splitting_ops)
    _unalias_piece_inputs(gm, assignment, splitting_ops)
    _recompute_floats(gm, assignment, splitting_ops)
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


#: Ops that make a view of their input, reading no data: computed in any piece, they give the same
#: tensor, so one may move to the piece that uses it (``_sink_views``). ``reshape`` and indexing
#: may copy (a read, which a splitting op's mutation in between would change) and are not here.
_VIEW_METHODS = frozenset({"unsqueeze", "squeeze", "view", "expand", "transpose", "permute", "t", "narrow",
                           "select", "unflatten", "view_as", "expand_as"})


#: Where torch's tensor functions live (``torch.narrow.__module__`` is "torch", ``torch.split``'s
#: "torch.functional").
_TORCH_FUNCTION_MODULES = ("torch", "torch.functional", "torch._C._VariableFunctions")


def torch_call_name(node: torch.fx.Node) -> str | None:
    """The name a call answers to as a tensor method or a ``torch`` function (``x.narrow(...)`` and
    ``torch.narrow(x, ...)``: "narrow"); None for any other node."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function" and getattr(node.target, "__module__", "") in _TORCH_FUNCTION_MODULES:
        return getattr(node.target, "__name__", None)
    return None


def _is_view(node: torch.fx.Node) -> bool:
    return torch_call_name(node) in _VIEW_METHODS


def _sink_views(gm: torch.fx.GraphModule, assignment: dict[torch.fx.Node, int], splitting_ops: Sequence[str]) -> None:
    """Move each view whose users all sit in later pieces to the first of them (a splitting op's
    user: the piece before it, as a splitting op stays alone), in place.

    Dynamo's graph may compute a layer's views of shared inputs (the rotary cos/sin unsqueezed for
    the next layer, say) before the previous layer's attention; split by position, every middle
    piece of a Llama then computes its successor's views and hands them on, except the last
    middle piece, which has no successor with rotary: one distinct piece more (on the Llama-3-8B
    shape one more dynamic-shape compile of ~3 s and four static ones, run S14-1). A view reads no
    data, so its users see the same values wherever it is made, unless an in-place op in between
    changes its base's shape or storage (``t_``, ``resize_``, ``set_``): past any in-place op on
    its input it stays. It never moves into a piece that would hold nothing else."""
    occupied = {assignment[n] for n in assignment if not is_splitting_node(n, splitting_ops)}
    for node in reversed(list(gm.graph.nodes)):
        if node not in assignment or not _is_view(node) or not node.users:
            continue
        if any(user not in assignment for user in node.users):  # the graph's output
            continue
        first = min(assignment[user] - is_splitting_node(user, splitting_ops) for user in node.users)
        if first <= assignment[node] or first not in occupied:
            continue
        nodes = list(gm.graph.nodes)  # again per move: a move reorders them
        order = {n: i for i, n in enumerate(nodes)}
        first_user = min(node.users, key=order.__getitem__)
        bases = set(node.all_input_nodes)
        between = nodes[order[node] + 1:order[first_user]]
        if any(_in_place(n) and bases & set(n.all_input_nodes) for n in between):
            continue
        assignment[node] = first
        first_user.prepend(node)  # split_module orders the pieces by their nodes' original order


def node_storages(node: torch.fx.Node) -> set:
    """The storages of the tensors in a node's traced value (a tuple's too: ``split``'s,
    ``unbind``'s); empty for a node without one (a hand-built graph). Both passes tell aliasing by
    them."""
    value = node_example_value(node)
    values = value if isinstance(value, (tuple, list)) else (value,)
    return {key for v in values if isinstance(v, torch.Tensor) and (key := storage_key(v)) is not None}


def _views_its_input(node: torch.fx.Node) -> bool:
    """A call, not one that writes, whose traced value lies in its first argument's storage: a view
    made by any op (``h[:, :4]``, ``split`` and its items), as Dynamo's fake tensors tell. Not
    ``torch.mul(h, 2, out=h)``, whose value is ``h`` too: made again, it would write again."""
    if node.op not in ("call_function", "call_method") or writes_in_place(node) or node.is_impure() \
            or not node.args:
        return False
    if node.op == "call_function" and node.target is not operator.getitem and torch_call_name(node) is None:
        return False
    base, keys = node.args[0], node_storages(node)
    return isinstance(base, torch.fx.Node) and bool(keys) and keys <= node_storages(base)


#: The functions of Python's ``operator`` that write their first argument.
_OPERATOR_WRITES = frozenset({operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                              operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
                              operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift})


def writes_in_place(node: torch.fx.Node) -> bool:
    """A call that writes a tensor it is given: an in-place name (``add_``, ``torch.relu_``), an
    ``out=`` tensor (``torch.add(h, 1, out=h)``), ``inplace=True`` (``F.relu(h, inplace=True)``,
    ``F.leaky_relu(h, 0.1, True)``), ``operator.setitem``, or an op with a mutable schema. Dynamo
    records the torch functions among them as calls whose result nobody need use (later code reads
    ``h``), and FX does not count them impure: the passes ask this instead."""
    if node.op != "call_function" and node.op != "call_method":
        return False
    if node.op == "call_function" and getattr(node.target, "__module__", None) == "_operator":
        return node.target in _OPERATOR_WRITES  # not operator.not_ (Dynamo's shape checks)
    if _in_place(node):
        return True
    if isinstance(node.kwargs.get("out"), (torch.fx.Node, tuple, list)) or _inplace_flag(node):
        return True
    schema = call_schema(node.target) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable


def written_values(node: torch.fx.Node) -> list:
    """The traced values (fake tensors) a ``writes_in_place`` node writes: its first argument (an
    in-place call, ``inplace=True``, ``operator.setitem``), its ``out=`` tensors, and the arguments
    its schema marks written; the first argument where a mutable schema is not at hand."""
    if not writes_in_place(node):
        return []
    schema = call_schema(node.target) if node.op == "call_function" else None
    if schema is not None and schema.is_mutable and not _in_place(node):
        bound = dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)
        targets = [bound.get(a.name) for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    else:
        out = node.kwargs.get("out")
        targets = list(out) if isinstance(out, (tuple, list)) else [out] if out is not None else node.args[:1]
    values = [node_example_value(t) for t in targets if isinstance(t, torch.fx.Node)]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _inplace_flag(node: torch.fx.Node) -> bool:
    """``inplace=True``, as a keyword or in its place among the arguments: ``nn.LeakyReLU``,
    ``nn.ReLU6`` (``hardtanh``) and ``nn.ELU`` pass it positionally (``F.leaky_relu(h, 0.1, True)``),
    and Dynamo records the call as written."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op != "call_function" or not any(a is True for a in node.args):
        return False
    try:
        names = list(inspect.signature(node.target).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    at = names.index("inplace") if "inplace" in names else len(node.args)
    return at < len(node.args) and node.args[at] is True


def _unalias_piece_inputs(gm: torch.fx.GraphModule, assignment: dict[torch.fx.Node, int],
                          splitting_ops: Sequence[str]) -> None:
    """Where a piece that writes in place would take two inputs sharing storage (``h`` and
    ``h[:, :4]`` made before an attention op, ``hv.zero_()`` after it; two slices of one tensor),
    copy each such input that is a chain of views into the piece, before its first use there, so
    the piece takes the chain's base instead, in place.

    AOTAutograd compiles a graph that mutates one of two aliasing inputs through a "synthetic
    base"; Inductor's piece so compiled for the dynamic token count asserted the base's traced
    shape on the flat storage it is called with (torch 2.13: ``AssertionError: wrong number of
    dimensions``), where ``torch.compile`` of the whole model, holding both views' base, never
    meets aliasing inputs, and its piece compiled for a static size (``compile_sizes``) computed
    wrong values. A view reads no data, so made again in the later piece it is the same tensor,
    whatever values were written in between (``residual.add_(...)``, ``s.masked_fill_(...)``); one
    past an in-place op that reshapes its chain (``t_``, ``resize_``) is left as it is."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    pieces = sorted({assignment[n] for n in assignment if not is_splitting_node(n, splitting_ops)})
    for piece in pieces:
        members = [n for n in nodes if assignment.get(n) == piece]
        if not any(writes_in_place(n) for n in members):
            continue
        crossing = list(dict.fromkeys(i for n in members for i in n.all_input_nodes if assignment.get(i) != piece))
        by_storage: dict = {}
        for node in crossing:
            for key in node_storages(node):
                by_storage.setdefault(key, []).append(node)
        aliased = sorted({n for group in by_storage.values() if len(group) > 1 for n in group}, key=order.__getitem__)
        for view in aliased:
            nodes = list(gm.graph.nodes)  # again per view: copies were inserted
            order = {n: i for i, n in enumerate(nodes)}
            chain, link = [], view
            while _views_its_input(link):
                chain.append(link)
                link = link.args[0]
            if not chain:
                continue
            users = sorted((u for u in view.users if assignment.get(u) == piece), key=order.__getitem__)
            between = nodes[order[view] + 1:order[users[0]]]
            inputs = {link, *chain}
            if any(_reshapes_in_place(n) and inputs & set(n.all_input_nodes) for n in between):
                continue
            copies: dict[torch.fx.Node, torch.fx.Node] = {}
            for link in reversed(chain):
                with gm.graph.inserting_before(users[0]):
                    copy = gm.graph.node_copy(link, lambda a: copies.get(a, a))
                copy.meta = dict(link.meta)
                assignment[copy] = piece
                copies[link] = copy
            for user in users:
                user.replace_input_with(view, copies[view])


#: In-place ops that change a tensor's shape, strides or storage, not only its values: a view made
#: again after one is not the view made before it.
_RESHAPING_IN_PLACE = frozenset({"t_", "transpose_", "swapdims_", "swapaxes_", "squeeze_", "unsqueeze_",
                                 "as_strided_", "resize_", "resize_as_", "set_"})


def _reshapes_in_place(node: torch.fx.Node) -> bool:
    """An in-place call in ``_RESHAPING_IN_PLACE``. A write of values (``add_``, ``masked_fill_``,
    ``copy_``) leaves a view of the tensor the same view: made again later, it reads the same
    elements."""
    if not _in_place(node):
        return False
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name.split(".")[0] in _RESHAPING_IN_PLACE


def _is_float_arithmetic(node: torch.fx.Node) -> bool:
    """A pure call on no tensor whose traced value is a float (a SymFloat of the sizes: ``1.0 / (n + 1)``)."""
    if node.op != "call_function" or node.is_impure() or writes_in_place(node):
        return False
    if not isinstance(node_example_value(node), (float, torch.SymFloat)):
        return False
    return not any(isinstance(node_example_value(i), torch.Tensor) for i in node.all_input_nodes)


def _recompute_floats(gm: torch.fx.GraphModule, assignment: dict[torch.fx.Node, int],
                      splitting_ops: Sequence[str]) -> None:
    """Copy each float computed from the sizes into every later piece that uses it (its inputs,
    SymInts, cross instead), in place; an original left without users is dropped.

    A piece may not return a float: compiled for static sizes (``compile_sizes``), it becomes a
    Python float, which Inductor refuses as a graph output (``AssertionError`` in
    ``GraphLowering.output``); the hoist pass moves such arithmetic before an attention op, so
    ``out * (1.0 / n)`` after the op made one. Recomputing is a few scalar operations."""
    for node in reversed(list(gm.graph.nodes)):
        if node not in assignment or is_splitting_node(node, splitting_ops) or not _is_float_arithmetic(node):
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        by_piece: dict[int, list[torch.fx.Node]] = {}
        for user in node.users:
            if user in assignment and assignment[user] != assignment[node]:
                by_piece.setdefault(assignment[user], []).append(user)
        for piece, users in by_piece.items():
            first = min(users, key=order.__getitem__)
            with gm.graph.inserting_before(first):
                copy = gm.graph.node_copy(node)
            copy.meta = dict(node.meta)
            assignment[copy] = piece
            for user in users:
                user.replace_input_with(node, copy)
        if not node.users:
            gm.graph.erase_node(node)
            del assignment[node]


def _in_place(node: torch.fx.Node) -> bool:
    """An in-place call (a trailing underscore, as ``add_``, ``t_``, ``aten.resize_``)."""
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", "")
    else:
        return False
    name = name.split(".")[0] if isinstance(name, str) else ""
    return name.endswith("_") and not name.startswith("_")


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
