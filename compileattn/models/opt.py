"""OPT-style decoder (pre-LayerNorm, learned positions, MHA, ReLU FFN, biases) with random weights.

The second family exists because it differs from Llama exactly where a compiler pass could go
wrong: biases on every projection, LayerNorm instead of RMSNorm, absolute learned positions instead
of RoPE, and MHA (kv_heads == heads). OPT's position table has 2 extra rows at the front (a
leftover of fairseq's padding handling), so position p reads row p + 2.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..kv_cache import AttentionSpec, check_dtype, check_head_dim
from .attention import Attention, ServedModel
from .llama import check_config_fields, init_random_weights

#: OPT's learned-position offset (HF ``OPTLearnedPositionalEmbedding.offset``).
POSITION_OFFSET = 2


@dataclasses.dataclass(frozen=True)
class OPTConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    ffn_dim: int = 128
    max_position: int = 2048
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        check_config_fields(self, ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_dim", "max_position"),
                            non_negative=("layer_norm_eps",))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        check_head_dim(self.head_dim)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def tiny(cls, **overrides) -> "OPTConfig":
        """CPU tests: 2 layers, 2 heads of 32."""
        return dataclasses.replace(cls(), **overrides)

    @classmethod
    def opt_125m(cls, **overrides) -> "OPTConfig":
        base = cls(vocab_size=50272, hidden_size=768, num_layers=12, num_heads=12, ffn_dim=3072,
                   max_position=2048)
        return dataclasses.replace(base, **overrides)


class OPTAttention(nn.Module):
    def __init__(self, config: OPTConfig, layer_name: str):
        super().__init__()
        h = config.hidden_size
        self.hidden_size = h
        self.qkv_proj = nn.Linear(h, 3 * h, bias=True)
        self.out_proj = nn.Linear(h, h, bias=True)
        self.attn = Attention(AttentionSpec(config.num_heads, config.num_heads, config.head_dim), layer_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.hidden_size, dim=-1)
        # split() gives strided column views; the attention op gets dense (tokens, heads*head_dim).
        return self.out_proj(self.attn(q.contiguous(), k.contiguous(), v.contiguous()))

    def tp_head_layout(self) -> tuple[int, int, int, dict[str, str]]:
        """For tensor parallelism (``compileattn.parallel.shard``): see ``LlamaAttention``."""
        spec = self.attn.spec
        return spec.num_heads, spec.num_kv_heads, spec.head_dim, {"qkv_proj": "qkv", "out_proj": "o"}

    def shard_heads(self, shard) -> None:
        self.attn.spec = shard.spec(self.attn.spec)
        self.hidden_size = self.attn.spec.num_heads * self.attn.spec.head_dim


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: OPTConfig, index: int):
        super().__init__()
        eps = config.layer_norm_eps
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = OPTAttention(config, f"model.layers.{index}.self_attn.attn")
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_dim, bias=True)
        self.fc2 = nn.Linear(config.ffn_dim, config.hidden_size, bias=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.self_attn_layer_norm(h))
        return h + self.fc2(torch.relu(self.fc1(self.final_layer_norm(h))))


class OPTModel(nn.Module):
    def __init__(self, config: OPTConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position + POSITION_OFFSET, config.hidden_size)
        self.layers = nn.ModuleList(OPTDecoderLayer(config, i) for i in range(config.num_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class OPTForCausalLM(ServedModel):
    """Random-weight OPT with the same driver interface as ``LlamaForCausalLM``; the LM head is tied
    to the token embedding, as in every released OPT."""

    tp_plan = {"model.layers.*.self_attn.qkv_proj": "colwise", "model.layers.*.self_attn.out_proj": "rowwise",
               "model.layers.*.fc1": "colwise", "model.layers.*.fc2": "rowwise"}

    def __init__(self, config: OPTConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0):
        super().__init__()
        if not isinstance(config, OPTConfig):
            raise TypeError(f"config must be an OPTConfig, got {type(config).__name__}")
        check_dtype(dtype, "dtype")  # see LlamaForCausalLM
        self.config = config
        with torch.device("meta"):
            self.model = OPTModel(config)
        self.to_empty(device=device)
        self.to(dtype)
        self.requires_grad_(False)
        init_random_weights(self, seed)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: int64 (tokens,) -> hidden (tokens, hidden_size)."""
        m = self.model
        h = m.embed_tokens(input_ids) + m.embed_positions(positions + POSITION_OFFSET)
        for layer in m.layers:
            h = layer(h)
        return m.final_layer_norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> fp32 (N, vocab)."""
        return nn.functional.linear(hidden, self.model.embed_tokens.weight).float()

