"""Every private torch API compileattn uses is listed in ``_torch_compat.PRIVATE_APIS``, resolves on
the installed torch, and is reached only through ``_torch_compat``: a torch upgrade that moves one
fails here, by name."""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

from compileattn import _torch_compat

PACKAGE = Path(_torch_compat.__file__).resolve().parent
SOURCES = sorted(p for d in (PACKAGE, PACKAGE.parent / "passes") for p in d.rglob("*.py"))


@pytest.mark.parametrize("dotted", sorted(_torch_compat.PRIVATE_APIS))
def test_private_api_resolves(dotted):
    assert _torch_compat.resolve(dotted) is not None


def test_every_resolved_name_is_listed():
    text = (PACKAGE / "_torch_compat.py").read_text()
    used = set(re.findall(r'resolve\("([^"]+)"\)', text))
    assert used, "found no resolve(...) calls"
    assert used <= set(_torch_compat.PRIVATE_APIS), sorted(used - set(_torch_compat.PRIVATE_APIS))
    assert set(_torch_compat.PRIVATE_APIS) <= used, "listed but never used: " + str(
        sorted(set(_torch_compat.PRIVATE_APIS) - used))


def _code_tokens(path: Path) -> str:
    """The file's code without strings and comments (a private name in a message is not a use)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return " ".join(t.string for t in tokens if t.type not in (tokenize.STRING, tokenize.COMMENT))


def test_no_private_torch_name_outside_the_compat_module():
    offenders = {}
    for path in SOURCES:
        if path.name == "_torch_compat.py":
            continue
        found = re.findall(r"torch \. (_[A-Za-z]\w*)", _code_tokens(path))
        if found:
            offenders[str(path.relative_to(PACKAGE.parent))] = sorted(set(found))
    assert not offenders, offenders


def test_missing_api_raises_import_error_naming_it_and_the_supported_versions():
    with pytest.raises(ImportError, match=r"has no torch\._no_such_module\.thing .*2\.11-2\.13"):
        _torch_compat.resolve("torch._no_such_module.thing")


def test_aot_compile_is_available_on_this_torch():
    """2.11 hides ``aot_compile`` unless enable_aot_compile is on when torch.compile wraps; the
    decorator's Dynamo-free warm start needs it on every supported torch."""
    def f(x):
        return x + 1

    aot = _torch_compat.aot_compile(f, (torch.ones(2),), {}, lambda gm, inputs: _Callable(gm.forward))
    assert torch.equal(_torch_compat.aot_function(aot)(torch.ones(2)), torch.full((2,), 2.0))


class _Callable(_torch_compat.serializable_callable_base()):
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn):
        raise NotImplementedError

    @classmethod
    def deserialize_compile_artifacts(cls, data):
        raise NotImplementedError
