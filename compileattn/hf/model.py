"""A transformers ``*ForCausalLM`` as a compileattn model: ``forward(input_ids, positions) -> hidden``,
``compute_logits(hidden)``, ``attention_specs()``, like the own models in ``compileattn.models``.

The model's decoder runs unmodified (embedding scaling, RoPE, norms, Granite's multipliers); only
its attention implementation is switched to ``"compileattn"``. What the ``*ForCausalLM.forward``
does to the logits after ``lm_head`` (Gemma's softcap, Cohere's and Granite's scales) is repeated by
``compute_logits`` from ``LOGIT_TRANSFORMS``. Each layer's ``AttentionSpec``
is derived at load time by a probe: one short forward with a recording attention function, which
sees exactly what every layer passes (head counts from the projected shapes, ``scaling``,
``sliding_window``, ``softcap``, any mask or extra argument). Deriving it from the calls rather
than from config attributes is what makes it family-independent: Mistral takes its window from
the config, Qwen2 and Gemma from ``layer_types``, OPT pre-scales q and passes ``scaling=1.0``.
Whatever the probe sees that compileattn cannot serve is refused here, with the reason, before
any cache is allocated.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterator, NamedTuple

import torch
from torch import nn

from ..kv_cache import AttentionSpec
from ..refusals import UnsupportedModelError
from . import attention as hf_attention
from .attention import BINDING_ATTR, IMPLEMENTATION, LayerBinding

logger = logging.getLogger("compileattn")

_PROBE = "compileattn_probe"
#: Layer types (``config.layer_types``) whose attention compileattn serves.
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")
#: RoPE variants whose frequencies transformers picks in the forward from its longest position,
#: each with why compileattn refuses it. ``longrope`` switches from its short to its long factors
#: once that position passes ``original_max_position_embeddings``: with all sequences of a step
#: packed into one row, a short sequence would get a long one's frequencies. ``dynamic`` rescales
#: only past ``max_position_embeddings``, which no served sequence reaches, but decides so in a
#: data-dependent branch that torch.compile cannot trace, on state kept across forwards.
BATCH_DEPENDENT_ROPE = {
    "longrope": "switches from its short to its long frequencies when the longest position in the forward passes "
                "original_max_position_embeddings; with every sequence of a step packed into one row, a short "
                "sequence would get a long one's frequencies",
    "dynamic": "recomputes its frequencies in every forward from its longest position, in a data-dependent branch "
               "on state kept across forwards that torch.compile cannot trace",
}
#: Norm-relative agreement the load-time check wants between the model's own logits and
#: ``compute_logits`` (the latter applies its transform in fp32, the model in its own dtype).
_LOGITS_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


class LogitTransform(NamedTuple):
    """What a family's ``*ForCausalLM.forward`` does to the logits after ``lm_head``, which
    ``compute_logits`` must repeat (compileattn runs the decoder, not that forward): ``op`` with
    the text config's ``attribute`` as its parameter, for the families whose ``model_type`` is in
    ``model_types`` (``None``: any family whose config has the attribute). An attribute that is
    unset or ``None`` (or a softcap of 0) means no transform."""
    attribute: str
    op: str  # a key of LOGIT_OPS
    model_types: tuple[str, ...] | None = None


#: ``LogitTransform.op`` -> (fp32 logits, the config's parameter c) -> logits.
LOGIT_OPS = {
    "softcap": lambda logits, c: torch.tanh(logits / c) * c,
    "multiply": lambda logits, c: logits * c,
    "divide": lambda logits, c: logits / c,
}


#: The post-``lm_head`` logit transforms compileattn applies, in this order. The scales are named by
#: ``model_type``, not by attribute alone: HyperCLOVA X multiplies by the ``logits_scaling`` that
#: Granite divides by. A family not listed here that transforms its logits is refused at load
#: (``HFCausalLM._check_logits`` compares ``compute_logits`` with the model's own logits).
LOGIT_TRANSFORMS = (
    LogitTransform("final_logit_softcapping", "softcap"),  # Gemma-2/3 and kin
    LogitTransform("logit_scale", "multiply", ("cohere", "cohere2", "cohere2_moe")),
    LogitTransform("logits_scaling", "divide", ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid")),
    LogitTransform("logits_scaling", "multiply", ("hyperclovax",)),
)


class _ProbeCall:
    __slots__ = ("module", "query", "key", "value", "mask", "mask_function", "kwargs")

    def __init__(self, module, query, key, value, mask, mask_function, kwargs):
        self.module, self.query, self.key, self.value, self.mask, self.mask_function, self.kwargs = (
            module, query, key, value, mask, mask_function, kwargs)


_recording: list[_ProbeCall] | None = None
#: Storage address of each mask ``_probe_mask`` made in the current probe -> (the mask, kept so
#: that the address is not reused, and transformers' ``mask_function`` it was made from).
_masks: dict[int, tuple[torch.Tensor, object]] | None = None


def _probe_mask(**kwargs):
    """transformers' mask interface for the probe: the boolean mask its sdpa attention would get,
    remembered with the mask function that made it. Served, the model gets no mask at all (no
    mask function is registered for ``"compileattn"``), so a window or any other pattern that a
    model applies only through its mask, not through its attention call's arguments (Qwen2-MoE's
    and PhiMoE's sliding windows), is found here, by comparing each layer's mask with its spec."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**{**kwargs, "allow_is_causal_skip": False})
    if isinstance(mask, torch.Tensor) and _masks is not None:
        _masks[mask.untyped_storage().data_ptr()] = (mask, kwargs.get("mask_function"))
    return mask


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    """Records the call; returns zeros (the probe needs the arguments, not the result), shaped as
    transformers' attention output (batch, tokens, heads, value's head dim): a query-shaped result
    failed in the model's output projection where V's head dim differs from Q's (DeepSeek's MLA),
    before ``check_call`` could refuse the layer with the reason. A mask ``_probe_mask`` made (or
    a view of one) is recorded as its mask function, not as a mask."""
    if _recording is None:
        raise RuntimeError("compileattn's probe attention ran outside a probe")
    mask_function = None
    if isinstance(attention_mask, torch.Tensor):
        made = _masks.get(attention_mask.untyped_storage().data_ptr())
        if made is not None and made[1] is not None:
            attention_mask, mask_function = None, made[1]
    _recording.append(_ProbeCall(module, query, key, value, attention_mask, mask_function, kwargs))
    return query.new_zeros((*query.shape[:-1], value.shape[-1])).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _probing(model) -> Iterator[list[_ProbeCall]]:
    global _recording, _masks
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(_PROBE, _probe_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_PROBE, _probe_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_PROBE)
    _recording, _masks = [], {}
    try:
        yield _recording
    finally:
        _recording = _masks = None
        model.set_attn_implementation(previous)


def _check_mask(mask_function, spec: AttentionSpec, layer_name: str, max_position: int) -> None:
    """Refuse a layer whose mask (transformers' ``mask_function``: which keys a query position may
    see) is not causal attention with the spec's left window: compileattn attends by the spec alone.
    Checked at the first 64 positions, around the window's edge and at the last position."""
    window = spec.sliding_window
    edges = (window - 1, window, window + 1, window + 2, 2 * window + 2) if window >= 0 else ()
    positions = sorted({*range(min(64, max_position)), *(q for q in edges if 0 <= q < max_position),
                        max_position - 1})
    zero = torch.zeros((), dtype=torch.long)
    for q in positions:
        kv = torch.arange(q + 2)  # one key past the query: must be masked
        expected = (kv <= q) & ((q - kv <= window) if window >= 0 else True)
        try:
            seen = torch.as_tensor(mask_function(zero, zero, torch.tensor(q), kv)).expand(kv.shape)
        except Exception as exc:  # a mask function that needs vmap or more than positions
            raise UnsupportedModelError(f"{layer_name}: its attention mask could not be compared with causal "
                                        f"attention ({type(exc).__name__}: {exc})") from None
        seen = seen.bool()
        if not torch.equal(seen, expected):
            hidden, shown = (expected & ~seen).nonzero()[:, 0].tolist(), (seen & ~expected).nonzero()[:, 0].tolist()
            raise UnsupportedModelError(
                f"{layer_name}: its attention mask is not what its attention call asks for (causal, window_left="
                f"{window}): at query position {q} the mask "
                + (f"hides keys {hidden[:4]}" if hidden else f"shows keys {shown[:4]}")
                + "; transformers applies it (a sliding window, say) through the mask only, which compileattn "
                  "cannot apply")


def _refuse_config(model) -> None:
    config = model.config
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; compileattn serves decoder-only "
                                    f"causal LMs")
    if config.get_text_config() is not config:
        raise UnsupportedModelError(f"{name} is a multimodal model ({type(config).__name__} has sub-configs); "
                                    f"compileattn serves text-only causal LMs")
    if model.get_output_embeddings() is None:
        raise UnsupportedModelError(f"{name} has no output embeddings (lm_head): not a causal LM")
    layer_types = getattr(config, "layer_types", None) or ()
    unserved = sorted(set(layer_types) - set(SERVED_LAYER_TYPES))
    if unserved:
        raise UnsupportedModelError(f"{name} has layers of type {unserved}; compileattn serves "
                                    f"{list(SERVED_LAYER_TYPES)}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    ropes = rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for r in ropes:
        rope_type = (r or {}).get("rope_type", (r or {}).get("type"))
        if rope_type in BATCH_DEPENDENT_ROPE:
            raise UnsupportedModelError(
                f"{name} uses rope_type={rope_type!r}, which {BATCH_DEPENDENT_ROPE[rope_type]}")
    no_rope = getattr(config, "no_rope_layers", None) or ()
    if getattr(config, "attn_temperature_tuning", False) and not all(no_rope):
        # Llama-4's NoPE layers (no_rope_layers[i] == 0) scale their queries by a function of the
        # token's index in the row plus the transformers cache's length, not of position_ids.
        raise UnsupportedModelError(
            f"{name} uses attn_temperature_tuning, which scales its NoPE layers' queries by each token's index "
            f"in the row plus the transformers cache's length rather than by position_ids; with every sequence "
            f"of a step packed into one row and no transformers cache, tokens would get another position's "
            f"scale")


def _spec_of_call(call: _ProbeCall, layer_name: str) -> AttentionSpec:
    kwargs = dict(call.kwargs)
    scaling = kwargs.pop("scaling", None)
    dropout = kwargs.pop("dropout", 0.0)
    sliding_window = kwargs.pop("sliding_window", None)
    softcap = kwargs.pop("softcap", None)
    if not getattr(call.module, "is_causal", True):
        raise UnsupportedModelError(f"{layer_name} is not causal (bidirectional attention); compileattn "
                                    f"attends causally only")
    try:
        spec = hf_attention.spec_from_settings(hf_attention.settings_from_call(
            call.query, call.key, scaling, sliding_window, softcap))
        hf_attention.check_call(LayerBinding(layer_name, spec), call.query, call.key, call.value, call.mask,
                                scaling, dropout, sliding_window, softcap, kwargs)
    except hf_attention.AttentionMismatchError as exc:  # names the layer already
        raise UnsupportedModelError(str(exc)) from None
    except ValueError as exc:
        raise UnsupportedModelError(f"{layer_name}: {exc}") from None
    return spec


def _body(model) -> nn.Module:
    """The decoder whose hidden states ``lm_head`` reads: ``model.base_model``, or ``model.model``
    where ``base_model`` is the whole LM. That is a causal LM whose ``base_model_prefix`` names the
    attribute a multimodal model holds it under ("language_model": Llama-4's and Mllama's text
    models), which it lacks itself; its own forward runs ``self.model``."""
    body = model.base_model
    if body is model:
        body = getattr(model, "model", None)
        if not isinstance(body, nn.Module):
            raise UnsupportedModelError(f"{type(model).__name__} has no decoder apart from its LM head (its "
                                        f"base_model is the model itself and it has no .model)")
    return body


def bind_layers(model, num_tokens: int = 3) -> dict[str, AttentionSpec]:
    """Probe ``model`` (a transformers causal LM, already on its device and dtype), refuse what
    compileattn cannot serve, and bind every attention module to its layer name and spec.
    Returns layer name -> spec, in call order."""
    _refuse_config(model)
    names = {id(m): n for n, m in model.named_modules()}
    ids, pos = _probe_inputs(model, num_tokens)
    with _probing(model) as calls, torch.no_grad():
        _body(model)(input_ids=ids, position_ids=pos, use_cache=False)
    name = type(model).__name__
    if not calls:
        raise UnsupportedModelError(f"{name} does not route attention through transformers' AttentionInterface "
                                    f"(no layer called the attention function)")
    expected = getattr(model.config, "num_hidden_layers", None)
    if expected is not None and len(calls) != expected:
        raise UnsupportedModelError(f"{name} has {expected} layers but {len(calls)} attention calls went through "
                                    f"the AttentionInterface; every layer must, exactly once")
    specs: dict[str, AttentionSpec] = {}
    max_position = int(getattr(model.config.get_text_config(), "max_position_embeddings", None) or 4096)
    checked_masks = set()  # (mask function, window): layers of one type share their mask, checked once
    for call in calls:
        layer_name = names[id(call.module)]
        if layer_name in specs:
            raise UnsupportedModelError(f"{layer_name} attends more than once per forward (shared layers); its "
                                        f"KV cache would be written twice")
        spec = specs[layer_name] = _spec_of_call(call, layer_name)
        if call.mask_function is not None and (id(call.mask_function), spec.sliding_window) not in checked_masks:
            _check_mask(call.mask_function, spec, layer_name, max_position)
            checked_masks.add((id(call.mask_function), spec.sliding_window))
    _check_cache_windows(model, specs, max_position)
    _check_positions(model, ids, pos, names, max_position)
    for layer_name, spec in specs.items():
        setattr(model.get_submodule(layer_name), BINDING_ATTR, LayerBinding(layer_name, spec))
    return specs


def _check_cache_windows(model, specs: dict[str, AttentionSpec], max_position: int) -> None:
    """Refuse a layer whose transformers cache keeps fewer keys than its attention sees. transformers
    builds a sliding-window cache layer from the config alone (``config.sliding_window`` with no
    ``layer_types`` makes every layer one), whatever the attention call and the mask do: where they
    attend further back (Moshi), the model's ``generate()`` attends a window in decode steps that its
    forward, prefill included, does not apply. compileattn attends by the spec alone, so its tokens
    would differ from that ``generate()``. A window no sequence reaches (at least ``max_position``
    keys) drops nothing and is served. Cache layers pair with the attention calls in order, one
    per decoder layer (``bind_layers`` checked that); a cache transformers cannot build for the
    config is no cache that could differ."""
    from transformers.cache_utils import DynamicCache

    try:
        cache_layers = DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001  (no cache for this config: nothing its generate() could window)
        return
    for layer, (layer_name, spec) in zip(cache_layers, specs.items()):
        kept = getattr(layer, "sliding_window", None)
        if kept is None or kept >= max_position:
            continue
        seen = spec.sliding_window + 1 if spec.sliding_window >= 0 else None  # keys a query sees, itself included
        if seen is None or kept < seen:
            raise UnsupportedModelError(
                f"{layer_name}: transformers' cache for this config is a sliding window of {kept} keys while its "
                f"attention call and mask attend further back (causal, window_left={spec.sliding_window}): the "
                f"model's own generate() applies that window in decode steps only, which compileattn cannot "
                f"reproduce")


#: Norm-relative difference ``_check_positions`` allows between a query (or key) and the same
#: token's at the same position in the second packed sequence: rounding only.
_PACKED_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}


def _check_positions(model, ids: torch.Tensor, pos: torch.Tensor, names: dict[int, str], max_position: int) -> None:
    """compileattn packs every sequence of a step into one row and gives each token its position
    through ``position_ids``; a model must compute a token's query and key from its id and that
    position alone. Three probes of the row, every layer's queries and keys compared:

    - the probe's tokens packed twice, as two sequences starting at position 0: the second's must
      be the first's. A model that numbers tokens by their index in the row instead
      (BartForCausalLM and its kin take positions from the cache length and drop ``position_ids``)
      would serve every token after a step's first sequence, and every decode token, at the wrong
      position;
    - the second sequence moved to the last positions below ``max_position``: the first's must not
      change. A model whose position encoding depends on the longest position in the forward
      (PhiMoE scales cos/sin by ``long_mscale`` or ``short_mscale`` by ``max(position_ids)``,
      whatever its ``rope_type``) would give a short sequence another encoding when a long one
      shares its step; its own ``generate()`` even re-encodes the whole cache when a sequence
      crosses the switch, which a paged cache cannot;
    - the first probe again: a forward at those positions must not have changed the model's state
      (a rotary embedding that keeps the frequencies of the longest sequence it saw)."""
    n = ids.shape[1]
    runs = {}
    far = torch.arange(max_position - n, max_position, device=pos.device).unsqueeze(0)
    for run, second in (("near", pos), ("far", far), ("again", pos)):
        if run != "near" and max_position <= n:
            break
        with _probing(model) as calls, torch.no_grad():
            _body(model)(input_ids=ids.repeat(1, 2), position_ids=torch.cat([pos, second], dim=1), use_cache=False)
        runs[run] = calls
    name = type(model).__name__
    for i, call in enumerate(runs["near"]):
        for what in ("query", "key"):
            x = getattr(call, what)
            tol = _PACKED_TOLERANCE.get(x.dtype, 2e-2)
            first = x[..., :n, :].float()
            err = _relative(x[..., n:, :] if x.shape[-2] == 2 * n else None, first)
            if not err <= tol:
                raise UnsupportedModelError(
                    f"{name} does not place tokens by position_ids: {names[id(call.module)]}'s {what} for the same "
                    f"tokens at the same positions differs in a second sequence packed into the row (relative "
                    f"difference {err:.2e}); "
                    f"compileattn packs a step's sequences into one row and gives each token its position through "
                    f"position_ids")
            for run, how in (("far", f"when a sequence at positions {max_position - n}..{max_position - 1} is "
                                     f"packed into the same row"),
                             ("again", f"after a forward at positions up to {max_position - 1}")):
                calls = runs.get(run)
                if calls is None:
                    continue
                other = getattr(calls[i], what) if i < len(calls) else None
                err = _relative(other[..., :n, :] if other is not None and other.shape == x.shape else None, first)
                if not err <= tol:
                    raise UnsupportedModelError(
                        f"{name}'s position encoding depends on more than each token's position: "
                        f"{names[id(call.module)]}'s {what} at positions 0..{n - 1} changes {how} (relative "
                        f"difference {err:.2e}); compileattn packs sequences of any length into one step, so a "
                        f"sequence's result would depend on the others'")


def _relative(x: torch.Tensor | None, reference: torch.Tensor) -> float:
    if x is None:
        return math.inf
    return ((x.float() - reference).norm() / reference.norm().clamp_min(1e-12)).item()


def _probe_inputs(model, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(num_tokens, device=device) % vocab).unsqueeze(0)
    return ids, torch.arange(num_tokens, device=device).unsqueeze(0)


def logit_transforms(text_config) -> tuple[tuple[str, float], ...]:
    """(op, parameter) of each ``LOGIT_TRANSFORMS`` entry that applies to ``text_config``, in order."""
    model_type = getattr(text_config, "model_type", None)
    found = []
    for transform in LOGIT_TRANSFORMS:
        if transform.model_types is not None and model_type not in transform.model_types:
            continue
        value = getattr(text_config, transform.attribute, None)
        if value is None or (transform.op == "softcap" and not value):
            continue
        found.append((transform.op, float(value)))
    return tuple(found)


class HFCausalLM(nn.Module):
    """A transformers causal LM behind compileattn's model interface.

    Wrapping switches ``model`` to eval mode and to the ``"compileattn"`` attention implementation
    (it then runs only inside ``compileattn.set_forward_context``), and stores a ``LayerBinding``
    on each attention module. Refuses (``UnsupportedModelError``) what it cannot serve.
    ``served_by``: what serves the wrapper (``"LLM"``), named by the error a call of the model
    outside a forward context raises (its own ``generate``, say).
    """

    def __init__(self, model, *, served_by: str | None = None):
        super().__init__()
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        model.eval()
        hf_attention.register()
        self.hf = model
        self._specs = bind_layers(model)
        for layer_name in self._specs:
            getattr(model.get_submodule(layer_name), BINDING_ATTR).served_by = served_by
        text_config = model.config.get_text_config()
        #: (op, parameter) of each ``LOGIT_TRANSFORMS`` entry this model's forward applies after ``lm_head``.
        self.logit_transforms = logit_transforms(text_config)
        max_position = getattr(text_config, "max_position_embeddings", None)
        if max_position is None:
            raise UnsupportedModelError(f"{type(model).__name__}'s config has no max_position_embeddings")
        self.max_position = int(max_position)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self._check_logits()
        model.set_attn_implementation(IMPLEMENTATION)

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: int64 (tokens,), every sequence of the step packed -> hidden (tokens, hidden)."""
        out = _body(self.hf)(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> fp32 (N, vocab): ``lm_head``, then what the model's own forward does to
        its logits after it (``LOGIT_TRANSFORMS``: Gemma's softcap, Cohere's and Granite's scales)."""
        logits = self.hf.get_output_embeddings()(hidden).float()
        for op, value in self.logit_transforms:
            logits = LOGIT_OPS[op](logits, value)
        return logits

    def attention_specs(self) -> dict[str, AttentionSpec]:
        return dict(self._specs)

    def _check_logits(self) -> None:
        """The model's own forward and ``forward`` + ``compute_logits`` must give the same logits:
        a model that transforms its logits after ``lm_head`` in a way this adapter does not
        reproduce is refused rather than sampled from wrongly. Runs with the probe's attention."""
        ids, pos = _probe_inputs(self.hf, 3)
        with _probing(self.hf), torch.no_grad():
            expected = self.hf(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
            actual = self.compute_logits(self.forward(ids[0], pos[0]))
        err = ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()
        tol = _LOGITS_TOLERANCE.get(self.dtype, 2e-2)
        if actual.shape != expected.shape or not err <= tol:
            raise UnsupportedModelError(
                f"{type(self.hf).__name__}'s forward transforms its logits after lm_head in a way compileattn does "
                f"not reproduce (relative difference {err:.2e} > {tol:.0e}); compute_logits applies "
                f"{[op for op, _ in self.logit_transforms] or 'none'} of the transforms in "
                f"compileattn.hf.model.LOGIT_TRANSFORMS")
