"""A second dynamic size beside the token count (compilation/pinned_sizes.py).

CUDA graphs and static pieces are keyed by the token count. A call with the same token count and
another value of a second dynamic size must not replay the graph captured with the first value
(once the graph's first replay has checked its inputs, a replay reads the captured shapes: a
wrong answer) nor run the static piece compiled for it (Inductor's size assertion), nor load
another process's static piece compiled for another value: it runs the dynamic-shape pieces
without graphs. Simulated CUDA graphs replay the captured call as a real one would, so the wrong
answer shows on the CPU.
"""
from __future__ import annotations

import pytest
import torch

import compileattn as ca
from compileattn import counters
from compileattn.compilation import artifact
from compileattn.compilation.pinned_sizes import PinnedSizes, pin_other_sizes
from compileattn.compilation.size_reads import SizeRead

#: (x rows: the token count, y rows: the second dynamic size); y = 3 is the first call's. The
#: second call's replay checks the graph's inputs once; the third, with another y, is the one a
#: graph keyed by the token count alone answers wrong.
CALLS = [(8, 3), (8, 3), (8, 5), (8, 3), (9, 5), (8, 7), (9, 3)]
FIRST_Y = CALLS[0][1]


def two_sums(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum(0, keepdim=True) + y.sum(0, keepdim=True) * 3


GRAPHS = dict(compile_sizes=(), cudagraph_mode="piecewise", cudagraph_capture_sizes=[8])
STATIC = dict(compile_sizes=[8], cudagraph_mode="none")


def _config(kind: dict, **extra) -> ca.CompileConfig:
    return ca.CompileConfig(compile_workers=0, background_static_compiles=False, **kind, **extra)


def _run_calls(f, graphs: bool) -> None:
    """Every call answers as eager; graphs are replayed only at the first call's y size."""
    xs, ys = torch.randn(16, 4), torch.randn(16, 4)  # persistent buffers: graphs read them in place
    for nx, ny in CALLS:
        x, y = xs[:nx], ys[:ny]
        pinned = ny == FIRST_Y
        replays = int(graphs and pinned and nx == 8)
        before = counters.snapshot()
        out = f(x, y)
        torch.testing.assert_close(out, two_sums(x, y), msg=lambda m: f"x {nx} rows, y {ny} rows: {m}")
        after = counters.snapshot()
        assert (after["unpinned_steps"] - before["unpinned_steps"],
                after["cudagraph_replays"] - before["cudagraph_replays"]) == (int(not pinned), replays)


@pytest.mark.parametrize("kind", [GRAPHS, STATIC], ids=["piecewise graphs", "static pieces"])
def test_decorator_answers_a_call_whose_second_dynamic_size_changed(simulated_graphs, kind):
    f = ca.compile(dynamic_arg_dims={"x": 0, "y": 0}, config=_config(kind))(two_sums)
    _run_calls(f, graphs=kind is GRAPHS)


@pytest.mark.parametrize("kind", [GRAPHS, STATIC], ids=["piecewise graphs", "static pieces"])
def test_torch_compile_answers_a_call_whose_second_dynamic_size_changed(simulated_graphs, kind):
    compiled = torch.compile(two_sums, backend="compileattn", options=dict(vars(_config(kind))), dynamic=True,
                             fullgraph=True)
    _run_calls(compiled, graphs=kind is GRAPHS)


def test_a_warm_start_keeps_the_pinned_sizes(simulated_graphs, tmp_path):
    config = _config(GRAPHS, cache_dir=str(tmp_path))
    cold = ca.compile(dynamic_arg_dims={"x": 0, "y": 0}, config=config)(two_sums)
    cold(torch.randn(8, 4), torch.randn(FIRST_Y, 4))
    warm = ca.compile(dynamic_arg_dims={"x": 0, "y": 0}, config=config)(two_sums)
    _run_calls(warm, graphs=True)
    assert warm.compile_stats["path"] == "warm"


def test_a_static_piece_compiled_for_another_second_size_is_not_loaded_from_the_compile_cache(tmp_path):
    options = dict(vars(_config(STATIC, cache_dir=str(tmp_path))))
    for other in (3, 5):  # two compiles (processes) whose first calls differ in y only
        torch._dynamo.reset()
        compiled = torch.compile(two_sums, backend="compileattn", options=options, dynamic=True, fullgraph=True)
        x, y = torch.randn(8, 4), torch.randn(other, 4)
        with counters.expect(unpinned_steps=0, cache_hits=int(other == 5)):  # the dynamic piece only
            torch.testing.assert_close(compiled(x, y), two_sums(x, y))


def test_the_full_step_shortcut_leaves_a_call_with_another_second_size_to_the_dispatcher(simulated_graphs):
    """``@compileattn.compile`` replays a full-decode graph itself once the dispatcher has; a call
    whose second size changed in place (same buffer, fewer rows) runs the dynamic pieces."""
    import random

    from compileattn.models.opt import OPTConfig, OPTForCausalLM
    from compileattn.testing import PersistentInputs

    block, blocks, max_tokens = 16, 96, 16
    config = ca.CompileConfig(cudagraph_mode="full_and_piecewise", max_capture_size=max_tokens,
                              piece_compiler="eager")
    model = OPTForCausalLM(OPTConfig.tiny(), seed=0)
    caches = ca.allocate_kv_caches(model.attention_specs(), blocks, block, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=block, num_blocks=blocks, max_num_tokens=max_tokens,
                                         max_blocks_per_seq=4)

    def forward(input_ids, positions, extra):
        return model(input_ids, positions) + extra.sum(0)

    fn = ca.compile(forward, dynamic_arg_dims={"input_ids": 0, "positions": 0, "extra": 0}, config=config)
    inputs = PersistentInputs(model.config.vocab_size, max_tokens, positions=(1, 40), mark_dynamic=False)
    extras = torch.randn(16, model.config.hidden_size)
    rng = random.Random(4)
    seqs = [ca.SequenceStep(1, rng.randint(1, 40), [4 * i + j for j in range(4)]) for i in range(4)]
    for rows, direct in [(3, 0), (3, 0), (3, 1), (3, 1), (5, 0), (3, 1)]:
        md = builder.build(seqs, pad_to=config.padded_num_tokens(4))
        ids, pos = inputs(md.num_tokens)
        with torch.no_grad(), ca.set_forward_context(md, caches):
            with counters.expect(full_graph_direct_steps=direct, unpinned_steps=int(rows != 3)):
                out = fn(ids, pos, extras[:rows])
            torch.testing.assert_close(out, model(ids, pos) + extras[:rows].sum(0))


def test_pinned_sizes_survive_the_artifact(simulated_graphs):
    captured = []

    def backend(gm, example_inputs):
        from compileattn.compilation.backend import compileattn_backend

        captured.append(compileattn_backend(gm, example_inputs, options=vars(_config(GRAPHS))))
        return captured[-1]

    x, y = torch.randn(8, 4), torch.randn(3, 4)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, 0)
    torch.compile(two_sums, backend=backend, fullgraph=True)(x, y)
    pinned = captured[0].compiled.pinned
    assert [(read, value) for _, read, value, _ in pinned.sizes] == [(SizeRead("shape", 0), 3)]
    assert artifact.loads(artifact.dumps(captured[0])).compiled.pinned == pinned


def test_only_other_sizes_are_pinned_and_strides_are_read_too():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2)
    columns = torch.empty(8, 6)[:, :3]  # a column slice: its row stride (6) is a symbol of its own
    tokens = mode.from_tensor(columns, symbolic_context=dynamic)
    other = mode.from_tensor(torch.empty(5, 4), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    pinned = pin_other_sizes([tokens, other], ["a", "b"], tokens.shape[0].node.expr)
    assert pinned.describe() == "b.size(0) = 5, a.size(1) = 3, a.stride(0) = 6"
    assert pinned.values == (5, 3, 6)
    check = pinned.checker()
    assert check([columns, torch.empty(5, 4)])
    assert check([torch.empty(20, 6)[:, :3], torch.empty(5, 4)])  # another token count: still pinned
    assert not check([columns, torch.empty(6, 4)])
    assert not check([torch.empty(8, 7)[:, :3], torch.empty(5, 4)])
    assert not check([torch.empty(8, 3), torch.empty(5, 4)])


def test_no_pinned_check_where_no_graphs_or_static_pieces_could_be_kept_from_a_call():
    f = ca.compile(dynamic_arg_dims={"x": 0, "y": 0}, config=_config(dict(compile_sizes=(), cudagraph_mode="none")))(
        two_sums)
    xs, ys = torch.randn(16, 4), torch.randn(16, 4)
    for nx, ny in CALLS:
        with counters.expect(unpinned_steps=0):
            torch.testing.assert_close(f(xs[:nx], ys[:ny]), two_sums(xs[:nx], ys[:ny]))


def test_no_other_size_costs_nothing_and_an_unreadable_one_turns_graphs_off():
    assert PinnedSizes().checker() is None
    unreadable = PinnedSizes(unreadable=("s3",))
    assert not unreadable.keyed_by_token_count
    assert unreadable.checker()([torch.empty(8)]) is False
    assert "s3" in unreadable.describe()


@pytest.mark.cuda
def test_cuda_graphs_and_static_pieces_serve_only_the_first_calls_second_size():
    f = ca.compile(dynamic_arg_dims={"x": 0, "y": 0},
                   config=ca.CompileConfig(compile_sizes=[8], cudagraph_mode="piecewise", cudagraph_capture_sizes=[8],
                                           compile_workers=0, background_static_compiles=False))(two_sums)
    xs, ys = torch.randn(16, 4, device="cuda"), torch.randn(16, 4, device="cuda")
    for nx, ny in CALLS:
        x, y = xs[:nx], ys[:ny]
        pinned = ny == FIRST_Y
        with counters.expect(unpinned_steps=int(not pinned), cudagraph_replays=int(pinned and nx == 8)):
            out = f(x, y)
        torch.testing.assert_close(out, two_sums(x, y))
