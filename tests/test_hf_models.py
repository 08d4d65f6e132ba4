"""Hugging Face models through compileattn.LLM: token for token what the model's own generate() gives.

Every family is saved with ``save_pretrained`` to a temporary directory and loaded from it by
``LLM`` (its attention routed through ``compileattn::attention``) and, separately, by transformers
with its eager attention, the reference. Prompts of different lengths are batched together, with
the longest prefill chunked under a 16-token step budget, 4-token blocks interleaving across
sequences, and windows shorter than the prompts. fp32 on the CPU, so the comparison is exact up to
rounding: tokens must be equal, logits within 1e-4.

Compiled runs use simulated CUDA graphs (tests/conftest.py): mixed steps take the piecewise path,
uniform decode steps the full-graph path, as on a GPU.
"""
import math
from pathlib import Path

import pytest
import torch

import compileattn as ca
from compileattn import _torch_compat
from compileattn.hf.model import UnsupportedModelError
from hf_families import FAMILIES, hf_greedy, load_reference, prompts, save_family

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 8
ENGINE = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, num_blocks=96)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """family -> (directory, reference model, HF tokens and logits per prompt), built once."""
    made = {}

    def get(family):
        if family not in made:
            directory = save_family(family, tmp_path_factory.mktemp(family))
            reference = load_reference(directory)
            made[family] = directory, reference, [hf_greedy(reference, p, NEW_TOKENS) for p in prompts()]
        return made[family]

    return get


def engine_greedy_logits(llm, prompt_list, new_tokens):
    """Greedy through the engine, recording every sampled row's logits: (tokens, logits) per prompt."""
    engine = llm.engine
    rows = {}

    def record(logits, seq_ids):
        for s, row in zip(seq_ids, logits):
            rows.setdefault(s, []).append(row.clone())
        return logits.argmax(-1).tolist()

    ids = engine.add_requests([ca.SamplingParams(max_new_tokens=new_tokens)] * len(prompt_list), prompt_list)
    while engine.has_unfinished():
        engine.step(sampler=record)
    return [(engine.pop_request(i).output, torch.stack(rows[i])) for i in ids]


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_greedy_equals_hf_generate(family, checkpoint):
    directory, _, expected = checkpoint(family)
    llm = ca.LLM(str(directory), compile_config=None, **ENGINE)
    outputs = llm.generate(prompts(), NEW_TOKENS, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [tokens for tokens, _ in expected]
    assert all(o.finish_reason == "length" for o in outputs)
    assert len({t for o in outputs for t in o.token_ids}) > NEW_TOKENS  # not a degenerate model
    assert max(h[3] for h in llm.engine.history) == 16 and any(h[0] and h[2] for h in llm.engine.history)
    for (tokens, logits), (hf_tokens, hf_logits) in zip(engine_greedy_logits(llm, prompts(), NEW_TOKENS), expected):
        assert tokens == hf_tokens
        torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, piece_compiler, mode", [
    *[(f, "eager", "full_and_piecewise") for f in FAMILIES],
    ("llama", "inductor", "piecewise"),
    ("gemma2", "inductor", "full_and_piecewise"),
])
def test_compiled_greedy_equals_hf_generate(family, piece_compiler, mode, checkpoint, simulated_graphs):
    directory, _, expected = checkpoint(family)
    config = ca.CompileConfig(piece_compiler=piece_compiler, cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8, 16])
    # Compiled once, at construction, the two decoder layers traced as one region. Where their windows
    # differ each is traced on its own, and torch inlines a region called only once (no region calls).
    # (torch 2.13's behaviour; 2.11 traces each call and keeps what it keeps: not counted there)
    regions = {"regions_inlined": 0 if family in ("qwen2", "gemma2", "gemma3", "cohere2", "cohere2_moe") else 2}
    with ca.counters.expect(dynamo_graphs=1, **(regions if _torch_compat.compile_region() is not None else {})):
        llm = ca.LLM(str(directory), compile_config=config, **ENGINE)
    captures, replays, full = ca.counters.cudagraph_captures, ca.counters.cudagraph_replays, ca.counters.full_graph_steps
    with ca.counters.expect(dynamo_graphs=0):  # every step size, 1-token steps included, without recompiling
        outputs = llm.generate(prompts(), NEW_TOKENS, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [tokens for tokens, _ in expected]
    assert ca.counters.cudagraph_replays - replays == len(llm.engine.history)  # every step at a capture size
    assert ca.counters.cudagraph_captures == captures  # all captured at construction
    # simulated graphs count the reference backend as capturable, so decode steps take the full graph
    assert (ca.counters.full_graph_steps > full) == (mode == "full_and_piecewise")


def test_windows_and_softcaps_reach_the_kernel(checkpoint, monkeypatch):
    """The token tests can fail: the same Gemma-2 checkpoint with transformers' window taken as
    compileattn's (one key too many) or without the attention softcap generates other tokens. The
    wrong window is refused at load, where the probe compares it with the model's mask and then with
    transformers' cache; with those checks off, it is served and generates other tokens."""
    import compileattn.hf.attention as hf_attention
    import compileattn.hf.model as hf_model

    directory, _, expected = checkpoint("gemma2")
    real = hf_attention.settings_from_call
    for wrong in ("window", "softcap"):
        def settings(query, key, scaling, sliding_window, softcap, _wrong=wrong):
            if _wrong == "window":
                return real(query, key, scaling, None if sliding_window is None else sliding_window + 1, softcap)
            return real(query, key, scaling, sliding_window, None)

        monkeypatch.setattr(hf_attention, "settings_from_call", settings)
        if wrong == "window":
            with pytest.raises(UnsupportedModelError, match=r"window_left=6\): at query position 6 the mask hides"):
                ca.LLM(str(directory), compile_config=None, **ENGINE)
            monkeypatch.setattr(hf_model, "_check_mask", lambda *args: None)
            with pytest.raises(UnsupportedModelError, match=r"cache for this config is a sliding window of 6 keys "
                                                            r"while .*\(causal, window_left=6\)"):
                ca.LLM(str(directory), compile_config=None, **ENGINE)
            monkeypatch.setattr(hf_model, "_check_cache_windows", lambda *args: None)
        llm = ca.LLM(str(directory), compile_config=None, **ENGINE)
        outputs = llm.generate(prompts(), NEW_TOKENS, use_tqdm=False)
        monkeypatch.undo()
        assert [o.token_ids for o in outputs] != [tokens for tokens, _ in expected], wrong


def test_granites_attention_multiplier_reaches_the_kernel(checkpoint, monkeypatch):
    """Granite passes its ``attention_multiplier`` (0.05 here) as ``scaling=``, not 1/sqrt(head dim):
    the token tests can fail, served at the default scale it generates other tokens. (Its and
    Cohere's logit scales are positive factors, which no greedy token shows: the eager test's logits
    do, and the load-time check refuses a model without its scale, tests/test_hf_refusals.py.)"""
    import compileattn.hf.attention as hf_attention

    directory, _, expected = checkpoint("granite")
    real = hf_attention.settings_from_call
    monkeypatch.setattr(hf_attention, "settings_from_call",
                        lambda query, key, scaling, sliding_window, softcap: real(query, key, None, sliding_window,
                                                                                  softcap))
    llm = ca.LLM(str(directory), compile_config=None, **ENGINE)
    assert {spec.scale for spec in llm.model.attention_specs().values()} == {1.0 / math.sqrt(32)}
    outputs = llm.generate(prompts(), NEW_TOKENS, use_tqdm=False)
    assert [o.token_ids for o in outputs] != [tokens for tokens, _ in expected]


def test_a_window_of_one_attends_each_token_alone_as_the_models_forward_does(tmp_path):
    """``sliding_window=1``: every query sees only its own key. The reference is the model's forward
    without a cache, run again for each token: transformers' ``generate()`` is none here, its
    sliding cache keeps the last ``sliding_window - 1`` keys as ``keys[:, :, -sliding_window + 1:]``,
    which for a window of 1 is every key, so its decode steps attend further back than its forward."""
    directory = save_family("mistral", tmp_path / "w1", sliding_window=1)
    reference = load_reference(directory)
    llm = ca.LLM(str(directory), compile_config=None, **ENGINE)
    for prompt, output in zip(prompts(), llm.generate(prompts(), NEW_TOKENS, use_tqdm=False)):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                ids.append(int(reference(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        assert output.token_ids == ids[len(prompt):]


def test_preemption_and_block_reuse_under_pressure_give_unpressured_tokens(checkpoint):
    directory, _, expected = checkpoint("qwen2")
    # 14 blocks of 4 tokens: the four sequences grow to 2 + 4 + 7 + 11 blocks.
    llm = ca.LLM(str(directory), compile_config=None, **{**ENGINE, "num_blocks": 14})
    outputs = llm.generate(prompts() * 2, NEW_TOKENS, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [tokens for tokens, _ in expected] * 2
    assert llm.engine.num_preemptions > 0 and sum(o.metrics.num_preemptions for o in outputs) > 0
    assert llm.engine.allocator.num_free == 14


def test_eos_and_stop_tokens_end_requests_like_hf(checkpoint, tmp_path):
    _, reference, expected = checkpoint("llama")
    # An EOS the model reaches a few tokens in: the model's generate() stops there, EOS included.
    tokens = expected[2][0]
    eos = tokens[3]
    directory = save_family("llama", tmp_path / "eos", eos_token_id=eos)
    hf_tokens, _ = hf_greedy(load_reference(directory), prompts()[2], NEW_TOKENS)
    assert hf_tokens == tokens[: tokens.index(eos) + 1]
    llm = ca.LLM(str(directory), compile_config=None, **ENGINE)
    out = llm.generate(prompts()[2], NEW_TOKENS, use_tqdm=False)[0]
    assert out.token_ids == hf_tokens and out.finish_reason == "stop"
    out = llm.generate(prompts()[2], NEW_TOKENS, ignore_eos=True, use_tqdm=False)[0]
    assert out.token_ids == tokens and out.finish_reason == "length"
    out = llm.generate(prompts()[2], NEW_TOKENS, stop_token_ids=[tokens[1]], ignore_eos=True, use_tqdm=False)[0]
    assert out.token_ids == tokens[: tokens.index(tokens[1]) + 1] and out.finish_reason == "stop"


def test_in_memory_model_and_seeded_sampling(checkpoint):
    _, reference, expected = checkpoint("phi3")
    import copy

    llm = ca.LLM(copy.deepcopy(reference), compile_config=None, **ENGINE)
    assert [o.token_ids for o in llm.generate(prompts(), NEW_TOKENS, use_tqdm=False)] == [t for t, _ in expected]
    sample = dict(temperature=1.0, top_p=0.9, use_tqdm=False)
    a = llm.generate(prompts(), NEW_TOKENS, seed=7, **sample)
    b = llm.generate(prompts(), NEW_TOKENS, seed=7, **sample)
    c = llm.generate(prompts(), NEW_TOKENS, seed=8, **sample)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    assert [o.token_ids for o in a] != [t for t, _ in expected]


def test_an_llm_over_a_kept_model_frees_its_kv_cache_when_deleted(checkpoint, simulated_graphs):
    """The benchmark's pattern: one in-memory model served by several LLMs in turn. Nothing the LLM
    leaves on the model, or in the process, keeps the previous LLM's cache alive."""
    import copy
    import gc
    import weakref

    _, reference, _ = checkpoint("llama")
    model = copy.deepcopy(reference)
    config = ca.CompileConfig(piece_compiler="eager", cudagraph_mode="full_and_piecewise",
                              cudagraph_capture_sizes=[1, 2, 4, 8, 16])
    llm = ca.LLM(model, compile_config=config, **ENGINE)
    llm.generate(prompts(), 2, use_tqdm=False)
    kept = weakref.ref(next(iter(llm.engine.kv_caches.values())).key_cache)
    del llm
    torch.compiler.reset()
    gc.collect()
    assert kept() is None
    assert model is not None


_WARM_SCRIPT = """
import json, logging, sys
import compileattn as ca
records = []
logging.getLogger("compileattn").addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: records.append(r.getMessage())})())
logging.getLogger("compileattn").setLevel(logging.INFO)
config = ca.CompileConfig(piece_compiler="eager", compile_workers=0, cache_dir=sys.argv[2])
llm = ca.LLM(sys.argv[1], compile_config=config, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
tokens = llm.generate([[1, 2, 3, 4, 5]], 4, use_tqdm=False)[0].token_ids
print(json.dumps({"tokens": tokens, "warm": any("warm start, no Dynamo" in m for m in records)}))
"""


def test_a_second_process_serves_a_hugging_face_model_from_its_warm_start(checkpoint, tmp_path):
    """The warm-start key of a transformers model is the same in every process (its configs'
    private state, such as GenerationConfig's per-process string hash, stays out of it)."""
    import json
    import os
    import subprocess
    import sys

    directory, _, _ = checkpoint("llama")
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    runs = [json.loads(subprocess.run([sys.executable, "-c", _WARM_SCRIPT, str(directory), str(cache)], env=env,
                                      capture_output=True, text=True, timeout=300, check=True).stdout.splitlines()[-1])
            for _ in range(2)]
    assert [r["warm"] for r in runs] == [False, True]
    assert runs[0]["tokens"] == runs[1]["tokens"]


def test_a_causal_lm_whose_base_model_is_itself_serves_its_decoder(tmp_path):
    """Llama4ForCausalLM's ``base_model_prefix`` ("language_model") names where the multimodal model
    holds it, so its ``base_model`` is the whole LM, whose output has logits, not hidden states
    (loading failed on ``last_hidden_state``). Its decoder is ``model.model``."""
    import transformers as T

    config = T.Llama4TextConfig(vocab_size=160, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                num_local_experts=2, num_experts_per_tok=1, attention_chunk_size=8192,
                                layer_types=["full_attention"] * 2, no_rope_layers=[1, 1], initializer_range=0.2,
                                tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama4")
    reference = load_reference(tmp_path / "llama4")
    assert reference.base_model is reference
    llm = ca.LLM(str(tmp_path / "llama4"), compile_config=None, **ENGINE)
    outputs = llm.generate(prompts(), NEW_TOKENS, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [hf_greedy(reference, p, NEW_TOKENS)[0] for p in prompts()]


def test_the_models_own_generate_after_llm_says_the_llm_switched_it(checkpoint):
    """An HF user who called model.generate after LLM(model) was told only to use
    compileattn.set_forward_context, not that LLM had switched the model's attention."""
    import copy

    from compileattn.hf.model import HFCausalLM

    _, reference, _ = checkpoint("llama")
    model = copy.deepcopy(reference)
    ca.LLM(model, compile_config=None, **ENGINE)
    ids = torch.tensor([prompts()[0]])
    with pytest.raises(RuntimeError, match=r"^no forward context: this transformers model's attention was switched "
                                           r"to compileattn's \('compileattn'\) for serving through LLM.*generate "
                                           r"with LLM\.generate"):
        model.generate(ids, max_new_tokens=2, do_sample=False)
    own = copy.deepcopy(reference)
    HFCausalLM(own)  # switched by a caller that runs it in its own forward contexts: the generic advice
    with pytest.raises(RuntimeError, match=r"^no forward context: run the model inside compileattn\.set_forward_context"):
        own(ids)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
], ids=lambda rope: rope["rope_type"])
def test_rope_scalings_fixed_at_load_are_served_past_their_original_length(rope, tmp_path):
    """These rope types' frequencies are fixed when the model is built, whatever the positions of a
    forward: sequences crossing ``original_max_position_embeddings`` (16), batched with shorter ones,
    give the model's own generate()'s tokens. (Those that switch by the longest position are refused
    at load: tests/test_hf_refusals.py.)"""
    directory = save_family("llama", tmp_path / rope["rope_type"], max_position_embeddings=64,
                            rope_parameters={**rope, "rope_theta": 10000.0})
    reference = load_reference(directory)
    llm = ca.LLM(str(directory), compile_config=None, **ENGINE)
    outputs = llm.generate(prompts(), 16, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [hf_greedy(reference, p, 16)[0] for p in prompts()]
