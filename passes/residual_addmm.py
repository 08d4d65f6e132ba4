"""Inductor pass for the pieces: a residual add stays an add, not the input of a cuBLAS ``addmm``.

Inductor rewrites ``x @ w + r`` into ``addmm(r, x, w)`` unless every user of the sum is pointwise
(``torch/_inductor/fx_passes/post_grad.py``: ``addmm`` and ``should_prefer_unfused_addmm``). In a
decoder without projection biases (Llama and most current LLMs) the sums are the residual
stream. Inside a piece the MLP's sum is a piece output (the layer after the next attention reads
it), and an output is not a pointwise user, so it becomes an ``addmm``; the pattern pass visits
the graph from its end, so the attention's sum, whose user is by then that ``addmm``, becomes one
too: two in every piece between two attention layers (62 for 32 layers), each of which cuBLAS
runs on CUDA as a device-to-device copy of ``r`` into the result and a GEMM with beta 1, one more
GPU operation. torch.compile's whole-model graph has none of them (there every user of a sum is
pointwise). Profiled on the H200 (run S7-1, ``piecewise_gaps_llama_S7-1.md``, Llama-3-8B shape):
62 ``Memcpy DtoD`` per step in compileattn's pieces and full-decode graph, none in the
whole-model Inductor graph.

Kept apart, the add joins the kernel that consumes the sum (the next RMSNorm), which writes the
residual stream out too. Numerics: the product is rounded to the dtype before the add, as in the
eager model (``F.linear``, then ``+``) and in the whole-model compile, which never forms these
``addmm``s; cuBLAS's fused form rounds once. Only a dense row-major ``r`` of the result's shape on
a GPU is rewritten: a broadcast bias is cuBLAS's epilogue, and on the CPU Inductor itself prefers
``addmm``.

Imported only when a piece is compiled (``compilation/inductor_piece.py``).
"""
from __future__ import annotations

import hashlib

import torch

from .. import _torch_compat

aten = torch.ops.aten
statically_known_true = _torch_compat.statically_known_true
_GPU_DEVICES = ("cuda", "xpu")


def _residual_addmm(node: torch.fx.Node) -> bool:
    """``addmm(r, a, b)`` with alpha = beta = 1 whose ``r`` is a GPU matrix of the result's shape."""
    if node.op != "call_function" or node.target is not aten.addmm.default or len(node.args) != 3:
        return False
    if any(node.kwargs.get(k, 1) != 1 for k in ("alpha", "beta")):
        return False
    inp, out = node.args[0], node.meta.get("val")
    val = inp.meta.get("val") if isinstance(inp, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    # a dense row-major matrix, as addmm's result is: the add's result then has addmm's strides
    return (val.device.type in _GPU_DEVICES and val.dim() == 2 and val.dtype == out.dtype
            and all(statically_known_true(a == b) for a, b in zip(val.shape, out.shape))
            and statically_known_true(val.stride()[1] == 1) and statically_known_true(val.stride()[0] == val.shape[1]))


def unfuse_residual_addmm(graph: torch.fx.Graph) -> int:
    """Rewrite every residual ``addmm`` of ``graph`` as ``r + a @ b``; the count rewritten."""
    count = 0
    for node in list(graph.nodes):
        if not _residual_addmm(node):
            continue
        inp, mat1, mat2 = node.args
        with graph.inserting_before(node):
            product = graph.call_function(aten.mm.default, (mat1, mat2))
            total = graph.call_function(aten.add.Tensor, (inp, product))
        # FakeTensor values (ops on them run in their own fake mode), as Inductor's lowering reads them.
        product.meta = {**node.meta, "val": aten.mm.default(mat1.meta["val"], mat2.meta["val"])}
        total.meta = {**node.meta, "val": aten.add.Tensor(inp.meta["val"], product.meta["val"])}
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        count += 1
    return count


class UnfuseResidualAddmm(_torch_compat.custom_graph_pass_base()):
    """``unfuse_residual_addmm`` as Inductor's ``post_grad_custom_post_pass`` (after its own
    pattern passes have formed the ``addmm``s), followed by ``then`` (a pass the caller set
    there already: one callable, or a list of them). ``uuid`` keys Inductor's caches: this file,
    the devices it rewrites for, and ``then``'s own ``uuid``."""

    def __init__(self, then=None):
        self.then = [] if then is None else list(then) if isinstance(then, (list, tuple)) else [then]

    def __call__(self, graph: torch.fx.Graph) -> None:
        unfuse_residual_addmm(graph)
        for other in self.then:
            other(graph)

    def uuid(self) -> bytes | None:
        parts = [_torch_compat.files_hash((__file__,)), repr(_GPU_DEVICES).encode()]
        for other in self.then:
            key = other.uuid() if hasattr(other, "uuid") else None
            if key is None:
                return None  # a pass without an identity: Inductor bypasses its caches, as it would for it
            parts.append(repr(key).encode())
        return hashlib.sha256(b"\0".join(parts)).digest()
