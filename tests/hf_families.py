"""Tiny transformers configs of every model family compileattn serves, and the HF references.

Every config is a few hundred thousand random parameters (2 layers, hidden 64, head dim 32: the
smallest head dim every backend takes), with whatever makes its family different switched on and
made to matter: sliding windows (6) shorter than the test prompts, Gemma-2's attention softcap
small enough to bite, Gemma's final logit softcap, OPT's pre-scaled queries, GQA, Granite's
embedding, residual and attention multipliers, Cohere's, Granite's and HyperCLOVA X's logit scales
(positive factors, which change no greedy token: the logits comparisons show them). Weights are drawn
with ``initializer_range=0.2`` and untied output embeddings: at transformers' default 0.02, or with
tied embeddings, greedy decoding repeats one token and a test could not tell right from wrong.
EOS is off (``eos_token_id=None``) so token-for-token comparisons run their full length.
"""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 160
WINDOW = 6
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, eos_token_id=None, bos_token_id=None, pad_token_id=None,
               initializer_range=0.2, tie_word_embeddings=False)


def tiny_llama():
    """An in-memory tiny Llama with sdpa attention, for the benchmarks' plumbing tests (the GPU
    scripts build 8B shapes the same way, from a config)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      eos_token_id=None, initializer_range=0.2)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _config(family: str, **overrides):
    import transformers as T

    c = dict(_COMMON)
    if family == "llama":
        cls, c = T.LlamaConfig, dict(c, head_dim=32)
    elif family == "qwen2":  # head dim 64 / 2 = 32; window on the second layer only
        cls, c = T.Qwen2Config, dict(c, num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                     sliding_window=WINDOW, max_window_layers=1)
    elif family == "qwen3":
        cls, c = T.Qwen3Config, dict(c, head_dim=32)
    elif family == "mistral":
        cls, c = T.MistralConfig, dict(c, head_dim=32, sliding_window=WINDOW)
    elif family == "gemma2":  # alternating windows, attention softcap, final logit softcap
        cls, c = T.Gemma2Config, dict(c, head_dim=32, sliding_window=WINDOW, attn_logit_softcapping=1.0,
                                      final_logit_softcapping=5.0, query_pre_attn_scalar=32)
    elif family == "gemma3":
        cls, c = T.Gemma3TextConfig, dict(c, head_dim=32, sliding_window=WINDOW, final_logit_softcapping=5.0,
                                          layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32)
    elif family == "phi3":  # fused qkv; head dim 64 / 2 = 32
        cls, c = T.Phi3Config, dict(c, num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
    elif family == "opt":  # pre-scales q and passes scaling=1.0; learned positions; MHA
        cls, c = T.OPTConfig, dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                   num_attention_heads=2, word_embed_proj_dim=64, eos_token_id=None, bos_token_id=None,
                                   pad_token_id=None, init_std=0.2, tie_word_embeddings=False)
    elif family == "cohere":  # logits * logit_scale after lm_head; per-head q/k LayerNorm (Command R+)
        cls, c = T.CohereConfig, dict(c, num_attention_heads=2, num_key_value_heads=1, logit_scale=0.3,
                                      use_qk_norm=True)
    elif family == "cohere2":  # and alternating windows, RoPE on the windowed layers only
        cls, c = T.Cohere2Config, dict(c, num_attention_heads=2, num_key_value_heads=1, logit_scale=0.3,
                                       sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    elif family == "cohere2_moe":
        cls, c = T.Cohere2MoeConfig, dict(c, head_dim=32, logit_scale=0.3, sliding_window=WINDOW,
                                          layer_types=["sliding_attention", "full_attention"], num_experts=2,
                                          num_experts_per_tok=1)
    elif family in ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid"):
        # logits / logits_scaling after lm_head; the multipliers are the decoder's: embeddings,
        # each residual branch, and the attention scale it passes as scaling= (not 1/sqrt(head dim))
        cls = {"granite": T.GraniteConfig, "granitemoe": T.GraniteMoeConfig,
               "granitemoeshared": T.GraniteMoeSharedConfig, "granitemoehybrid": T.GraniteMoeHybridConfig}[family]
        c = dict(c, num_attention_heads=2, num_key_value_heads=1, logits_scaling=4.0, embedding_multiplier=3.0,
                 residual_multiplier=0.5, attention_multiplier=0.05)
        if family != "granite":
            c.update(num_local_experts=2, num_experts_per_tok=1)
        if family in ("granitemoeshared", "granitemoehybrid"):
            c.update(shared_intermediate_size=64)
        if family == "granitemoehybrid":  # no Mamba layers (those are refused: linear attention)
            c.update(layer_types=["full_attention", "full_attention"], position_embedding_type="rope")
    elif family == "hyperclovax":  # logits * logits_scaling: Granite's attribute, the other way round
        cls, c = T.HyperCLOVAXConfig, dict(c, head_dim=32, logits_scaling=0.5)
    else:
        raise ValueError(family)
    c.update(overrides)
    if "layer_types" in c and "num_hidden_layers" in overrides:  # keep the alternation at any depth
        c["layer_types"] = [c["layer_types"][i % 2] for i in range(c["num_hidden_layers"])]
    return cls(**c)


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "opt", "cohere", "cohere2",
            "cohere2_moe", "granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "hyperclovax")
#: Prompt lengths: one shorter than the window, the rest longer (so the window's edge is crossed in
#: prefill and in decode), one long enough to be chunked at a 16-token step budget.
PROMPT_LENGTHS = (3, 13, 21, 37)


def save_family(family: str, directory: Path, seed: int = 0, **overrides) -> Path:
    """Random weights of ``family`` saved with ``save_pretrained`` (config.json + safetensors)."""
    from transformers import AutoModelForCausalLM

    config = _config(family, **overrides)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def load_reference(directory: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The same checkpoint through transformers' own eager attention (the only one that applies
    every family's softcap and window exactly)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=dtype,
                                                 local_files_only=True)
    return model.to(device).eval()


def prompts(seed: int = 0, lengths=PROMPT_LENGTHS, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **kwargs):
    """(tokens, fp32 logits (max_new_tokens, vocab)) from the model's own ``generate``."""
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kwargs)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([x[0].float() for x in out.logits])


def byte_level_tokenizer():
    """A 256-token byte-level tokenizer made offline: every string round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)
