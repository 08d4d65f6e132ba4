"""Loading a causal LM (and its tokenizer) from a local directory, as ``save_pretrained`` writes it.

Offline only (``local_files_only``: nothing is downloaded), no remote code, and weights from
safetensors only: a pickled ``pytorch_model.bin`` can run code when loaded, so it is read only
when the caller passes ``allow_pickle=True``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..refusals import ServingRefused

logger = logging.getLogger("compileattn")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


#: The safetensors weights transformers loads from a directory (``SAFE_WEIGHTS_NAME`` and
#: ``SAFE_WEIGHTS_INDEX_NAME``): another ``*.safetensors`` beside pickled weights (an adapter's) is
#: not the model's, and was taken for them, so transformers refused the directory without the reason.
_SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")


def check_model_directory(path: str | Path, allow_pickle: bool = False) -> None:
    """Raise what ``load_model`` raises for the directory itself, loading nothing: a
    FileNotFoundError where it does not exist, is a file or has no config.json or weights, a
    ValueError where it holds an adapter or pickled weights without ``allow_pickle``. ``load_model``
    makes these checks first; public so that a caller can refuse a wrong directory as the user's
    mistake before anything loads (the command line), and tell it from a failure of the load."""
    _check_directory(Path(path), allow_pickle)


def _check_directory(path: Path, allow_pickle: bool) -> None:
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise FileNotFoundError(f"model directory {str(path)!r} {what} (models are loaded from a local "
                                f"directory written by save_pretrained; nothing is downloaded)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    if (path / "adapter_config.json").is_file():
        # With peft installed, from_pretrained also loads the adapter: its weights (pickled ones
        # too) and a base model named in its config, none of them checked here.
        raise ValueError(f"{path} holds an adapter (adapter_config.json), which compileattn does not load; merge "
                         f"it into the model (peft's merge_and_unload) and save_pretrained the result")
    explicit = _config_weights(path)
    if explicit is not None:
        if explicit.endswith(".safetensors.index.json"):
            _check_shards(path / explicit, allow_pickle)
        elif not explicit.endswith(".safetensors") and not allow_pickle:
            raise ValueError(f"{path}'s config.json names pickled weights (transformers_weights={explicit!r}), which "
                             f"can run code when loaded; pass allow_pickle=True if you trust them, or convert them "
                             f"to safetensors")
        return  # transformers reads that file alone, and names it if it is missing
    if (path / "model.safetensors").is_file():
        return
    if (path / "model.safetensors.index.json").is_file():
        _check_shards(path / "model.safetensors.index.json", allow_pickle)
        return
    if any(path.glob("*.bin")):
        if allow_pickle:
            return
        raise ValueError(f"{path} has only pickled weights (*.bin), which can run code when loaded; pass "
                         f"allow_pickle=True if you trust them, or convert them to safetensors")
    raise FileNotFoundError(f"{path} has no weights ({' or '.join(_SAFETENSORS_FILES)})")


def _config_weights(path: Path) -> str | None:
    """``transformers_weights`` in config.json: the one weights file transformers reads from the
    directory, before and instead of ``model.safetensors``, whatever ``use_safetensors`` says. It
    takes ``*.safetensors``, ``*.safetensors.index.json`` and ``adapter_model.bin``, which it
    unpickles (``torch.load``). None where the config names none, or cannot be read here
    (transformers then refuses it with its own reason)."""
    try:
        value = json.loads((path / "config.json").read_text()).get("transformers_weights")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _check_shards(index: Path, allow_pickle: bool) -> None:
    """The shards a safetensors index names are what transformers reads, by their own suffix:
    ``use_safetensors=True`` only picks the index, and a shard named ``*.bin`` in its
    ``weight_map`` is unpickled (``torch.load``) like any ``pytorch_model.bin``."""
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # transformers refuses an index it cannot read, with its own reason
    pickled = [s for s in shards if isinstance(s, str) and not s.endswith(".safetensors")]
    if pickled and not allow_pickle:
        raise ValueError(f"{index} names shards that are not safetensors ({', '.join(pickled[:3])}), "
                         f"which can run code when loaded; pass allow_pickle=True if you trust them, or convert "
                         f"them to safetensors")


def _check_loaded_keys(path: Path, info: dict) -> None:
    """transformers leaves a parameter the checkpoint lacks at its random initial value and drops
    one the model lacks, and only logs it: a model that would generate from random weights, or
    without weights the checkpoint holds (a config that does not match), is refused instead, as
    the directory's mistake (``ServingRefused``)."""
    for kind, what in (("missing_keys", "has no weights for"), ("unexpected_keys", "holds weights the model "
                                                                                      "has no place for:")):
        keys = sorted(info.get(kind) or ())
        if keys:
            shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
            raise ServingRefused(f"the checkpoint in {path} {what} {shown} (its config.json and weights do not "
                                 f"match)")


def _check_config(path: Path) -> None:
    """transformers' refusal of the directory's config.json (not JSON, no or an unknown
    ``model_type``, one whose code is the checkpoint's own: no remote code runs), a ValueError or
    an OSError out of ``AutoConfig``, as the directory's mistake (``ServingRefused``, the same
    message); and a config with no causal LM class (``AutoModelForCausalLM`` refuses it). Read
    before the model, which reads it again: ``from_pretrained``'s own ValueErrors are not all the
    directory's, so they are not caught."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError) as exc:
        raise ServingRefused(str(exc)) from exc
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ServingRefused(f"{path}'s config.json is a {type(config).__name__} (model_type "
                             f"{getattr(config, 'model_type', None)!r}), which has no causal language model in "
                             f"transformers (AutoModelForCausalLM)")


def load_model(path: str | Path, *, dtype: torch.dtype, device: torch.device, allow_pickle: bool = False):
    """The directory's ``*ForCausalLM`` in ``dtype`` on ``device``, in eval mode. A directory whose
    config.json transformers refuses, or whose weights do not match it, is refused with a
    ``ServingRefused``."""
    from transformers import AutoModelForCausalLM

    from transformers.utils import is_accelerate_available

    path = Path(path)
    check_model_directory(path, allow_pickle)
    _check_config(path)
    # transformers places weights on a device while loading only through accelerate; without it
    # they are loaded into CPU memory and moved once.
    direct = device.type == "cpu" or is_accelerate_available()
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, device_map=str(device) if direct and device.type != "cpu" else None,
        local_files_only=True, trust_remote_code=False, use_safetensors=None if allow_pickle else True,
        output_loading_info=True)
    _check_loaded_keys(path, info)
    if not direct:
        model.to(device)
    logger.info("loaded %s from %s (%s on %s%s)", type(model).__name__, path, dtype, device,
                "" if direct else ", through CPU memory: install accelerate to load onto the device directly")
    return model.eval()


def load_tokenizer(path: str | Path):
    """The directory's tokenizer, or None when it has none."""
    path = Path(path)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
