"""Shard a model in place for tensor parallelism, following a plan of module-path patterns.

A plan maps module paths to styles, as Hugging Face's ``config.base_model_tp_plan`` does:
``{"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise", ...}``
(``*`` stands for one path component). Styles:

- ``colwise``: keep this rank's output rows. For a projection of an attention module the rows are
  heads: a query projection keeps the rank's query heads, a key/value projection its KV heads
  (``layers.HeadShard``: replicated when there are fewer KV heads than ranks), and a fused
  ``qkv`` projection keeps the rank's slice of q, of k and of v, never a slice of the
  concatenation. Any other linear keeps an even 1/tp of its rows.
- ``packed_colwise``: a fused ``gate|up`` projection: each half sharded evenly.
- ``rowwise``: keep the matching input columns; becomes a ``RowParallelLinear`` (all-reduce,
  then bias).
- ``replicated``, ``replicated_with_grad_allreduce``: left whole (inference has no gradients).
- ``embedding_rowwise``, ``embedding_colwise``: Hugging Face's vocab-parallel and hidden-parallel
  embeddings, left whole. Both end with the full hidden state on every rank (the ranks' partial
  lookups summed, or their slices gathered), which the whole embedding gives; transformers 5.17
  writes ``embed_tokens: embedding_rowwise`` into the plan of every config with tied embeddings,
  and a whole embedding also keeps the LM head that shares its weight whole.

Any other style (MoE experts, sequence parallelism, a linear whose output is gathered) is refused
rather than run wrongly. Embeddings and the LM head stay replicated.

A model the plan does not fit (no plan, a style above not supported, a layer whose heads do not
split over the ranks, a planned module that is missing, not an ``nn.Linear``, or not of the
expected width) is refused before any module changes with ``UnsupportedModelError`` (a
``ValueError``): ``LLM(..., tensor_parallel_size=N)`` shards while it loads, and its callers tell a
model that cannot be served this way from a failure by that type. A planned module of another
class is the model's mismatch with its plan, as a wrong width is, not a caller's argument of the
wrong type: it is refused the same way, not as a ``TypeError``.

Attention modules are recognised two ways: compileattn's own (``tp_head_layout()`` /
``shard_heads()``, see ``models/llama.py``), or Hugging Face's (``q_proj``/``k_proj``/``v_proj``/
``o_proj`` linears, ``head_dim``, and head counts in ``config``); after sharding, each learns its
local head counts so its forward and ``attention_specs()`` describe this rank's heads.

A Hugging Face attention's other parameters (its q/k norms) must be the same for every head, or
be sharded with the heads: a norm over ``head_dim`` (Qwen3's, Gemma-3's) stays whole; one with a
weight per head, ``(heads, head_dim)`` (Cohere's qk LayerNorm), keeps the rows of this rank's
query (``q_norm``) or KV (``k_norm``) heads. Any other parameter could span the heads (a norm over
the whole query width, OLMo-2's, mixes every head and cannot be computed from one rank's): such a
model is refused, not served with a norm over the wrong heads.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import torch
from torch import nn

from ..refusals import UnsupportedModelError
from .group import TPGroup, get_tp
from .layers import HeadShard, even_rows, head_rows, row_parallel, shard_columns_out

#: Styles left whole: see the module docstring.
_NOOP_STYLES = ("replicated", "replicated_with_grad_allreduce", "embedding_rowwise", "embedding_colwise")
STYLES = ("colwise", "packed_colwise", "rowwise") + _NOOP_STYLES
_HF_ROLES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}


@dataclasses.dataclass
class _Attention:
    """An attention module whose projections are being sharded."""

    path: str
    module: nn.Module
    heads: HeadShard
    head_dim: int
    #: child name -> role: "q", "k", "v", "qkv" (fused) or "o"
    roles: dict[str, str]
    #: Hugging Face only: other parameters with a row per head, by name -> "q" or "kv" (whose heads' rows a rank keeps)
    per_head: dict[str, str] = dataclasses.field(default_factory=dict)


def _pattern(pattern: str) -> re.Pattern:
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))


def _attention_modules(root: nn.Module, rank: int, tp: int) -> dict[str, _Attention]:
    found = {}
    for path, module in root.named_modules():
        if hasattr(module, "tp_head_layout") and hasattr(module, "shard_heads"):
            num_heads, num_kv_heads, head_dim, roles = module.tp_head_layout()
        elif all(isinstance(getattr(module, n, None), nn.Linear) for n in _HF_ROLES) and hasattr(module, "head_dim"):
            config = getattr(module, "config", None)
            num_heads = getattr(config, "num_attention_heads", None)
            num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
            if num_heads is None:
                continue
            head_dim, roles = module.head_dim, dict(_HF_ROLES)
        else:
            continue
        try:
            heads = HeadShard(num_heads, num_kv_heads, rank, tp)
        except ValueError as exc:
            raise UnsupportedModelError(f"{path}: its heads cannot be split over {tp} ranks: {exc}") from None
        found[path] = _Attention(path, module, heads, head_dim, roles)
    return found


#: Hugging Face attention children whose ``(heads, head_dim)`` weight has a row per query / KV head.
_PER_HEAD_NORMS = {"q_norm": "q", "k_norm": "kv"}


def _per_head_parameters(attn: _Attention) -> dict[str, str]:
    """A Hugging Face attention's parameters outside its projections that have a row per head (name ->
    "q" or "kv"); refuses one that is neither that nor per ``head_dim`` (see the module docstring)."""
    h, d = attn.heads, attn.head_dim
    per_head = {}
    for name, param in attn.module.named_parameters():
        child = name.partition(".")[0]
        if child in attn.roles or tuple(param.shape) == (d,):
            continue
        kind = _PER_HEAD_NORMS.get(child)
        if kind is not None and tuple(param.shape) == ({"q": h.num_heads, "kv": h.num_kv_heads}[kind], d):
            per_head[name] = kind
            continue
        raise UnsupportedModelError(
            f"{attn.path}.{name} has shape {tuple(param.shape)}, neither per head_dim ({d},) nor a row per head: it "
            f"may span the attention's heads, which tensor parallelism splits over the ranks")
    return per_head


def _rows(role: str | None, linear: nn.Linear, attn: _Attention | None, rank: int, tp: int) -> torch.Tensor:
    """Output rows a rank keeps of a column-parallel ``linear`` with ``role`` in ``attn``."""
    if attn is None or role is None:
        return even_rows(linear.out_features, rank, tp)
    h, d = attn.heads, attn.head_dim
    q, kv = h.num_heads * d, h.num_kv_heads * d
    expected = {"q": q, "k": kv, "v": kv, "qkv": q + 2 * kv}.get(role)
    if expected is None:
        raise ValueError(f"{attn.path}: a {role!r} projection cannot be column-parallel")
    if linear.out_features != expected:
        raise ValueError(f"{attn.path}: its {role} projection has {linear.out_features} outputs, expected {expected} "
                         f"({h.num_heads} query / {h.num_kv_heads} KV heads of {d})")
    if role == "q":
        return head_rows(h.q_heads, d)
    if role in ("k", "v"):
        return head_rows(h.kv_heads, d)
    return torch.cat([head_rows(h.q_heads, d), head_rows(h.kv_heads, d, q), head_rows(h.kv_heads, d, q + kv)])


def _columns(role: str | None, linear: nn.Linear, attn: _Attention | None, rank: int, tp: int) -> torch.Tensor:
    """Input columns a rank keeps of a row-parallel ``linear``."""
    if attn is None or role is None:
        return even_rows(linear.in_features, rank, tp)
    if role != "o":
        raise ValueError(f"{attn.path}: a {role!r} projection cannot be row-parallel")
    h, d = attn.heads, attn.head_dim
    if linear.in_features != h.num_heads * d:
        raise ValueError(f"{attn.path}: its output projection takes {linear.in_features} inputs, expected "
                         f"{h.num_heads * d}")
    return head_rows(h.q_heads, d)


def shard_model(model: nn.Module, plan: Mapping[str, str] | None = None, tp: TPGroup | None = None) -> nn.Module:
    """Shard ``model`` in place for this rank of ``tp`` (default: ``get_tp()``) and return it.

    ``plan`` defaults to the model's own: ``model.config.base_model_tp_plan`` (Hugging Face, paths
    from ``model.base_model``) or ``model.tp_plan`` (compileattn's models, paths from the model's
    root). A one-rank group leaves the model as it is.

    A plan entry that matches no module is refused (a plan that does not fit the model); except, in
    a Hugging Face model's own plan, a whole group of entries under one parent (``layers.*.mlp.*``)
    that matches nothing: MoE variants keep their dense parent's plan (Cohere2-MoE's names a
    ``gate_proj``/``up_proj``/``down_proj`` its routed ``mlp`` does not have), and what no entry
    names stays replicated, which is correct (each rank computes it whole from the all-reduced
    hidden state). A group matched in part is still refused: half a column/row pair would be wrong.
    """
    tp = tp or get_tp()
    root = model
    own_hf_plan = False
    if plan is None:
        # Hugging Face first: its models also have a ``tp_plan``, which adds vocab-parallel
        # embedding and LM head styles; the base model's plan keeps those replicated. A Hugging
        # Face config without one (Granite-MoE's in transformers 5.17) means no plan: the
        # model's ``tp_plan`` is then its LM head's alone, refused for a style that was not the point.
        config = getattr(model, "config", None)
        if hasattr(config, "base_model_tp_plan"):
            plan = config.base_model_tp_plan
            root, own_hf_plan = getattr(model, "base_model", model), True
        else:
            plan = getattr(model, "tp_plan", None)
        if not plan:
            raise UnsupportedModelError(f"{type(model).__name__} has no tensor-parallel plan (neither .tp_plan nor "
                                        f"config.base_model_tp_plan); pass plan=")
    bad = sorted({style for style in plan.values() if style not in STYLES})
    if bad:
        raise UnsupportedModelError(f"{type(model).__name__}: unsupported tensor-parallel style(s) {bad} in the plan; "
                                    f"supported: {list(STYLES)}")
    if getattr(model, "tp_shard", None) is not None:
        raise ValueError(f"the model is already sharded ({model.tp_shard})")
    if tp.world_size == 1:
        return model
    attentions = _attention_modules(root, tp.rank, tp.world_size)
    owner = {f"{path}.{child}" if path else child: (attn, role)
             for path, attn in attentions.items() for child, role in attn.roles.items()}
    patterns = [(_pattern(p), p, style) for p, style in plan.items()]
    matched = {p: 0 for p in plan}
    # Every module's share is worked out (and a plan that does not fit refused) before any module
    # changes: a refusal halfway left the caller's model half-sharded.
    shares = []
    for name, module in list(root.named_modules()):
        hits = [(p, style) for rx, p, style in patterns if rx.fullmatch(name)]
        if not hits:
            continue
        if len(hits) > 1:
            raise UnsupportedModelError(f"{name} matches several plan entries: {[p for p, _ in hits]}")
        pattern, style = hits[0]
        matched[pattern] += 1
        if style in _NOOP_STYLES:
            continue
        if type(module) is not nn.Linear:
            raise UnsupportedModelError(f"{name} ({type(module).__name__}) is planned {style!r}; only nn.Linear can "
                                        f"be sharded")
        attn, role = owner.get(name, (None, None))
        try:
            if style == "colwise":
                share = _rows(role, module, attn, tp.rank, tp.world_size)
            elif style == "packed_colwise":
                half = module.out_features // 2
                if role is not None or module.out_features % 2:
                    raise ValueError("packed_colwise needs a fused projection of two equal halves (gate|up)")
                share = torch.cat([even_rows(half, tp.rank, tp.world_size),
                                   even_rows(half, tp.rank, tp.world_size, half)])
            else:  # rowwise
                share = _columns(role, module, attn, tp.rank, tp.world_size)
        except ValueError as exc:
            raise UnsupportedModelError(f"{name} ({style}): {exc}") from None
        shares.append((name, module, style, attn, share))
    missing = [p for p, n in matched.items() if n == 0 and plan[p] not in _NOOP_STYLES]
    if own_hf_plan:
        def parent(pattern: str) -> str:
            return pattern.rpartition(".")[0]

        missing = [p for p in missing if any(matched[q] for q in plan if parent(q) == parent(p))]
    if missing:
        raise UnsupportedModelError(f"plan entries matched no module: {missing}")
    planned: dict[str, set] = {}
    for name, _, _, attn, _ in shares:
        if attn is not None:
            planned.setdefault(attn.path, set()).add(name.rpartition(".")[2])
    for attn in attentions.values():
        roles = planned.get(attn.path)
        if roles and roles != set(attn.roles):
            raise UnsupportedModelError(f"{attn.path}: the plan shards {sorted(roles)} but not "
                                        f"{sorted(set(attn.roles) - roles)}; an attention's projections shard "
                                        f"together")
        if roles and not hasattr(attn.module, "shard_heads"):
            attn.per_head = _per_head_parameters(attn)
    for name, module, style, attn, share in shares:
        if style == "rowwise":
            parent, _, child = name.rpartition(".")
            setattr(root.get_submodule(parent) if parent else root, child, row_parallel(module, share, tp.group_name))
        else:
            shard_columns_out(module, share)
    for attn in attentions.values():
        if attn.path in planned:
            _localize(attn)
    model.tp_shard = (tp.rank, tp.world_size)
    return model


def _localize(attn: _Attention) -> None:
    """Tell an attention module that it now holds this rank's heads only."""
    h = attn.heads
    if hasattr(attn.module, "shard_heads"):
        attn.module.shard_heads(h)
        return
    with torch.no_grad():
        for name, kind in attn.per_head.items():
            parent, _, leaf = name.rpartition(".")
            owner = attn.module.get_submodule(parent) if parent else attn.module
            param = getattr(owner, leaf)
            heads = h.q_heads if kind == "q" else h.kv_heads
            setattr(owner, leaf, nn.Parameter(param[heads.start:heads.stop].contiguous(), requires_grad=False))
    # Hugging Face: forward infers head counts from the projections' widths (view(..., -1, head_dim));
    # what it keeps as attributes must follow.
    if hasattr(attn.module, "num_key_value_groups"):
        attn.module.num_key_value_groups = h.local_heads // h.local_kv_heads
    for name, value in (("num_heads", h.local_heads), ("num_attention_heads", h.local_heads),
                        ("num_key_value_heads", h.local_kv_heads)):
        if isinstance(getattr(attn.module, name, None), int):
            setattr(attn.module, name, value)
