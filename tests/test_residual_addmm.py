"""The pieces' Inductor pass that keeps residual adds out of cuBLAS ``addmm`` (passes/residual_addmm.py)."""
from __future__ import annotations

import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import compileattn as ca
from compileattn.models.llama import LlamaConfig, LlamaForCausalLM
from compileattn.passes import residual_addmm
from compileattn.passes.residual_addmm import UnfuseResidualAddmm, piece_inductor_options, unfuse_residual_addmm
from compileattn.testing import PersistentInputs, assert_matches_eager, random_step

aten = torch.ops.aten
T, K, N = 3, 8, 16


def _graph(device: str, inp_shape=(T, N), **kwargs):
    """``s = addmm(inp, x, w)``, returned and reduced (two non-pointwise users, as in a piece)."""
    graph = torch.fx.Graph()
    mode = FakeTensorMode()
    with mode:
        vals = {"x": torch.empty(T, K, device=device), "w": torch.empty(K, N, device=device),
                "inp": torch.empty(*inp_shape, device=device)}
    nodes = {}
    for name, val in vals.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = val
    s = graph.call_function(aten.addmm.default, (nodes["inp"], nodes["x"], nodes["w"]), kwargs)
    s.meta["val"] = aten.addmm.default(vals["inp"], vals["x"], vals["w"], **kwargs)
    total = graph.call_function(aten.sum.default, (s,))
    total.meta["val"] = aten.sum.default(s.meta["val"])
    graph.output((s, total))
    return graph


def _targets(graph):
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_a_residual_addmm_on_the_gpu_becomes_mm_plus_add_with_the_same_values():
    graph = _graph("cuda")
    assert unfuse_residual_addmm(graph) == 1
    assert _targets(graph) == [aten.mm.default, aten.add.Tensor, aten.sum.default]
    add = next(n for n in graph.nodes if n.target is aten.add.Tensor)
    assert add.meta["val"].shape == (T, N) and add.meta["val"].device.type == "cuda"
    assert add.meta["val"].stride() == (N, 1)
    graph.lint()
    x, w, inp = torch.randn(T, K, dtype=torch.float64), torch.randn(K, N, dtype=torch.float64), torch.randn(T, N, dtype=torch.float64)
    s, total = torch.fx.GraphModule(torch.nn.Module(), graph)(x, w, inp)
    torch.testing.assert_close(s, torch.addmm(inp, x, w))
    torch.testing.assert_close(total, torch.addmm(inp, x, w).sum())


@pytest.mark.parametrize("case", ["cpu", "bias vector", "broadcast row", "beta 2", "alpha 2"])
def test_addmm_kept_where_cublas_or_mkl_is_the_better_place(case):
    """A bias vector (or a broadcast row) is cuBLAS's epilogue; on the CPU Inductor prefers addmm;
    scaled forms are left as they are."""
    graph = {"cpu": lambda: _graph("cpu"), "bias vector": lambda: _graph("cuda", (N,)),
             "broadcast row": lambda: _graph("cuda", (1, N)), "beta 2": lambda: _graph("cuda", beta=2),
             "alpha 2": lambda: _graph("cuda", alpha=2)}[case]()
    assert unfuse_residual_addmm(graph) == 0
    assert _targets(graph)[0] is aten.addmm.default


def test_options_add_the_pass_unless_the_caller_brings_one():
    opts = piece_inductor_options({"max_autotune": False})
    assert isinstance(opts["post_grad_custom_post_pass"], UnfuseResidualAddmm) and opts["max_autotune"] is False
    mine = object()
    assert piece_inductor_options({"post_grad_custom_post_pass": mine})["post_grad_custom_post_pass"] is mine
    assert UnfuseResidualAddmm().uuid() == UnfuseResidualAddmm().uuid()  # cacheable: a stable key


def _llama_pieces_match_eager(monkeypatch, device: str, dtype: torch.dtype, **config) -> int:
    """A tiny Llama compiled with Inductor pieces matches eager; the residual adds rewritten."""
    rewritten = []
    real = residual_addmm.unfuse_residual_addmm
    monkeypatch.setattr(residual_addmm, "unfuse_residual_addmm", lambda g: rewritten.append(real(g)) or rewritten[-1])
    config = ca.CompileConfig(piece_compiler="inductor", inductor_options={"fx_graph_cache": False}, **config)
    cls = ca.compile(type("ResidualLlama", (LlamaForCausalLM,), {}),
                     dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=config)
    model = cls(LlamaConfig.tiny(num_layers=2), dtype=dtype, device=device, seed=1)
    eager = LlamaForCausalLM(LlamaConfig.tiny(num_layers=2), dtype=dtype, device=device, seed=1)
    caches = ca.allocate_kv_caches(eager.attention_specs(), 64, 4, dtype=dtype, device=device)
    builder = ca.AttentionMetadataBuilder(block_size=4, num_blocks=64, max_num_tokens=64, max_blocks_per_seq=16,
                                          device=device)
    make_inputs = PersistentInputs(256, 64, device=device)
    pad = (lambda n: next(s for s in config.capture_sizes if s >= n)) if device == "cuda" else (lambda n: None)
    rng = random.Random(0)
    with torch.no_grad():
        for i in range(4):
            seqs = random_step(rng, num_seqs=rng.randint(1, 4), block_size=4, num_blocks=64,
                               max_query_len=1 if i % 2 else 5, max_context_len=12)
            assert_matches_eager(eager, model, builder, caches, seqs, make_inputs,
                                 pad_to=pad(sum(s.query_len for s in seqs)))
    return sum(rewritten)


def test_pieces_compiled_with_the_pass_match_eager(monkeypatch):
    """Inductor runs the pass on every piece it compiles; with the CPU let in (the pass rewrites GPU
    graphs only), a Llama's residual adds are rewritten inside Inductor, symbolic token count
    included, and the compiled model still matches eager."""
    monkeypatch.setattr(residual_addmm, "_GPU_DEVICES", ("cuda", "xpu", "cpu"))
    # the middle piece holds 2 residual adds (attention's, MLP's), the last 2 more
    assert _llama_pieces_match_eager(monkeypatch, "cpu", torch.float32, compile_sizes=(),
                                     cudagraph_mode="none") >= 3


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_pieces_with_the_pass_match_eager_through_cuda_graphs(monkeypatch, dtype):
    """On the GPU, where the pass applies: dynamic and static pieces (the decode sizes), piecewise
    and full-decode CUDA graphs, against eager."""
    assert _llama_pieces_match_eager(monkeypatch, "cuda", dtype, cudagraph_capture_sizes=[1, 2, 4, 8, 16],
                                     compile_sizes=(1, 2, 4), background_static_compiles=False,
                                     compile_workers=0) >= 3
