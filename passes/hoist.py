"""Move shape logic to capture time: out of and away from the eagerly-run splitting ops.

Everything between CUDA-graph replays runs eagerly once per layer per step, so any shape work
done there is paid per layer per step (~60 µs per attention call for reshapes and checks inside
the op, measured on the H200). This pass makes sure that work lives inside captured pieces:

1. Layout: every tensor a splitting op reads is made contiguous *before* the op (a
   ``contiguous`` node placed in the preceding piece, so it is captured), so the kernel path never
   copies or checks strides. A non-contiguous tensor the op *writes* cannot be fixed by a copy
   (the write would land in the copy): that is a compile-time ``ValueError``.
2. Hoisting: pure nodes that follow a splitting op but do not depend on it (size arithmetic,
   views, the next layer's reshapes of untouched tensors) are moved before it, into the preceding
   piece, so the following piece receives finished values instead of recomputing shapes.

"Depends on" is conservative: a node is tainted if it reads the splitting op, a tensor the op
mutates, any node sharing that tensor's storage (the buffer an output was cut from by any view op,
told by Dynamo's fake tensors, which share storage as the real ones will), or anything derived from
those, wherever it sits in the graph. A node also stays after a write that stays after the op
(an in-place op such as ``h.add_(1)`` or ``buf[:, :4].zero_()``, a buffer's counter) if it reads
a tensor sharing storage with what that write may change: moved before the op, it would read the
values from before the write. Nothing moves across a mode switch (``with torch.autocast(...)``
entered or left after the op): it would run in the op's mode, not its own.
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch
import torch.fx

from .._torch_compat import call_schema, node_example_value, op_names
from .split import is_splitting_node, node_storages, torch_call_name, writes_in_place

#: call_method names known not to mutate their receiver.
_PURE_METHODS = frozenset({
    "view", "reshape", "size", "dim", "contiguous", "to", "transpose", "permute", "unsqueeze", "squeeze",
    "flatten", "unflatten", "expand", "float", "half", "bfloat16", "type_as", "view_as", "split", "chunk",
    "narrow", "select", "__getitem__", "numel", "stride",
})


def _mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Argument nodes the op's schema marks as written (``Tensor(a!)``)."""
    schema = call_schema(node.target)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                out.append(value)
    return out


#: Ops whose schema writes nothing but which write state outside the graph: ``write_layer_kv``
#: writes its layer's KV cache, which a later ``attend`` of that layer reads. A model that runs one
#: attention layer twice (shared layers) has a second write that does not depend on the first
#: attention: moved before it, the first attention would read the second call's keys and values.
_WRITES_HIDDEN_STATE = frozenset({"compileattn::write_layer_kv"})


def _is_pure(node: torch.fx.Node) -> bool:
    if node.op == "call_function" and _WRITES_HIDDEN_STATE.intersection(op_names(node.target)):
        return False
    if writes_in_place(node):  # also F.relu(h, inplace=True), torch.add(h, 1, out=h)
        return False
    if node.op == "call_method":
        return node.target in _PURE_METHODS
    if node.op != "call_function":
        return False
    if node.is_impure():
        return False
    schema = call_schema(node.target)
    if schema is not None:
        return not schema.is_mutable
    name = getattr(node.target, "__name__", "")
    return not name.endswith("_") or node.target is operator.getitem


#: The calls Dynamo records for a context manager that changes how the ops after it run
#: (``torch.autocast``, ``torch.no_grad``, ``torch.inference_mode``).
_MODE_SWITCHES = frozenset({"_enter_autocast", "_exit_autocast", "_set_grad_enabled", "_enter_inference_mode",
                            "_exit_inference_mode"})


def _switches_mode(node: torch.fx.Node) -> bool:
    """A call entering or leaving a mode (``with torch.autocast(...)``): nothing after it moves
    before the op, which runs in the mode before the switch (``F.linear`` moved out of an autocast
    region computes in float32, not bfloat16)."""
    return node.op == "call_function" and getattr(node.target, "__name__", None) in _MODE_SWITCHES


def _inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return list(node.all_input_nodes)


def _make_inputs_contiguous(gm: torch.fx.GraphModule, node: torch.fx.Node) -> int:
    written = set(_mutated_args(node))
    fixed = 0
    for arg in _inputs(node):
        value = node_example_value(arg)
        if not isinstance(value, torch.Tensor) or value.is_contiguous():
            continue
        if arg in written:
            raise ValueError(f"{node.target}: the tensor it writes ({arg.name}) is not contiguous; "
                             f"allocate it contiguous (e.g. torch.empty_like(query))")
        with gm.graph.inserting_before(node):
            fixed_arg = gm.graph.call_method("contiguous", (arg,))
        fixed_arg.meta["example_value"] = value.contiguous()
        node.replace_input_with(arg, fixed_arg)
        fixed += 1
    return fixed


#: Ops whose result may alias their first argument's storage, as methods or ``torch`` functions
#: (``getitem`` too: of a tensor, or of a tuple of views such as ``unbind``'s).
_VIEW_OPS = frozenset({"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten",
                       "expand", "expand_as", "view_as", "narrow", "select", "unbind", "split", "split_with_sizes",
                       "chunk", "tensor_split", "hsplit", "vsplit", "dsplit", "movedim", "moveaxis", "swapaxes",
                       "swapdims", "t", "as_strided", "diagonal", "unfold", "view_as_real", "view_as_complex",
                       "detach", "alias", "__getitem__"})


def _is_view_op(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem) or torch_call_name(node) in _VIEW_OPS


def _storage_base(node: torch.fx.Node) -> torch.fx.Node:
    """Walk a chain of views back to the node that owns the storage (``out`` for ``out.view(...)``)."""
    while isinstance(node, torch.fx.Node) and node.args and isinstance(node.args[0], torch.fx.Node) \
            and _is_view_op(node):
        node = node.args[0]
    return node


def _nodes_by_storage(gm: torch.fx.GraphModule) -> dict:
    """storage key -> the nodes whose traced value holds a tensor of that storage."""
    by_storage: dict = {}
    for n in gm.graph.nodes:
        for key in node_storages(n):
            by_storage.setdefault(key, set()).add(n)
    return by_storage


def _sharing_storage(written: torch.fx.Node, by_storage: dict) -> set[torch.fx.Node]:
    """Every node whose value may share ``written``'s storage: its chain of views back to the base,
    and, where Dynamo traced the graph, every node whose fake tensor shares its fake storage (fake
    tensors alias as the real ones will: a view made by any op, ``buf.unbind(0)[0]`` or
    ``torch.narrow(buf, ...)``, and the base ``buf`` itself, share one)."""
    found = {written, _storage_base(written)}
    for key in node_storages(written):
        found.update(by_storage.get(key, ()))
    return found


def _tainted_by(gm: torch.fx.GraphModule, node: torch.fx.Node, by_storage: dict) -> set[torch.fx.Node]:
    """The op, what it writes, every node that may share that storage (its base, other views of
    it), and every node derived from those, wherever it sits in the graph. Nodes are in
    topological order, so one forward pass suffices."""
    tainted = {node}
    for written in _mutated_args(node):
        tainted.update(_sharing_storage(written, by_storage))
    for n in gm.graph.nodes:
        if n not in tainted and any(i in tainted for i in n.all_input_nodes):
            tainted.add(n)
    return tainted


def _may_write(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The argument nodes an impure node may write: a mutable op's ``(a!)`` arguments, else
    (an in-place method's receiver, ``operator.setitem``'s target, anything without a schema)
    every input, conservatively."""
    schema = call_schema(node.target) if node.op == "call_function" else None
    return _mutated_args(node) if schema is not None else list(node.all_input_nodes)


def hoist_shape_logic(gm: torch.fx.GraphModule, splitting_ops: Sequence[str]) -> torch.fx.GraphModule:
    splits = [n for n in gm.graph.nodes if is_splitting_node(n, splitting_ops)]
    made_contiguous = sum(_make_inputs_contiguous(gm, s) for s in splits)
    moved = 0
    by_storage = _nodes_by_storage(gm)
    for split in splits:
        tainted = _tainted_by(gm, split, by_storage)
        stayed: set[torch.fx.Node] = {split}  # nodes after the op that stay there
        written: set[torch.fx.Node] = set()  # nodes sharing storage with what a staying write may change
        node = split.next
        while node.op != "output" and not is_splitting_node(node, splitting_ops) and not _switches_mode(node):
            following = node.next
            inputs = node.all_input_nodes
            if node not in tainted and _is_pure(node) and not stayed.intersection(inputs) \
                    and not written.intersection(inputs):
                split.prepend(node)
                moved += 1
            else:
                stayed.add(node)
                if not _is_pure(node):
                    for arg in _may_write(node):
                        written.update(_sharing_storage(arg, by_storage))
            node = following
    gm.graph.lint()
    gm.recompile()
    gm.meta["compileattn_hoist"] = {"made_contiguous": made_contiguous, "moved": moved}
    return gm
