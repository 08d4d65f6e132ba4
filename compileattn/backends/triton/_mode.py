"""Keep the kernels' compiled/interpreted flavour in step with ``TRITON_INTERPRET``.

``triton.jit`` picks JITFunction or InterpretedFunction when the decorator runs, i.e. at import.
If these modules were imported before ``TRITON_INTERPRET=1`` was set (another test module in the
same pytest process, say), their kernels are compiled-mode objects that cannot run on CPU
tensors. Re-executing the kernel modules (in dependency order, so callers pick up the new
helpers) re-decorates them in the current mode.
"""
from __future__ import annotations

import importlib
import sys

import triton

#: Kernel modules, helpers first: a module's ``from .tile import ...`` must see the reloaded ones.
KERNEL_MODULES = ("tile", "kv_write", "decode", "unified")


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def kernels_interpreted() -> bool:
    """True if every kernel module is (imported and) decorated in interpreter mode."""
    return all(getattr(_module(name), "INTERPRETED", None) is True for name in KERNEL_MODULES)


def _module(name: str):
    return sys.modules.get(f"{__package__}.{name}") or importlib.import_module(f".{name}", __package__)


def sync_interpreter_mode() -> bool:
    """Re-decorate the kernels if ``TRITON_INTERPRET`` changed since import; True if it did.

    Every module is checked, not one: another caller may have imported only some of them.
    """
    want = interpreting()
    if all(getattr(_module(name), "INTERPRETED", None) is want for name in KERNEL_MODULES):
        return False
    for name in KERNEL_MODULES:
        importlib.reload(_module(name))
    return True
