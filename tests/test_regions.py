"""Repeated decoder layers traced once (nested compile regions, compilation/regions.py): the
backend flattens them into the graph a flat trace gives, every layer keeps its own weights,
constants and KV cache, and a model whose layers cannot share a region is traced flat."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import compileattn as ca
from compileattn import _torch_compat, layer_ids
from compileattn.compilation import regions
from compileattn.kv_cache import AttentionSpec
from compileattn.models.attention import Attention
from compileattn.models.llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM
from compileattn.passes import inline_regions
from compileattn.testing import PersistentInputs, assert_matches_eager, assert_matches_eager_over_steps, random_step

BLOCK, NUM_BLOCKS = 4, 128
H, KVH, D = 2, 1, 32
SPEC = AttentionSpec(H, KVH, D)
#: torch 2.13 traces a region once and reuses it where its guards hold; 2.11 traces every call and
#: keeps one subgraph per distinct graph (``_torch_compat.compile_region``), so compileattn uses
#: regions only on the former. The tests force them on any torch with ``nested_compile_region``
#: (``forced_regions``): flattening, layer ids and names are the same code; only the counts of
#: traced subgraphs and the reuse limit are torch's and differ.
REUSES_TRACE = _torch_compat.compile_region() is not None


@pytest.fixture(autouse=True)
def forced_regions(monkeypatch):
    monkeypatch.setattr(_torch_compat, "compile_region", lambda: torch.compiler.nested_compile_region)


def subgraphs(expected: int) -> dict:
    """``counters.expect`` arguments for ``expected`` distinct subgraphs, where torch says how many."""
    return {"region_subgraphs": expected} if REUSES_TRACE else {}


def _steps(eager, compiled, make_inputs, steps=3, seed=0):
    caches = ca.allocate_kv_caches(eager.attention_specs(), NUM_BLOCKS, BLOCK, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=256,
                                          max_blocks_per_seq=32)
    rng = random.Random(seed)
    with torch.no_grad():
        for _ in range(steps):
            seqs = random_step(rng, num_seqs=rng.randint(2, 5), block_size=BLOCK, num_blocks=NUM_BLOCKS,
                               max_query_len=7, max_context_len=25)
            assert_matches_eager(eager, compiled, builder, caches, seqs, make_inputs)


def _llama(num_layers, compiled=True, **config):
    cls = LlamaForCausalLM
    if compiled:
        cls = ca.compile(type("CompiledLlama", (LlamaForCausalLM,), {}),
                         dynamic_arg_dims={"input_ids": 0, "positions": 0},
                         config=ca.CompileConfig(piece_compiler="eager", **config))
    return cls(LlamaConfig.tiny(num_layers=num_layers), seed=1)


def _llama_inputs(n):
    return torch.randint(0, 256, (n,)), torch.randint(0, 60, (n,))


def test_layers_traced_once_compile_the_pieces_a_flat_trace_compiles():
    eager, once, flat = _llama(6, compiled=False), _llama(6), _llama(6, trace_layers_once=False)
    forward = LlamaDecoderLayer.__dict__["forward"]
    with ca.counters.expect(dynamo_graphs=1, regions_inlined=6, **subgraphs(1)):
        _steps(eager, once, _llama_inputs)
    with ca.counters.expect(dynamo_graphs=1, regions_inlined=0):
        _steps(eager, flat, _llama_inputs)
    assert once.forward.compile_stats["regions"] == "on: LlamaDecoderLayer x6"
    assert flat.forward.compile_stats["regions"] == "off: config.trace_layers_once is False"
    # The trace's class patch and switch are gone: eager calls and other compiles see the model as is.
    assert LlamaDecoderLayer.__dict__["forward"] is forward and not layer_ids.tracing_regions
    a, b = once.forward.runtimes[0].compiled, flat.forward.runtimes[0].compiled
    assert list(a.signatures.values()) == list(b.signatures.values())
    assert list(a.layer_slots.values()) == list(b.layer_slots.values())
    assert [c.layer for c in a.splitting.values()] == [c.layer for c in b.splitting.values()] == \
        list(eager.attention_specs())


class Block(nn.Module):
    """A decoder-ish block whose residual scale is a per-layer Python constant: a value Dynamo
    guards, so blocks with different scales cannot share one traced region."""

    def __init__(self, index: int, scale: float):
        super().__init__()
        self.qkv = nn.Linear(H * D, (H + 2 * KVH) * D)
        self.attn = Attention(SPEC, f"blocks.{index}.attn")
        self.out = nn.Linear(H * D, H * D)
        self.scale = scale

    def forward(self, x):
        q, k, v = self.qkv(x).split([H * D, KVH * D, KVH * D], dim=-1)
        return x + self.scale * self.out(self.attn(q, k, v))


class Stack(nn.Module):
    def __init__(self, scales, block: type = Block):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(block(i, s) for i, s in enumerate(scales))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def attention_specs(self):
        return {block.attn.layer_name: SPEC for block in self.blocks}


def _stack(scales, block: type = Block):
    eager = Stack(scales, block)
    compiled = ca.compile(type("CompiledStack", (Stack,), {}), dynamic_arg_dims={"x": 0},
                          config=ca.CompileConfig(piece_compiler="eager"))(scales, block)
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def _stack_inputs(n):
    return (torch.randn(n, H * D),)


def test_layers_that_differ_in_a_constant_each_keep_theirs():
    """Alternating constants: two traced variants, each layer run with its own (a region reused
    without its guards would give every layer the first one's)."""
    eager, compiled = _stack([0.5, 2.0] * 3)
    with ca.counters.expect(dynamo_graphs=1, regions_inlined=6, **subgraphs(2)):
        _steps(eager, compiled, _stack_inputs)
    assert compiled.forward.compile_stats["regions"] == "on: Block x6"


def test_layers_that_cannot_share_a_region_are_traced_flat(caplog):
    """Ten variants, past torch 2.13's ``max_reuse_entries=8``: Dynamo raises, the decorator traces
    again flat. torch 2.11 traces every call anyway and keeps the ten subgraphs."""
    forward = Block.__dict__["forward"]
    eager, compiled = _stack([1.0 + i / 8 for i in range(10)])
    with caplog.at_level("INFO", logger="compileattn"), ca.counters.expect(
            dynamo_graphs=1, regions_inlined=0 if REUSES_TRACE else 10):
        _steps(eager, compiled, _stack_inputs)
    why = compiled.forward.compile_stats["regions"]
    if REUSES_TRACE:
        assert why.startswith("off: ") and "reuse" in why
        assert "tracing it flat" in caplog.text
    else:
        assert why == "on: Block x10"
    assert Block.__dict__["forward"] is forward and not layer_ids.tracing_regions


def test_regions_only_where_torch_reuses_their_trace_and_for_the_default_backend(monkeypatch):
    monkeypatch.setattr(_torch_compat, "compile_region", lambda: None)
    eager, compiled = _stack([1.0] * 3)
    with ca.counters.expect(regions_inlined=0):
        _steps(eager, compiled, _stack_inputs, steps=1)
    why = compiled.forward.compile_stats["regions"]
    assert why == f"off: torch {torch.__version__} traces every region call again (nothing saved)"
    monkeypatch.undo()
    other = ca.compile(type("EagerStack", (Stack,), {}), dynamic_arg_dims={"x": 0}, backend="eager")([1.0] * 3)
    other.load_state_dict(eager.state_dict())
    with torch.no_grad():
        x = torch.randn(5, H * D)
        caches = ca.allocate_kv_caches(eager.attention_specs(), NUM_BLOCKS, BLOCK, dtype=torch.float32)
        builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=16,
                                              max_blocks_per_seq=4)
        with ca.set_forward_context(builder.build([ca.SequenceStep(5, 0, [0, 1])]), caches):
            other(x)
    assert other.forward.compile_stats["regions"] == "off: not the compileattn backend"


class InheritingBlock(Block):
    """A layer class without a forward of its own."""


def test_a_layer_class_that_inherits_forward_gets_it_back():
    eager, compiled = Stack([1.0] * 3), ca.compile(type("CompiledStack", (Stack,), {}), dynamic_arg_dims={"x": 0},
                                                    config=ca.CompileConfig(piece_compiler="eager"))([1.0] * 3)
    for stack in (eager, compiled):
        stack.blocks = nn.ModuleList(InheritingBlock(i, 1.0) for i in range(3))
    compiled.load_state_dict(eager.state_dict())
    with ca.counters.expect(regions_inlined=3):
        _steps(eager, compiled, _stack_inputs, steps=1)
    assert compiled.forward.compile_stats["regions"] == "on: InheritingBlock x3"
    assert "forward" not in InheritingBlock.__dict__ and InheritingBlock.forward is Block.__dict__["forward"]


class ReshapingStack(Stack):
    def forward(self, x):
        return super().forward(x.view(-1, 7))  # fails before any layer for hidden sizes not divisible by 7


def test_model_errors_outside_the_layers_are_not_traced_again_flat(caplog):
    compiled = ca.compile(type("CompiledReshaping", (ReshapingStack,), {}), dynamic_arg_dims={"x": 0},
                          config=ca.CompileConfig(piece_compiler="eager"))([1.0] * 3)
    with caplog.at_level("INFO", logger="compileattn"), pytest.raises(Exception) as raised:
        _steps(Stack([1.0] * 3), compiled, _stack_inputs, steps=1)
    assert "tracing it flat" not in caplog.text and "invoke_subgraph" not in str(raised.value)


def test_model_errors_inside_a_layer_are_not_traced_again_flat(caplog):
    """A shape error in a layer's region is the model's (a fake-tensor error), not the region's."""
    eager, compiled = _stack([1.0] * 3)
    compiled.blocks[1].qkv = nn.Linear(H * D, H * D)  # q, k, v no longer fit: the split fails
    with caplog.at_level("INFO", logger="compileattn"), pytest.raises(Exception) as raised:
        _steps(eager, compiled, _stack_inputs, steps=1)
    assert "tracing it flat" not in caplog.text and "invoke_subgraph" not in str(raised.value)


def test_a_list_of_attention_layers_is_not_a_list_of_decoder_layers():
    model = nn.Module()
    model.attn = nn.ModuleList(Attention(SPEC, f"a.{i}") for i in range(3))
    assert regions.repeated_layers(model) == {}


def test_repeated_layers_are_lists_of_one_class_holding_attention():
    model = _llama(3, compiled=False)
    assert regions.repeated_layers(model) == {LlamaDecoderLayer: 3}
    mixed = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU()])
    plain = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])  # no attention inside
    assert regions.repeated_layers(nn.ModuleDict({"a": mixed, "b": plain})) == {}


def test_nested_regions_flatten_and_compute_the_same():
    inner = torch.compiler.nested_compile_region(lambda x: x.sin() * 2)

    @torch.compiler.nested_compile_region
    def outer(x):
        return inner(x) + inner(x + 1)

    def f(x):
        return outer(x) + outer(x * 3)

    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    x = torch.randn(6)
    torch.compile(f, backend=record, fullgraph=True)(x)
    gm, example_inputs = graphs[0]
    flat, calls, subgraphs = inline_regions(gm, example_inputs, layer_ids.name_of)
    assert (calls, subgraphs) == (4, 2)  # outer twice here, inner twice in outer's one subgraph
    assert not any(n.target is torch.ops.higher_order.invoke_subgraph for n in flat.graph.nodes)
    assert not list(flat.children())
    torch.testing.assert_close(flat(*example_inputs)[0], f(x))


def test_a_layer_id_that_is_not_a_graph_input_is_refused():
    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    layer_id = graph.call_function(torch.zeros, ((),), {"dtype": torch.int64})
    graph.call_function(torch.ops.compileattn.attention_by_id.default, (q, q, q, q, layer_id))
    graph.output(None)
    gm = torch.fx.GraphModule(nn.Module(), graph)
    with pytest.raises(ValueError, match="its layer_id is not an input of the graph"):
        inline_regions(gm, [torch.zeros(1, 2, 32)], layer_ids.name_of)


def _graphs_from_regions(device: str, dtype: torch.dtype) -> None:
    """Pieces and CUDA graphs (piecewise, and full graphs for the decode steps) compiled from a
    trace with regions match eager. Inputs are views of persistent buffers, as an engine feeds
    a model replayed from graphs (a full graph reads its inputs where it captured them)."""
    config = ca.CompileConfig(cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32], compile_sizes=(),
                              piece_compiler="inductor" if device == "cuda" else "eager")
    cls = ca.compile(type("GraphLlama", (LlamaForCausalLM,), {}), dynamic_arg_dims={"input_ids": 0, "positions": 0},
                     config=config)
    model = cls(LlamaConfig.tiny(num_layers=4), dtype=dtype, device=device, seed=1)
    eager = LlamaForCausalLM(LlamaConfig.tiny(num_layers=4), dtype=dtype, device=device, seed=1)
    caches = ca.allocate_kv_caches(eager.attention_specs(), NUM_BLOCKS, BLOCK, dtype=dtype, device=device)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=64,
                                          max_blocks_per_seq=32, device=device)
    make_inputs = PersistentInputs(256, 64, positions=(0, 60), device=device)
    full_steps = ca.counters.full_graph_steps
    with ca.counters.expect(dynamo_graphs=1, regions_inlined=4), torch.no_grad():
        assert_matches_eager_over_steps(eager, model, builder, caches, make_inputs, steps=8, seed=1, num_seqs=(2, 4),
                                        max_query_len=7, max_context_len=25, capture_sizes=config.capture_sizes)
    assert ca.counters.full_graph_steps - full_steps >= 4  # the decode steps ran full graphs
    assert model.forward.compile_stats["regions"] == "on: LlamaDecoderLayer x4"


def test_layers_traced_once_match_eager_through_simulated_graphs(simulated_graphs):
    _graphs_from_regions("cpu", torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_layers_traced_once_match_eager_through_cuda_graphs(dtype):
    _graphs_from_regions("cuda", dtype)


def test_the_warm_start_key_does_not_see_layer_id_values():
    """Layer ids are indices in registration order, which differs between processes that build
    other models first: the warm-start key (the model's fingerprint) must not print them."""
    from compileattn.compilation.warm_start import module_fingerprint
    from compileattn.hf.attention import BINDING_ATTR, LayerBinding

    holder = nn.Module()
    setattr(holder, BINDING_ATTR, LayerBinding("layers.0", SPEC))
    own = Attention(SPEC, "layers.0")
    text = "\n".join([*module_fingerprint(holder), *module_fingerprint(own)])
    assert "layers.0" in text and f"tensor({int(own.layer_id)})" not in text
    assert "layer_id=Tensor((),torch.int64,cpu)" in text  # shape, dtype, device only


def test_a_renamed_layer_gets_the_id_of_its_new_name():
    from compileattn.hf.attention import LayerBinding

    attn, binding = Attention(SPEC, "old.attn"), LayerBinding("old.attn", SPEC)
    attn.layer_name, binding.name = "new.attn", "new.attn"
    assert layer_ids.name_of(attn.layer_id) == layer_ids.name_of(binding.layer_id) == "new.attn"


def test_regions_the_backend_cannot_flatten_are_traced_flat(monkeypatch, caplog):
    from compileattn.compilation import piecewise
    from compileattn.passes import RegionInlineError

    def refusing(gm, example_inputs, layer_of_id):
        if any(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes):
            raise RegionInlineError("a subgraph this pass cannot flatten")
        return inline_regions(gm, example_inputs, layer_of_id)

    monkeypatch.setattr(piecewise, "inline_regions", refusing)
    eager, compiled = _stack([1.0] * 3)
    with caplog.at_level("INFO", logger="compileattn"), ca.counters.expect(dynamo_graphs=1, regions_inlined=0):
        _steps(eager, compiled, _stack_inputs, steps=2)
    assert compiled.forward.compile_stats["regions"] == "off: RegionInlineError: a subgraph this pass cannot flatten"
    assert "tracing it flat" in caplog.text
