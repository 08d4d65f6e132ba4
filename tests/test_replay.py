"""Full-decode steps replayed by ``@compileattn.compile`` without Dynamo's code (compilation/replay.py).

With CUDA graphs simulated on the CPU, a replay re-runs the captured forward on the captured
inputs, so a direct replay's output is checked against eager; every condition the shortcut relies
on is broken once and must leave the step to the ordinary path, which raises or runs as before.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

import compileattn as ca
from compileattn.compilation import replay
from compileattn.compilation.cudagraph import CudaGraphAddressError
from compileattn.compilation.decorator import RecompileError
from compileattn.models.opt import OPTConfig, OPTForCausalLM
from compileattn.testing import PersistentInputs, assert_matches_eager, restore, snapshot

BLOCK, NUM_BLOCKS, MAX_TOKENS = 16, 96, 16


class Setup:
    def __init__(self, cls=OPTForCausalLM, *, direct=True, decorate_class=False, **options):
        """``decorate_class``: ``@compileattn.compile`` on the model class (a bound method per
        instance); else on a function calling the model, as ``benchmarks/latency.py`` does."""
        self.config = ca.CompileConfig(cudagraph_mode="full_and_piecewise", max_capture_size=MAX_TOKENS,
                                       piece_compiler="eager", direct_full_replay=direct, **options)
        dims = {"input_ids": 0, "positions": 0}
        if decorate_class:
            cls = ca.compile(type(f"Compiled{cls.__name__}", (cls,), {}), dynamic_arg_dims=dims, config=self.config)
        self.model = cls(OPTConfig.tiny(), seed=0)
        self.eager = OPTForCausalLM(OPTConfig.tiny(), seed=0)
        self.caches = ca.allocate_kv_caches(self.model.attention_specs(), NUM_BLOCKS, BLOCK, dtype=torch.float32)
        self.builder = self.new_builder()
        if decorate_class:
            self.fn = self.model
        else:
            model = self.model

            def forward(input_ids, positions):
                return model(input_ids, positions)

            self.fn = ca.compile(forward, dynamic_arg_dims=dims, config=self.config)
        self.inputs = PersistentInputs(self.model.config.vocab_size, MAX_TOKENS, positions=(1, 40),
                                       mark_dynamic=False)

    @staticmethod
    def new_builder():
        return ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_TOKENS,
                                           max_blocks_per_seq=4)

    def decode(self, batch, rng=None, prefill=0):
        rng = rng or random.Random(batch)
        seqs = [ca.SequenceStep(1, rng.randint(1, 40), [4 * i + j for j in range(4)]) for i in range(batch)]
        if prefill:
            seqs.append(ca.SequenceStep(prefill, 0, [4 * batch + j for j in range(4)]))
        return seqs

    def padded(self, seqs):
        return self.config.padded_num_tokens(sum(s.query_len for s in seqs))

    def step(self, seqs, builder=None, caches=None):
        md = (builder or self.builder).build(seqs, pad_to=self.padded(seqs))
        ids, pos = self.inputs(md.num_tokens)
        with torch.no_grad(), ca.set_forward_context(md, caches if caches is not None else self.caches):
            return self.fn(ids, pos)

    def warm(self, batch):
        """Compile, capture, then the first (checked) replay: the one the shortcut learns from."""
        for _ in range(3):
            self.step(self.decode(batch))


def test_decode_steps_replay_directly_and_match_eager(simulated_graphs):
    s = Setup()
    assert s.fn.compile_stats == {}
    rng = random.Random(0)
    seen: dict[int, int] = {}  # padded size -> full-graph steps so far
    direct = 0
    for i in range(18):
        mixed = i % 5 == 4
        seqs = s.decode(rng.choice([2, 3, 4, 8]), rng, prefill=3 if mixed else 0)
        n = s.padded(seqs)
        before = ca.counters.full_graph_direct_steps
        assert_matches_eager(s.eager, s.fn, s.builder, s.caches, seqs, s.inputs, pad_to=n)
        took = ca.counters.full_graph_direct_steps - before
        if not mixed:
            seen[n] = seen.get(n, 0) + 1
            assert took == (seen[n] > 2), (i, n, seen[n])  # capture, learning replay, then direct
            direct += took
        else:
            assert took == 0
    assert s.fn.compile_stats["direct_replay"] == "on"
    assert direct >= 6


def test_a_direct_replay_returns_the_ordinary_paths_output_object(simulated_graphs):
    s = Setup()
    s.warm(4)
    seqs = s.decode(4)
    with ca.counters.expect(full_graph_direct_steps=1, full_graph_steps=1, cudagraph_replays=1, eager_steps=0):
        out = s.step(seqs)
    learned = s.fn._site.direct.learned[4]  # noqa: SLF001
    assert out is learned.output()  # the graph's static output, as Dynamo's code returned it
    with ca.counters.expect(full_graph_direct_steps=1):
        again = s.step(seqs)
    assert again is out


def test_decorated_class_replays_directly(simulated_graphs):
    s = Setup(decorate_class=True)
    s.warm(2)
    with ca.counters.expect(full_graph_direct_steps=1):
        s.step(s.decode(2))
    assert s.model.forward.compile_stats["direct_replay"] == "on"


def test_warm_started_code_replays_directly(simulated_graphs, tmp_path):
    """The code a warm start loads is Dynamo's code too, calling the loaded dispatcher."""
    cold = Setup(decorate_class=True, cache_dir=str(tmp_path))
    cold.warm(4)
    assert cold.fn.forward.compile_stats["path"] == "cold"
    warm = Setup(decorate_class=True, cache_dir=str(tmp_path))  # a fresh decoration, as in a new process
    warm.warm(4)
    assert warm.fn.forward.compile_stats["path"] == "warm"
    assert warm.fn.forward.compile_stats["direct_replay"] == "on"
    with ca.counters.expect(full_graph_direct_steps=1), torch.no_grad():
        assert_matches_eager(warm.eager, warm.fn, warm.builder, warm.caches, warm.decode(4), warm.inputs, pad_to=4)


def test_config_off_always_runs_dynamos_code(simulated_graphs):
    s = Setup(direct=False)
    s.warm(2)
    with ca.counters.expect(full_graph_direct_steps=0, full_graph_steps=1):
        s.step(s.decode(2))
    assert s.fn.compile_stats["direct_replay"].startswith("off")


def test_moved_inputs_raise_rather_than_replay_stale_memory(simulated_graphs):
    """After a size's first replay the ordinary path no longer checks addresses; the shortcut
    sees the move and refuses, naming the argument, where a replay would read the old buffer."""
    s = Setup()
    s.warm(4)
    seqs = s.decode(4)
    md = s.builder.build(seqs, pad_to=4)
    ids, pos = s.inputs(4)
    with torch.no_grad(), ca.set_forward_context(md, s.caches):
        for i, moved in enumerate(((ids.clone(), pos), (ids, pos.clone()))):
            with pytest.raises(CudaGraphAddressError, match=f"argument {i} was at 0x"):
                s.fn(*moved)
        with ca.counters.expect(full_graph_direct_steps=1):
            s.fn(ids, pos)


def test_mixed_step_at_a_captured_size_is_not_a_full_replay(simulated_graphs):
    s = Setup()
    s.warm(4)
    seqs = s.decode(2, prefill=2)  # 4 tokens, not a uniform decode
    with ca.counters.expect(full_graph_direct_steps=0, full_graph_steps=0, cudagraph_replays=1), torch.no_grad():
        assert_matches_eager(s.eager, s.fn, s.builder, s.caches, seqs, s.inputs, pad_to=4)


def test_other_builder_or_caches_still_raise(simulated_graphs):
    s = Setup()
    s.warm(4)
    with pytest.raises(CudaGraphAddressError, match="another metadata builder"):
        s.step(s.decode(4), builder=s.new_builder())
    other = dict(s.caches)
    layer = next(iter(other))
    old = other[layer]
    other[layer] = ca.KVCache(old.key_cache.clone(), old.value_cache.clone(), old.spec)
    with pytest.raises(CudaGraphAddressError, match="or a layer's cache replaced in it"):
        s.step(s.decode(4), caches=other)
    # A copy of the mapping holds the very caches the graphs read: served (after its own path's check).
    with ca.counters.expect(full_graph_direct_steps=0, full_graph_steps=1):
        s.step(s.decode(4), caches=dict(s.caches))
    with ca.counters.expect(full_graph_direct_steps=1):
        s.step(s.decode(4))


def test_changed_arguments_still_raise_recompile_error(simulated_graphs):
    s = Setup()
    s.warm(4)
    md = s.builder.build(s.decode(4), pad_to=4)
    ids, pos = s.inputs(4)
    with ca.set_forward_context(md, s.caches):
        with torch.no_grad(), pytest.raises(RecompileError, match="dtype"):
            s.fn(ids.to(torch.int32), pos)
        with pytest.raises(RecompileError, match="grad mode"):
            s.fn(ids, pos)
        with torch.no_grad(), ca.counters.expect(full_graph_direct_steps=1):
            s.fn(ids, pos)


_log: list = []


class Logging(OPTForCausalLM):
    """A forward with a side effect Dynamo replays in its code after the graph."""

    def forward(self, input_ids, positions):
        _log.append(1)
        return super().forward(input_ids, positions)


class Returning(OPTForCausalLM):
    """Returns an input besides the graph's output: not built of the graph's outputs alone."""

    def forward(self, input_ids, positions):
        return super().forward(input_ids, positions), positions


class Listing(OPTForCausalLM):
    def forward(self, input_ids, positions):
        h = super().forward(input_ids, positions)
        return [h, (h + 1, None)]


def test_side_effects_keep_dynamos_code(simulated_graphs):
    s = Setup(Logging)
    s.warm(2)
    assert s.fn.compile_stats["direct_replay"] != "on"
    _log.clear()
    with ca.counters.expect(full_graph_direct_steps=0, full_graph_steps=1):
        s.step(s.decode(2))
    assert _log  # Dynamo's code ran and replayed the append


def test_output_not_built_of_graph_outputs_is_not_learned(simulated_graphs):
    s = Setup(Returning)
    s.warm(2)
    assert s.fn.compile_stats["direct_replay"] == "on" and not s.fn._site.direct.learned
    with ca.counters.expect(full_graph_direct_steps=0, full_graph_steps=1):
        out = s.step(s.decode(2))
    assert out[1] is s.inputs.positions[:2] or out[1].data_ptr() == s.inputs.positions.data_ptr()


def test_list_outputs_are_rebuilt_per_call(simulated_graphs):
    s = Setup(Listing)
    s.warm(2)
    with ca.counters.expect(full_graph_direct_steps=2):
        a = s.step(s.decode(2))
        b = s.step(s.decode(2))
    assert type(a) is list and a is not b and a[0] is b[0] and a[1][0] is b[1][0] and a[1][1] is None
    torch.testing.assert_close(a[1][0], a[0] + 1)


# -- parameters and buffers replaced after capture (compilation/module_watch.py) -------------------

def _changed_state(model) -> dict:
    """``model``'s state with layer 0's fc1 weight redrawn."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    key = "model.layers.0.fc1.weight"
    state[key] = torch.randn(state[key].shape, generator=torch.Generator().manual_seed(7)) * 0.2
    return state


def _assign_attribute(model, state):
    model.model.layers[0].fc1.weight = torch.nn.Parameter(state["model.layers.0.fc1.weight"].clone(),
                                                          requires_grad=False)


def _load_assigned(model, state):
    model.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)


def _new_submodule(model, state):
    old = model.model.layers[0].fc1
    new = torch.nn.Linear(old.in_features, old.out_features).requires_grad_(False)
    new.load_state_dict({"weight": state["model.layers.0.fc1.weight"], "bias": old.bias})
    model.model.layers[0].fc1 = new


REPLACEMENTS = {"attribute": _assign_attribute, "load_state_dict_assign": _load_assigned,
                "submodule": _new_submodule}


def _same_step(a: Setup, b: Setup, seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """One step run by ``a`` and by ``b`` from ``a``'s cache state and on the same inputs."""
    n = a.padded(seqs)
    saved = snapshot(a.caches)
    restore(b.caches, saved)
    ids, pos = a.inputs(n)
    b.inputs.ids[:n].copy_(ids)
    b.inputs.positions[:n].copy_(pos)
    outs = []
    for s, args in ((a, (ids, pos)), (b, (b.inputs.ids[:n], b.inputs.positions[:n]))):
        md = s.builder.build(seqs, pad_to=n)
        with torch.no_grad(), ca.set_forward_context(md, s.caches):
            outs.append(s.fn(*args).clone())
    restore(a.caches, saved)
    return outs[0], outs[1]


@pytest.mark.parametrize("replace", sorted(REPLACEMENTS))
def test_a_replaced_parameter_is_captured_again_and_served(simulated_graphs, caplog, replace):
    """Graphs captured with the old parameter would replay its memory: after a replacement every
    graph is dropped and captured again with the new one, on the direct path as on the ordinary."""
    s = Setup()
    s.warm(4)
    pieces = sum(not p.is_splitting_op for p in s.fn.runtimes[0].pieces)
    mixed = s.decode(2, prefill=2)  # 4 tokens, not a uniform decode: the piece graphs
    s.step(mixed)
    with ca.counters.expect(full_graph_direct_steps=1):
        s.step(s.decode(4))
    state = _changed_state(s.model)
    for model in (s.model, s.eager):
        REPLACEMENTS[replace](model, state)
    with torch.no_grad():
        with caplog.at_level("INFO", logger="compileattn"), ca.counters.expect(
                parameter_recaptures=1, module_rechecks=1, cudagraph_captures=1, full_graph_direct_steps=0):
            assert_matches_eager(s.eager, s.fn, s.builder, s.caches, s.decode(4), s.inputs, pad_to=4)
        named = "embed_tokens_parameters_weight_ (and 27 more)" if replace == "load_state_dict_assign" else "fc1"
        assert named in caplog.text and "replaced since this model's CUDA graphs were captured" in caplog.text
        with ca.counters.expect(parameter_recaptures=0, cudagraph_captures=pieces):
            assert_matches_eager(s.eager, s.fn, s.builder, s.caches, mixed, s.inputs, pad_to=4)
        for direct in (0, 1):  # the new graph's first replay teaches the shortcut, which then replays it
            with ca.counters.expect(cudagraph_captures=0, full_graph_direct_steps=direct):
                assert_matches_eager(s.eager, s.fn, s.builder, s.caches, s.decode(4), s.inputs, pad_to=4)
    pool = s.fn.runtimes[0].pool
    assert not pool.retired  # the graphs captured since keep the pool alive: the dropped ones are let go
    fresh = Setup()  # compiled with the new weights from the start
    fresh.model.load_state_dict(state)
    fresh.warm(4)
    fresh.step(mixed)
    for seqs in (s.decode(4), mixed):
        with ca.counters.expect(cudagraph_captures=0):
            replaced, compiled_fresh = _same_step(s, fresh, seqs)
        torch.testing.assert_close(replaced, compiled_fresh)


def test_a_parameter_updated_in_place_is_served_without_a_recheck(simulated_graphs):
    s = Setup()
    s.warm(4)
    state = _changed_state(s.model)
    with torch.no_grad():
        for model in (s.model, s.eager):
            model.model.layers[0].fc1.weight.copy_(state["model.layers.0.fc1.weight"])
        with ca.counters.expect(module_rechecks=0, cudagraph_captures=0, full_graph_direct_steps=1):
            assert_matches_eager(s.eager, s.fn, s.builder, s.caches, s.decode(4), s.inputs, pad_to=4)


def test_a_parameter_replaced_in_another_module_drops_no_graph(simulated_graphs):
    s = Setup()
    s.warm(4)
    s.step(s.decode(2, prefill=2))
    runtime = s.fn.runtimes[0]
    graphs = runtime.full_graph_count(), runtime.piece_graph_count()
    other = torch.nn.Linear(4, 4)
    other.weight = torch.nn.Parameter(torch.zeros(4, 4))
    with torch.no_grad():
        with ca.counters.expect(module_rechecks=1, parameter_recaptures=0, cudagraph_captures=0,
                                full_graph_direct_steps=0):
            assert_matches_eager(s.eager, s.fn, s.builder, s.caches, s.decode(4), s.inputs, pad_to=4)
        with ca.counters.expect(module_rechecks=0, full_graph_direct_steps=1):  # the graph it learned stands
            assert_matches_eager(s.eager, s.fn, s.builder, s.caches, s.decode(4), s.inputs, pad_to=4)
    assert (runtime.full_graph_count(), runtime.piece_graph_count()) == graphs


class Scaled(OPTForCausalLM):
    """A forward that reads a (persistent) buffer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, self.config.hidden_size))

    def forward(self, input_ids, positions):
        return super().forward(input_ids, positions) * self.scale


def test_a_buffer_replaced_alone_raises_until_put_back(simulated_graphs):
    """The direct path compares the buffers as the ordinary path does: it must not replay the old one either."""
    s = Setup(Scaled)
    s.warm(4)
    with ca.counters.expect(full_graph_direct_steps=1):
        s.step(s.decode(4))
    old = s.model.scale
    s.model.scale = old * 2
    for _ in range(2):
        with pytest.raises(CudaGraphAddressError, match="scale.*buffer replaced after capture"):
            s.step(s.decode(4))
    s.model.scale = old
    with ca.counters.expect(cudagraph_captures=0, full_graph_direct_steps=0):
        s.step(s.decode(4))
    with ca.counters.expect(full_graph_direct_steps=1):
        s.step(s.decode(4))


@pytest.mark.parametrize("other", ["new size", "mixed step"])
def test_a_buffer_replaced_alone_raises_after_a_step_of_another_size_or_mode(simulated_graphs, other):
    """A step of a size or mode with no graphs yet compares only what it captures now: the full
    graph of another size still reads the old buffer, and its direct replay must not resume."""
    s = Setup(Scaled)
    s.eager = Scaled(OPTConfig.tiny(), seed=0)
    s.warm(4)
    with ca.counters.expect(full_graph_direct_steps=1):
        s.step(s.decode(4))
    new = s.model.scale * 2
    s.model.scale = new
    s.eager.scale = new.clone()
    with torch.no_grad():
        s.step(s.decode(8) if other == "new size" else s.decode(2, prefill=2))
        for _ in range(2):
            with pytest.raises(CudaGraphAddressError, match="scale"):
                assert_matches_eager(s.eager, s.fn, s.builder, s.caches, s.decode(4), s.inputs, pad_to=4)


def test_a_buffer_replaced_with_the_parameters_is_served(simulated_graphs):
    """``load_state_dict(..., assign=True)`` replaces the buffers too: the graphs captured again read them."""
    s = Setup(Scaled)
    s.eager = Scaled(OPTConfig.tiny(), seed=0)
    s.warm(4)
    state = _changed_state(s.model)
    state["scale"] = torch.linspace(2.0, -1.0, s.model.config.hidden_size)
    with torch.no_grad():
        for model in (s.model, s.eager):
            _load_assigned(model, state)
        with ca.counters.expect(parameter_recaptures=1, cudagraph_captures=1):
            assert_matches_eager(s.eager, s.fn, s.builder, s.caches, s.decode(4), s.inputs, pad_to=4)
        for direct in (0, 1):
            with ca.counters.expect(cudagraph_captures=0, full_graph_direct_steps=direct):
                assert_matches_eager(s.eager, s.fn, s.builder, s.caches, s.decode(4), s.inputs, pad_to=4)



class Shifted(OPTForCausalLM):
    """A forward that reads a tensor held in a plain attribute (neither a parameter nor a buffer)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shift = torch.linspace(-1.0, 1.0, self.config.hidden_size)

    def forward(self, input_ids, positions):
        return super().forward(input_ids, positions) + self.shift


def _rebind_attribute(model, new):
    model.shift = new


def _assign_data(model, new):
    model.shift.data = new


@pytest.mark.parametrize("move", [_rebind_attribute, _assign_data],
                         ids=["attribute rebound", "attribute.data assigned"])
def test_a_plain_attribute_tensor_moved_after_capture_raises_on_the_direct_path_too(simulated_graphs, move):
    """A tensor in a plain attribute is a graph input the full graph reads by address, and no
    registration tells it moved: the ordinary path raises (``dispatch._check_addresses``), so the
    direct replay must not return the graph's answer computed from the old tensor."""
    s = Setup(Shifted, decorate_class=True)
    s.warm(4)
    with ca.counters.expect(full_graph_direct_steps=1):
        s.step(s.decode(4))
    move(s.model, s.model.shift * 2)
    for _ in range(2):
        with pytest.raises(CudaGraphAddressError, match="shift"):
            s.step(s.decode(4))


def test_a_closure_tensor_rebound_after_capture_raises_on_the_direct_path_too(simulated_graphs):
    s = Setup()
    model, shift = s.model, [torch.linspace(-1.0, 1.0, s.model.config.hidden_size)]

    def forward(input_ids, positions):
        return model(input_ids, positions) + shift[0]

    s.fn = ca.compile(forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=s.config)
    s.warm(4)
    with ca.counters.expect(full_graph_direct_steps=1):
        s.step(s.decode(4))
    shift[0] = shift[0] * 2
    for _ in range(2):
        with pytest.raises(CudaGraphAddressError):
            s.step(s.decode(4))

# -- the bytecode check, on hand-written functions shaped like Dynamo's code ------------------------

class _Utils:
    @staticmethod
    def record_pregraph_bytecode_enter():
        return None

    @staticmethod
    def record_pregraph_bytecode_exit(cm):
        return None

    @staticmethod
    def call_size(x, i):
        return x.size(i)


_holder = type("Holder", (), {})()


def _gathers(x, m):
    tmp = __import_torch_dot__dynamo_dot_utils.record_pregraph_bytecode_enter()  # noqa: F821
    s0 = __import_torch_dot__dynamo_dot_utils.call_size(x, 0)  # noqa: F821
    w = m._modules["lin"]._parameters["weight"]
    __import_torch_dot__dynamo_dot_utils.record_pregraph_bytecode_exit(tmp)  # noqa: F821
    out = __compiled_fn_1(w, s0, x)  # noqa: F821
    return out[0], [out[1]]


def _stores_attr(x, m):
    out = __compiled_fn_1(x)  # noqa: F821
    m.calls = 1
    return out[0]


def _calls_a_method(x, m):
    out = __compiled_fn_1(x)  # noqa: F821
    m.log.append(1)
    return out[0]


def _calls_a_global(x, m):
    out = __compiled_fn_1(x)  # noqa: F821
    print(out)
    return out[0]


def _branches(x, m):
    out = __compiled_fn_1(x)  # noqa: F821
    return out[0] if m else out[1]


def _two_graphs(x, m):
    a = __compiled_fn_1(x)  # noqa: F821
    return __compiled_fn_2(a)  # noqa: F821


def _no_graph(x, m):
    return x


def test_bytecode_check_accepts_gathering_and_one_graph_call():
    graph = object()
    fn = _gathers
    fn.__globals__.update(__compiled_fn_1=graph, __import_torch_dot__dynamo_dot_utils=torch._dynamo.utils)
    try:
        assert replay.graph_call_of(fn) == (graph, "")
        fn.__globals__["__import_torch_dot__dynamo_dot_utils"] = _Utils
        assert replay.graph_call_of(fn)[0] is None  # the helpers must be torch's own
    finally:
        for name in ("__compiled_fn_1", "__import_torch_dot__dynamo_dot_utils"):
            fn.__globals__.pop(name, None)


@pytest.mark.parametrize("fn, why", [
    (_stores_attr, "STORE_ATTR"), (_calls_a_method, "method"), (_calls_a_global, "calls something other"),
    (_branches, "only straight-line"), (_two_graphs, "more than one graph"), (_no_graph, "calls no graph"),
])
def test_bytecode_check_refuses_anything_else(fn, why):
    graph, reason = replay.graph_call_of(fn)
    assert graph is None and why in reason
    assert replay.graph_call_of(lambda *a: None)[0] is None
    assert "plain function" in replay.graph_call_of(torch.nn.Linear(2, 2))[1]


def _cuda_compiled_opt():
    """A tiny fp16 OPT on the GPU, compiled with real CUDA graphs (Inductor pieces, the Triton
    backend): (model, caches, builder, compiled forward, persistent inputs)."""
    torch.manual_seed(0)
    config = ca.CompileConfig(cudagraph_mode="full_and_piecewise", max_capture_size=MAX_TOKENS,
                              attention_backend="triton")
    model = OPTForCausalLM(OPTConfig.tiny(), dtype=torch.float16, device="cuda", seed=0)
    caches = ca.allocate_kv_caches(model.attention_specs(), NUM_BLOCKS, BLOCK, dtype=torch.float16, device="cuda")
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_TOKENS,
                                          max_blocks_per_seq=4, device="cuda", backend="triton")

    def forward(input_ids, positions):
        return model(input_ids, positions)

    fn = ca.compile(forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=config)
    inputs = PersistentInputs(model.config.vocab_size, MAX_TOKENS, positions=(1, 40), device="cuda",
                              mark_dynamic=False)
    return model, caches, builder, fn, inputs


@pytest.mark.cuda
def test_cuda_direct_replays_match_eager():
    """Real CUDA graphs: direct replays from the second replay of each size on, each matching eager."""
    model, caches, builder, fn, inputs = _cuda_compiled_opt()
    rng = random.Random(0)
    direct = 0
    with torch.no_grad():
        for i in range(12):
            batch = [2, 4, 8][i % 3]
            seqs = [ca.SequenceStep(1, rng.randint(1, 40), [4 * j + k for k in range(4)]) for j in range(batch)]
            before = ca.counters.full_graph_direct_steps
            assert_matches_eager(model, fn, builder, caches, seqs, inputs, pad_to=batch)
            direct += ca.counters.full_graph_direct_steps - before
    assert fn.compile_stats["direct_replay"] == "on"
    assert direct == 6  # 4 steps per size: capture, first replay, then two direct


@pytest.mark.cuda
@pytest.mark.parametrize("replace", ["attribute", "load_state_dict_assign"])
def test_cuda_a_replaced_parameter_is_captured_again(replace):
    """Real CUDA graphs (Inductor pieces, the Triton backend), full-decode replays direct and
    piece graphs of a mixed step: a replaced weight is what the next steps compute with."""
    model, caches, builder, fn, inputs = _cuda_compiled_opt()
    eager = OPTForCausalLM(OPTConfig.tiny(), dtype=torch.float16, device="cuda", seed=0)
    rng = random.Random(0)

    def steps(count):
        for i in range(count):
            seqs = [ca.SequenceStep(1, rng.randint(1, 40), [4 * j + k for k in range(4)]) for j in range(4)]
            if i % 2:
                seqs = seqs[:2] + [ca.SequenceStep(2, 0, [8 + k for k in range(4)])]  # 4 tokens, mixed: pieces
            assert_matches_eager(eager, fn, builder, caches, seqs, inputs, pad_to=4)

    state = {k: v.clone() for k, v in model.state_dict().items()}
    key = "model.layers.0.fc1.weight"
    state[key] = torch.randn(state[key].shape, device="cuda", dtype=state[key].dtype) * 0.2
    with torch.no_grad():
        steps(1)
        # Landed first: a static piece landing between the steps below recaptures its size's
        # graph, which starts that size's direct replays anew (with 14 test workers on one H100,
        # S27-1, five steps held no direct replay).
        assert fn.wait_for_static_pieces(timeout=300)
        direct = ca.counters.full_graph_direct_steps
        steps(5)
        assert ca.counters.full_graph_direct_steps > direct
        for m in (model, eager):
            if replace == "attribute":
                m.model.layers[0].fc1.weight = torch.nn.Parameter(state[key].clone(), requires_grad=False)
            else:
                m.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
        with ca.counters.expect(parameter_recaptures=1):
            steps(5)
        pool = fn.runtimes[0].pool
        assert pool is not None and not pool.retired  # the recaptured graphs keep the pool alive
        for m in (model, eager):  # again: graphs retired and captured into the same pool once more
            m.model.layers[0].fc1.weight = torch.nn.Parameter(state[key] * 0.5, requires_grad=False)
        with ca.counters.expect(parameter_recaptures=1):
            steps(5)


def test_host_step_benchmark_runs_on_the_cpu(tmp_path, capsys):
    """``benchmarks/host_step.py``: both variants match eager, the direct one is taken, every row is timed."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "host_step.py"
    spec = importlib.util.spec_from_file_location("host_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu", "--calls", "20", "--rounds", "1", "-o", str(tmp_path / "hs")]) == 0
    res = json.loads((tmp_path / "hs.json").read_text())
    assert res["direct_replay"] == "on" and set(res["batches"]) == {"1", "8"}
    for row in res["batches"].values():
        assert row["direct_taken"] and set(row["us"]) == set(module.ROWS)


def test_host_step_benchmark_writes_each_batch_as_it_finishes(tmp_path, monkeypatch):
    """``benchmarks/host_step.py`` has no budget of its own and runs under a timeout in
    ``issue12_gpu.sh``: its result files are written after each batch, so a run killed during the
    next one keeps the batches it finished (here: killed right after the first, batch 8)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "host_step.py"
    spec = importlib.util.spec_from_file_location("host_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    measure = module.measure

    class Killed(Exception):
        pass

    def killed_after_first_batch(args, on_batch=None):
        def then_kill(res):
            on_batch(res)
            raise Killed

        return measure(args, on_batch=then_kill)

    monkeypatch.setattr(module, "measure", killed_after_first_batch)
    with pytest.raises(Killed):
        module.main(["--device", "cpu", "--calls", "20", "--rounds", "1", "-o", str(tmp_path / "hs")])
    res = json.loads((tmp_path / "hs.json").read_text())
    assert set(res["batches"]) == {"8"} and res["direct_replay"] == "on" and "env" in res
    assert "batch 8" in (tmp_path / "hs.md").read_text()


def test_steps_compiled_and_captured_under_inference_mode_replay_under_no_grad(simulated_graphs):
    """A warm-up under ``torch.inference_mode()`` and serving under ``torch.no_grad()`` (grad off
    in both, so one compile): the builder's buffers and what the captures allocated (the full
    graph's outputs, the piecewise graphs' outputs that the eager attention between them writes
    into), made by the first steps, were inference tensors that refused the later steps' writes."""
    s = Setup()
    rng = random.Random(5)

    def run(mode, prefill):
        seqs = s.decode(2, rng, prefill=prefill)
        with torch.inference_mode() if mode == "inference" else torch.no_grad():
            assert_matches_eager(s.eager, s.fn, s.builder, s.caches, seqs, s.inputs, pad_to=s.padded(seqs))

    for prefill in (0, 0, 0, 3, 3):  # compile, capture the full and the piecewise graphs, replay each
        run("inference", prefill)
    with ca.counters.expect(cudagraph_captures=0):
        for mode, prefill in [("no_grad", 0), ("no_grad", 3), ("inference", 0), ("no_grad", 0), ("inference", 3),
                              ("no_grad", 3)]:
            run(mode, prefill)
    assert s.fn.compile_stats["direct_replay"] == "on"


def test_a_model_its_caches_and_every_step_under_inference_mode(simulated_graphs):
    """Everything made and run under ``torch.inference_mode()``: the KV caches are inference tensors
    the pieces write into, so captures must run in inference mode too (allocating their tensors as
    normal ones outside it refused those writes)."""
    with torch.inference_mode():
        s = Setup()
        rng = random.Random(6)
        for prefill in (0, 0, 0, 3, 3, 0, 3):
            seqs = s.decode(2, rng, prefill=prefill)
            assert_matches_eager(s.eager, s.fn, s.builder, s.caches, seqs, s.inputs, pad_to=s.padded(seqs))
