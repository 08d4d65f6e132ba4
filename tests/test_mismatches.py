"""A call that disagrees with its step's metadata or caches is an error naming what disagrees,
never zero rows or a torch internal error. Each test says where its check runs, because a check
that reads values must not run per layer on the hot path:

- builder: ``AttentionMetadataBuilder.build``, once per step, on the host;
- context: ``set_forward_context``, once per (builder, caches) pair;
- eager op: the ``compileattn::attention`` op called through the dispatcher (no compile), per call;
- step: the compiled model's dispatcher, once per step (token count) or per set of caches;
- config: when the ``CompileConfig`` (or the AttentionSpec) is made;
- entry: the flash-attn-shaped public functions, before any kernel (tests/test_validation.py
  has the rest of those).
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

import compileattn as ca
from compileattn import AttentionMetadataBuilder, AttentionSpec, SequenceStep, allocate_kv_caches, set_forward_context
from compileattn.models.attention import Attention

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32)
BS, NB = 4, 16


def builder(**over):
    kw = dict(block_size=BS, num_blocks=NB, max_num_tokens=32, max_blocks_per_seq=4, backend="reference")
    kw.update(over)
    return AttentionMetadataBuilder(**kw)


class Layer(torch.nn.Module):
    def __init__(self, name="layer0"):
        super().__init__()
        self.attn = Attention(SPEC, layer_name=name)

    def forward(self, q, k, v):
        return self.attn(q, k, v)


def qkv(n, dtype=torch.float32):
    return (torch.randn(n, SPEC.num_heads * SPEC.head_dim, dtype=dtype),
            torch.randn(n, SPEC.num_kv_heads * SPEC.head_dim, dtype=dtype),
            torch.randn(n, SPEC.num_kv_heads * SPEC.head_dim, dtype=dtype))


TWO_TOKENS = [SequenceStep(1, 3, [0]), SequenceStep(1, 0, [1])]


def test_more_tokens_than_the_metadata_eager_op():
    """eager op: 5 tokens under 2-token metadata used to return rows 2-4 as zeros."""
    caches = allocate_kv_caches({"layer0": SPEC}, NB, BS, torch.float32)
    with set_forward_context(builder().build(TWO_TOKENS), caches), torch.no_grad():
        with pytest.raises(ValueError, match="query has 5 tokens but the step's metadata has num_tokens=2"):
            Layer()(*qkv(5))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_value_or_output_unlike_the_key_and_query_eager_op(backend):
    """eager op: a value of another head dim was written into the cache's rows (Triton), an output
    of one row for three tokens was written past its end."""
    caches = allocate_kv_caches({"layer0": SPEC}, NB, BS, torch.float16)
    q = torch.randn(2, SPEC.num_heads, SPEC.head_dim, dtype=torch.float16)
    k = torch.randn(2, SPEC.num_kv_heads, SPEC.head_dim, dtype=torch.float16)
    with set_forward_context(builder(backend=backend).build(TWO_TOKENS), caches), torch.no_grad():
        with pytest.raises(ValueError, match=r"value is \(2, 2, 16\) torch.float16, key is \(2, 2, 32\)"):
            torch.ops.compileattn.attention(q, k, k[..., :16].contiguous(), torch.empty_like(q), "layer0")
        with pytest.raises(ValueError, match=r"output is \(1, 4, 32\) .* must have the query's shape \(2, 4, 32\)"):
            torch.ops.compileattn.attention(q, k, k, torch.empty_like(q)[:1], "layer0")
        with pytest.raises(TypeError, match=r"key is torch.float32 but query is torch.float16"):
            torch.ops.compileattn.attention(q, k.float(), k.float(), torch.empty_like(q), "layer0")


def test_more_tokens_than_the_metadata_compiled():
    """step: the compiled model checks the graph inputs' token count against the metadata."""
    caches = allocate_kv_caches({"layer0": SPEC}, NB, BS, torch.float32)
    compiled = torch.compile(Layer(), backend="compileattn", options={"piece_compiler": "eager"})
    b = builder()
    with torch.no_grad():
        q, k, v = qkv(2)
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 0)
        with set_forward_context(b.build(TWO_TOKENS), caches):
            compiled(q, k, v)
        q, k, v = qkv(5)
        with set_forward_context(b.build(TWO_TOKENS), caches), pytest.raises(
                ValueError, match="called with 5 tokens, but the step's metadata has num_tokens=2"):
            compiled(q, k, v)


def test_two_sequences_writing_one_slot():
    """builder: a slot written twice in one step (here: two sequences given the same block)."""
    with pytest.raises(ValueError, match=r"sequences \[0, 1\] write cache slot 3 \(block 0, row 3\)"):
        builder().build([SequenceStep(1, 3, [0]), SequenceStep(1, 3, [0])])


def test_a_layer_name_without_a_cache_eager_and_compiled():
    """eager op and step: the name of the missing layer and the names the context has."""
    caches = allocate_kv_caches({"layer0": SPEC}, NB, BS, torch.float32)
    md = builder().build(TWO_TOKENS)
    with set_forward_context(md, caches), torch.no_grad():
        with pytest.raises(ValueError, match=r"layer_name='x'.*no entry for this layer.*\['layer0'\]"):
            Layer("x")(*qkv(2))
    compiled = torch.compile(Layer("x"), backend="compileattn", options={"piece_compiler": "eager"})
    with set_forward_context(md, caches), torch.no_grad(), pytest.raises(ValueError, match="layer_name='x'"):
        compiled(*qkv(2))


def test_half_activations_into_a_float_cache():
    """eager op (per call) and step (once per set of caches): a dtype mismatch is a TypeError that
    says what to do, not ``Index put requires the source and destination dtypes match``."""
    caches = allocate_kv_caches({"layer0": SPEC}, NB, BS, torch.float32)
    md = builder().build(TWO_TOKENS)
    model = Layer().to(torch.float16)
    with set_forward_context(md, caches), torch.no_grad():
        with pytest.raises(TypeError,
                           match="query is torch.float16 but the layer's KV cache takes torch.float32 queries"):
            model(*qkv(2, torch.float16))
    compiled = torch.compile(model, backend="compileattn", options={"piece_compiler": "eager"})
    with set_forward_context(md, caches), torch.no_grad(), pytest.raises(
            TypeError, match="runs in torch.float16 but its KV cache takes torch.float32 queries"):
        compiled(*qkv(2, torch.float16))


@pytest.mark.parametrize("capture_kv_write", [True, False])
def test_keys_of_other_kv_heads_than_the_cache_compiled(capture_kv_write):
    """step (once per set of caches): a model writing 2 KV heads into a cache whose spec has 1 (same
    query heads and head dim) is refused; Triton's prepared write took the key's head count as it
    came and wrote the second head over the next slot's row, and attention answered for 1 KV head."""
    caches = allocate_kv_caches({"layer0": AttentionSpec(num_heads=4, num_kv_heads=1, head_dim=32)}, NB, BS,
                                torch.float32)
    compiled = torch.compile(Layer(), backend="compileattn",
                             options={"piece_compiler": "eager", "capture_kv_write": capture_kv_write})
    with set_forward_context(builder(backend="triton").build(TWO_TOKENS), caches), torch.no_grad(), pytest.raises(
            ValueError, match="writes keys of 2 KV heads of 32, its KV cache's AttentionSpec has 1 of 32"):
        compiled(*qkv(2))


def test_activations_on_another_device_than_the_caches():
    """eager op (per call) and step (once per set of caches): the model on one device and its
    caches on another (meta here) is an error naming both, not a failure inside a kernel
    (``torch.nonzero`` on meta here; a pointer error in a GPU kernel)."""
    caches = allocate_kv_caches({"layer0": SPEC}, NB, BS, torch.float32, device="meta")
    md = builder(device="meta").build(TWO_TOKENS)
    with set_forward_context(md, caches), torch.no_grad():
        with pytest.raises(ValueError, match="query is on cpu but the layer's KV cache is on meta"):
            Layer()(*qkv(2))
    compiled = torch.compile(Layer(), backend="compileattn", options={"piece_compiler": "eager"})
    with set_forward_context(md, caches), torch.no_grad(), pytest.raises(
            ValueError, match="attention runs on cpu but its KV cache is on meta"):
        compiled(*qkv(2))


def test_a_cache_smaller_than_the_builder():
    """context: a cache with fewer blocks than the builder hands out (block tables could point
    past it: an IndexError deep in a kernel, or memory corruption on a GPU)."""
    caches = allocate_kv_caches({"layer0": SPEC}, NB - 4, BS, torch.float32)
    with pytest.raises(ValueError, match=r"kv_caches\['layer0'\] has 12 blocks, but .* num_blocks=16"):
        with set_forward_context(builder().build(TWO_TOKENS), caches):
            pass


@pytest.mark.parametrize("scale,error", [(-1.0, ValueError), (0.0, ValueError), (float("inf"), ValueError),
                                         (float("nan"), ValueError), ("0.1", TypeError)])
def test_attention_spec_scale(scale, error):
    """config: the softmax scale must be a finite positive float."""
    with pytest.raises(error, match="scale"):
        AttentionSpec(4, 2, 32, scale=scale)


def test_unknown_attention_backend_in_the_config():
    """config: at CompileConfig creation, and through torch.compile's options at the first call
    (Dynamo calls backends lazily; it wraps our ValueError in BackendCompilerFailed)."""
    with pytest.raises(ValueError, match=r"attention_backend='bogus' is unknown; choose from"):
        ca.CompileConfig(attention_backend="bogus")
    compiled = torch.compile(Layer(), backend="compileattn", options={"attention_backend": "bogus"})
    caches = allocate_kv_caches({"layer0": SPEC}, NB, BS, torch.float32)
    with set_forward_context(builder().build(TWO_TOKENS), caches), torch.no_grad(), pytest.raises(
            Exception, match="attention_backend='bogus' is unknown"):
        compiled(*qkv(2))


@pytest.mark.parametrize("options, error, match", [
    # a string is iterable: split into characters, it split nothing, and attention was captured
    (dict(splitting_ops="compileattn::attention"), TypeError, "splitting_ops must be a list of op names"),
    (dict(splitting_ops=["bogus"]), ValueError, "splitting_ops: 'bogus' is not an op name"),
    (dict(splitting_ops=["compileattn::atention"]), ValueError, "no op is registered as 'compileattn::atention'"),
    (dict(cudagraph_capture_sizes="16"), TypeError, "cudagraph_capture_sizes must be a list of positive ints"),
    (dict(cudagraph_capture_sizes=[2.5, 8]), TypeError, r"cudagraph_capture_sizes\[0\] must be an int, got 2.5"),
    (dict(compile_sizes=[2.9]), TypeError, r"compile_sizes\[0\] must be an int, got 2.9"),
    (dict(compile_sizes=8), TypeError, "compile_sizes must be a list of positive ints"),
    (dict(max_capture_size=2.5), TypeError, "max_capture_size must be an int"),
    (dict(compile_workers=2.0), TypeError, "compile_workers must be an int, got 2.0"),
    (dict(compile_workers=True), TypeError, "compile_workers must be an int, got True"),
    (dict(compile_workers=np.True_), TypeError, "compile_workers must be an int, got np.True_"),
    (dict(compile_workers="4"), ValueError, "compile_workers must be 'auto' or an int >= 0, got '4'"),
    (dict(compile_workers=-1), ValueError, "compile_workers must be >= 0, got -1"),
    (dict(disable="false"), TypeError, "disable must be a bool, got 'false'"),
    (dict(background_static_compiles="no"), TypeError, "background_static_compiles must be a bool"),
    (dict(inductor_options={"bogus_knob": 1}), ValueError, r"\['bogus_knob'\] are not torch._inductor.config"),
    # attributes of torch._inductor.config that are not settings: a method, an imported module, a
    # group of settings; patching them failed inside the first compile
    (dict(inductor_options={"patch": 1}), ValueError, r"\['patch'\] are not torch._inductor.config"),
    (dict(inductor_options={"os": 1}), ValueError, r"\['os'\] are not torch._inductor.config"),
    (dict(inductor_options={"triton": {}}), ValueError, r"\['triton'\] are not torch._inductor.config"),
    (dict(inductor_options=["max_autotune"]), TypeError, "inductor_options must be a dict"),
    (dict(cache_dir=5), TypeError, "cache_dir must be a path"),
])
def test_config_values_are_refused_by_type_and_name_at_creation(options, error, match):
    """config: each was accepted and converted (a float truncated, a string iterated, any truthy
    object a True), or failed only inside the first compile."""
    with pytest.raises(error, match=match):
        ca.CompileConfig(**options)


def test_a_config_is_checked_once_so_it_cannot_change_afterwards():
    """config: a value set after the check reached the compile unchecked (a negative
    max_capture_size left no capture sizes); a changed copy is checked again, and a list or dict
    the caller keeps is not the config's."""
    options, sizes = {"max_autotune": True}, [4, 2]
    config = ca.CompileConfig(cudagraph_capture_sizes=sizes, inductor_options=options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_capture_size = -5
    with pytest.raises(ValueError, match="max_capture_size must be >= 1"):
        dataclasses.replace(config, max_capture_size=-5)
    with pytest.raises(ValueError, match="max_capture_size must be >= 1"):
        ca.CompileConfig.from_options({"config": config, "max_capture_size": -5})
    options["bogus_knob"], sizes[0] = 1, 0
    assert config.inductor_options == {"max_autotune": True} and config.capture_sizes == [2, 4]


def test_a_configs_inductor_options_cannot_change_after_the_check():
    """The config is frozen, but its ``inductor_options`` dict took a setting added afterwards
    (``cfg.inductor_options["bogus_knob"] = 1``), which reached the compile unchecked. It is
    read-only now, and still a dict where it is read: the compile-cache key, a copy, a pickle."""
    import pickle

    config = ca.CompileConfig(inductor_options={"max_autotune": True})
    changes = (lambda o: o.__setitem__("bogus_knob", 1), lambda o: o.update(bogus_knob=1),
               lambda o: o.setdefault("bogus_knob", 1), lambda o: o.pop("max_autotune"),
               lambda o: o.__delitem__("max_autotune"), lambda o: o.clear(), lambda o: o.popitem())
    for change in changes:
        with pytest.raises(TypeError, match="cannot change after the config is made"):
            change(config.inductor_options)
    with pytest.raises(TypeError, match="cannot change"):
        config.inductor_options |= {"bogus_knob": 1}
    assert config.inductor_options == {"max_autotune": True} and isinstance(config.inductor_options, dict)
    plain = ca.CompileConfig(inductor_options={"max_autotune": True})
    object.__setattr__(plain, "inductor_options", {"max_autotune": True})
    assert config.hash() == plain.hash()  # the compile-cache key of a plain dict
    loaded = pickle.loads(pickle.dumps(config))
    assert loaded == config and loaded.hash() == config.hash()
    assert dataclasses.replace(config, max_capture_size=8).inductor_options == {"max_autotune": True}


def test_config_takes_numpy_integers_as_ints():
    """config: numpy's integers (a count read from an array) and 0-dim integer tensors are ints (argtypes.py)."""
    workers = ca.CompileConfig(compile_workers=np.int64(2)).compile_workers
    assert workers == 2 and type(workers) is int
    assert ca.CompileConfig(compile_workers=torch.tensor(0)).compile_workers == 0


def test_config_takes_nested_inductor_settings_and_overload_names():
    ca.CompileConfig(inductor_options={"triton.cudagraphs": False, "max_autotune": True},
                     splitting_ops=["compileattn::attention.default", "compileattn::attend"])


def test_unknown_option_names_itself():
    with pytest.raises(TypeError, match=r"unknown compileattn option\(s\) \['piece_compilr'\]"):
        ca.CompileConfig.from_options({"piece_compilr": "eager"})


def test_inference_only_backward_raises_naming_the_op_and_forward_does_not_warn():
    """The README example without torch.no_grad(): no autograd warning on forward; a backward
    through attention raises naming the op instead of silently treating it as a constant."""
    caches = allocate_kv_caches({"layer0": SPEC}, NB, BS, torch.float32)
    lin = torch.nn.Linear(8, SPEC.num_heads * SPEC.head_dim + 2 * SPEC.num_kv_heads * SPEC.head_dim)
    with set_forward_context(builder().build(TWO_TOKENS), caches):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            q, k, v = lin(torch.randn(2, 8)).split([128, 64, 64], dim=-1)
            out = Layer()(q, k, v.contiguous())
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="compileattn::attention is inference-only"):
        out.sum().backward()


def test_attention_left_out_of_splitting_ops_under_cuda_graphs_is_refused():
    """step (at the first call): with ``splitting_ops`` leaving the attention op in a piece, a
    CUDA-graph mode would capture it with the step it read at capture and replay that step's
    lengths and launch for later steps of the same size; refused naming the op. Without graphs
    the same configuration runs (and matches eager)."""
    from compileattn.testing import simulated_cuda_graphs

    caches = allocate_kv_caches({"layer0": SPEC}, NB, BS, torch.float32)
    options = {"piece_compiler": "eager", "splitting_ops": []}
    with simulated_cuda_graphs():
        compiled = torch.compile(Layer(), backend="compileattn", options=options)
        with set_forward_context(builder().build(TWO_TOKENS), caches), torch.no_grad(), pytest.raises(
                Exception, match=r"would capture \['compileattn::attention'\] inside a piece's CUDA graph"):
            compiled(*qkv(2))
    torch._dynamo.reset()
    model, inputs = Layer(), qkv(2)
    compiled = torch.compile(model, backend="compileattn", options={**options, "cudagraph_mode": "none"})
    with set_forward_context(builder().build(TWO_TOKENS), caches), torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
