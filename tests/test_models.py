"""Model families: configs, tracing under torch.compile, and numerics against independent oracles."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from compileattn import SequenceStep
from compileattn.kv_cache import AttentionSpec
from compileattn.models.attention import Attention
from compileattn.engine import Engine
from compileattn.models.llama import LlamaConfig, LlamaForCausalLM
from compileattn.models.opt import OPTConfig, OPTForCausalLM

ATTENTION_TARGETS = {torch.ops.compileattn.attention, torch.ops.compileattn.attention.default}

MODELS = {
    "llama": lambda **kw: LlamaForCausalLM(LlamaConfig.tiny(**kw)),
    "opt": lambda **kw: OPTForCausalLM(OPTConfig.tiny(**kw)),
}


def make_engine(model, **kw):
    kw.setdefault("num_blocks", 32)
    kw.setdefault("max_num_tokens", 64)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("block_size", 4)  # small blocks: sequences span and interleave several
    return Engine(model, **kw)


class RecordingBackend:
    """A torch.compile backend that keeps every FX graph Dynamo hands it and runs it as is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def attention_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ATTENTION_TARGETS]


# -- configs ---------------------------------------------------------------------------------------

def test_presets_have_the_published_shapes():
    c = LlamaConfig.llama3_8b()
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (4096, 32, 32, 8, 128)
    assert (c.intermediate_size, c.vocab_size) == (14336, 128256)
    o = OPTConfig.opt_125m()
    assert (o.hidden_size, o.num_layers, o.num_heads, o.head_dim) == (768, 12, 12, 64)
    assert (o.ffn_dim, o.vocab_size, o.max_position) == (3072, 50272, 2048)


@pytest.mark.parametrize("make, match", [
    (lambda: LlamaConfig.tiny(head_dim=48), "head_dim"),
    (lambda: LlamaConfig.tiny(num_heads=6, num_kv_heads=4), "divisible"),
    (lambda: LlamaConfig.tiny(sliding_window=-2), "sliding_window"),
    (lambda: OPTConfig.tiny(num_heads=3), "divisible"),
    (lambda: OPTConfig.tiny(num_heads=4, hidden_size=64), "head_dim"),  # head dim 16
])
def test_bad_configs_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make, error, match", [
    (lambda: LlamaConfig.tiny(rope_theta=0), ValueError, "rope_theta"),  # inv_freq inf: NaN RoPE
    (lambda: LlamaConfig.tiny(rope_theta=-10000.0), ValueError, "rope_theta"),
    (lambda: LlamaConfig.tiny(rms_norm_eps=float("nan")), ValueError, "rms_norm_eps"),
    (lambda: LlamaConfig.tiny(rms_norm_eps=-1.0), ValueError, "rms_norm_eps"),
    (lambda: LlamaConfig.tiny(rope_theta="1e4"), TypeError, "rope_theta"),
    (lambda: OPTConfig.tiny(layer_norm_eps=float("inf")), ValueError, "layer_norm_eps"),
    (lambda: LlamaConfig.tiny(hidden_size=64.5), TypeError, "hidden_size"),  # failed later in nn.Linear
    (lambda: LlamaConfig.tiny(num_heads=4.0), TypeError, "num_heads"),
    (lambda: LlamaConfig.tiny(num_layers=True), TypeError, "num_layers"),
    (lambda: LlamaConfig.tiny(sliding_window=4.0), TypeError, "sliding_window"),
    (lambda: OPTConfig.tiny(num_heads=2.0), TypeError, "num_heads"),
])
def test_configs_refuse_non_int_sizes_and_non_finite_settings(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_configs_take_numpy_sizes_as_ints():
    np = pytest.importorskip("numpy")
    c = LlamaConfig.tiny(num_layers=np.int64(1), sliding_window=np.int32(8))
    assert type(c.num_layers) is int and type(c.sliding_window) is int
    assert LlamaConfig.tiny(num_layers=np.int64(1)) == LlamaConfig.tiny(num_layers=1)
    assert type(OPTConfig.tiny(num_heads=np.int64(2)).num_heads) is int


def test_model_rejects_foreign_config():
    with pytest.raises(TypeError, match="config"):
        LlamaForCausalLM(OPTConfig.tiny())


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("dtype", ["float16", torch.float64, torch.int32])
def test_model_refuses_a_dtype_the_attention_op_does_not_run_naming_it(family, dtype):
    # A string went to nn.Module.to as a device ("Invalid device string: 'float16'").
    cls, config = (LlamaForCausalLM, LlamaConfig.tiny()) if family == "llama" else (OPTForCausalLM, OPTConfig.tiny())
    with pytest.raises(TypeError, match="dtype"):
        cls(config, dtype=dtype)


@pytest.mark.parametrize("family", MODELS)
def test_weights_are_deterministic_in_the_seed(family):
    cfg = LlamaConfig.tiny() if family == "llama" else OPTConfig.tiny()
    cls = LlamaForCausalLM if family == "llama" else OPTForCausalLM
    a, b, c = cls(cfg, seed=1), cls(cfg, seed=1), cls(cfg, seed=2)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not all(torch.equal(pa[k], pc[k]) for k in pa)
    assert not any(p.requires_grad for p in a.parameters())
    w = pa["model.embed_tokens.weight"]
    assert 0.015 < w.std().item() < 0.025


@pytest.mark.parametrize("family", MODELS)
def test_attention_specs_name_the_attention_modules(family):
    model = MODELS[family](num_layers=3)
    specs = model.attention_specs()
    modules = {name: m for name, m in model.named_modules() if isinstance(m, Attention)}
    assert list(specs) == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert set(specs) == set(modules)  # the cache key is the module path
    assert all(modules[n].spec == s for n, s in specs.items())


@pytest.mark.parametrize("q, k", [
    ((2, 3, 128), (2, 3, 64)),  # a RuntimeError from view()
    ((128,), (64,)),
    ((2, 128), (2, 1, 64)),     # k was folded into (2, 2, 32) and attended
])
def test_attention_layer_refuses_inputs_not_tokens_by_features(q, k):
    attn = Attention(AttentionSpec(4, 2, 32), "x.attn")
    with pytest.raises(ValueError, match=r"x\.attn: expected q \(tokens, 128\) and k/v \(tokens, 64\)"):
        attn(torch.zeros(q), torch.zeros(k), torch.zeros(k))


# -- tracing ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", MODELS)
def test_fullgraph_trace_has_one_attention_node_per_layer(family):
    model = MODELS[family](num_layers=3)
    backend = RecordingBackend()
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True)
    engine = make_engine(model, forward=compiled)  # marks the token dim dynamic
    engine.run_step([SequenceStep(3, 0, [0]), SequenceStep(5, 0, [1, 2])], list(range(8)),
                    [0, 1, 2, 0, 1, 2, 3, 4])
    # Another token count, with a cached prefix: the dynamic token dim must not recompile.
    engine.run_step([SequenceStep(1, 3, [0]), SequenceStep(4, 5, [1, 2, 3])], list(range(5)),
                    [3, 5, 6, 7, 8])
    assert len(backend.graphs) == 1
    nodes = attention_nodes(backend.graphs[0])
    assert [n.args[4] for n in nodes] == list(model.attention_specs())
    for node in nodes:
        q, k, v, out = (a.meta["example_value"] for a in node.args[:4])
        assert all(t.is_contiguous() for t in (q, k, v, out)), node.args[4]


# -- numerics --------------------------------------------------------------------------------------

def dense_attention(self, q, k, v):
    """Causal SDPA over the whole (single-sequence) batch: an oracle independent of the paged op."""
    s = self.spec
    n = q.shape[0]
    q = q.view(n, s.num_heads, s.head_dim).transpose(0, 1)
    k = k.view(n, s.num_kv_heads, s.head_dim).transpose(0, 1).repeat_interleave(s.group_size, 0)
    v = v.view(n, s.num_kv_heads, s.head_dim).transpose(0, 1).repeat_interleave(s.group_size, 0)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s.scale)
    return o.transpose(0, 1).reshape(n, s.num_heads * s.head_dim)


@pytest.mark.parametrize("family", MODELS)
def test_prefill_matches_dense_attention(family, monkeypatch):
    model = MODELS[family]()
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(23)
    engine = make_engine(model)
    paged = engine.run_step([SequenceStep(23, 0, list(range(6)))], ids, pos).clone()
    with monkeypatch.context() as mp:
        mp.setattr(Attention, "forward", dense_attention)
        with torch.no_grad():
            dense = model(ids, pos)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", MODELS)
def test_chunked_prefill_and_decode_match_one_prefill(family):
    """Chunks over a cached prefix, then token-by-token decode, give the rows one prefill gives:
    checks cache writes, positions (RoPE / learned) and bottom-right causal alignment together."""
    model = MODELS[family]()
    ids = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(1))
    whole = make_engine(model).run_step([SequenceStep(19, 0, [0, 1, 2, 3, 4])], ids, torch.arange(19)).clone()
    engine = make_engine(model)
    table = [7, 3, 11, 5, 9]  # scattered blocks
    rows = []
    for start, end in ((0, 6), (6, 15), (15, 16), (16, 17), (17, 19)):
        seq = SequenceStep(end - start, start, table)
        rows.append(engine.run_step([seq], ids[start:end], torch.arange(start, end)).clone())
    torch.testing.assert_close(torch.cat(rows), whole, atol=1e-5, rtol=1e-5)


def mixed_script(engine, sampler_seed=0):
    """Queue prompts so that steps mix decodes, whole prefills and chunked prefills; tokens come from
    a fixed stream (not argmax), so two engines see identical inputs even if their logits differ."""
    g = torch.Generator().manual_seed(sampler_seed)
    for n in (7, 20, 1, 13, 30):
        engine.add_request(torch.randint(0, 256, (n,), generator=g).tolist(), 4)
    counters = {}

    def fixed(logits, seq_ids):
        out = []
        for s in seq_ids:
            counters[s] = counters.get(s, 0) + 1
            out.append((31 * s + 17 * counters[s]) % 256)
        return out
    return fixed


@pytest.mark.parametrize("family", MODELS)
def test_inductor_matches_eager_on_mixed_batches(family):
    model = MODELS[family]()
    eager = make_engine(model)
    compiled = make_engine(model, forward=torch.compile(model.forward, backend="inductor", fullgraph=True),
                           pad_fn=lambda n: -(-n // 8) * 8)  # no size-1 steps: one dynamic graph
    fe, fc = mixed_script(eager), mixed_script(compiled)
    kinds = set()
    while eager.has_unfinished():
        a = eager.step(16, fe)
        b = compiled.step(16, fc)
        assert a.kinds == b.kinds and a.sampled == b.sampled
        kinds.update(a.kinds)
        torch.testing.assert_close(b.hidden, a.hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
    assert kinds == {"decode", "prefill", "chunked_prefill"}
    assert not compiled.has_unfinished()


def test_sliding_window_changes_long_context_only():
    """The config's window reaches the attention spec: rows within the window match full attention,
    rows past it differ."""
    full = LlamaForCausalLM(LlamaConfig.tiny())
    windowed = LlamaForCausalLM(LlamaConfig.tiny(sliding_window=4))
    assert all(s.sliding_window == 4 for s in windowed.attention_specs().values())
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(2))
    a = make_engine(full).run_step([SequenceStep(12, 0, [0, 1, 2])], ids, torch.arange(12)).clone()
    b = make_engine(windowed).run_step([SequenceStep(12, 0, [0, 1, 2])], ids, torch.arange(12)).clone()
    torch.testing.assert_close(a[:5], b[:5])
    assert not torch.allclose(a[5:], b[5:], atol=1e-4)


def test_dataclass_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LlamaConfig.tiny().num_layers = 3
