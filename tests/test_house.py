"""The shape of the house, checked: the per-layer path is short, backends depend on a small core
and not on each other, the package has no import cycles, and every private torch API resolves.

- Frames: in piecewise mode the attention op runs eagerly once per layer per step, so every Python
  frame between the compiled runtime and the kernel launch is paid L times a step. The target is
  at most 4 (vLLM takes three; nano-vllm two).
- Imports: ``backends/base.py`` imports nothing of the package; a backend imports only the shared
  core (``base``, ``kv_write``, ``kv_cache``) and its own subpackage; no module imports another
  that (transitively) imports it back, counting only module-level imports.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

import compileattn as ca
from compileattn import _torch_compat
from compileattn.models.attention import Attention

PACKAGE = Path(ca.__file__).resolve().parent
MAX_FRAMES = 4


def _frames_to_launch(fn, start_name: str, launch_names: set[str]) -> int:
    """Python frames from the first frame of code ``start_name`` down to (and including) the first
    call of a function named in ``launch_names``, counted by the interpreter's profile hook."""
    depth, start, found = 0, None, []

    def hook(frame, event, arg):
        nonlocal depth, start
        if event == "call":
            depth += 1
            name = frame.f_code.co_name
            if start is None and name == start_name:
                start = depth
            elif start is not None and not found and name in launch_names:
                found.append(depth - start + 1)
        elif event == "return":
            depth -= 1
            if start is not None and depth < start:
                start = None

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    assert found, f"no call of {launch_names} under {start_name}"
    return found[0]


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
def test_per_layer_path_to_the_triton_launch_is_short(decode):
    """From the compiled runtime's attention call to Triton's launch (``JITFunction.run``, or the
    interpreter's ``run`` on the CPU)."""
    spec = ca.AttentionSpec(4, 2, 32)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention(spec, "l0")

        def forward(self, q, k, v):
            return self.attn(q, k, v) * 2

    caches = ca.allocate_kv_caches({"l0": spec}, 8, 16, torch.float16)
    builder = ca.AttentionMetadataBuilder(block_size=16, num_blocks=8, max_num_tokens=8, max_blocks_per_seq=2,
                                          backend="triton")
    steps = [ca.SequenceStep(1, 5, [0]), ca.SequenceStep(1, 9, [1])] if decode else [
        ca.SequenceStep(1, 5, [0]), ca.SequenceStep(3, 0, [1])]
    md = builder.build(steps)
    n = md.num_tokens
    q = torch.randn(n, 128, dtype=torch.float16)
    k, v = torch.randn(n, 64, dtype=torch.float16), torch.randn(n, 64, dtype=torch.float16)
    compiled = torch.compile(Layer(), backend="compileattn", options={"piece_compiler": "eager"})
    with ca.set_forward_context(md, caches), torch.no_grad():
        compiled(q, k, v)  # compile, bind
        frames = _frames_to_launch(lambda: compiled(q, k, v), "call_attend", {"run"})
    assert frames <= MAX_FRAMES, f"{frames} Python frames from the runtime's attention call to the launch"


def _module_imports(path: Path, module: str) -> set[str]:
    """Package modules ``module`` imports at module level (function-local imports excluded)."""
    tree = ast.parse(path.read_text())
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n.startswith("compileattn"))
    return out


def _package_graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _module_imports(path, name) if m in modules and m != name}
    return graph


def test_no_import_cycles():
    graph = _package_graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if nxt.startswith(node + "."):
                continue  # a package's __init__ importing its own submodule is not a cycle
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_backends_depend_on_the_core_not_on_each_other():
    graph = _package_graph()
    assert graph["compileattn.backends.base"] == set(), "base.py must import nothing of the package"
    core = {"compileattn.backends.base", "compileattn.backends.kv_write", "compileattn.kv_cache"}
    for name in ("reference", "flash_fa4", "flash_fa2", "kv_write"):
        extra = graph[f"compileattn.backends.{name}"] - core
        assert not extra, f"backends/{name}.py imports {extra}"
    for name, deps in graph.items():
        if name.startswith("compileattn.backends.triton"):
            extra = {d for d in deps if not d.startswith("compileattn.backends.triton")} - core
            assert not extra, f"{name} imports {extra}"


def test_private_torch_apis_resolve():
    """Every private torch API the package uses exists in this torch (see _torch_compat)."""
    for dotted in _torch_compat.PRIVATE_APIS:
        _torch_compat.resolve(dotted)
    with pytest.raises(ImportError, match="torch .* has no torch._not_there"):
        _torch_compat.resolve("torch._not_there")
