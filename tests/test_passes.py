"""FX passes on toy graphs (CPU): split at packet and overload, user ops, order, hoisting."""
import operator

import pytest
import torch
import torch.fx

import compileattn  # noqa: F401  (registers the ops)
from compileattn.passes import cleanup, hoist_shape_logic, split_graph

ATTN = ("compileattn::attention",)

_lib = torch.library.Library("compileattn_test", "DEF")
_lib.define("marker(Tensor x) -> Tensor")
_lib.impl("marker", lambda x: x * 2, "CompositeExplicitAutograd")
torch.library.register_fake("compileattn_test::marker")(lambda x: torch.empty_like(x))


def _attention_graph(target, layers=2, contiguous_q=True):
    """A Dynamo-like graph: per layer, views feeding the attention op, then an op on its output."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    for i in range(layers):
        q = g.call_method("view", (x, 4, 2, 8))
        if not contiguous_q:
            q = g.call_method("transpose", (q, 0, 1))
        k = g.call_method("view", (x, 4, 2, 8))
        out = g.call_function(torch.empty_like, (q,))
        g.call_function(target, (q, k, k, out, f"l{i}"))
        x = g.call_method("view", (out, 4, 16))
        x = g.call_function(operator.add, (x, 1.0))
    g.output((x,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("target", [torch.ops.compileattn.attention, torch.ops.compileattn.attention.default])
def test_split_matches_packet_and_overload(target):
    gm = _attention_graph(target, layers=3)
    split_gm, pieces = split_graph(gm, ATTN)
    assert [p.is_splitting_op for p in pieces] == [False, True, False, True, False, True, False]
    assert [p.index for p in pieces] == list(range(7))


def test_split_by_overload_name_only_matches_that_overload():
    gm = _attention_graph(torch.ops.compileattn.attention.default)
    _, pieces = split_graph(gm, ("compileattn::attention.default",))
    assert sum(p.is_splitting_op for p in pieces) == 2
    _, pieces = split_graph(gm, ("compileattn::other",))
    assert sum(p.is_splitting_op for p in pieces) == 0 and len(pieces) == 1


def test_an_overload_name_splits_at_the_packet_dynamo_records():
    """The documented "ns::op.overload" form: Dynamo records the packet, which answered to
    "ns::op" only, so the graph was not split at all."""
    gm = _attention_graph(torch.ops.compileattn.attention)
    _, pieces = split_graph(gm, ("compileattn::attention.default",))
    assert sum(p.is_splitting_op for p in pieces) == 2


def test_split_at_a_user_op_keeps_semantics_and_order():
    def f(x):
        y = x + 1
        z = torch.ops.compileattn_test.marker(y)
        return z * 3 + y

    gm = torch.fx.symbolic_trace(f)
    split_gm, pieces = split_graph(gm, ("compileattn_test::marker",))
    assert [p.is_splitting_op for p in pieces] == [False, True, False]
    x = torch.randn(5)
    torch.testing.assert_close(split_gm(x), f(x))


def test_a_view_made_early_moves_to_the_piece_that_uses_it():
    """Dynamo may make a later layer's views of a shared input (the rotary cos/sin) before an
    earlier layer's attention; split by position, that piece would hand them on and differ from
    its neighbours. A view reads nothing, so it moves to its first user's piece; one the splitting
    op itself uses stays in the piece before it (a splitting op stays alone)."""
    def f(x, cos):
        early = cos.unsqueeze(0)             # used only after the marker
        y = torch.ops.compileattn_test.marker(x.view(4, 2))   # this view feeds the splitting op
        return (y + early).sum()

    gm = torch.fx.symbolic_trace(f)
    split_gm, pieces = split_graph(gm, ("compileattn_test::marker",))
    assert [p.is_splitting_op for p in pieces] == [False, True, False]
    first, marker, last = (p.module for p in pieces)
    methods = lambda gm: [n.target for n in gm.graph.nodes if n.op == "call_method"]  # noqa: E731
    assert methods(first) == ["view"] and methods(last) == ["unsqueeze", "sum"]
    assert not any(n.op == "call_method" for n in marker.graph.nodes)
    x, cos = torch.randn(8), torch.randn(2)
    torch.testing.assert_close(split_gm(x, cos), f(x, cos))


def test_a_view_stays_where_an_in_place_op_or_an_empty_piece_would_change_it():
    def transposed_in_place(x):
        v = x.transpose(0, 1)               # made before x.t_(), which changes what it views
        y = torch.ops.compileattn_test.marker(x)
        x.t_()
        return v + y.sum()

    def between_two_markers(x):
        h = x + 1
        v = h.unsqueeze(0)                  # only the second marker uses it: no piece between the two
        y = torch.ops.compileattn_test.marker(h)
        z = torch.ops.compileattn_test.marker(v)
        return y.sum() + z.sum()

    for f, args, view in ((transposed_in_place, (torch.randn(4, 2),), "transpose"),
                          (between_two_markers, (torch.randn(3),), "unsqueeze")):
        gm = torch.fx.symbolic_trace(f)
        split_gm, split = split_graph(gm, ("compileattn_test::marker",))
        assert view in [n.target for n in split[0].module.graph.nodes if n.op == "call_method"]
        x, x2 = args[0].clone(), args[0].clone()
        torch.testing.assert_close(split_gm(x), f(x2))


def test_pieces_return_tuples():
    gm = _attention_graph(torch.ops.compileattn.attention)
    _, pieces = split_graph(gm, ATTN)
    for p in pieces:
        if not p.is_splitting_op:
            out = next(n for n in p.module.graph.nodes if n.op == "output")
            assert isinstance(out.args[0], (tuple, list))


def test_cleanup_drops_dead_shape_checks():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    eq = g.call_function(operator.eq, (x, x))
    g.call_function(operator.not_, (eq,))
    g.output(g.call_function(operator.add, (x, 1)))
    gm = cleanup(torch.fx.GraphModule(torch.nn.Module(), g))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [operator.add]


def _attention_call(q_value, out_value):
    """x -> q (view) -> attention(q, q, q, out); example_value meta set the way Dynamo sets it."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    q = g.call_method("view", (x, 4, 2, 8))
    out = g.call_function(torch.empty_like, (q,))
    attn = g.call_function(torch.ops.compileattn.attention, (q, q, q, out, "l0"))
    g.output((out,))
    q.meta["example_value"] = q_value
    out.meta["example_value"] = out_value
    return torch.fx.GraphModule(torch.nn.Module(), g), attn


def test_hoist_makes_read_inputs_contiguous():
    gm, attn = _attention_call(torch.empty(2, 4, 8).transpose(0, 1), torch.empty(4, 2, 8))
    gm = hoist_shape_logic(gm, ATTN)
    assert [a.target for a in attn.args[:3]] == ["contiguous"] * 3
    assert attn.args[0] is attn.args[1] is attn.args[2]  # one copy, read three times
    assert gm.meta["compileattn_hoist"]["made_contiguous"] == 1


def test_hoist_refuses_non_contiguous_output():
    gm, _ = _attention_call(torch.empty(4, 2, 8), torch.empty(2, 4, 8).transpose(0, 1))
    with pytest.raises(ValueError, match="not contiguous"):
        hoist_shape_logic(gm, ATTN)


def test_hoist_moves_independent_shape_logic_before_the_op_only():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y")
    q = g.call_method("view", (x, 4, 2, 8))
    out = g.call_function(torch.empty_like, (q,))
    out_view = g.call_method("view", (out, 4, 16))  # a view of the written tensor, made before the op
    attn = g.call_function(torch.ops.compileattn.attention, (q, q, q, out, "l0"))
    y2 = g.call_method("view", (y, 2, 8))  # independent: may move before the op
    n_size = g.call_method("size", (y, 0))  # independent size arithmetic
    r = g.call_method("view", (out_view, 64))  # reads the written tensor through an alias: must stay
    s = g.call_function(operator.add, (r, 1.0))
    g.output((s, y2, n_size))
    gm = hoist_shape_logic(torch.fx.GraphModule(torch.nn.Module(), g), ATTN)
    order = list(gm.graph.nodes)
    assert order.index(y2) < order.index(attn) and order.index(n_size) < order.index(attn)
    assert order.index(r) > order.index(attn) and order.index(s) > order.index(attn)
    assert gm.meta["compileattn_hoist"]["moved"] == 2


@pytest.mark.parametrize("target", [torch.ops.compileattn.attention, torch.ops.compileattn.attention.default])
def test_cleanup_keeps_mutating_ops_without_users(target):
    """torch 2.11's eliminate_dead_code dropped the packet form of the attention op (it has no
    users; its effect is the write into ``output``)."""
    gm = _attention_graph(target, layers=2)
    gm = cleanup(gm)
    assert sum(1 for n in gm.graph.nodes if n.target is target) == 2


def test_cleanup_keeps_in_place_methods():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.call_method("add_", (x, 1))
    g.output(x)
    gm = cleanup(torch.fx.GraphModule(torch.nn.Module(), g))
    assert any(n.target == "add_" for n in gm.graph.nodes)


@pytest.mark.parametrize("target,kwargs", [(torch.relu_, {}), (torch.nn.functional.relu, {"inplace": True}),
                                           (torch.add, {"out": "x"})], ids=["relu_", "inplace=True", "out="])
def test_cleanup_keeps_torch_functions_that_write_in_place(target, kwargs):
    """Dynamo records ``F.relu(h, inplace=True)`` as a call whose result nobody reads (later code
    reads ``h``); FX does not count it impure, so a DCE dropped the write."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    args = (x, 1.0) if target is torch.add else (x,)
    g.call_function(target, args, {k: x if v == "x" else v for k, v in kwargs.items()})
    g.output(g.call_function(operator.mul, (x, 2)))
    gm = cleanup(torch.fx.GraphModule(torch.nn.Module(), g))
    assert any(n.target is target for n in gm.graph.nodes)
    h = torch.randn(5)
    torch.testing.assert_close(gm(h.clone()), target(h.clone(), *args[1:], **{k: h.clone() if v == "x" else v
                                                                              for k, v in kwargs.items()}) * 2)


def test_capture_kv_write_moves_the_write_into_the_preceding_piece():
    from compileattn.passes import capture_kv_write

    gm = capture_kv_write(_attention_graph(torch.ops.compileattn.attention, layers=2))
    assert gm.meta["compileattn_kv_write"] == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.compileattn.attention not in targets
    _, pieces = split_graph(gm, ("compileattn::attend",))
    assert [p.is_splitting_op for p in pieces] == [False, True, False, True, False]
    for i in (0, 2):  # each write sits in the piece before its attend
        writes = [n for n in pieces[i].module.graph.nodes if n.target is torch.ops.compileattn.write_layer_kv.default]
        assert len(writes) == 1
    attend = next(n for n in pieces[1].module.graph.nodes if n.op == "call_function")
    assert attend.target is torch.ops.compileattn.attend.default


def test_hoist_never_moves_a_read_of_the_written_storage_before_the_op():
    """``attention(q, k, v, out.view(...))`` writes ``out``: a later read of ``out`` itself (not of
    the view) must stay after the op."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    q = g.call_method("view", (x, 4, 2, 8))
    out = g.call_function(torch.empty, ((4, 16),))
    out_view = g.call_method("view", (out, -1, 2, 8))
    attn = g.call_function(torch.ops.compileattn.attention, (q, q, q, out_view, "l0"))
    read = g.call_function(torch.nn.functional.linear, (out, w))
    g.output((read,))
    gm = hoist_shape_logic(torch.fx.GraphModule(torch.nn.Module(), g), ATTN)
    order = list(gm.graph.nodes)
    assert order.index(read) > order.index(attn)
    assert gm.meta["compileattn_hoist"]["moved"] == 0


@pytest.mark.parametrize("make_view", ["unbind", "chunk", "torch.narrow", "torch.select"])
def test_hoist_knows_the_base_of_an_output_made_by_any_view_op(make_view):
    """A graph without traced values (the pass walks the chain of views): an output made by
    ``buf.unbind(0)[0]``, ``buf.chunk(2)[0]`` or the function forms writes ``buf``, so a later read
    of ``buf`` stays after the op."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    q = g.call_method("view", (x, 4, 2, 8))
    buf = g.call_function(torch.empty, ((2, 4, 2, 8),))
    if make_view == "unbind":
        out = g.call_function(operator.getitem, (g.call_method("unbind", (buf, 0)), 0))
    elif make_view == "chunk":
        out = g.call_method("view", (g.call_function(operator.getitem, (g.call_method("chunk", (buf, 2)), 0)), 4, 2, 8))
    elif make_view == "torch.narrow":
        out = g.call_method("view", (g.call_function(torch.narrow, (buf, 0, 0, 1)), 4, 2, 8))
    else:
        out = g.call_function(torch.select, (buf, 0, 0))
    attn = g.call_function(torch.ops.compileattn.attention, (q, q, q, out, "l0"))
    read = g.call_function(torch.nn.functional.linear, (g.call_method("view", (buf, 8, 16)), w))
    g.output((read,))
    gm = hoist_shape_logic(torch.fx.GraphModule(torch.nn.Module(), g), ATTN)
    order = list(gm.graph.nodes)
    assert order.index(read) > order.index(attn)


def _inference_region(x):
    y = x * 2
    with torch.inference_mode():
        z = y + 1
    return y, z


def test_cleanup_keeps_an_inference_mode_region():
    """Dynamo records ``with torch.inference_mode()`` as ``_enter_inference_mode`` and an
    ``_exit_inference_mode`` whose result nobody reads, which FX does not count impure: dropped,
    the region ran outside inference mode, and its result was a normal tensor recording autograd."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    x = torch.ones(3, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(_inference_region, backend=backend, fullgraph=True)(x)
    gm = cleanup(graphs[0])
    _, z = gm(x)
    _, expected = _inference_region(x)
    assert expected.is_inference() and not expected.requires_grad
    assert z.is_inference() and not z.requires_grad
    torch.testing.assert_close(z, expected)
