"""The pieces' Inductor pass that keeps residual adds out of cuBLAS ``addmm`` (passes/residual_addmm.py)."""
from __future__ import annotations


import pytest
import torch
import torch._functorch.config as functorch_config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import compileattn as ca
from compileattn import _torch_compat
from compileattn.models.llama import LlamaConfig, LlamaForCausalLM
from compileattn.passes import residual_addmm
from compileattn.compilation.inductor_piece import config_patches
from compileattn.passes.residual_addmm import UnfuseResidualAddmm, unfuse_residual_addmm
from compileattn.testing import PersistentInputs, assert_matches_eager_over_steps

aten = torch.ops.aten
T, K, N = 3, 8, 16


def _graph(device: str, inp_shape=(T, N), transposed=False, symbolic=False, **kwargs):
    """``s = addmm(inp, x, w)``, returned and reduced (two non-pointwise users, as in a piece).
    ``symbolic``: the token dim is a symbol, as in a piece compiled for dynamic shapes."""
    graph = torch.fx.Graph()
    mode = FakeTensorMode(shape_env=ShapeEnv()) if symbolic else FakeTensorMode()
    t = T
    if symbolic:
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC])
        t = mode.from_tensor(torch.empty(T), symbolic_context=context).shape[0]
    with mode:
        inp = torch.empty(*inp_shape[::-1], device=device).t() if transposed else torch.empty(
            *((t, *inp_shape[1:]) if len(inp_shape) == 2 and inp_shape[0] == T else inp_shape), device=device)
        vals = {"x": torch.empty(t, K, device=device), "w": torch.empty(K, N, device=device), "inp": inp}
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


def test_a_residual_with_a_symbolic_token_count_is_rewritten():
    graph = _graph("cuda", symbolic=True)
    assert unfuse_residual_addmm(graph) == 1
    add = next(n for n in graph.nodes if n.target is aten.add.Tensor)
    assert isinstance(add.meta["val"].shape[0], torch.SymInt)


@pytest.mark.parametrize("case", ["cpu", "bias vector", "broadcast row", "transposed", "beta 2", "alpha 2"])
def test_addmm_kept_where_cublas_or_mkl_is_the_better_place(case):
    """A bias vector (or a broadcast row) is cuBLAS's epilogue; on the CPU Inductor prefers addmm;
    a residual that is not row-major would give the add other strides than addmm's result; scaled
    forms are left as they are."""
    graph = {"cpu": lambda: _graph("cpu"), "bias vector": lambda: _graph("cuda", (N,)),
             "broadcast row": lambda: _graph("cuda", (1, N)), "transposed": lambda: _graph("cuda", transposed=True),
             "beta 2": lambda: _graph("cuda", beta=2), "alpha 2": lambda: _graph("cuda", alpha=2)}[case]()
    assert unfuse_residual_addmm(graph) == 0
    assert _targets(graph)[0] is aten.addmm.default


class _TheirPass:
    def __init__(self, key="theirs"):
        self.key, self.calls = key, []

    def __call__(self, graph):
        self.calls.append(_targets(graph))

    def uuid(self):
        return self.key


def test_the_pass_runs_before_the_users_own_and_none_turns_it_off():
    ours = config_patches({"max_autotune": False})
    assert isinstance(ours["post_grad_custom_post_pass"], UnfuseResidualAddmm) and ours["max_autotune"] is False
    theirs = _TheirPass()
    chained = config_patches({"post_grad_custom_post_pass": theirs})["post_grad_custom_post_pass"]
    chained(_graph("cuda"))
    assert theirs.calls == [[aten.mm.default, aten.add.Tensor, aten.sum.default]]  # after ours
    assert config_patches({"post_grad_custom_post_pass": None}) == {"post_grad_custom_post_pass": None}
    # a pass set in torch._inductor.config still runs, after ours
    import torch._inductor.config as inductor_config
    with inductor_config.patch(post_grad_custom_post_pass=theirs):
        assert config_patches({})["post_grad_custom_post_pass"].then == [theirs]


def test_the_cache_identity_follows_what_the_pass_does(monkeypatch):
    """Inductor keys its caches by the pass's uuid: it must differ where the rewrite differs."""
    base = UnfuseResidualAddmm().uuid()
    assert base == UnfuseResidualAddmm().uuid()
    assert UnfuseResidualAddmm(_TheirPass("a")).uuid() != UnfuseResidualAddmm(_TheirPass("b")).uuid() != base
    assert UnfuseResidualAddmm(lambda graph: None).uuid() is None  # a pass without an identity: no caching
    monkeypatch.setattr(residual_addmm, "_GPU_DEVICES", ("cuda", "xpu", "cpu"))
    assert UnfuseResidualAddmm().uuid() != base


def test_compile_fx_arguments_are_refused_as_inductor_options():
    with pytest.raises(ValueError, match="config_patches.*compile_fx arguments"):
        ca.CompileConfig(inductor_options={"config_patches": {"max_autotune": True}})


def _llama_pieces_match_eager(monkeypatch, device: str, dtype: torch.dtype, **config) -> list[int]:
    """A tiny Llama compiled with Inductor pieces matches eager; the residual adds this process
    rewrote, per piece compile."""
    rewritten = []
    real = residual_addmm.unfuse_residual_addmm
    monkeypatch.setattr(residual_addmm, "unfuse_residual_addmm", lambda g: rewritten.append(real(g)) or rewritten[-1])
    # shape_padding off: on a GPU Inductor times a padded against the plain matrix product of an
    # unaligned size (a decode size of 1, 2, 4) and keeps the faster, which then may not be an addmm:
    # counts that follow a timing would make the test flaky (it was, in either dtype).
    config = ca.CompileConfig(piece_compiler="inductor", inductor_options={"fx_graph_cache": False,
                                                                          "shape_padding": False}, **config)
    cls = ca.compile(type("ResidualLlama", (LlamaForCausalLM,), {}),
                     dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=config)
    model = cls(LlamaConfig.tiny(num_layers=2), dtype=dtype, device=device, seed=1)
    eager = LlamaForCausalLM(LlamaConfig.tiny(num_layers=2), dtype=dtype, device=device, seed=1)
    caches = ca.allocate_kv_caches(eager.attention_specs(), 64, 4, dtype=dtype, device=device)
    builder = ca.AttentionMetadataBuilder(block_size=4, num_blocks=64, max_num_tokens=64, max_blocks_per_seq=16,
                                          device=device)
    make_inputs = PersistentInputs(256, 64, device=device)
    # AOTAutograd's disk cache (on beside the FX graph cache turned off above) would serve an
    # earlier run's pieces on this machine without running the pass, or any Inductor pass at all.
    # (Its own patch(): monkeypatch's undo deletes a torch config entry it set.)
    with torch.no_grad(), functorch_config.patch(enable_autograd_cache=False):
        assert_matches_eager_over_steps(eager, model, builder, caches, make_inputs, steps=4, seed=0, num_seqs=(1, 4),
                                        max_query_len=5, max_context_len=12,
                                        capture_sizes=config.capture_sizes if device == "cuda" else None)
    return rewritten


def test_pieces_compiled_with_the_pass_match_eager(monkeypatch):
    """Inductor runs the pass on every piece it compiles; with the CPU let in (the pass rewrites GPU
    graphs only), a Llama's residual adds are rewritten inside Inductor, symbolic token count
    included, and the compiled model still matches eager."""
    monkeypatch.setattr(residual_addmm, "_GPU_DEVICES", ("cuda", "xpu", "cpu"))
    artifacts = []
    compile_real = _torch_compat.standalone_compile
    monkeypatch.setattr(_torch_compat, "standalone_compile",
                        lambda *a: artifacts.append(compile_real(*a)) or artifacts[-1])
    rewritten = _llama_pieces_match_eager(monkeypatch, "cpu", torch.float32, compile_sizes=(), cudagraph_mode="none",
                                          compile_workers=0)  # the pass must run in this process
    # on the CPU Inductor fuses every mm + add: the embedding piece has none, the piece between the
    # two attention layers and the last piece the attention's and the MLP's residual adds each
    assert sorted(rewritten) == [0, 2, 2]
    # and nothing after the pass fuses them again: no addmm in the code Inductor generated
    sources = [_torch_compat.artifact_source(a) for a in artifacts]
    assert len(sources) == 3 and all(src is not None and "addmm" not in src for src in sources)


@pytest.mark.cuda
@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_pieces_with_the_pass_match_eager_through_cuda_graphs(monkeypatch, dtype, workers):
    """On the GPU, where the pass applies: dynamic and static pieces (the decode sizes, compiled
    in this process or in workers, which run the pass in theirs), piecewise and full-decode CUDA
    graphs, against eager. On a GPU Inductor forms the addmms only in the piece between the two
    attention layers (its sums leave the piece): two per compile of it."""
    rewritten = _llama_pieces_match_eager(monkeypatch, "cuda", dtype, cudagraph_capture_sizes=[1, 2, 4, 8, 16],
                                          compile_sizes=(1, 2, 4), background_static_compiles=False,
                                          compile_workers=workers)
    assert 2 in rewritten and set(rewritten) <= {0, 2}, f"rewrites per piece compile: {rewritten}"
