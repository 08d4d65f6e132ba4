"""The CUDA-graph runtime's step logic on the CPU, with CUDA graphs simulated.

A simulated graph re-runs the captured callable on replay and copies the results into the
outputs it returned at capture, so a replay hands back the same tensor objects with fresh values,
as a real graph does. What it cannot show (kernels really captured, memory really shared) is
tested on the GPU in tests/test_cudagraph.py; what it shows here, on every CI run, is the
runtime's choice of mode per step, its replay/capture counting, padding, and graphs for a graph
with no symbolic token dim (Dynamo's 1-token specialisation), whose absence the H200 caught first.
"""
import logging
import random

import pytest
import torch

import compileattn as ca
from compileattn.compilation.cudagraph import CudaGraphAddressError
from compileattn.models.llama import LlamaConfig, LlamaForCausalLM
from compileattn.testing import PersistentInputs, RecordingBackend, assert_matches_eager, random_step

BLOCK, NUM_BLOCKS, MAX_TOKENS = 16, 512, 64
SIZES = [1, 2, 4, 8, 16, 24, 32]


def _setup():
    model = LlamaForCausalLM(LlamaConfig.tiny(num_layers=2, head_dim=64), seed=0)
    caches = ca.allocate_kv_caches(model.attention_specs(), NUM_BLOCKS, BLOCK, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_TOKENS,
                                          max_blocks_per_seq=16)
    return model, caches, builder, PersistentInputs(model.config.vocab_size, MAX_TOKENS, mark_dynamic=False)


def _mark(make_inputs):
    def make(n):
        ids, pos = make_inputs(n)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        return ids, pos

    return make


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_every_step_at_a_capture_size_replays_including_one_token_steps(simulated_graphs, mode):
    model, caches, builder, make_inputs = _setup()
    cfg = ca.CompileConfig(cudagraph_mode=mode, cudagraph_capture_sizes=SIZES, piece_compiler="eager")
    backend = RecordingBackend(config=cfg)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    rng = random.Random(0)
    one_token_steps = 0
    seen = set()  # (padded size, uniform decode, 1-token graph): a repeat captures nothing new
    captures = ca.counters.cudagraph_captures
    repeats = 0
    for i in range(16):
        decode = i % 2 == 0
        num_seqs = 1 if i in (4, 9) else rng.randint(2, 5)  # 1-token steps: a static graph of their own
        seqs = random_step(rng, num_seqs=num_seqs, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                           max_query_len=1 if num_seqs == 1 else 5, max_context_len=100,
                           decode_fraction=1.0 if decode else 0.3)
        n = sum(s.query_len for s in seqs)
        one_token_steps += n == 1
        key = (cfg.padded_num_tokens(n), all(s.query_len == 1 for s in seqs), n == 1)
        before = ca.counters.cudagraph_captures
        with ca.counters.expect(cudagraph_replays=1, eager_steps=0):
            assert_matches_eager(model, compiled, builder, caches, seqs, _mark(make_inputs),
                                 pad_to=cfg.padded_num_tokens(n))
        if key in seen:
            repeats += 1
            assert ca.counters.cudagraph_captures == before, f"step {i} re-captured {key}"
        seen.add(key)
    assert one_token_steps == 2 and len(backend.built) == 2  # the dynamic graph and the 1-token one
    full = sum(rt.full_graph_count() for rt in backend.built)
    assert (full > 0) == (mode == "full_and_piecewise")
    assert ca.counters.cudagraph_captures > captures and repeats > 0


def test_shared_piece_code_is_captured_per_layer(simulated_graphs):
    """Identical pieces share compiled code (piece_signature.py); each piece's graphs are captured
    with its own layers' KV writes, in piecewise and full-graph steps (the caches are compared)."""
    model = LlamaForCausalLM(LlamaConfig.tiny(num_layers=5, head_dim=64), seed=0)
    caches = ca.allocate_kv_caches(model.attention_specs(), NUM_BLOCKS, BLOCK, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_TOKENS,
                                          max_blocks_per_seq=16)
    make_inputs = PersistentInputs(model.config.vocab_size, MAX_TOKENS, mark_dynamic=False)

    cfg = ca.CompileConfig(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=SIZES, piece_compiler="eager")
    compiled = torch.compile(model, backend=RecordingBackend(config=cfg), fullgraph=True)
    rng = random.Random(2)
    # the first piece, four identical middle ones, the last
    with ca.counters.expect(dynamo_graphs=1, pieces=6, backend_compiles=3, piece_reuses=3, cudagraph_replays=6):
        for i in range(6):
            seqs = random_step(rng, num_seqs=rng.randint(2, 5), block_size=BLOCK, num_blocks=NUM_BLOCKS,
                               max_query_len=4, max_context_len=60, decode_fraction=1.0 if i % 2 else 0.3)
            n = sum(s.query_len for s in seqs)
            assert_matches_eager(model, compiled, builder, caches, seqs, _mark(make_inputs),
                                 pad_to=cfg.padded_num_tokens(n))


@pytest.mark.parametrize("mode, decode", [("piecewise", False), ("full_and_piecewise", True)])
def test_an_input_moved_after_the_first_replay_raises_instead_of_replaying_stale_memory(simulated_graphs, mode,
                                                                                        decode):
    """A graph reads its inputs where they were at capture: the first replay compares every input,
    and every later graph step the caller's inputs (token ids, positions), so a fresh tensor passed
    after a few replays is refused instead of answered from the old memory."""
    model, caches, builder, make_inputs = _setup()
    cfg = ca.CompileConfig(cudagraph_mode=mode, cudagraph_capture_sizes=SIZES, piece_compiler="eager")
    compiled = torch.compile(model, backend=RecordingBackend(config=cfg), fullgraph=True)
    make = _mark(make_inputs)
    seqs = [ca.SequenceStep(1, 10 + i, [i]) for i in range(4)] if decode else \
        [ca.SequenceStep(1, 10, [0]), ca.SequenceStep(3, 0, [1])]
    md = builder.build(seqs, pad_to=4)
    with ca.set_forward_context(md, caches):
        for _ in range(3):  # capture, first replay, a later one
            ids, pos = make(4)
            compiled(ids, pos)
        with pytest.raises(CudaGraphAddressError, match=r"graph input \d+ \(l_input_ids_, shape \(4,\)\) was at .* when this size's CUDA graphs were captured"):
            compiled(ids.clone(), pos)
        compiled(*make(4))  # the persistent buffers are still served


@pytest.mark.parametrize("mode, check", [("piecewise", True), ("full_and_piecewise", False)])
def test_a_parameter_replaced_after_capture_is_captured_again(simulated_graphs, mode, check):
    """Through torch.compile, Dynamo's code passes the replacing parameter to the same dispatcher;
    its graphs, captured with the old one, are dropped and captured again (also without
    ``check_input_addresses``, which is about the caller's inputs)."""
    model, caches, builder, make_inputs = _setup()
    cfg = ca.CompileConfig(cudagraph_mode=mode, cudagraph_capture_sizes=SIZES, piece_compiler="eager",
                           check_input_addresses=check)
    backend = RecordingBackend(config=cfg)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    decode = [ca.SequenceStep(1, 10 + i, [i]) for i in range(4)]
    mixed = [ca.SequenceStep(1, 10, [0]), ca.SequenceStep(3, 0, [1])]

    def step(seqs):  # the model itself is the eager reference: it holds whatever weights it was given
        assert_matches_eager(model, compiled, builder, caches, seqs, _mark(make_inputs), pad_to=4)

    for seqs in (decode, mixed, decode, mixed):
        step(seqs)
    proj = model.model.layers[1].mlp.down_proj
    proj.weight = torch.nn.Parameter(torch.randn(proj.weight.shape, generator=torch.Generator().manual_seed(1)),
                                     requires_grad=False)
    with ca.counters.expect(parameter_recaptures=1):
        step(decode)
    with ca.counters.expect(parameter_recaptures=0, module_rechecks=0):
        for seqs in (mixed, decode, mixed):
            step(seqs)
    assert len(backend.built) == 1  # not a recompile: the graphs of the one dispatcher were captured again


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_a_second_instance_of_the_model_class_is_not_answered_from_the_first_ones_graphs(simulated_graphs, mode):
    """Dynamo serves every instance of a module class from one graph (its parameters are graph
    inputs), so two models compiled apart share one dispatcher: the second, made before the first
    captured (no registration since), must not replay graphs that read the first one's weights.
    OPT has no buffers, whose per-step comparison would have refused the second instead."""
    from compileattn.models.opt import OPTConfig, OPTForCausalLM

    first, second = (OPTForCausalLM(OPTConfig.tiny(), seed=seed) for seed in (0, 1))
    caches = ca.allocate_kv_caches(first.attention_specs(), NUM_BLOCKS, BLOCK, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_TOKENS,
                                          max_blocks_per_seq=16)
    make_inputs = _mark(PersistentInputs(first.config.vocab_size, MAX_TOKENS, mark_dynamic=False))
    options = dict(cudagraph_mode=mode, cudagraph_capture_sizes=SIZES, piece_compiler="eager")
    compiled = [torch.compile(m, backend="compileattn", fullgraph=True, options=options) for m in (first, second)]
    decode = [ca.SequenceStep(1, 10 + i, [i]) for i in range(4)]
    mixed = [ca.SequenceStep(1, 10, [0]), ca.SequenceStep(3, 0, [1])]
    # one graph, one dispatcher (what makes this case); each switch of model captures again
    with ca.counters.expect(dynamo_graphs=1, parameter_recaptures=2):
        for model, fn in ((first, compiled[0]), (first, compiled[0]), (second, compiled[1]), (first, compiled[0])):
            for seqs in (decode, mixed):
                assert_matches_eager(model, fn, builder, caches, seqs, make_inputs, pad_to=4)


def test_a_weight_sync_assigning_every_parameters_data_is_captured_again(simulated_graphs):
    """``p.data = new`` for every parameter registers nothing, and a graph reads the old memory
    (the simulated graph too: it keeps aliases of the captured memory); the first and last
    parameter inputs moved, so the next graph step captures again."""
    from compileattn.models.opt import OPTConfig, OPTForCausalLM

    model = OPTForCausalLM(OPTConfig.tiny(), seed=0)
    caches = ca.allocate_kv_caches(model.attention_specs(), NUM_BLOCKS, BLOCK, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_TOKENS,
                                          max_blocks_per_seq=16)
    make_inputs = _mark(PersistentInputs(model.config.vocab_size, MAX_TOKENS, mark_dynamic=False))
    compiled = torch.compile(model, backend="compileattn", fullgraph=True,
                             options=dict(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=SIZES,
                                          piece_compiler="eager"))
    decode = [ca.SequenceStep(1, 10 + i, [i]) for i in range(4)]
    mixed = [ca.SequenceStep(1, 10, [0]), ca.SequenceStep(3, 0, [1])]
    for seqs in (decode, mixed, decode, mixed):
        assert_matches_eager(model, compiled, builder, caches, seqs, make_inputs, pad_to=4)
    generator = torch.Generator().manual_seed(3)
    for p in model.parameters():
        p.data = p.data + 0.05 * torch.randn(p.shape, generator=generator)
    with ca.counters.expect(parameter_recaptures=1):
        for seqs in (decode, mixed, decode, mixed):
            assert_matches_eager(model, compiled, builder, caches, seqs, make_inputs, pad_to=4)


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_a_float_attribute_that_became_a_graph_input_is_compared_by_value(simulated_graphs, mode):
    """Two instances of a class differing in a float attribute: Dynamo recompiles with the float as
    a graph input, a fresh 0-dim CPU tensor every call. A CUDA graph bakes such a scalar into its
    kernel launches at capture, so its address means nothing and its value everything: the same
    value replays (no address error), another one captures that size again instead of replaying
    the captured value."""
    from compileattn.models.opt import OPTConfig, OPTForCausalLM

    class Scaled(torch.nn.Module):
        def __init__(self, inner, scale):
            super().__init__()
            self.inner, self.scale = inner, scale

        def forward(self, ids, pos):
            return self.inner(ids, pos) * self.scale

    inner = OPTForCausalLM(OPTConfig.tiny(), seed=0)
    one, half = Scaled(inner, 1.0), Scaled(inner, 0.5)  # the same weights: only the float differs
    caches = ca.allocate_kv_caches(inner.attention_specs(), NUM_BLOCKS, BLOCK, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_TOKENS,
                                          max_blocks_per_seq=16)
    make_inputs = _mark(PersistentInputs(inner.config.vocab_size, MAX_TOKENS, mark_dynamic=False))
    options = dict(cudagraph_mode=mode, cudagraph_capture_sizes=SIZES, piece_compiler="eager")
    compiled = {m: torch.compile(m, backend="compileattn", fullgraph=True, options=options) for m in (one, half)}
    decode = [ca.SequenceStep(1, 10 + i, [i]) for i in range(4)]
    mixed = [ca.SequenceStep(1, 10, [0]), ca.SequenceStep(3, 0, [1])]

    def steps(model):
        for seqs in (decode, mixed):
            assert_matches_eager(model, compiled[model], builder, caches, seqs, make_inputs, pad_to=4)

    steps(one)  # the graph with the float specialised
    with ca.counters.expect(dynamo_graphs=1):  # automatic dynamic: the float becomes a graph input
        steps(half)
    with ca.counters.expect(scalar_recaptures=0, parameter_recaptures=0, cudagraph_replays=4):
        steps(half)  # replays of the same value: not refused for the fresh tensor's address
        steps(half)
    with ca.counters.expect(scalar_recaptures=1, parameter_recaptures=0):
        steps(one)  # another value: captured again, not answered with the captured 0.5
        steps(one)
    with ca.counters.expect(scalar_recaptures=1):
        steps(half)


class _Scaled(torch.nn.Module):
    """A model whose forward reads a float attribute: set to another value after the first step,
    Dynamo makes it a graph input (automatic dynamic), a fresh 0-dim CPU tensor every call."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.scale = inner, 0.0

    def forward(self, ids, pos):
        return self.inner(ids, pos) * (1.0 + self.scale)


def _scaled_and_compiled(mode: str):
    """step(value, seqs, pad_to): sets the float and checks a step of the compiled model against eager."""
    from compileattn.models.opt import OPTConfig, OPTForCausalLM

    inner = OPTForCausalLM(OPTConfig.tiny(), seed=0)
    model = _Scaled(inner)
    caches = ca.allocate_kv_caches(inner.attention_specs(), NUM_BLOCKS, BLOCK, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_TOKENS,
                                          max_blocks_per_seq=16)
    make_inputs = _mark(PersistentInputs(inner.config.vocab_size, MAX_TOKENS, mark_dynamic=False))
    compiled = torch.compile(model, backend="compileattn", fullgraph=True,
                             options=dict(cudagraph_mode=mode, cudagraph_capture_sizes=SIZES, piece_compiler="eager"))

    def step(value, seqs, pad_to):
        model.scale = value
        assert_matches_eager(model, compiled, builder, caches, seqs, make_inputs, pad_to=pad_to)

    return step


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_a_scalar_input_that_keeps_changing_stops_the_captures(simulated_graphs, mode, caplog):
    """A scalar graph input changing step after step (a step counter a forward reads) would
    capture every step; after ``SCALAR_RECAPTURES_BEFORE_EAGER`` changes the dispatcher runs the
    compiled pieces without graphs, still answering with each step's value, and says so once."""
    from compileattn.compilation import dispatch

    step = _scaled_and_compiled(mode)
    decode = [ca.SequenceStep(1, 10 + i, [i]) for i in range(4)]
    step(0.0, decode, 4)
    step(0.5, decode, 4)  # automatic dynamic: the float becomes a graph input; captured with 0.5
    limit = dispatch.SCALAR_RECAPTURES_BEFORE_EAGER
    with ca.counters.expect(scalar_recaptures=limit, scalar_graphs_off=0):
        for i in range(limit):
            step(1.0 + i, decode, 4)
    with caplog.at_level(logging.WARNING, logger="compileattn"), \
            ca.counters.expect(scalar_recaptures=0, scalar_graphs_off=1, cudagraph_captures=0, cudagraph_replays=0,
                               eager_steps=limit + 1):
        for i in range(limit + 1):
            step(10.0 + i, decode, 4)  # each value answered, none captured
    assert sum("without CUDA graphs" in r.getMessage() for r in caplog.records) == 1


def test_one_change_of_a_scalar_input_recaptures_each_size_and_keeps_the_graphs(simulated_graphs):
    """A scalar graph input that changes once is one change, however many capture sizes catch up
    with it: each size's graphs are captured again once, and graphs stay on. (Counting each size's
    recapture as another change, one change seen by more sizes than
    ``SCALAR_RECAPTURES_BEFORE_EAGER`` turned CUDA graphs off for good.)"""
    from compileattn.compilation import dispatch

    step = _scaled_and_compiled("piecewise")
    sizes = [2, 4, 8, 16, 24][:dispatch.SCALAR_RECAPTURES_BEFORE_EAGER + 2]

    def steps(value):
        for n in sizes:
            step(value, [ca.SequenceStep(1, 5 + i % 8, [i]) for i in range(n)], n)

    steps(0.0)
    steps(0.5)  # automatic dynamic: the float becomes a graph input; each size captured with 0.5
    with ca.counters.expect(scalar_recaptures=len(sizes), scalar_graphs_off=0):
        steps(1.0)  # one change: each size captures again
    with ca.counters.expect(scalar_recaptures=0, scalar_graphs_off=0, cudagraph_captures=0,
                            cudagraph_replays=len(sizes), eager_steps=0):
        steps(1.0)


def test_a_graph_wrappers_first_replay_checks_addresses_shapes_and_scalar_values(simulated_graphs):
    """``CUDAGraphWrapper``'s own check at a graph's first replay (``CapturedGraph.check``), without the
    dispatcher in front of it: the tests above go through ``StepDispatcher``, whose comparisons raise
    or recapture first, so each of the three checks could be deleted with every CPU test passing.
    Each is broken once here (an input moved, an input reshaped at its address, a 0-dim CPU scalar
    of another value) and must raise, naming what it compared; an unchanged call replays."""
    from compileattn.compilation import cudagraph

    def fn(x, s):
        return x * s

    def wrapper():
        w = cudagraph.CUDAGraphWrapper("piece", fn, cudagraph.make_pool(torch.device("cpu")))
        x, s = torch.arange(8.0), torch.tensor(2.0)
        w.run(8, (x, s))  # capture
        return w, x, s

    w, x, s = wrapper()
    out = w.run(8, (x, s))  # first replay: checked, passes
    assert torch.equal(out, torch.arange(8.0) * 2)
    w, x, s = wrapper()
    with pytest.raises(CudaGraphAddressError, match=r"piece, size 8: input 0 was captured at 0x[0-9a-f]+ but is now"):
        w.run(8, (x.clone(), s))
    w, x, s = wrapper()
    with pytest.raises(CudaGraphAddressError, match=r"input 0 was captured with shape \(8,\) but has \(2, 4\)"):
        w.run(8, (x.view(2, 4), s))
    w, x, s = wrapper()
    with pytest.raises(CudaGraphAddressError, match=r"scalar input 1 .* was captured as 2.0 but is now 3.0"):
        w.run(8, (x, torch.tensor(3.0)))


class _Counted(torch.nn.Module):
    """A forward that updates memory it also reads: a step counter buffer, and the hidden state
    added to in place after the attention (a piece's input, made by the piece before)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, ids, pos):
        self.steps.add_(1)
        h = self.inner(ids, pos)
        h.add_(self.steps)
        return h * self.steps


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_a_capture_runs_the_step_once(simulated_graphs, mode):
    """A capture's warm-up is the step's one run: its outputs are the warm-up's results. A replay
    after the capture to fill them ran the step a second time, so a forward that updates memory it
    reads (a counter buffer, ``h += ...`` in place) answered the capture step, and left the
    counter, as after two steps."""
    from compileattn.models.opt import OPTConfig, OPTForCausalLM

    model, eager = (_Counted(OPTForCausalLM(OPTConfig.tiny(), seed=0)) for _ in range(2))
    caches = ca.allocate_kv_caches(model.inner.attention_specs(), NUM_BLOCKS, BLOCK, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_TOKENS,
                                          max_blocks_per_seq=16)
    make_inputs = _mark(PersistentInputs(model.inner.config.vocab_size, MAX_TOKENS, mark_dynamic=False))
    compiled = torch.compile(model, backend="compileattn", fullgraph=True,
                             options=dict(cudagraph_mode=mode, cudagraph_capture_sizes=SIZES, piece_compiler="eager"))
    decode = [ca.SequenceStep(1, 10 + i, [i]) for i in range(4)]
    mixed = [ca.SequenceStep(1, 10, [0]), ca.SequenceStep(3, 0, [1])]
    captures = ca.counters.cudagraph_captures
    with torch.no_grad():
        for seqs in (decode, mixed, decode, mixed):
            assert_matches_eager(eager, compiled, builder, caches, seqs, make_inputs, pad_to=4)
            assert model.steps.item() == eager.steps.item()
    assert ca.counters.cudagraph_captures > captures


def test_a_capture_fills_outputs_nested_in_tuples_lists_and_dicts():
    """A capture's outputs take the warm-up's results wherever they sit: only a flat tuple or list
    was filled (a dict's or an inner tuple's tensors kept the capture's unwritten memory), and a
    simulated replay refreshed none of those either."""
    from compileattn.compilation.cudagraph import SimulatedGraphPool, _copy_results

    def step(x):
        return {"double": x * 2, "more": (x + 1, [x.sum()])}

    x = torch.arange(4.0)
    captured = SimulatedGraphPool(torch.device("cpu")).capture(step, (x,), "nested", 4)
    torch.testing.assert_close(captured.outputs, step(x))
    x.add_(10)
    captured.graph.replay()
    torch.testing.assert_close(captured.outputs, step(x))
    outputs = {"a": (torch.zeros(2),), "b": [torch.zeros(3)]}
    _copy_results(outputs, {"a": (torch.ones(2),), "b": [torch.full((3,), 2.0)]})
    torch.testing.assert_close(outputs, {"a": (torch.ones(2),), "b": [torch.full((3,), 2.0)]})
