"""What an argument counts as: an int or a bool, whichever library made it.

One rule for every public entry: numpy's integers and 0-dim integer tensors are ints (token ids and
sizes often come from arrays), a bool or a float never is (``int()`` would truncate 2.7 into a
window of 2, or a block id into another one); numpy's bools are bools.
"""
from __future__ import annotations

import operator

import torch


def is_bool(value) -> bool:
    """A bool, Python's or numpy's (``np.True_``)."""
    kind = type(value)
    return kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def as_int(value) -> int | None:
    """An integer (Python, numpy, or a 0-dim integer tensor) as an int; None for a float, a bool
    or anything else, which would be truncated into another block id, token id or length."""
    if is_bool(value):
        return None
    if isinstance(value, torch.Tensor) and (value.dim() != 0 or value.dtype == torch.bool or value.is_floating_point()
                                            or value.is_complex()):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def integer_as_int(value):
    """``value`` as an int where it is an integer (``as_int``), else as it is: for an argument whose
    own check follows and names it, so numpy's integers pass it as Python's do."""
    index = as_int(value)
    return value if index is None else index


def positive_int(value, name: str) -> int:
    """``value`` as an int >= 1 (``as_int``), or a TypeError / ValueError naming ``name``."""
    return _int_at_least(value, name, 1)


def non_negative_int(value, name: str) -> int:
    """``value`` as an int >= 0 (``as_int``), or a TypeError / ValueError naming ``name``."""
    return _int_at_least(value, name, 0)


def _int_at_least(value, name: str, low: int) -> int:
    index = as_int(value)
    if index is None:
        raise TypeError(f"{name} must be an int, got {value!r}")
    if index < low:
        raise ValueError(f"{name} must be >= {low}, got {index}")
    return index


def serving_device(value: torch.device | str | int, name: str = "device") -> torch.device:
    """``value`` as a device compileattn serves on: 'cpu' or 'cuda' (with an index this machine
    has), or an int (``as_int``), which is a CUDA index as in ``torch.device(0)``. Checked before
    anything loads or builds: an unparsable string, a device type with no kernels here, or CUDA on
    a machine without it otherwise surfaced from deep inside as torch's own errors ("Torch not
    compiled with CUDA enabled", a dispatcher error listing every kernel), none naming the argument."""
    spec = (value,)
    if not isinstance(value, (str, torch.device)):
        index = as_int(value)
        if index is None:
            raise TypeError(f"{name} must be a torch.device, a string such as 'cpu' or 'cuda', or a CUDA device "
                            f"index, got {value!r}")
        spec = ("cuda", index)
    try:
        device = torch.device(*spec)
    except RuntimeError as e:
        raise ValueError(f"{name}={value!r} is not a device: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}={value!r}: compileattn serves on 'cpu' or 'cuda', not {device.type!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={value!r}: no CUDA device is available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={value!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
