"""CompileConfig.debug_dump_dir: depyf's decompiled code and the graphs land there, nothing otherwise."""
from __future__ import annotations

import gc
import os
import sys

import pytest
import torch
from torch import nn

import compileattn
from compileattn.compilation import debug


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * 2


def stand_in_backend(gm, example_inputs):
    return gm.forward


def compiled_toy(config, backend=stand_in_backend):
    cls = compileattn.compile(type("DumpedToy", (Toy,), {}), dynamic_arg_dims={"x": 0}, config=config,
                              backend=backend)
    model, eager = cls(), Toy()
    eager.load_state_dict(model.state_dict())
    return model, eager


def dynamo_patch_state():
    """What depyf's prepare_debug patches; all of it must be back after the dump."""
    return (
        dict(torch._dynamo.convert_frame._bytecode_hooks),
        torch.fx.graph_module._exec_with_source,
        torch._dynamo.utils.lazy_format_graph_code.__code__,
    )


def test_dump_dir_holds_decompiled_transformed_forward(tmp_path):
    dump = tmp_path / "dump"
    before = dynamo_patch_state()
    model, eager = compiled_toy(compileattn.CompileConfig(debug_dump_dir=str(dump)))
    with torch.no_grad():
        x = torch.randn(5, 8)
        torch.testing.assert_close(model(x), eager(x))
    files = os.listdir(dump)
    transformed = [f for f in files if "transformed_code" in f and "forward" in f and f.endswith(".py")]
    assert transformed, files
    src = (dump / transformed[0]).read_text()
    assert "__compiled_fn" in src and "def " in src, src  # Dynamo's code, not the user's forward
    assert any(f.startswith("full_code_for_forward") for f in files), files
    assert dynamo_patch_state() == before

    # A dump compiles through Dynamo's frame evaluation (depyf sees the code only there), with
    # every guard skipped: other sizes run the same code. A Dynamo reset drops that code; the next
    # call must raise rather than trace again without the dynamic dims (which would serve every
    # later size with code specialised to one).
    with torch.no_grad():
        for n in (1, 3, 12):
            x = torch.randn(n, 8)
            torch.testing.assert_close(model(x), eager(x))
    assert model.forward.compile_stats["path"] == "frame"
    torch._dynamo.reset()
    gc.collect()
    with torch.no_grad(), pytest.raises(RuntimeError, match="fail_on_recompile"):
        model(torch.randn(4, 8))


def test_later_compiles_are_not_dumped_and_still_work(tmp_path):
    dump = tmp_path / "dump"
    model, _ = compiled_toy(compileattn.CompileConfig(debug_dump_dir=str(dump)))
    with torch.no_grad():
        model(torch.randn(4, 8))
    files = sorted(os.listdir(dump))
    plain = torch.compile(lambda x: x.sin() + 1, backend="eager")
    x = torch.randn(3)
    torch.testing.assert_close(plain(x), x.sin() + 1)
    assert sorted(os.listdir(dump)) == files


def test_no_dump_dir_writes_nothing_and_never_enters_depyf(tmp_path, monkeypatch):
    import depyf

    def refuse(*args, **kwargs):
        raise AssertionError("depyf.prepare_debug entered without a dump directory")

    monkeypatch.setattr(depyf, "prepare_debug", refuse)
    monkeypatch.chdir(tmp_path)
    model, eager = compiled_toy(compileattn.CompileConfig())
    with torch.no_grad():
        x = torch.randn(5, 8)
        torch.testing.assert_close(model(x), eager(x))
    assert os.listdir(tmp_path) == []


def test_failed_compile_restores_dynamo_and_the_next_dump_works(tmp_path):
    before = dynamo_patch_state()

    def broken_backend(gm, example_inputs):
        raise RuntimeError("backend exploded")

    model, _ = compiled_toy(compileattn.CompileConfig(debug_dump_dir=str(tmp_path / "a")), broken_backend)
    with torch.no_grad(), pytest.raises(Exception, match="backend exploded"):
        model(torch.randn(4, 8))
    assert dynamo_patch_state() == before
    assert debug._active_dir is None

    model, eager = compiled_toy(compileattn.CompileConfig(debug_dump_dir=str(tmp_path / "b")))
    with torch.no_grad():
        x = torch.randn(4, 8)
        torch.testing.assert_close(model(x), eager(x))
    assert any("transformed_code" in f for f in os.listdir(tmp_path / "b"))


def test_nested_dump_contexts_enter_depyf_once(tmp_path, monkeypatch):
    import depyf

    entered = []
    real = depyf.prepare_debug
    monkeypatch.setattr(depyf, "prepare_debug", lambda d, *a, **k: entered.append(d) or real(d, *a, **k))
    with debug.dump_context(str(tmp_path / "outer")) as outer:
        with debug.dump_context(str(tmp_path / "inner")) as inner:
            assert inner == outer == str(tmp_path / "outer")
    assert entered == [str(tmp_path / "outer")]
    assert debug._active_dir is None


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_dump_dir_others_can_write_is_refused_before_depyf(tmp_path, monkeypatch):
    """Inside the dump depyf copies each Inductor kernel's source into the directory and Inductor
    imports that copy: a directory group or others can write would run their code here (and a
    planted symlink would have the dump overwrite a file of the user's). Refused like a compile
    cache_dir, before depyf is entered; a new directory is made 0700."""
    import depyf

    entered = []
    monkeypatch.setattr(depyf, "prepare_debug", lambda d, *a, **k: entered.append(d))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    gm = torch.fx.symbolic_trace(Toy())
    with pytest.raises(PermissionError, match=r"debug_dump_dir .*shared' is writable by group or others"):
        with debug.dump_context(str(shared)):
            pass
    assert entered == [] and debug._active_dir is None
    with pytest.raises(PermissionError, match="depyf's dump has Inductor import its compiled kernels from there"):
        debug.dump_graph(str(shared), "graph", gm)
    with pytest.raises(PermissionError, match="writable by group or others"):
        debug.expect_transformed_code(str(shared))
    assert os.listdir(shared) == []
    debug.dump_graph(str(tmp_path / "fresh"), "graph", gm)
    assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o700


def test_dump_graph_writes_the_graph_module_code(tmp_path):
    gm = torch.fx.symbolic_trace(Toy())
    path = debug.dump_graph(str(tmp_path), "piece 0/lin", gm)
    assert path == str(tmp_path / "piece_0_lin.py")
    src = open(path).read()
    assert "def forward" in src and "relu" in src and "lin" in src
    compile(src.split("\n", 1)[1].replace("class GraphModule(torch.nn.Module):", "class G:"), path, "exec")
    assert debug.dump_graph(None, "graph", gm) is None
    with pytest.raises(TypeError, match="GraphModule"):
        debug.dump_graph(str(tmp_path), "graph", object())
    with pytest.raises(ValueError, match="empty file name"):
        debug.dump_graph(str(tmp_path), "..", gm)


def test_missing_depyf_raises_import_error_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "depyf", None)  # makes `import depyf` raise ImportError
    with pytest.raises(ImportError, match=r"compileattn\[debug\]"):
        with debug.dump_context(str(tmp_path)):
            pass
    model, _ = compiled_toy(compileattn.CompileConfig(debug_dump_dir=str(tmp_path)))
    with torch.no_grad(), pytest.raises(ImportError, match=r"debug_dump_dir needs the 'depyf' package"):
        model(torch.randn(4, 8))
    model, eager = compiled_toy(compileattn.CompileConfig())  # no dump: depyf is not needed
    with torch.no_grad():
        x = torch.randn(4, 8)
        torch.testing.assert_close(model(x), eager(x))


def test_torch_compile_path_dumps_transformed_code(tmp_path):
    """With torch.compile(backend="compileattn") nothing encloses the compile, so the backend asks
    for the dump and a bytecode hook writes it once Dynamo has the code."""

    def dumping_backend(gm, example_inputs):
        debug.expect_transformed_code(str(tmp_path))
        return gm.forward

    def scaled(x):
        return x.cos() * 3

    x = torch.randn(4)
    torch.testing.assert_close(torch.compile(scaled, backend=dumping_backend)(x), x.cos() * 3)
    files = os.listdir(tmp_path)
    assert len(files) == 1 and files[0].startswith("transformed_code_scaled_"), files
    assert "__compiled_fn" in (tmp_path / files[0]).read_text()

    torch.compile(lambda y: y + 1, backend=stand_in_backend)(x)  # did not ask: not dumped
    assert os.listdir(tmp_path) == files


def test_real_backend_dumps_graphs_and_pieces(tmp_path):
    config = compileattn.CompileConfig(piece_compiler="eager", debug_dump_dir=str(tmp_path))
    cls = compileattn.compile(type("DumpedToy", (Toy,), {}), dynamic_arg_dims={"x": 0}, config=config)
    model = cls()
    with torch.no_grad():
        model(torch.randn(4, 8))
    files = os.listdir(tmp_path)
    assert any("transformed_code" in f and "forward" in f for f in files), files
    assert any(f.startswith("full_code_for_forward") for f in files), files
    assert "graph.py" in files and "split_graph.py" in files, files
    assert any(f.startswith("piece_") for f in files), files
