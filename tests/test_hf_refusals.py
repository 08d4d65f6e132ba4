"""What compileattn cannot serve is refused at load, with the reason; what a model asks for at run
time is checked against the spec its cache was allocated for; loading is offline and pickle-free."""
import pytest
import torch
import transformers as T

import compileattn as ca
from compileattn.engine import Engine
from compileattn.hf.attention import BINDING_ATTR, AttentionMismatchError, LayerBinding
from compileattn.hf.model import HFCausalLM, UnsupportedModelError
from compileattn.refusals import ServingRefused
from hf_families import VOCAB, byte_level_tokenizer, hf_greedy, load_reference, prompts, save_family

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1)


def build(config):
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config) if not config.is_encoder_decoder else \
        T.T5ForConditionalGeneration(config)


@pytest.mark.parametrize("config, reason", [
    (T.LlamaConfig(head_dim=16, **TINY), "head_dim=16 is not supported"),
    (T.Gemma3TextConfig(head_dim=32, use_bidirectional_attention=True, **TINY), "not causal"),
    (T.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=2), "does not route attention"),
    (T.GptOssConfig(head_dim=32, num_local_experts=2, num_experts_per_tok=1, **TINY), r"\['s_aux'\]"),
    (T.LlamaConfig(head_dim=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, **TINY),
     "rope_type='dynamic', which recomputes its frequencies .* torch.compile cannot trace"),
    # Phi-3.5's: its generate() re-encodes the whole cache when a sequence crosses the switch
    (T.Phi3Config(max_position_embeddings=64, pad_token_id=0, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
        "original_max_position_embeddings": 16}, **TINY),
     "rope_type='longrope', which switches from its short to its long frequencies .* a short sequence would get a "
     "long one's frequencies"),
    (T.Qwen2Config(layer_types=["full_attention", "linear_attention"], **TINY), r"\['linear_attention'\]"),
    (T.T5Config(vocab_size=VOCAB, d_model=64, d_kv=32, d_ff=128, num_layers=1, num_heads=2), "encoder-decoder"),
    # Their sliding windows are in the mask only, not in the attention call: served, they attended
    # every key and generated other tokens than their own generate().
    (T.Qwen2MoeConfig(use_sliding_window=True, sliding_window=6, max_window_layers=2, num_experts=2,
                      num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32, **TINY),
     r"model\.layers\.0\.self_attn: its attention mask is not .*window_left=-1.* hides keys \[0\]"),
    (T.PhimoeConfig(sliding_window=6, num_local_experts=2, num_experts_per_tok=1, **TINY),
     r"model\.layers\.0\.self_attn: its attention mask is not .*window_left=-1.* hides keys \[0\]"),
    # V's head dim differs from Q's (MLA): the probe failed in o_proj (a RuntimeError) before refusing it
    (T.DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2,
                        num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=64),
     r"value \(1, 2, 3, 64\): only self-attention with one head dim is served"),
    # Positions from the cache length, position_ids dropped: served, a step's second sequence and
    # every decode token got the wrong learned positions (other tokens than its generate())
    (T.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                  decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, is_encoder_decoder=False),
     r"BartForCausalLM does not place tokens by position_ids: model\.decoder\.layers\.0\.self_attn's query"),
    # A window in transformers' cache only (config.sliding_window, no layer_types), not in the
    # attention call or the mask: its generate() attended the last 6 keys in decode steps and every
    # key in prefill; served, it attended every key throughout (other tokens than its generate())
    (T.MoshiConfig(sliding_window=6, **TINY),
     r"model\.layers\.0\.self_attn: transformers' cache for this config is a sliding window of 6 keys .*"
     r"window_left=-1\): the model's own generate\(\) applies that window in decode steps only"),
    # Its NoPE layer's query scale comes from the token's index in the row (and the cache's length),
    # not from position_ids: served, tokens past floor_scale would get another position's scale
    (T.Llama4TextConfig(head_dim=32, intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1,
                        no_rope_layers=[1, 0], attention_chunk_size=None, layer_types=["full_attention"] * 2,
                        floor_scale=8, **TINY),
     r"Llama4ForCausalLM uses attn_temperature_tuning, .* index in the row"),
    # Its cos/sin scale (short_mscale or long_mscale) follows the longest position in the forward,
    # whatever its rope_type: served, a short sequence packed with one past original_max_position_embeddings
    # got the long scale, and its own generate() re-encodes its whole cache when a sequence crosses it
    (T.PhimoeConfig(sliding_window=None, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=64,
                    rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "short_mscale": 1.0,
                                     "long_mscale": 1.6, "original_max_position_embeddings": 16}, **TINY),
     r"PhimoeForCausalLM's position encoding depends on more than each token's position: model\.layers\.0\.self_attn's "
     r"query at positions 0\.\.2 changes when a sequence at positions 61\.\.63 is packed into the same row"),
], ids=["head-dim", "bidirectional", "alibi-bloom", "attention-sinks", "dynamic-rope", "longrope-phi3", "linear-attention", "t5",
        "window-in-mask-only-qwen2-moe", "window-in-mask-only-phimoe", "mla-value-head-dim",
        "positions-not-from-position-ids-bart", "window-in-cache-only-moshi", "attn-temperature-tuning-llama4",
        "max-position-dependent-mscale-phimoe"])
def test_unservable_models_are_refused_with_the_reason(config, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        HFCausalLM(build(config))


@pytest.mark.parametrize("config", [
    T.CohereConfig(logit_scale=0.0625, **TINY),
    T.GraniteConfig(logits_scaling=16.0, **TINY),
    T.HyperCLOVAXConfig(head_dim=32, logits_scaling=0.5, **TINY),
], ids=lambda config: config.model_type)
def test_a_logit_transform_compileattn_does_not_repeat_is_refused(config, monkeypatch):
    """``compute_logits`` repeats only the post-lm_head transforms in ``LOGIT_TRANSFORMS``; the
    load-time check compares it with the model's own logits. Without these families' entries (a
    family whose transform is not listed) they are refused; with HyperCLOVA X taken for Granite
    (the same ``logits_scaling``, which it multiplies by), too."""
    import compileattn.hf.model as hf_model

    model = build(config)
    HFCausalLM(model)  # served with the entries
    softcap_only = tuple(t for t in hf_model.LOGIT_TRANSFORMS if t.op == "softcap")
    monkeypatch.setattr(hf_model, "LOGIT_TRANSFORMS", softcap_only)
    reason = rf"{type(model).__name__}'s forward transforms its logits after lm_head in a way compileattn does not " \
             r"reproduce .*compute_logits applies none of the transforms"
    with pytest.raises(UnsupportedModelError, match=reason):
        HFCausalLM(build(config))
    if config.model_type == "hyperclovax":
        monkeypatch.setattr(hf_model, "LOGIT_TRANSFORMS", softcap_only + (
            hf_model.LogitTransform("logits_scaling", "divide", ("granite", "hyperclovax")),))
        with pytest.raises(UnsupportedModelError, match=r"compute_logits applies \['divide'\]"):
            HFCausalLM(build(config))


def test_a_cache_window_no_sequence_reaches_is_served():
    """Moshi's checkpoints window their cache at max_position_embeddings: no sequence is longer,
    so the window never drops a key its attention would see."""
    HFCausalLM(build(T.MoshiConfig(sliding_window=64, max_position_embeddings=64, **TINY)))


def test_a_model_that_calls_attention_differently_than_bound_fails_loudly(tmp_path):
    directory = save_family("mistral", tmp_path / "m")
    llm = ca.LLM(str(directory), compile_config=None, block_size=4, num_blocks=32, max_num_batched_tokens=32)
    layer = llm.model.hf.get_submodule("model.layers.1.self_attn")
    binding = getattr(layer, BINDING_ATTR)
    spec = binding.spec
    wrong = ca.AttentionSpec(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale, sliding_window=-1)
    setattr(layer, BINDING_ATTR, LayerBinding(binding.name, wrong))
    with pytest.raises(AttentionMismatchError, match="model.layers.1.self_attn: called with .* allocated for"):
        llm.generate(prompts()[1], 2, use_tqdm=False)
    assert not llm.engine.has_unfinished()  # the failed call left the engine usable
    # Compiled: the same check runs once, at trace time.
    with pytest.raises(Exception, match="allocated for"):  # compiles on a warm-up step
        Engine(llm.model, num_blocks=32, max_num_tokens=32, max_num_seqs=4, block_size=4,
               compile_config=ca.CompileConfig(piece_compiler="eager"))


def test_pickled_weights_need_allow_pickle_and_nothing_is_downloaded(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = save_family("llama", tmp_path / "bin")
    torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="allow_pickle=True"):
        ca.LLM(str(directory), compile_config=None, num_blocks=16)
    with pytest.raises(TypeError, match="allow_pickle must be a bool, got 'False'"):  # was read as a truth value
        ca.LLM(str(directory), compile_config=None, num_blocks=16, allow_pickle="False")
    # Another safetensors file is not the model's weights (it was taken for them: transformers then
    # refused the directory with an OSError that did not name allow_pickle).
    save_file({"lora_A": torch.zeros(2, 2)}, directory / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="only pickled weights .*allow_pickle=True"):
        ca.LLM(str(directory), compile_config=None, num_blocks=16)
    llm = ca.LLM(str(directory), compile_config=None, num_blocks=16, allow_pickle=True)
    assert llm.generate(prompts()[0], 4, use_tqdm=False)[0].token_ids == hf_greedy(
        load_reference(save_family("llama", tmp_path / "safe")), prompts()[0], 4)[0]
    # An adapter beside the model: with peft installed transformers would load it (pickled weights
    # too, and the base model its config names) unchecked.
    adapted = save_family("llama", tmp_path / "adapted")
    (adapted / "adapter_config.json").write_text('{"peft_type": "LORA", "base_model_name_or_path": "x"}')
    with pytest.raises(ValueError, match="holds an adapter .*merge_and_unload"):
        ca.LLM(str(adapted), compile_config=None, num_blocks=16)
    with pytest.raises(FileNotFoundError, match="does not exist .*nothing is downloaded"):
        ca.LLM("meta-llama/Llama-3-8B", compile_config=None)
    with pytest.raises(FileNotFoundError, match="is a file, not a directory"):
        ca.LLM(str(directory / "config.json"), compile_config=None)


def test_a_safetensors_index_naming_pickled_shards_needs_allow_pickle(tmp_path):
    """transformers reads the shards a ``model.safetensors.index.json`` names by their own suffix:
    ``use_safetensors=True`` picked the index and a ``*.bin`` shard was unpickled without
    ``allow_pickle``. A sharded safetensors checkpoint is served."""
    import json

    from safetensors.torch import load_file

    sharded = tmp_path / "sharded"
    T.AutoModelForCausalLM.from_pretrained(save_family("llama", tmp_path / "whole")).save_pretrained(
        sharded, max_shard_size="100KB")
    assert not (sharded / "model.safetensors").exists() and (sharded / "model.safetensors.index.json").is_file()
    expected = hf_greedy(load_reference(tmp_path / "whole"), prompts()[0], 4)[0]
    assert ca.LLM(str(sharded), compile_config=None, num_blocks=16).generate(
        prompts()[0], 4, use_tqdm=False)[0].token_ids == expected

    directory = save_family("llama", tmp_path / "pickled-shards")
    weights = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    torch.save(weights, directory / "model-00001-of-00001.bin")
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: "model-00001-of-00001.bin" for name in weights}}))
    with pytest.raises(ValueError, match=r"names shards that are not safetensors \(model-00001-of-00001\.bin\).*"
                                         r"allow_pickle=True"):
        ca.LLM(str(directory), compile_config=None, num_blocks=16)
    llm = ca.LLM(str(directory), compile_config=None, num_blocks=16, allow_pickle=True)
    assert llm.generate(prompts()[0], 4, use_tqdm=False)[0].token_ids == expected


def test_weights_a_config_names_are_the_ones_checked(tmp_path):
    """``transformers_weights`` in config.json is the one file transformers reads, before
    ``model.safetensors`` and whatever ``use_safetensors`` says; ``adapter_model.bin`` it unpickles.
    Named there, pickled weights beside a ``model.safetensors`` were loaded without
    ``allow_pickle``, and safetensors weights under another name were refused as no weights."""
    import json

    from safetensors.torch import load_file

    def name_weights(directory, filename):
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "transformers_weights": filename}))

    expected = hf_greedy(load_reference(save_family("llama", tmp_path / "reference")), prompts()[0], 4)[0]
    directory = save_family("llama", tmp_path / "pickled")
    torch.save(load_file(directory / "model.safetensors"), directory / "adapter_model.bin")
    save_family("llama", tmp_path / "other", seed=1)  # other weights in model.safetensors: not the ones read
    (tmp_path / "other" / "model.safetensors").replace(directory / "model.safetensors")
    name_weights(directory, "adapter_model.bin")
    with pytest.raises(ValueError, match=r"names pickled weights \(transformers_weights='adapter_model\.bin'\).*"
                                         r"allow_pickle=True"):
        ca.LLM(str(directory), compile_config=None, num_blocks=16)
    llm = ca.LLM(str(directory), compile_config=None, num_blocks=16, allow_pickle=True)
    assert llm.generate(prompts()[0], 4, use_tqdm=False)[0].token_ids == expected

    renamed = save_family("llama", tmp_path / "renamed")
    (renamed / "model.safetensors").replace(renamed / "weights.safetensors")
    name_weights(renamed, "weights.safetensors")
    llm = ca.LLM(str(renamed), compile_config=None, num_blocks=16)
    assert llm.generate(prompts()[0], 4, use_tqdm=False)[0].token_ids == expected


@pytest.mark.parametrize("change, refused", [
    ("drop", r"has no weights for model\.layers\.1\.self_attn\.q_proj\.weight"),
    ("add", r"holds weights the model has no place for: model\.layers\.1\.self_attn\.bogus\.weight"),
])
def test_a_checkpoint_whose_keys_do_not_match_the_model_is_refused(tmp_path, change, refused):
    """transformers left a missing weight random (the model generated other tokens) and dropped an
    unexpected one, logging it only."""
    from safetensors.torch import load_file, save_file

    directory = save_family("llama", tmp_path / change)
    weights = load_file(directory / "model.safetensors")
    if change == "drop":
        del weights["model.layers.1.self_attn.q_proj.weight"]
    else:
        weights["model.layers.1.self_attn.bogus.weight"] = torch.zeros(2, 2)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ServingRefused, match=refused):  # the directory's mistake, by type
        ca.LLM(str(directory), compile_config=None, num_blocks=16)


@pytest.mark.parametrize("config, refused", [
    ('{"model_type": "nope"}', "has model type `nope` but Transformers does not recognize this architecture"),
    ("{not json", "is not a valid JSON file"),
    ("{}", "Should have a `model_type` key in its config.json"),
    ('{"model_type": "vit"}', r"config\.json is a ViTConfig \(model_type 'vit'\), which has no causal language "
                              r"model in transformers"),
], ids=["unknown-model-type", "not-json", "no-model-type", "not-a-causal-lm"])
def test_a_config_transformers_refuses_is_a_typed_refusal(tmp_path, config, refused):
    """transformers' refusal of the directory's config.json (a ValueError or an OSError out of its
    load) is the directory's mistake: a ``ServingRefused`` with transformers' message, told by type
    from a failure of the load."""
    (tmp_path / "config.json").write_text(config)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    with pytest.raises(ServingRefused, match=refused):
        ca.LLM(str(tmp_path), compile_config=None, num_blocks=16)


def test_the_refusals_of_a_model_are_serving_refusals_and_value_errors(tmp_path):
    """One type for "these arguments or this model cannot be served", which the refusals of a
    model and of a layer's configuration are too; still ValueErrors for callers catching those.
    A KV-cache budget that holds no block is one as well."""
    from compileattn.backends.selector import UnsupportedConfigurationError

    for error in (ServingRefused, UnsupportedModelError, UnsupportedConfigurationError):
        assert issubclass(error, ServingRefused) and issubclass(error, ValueError)
    with pytest.raises(ServingRefused, match="holds no block"):
        ca.LLM(str(save_family("llama", tmp_path / "m")), compile_config=None, kv_cache_memory=1)


def test_string_prompts_use_the_directory_tokenizer(tmp_path):
    directory = save_family("llama", tmp_path / "tok", vocab_size=256)
    byte_level_tokenizer().save_pretrained(directory)
    llm = ca.LLM(str(directory), compile_config=None, block_size=4, num_blocks=64)
    assert llm.tokenizer is not None
    out = llm.generate(["Hello, paged world", "ü"], 6, use_tqdm=False)
    reference = load_reference(directory)
    for o, text in zip(out, ["Hello, paged world", "ü"]):
        assert o.prompt == text and o.prompt_token_ids == llm.tokenizer.encode(text)
        assert o.token_ids == hf_greedy(reference, o.prompt_token_ids, 6)[0]
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    no_tokenizer = ca.LLM(llm.model.hf, compile_config=None, num_blocks=64)
    with pytest.raises(TypeError, match="no tokenizer"):
        no_tokenizer.generate("Hello")


@pytest.mark.parametrize("arguments, refused", [
    (dict(num_blocks=0), "num_blocks must be a positive int, got 0"),
    (dict(block_size=0), "block_size must be a positive int, got 0"),
    (dict(max_model_len=0), "max_model_len must be a positive int, got 0"),
    (dict(max_model_len=-5), "max_model_len must be a positive int, got -5"),
    (dict(attention_backend="bogus"), r"attention_backend='bogus' is unknown"),
    (dict(kv_cache_memory="1GB"), "kv_cache_memory must be a positive number of bytes, got '1GB'"),
    (dict(kv_cache_memory=0), "kv_cache_memory must be a positive number of bytes, got 0"),
    (dict(gpu_memory_utilization=5), r"gpu_memory_utilization must be in \(0, 1\], got 5"),
    (dict(device="bogus"), r"device='bogus' is not a device"),
    (dict(device="meta"), r"device='meta': compileattn serves on 'cpu' or 'cuda'"),
])
def test_bad_llm_arguments_are_named_before_the_model_loads(tmp_path, arguments, refused):
    """They divided by zero in the KV budget's log line, or were reported as a model the backends
    cannot serve."""
    with pytest.raises(ValueError, match=refused):
        ca.LLM(str(tmp_path / "not-loaded"), compile_config=None, **arguments)


def test_check_arguments_is_the_constructors_check_and_loads_nothing(tmp_path):
    """``LLM.check_arguments`` makes the constructor's checks of the arguments that need no model
    (the constructor calls it), so a caller can refuse them before anything loads; its defaults are
    the constructor's, and it returns the arguments normalized."""
    import inspect

    import numpy as np

    init = inspect.signature(ca.LLM.__init__).parameters
    for name, parameter in inspect.signature(ca.LLM.check_arguments).parameters.items():
        assert parameter.default == init[name].default, name
    with pytest.raises(ValueError, match="num_blocks must be a positive int, got 0"):
        ca.LLM.check_arguments(num_blocks=0)
    with pytest.raises(ValueError, match="pass kv_cache_memory or num_blocks, not both"):
        ca.LLM.check_arguments(num_blocks=4, kv_cache_memory=2**20)
    checked = ca.LLM.check_arguments(device="cpu", num_blocks=np.int64(8), max_model_len=np.int32(64),
                                     kv_cache_memory=None, allow_pickle=np.bool_(True))
    assert checked["device"] == torch.device("cpu")
    assert type(checked["num_blocks"]) is int and checked["num_blocks"] == 8
    assert type(checked["max_model_len"]) is int and checked["allow_pickle"] is True
    assert checked["block_size"] == 16 and checked["tensor_parallel_size"] == 1


def test_check_model_directory_refuses_what_load_model_refuses_without_loading(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from compileattn.hf.loading import check_model_directory

    directory = save_family("llama", tmp_path / "bin")
    torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()
    monkeypatch.setattr(T.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("check_model_directory loaded the model"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_directory(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        check_model_directory(str(tmp_path))
    with pytest.raises(ValueError, match="only pickled weights .*allow_pickle=True"):
        check_model_directory(directory)
    check_model_directory(directory, allow_pickle=True)
    with pytest.raises(ValueError, match="only pickled weights .*allow_pickle=True"):  # load_model's own check
        ca.LLM(str(directory), compile_config=None, num_blocks=16)


def test_only_the_selectors_refusal_is_reported_as_an_unsupported_model(tmp_path, monkeypatch):
    """Every ValueError out of the backend selection was an ``UnsupportedModelError``: a bug in a
    backend's check read as a model compileattn cannot serve. Only the selector's typed refusal is."""
    from compileattn.backends.reference import ReferenceBackend
    from compileattn.backends.selector import UnsupportedConfigurationError

    directory = save_family("llama", tmp_path / "m")
    monkeypatch.setattr(ReferenceBackend, "unsupported_reason", lambda self, *a, **k: "not this one")
    with pytest.raises(UnsupportedModelError, match=r"^model\.layers\.0\.self_attn: no attention backend runs "
                                                    r".*reference: not this one"):
        ca.LLM(str(directory), compile_config=None, num_blocks=16)
    assert issubclass(UnsupportedConfigurationError, ValueError)

    def bug(self, *args, **kwargs):
        raise ValueError("internal")

    monkeypatch.setattr(ReferenceBackend, "unsupported_reason", bug)
    with pytest.raises(ValueError, match="^internal$") as raised:
        ca.LLM(str(directory), compile_config=None, num_blocks=16)
    assert not isinstance(raised.value, UnsupportedModelError)


def test_cuda_without_cuda_is_refused_naming_the_device(tmp_path, monkeypatch):
    """torch's "Torch not compiled with CUDA enabled" came out of the load, naming no argument."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda': no CUDA device is available"):
        ca.LLM(str(tmp_path / "not-loaded"), compile_config=None, device="cuda")


def test_an_int_device_is_a_cuda_index(tmp_path, monkeypatch):
    """torch takes ``torch.device(0)`` as cuda:0; ``LLM(device=0)`` raised a TypeError. An int is
    checked as cuda:N (no CUDA here, an index this machine lacks); a bool is not an index."""
    from compileattn.argtypes import serving_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device=0: no CUDA device is available"):
        ca.LLM(str(tmp_path / "not-loaded"), compile_config=None, device=0)
    with pytest.raises(ValueError, match="device=-1 is not a device"):
        serving_device(-1)
    with pytest.raises(TypeError, match="device must be a torch.device"):
        ca.LLM(str(tmp_path / "not-loaded"), compile_config=None, device=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert serving_device(1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="device=2: this machine has 2 CUDA device"):
        serving_device(2)


def test_a_tokenizer_without_encode_and_decode_is_refused_before_the_model_loads(tmp_path):
    """It was accepted, and every request ran to its end before decoding the output failed."""
    with pytest.raises(TypeError, match="tokenizer must have encode"):
        ca.LLM(str(tmp_path / "not-loaded"), compile_config=None, tokenizer="not a tokenizer")


def test_check_requests_raises_what_generate_raises_and_runs_nothing(tmp_path, monkeypatch):
    llm = ca.LLM(str(save_family("qwen3", tmp_path / "q")), compile_config=None, num_blocks=16, block_size=4)
    monkeypatch.setattr(Engine, "run", lambda *a, **k: pytest.fail("check_requests ran the engine"))
    for call in (llm.check_requests, llm.generate):
        with pytest.raises(ValueError, match=rf"^prompts\[1\]: prompt token {VOCAB} out of range"):
            call([[1, 2], [3, VOCAB]], 2)
        with pytest.raises(ValueError, match=r"^prompts\[0\]: .*needs 65 positions > max_model_len 64"):
            call([[1] * 60], 6)
        with pytest.raises(ValueError, match="temperature"):
            call([1, 2], 2, temperature=-1.0)
    assert llm.check_requests([[1, 2], [3]], [4, 1], temperature=0.5, seed=3) is None
    assert not llm.engine.has_unfinished()


def test_bad_generate_arguments_raise_before_running(tmp_path):
    llm = ca.LLM(str(save_family("qwen3", tmp_path / "q")), compile_config=None, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([1, 2], 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate([1, 2], 2, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 2 prompts"):
        llm.generate([[1, 2], [3]], [4])
    with pytest.raises(ValueError, match=r"prompts\[1\]: .*max_model_len 64"):
        llm.generate([[1, 2], [3] * 60], 8)
    with pytest.raises(ValueError, match="kv_cache_memory or num_blocks"):
        ca.LLM(llm.model.hf, num_blocks=4, kv_cache_memory=1 << 20)
    with pytest.raises(TypeError, match="got a Tensor"):
        llm.generate(torch.tensor([1, 2]), 2)
    with pytest.raises(TypeError, match=r"stop_token_ids must be a sequence of token ids, got the int 5"):
        llm.generate([1, 2], 2, stop_token_ids=5)
    assert not llm.engine.has_unfinished()
    assert llm.generate([[1, 2], [3]], [0, 1], use_tqdm=False)[0].finish_reason == "length"
    # an iterator's prompts are read once, all of them (its first one was lost to a type test)
    assert len(llm.generate((p for p in [[1, 2], [3], [4, 5]]), 1, use_tqdm=False)) == 3
    with pytest.raises(TypeError, match="max_new_tokens must be an int or one int per prompt, got 4.0"):
        llm.generate([1, 2], 4.0)
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a string or a list of token ids"):
        llm.generate([[1, 2.0]], 2)
    # bytes and a dict were read as token ids (their bytes, its keys); None and an int failed inside
    for prompts_ in (None, 5, b"ab", {1: 2}):
        with pytest.raises(TypeError, match="prompts must be a string, a list of token ids"):
            llm.generate(prompts_, 2)
    with pytest.raises(TypeError, match="ignore_eos must be a bool"):
        llm.generate([1, 2], 2, ignore_eos="no")
    with pytest.raises(TypeError, match="temperature must be a number, got True"):
        llm.generate([1, 2], 2, temperature=True)
    with pytest.raises(TypeError, match="stop_token_ids must be a list of token ids"):
        llm.generate([1, 2], 2, stop_token_ids=[1.0])
    assert not llm.engine.has_unfinished()


def test_numpy_integers_are_token_ids_and_lengths(tmp_path):
    """As the engine's add_request takes them: a numpy array is one prompt, its integers token ids,
    and per-prompt lengths may be numpy integers (a flat array was split into one prompt per token,
    which then failed as "not iterable")."""
    import numpy as np

    llm = ca.LLM(str(save_family("qwen3", tmp_path / "q")), compile_config=None, num_blocks=16, block_size=4)
    expected = llm.generate([[1, 2, 3], [4]], [3, 2], use_tqdm=False)
    as_numpy = llm.generate([np.array([1, 2, 3]), np.array([4])], np.array([3, 2]), use_tqdm=False)
    assert [o.token_ids for o in as_numpy] == [o.token_ids for o in expected]
    flat = llm.generate(np.array([1, 2, 3]), np.int64(3), use_tqdm=False)
    assert len(flat) == 1 and flat[0].token_ids == expected[0].token_ids
    # stop tokens alike (an array or a tensor failed on its truth value)
    stop = [expected[0].token_ids[0]]
    stopped = llm.generate([1, 2, 3], 3, stop_token_ids=stop, ignore_eos=True, use_tqdm=False)[0].token_ids
    assert stopped == stop
    for as_array in (np.array(stop), torch.tensor(stop), [np.int64(stop[0])]):
        assert llm.generate([1, 2, 3], 3, stop_token_ids=as_array, ignore_eos=True,
                            use_tqdm=False)[0].token_ids == stopped


def test_numpy_sizes_and_sampling_numbers_are_taken(tmp_path):
    """The rule every public entry follows (``argtypes``): numpy's integers are ints, and a numpy
    float is a number. ``LLM``'s sizes refused ``np.int64(4)`` as "must be a positive int", and
    ``temperature``/``top_p`` refused ``np.float32`` as "must be a finite number" (``np.float64``,
    a float subclass, passed); ``generate``'s ``seed`` refused ``np.int64(3)``, which
    ``SamplingParams`` takes."""
    import numpy as np

    directory = save_family("qwen3", tmp_path / "q")
    sizes = dict(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32)
    llm = ca.LLM(str(directory), compile_config=None, **sizes)
    as_numpy = ca.LLM(str(directory), compile_config=None, **{k: np.int64(v) for k, v in sizes.items()})
    assert as_numpy.engine.max_model_len == 32 and as_numpy.engine.block_size == 4
    sample = dict(seed=3, use_tqdm=False)
    expected = llm.generate([[1, 2, 3], [4]], 4, temperature=0.5, top_p=0.75, **sample)
    for number in (np.float32, np.float64):
        got = as_numpy.generate([[1, 2, 3], [4]], 4, temperature=number(0.5), top_p=number(0.75), **sample)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    got = as_numpy.generate([[1, 2, 3], [4]], np.int64(4), temperature=0.5, top_p=0.75, seed=np.int64(3),
                            use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    params = ca.SamplingParams(max_new_tokens=np.int64(4), temperature=0.5, top_p=0.75, seed=np.int32(3),
                               stop_token_ids=[np.int64(7)])
    assert (type(params.max_new_tokens), type(params.seed), type(params.stop_token_ids[0])) == (int, int, int)


def test_a_tokenizer_whose_encode_gives_no_token_ids_is_named(tmp_path):
    """A ``tokenizers.Tokenizer`` has encode() and decode(), but its encode gives an ``Encoding``:
    generate failed with "'tokenizers.Encoding' object is not iterable", naming neither the
    tokenizer nor the prompt."""
    llm = ca.LLM(str(save_family("llama", tmp_path / "t", vocab_size=256)), compile_config=None, num_blocks=16,
                 tokenizer=byte_level_tokenizer().backend_tokenizer)
    with pytest.raises(TypeError, match=r"tokenizer\.encode\(prompts\[0\]\) gave Encoding, not token ids"):
        llm.generate("Hello", 2, use_tqdm=False)
    assert not llm.engine.has_unfinished()
