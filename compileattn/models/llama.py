"""Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) with random weights, for driving the compiler.

Module paths follow Hugging Face's (``model.layers.{i}.self_attn.attn``) so a layer's KV-cache key
is also its module path. Two constraints shape ``forward``:

- It must trace with ``torch.compile(fullgraph=True)`` with the token dim dynamic, so no Python
  branches on tensor values and no shape arithmetic beyond what Dynamo can keep symbolic.
- The attention op receives contiguous (tokens, heads*head_dim) inputs: the fused qkv projection is
  split into strided views, and FlashAttention kernels (and CUDA-graph address checks) want dense
  tensors, so RoPE writes fresh q/k and v is made contiguous explicitly.
"""
from __future__ import annotations

import dataclasses
import math
from numbers import Real

import torch
from torch import nn

from ..argtypes import as_int, is_bool, positive_int
from ..kv_cache import AttentionSpec, check_dtype, check_gqa, check_head_dim
from .attention import Attention, ServedModel


def check_config_fields(config, sizes: tuple[str, ...], *, positive: tuple[str, ...] = (),
                        non_negative: tuple[str, ...] = ()) -> None:
    """Check a frozen model config's fields in place: ``sizes`` are ints >= 1 by the int rule
    (``argtypes``: numpy's integers are stored as ints; a float or a bool is no size, and a float
    would only fail later inside ``nn.Linear``), the float settings finite, ``positive`` ones > 0
    and ``non_negative`` ones >= 0: a ``rope_theta`` of 0 or below, or a NaN, infinite or negative
    norm eps, makes every hidden state NaN (or 0) with no error."""
    for name in sizes:
        object.__setattr__(config, name, positive_int(getattr(config, name), name))
    for name in positive + non_negative:
        value = getattr(config, name)
        if is_bool(value) or not isinstance(value, Real):
            raise TypeError(f"{name} must be a float, got {value!r}")
        strict = name in positive
        if not (math.isfinite(value) and (value > 0 if strict else value >= 0)):
            raise ValueError(f"{name} must be a finite float {'> 0' if strict else '>= 0'}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    #: Tokens to the left a query sees (Mistral-style); -1 = full causal attention.
    sliding_window: int = -1
    max_position: int = 4096
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        check_config_fields(self, ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                   "head_dim", "intermediate_size", "max_position"),
                            positive=("rope_theta",), non_negative=("rms_norm_eps",))
        check_gqa(self.num_heads, self.num_kv_heads)
        check_head_dim(self.head_dim)
        window = as_int(self.sliding_window)
        if window is None:
            raise TypeError(f"sliding_window must be an int, got {self.sliding_window!r}")
        if window < -1:
            raise ValueError(f"sliding_window must be -1 (off) or >= 0, got {window}")
        object.__setattr__(self, "sliding_window", window)

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """CPU tests: about 130 thousand parameters (2 layers, hidden 64), GQA 4:2, head dim 32."""
        return dataclasses.replace(cls(), **overrides)

    @classmethod
    def small(cls, **overrides) -> "LlamaConfig":
        """The demo's default: big enough that a step takes measurable time, small enough to compile
        in seconds on a 2-core CPU."""
        base = cls(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                   head_dim=32, intermediate_size=768)
        return dataclasses.replace(base, **overrides)

    @classmethod
    def llama3_8b(cls, **overrides) -> "LlamaConfig":
        """Llama-3-8B's shapes (without its RoPE frequency scaling, which changes no kernel shape)."""
        base = cls(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                   head_dim=128, intermediate_size=14336, rope_theta=500000.0, max_position=8192)
        return dataclasses.replace(base, **overrides)

    @classmethod
    def llama3_70b(cls, **overrides) -> "LlamaConfig":
        """Llama-3-70B's shapes: GQA 64/8, hidden 8192, FFN 28672 (80 layers: pass num_layers to fit)."""
        base = cls(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                   head_dim=128, intermediate_size=28672, rope_theta=500000.0, max_position=8192)
        return dataclasses.replace(base, **overrides)


def init_random_weights(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights: N(0, std) for every Linear/Embedding parameter (biases too, so
    a test notices a dropped bias), ones/zeros for norms.

    Drawn with a generator on the parameters' device, in their dtype: an 8B model is filled in a
    second on a GPU instead of minutes through the CPU. The same seed therefore gives the same
    weights on the same device type, not across CPU and CUDA.
    """
    params = list(module.parameters())
    if not params:
        return
    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    with torch.no_grad():
        for name, sub in module.named_modules():
            if isinstance(sub, (nn.Linear, nn.Embedding)):
                for p in sub.parameters(recurse=False):
                    p.normal_(0.0, std, generator=gen)
            elif isinstance(sub, (RMSNorm, nn.LayerNorm)):
                sub.weight.fill_(1.0)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.zero_()


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 as HF/vLLM do: fp16 squares of activations overflow past ~256.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin (tokens, head_dim/2) computed from ``positions`` in fp32, then cast to ``dtype``."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX/HF "rotate half" RoPE on x (tokens, heads, head_dim); returns a new contiguous tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_name: str):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        spec = AttentionSpec(c.num_heads, c.num_kv_heads, c.head_dim, sliding_window=c.sliding_window)
        self.attn = Attention(spec, layer_name)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.reshape(n, self.num_heads, self.head_dim), cos, sin).reshape(n, self.q_size)
        k = apply_rope(k.reshape(n, self.num_kv_heads, self.head_dim), cos, sin).reshape(n, self.kv_size)
        return self.o_proj(self.attn(q, k, v.contiguous()))

    def tp_head_layout(self) -> tuple[int, int, int, dict[str, str]]:
        """For tensor parallelism (``compileattn.parallel.shard``): heads, KV heads, head dim, and
        what each projection holds (the fused qkv is sharded per part, never as one block)."""
        return self.num_heads, self.num_kv_heads, self.head_dim, {"qkv_proj": "qkv", "o_proj": "o"}

    def shard_heads(self, shard) -> None:
        """Hold one rank's heads (``parallel.HeadShard``), once the projections are sharded."""
        self.num_heads, self.num_kv_heads = shard.local_heads, shard.local_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.attn.spec = shard.spec(self.attn.spec)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # chunk, not split(intermediate_size): under tensor parallelism the halves are 1/tp as wide.
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, f"model.layers.{index}.self_attn.attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(ServedModel):
    """Random-weight Llama. ``forward`` -> hidden states; ``compute_logits`` is separate so a driver
    can gather the rows it samples from first (and so it stays out of the compiled graph)."""

    #: Tensor-parallel plan (``compileattn.parallel.shard_model``), as Hugging Face writes one.
    tp_plan = {"model.layers.*.self_attn.qkv_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
               "model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise"}

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0):
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        # Before nn.Module.to reads a dtype string as a device ("Invalid device string: 'float16'").
        check_dtype(dtype, "dtype")
        self.config = config
        # Built on the meta device and materialised once: nn.Linear's own init would fill 8B
        # parameters only for init_random_weights to overwrite them.
        with torch.device("meta"):
            self.model = LlamaModel(config)
            self.lm_head = None if config.tie_word_embeddings else nn.Linear(
                config.hidden_size, config.vocab_size, bias=False)
        self.to_empty(device=device)
        self.to(dtype)
        # Inference only: without this every compile would also trace a backward graph.
        self.requires_grad_(False)
        init_random_weights(self, seed)
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: int64 (tokens,) -> hidden (tokens, hidden_size)."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> fp32 (N, vocab); fp32 so greedy ties are not made by rounding the logits."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight).float()

