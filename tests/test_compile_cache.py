"""The compile cache across processes: a second process loads its pieces instead of compiling;
a run-time setting (CUDA-graph sizes, kernel choice) keeps the cache warm; a setting that changes
the compiled pieces misses."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import compileattn as ca
    from compileattn.models.opt import OPTConfig, OPTForCausalLM
    from compileattn import SequenceStep as S
    model = OPTForCausalLM(OPTConfig.tiny(), seed=0)
    caches = ca.allocate_kv_caches(model.attention_specs(), 16, 4, dtype=torch.float32)
    b = ca.AttentionMetadataBuilder(block_size=4, num_blocks=16, max_num_tokens=32, max_blocks_per_seq=8)
    compiled = torch.compile(model, backend="compileattn", fullgraph=True,
                             options={"cache_dir": sys.argv[1], **json.loads(sys.argv[2])})
    md = b.build([S(1, 4, [0, 1]), S(3, 0, [2])])
    ids = torch.arange(md.num_tokens); pos = torch.arange(md.num_tokens)
    torch._dynamo.mark_dynamic(ids, 0); torch._dynamo.mark_dynamic(pos, 0)
    with ca.set_forward_context(md, caches):
        out = compiled(ids, pos)
    with ca.set_forward_context(md, caches):
        ref = model(ids, pos)
    print(json.dumps({**ca.counters.snapshot(), "max_err": (out - ref).abs().max().item()}))
""")


def _run(cache_dir, **options):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(cache_dir), json.dumps(options)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_second_process_hits_and_config_change_misses(tmp_path):
    pieces = 3  # OPT tiny: 2 layers -> 3 pieces
    first = _run(tmp_path)
    assert (first["cache_misses"], first["cache_hits"], first["backend_compiles"]) == (pieces, 0, pieces)
    second = _run(tmp_path)
    assert (second["cache_misses"], second["cache_hits"], second["backend_compiles"]) == (0, pieces, 0)
    assert second["max_err"] < 1e-4
    runtime_only = _run(tmp_path, max_capture_size=128, attention_backend="reference", cudagraph_mode="none",
                        check_input_addresses=False)
    assert (runtime_only["cache_misses"], runtime_only["cache_hits"]) == (0, pieces), "a run-time setting missed"
    changed = _run(tmp_path, hoist_shape_logic=False)
    assert (changed["cache_misses"], changed["cache_hits"], changed["backend_compiles"]) == (pieces, 0, pieces)
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2


@pytest.mark.slow
def test_a_piece_torch_cannot_serialize_costs_the_save_not_the_compile(tmp_path):
    """Inductor's ``freezing`` artifacts raise ``TypeError: 'NoneType' object is not callable`` when
    serialized: with a cache dir the whole compile failed (BackendCompilerFailed)."""
    run = _run(tmp_path, inductor_options={"freezing": True})
    assert (run["backend_compiles"], run["cache_hits"]) == (3, 0)
    assert run["max_err"] < 1e-4


def test_writers_of_one_pid_and_thread_keep_their_own_temporary_files(tmp_path, monkeypatch):
    """Writers sharing a cache directory from other PID namespaces or hosts may have the same pid
    and thread id: a second writer that starts while the first's temporary file is still open (here
    within the first's rename, in the same thread) must neither truncate nor rename that file
    away. Both writes land, the last rename wins, nothing is left behind, and the file is no one
    else's to write."""
    from compileattn.compilation import cache

    target = tmp_path / "piece.bin"
    real_replace = os.replace
    nested = []

    def replace_after_another_writer(src, dst):
        if not nested:
            nested.append(True)
            cache.write_atomic(target, b"the other writer's piece")
        real_replace(src, dst)

    monkeypatch.setattr(cache.os, "replace", replace_after_another_writer)
    cache.write_atomic(target, b"this writer's piece")
    assert target.read_bytes() == b"this writer's piece"
    assert [p.name for p in tmp_path.iterdir()] == ["piece.bin"]
    assert target.stat().st_mode & 0o077 == 0


def test_the_piece_key_changes_with_the_python_version(monkeypatch):
    """A piece's file is a pickle of code made for one interpreter: the key named the torch version
    but not Python's, so another Python loaded this one's pieces."""
    import torch
    import torch.fx

    from compileattn.compilation.cache import cache_key
    from compileattn.config import CompileConfig

    gm = torch.fx.symbolic_trace(lambda x: x.relu() + 1)
    config = CompileConfig()
    key = cache_key(config, gm)
    assert cache_key(config, gm) == key
    major, minor, micro, level, serial = sys.version_info
    monkeypatch.setattr(sys, "version_info", (major, minor + 1, micro, level, serial))
    assert cache_key(config, gm) != key
    monkeypatch.setattr(sys, "version_info", (major, minor, micro + 1, level, serial))
    assert cache_key(config, gm) != key


def test_the_warm_start_key_names_the_interpreter_as_the_piece_cache_does(monkeypatch):
    """One rule for the Python a saved file was made for (``cache.interpreter_key``), in both keys:
    the warm start's file holds pickled bytecode too."""
    from compileattn.compilation import warm_start
    from compileattn.config import CompileConfig

    def fn(x):
        return x + 1

    key = warm_start.key_of(fn, CompileConfig(), {}, "x: T", ())
    assert warm_start.key_of(fn, CompileConfig(), {}, "x: T", ()) == key
    major, minor, micro, level, serial = sys.version_info
    monkeypatch.setattr(sys, "version_info", (major, minor, micro + 1, level, serial))
    assert warm_start.key_of(fn, CompileConfig(), {}, "x: T", ()) != key
