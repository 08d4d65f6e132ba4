"""Warm start of @compileattn.compile: a second process loads Dynamo's code and the pieces from
``cache_dir`` and runs no Dynamo; a changed source, compile setting or model structure misses; a
run-time setting hits; the loaded code keeps the argument check; the cache dir must be private.

The processes compile pieces with ``piece_compiler="eager"`` (its pieces are saved as graphs),
which keeps them to seconds on the CPU; Inductor pieces are saved by the same code path and
covered by the GPU test at the end and by ``benchmarks/coldwarm.py``.
"""
from __future__ import annotations

import inspect
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import compileattn as ca
from compileattn.compilation.cache import secure_dir
from compileattn.kv_cache import AttentionSpec
from compileattn.models.attention import Attention
from compileattn.testing import assert_matches_eager, random_step

ROOT = Path(__file__).resolve().parents[1]

MODEL_SOURCE = textwrap.dedent("""
    import torch
    from torch import nn
    from compileattn.kv_cache import AttentionSpec
    from compileattn.models.attention import Attention

    H, KVH, D, HIDDEN = 2, 1, 32, 32


    class Tiny(nn.Module):
        def __init__(self, layers=3):
            super().__init__()
            self.embed = nn.Embedding(100, HIDDEN)
            self.qkv = nn.ModuleList(nn.Linear(HIDDEN, (H + 2 * KVH) * D) for _ in range(layers))
            self.attn = nn.ModuleList(Attention(AttentionSpec(H, KVH, D), f"layers.{i}") for i in range(layers))
            self.out = nn.ModuleList(nn.Linear(H * D, HIDDEN) for _ in range(layers))

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(input_ids)
            for qkv, attn, out in zip(self.qkv, self.attn, self.out):
                q, k, v = qkv(x).split([H * D, KVH * D, KVH * D], dim=-1)
                x = x + out(attn(q, k, v)) * 1.0
            return x
""")

SCRIPT = textwrap.dedent("""
    import json, random, sys
    import torch
    import compileattn as ca
    from compileattn.compilation.argcheck import RecompileError
    from compileattn.testing import assert_matches_eager, random_step
    import warm_model

    hooks = []
    torch._dynamo.convert_frame.register_bytecode_hook(lambda old, new: hooks.append(old.co_name))
    config = ca.CompileConfig(cache_dir=sys.argv[1], piece_compiler="eager", **json.loads(sys.argv[2]))
    Compiled = ca.compile(type("CompiledTiny", (warm_model.Tiny,), {}), dynamic_arg_dims={"input_ids": 0},
                          config=config)
    torch.manual_seed(0)
    model = Compiled()
    eager = warm_model.Tiny()
    eager.load_state_dict(model.state_dict())
    caches = ca.allocate_kv_caches({f"layers.{i}": a.spec for i, a in enumerate(model.attn)}, 64, 4,
                                   dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=4, num_blocks=64, max_num_tokens=64, max_blocks_per_seq=16)
    buf = torch.zeros(64, dtype=torch.long)

    def make_inputs(n):
        buf[:n].random_(0, 100)
        return (buf[:n],)

    rng = random.Random(0)
    with torch.no_grad():
        for num_seqs in (3, 1, 5):  # the first call compiles or loads; then other sizes, a 1-token step
            seqs = random_step(rng, num_seqs=num_seqs, block_size=4, num_blocks=64, max_query_len=1 if num_seqs == 1 else 5)
            assert_matches_eager(eager, model, builder, caches, seqs, make_inputs)
        md = builder.build([ca.SequenceStep(2, 0, [0])])
        try:
            with ca.set_forward_context(md, caches):
                model(buf[:2].to(torch.int32))
            refused = None
        except RecompileError as e:
            refused = str(e)
    print(json.dumps({"counters": ca.counters.snapshot(), "dynamo_frames": dict(torch._dynamo.utils.counters["frames"]),
                      "hooks": hooks, "stats": model.forward.compile_stats, "refused": refused}))
""")


def _process(tmp_path: Path, **options) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "src"), str(ROOT),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "cache"), json.dumps(options)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _write_model(tmp_path: Path, source: str) -> None:
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "warm_model.py").write_text(source)


def test_second_process_loads_without_dynamo_and_a_changed_source_misses(tmp_path):
    _write_model(tmp_path, MODEL_SOURCE)
    cold = _process(tmp_path)
    assert cold["stats"]["path"] == "cold" and cold["counters"]["dynamo_graphs"] == 1
    assert cold["counters"]["pieces"] == 4 and cold["counters"]["backend_compiles"] < 4  # identical middle pieces
    assert "refused" in cold and "'input_ids' dtype changed from torch.int64 to torch.int32" in cold["refused"]

    warm = _process(tmp_path)
    assert warm["stats"]["path"] == "warm", warm["stats"]
    assert warm["counters"]["dynamo_graphs"] == 0 and warm["counters"]["backend_compiles"] == 0
    assert warm["dynamo_frames"].get("total", 0) == 0, warm["dynamo_frames"]  # Dynamo never saw a frame
    assert warm["hooks"] == []  # no bytecode hook call: nothing was transformed
    assert warm["refused"] is not None and "'input_ids' dtype changed" in warm["refused"]
    assert warm["stats"]["load_s"] > 0 and warm["stats"]["first_call_s"] > 0

    _write_model(tmp_path, MODEL_SOURCE.replace("* 1.0", "* 2.0"))  # same structure, other computation
    changed = _process(tmp_path)
    assert changed["stats"]["path"] == "cold" and changed["counters"]["dynamo_graphs"] == 1  # and it matched eager


# -- in one process: what the key decides ------------------------------------------------------------

H, KVH, D, HIDDEN = 2, 1, 32, 32


class Stack(nn.Module):
    def __init__(self, layers: int = 2, scale: float = 1.0, tied: str | None = None):
        super().__init__()
        self.scale = scale  # a plain attribute the trace bakes in
        self.qkv = nn.ModuleList(nn.Linear(HIDDEN, (H + 2 * KVH) * D) for _ in range(layers))
        self.attn = nn.ModuleList(Attention(AttentionSpec(H, KVH, D), f"l{i}") for i in range(layers))
        self.out = nn.ModuleList(nn.Linear(H * D, HIDDEN) for _ in range(layers))
        if tied == "module":  # the last layer's output projection is the first one's
            self.out[-1] = self.out[0]
        elif tied == "parameter":
            self.out[-1].weight = self.out[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for qkv, attn, out in zip(self.qkv, self.attn, self.out):
            q, k, v = qkv(x).split([H * D, KVH * D, KVH * D], dim=-1)
            x = x + out(attn(q, k, v)) * self.scale
        return x


def _run_stack(cache_dir, layers: int = 2, scale: float = 1.0, tied: str | None = None, **options) -> dict:
    """A fresh decoration (as in a new process: no compiled site to reuse) and one checked step."""
    config = ca.CompileConfig(cache_dir=str(cache_dir), piece_compiler="eager", **options)
    cls = ca.compile(type("CompiledStack", (Stack,), {}), dynamic_arg_dims={"x": 0}, config=config)
    torch.manual_seed(0)
    model = cls(layers, scale, tied)
    eager = Stack(layers, scale, tied)
    eager.load_state_dict(model.state_dict())
    caches = ca.allocate_kv_caches({f"l{i}": AttentionSpec(H, KVH, D) for i in range(layers)}, 64, 4,
                                   dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=4, num_blocks=64, max_num_tokens=32, max_blocks_per_seq=16)
    seqs = random_step(random.Random(1), num_seqs=3, block_size=4, num_blocks=64, max_query_len=4)
    before = ca.counters.dynamo_graphs
    with torch.no_grad():
        assert_matches_eager(eager, model, builder, caches, seqs, lambda n: (torch.randn(n, HIDDEN),))
    return {**model.forward.compile_stats, "dynamo_graphs": ca.counters.dynamo_graphs - before}


def test_key_misses_on_compile_settings_and_structure_and_hits_on_run_time_settings(tmp_path):
    assert _run_stack(tmp_path)["path"] == "cold"
    hit = _run_stack(tmp_path)
    assert (hit["path"], hit["dynamo_graphs"]) == ("warm", 0)
    runtime_only = _run_stack(tmp_path, max_capture_size=128, attention_backend="reference", cudagraph_mode="none",
                              check_input_addresses=False)
    assert runtime_only["path"] == "warm", "a run-time setting missed the warm-start cache"
    assert _run_stack(tmp_path, hoist_shape_logic=False)["path"] == "cold"  # compiled differently
    assert _run_stack(tmp_path, layers=3)["path"] == "cold"  # other parameters
    assert _run_stack(tmp_path, scale=2.0)["path"] == "cold"  # same parameters, another baked-in attribute
    assert len(list((tmp_path / "warm_start").iterdir())) == 4


@pytest.mark.parametrize("tied", ["module", "parameter"])
def test_which_tensors_a_model_shares_between_layers_is_in_the_key(tmp_path, tied):
    """Dynamo passes a tensor the model reaches under two names as one graph input: a compile of a
    model whose layers share a weight, loaded for one of the same shapes whose layers do not, would
    run the second layer with the first one's weight."""
    assert _run_stack(tmp_path, tied=tied)["path"] == "cold"
    assert _run_stack(tmp_path)["path"] == "cold"
    assert _run_stack(tmp_path, tied=tied)["path"] == "warm"


class _ByLayout(nn.Module):
    """Takes another path for a weight stored transposed: Dynamo bakes the branch in, as Inductor's
    code bakes in the strides it was compiled for."""

    def __init__(self, transposed: bool):
        super().__init__()
        w = torch.arange(12.0).reshape(3, 4)
        self.w = nn.Parameter(w.t().contiguous().t() if transposed else w, requires_grad=False)

    def forward(self, x):
        return x @ self.w.t() * (2 if self.w.is_contiguous() else 3)


def test_how_a_models_weights_are_laid_out_is_in_the_key(tmp_path):
    """A model whose weight is stored transposed (same shape, dtype and device) loaded the compile
    of one whose weight is not, and returned its answer."""
    def run(transposed):
        cls = ca.compile(type("CompiledByLayout", (_ByLayout,), {}), dynamic_arg_dims={"x": 0},
                         config=_eager_pieces(tmp_path))
        model = cls(transposed)
        with torch.no_grad():
            assert torch.equal(model(torch.ones(5, 4)), _ByLayout(transposed)(torch.ones(5, 4)))
        return model.forward.compile_stats["path"]

    assert [run(False), run(True), run(True), run(False)] == ["cold", "cold", "warm", "warm"]


class _Tenfold(torch.Tensor):
    """A subclass whose ``__torch_function__`` multiplies every product by 10 (Dynamo traces it in)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.Tensor.mul, torch.Tensor.__mul__):
            return super().__torch_function__(torch.Tensor.mul, types, (out, 10))
        return out


class _SubclassWeighted(nn.Module):
    def __init__(self, subclass: bool):
        super().__init__()
        w = torch.arange(4.0)
        self.w = nn.Parameter(w.as_subclass(_Tenfold) if subclass else w, requires_grad=False)

    def forward(self, x):
        return x * self.w


def test_a_weight_of_a_tensor_subclass_is_in_the_key(tmp_path):
    """A model whose weight is of a tensor subclass (a quantized weight, a ``__torch_function__``
    override) of the same shape and dtype as another's plain one loaded that one's compile and
    returned its answer, and the two overwrote each other's file. Inductor pieces: Dynamo traces the
    override in, and eager pieces would run it once more on the subclass weight."""
    config = ca.CompileConfig(piece_compiler="inductor", compile_workers=0, compile_sizes=[], cache_dir=str(tmp_path))

    def run(subclass):
        cls = ca.compile(type("CompiledSubclassWeighted", (_SubclassWeighted,), {}), dynamic_arg_dims={"x": 0},
                         config=config)
        model = cls(subclass)
        with torch.no_grad():
            assert torch.equal(model(torch.ones(5, 4)), _SubclassWeighted(subclass)(torch.ones(5, 4)))
        return model.forward.compile_stats["path"]

    assert [run(True), run(False), run(False), run(True)] == ["cold", "cold", "warm", "warm"]
    assert len(list((tmp_path / "warm_start").iterdir())) == 2


def test_a_warm_first_call_settles_the_triton_cache_dir_as_a_cold_one_does(tmp_path, monkeypatch):
    """A cold first call on a GPU launches the attention kernels after ``TRITON_CACHE_DIR`` is set
    (Inductor's rule, ``kernel_warmup``): a warm one must set it before its first launch too, or
    it compiles them again in Triton's default directory (2 s of a 4.7 s warm start, run S19-1).
    On the CPU the setting is a no-op; here the call is counted on both paths."""
    from compileattn.compilation import kernel_warmup

    settled = []
    monkeypatch.setattr(kernel_warmup, "settle_cache_dir", lambda: settled.append(ca.counters.dynamo_graphs))
    assert _run_stack(tmp_path)["path"] == "cold" and len(settled) == 1
    assert _run_stack(tmp_path)["path"] == "warm" and len(settled) == 2


def test_settling_the_triton_cache_dir_sets_inductors_directory_only_when_unset(monkeypatch):
    """What a GPU first call settles (faked device: the CPU has no CUDA context to build)."""
    from types import SimpleNamespace

    from compileattn import _torch_compat, context
    from compileattn.compilation import kernel_warmup

    monkeypatch.setattr(_torch_compat, "inductor_triton_cache_dir", lambda index: f"/inductor/triton/{index}")
    monkeypatch.setattr(kernel_warmup, "settled_environment", {})
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(context, "_current", None)
    kernel_warmup.settle_cache_dir()  # no forward context: nothing to launch
    assert "TRITON_CACHE_DIR" not in os.environ
    monkeypatch.setattr(context, "_current", SimpleNamespace(metadata=SimpleNamespace(device=torch.device("cpu"))))
    kernel_warmup.settle_cache_dir()
    assert "TRITON_CACHE_DIR" not in os.environ
    monkeypatch.setattr(context, "_current", SimpleNamespace(metadata=SimpleNamespace(device=torch.device("cuda", 1))))
    kernel_warmup.settle_cache_dir()
    assert os.environ["TRITON_CACHE_DIR"] == "/inductor/triton/1"
    assert kernel_warmup.settled_environment == {"TRITON_CACHE_DIR": "/inductor/triton/1"}
    monkeypatch.setenv("TRITON_CACHE_DIR", "/users/own")
    kernel_warmup.settle_cache_dir()
    assert os.environ["TRITON_CACHE_DIR"] == "/users/own"


def test_a_cache_made_on_another_machine_misses(tmp_path, monkeypatch):
    """Inductor's C++ kernels are built for this CPU (``-march=native``), its Triton kernels for
    this GPU and Triton: a shared cache directory must not hand them to another machine."""
    from compileattn.compilation import cache

    assert _run_stack(tmp_path)["path"] == "cold"
    assert _run_stack(tmp_path)["path"] == "warm"
    monkeypatch.setattr(cache, "_cpu_identity", lambda: "x86_64 another-cpus-flags")
    assert _run_stack(tmp_path)["path"] == "cold"
    monkeypatch.setattr(cache, "_triton_version", lambda: "0.0-another")
    assert _run_stack(tmp_path)["path"] == "cold"
    assert _run_stack(tmp_path)["path"] == "warm"


def test_the_machine_key_names_the_gpus_only_once_cuda_is_initialised(monkeypatch):
    from types import SimpleNamespace

    from compileattn.compilation import cache

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: pytest.fail("CUDA queried"))
    cpu_only = cache.machine_key()
    assert not any(line.startswith("cuda") for line in cpu_only)
    gpus = {0: SimpleNamespace(name="NVIDIA H200", major=9, minor=0)}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gpus[index])
    h200 = cache.machine_key()
    assert h200 == cpu_only + ["cuda=['NVIDIA H200 sm90']"]
    gpus[1] = gpus[0]
    assert cache.machine_key() == h200  # more GPUs of the same kind: the same code serves
    gpus[1] = SimpleNamespace(name="NVIDIA A100-SXM4-80GB", major=8, minor=0)
    assert cache.machine_key() != h200


def _eager_pieces(tmp_path):
    return ca.CompileConfig(piece_compiler="eager", compile_workers=0, cache_dir=str(tmp_path))


def test_a_warm_start_whose_compile_assumed_other_sizes_compiles_instead(tmp_path):
    """The key leaves the dynamic sizes out: a file compiled for 3 rows (which took the trace's
    `<= 4` branch) must not answer a first call of 8 rows."""
    def branchy(x):
        return x * 2 if x.shape[0] > 4 else x * 3

    small = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(branchy)
    assert torch.equal(small(torch.ones(3, 2)), torch.full((3, 2), 3.0))
    large = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(branchy)
    assert torch.equal(large(torch.ones(8, 2)), torch.full((8, 2), 2.0))
    assert large.compile_stats["path"] == "cold"


def _scaler(scale):
    def scaled(x):
        return x * scale

    return scaled


def test_what_a_function_closes_over_and_a_models_private_attributes_and_hooks_are_in_the_key(tmp_path):
    """Two functions of one factory share their source; two instances of one class differ in a
    `_`-named attribute, a nested tuple, a config object or which hook they carry: each is a compile
    of its own, never the other's file."""
    for scale in (2.0, 5.0):
        f = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(_scaler(scale))
        assert torch.equal(f(torch.ones(3)), torch.full((3,), scale)) and f.compile_stats["path"] == "cold"

    class Settings:  # a plain object, as transformers' configs are
        def __init__(self, factor):
            self.factor = factor

    class Scaled(nn.Module):
        def __init__(self, private, nested, settings):
            super().__init__()
            self._private, self.nested, self.settings = private, nested, settings

        def forward(self, x):
            return x * self._private * self.nested[0][0] * self.settings.factor

    variants = [(2.0, ((1.0,),), Settings(1.0)), (3.0, ((1.0,),), Settings(1.0)), (2.0, ((4.0,),), Settings(1.0)),
                (2.0, ((1.0,),), Settings(7.0))]
    for args in variants:
        model = Scaled(*args)
        forward = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(Scaled.forward)
        assert torch.equal(forward(model, torch.ones(3)), model.forward(torch.ones(3)))
        assert forward.compile_stats["path"] == "cold", args
    for factor in (2.0, 5.0):
        model = Scaled(1.0, ((1.0,),), Settings(1.0))
        model.register_forward_hook(lambda module, inputs, out, factor=factor: out * factor)
        compiled = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(lambda m, x: m(x))
        assert torch.equal(compiled(model, torch.ones(3)), torch.full((3,), factor))
        assert compiled.compile_stats["path"] == "cold"


class _Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def test_a_model_passed_inside_a_list_is_in_the_key(tmp_path):
    def applied(layers, x):
        return layers[0](x)

    for factor in (2.0, 5.0):
        f = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(applied)
        assert torch.equal(f([_Scale(factor)], torch.ones(3)), torch.full((3,), factor))
        assert f.compile_stats["path"] == "cold"


def test_a_model_closed_over_inside_a_list_is_in_the_key(tmp_path):
    """A closure cell holding a list of models: each model is described by its attributes, as a
    model closed over directly is (a list of modules is otherwise named only)."""
    def closing_over(layers):
        def applied(x):
            return layers[0](x)

        return applied

    from compileattn.compilation import warm_start

    prints = [list(warm_start.closure_fingerprint(closing_over([_Scale(factor)]))) for factor in (2.0, 5.0)]
    assert prints[0] != prints[1]
    assert any("factor=2.0" in line for line in prints[0]) and any("factor=5.0" in line for line in prints[1])
    for factor in (2.0, 5.0):
        f = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(closing_over([_Scale(factor)]))
        assert torch.equal(f(torch.ones(3)), torch.full((3,), factor))
        assert f.compile_stats["path"] == "cold", factor


class _Runner:
    """Not a module: a runner object holding a model and a setting its method reads."""

    def __init__(self, model, factor):
        self.model, self.factor = model, factor

    def step(self, x):
        return self.model(x) * self.factor


@pytest.mark.parametrize("model_factor, runner_factor", [(5.0, 1.0), (1.0, 5.0)], ids=["its_model", "its_setting"])
def test_a_plain_object_whose_method_is_compiled_is_in_the_key_with_the_model_it_holds(tmp_path, model_factor,
                                                                                        runner_factor):
    """The instance of a decorated method that is not a module was keyed by nothing: a process
    whose runner held another model (another dtype, other attributes) or setting loaded this one's
    compile and ran it (garbage values over float64 weights, or the first runner's answer)."""
    first = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(_Runner.step)
    assert torch.equal(first(_Runner(_Scale(1.0), 1.0), torch.ones(3)), torch.ones(3))
    other = _Runner(_Scale(model_factor), runner_factor)
    second = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(_Runner.step)
    assert torch.equal(second(other, torch.ones(3)), torch.full((3,), 5.0))
    assert second.compile_stats["path"] == "cold"
    again = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(_Runner.step)
    assert torch.equal(again(_Runner(_Scale(1.0), 1.0), torch.ones(3)), torch.ones(3))
    assert again.compile_stats["path"] == "warm"  # the same runner and model: still a hit


def test_an_objects_private_state_stays_out_of_the_key_its_public_fields_go_in():
    """transformers' GenerationConfig keeps a string hash (randomized per process) in a private
    field: in the key, every process's warm start would miss. A config's public fields are in it."""
    from compileattn.compilation.warm_start import _fingerprint

    class Config:
        def __init__(self, factor, private):
            self.factor, self._original_object_hash = factor, private

    assert _fingerprint(Config(2.0, hash("a"))) == _fingerprint(Config(2.0, 12345))
    assert _fingerprint(Config(2.0, 0)) != _fingerprint(Config(3.0, 0))


def test_slices_ranges_numpy_values_and_slotted_objects_are_in_the_key_by_value():
    """A ``slice(0, k)`` attribute was keyed by its type only: a process with another k loaded
    this one's compile and returned its answer."""
    import numpy as np

    from compileattn.compilation.warm_start import _fingerprint

    class Slotted:
        __slots__ = ("factor",)

        def __init__(self, factor):
            self.factor = factor

    class WithDict:
        def __init__(self):
            self.name = "x"

    class SlotsBesideDict(WithDict):
        __slots__ = ("factor",)

        def __init__(self, factor):
            super().__init__()
            self.factor = factor

    for a, b in [(slice(0, 2), slice(0, 6)), (range(3), range(4)), (np.float32(1.5), np.float32(2.5)),
                 (np.arange(3), np.arange(1, 4)), (Slotted(2.0), Slotted(3.0)),
                 (SlotsBesideDict(2.0), SlotsBesideDict(3.0)), (torch.strided, torch.sparse_coo),
                 (torch.channels_last, torch.contiguous_format), (torch.finfo(torch.float16), torch.finfo(torch.bfloat16))]:
        assert _fingerprint(a) != _fingerprint(b)
    as_objects = [np.array(["x y z", "y"], dtype=object) for _ in range(2)]  # equal items, other pointers
    assert _fingerprint(as_objects[0]) == _fingerprint(as_objects[1])
    assert _fingerprint(torch.relu) == "builtin torch._VariableFunctionsClass.relu"  # where it is defined


def test_a_value_the_key_cannot_describe_means_no_warm_start(tmp_path, caplog):
    """Rather than a key that ignores it (a process where it differs would load this one's compile)."""
    import threading

    class Gated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()  # no fields, not a function

        def forward(self, x):
            return x * 2

    model = Gated()
    f = ca.compile(lambda x: model(x), dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))
    with caplog.at_level("INFO", logger="compileattn"):
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    assert "no warm start: the cache key cannot describe a _thread.lock" in caplog.text
    assert not (tmp_path / "warm_start").exists() or not any((tmp_path / "warm_start").iterdir())


def _shifted(scale, offset):
    def shifted(x, shift=offset):
        return x * scale + shift

    return shifted


def test_a_warm_start_reads_the_tensors_its_function_closes_over_and_defaults_to_now(tmp_path):
    """The key describes a tensor by its shape: the loaded code ran with the saving process's
    closure and defaults, pickled in the file (a later scale or shift, or an in-place update, was
    not seen)."""
    x = torch.ones(4, 3)
    first = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(
        _shifted(torch.full((3,), 2.0), torch.zeros(3)))
    assert torch.equal(first(x), torch.full((4, 3), 2.0)) and first.compile_stats["path"] == "cold"
    scale = torch.full((3,), 5.0)
    second = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(_shifted(scale, torch.ones(3)))
    assert torch.equal(second(x), torch.full((4, 3), 6.0))
    assert second.compile_stats["path"] == "warm"
    scale.fill_(7.0)
    assert torch.equal(second(x), torch.full((4, 3), 8.0))


_FACTOR = 2.0  # a module global a forward reads (a program may set it from its command line)


class _Namespace:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class _Private:
    """A config keeping its value in a private field, read through a property."""

    def __init__(self, factor):
        self._factor = factor

    @property
    def factor(self):
        return self._factor


class _Baked(nn.Module):
    """Reads each factor the way the key cannot see: a global, a class attribute, a field five
    objects deep, a private field behind a property, a module in a plain list (not a submodule)."""

    class_factor = 1.0

    def __init__(self, deep=1.0, private=1.0, listed=1.0):
        super().__init__()
        self.config = _Namespace(a=_Namespace(b=_Namespace(c=_Namespace(d=_Namespace(factor=deep)))))
        self.private = _Private(private)
        self.helpers = [_Scale(listed)]

    def forward(self, x):
        x = x * _FACTOR * self.class_factor * self.config.a.b.c.d.factor * self.private.factor
        return self.helpers[0](x)


@pytest.mark.parametrize("where", ["global", "class_attribute", "deep_config", "private_field", "module_in_list"])
def test_a_value_the_trace_baked_in_that_the_key_cannot_see_is_checked_on_loading(tmp_path, monkeypatch, where):
    """The key describes what it reaches before tracing, four levels deep: a process that set such
    a value otherwise loaded this one's compile and returned its answer. Dynamo's constant guards
    on what the trace read are saved and compared once, on loading."""
    arguments = {"deep_config": "deep", "private_field": "private", "module_in_list": "listed"}

    def run(value):
        if where == "global":
            monkeypatch.setattr(sys.modules[__name__], "_FACTOR", value)
        elif where == "class_attribute":
            monkeypatch.setattr(_Baked, "class_factor", value)
        model = _Baked(**({arguments[where]: value} if where in arguments else {}))
        f = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(lambda m, x: m(x))
        out = f(model, torch.ones(4, 3))
        assert torch.equal(out, model(torch.ones(4, 3))), where
        return f.compile_stats["path"]

    assert [run(2.0), run(2.0), run(3.0)] == ["cold", "warm", "cold"]


def _activation(doubling):
    return (lambda x: x * 2) if doubling else (lambda x: x * 3)


def _doubled_output(module, inputs, output):
    return output * 2


def _tripled_output(module, inputs, output):
    return output * 3


def test_which_code_a_function_holds_and_the_global_forward_hooks_are_in_the_key(tmp_path):
    """Two lambdas on one line share their name and line (Dynamo compares which one by identity,
    the source check sees one file); a hook for every module (``register_module_forward_hook``)
    is traced into the call: either way another process loaded this one's compile."""
    for doubling, factor in ((True, 2.0), (False, 3.0)):
        model = _Scale(1.0)
        model.act = _activation(doubling)
        f = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(lambda m, x: m.act(m(x)))
        assert torch.equal(f(model, torch.ones(4)), torch.full((4,), factor)) and f.compile_stats["path"] == "cold"
    for hook, factor in ((_doubled_output, 2.0), (_tripled_output, 3.0)):
        handle = torch.nn.modules.module.register_module_forward_hook(hook)
        try:
            f = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path))(lambda m, x: m(x))
            assert torch.equal(f(_Scale(1.0), torch.ones(4)), torch.full((4,), factor))
            assert f.compile_stats["path"] == "cold"
        finally:
            handle.remove()


def test_the_default_dtype_and_autocast_are_in_the_keys():
    from compileattn.compilation.cache import environment_key

    plain = environment_key()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert environment_key() != plain
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert environment_key() != plain
    finally:
        torch.set_default_dtype(previous)
    assert environment_key() == plain


def test_a_cache_that_cannot_be_written_costs_the_save_not_the_call(tmp_path, caplog):
    """A file where warm_start/ belongs, or a directory where the warm start file goes: the call is
    compiled and answered, the save is logged and skipped (no temporary file left)."""
    def doubled(x):
        return x * 2

    (tmp_path / "a").mkdir(mode=0o700)
    (tmp_path / "a" / "warm_start").write_text("not a directory")
    f = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path / "a"))(doubled)
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    first = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path / "b"))(doubled)
    first(torch.ones(3))
    [saved] = (tmp_path / "b" / "warm_start").iterdir()
    saved.unlink()
    saved.mkdir(mode=0o700)
    again = ca.compile(dynamic_arg_dims={"x": 0}, config=_eager_pieces(tmp_path / "b"))(doubled)
    with caplog.at_level("WARNING", logger="compileattn"):
        assert torch.equal(again(torch.ones(3)), torch.full((3,), 2.0))
    assert "could not save" in caplog.text
    assert sorted(p.name for p in (tmp_path / "b" / "warm_start").iterdir()) == [saved.name]


@pytest.mark.parametrize("kind", ["file", "dangling_link"])
@pytest.mark.parametrize("how", ["decorator", "backend"])
def test_a_cache_dir_that_is_a_file_costs_the_cache_not_the_call(tmp_path, caplog, how, kind):
    """The decorator logged "no warm start" for a file and went on to compile, then the backend's
    per-piece cache raised NotADirectoryError out of the call; a symlink to nothing raised a bare
    FileExistsError ("File exists") from ``mkdir``."""
    def doubled(x):
        return x * 2

    (tmp_path / "file").write_text("not a directory")
    if kind == "dangling_link":
        (tmp_path / "link").symlink_to(tmp_path / "nothing")
    config = _eager_pieces(tmp_path / ("file" if kind == "file" else "link"))
    f = (ca.compile(dynamic_arg_dims={"x": 0}, config=config)(doubled) if how == "decorator"
         else torch.compile(doubled, backend="compileattn", options={"config": config}))
    with caplog.at_level("WARNING", logger="compileattn"):
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    assert ("is not a directory" if kind == "file" else "which does not exist") in caplog.text
    assert (tmp_path / "file").read_text() == "not a directory"
    assert not (tmp_path / "nothing").exists()


def test_backend_other_than_compileattn_is_not_saved(tmp_path):
    @ca.compile(dynamic_arg_dims={"x": 0}, backend="eager", config=ca.CompileConfig(cache_dir=str(tmp_path)))
    def f(x):
        return x * 2

    torch.testing.assert_close(f(torch.ones(3)), torch.full((3,), 2.0))
    assert f.compile_stats["path"] == "cold"
    assert not (tmp_path / "warm_start").exists() or not any((tmp_path / "warm_start").iterdir())


def test_instance_forward_reports_its_own_compile_stats(tmp_path):
    cls = ca.compile(type("StatsStack", (Stack,), {}), dynamic_arg_dims={"x": 0},
                     config=ca.CompileConfig(piece_compiler="eager"))
    a, b = cls(), cls()
    caches = ca.allocate_kv_caches({f"l{i}": AttentionSpec(H, KVH, D) for i in range(2)}, 32, 4, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=4, num_blocks=32, max_num_tokens=32, max_blocks_per_seq=8)
    md = builder.build([ca.SequenceStep(3, 0, [0])])
    assert a.forward.compile_stats == {}
    with torch.no_grad(), ca.set_forward_context(md, caches):
        a(torch.randn(3, HIDDEN))
        assert a.forward.compile_stats["path"] == "cold" and b.forward.compile_stats == {}
        b(torch.randn(3, HIDDEN))
    assert b.forward.compile_stats["total_s"] > 0 and b.forward.runtimes
    assert a.forward.__self__ is a and list(inspect.signature(type(a).forward).parameters) == ["self", "x"]
    assert list(inspect.signature(a.forward).parameters) == ["x"]


# -- the cache directory ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0o777, 0o770, 0o757])
def test_group_or_world_writable_cache_dir_is_refused(tmp_path, mode):
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(mode)
    with pytest.raises(PermissionError, match=r"writable by group or others .* runs code"):
        _run_stack(cache)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_cache_dir_owned_by_another_user_is_refused(tmp_path):
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o700)
    os.chown(cache, 4242, 4242)
    with pytest.raises(PermissionError, match=r"owned by uid 4242"):
        _run_stack(cache)


def test_a_cache_dir_whose_parent_others_can_write_is_refused(tmp_path):
    """Whoever can write a directory above the cache can put their own cache in its place; a sticky
    one (``/tmp``) lets nobody rename another user's entries."""
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    with pytest.raises(PermissionError, match=r"lies under .*open', writable by anyone \(mode 777, not sticky\)"):
        secure_dir(open_parent / "cache")
    open_parent.chmod(0o1777)
    assert secure_dir(open_parent / "cache").is_dir()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_a_cache_reached_through_another_users_directory_or_link_is_refused(tmp_path):
    """A symlink's target was checked, but its owner could point it elsewhere after the check."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (theirs / "link").symlink_to(mine)
    os.chown(theirs, 4242, 4242)
    with pytest.raises(PermissionError, match=r"lies under .*theirs', owned by uid 4242"):
        secure_dir(theirs / "link")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_a_cache_reached_through_a_symlink_another_user_owns_in_a_sticky_directory_is_refused(tmp_path):
    """In /tmp the link is theirs to retarget: flipped between this user's cache and their own, it
    had their pickle loaded on the first try (the checks followed it to this user's directory)."""
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = sticky / "cache"
    link.symlink_to(mine)
    os.lchown(link, 65534, 65534)
    for path in (link, link / "sub"):
        with pytest.raises(PermissionError, match=r"goes through .*cache', a symlink owned by uid 65534"):
            secure_dir(path)
    os.lchown(link, os.getuid(), os.getgid())  # this user's own link: served, through the resolved path
    assert secure_dir(link / "sub") == (mine / "sub").resolve()


def test_a_cache_dir_under_home_is_expanded(tmp_path, monkeypatch):
    """``~/cache`` made a directory named ``~`` under the current one."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert secure_dir("~/cache") == (tmp_path / "cache").resolve()
    assert not (tmp_path / "~").exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_a_key_directory_planted_by_another_user_is_not_loaded(tmp_path):
    """The root was checked, but the key's directory under it, where the pickles are, was not."""
    from compileattn.compilation.cache import CompileCache

    cache = CompileCache(tmp_path / "cache", "k" * 24)
    cache.dir.mkdir(mode=0o700)
    os.chown(cache.dir, 4242, 4242)
    with pytest.raises(PermissionError, match="owned by uid 4242"):
        cache.load("signature")
    cache.dir.chmod(0o777)
    os.chown(cache.dir, os.geteuid(), os.getegid())
    with pytest.raises(PermissionError, match="writable by group or others"):
        cache.load("signature")


def test_missing_cache_dir_is_created_private(tmp_path):
    _run_stack(tmp_path / "new" / "cache")
    for d in (tmp_path / "new" / "cache", tmp_path / "new" / "cache" / "warm_start"):
        assert d.stat().st_mode & 0o777 == 0o700


# -- on the GPU: Inductor pieces, static compile sizes, CUDA graphs ------------------------------------

@pytest.mark.cuda
def test_cuda_warm_start_with_inductor_pieces(tmp_path):
    script = textwrap.dedent("""
        import json, sys, torch
        from triton.compiler import compiler
        import compileattn as ca
        from compileattn.models.llama import LlamaConfig, LlamaForCausalLM
        generated = []  # the Triton kernels this process generated IR for: compiled here, not found cached
        make_ir = compiler.ASTSource.make_ir
        def counting_make_ir(src, *args, **kwargs):
            generated.append(f"{getattr(src.fn, '__module__', '?')}.{getattr(src.fn, '__name__', '?')}")
            return make_ir(src, *args, **kwargs)
        compiler.ASTSource.make_ir = counting_make_ir
        cfg = ca.CompileConfig(cache_dir=sys.argv[1], cudagraph_mode="piecewise", attention_backend="triton")
        Compiled = ca.compile(type("CompiledLlama", (LlamaForCausalLM,), {}),
                              dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=cfg)
        model = Compiled(LlamaConfig.tiny(num_layers=4), dtype=torch.float16, device="cuda", seed=0)
        eager = LlamaForCausalLM(LlamaConfig.tiny(num_layers=4), dtype=torch.float16, device="cuda", seed=0)
        caches = ca.allocate_kv_caches(model.attention_specs(), 32, 16, dtype=torch.float16, device="cuda")
        b = ca.AttentionMetadataBuilder(block_size=16, num_blocks=32, max_num_tokens=8, max_blocks_per_seq=2,
                                        device="cuda", backend="triton")
        md = b.build([ca.SequenceStep(1, 16, [2 * i, 2 * i + 1]) for i in range(8)])
        ids = torch.arange(8, device="cuda"); pos = torch.full((8,), 16, device="cuda")
        with ca.set_forward_context(md, caches), torch.no_grad():
            out = model(ids, pos).clone()
            first_call_generated = list(generated)
            ref = eager(ids, pos)
            # static pieces still compiling in the background: the file is written once they land
            # (a process that ends first waits at exit; tests/test_static_landing.py covers that)
            assert model.forward.wait_for_static_pieces(timeout=300)
            model(ids, pos)
        print(json.dumps({"stats": model.forward.compile_stats, "counters": ca.counters.snapshot(),
                          "err": ((out - ref).norm() / ref.norm()).item(), "generated": first_call_generated}))
    """)
    # as a program that leaves TRITON_CACHE_DIR unset (the first call sets it); caches of its own
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TRITON_HOME=str(tmp_path / "home"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env.pop("TRITON_CACHE_DIR", None)
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                              env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["stats"]["path"] == "cold" and cold["counters"]["piece_reuses"] > 0
    assert cold["stats"]["static_s"] > 0  # compile_sizes="auto": static pieces for the decode sizes
    assert warm["stats"]["path"] == "warm" and warm["counters"]["dynamo_graphs"] == 0
    assert warm["counters"]["backend_compiles"] == 0
    assert cold["err"] < 5e-2 and warm["err"] < 5e-2
    # the attention kernels the cold run compiled are found where it put them
    assert not [k for k in warm["generated"] if k.startswith("compileattn.")], warm["generated"]


class _Weighted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False).requires_grad_(False)


def _scaled_then_applied(m: nn.Module, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w.mul_(2)
    return m.lin(x)


def test_a_warm_first_call_writing_a_view_of_a_parameter_is_compiled_and_refused(tmp_path, caplog):
    """Which arguments the code writes is known only after a call, and the compile that refuses a
    written view of a parameter (two graph inputs sharing memory) does not run on a warm start: a
    loaded compile served such a first call, reading the weight from before the write. The warm
    first call now compiles instead wherever an argument shares memory with a model's tensor, and
    the compile refuses it, as in the process that saved the file."""
    torch.manual_seed(0)
    m, x = _Weighted(), torch.randn(2, 4)
    config = ca.CompileConfig(cache_dir=str(tmp_path), piece_compiler="inductor", compile_workers=0)
    first = ca.compile(dynamic_arg_dims={}, config=config)(_scaled_then_applied)
    assert torch.allclose(first(m, torch.ones(4, 4), x), m.lin(x)) and first.compile_stats["path"] == "cold"
    second = ca.compile(dynamic_arg_dims={}, config=config)(_scaled_then_applied)
    weight = m.lin.weight.clone()
    with caplog.at_level("INFO", logger="compileattn"), \
            pytest.raises(ValueError, match=r"share memory and the compiled code writes it \(mul_\)"):
        second(m, m.lin.weight.view(4, 4), x)
    assert "does not serve this first call" in caplog.text
    assert torch.equal(m.lin.weight, weight), "refused before anything ran"
    third = ca.compile(dynamic_arg_dims={}, config=config)(_scaled_then_applied)
    assert torch.allclose(third(m, torch.ones(4, 4), x), m.lin(x)) and third.compile_stats["path"] == "warm"
