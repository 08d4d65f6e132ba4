"""CPU-side logic of the benchmark scripts: arguments, statistics, result files, merging runs and
the goal checks, the decode peers and compileattn adapters on tiny CPU shapes, and the latency
driver's plumbing on a tiny model. No timing is asserted (there is no GPU here)."""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import types
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Before anything imports triton: its own library functions (tl.zeros, ...) are decorated in
    # interpreter mode only if the variable is set when triton is imported (test_triton_backend
    # does the same).
    os.environ.setdefault("TRITON_INTERPRET", "1")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import allreduce_tp as art  # noqa: E402
import tp_step_profile as tsp  # noqa: E402
import coldwarm  # noqa: E402
import common  # noqa: E402
import decode_attention as dec  # noqa: E402
import goals as goals_report  # noqa: E402
import paged_attention_baseline as pab  # noqa: E402
import latency as lat  # noqa: E402
import latency_report as rep  # noqa: E402
import latency_tp as ltp  # noqa: E402
import op_overhead as op  # noqa: E402
import op_overhead_report as opr  # noqa: E402
import piecewise_gaps as pg  # noqa: E402
import prefix_sharing as ps  # noqa: E402
import region_trace as rt  # noqa: E402
import throughput as tp  # noqa: E402
import triton_decode_quick as tdq  # noqa: E402

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")


# -- arguments ---------------------------------------------------------------------------------------


def test_decode_args_defaults_quick_and_explicit():
    a = dec.parse_args([])
    assert (a.contexts, a.batches, a.pages) == ([1024, 4096], [1, 4, 16, 64, 256], [16, 128])
    assert a.impls == list(dec.IMPLS) and a.shapes == ["gqa64x8", "mha32"]
    q = dec.parse_args(["--quick"])
    assert (q.contexts, q.batches, q.pages, q.reps, q.shapes) == ([1024], [1, 64], [16], 5, ["gqa64x8"])
    assert dec.parse_args(["--shapes", "mha32"]).shapes == ["mha32"]
    e = dec.parse_args(["--quick", "--batches", "2,2,8", "--impls", "ca-triton,fi-tc"])
    assert e.batches == [2, 8] and e.contexts == [1024] and e.impls == ["ca-triton", "fi-tc"]


@pytest.mark.parametrize("argv", [["--batches", "0"], ["--batches", "x"], ["--impls", "nope"], ["--reps", "0"],
                                  ["--shapes", "gqa"]])
def test_decode_args_reject_bad_values(argv, capsys):
    with pytest.raises(SystemExit):
        dec.parse_args(argv)


def test_latency_args_defaults_quick_and_explicit():
    a = lat.parse_args([])
    assert (a.models, a.batches, a.contexts, a.steps) == (["opt", "llama"], [1, 8, 64], [512, 4096], 50)
    assert not a.no_cold_warm and a.columns == lat.COLUMNS
    q = lat.parse_args(["--quick"])
    assert (q.models, q.batches, q.contexts, q.steps, q.no_cold_warm) == (["opt"], [1, 8], [512], 20, True)
    e = lat.parse_args(["--models", "llama", "--columns", "eager,ca-full", "--llama-layers", "2"])
    assert e.models == ["llama"] and e.columns == ["eager", "ca-full"] and e.llama_layers == 2


def test_latency_inductor_options_reach_the_compileattn_columns():
    """``--inductor-options`` (JSON; null is None) becomes the columns' CompileConfig.inductor_options:
    the pieces' residual-add pass can be timed on and off in one session."""
    import types

    args = lat.parse_args(["--inductor-options", '{"post_grad_custom_post_pass": null}', "--backend", "reference"])
    assert args.inductor_options == {"post_grad_custom_post_pass": None}
    assert lat.parse_args([]).inductor_options == {}
    bench = types.SimpleNamespace(args=args, pad_config=types.SimpleNamespace(max_capture_size=8),
                                  model=torch.nn.Linear(2, 2))
    group = lat.CompileattnGroup(bench, "ca-piecewise")
    assert group.config.inductor_options == {"post_grad_custom_post_pass": None}
    assert pg.parse_args(["--inductor-options", "{}"]).inductor_options == {}


@pytest.mark.parametrize("argv", [["--models", "gpt"], ["--steps", "0"], ["--columns", "fast"],
                                  ["--llama-layers", "0"], ["--inductor-options", "[1]"],
                                  ["--inductor-options", "{bad"]])
def test_latency_args_reject_bad_values(argv, capsys):
    with pytest.raises(SystemExit):
        lat.parse_args(argv)


@no_cuda
@pytest.mark.parametrize("module,name,argv", [
    (dec, "decode_attention.py", ["--quick"]), (lat, "latency.py", ["--quick"]), (op, "op_overhead.py", ["--quick"]),
    (pg, "piecewise_gaps.py", []), (tp, "throughput.py", ["--quick"]), (ps, "prefix_sharing.py", ["--quick"]),
    (art, "allreduce_tp.py", []), (tsp, "tp_step_profile.py", [])])
def test_without_cuda_scripts_say_so_and_exit_0(module, name, argv, capsys, tmp_path):
    assert module.main([*argv, "--out", str(tmp_path / "x")]) == 0
    out = capsys.readouterr().out
    assert name in out and "needs CUDA" in out
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_allreduce_report_names_the_fastest_algorithm_per_size():
    ok = lambda us: {"status": "ok", "us": us, "rel_err": 0.0, "graph_vs_eager": 0.0}  # noqa: E731
    payload = {"benchmark": "allreduce_tp", "world_size": 2, "nccl": "2.28.9", "env": {},
               "config": {"hidden": 4096, "chain": 64, "replays": 20},
               "rows": [{"rows": 1, "bytes": 8192, "chosen": "one-shot", "nccl": ok(11.0), "one-shot": ok(5.5),
                         "two-shot": ok(9.9)},
                        {"rows": 1024, "bytes": 8 << 20, "chosen": "nccl", "nccl": ok(60.0),
                         "one-shot": {"status": "skipped"}, "two-shot": {"status": "error", "reason": "boom"}}]}
    md = art.render_markdown(payload)
    assert "| 1 | 8 KiB | 11.00 | 5.50 | 9.90 | one-shot (0.50× NCCL) | one-shot |" in md
    assert "| 1024 | 8192 KiB | 60.00 | skipped | error | nccl | nccl |" in md
    assert "1024 rows, two-shot: error: boom" in md


@pytest.mark.parametrize("name,kind", [
    ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", "matmul"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "matmul"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all-reduce"),
    ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>", "all-reduce"),
    ("decode_kernel", "attention"), ("combine_kernel", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "other"), ("kv_write_kernel", "other")])
def test_tp_profile_sorts_kernels_by_kind(name, kind):
    assert tsp.kernel_kind(name) == kind


def test_tp_profile_idle_counts_overlapping_kernels_once():
    # two overlapping kernels (0-12 busy), a gap of 8, two nested ones (20-25 busy)
    assert tsp.busy_union_us([(20, 25), (0, 10), (5, 12), (21, 22)]) == 17
    assert tsp.busy_union_us([]) == 0


# -- statistics and files ----------------------------------------------------------------------------


def test_percentile_matches_linear_interpolation():
    xs = list(range(1, 101))
    assert common.percentile(xs, 50) == pytest.approx(50.5)
    assert common.percentile(xs, 90) == pytest.approx(90.1)
    assert common.percentile(xs, 99) == pytest.approx(99.01)
    assert common.percentile([7.0], 99) == 7.0
    assert common.percentile([3, 1, 2], 0) == 1 and common.percentile([3, 1, 2], 100) == 3
    with pytest.raises(ValueError):
        common.percentile([], 50)
    s = common.summarize_us([0.001, 0.002, 0.003])
    assert s["p50_us"] == pytest.approx(2000) and s["mean_us"] == pytest.approx(2000) and s["steps"] == 3


def test_rel_error_catches_zero_and_nan_outputs():
    e = torch.randn(4, 8)
    assert common.rel_error(e.clone(), e) == 0.0
    assert common.rel_error(torch.zeros_like(e), e) == pytest.approx(1.0)
    bad = e.clone()
    bad[0, 0] = float("nan")
    assert common.rel_error(bad, e) == math.inf
    with pytest.raises(ValueError):
        common.rel_error(e[:2], e)


def test_rotations_cover_l2():
    assert common.rotations_for(4 << 20, 50 << 20) == 50
    assert common.rotations_for(1 << 30, 50 << 20) == 1
    assert common.rotations_for(1024, 50 << 20) == 64  # capped


def test_writers_and_markdown(tmp_path):
    paths = common.output_paths(tmp_path / "sub" / "res.json")
    assert paths["md"].name == "res.md" and paths["png"].name == "res.png"
    common.write_json(paths["json"], {"a": [1, 2.5], "p": Path("/x")})
    assert common.read_json(paths["json"]) == {"a": [1, 2.5], "p": "/x"}
    table = common.markdown_table(["a", "b"], [[1, "x|y"], [None, 2]])
    assert table.splitlines() == ["| a | b |", "|:--|--:|", "| 1 | x\\|y |", "|  | 2 |"]
    with pytest.raises(ValueError):
        common.markdown_table(["a"], [[1, 2]])
    assert common.fmt_num(None) == "—" and common.fmt_num(1234.5) == "1,234" and common.fmt_num(1.234, 2) == "1.23"


def test_environment_records_command_and_versions():
    env = common.environment(["benchmarks/x.py", "--quick"])
    assert env["command"].endswith("benchmarks/x.py --quick")
    assert env["versions"]["torch"] == torch.__version__
    assert "GPU" in common.environment_markdown(env)


def test_budget():
    assert not common.Budget(0).exceeded() and common.Budget(None).left() == math.inf
    assert common.Budget(-1).seconds is None
    b = common.Budget(1e-9)
    assert b.exceeded() and "budget" in b.reason()


# -- decode: merging runs, ratios, goals -------------------------------------------------------------


def _dec_row(run, impl, ctx, batch, page, us=None, status="ok", reason=""):
    r = dec.base_row(impl, ctx, batch, page, run)
    if status == "ok":
        kvb = dec.kv_bytes(batch, ctx)
        r.update(us=us, tbps=kvb / (us * 1e-6) / 1e12, x_floor=1.2, method="cuda-graph")
    r.update(status=status, reason=reason)
    return r


def _dec_payload(label, rows):
    return {"benchmark": "decode_attention", "shape": {}, "config": {},
            "runs": [{"label": label, "env": {}, "copy_bandwidth": {"GBps": 4000.0}}], "rows": rows}


def _two_runs():
    a = _dec_payload("fa4", [
        _dec_row(0, "ca-triton", 4096, 64, 16, 300.0), _dec_row(0, "ca-flash", 4096, 64, 16, 260.0),
        _dec_row(0, "ca-triton", 4096, 1, 16, 15.0), _dec_row(0, "ca-flash", 4096, 1, 16, 59.0),
        _dec_row(0, "sdpa-contig", 4096, 64, None, 280.0),
        _dec_row(0, "flex", 4096, 64, 16, status="error", reason="boom"),
    ])
    b = _dec_payload("fi", [
        _dec_row(0, "ca-triton", 4096, 64, 16, 240.0), _dec_row(0, "fi-tc", 4096, 64, 16, 252.0),
        _dec_row(0, "ca-triton", 4096, 1, 16, 13.0), _dec_row(0, "fi-tc", 4096, 1, 16, 12.0),
        _dec_row(0, "ca-flash", 4096, 64, 16, status="unavailable", reason="no FA"),
    ])
    return a, b


def test_decode_merge_prefers_the_run_that_measured_flashinfer():
    merged = dec.merge_payloads(list(_two_runs()), ["a", "b"])
    assert [r["label"] for r in merged["runs"]] == ["fa4", "fi"]
    chosen = dec.select(merged["rows"])
    tri = chosen[(4096, 64, 16, "ca-triton")]
    assert tri["run"] == 1 and tri["ratio_fi_tc"] == pytest.approx(240 / 252) and tri["ratio_same_run"]
    assert tri["other_runs"] == [{"run": 0, "us": 300.0, "status": "ok"}]
    fl = chosen[(4096, 64, 16, "ca-flash")]  # only run 0 has it ok: cross-run ratio, flagged
    assert fl["run"] == 0 and fl["ratio_fi_tc"] == pytest.approx(260 / 252) and not fl["ratio_same_run"]
    sdpa = chosen[(4096, 64, 16, "sdpa-contig")]  # page-independent row shown on the page row
    assert sdpa["page_independent"] and sdpa["us"] == 280.0
    goals = {(g["context"], g["batch"]): g for g in dec.goal_check(chosen)}
    g64, g1 = goals[(4096, 64)], goals[(4096, 1)]
    assert g64["best"] == "ca-triton" and g64["time_ok"] and g64["bw_ok"] is (g64["tbps"] >= dec.GOAL_TBPS)
    assert g1["time_ok"] is False and g1["ratio"] == pytest.approx(13 / 12) and g1["bw_ok"] is None
    text = "\n".join(dec.goal_summary(goals.values()))
    assert "NOT MET" in text and "1/2" in text


def test_decode_goals_are_not_met_where_a_page16_cell_has_no_compileattn_result():
    """"Every cell": a cell where every compileattn backend FAILED (FlashInfer measured) is not a
    cell met; the cells left must not make either goal MET."""
    rows = [_dec_row(0, "ca-triton", 1024, 64, 16, 50.0), _dec_row(0, "fi-tc", 1024, 64, 16, 60.0),
            _dec_row(0, "ca-triton", 4096, 64, 16, status="FAILED", reason="rel. error 1 > 0.02"),
            _dec_row(0, "fi-tc", 4096, 64, 16, 240.0)]
    kvb = dec.kv_bytes(64, 1024)
    assert kvb / (50e-6) / 1e12 >= dec.GOAL_TBPS  # the measured cell meets both goals
    got = {g["goal"]: g for g in dec.shape_goal_records(_dec_payload("x", rows))}
    time_goal = next(g for name, g in got.items() if "FlashInfer tensor-core" in name)
    bw_goal = next(g for name, g in got.items() if "TB/s" in name)
    assert time_goal["met"] is None and "1 cell(s) not measured" in time_goal["measured"]
    assert bw_goal["met"] is None and "1 cell(s) not measured" in bw_goal["measured"]
    rows[2] = _dec_row(0, "ca-triton", 4096, 64, 16, 230.0)
    got = {g["goal"]: g["met"] for g in dec.shape_goal_records(_dec_payload("x", rows))}
    assert got[time_goal["goal"]] is True and got[bw_goal["goal"]] is True


def test_decode_time_goal_divides_by_flashinfer_of_the_same_run():
    """Two runs measured FlashInfer: the goal's ratio is the table's same-run ratio, not the best
    compileattn row over the other run's FlashInfer time."""
    a = _dec_payload("a", [_dec_row(0, "ca-triton", 1024, 64, 16, status="FAILED", reason="wrong"),
                           _dec_row(0, "fi-tc", 1024, 64, 16, 100.0)])
    b = _dec_payload("b", [_dec_row(0, "ca-triton", 1024, 64, 16, 90.0), _dec_row(0, "fi-tc", 1024, 64, 16, 80.0)])
    chosen = dec.select(dec.merge_payloads([a, b])["rows"])
    tri = chosen[(1024, 64, 16, "ca-triton")]
    assert tri["run"] == 1 and tri["ratio_fi_tc"] == pytest.approx(90 / 80) and tri["ratio_same_run"]
    (g,) = dec.goal_check(chosen)
    assert g["ratio"] == pytest.approx(90 / 80) and g["fi_tc_us"] == 80.0 and g["time_ok"] is False


def test_decode_time_goal_takes_no_verdict_from_a_ratio_across_runs():
    """Where only another run measured FlashInfer, the cell's ratio (marked * in the table) is no
    verdict: the goal reads "not measured" for it, never MET."""
    a = _dec_payload("a", [_dec_row(0, "fi-tc", 1024, 64, 16, 100.0)])
    b = _dec_payload("b", [_dec_row(0, "ca-triton", 1024, 64, 16, 90.0)])
    chosen = dec.select(dec.merge_payloads([a, b])["rows"])
    assert chosen[(1024, 64, 16, "ca-triton")]["ratio_same_run"] is False
    (g,) = dec.goal_check(chosen)
    assert g["ratio"] == pytest.approx(0.9) and g["time_ok"] is None
    time_goal = dec.goal_records([g])[0]
    assert time_goal["met"] is None, time_goal


def test_goals_table_gathers_each_scripts_verdicts(tmp_path):
    """goals.py lists every goal the measuring scripts checked, with their verdicts (met, not met,
    not measured) and the file each came from; it decides nothing itself."""
    a, b = _two_runs()
    decode = tmp_path / "decode.json"
    common.write_json(decode, dec.merge_payloads([a, b], ["a", "b"]))
    latency = tmp_path / "latency.json"
    common.write_json(latency, {
        "benchmark": "latency", "config": {}, "runs": [{"label": "opt", "env": {"git_commit": "abc1234"}}],
        "stats": [], "rows": [_lat_row(0, "opt", "graph-inductor", 1, 500), _lat_row(0, "opt", "ca-piecewise", 1, 540),
                              _lat_row(0, "opt", "ca-full", 1, 505)],
        "probes": [{"run": 0, "model": "opt", "phase": "cold", "status": "ok", "first_call_s": 10.4},
                   {"run": 0, "model": "opt", "phase": "warm", "status": "skipped", "reason": "budget"}]})
    overhead = tmp_path / "op.json"
    common.write_json(overhead, {"benchmark": "op_overhead", "config": {}, "runs": [{"label": "x", "env": {}}],
                                 "rows": [{"run": 0, "variant": opr.op_caller("triton"), "batch": bt, "status": "ok",
                                           "cpu_us": us} for bt, us in ((1, 12.0), (64, 16.5))]})
    starts = tmp_path / "coldwarm.json"
    common.write_json(starts, {"benchmark": "coldwarm", "config": {}, "runs": [{"env": {}}], "rows": [
        {"model": "opt", "phase": "warm", "status": "ok", "first_call_s": 1.5},
        {"model": "opt", "phase": "cold, dynamic only", "status": "ok", "first_call_s": 30.0}]})
    assert goals_report.main(["--latency", str(latency), "--decode", str(decode), "--op-overhead", str(overhead),
                              "--coldwarm", str(starts), "-o", str(tmp_path / "g")]) == 0
    listed = common.read_json(tmp_path / "g.json")["goals"]
    warm = [(g["met"], g["source"]) for g in listed if g["goal"] == "OPT-125m shape, warm start ≤ 2 s"]
    assert warm == [(None, "latency.json"), (True, "coldwarm.json")]  # each run's verdict, side by side
    got = {g["goal"]: g for g in listed if g["source"] != "coldwarm.json"}
    pw = got["OPT-125m shape: compileattn piecewise ≤ 1.05× the best full graph"]
    assert pw["met"] is False and pw["worst"] == pytest.approx(1.08) and pw["source"] == "latency.json"
    assert got["OPT-125m shape: compileattn full-decode ≤ 1.02× the best full graph"]["met"] is True
    assert got["OPT-125m shape, cold start ≤ 10 s"]["met"] is False
    assert got["OPT-125m shape, warm start ≤ 2 s"]["met"] is None
    host = got[f"Triton attention op host cost ≤ {opr.HOST_GOAL_US:g} µs per call (compiled runtime, per layer)"]
    assert host["met"] is False and host["worst"] == 16.5
    time_goal = next(g for name, g in got.items() if "FlashInfer tensor-core" in name)
    assert time_goal["met"] is False and time_goal["source"] == "decode.json"
    md = (tmp_path / "g.md").read_text()
    assert "**not met**" in md and "not measured" in md and "abc1234" in md
    with pytest.raises(SystemExit):
        goals_report.parse_args(["-o", str(tmp_path / "x")])


def test_decode_report_marks_failures_and_reasons(tmp_path):
    a, b = _two_runs()
    a["rows"].append(_dec_row(0, "gather-sdpa", 4096, 64, 16, status="FAILED", reason="rel. error 1 > 0.02"))
    md = dec.render_markdown(dec.merge_payloads([a, b]))
    assert "**FAILED**" in md and "rel. error 1" in md and "boom" in md
    assert "Goal check" in md
    table = {tuple(c.strip() for c in ln.split("|")[1:4]): ln.split("|")[-2].strip()
             for ln in md.splitlines() if ln.startswith("| 4096 |")}
    assert table[("4096", "64", "16")] == "0.95" and table[("4096", "1", "16")] == "1.08"  # same-run: no *
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    common.write_json(pa, a)
    common.write_json(pb, b)
    out = tmp_path / "merged"
    assert dec.main(["--merge", str(pa), str(pb), "-o", str(out), "--no-plot"]) == 0
    saved = json.loads((tmp_path / "merged.json").read_text())
    assert len(saved["runs"]) == 2 and len(saved["rows"]) == len(a["rows"]) + len(b["rows"])
    assert (tmp_path / "merged.md").read_text().startswith("# Decode attention")


def test_decode_merge_rejects_other_results():
    with pytest.raises(ValueError, match="not a decode_attention"):
        dec.merge_payloads([{"benchmark": "latency", "runs": [], "rows": []}])


def test_decode_plot_when_matplotlib_present(tmp_path):
    merged = dec.merge_payloads(list(_two_runs()))
    assert common.try_plot(tmp_path / "p.png", dec.plot(merged)) is None
    assert (tmp_path / "p.png").stat().st_size > 1000


# -- decode: inputs, oracle and implementations on tiny CPU shapes -----------------------------------


@pytest.fixture
def tiny_case():
    case = dec.make_case(40, 3, rotations=2, device="cpu", dtype=torch.float32, seed=0, num_heads=4,
                         num_kv_heads=2, head_dim=32)
    return case, dec.make_paged(case, 16, seed=0)


def test_paged_layout_holds_the_same_kv_and_oracle_matches_reference(tiny_case):
    case, pc = tiny_case
    b, nb = pc.block_table.shape
    assert nb == 3 and len(set(pc.block_table.flatten().tolist())) == b * nb  # distinct pages
    rebuilt = pc.kcs[0][pc.block_table.long()].reshape(b, nb * 16, 2, 32)[:, :40]
    torch.testing.assert_close(rebuilt, case.k)
    torch.testing.assert_close(pc.kcs[1], pc.kcs[0])
    assert dec.check_oracle_against_reference(case, pc) < 1e-5
    wrong = dec.Case(case.context, case.batch, case.q, case.k, case.v, case.scale,
                     torch.zeros_like(case.expected), case.rotations)
    assert dec.check_oracle_against_reference(wrong, pc) == math.inf or dec.check_oracle_against_reference(wrong, pc) > 1


@pytest.mark.parametrize("impl", ["sdpa-contig", "gather-sdpa"])
def test_sdpa_peers_equal_the_oracle(tiny_case, impl):
    case, pc = tiny_case
    kernel = dec.builder_for(impl, case, pc)()
    for r in range(case.rotations):
        kernel.fn(r)
        assert common.rel_error(kernel.output().reshape(case.expected.shape), case.expected) < 1e-5


def test_compileattn_adapter_generic_path_on_reference_backend(tiny_case):
    case, pc = tiny_case
    kernel = dec.build_compileattn("reference", case, pc)
    assert kernel.note.startswith("reference prepared call")
    before = pc.kcs[0].clone()
    kernel.fn(0)
    assert common.rel_error(kernel.output(), case.expected) < 1e-5
    torch.testing.assert_close(pc.kcs[0], before)  # attention alone: the cache is only read


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check (the GPU runs the script itself)")
def test_compileattn_triton_adapter_runs_attention_only(tiny_case):
    from compileattn.backends.triton import _mode

    _mode.sync_interpreter_mode()
    case, pc = tiny_case
    kernel = dec.build_compileattn("triton", case, pc)
    assert kernel.note.startswith("triton prepared call")
    for r in range(case.rotations):
        kernel.output().zero_()
        kernel.fn(r)
        assert common.rel_error(kernel.output(), case.expected) < 1e-4


def test_call_name_names_functions_and_launch_objects():
    """An unsplit Triton decode on a GPU prepares a ``DirectKernel`` (no ``__qualname__``): the
    note names its type and kernel instead of failing the cell."""
    def attend_split(q, out):
        pass

    class DirectKernel:
        def __init__(self):
            self.jit = type("JIT", (), {"__name__": "decode_kernel"})()

        def __call__(self, q, out):
            pass

    assert dec.call_name(attend_split).endswith("attend_split")
    assert dec.call_name(DirectKernel()).endswith("DirectKernel(decode_kernel)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU check (the GPU times the tuned column)")
def test_autotuned_column_is_unavailable_off_the_gpu_with_the_reason(tiny_case):
    case, pc = tiny_case
    with pytest.raises(dec.Unavailable, match="autotuning times kernels on a GPU"):
        dec.builder_for("ca-triton-tuned", case, pc)()


def test_unavailable_peers_give_a_reason(tiny_case):
    case, pc = tiny_case
    for impl in ("ca-flash", "fi-tc"):
        try:
            dec.builder_for(impl, case, pc)()
        except dec.Unavailable as exc:
            assert str(exc)
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"{impl} raised {type(exc).__name__} instead of Unavailable: {exc}")


def test_measure_times_only_what_matches_the_oracle(tiny_case, monkeypatch):
    """measure(): ok rows get µs/TB/s/×floor, a wrong kernel is FAILED (never timed), a kernel whose
    timed (captured) calls go wrong is FAILED after timing, a crash is an error row, not a crash."""
    case, pc = tiny_case
    timed = []

    def fake_timer(fn, *, rotations, after=None, **kw):
        for r in range(rotations):
            fn(r)
        timed.append(fn)
        if after is not None:
            after()
        return common.TimingResult(10.0, 9.5, "cuda-graph", rotations, 3, 0.01)

    monkeypatch.setattr(common, "gpu_time_us", fake_timer)
    args = dec.parse_args(["--quick"])
    kw = dict(args=args, budget=common.Budget(0), copy_gbps=4000.0, log=lambda msg: None)
    ok = dec.measure("gather-sdpa", case, pc, **kw)
    assert ok["status"] == "ok" and ok["us"] == 10.0 and len(timed) == 1
    assert ok["tbps"] == pytest.approx(case.kv_bytes / 10e-6 / 1e12)
    assert ok["x_floor"] == pytest.approx(10.0 / (case.kv_bytes / 4000e9 * 1e6))

    zeros = torch.zeros_like(case.q)
    monkeypatch.setattr(dec, "builder_for", lambda *a: lambda: dec.Kernel(lambda r: None, lambda: zeros))
    bad = dec.measure("ca-triton", case, pc, **kw)
    assert bad["status"] == "FAILED" and bad["us"] is None and len(timed) == 1  # not timed

    good = case.expected.to(case.q.dtype).clone()
    calls = []

    def drifting(r):  # right on the check call, wrong during the timed calls
        calls.append(r)
        if len(calls) > 1:
            good.zero_()

    monkeypatch.setattr(dec, "builder_for", lambda *a: lambda: dec.Kernel(drifting, lambda: good))
    late = dec.measure("ca-triton", case, pc, **kw)
    assert late["status"] == "FAILED" and late["us"] is None and late["us_invalid"] == 10.0

    def boom():
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(dec, "builder_for", lambda *a: boom)
    err = dec.measure("ca-triton", case, pc, **kw)
    assert err["status"] == "error" and "kernel exploded" in err["reason"]
    skipped = dec.measure("ca-triton", case, pc, **{**kw, "budget": common.Budget(1e-9)})
    assert skipped["status"] == "skipped"


# -- decode: the PagedAttention-style baseline, the fp8 rows, the kernel table, the KV waste ---------


def test_vllm_rule_for_v1_or_v2():
    assert pab.use_v1(1024, 1, 64) is False  # 2 partitions, 64 programs: V2
    assert pab.use_v1(512, 1, 64) is True  # one partition
    assert pab.use_v1(4096, 16, 64) is True  # 1024 programs > 512: enough parallelism
    assert pab.use_v1(16384, 256, 64) is False  # beyond 8192: V2 (shared memory)


def _paged_problem(lens, page, heads, dtype, seed=0):
    import random

    import naive

    h, kvh, d = heads
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // page) for n in lens) + 2
    tables = naive.assign_blocks(lens, page, nb, random.Random(seed))
    width = max(len(t) for t in tables) + 1
    spare = nb - 1 if all(nb - 1 not in t for t in tables) else nb - 2
    bt = torch.tensor([t + [spare] * (width - len(t)) for t in tables], dtype=torch.int32)
    kc = torch.randn(nb, page, kvh, d, generator=g).to(dtype)
    vc = torch.randn(nb, page, kvh, d, generator=g).to(dtype)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    want = []
    for i, n in enumerate(lens):
        rows = [(tables[i][p // page], p % page) for p in range(n)]
        k = torch.stack([kc[b, r] for b, r in rows]) if rows else torch.zeros(0, kvh, d)
        v = torch.stack([vc[b, r] for b, r in rows]) if rows else torch.zeros(0, kvh, d)
        want.append(naive.attend(q[i:i + 1], k, v, scale=d ** -0.5, causal=True)[0])
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), torch.stack(want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check (the GPU runs the script itself)")
@pytest.mark.parametrize("variant", ["v1", "v2"])
@pytest.mark.parametrize("heads,page,dtype", [((4, 4, 64), 16, torch.float32), ((8, 2, 64), 5, torch.float16),
                                              ((4, 1, 80), 16, torch.float16)], ids=["mha-p16", "gqa-p5", "mqa-d80"])
def test_paged_attention_baseline_equals_the_oracle(variant, heads, page, dtype):
    """V1 (one program per head over the whole context) and V2 (32-token partitions here, so the
    reduce merges up to 4), MHA/GQA/MQA, a page size that divides nothing; a sequence of length 0
    outputs zeros."""
    lens = [1, 37, 100, 0, 64]
    q, kc, vc, bt, seq_lens, want = _paged_problem(lens, page, heads, dtype)
    kernel = pab.baseline_for(heads[0], heads[1], heads[2], page, seq_lens, bt, max(lens), variant=variant,
                              partition_size=32)
    assert kernel.variant.startswith(variant.upper())
    out = torch.full_like(q, 7.0)
    kernel(q, kc, vc, out)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    assert (out[3] == 0).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check (the GPU runs the script itself)")
@pytest.mark.parametrize("splits", [1, 3, 8])  # unsplit, merged in the launch, by the combine kernel
def test_triton_decode_quick_launcher_equals_the_oracle(monkeypatch, splits):
    """The sweep's decode launcher (``triton_decode_quick.decode_launcher``) at any split count."""
    from compileattn.backends.triton.config import decode_config

    heads = (8, 2, 64)
    monkeypatch.setattr(tdq, "DEV", "cpu")
    monkeypatch.setattr(tdq, "H", heads[0])
    monkeypatch.setattr(tdq, "KVH", heads[1])
    monkeypatch.setattr(tdq, "D", heads[2])
    lens = [37, 100, 64]
    q, kc, vc, bt, seq_lens, want = _paged_problem(lens, 16, heads, torch.float16)
    step = types.SimpleNamespace(batch=len(lens), page=16, q=q, kc=kc, vc=vc, out=torch.full_like(q, 7.0),
                                 cu_q=torch.arange(len(lens) + 1, dtype=torch.int32), seq_lens=seq_lens)
    launch = tdq.decode_launcher(torch, step, decode_config(heads[0] // heads[1], heads[2], torch.float16), splits)
    launch(bt)
    torch.testing.assert_close(step.out.double(), want, atol=2e-3, rtol=2e-3)


def test_paged_attention_baseline_refuses_bad_partitions():
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="partition_size"):
        pab.baseline_for(4, 4, 64, 16, lens, torch.zeros(1, 1, dtype=torch.int32), 3, variant="v2", partition_size=48)
    with pytest.raises(ValueError, match="variant"):
        pab.baseline_for(4, 4, 64, 16, lens, torch.zeros(1, 1, dtype=torch.int32), 3, variant="v3")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check (the GPU runs the script itself)")
@pytest.mark.parametrize("impl", ["pa-baseline", "ca-triton-fp8"])
def test_baseline_and_fp8_adapters(tiny_case, impl):
    from compileattn.backends.triton import _mode

    _mode.sync_interpreter_mode()
    case, pc = tiny_case
    kernel = dec.builder_for(impl, case, pc)()
    tol = dec.FP8_TOLERANCE if impl == dec.FP8_IMPL else 1e-4
    for r in range(case.rotations):
        kernel.output().zero_()
        kernel.fn(r)
        err = common.rel_error(kernel.output().reshape(case.expected.shape), case.expected)
        assert err < tol
    if impl == dec.FP8_IMPL:
        assert kernel.kv_bytes == 2 * case.k.numel() and err > 1e-3 and "fp8 KV" in kernel.note
    else:
        assert kernel.kv_bytes is None and kernel.note.startswith("V1")


def _table_rows():
    rows = []
    for ctx, batch, page, impl, us in [
        (1024, 1, 16, "ca-triton", 10.0), (1024, 1, 128, "ca-triton", 9.8), (1024, 1, 16, "pa-baseline", 30.0),
        (1024, 1, 16, "fi-tc", 11.0), (1024, 1, 16, "ca-triton-fp8", 8.0),
        (1024, 64, 16, "ca-triton", 70.0), (1024, 64, 16, "ca-flash", 60.0), (1024, 64, 128, "ca-triton", 55.0),
        (1024, 64, 16, "pa-baseline", 90.0), (1024, 64, 16, "ca-triton-fp8", 38.0),
    ]:
        rows.append(_dec_row(0, impl, ctx, batch, page, us))
    mha = _dec_row(0, "ca-triton", 1024, 1, 16, 20.0)
    mha["shape"] = "mha32"
    return rows + [mha]


def test_kernel_table_and_fp8_rows():
    chosen = dec.select([r for r in _table_rows() if dec.row_shape(r) == "gqa64x8"])
    kt = {(e["context"], e["batch"]): e for e in dec.kernel_table(chosen)}
    e1, e64 = kt[(1024, 1)], kt[(1024, 64)]
    assert e1["vs_baseline"] == pytest.approx(10 / 30) and e1["speedup"] == pytest.approx(3.0)
    assert e1["p16_vs_p128"] == pytest.approx(10 / 9.8) and e1["vs_fi"] == pytest.approx(10 / 11)
    assert e64["ca16_impl"] == "ca-flash" and e64["p16_vs_p128"] == pytest.approx(60 / 55) and e64["fi_us"] is None
    text = "\n".join(dec.render_kernel_table(list(kt.values())))
    assert "0.33–0.67×" in text and "1.50–3.00×" in text and "in 1 of 2 cells" in text
    ft = {(e["batch"]): e for e in dec.fp8_table(chosen)}
    assert ft[64]["ratio"] == pytest.approx(38 / 70) and ft[1]["ratio"] == pytest.approx(0.8)
    text = "\n".join(dec.render_fp8_table(list(ft.values())))
    assert "At batch ≥ 64 (HBM-bound), fp8 ÷ bf16 GPU time: 0.54×" in text


def test_report_has_a_section_per_shape_and_the_kv_waste(tmp_path):
    payload = _dec_payload("x", _table_rows())
    md = dec.render_markdown(payload)
    assert md.index("## GQA 64/8") < md.index("### Kernel table") < md.index("## MHA 32/32")
    assert "### fp8 KV cache against bf16" in md and "## KV-cache memory wasted by the block size" in md
    assert common.try_plot(tmp_path / "p.png", dec.plot(payload)) is None


def test_kv_waste_is_the_partly_empty_last_block():
    rows = {r["block"]: r for r in dec.kv_waste_rows(lengths=range(1, 257), blocks=(1, 16, 256))}
    assert rows[1]["waste_tokens"] == 0 and rows[1]["fit_vs_block1"] == 1.0
    assert rows[16]["waste_tokens"] == pytest.approx(7.5)  # lengths spread evenly over 16 residues
    assert rows[256]["mean_allocated"] == 256 and rows[256]["waste_tokens"] == pytest.approx(256 - 128.5)
    assert rows[16]["waste_mib"] == pytest.approx(7.5 * dec.BYTES_PER_TOKEN_70B * 256 / common.MiB)
    sample = dec.kv_waste_rows(blocks=(16, 128))
    assert sample[0]["waste_tokens"] < sample[1]["waste_tokens"] and 0 < sample[0]["waste_share"] < 0.02
    with pytest.raises(ValueError):
        dec.kv_waste_rows(lengths=[0, 3])


def test_kv_waste_alone_needs_no_gpu(tmp_path):
    assert dec.main(["--kv-waste", "--out", str(tmp_path / "w")]) == 0
    assert (tmp_path / "w.md").read_text().startswith("# KV-cache memory wasted")


# -- latency: cells, merging, ratios, goals ----------------------------------------------------------


def test_latency_cells_order_and_blocks():
    args = lat.parse_args(["--batches", "1,8", "--contexts", "20,40", "--mixed-decodes", "2", "--mixed-prefill", "5"])
    cells = lat.make_cells(args)
    assert [c.tokens for c in cells] == [8, 8, 7, 1, 1]  # largest first: the compile call has >= 2 tokens
    mixed = next(c for c in cells if c.kind == "mixed")
    seqs = mixed.seqs(16, first_block=10)
    assert [s.query_len for s in seqs] == [1, 1, 5] and [s.context_len for s in seqs] == [20, 20, 0]
    assert seqs[0].block_table == [10, 11] and seqs[2].block_table == [14]
    assert mixed.blocks(16) == 5 and mixed.positions() == [20, 20, 0, 1, 2, 3, 4]


def _lat_row(run, model, column, batch, p50, status="ok", context=512):
    cell = lat.Cell("decode", batch, context)
    r = lat.base_row(model, cell, column, batch)
    r["run"] = run
    if status == "ok":
        r.update(p50_us=p50, p90_us=p50 * 1.1, p99_us=p50 * 1.2, mean_us=p50, min_us=p50, max_us=p50, steps=3)
    r["status"] = status
    return r


def test_latency_merge_ratios_and_goals(tmp_path):
    a = {"benchmark": "latency", "config": {}, "runs": [{"label": "opt"}], "stats": [], "probes": [
        {"run": 0, "model": "opt", "phase": "warm", "status": "ok", "first_call_s": 1.5, "capture_s": 0.1}],
         "rows": [_lat_row(0, "opt", "graph-eager", 1, 540), _lat_row(0, "opt", "graph-inductor", 1, 500),
                  _lat_row(0, "opt", "ca-piecewise", 1, 520), _lat_row(0, "opt", "ca-full", 1, 530),
                  _lat_row(0, "opt", "eager", 1, 3400)]}
    b = {"benchmark": "latency", "config": {}, "runs": [{"label": "llama"}], "stats": [], "probes": [],
         "rows": [_lat_row(0, "llama", "reduce-overhead", 1, 4800), _lat_row(0, "llama", "ca-piecewise", 1, 4900),
                  _lat_row(0, "llama", "graph-eager", 1, 5100, status="FAILED")]}
    merged = rep.merge_payloads([a, b])
    assert [r["run"] for r in merged["rows"]][-1] == 1 and len(merged["runs"]) == 2
    chosen = rep.select(merged["rows"])
    rt = rep.ratios(chosen, ("opt", "decode", 1, 512, 0))
    assert rt["best_graph_us"] == 500 and rt["piecewise_vs_best_graph"] == pytest.approx(1.04)
    assert rt["full_vs_best_graph"] == pytest.approx(1.06)
    lines = "\n".join(rep.goal_lines(merged))
    assert "OPT-125m shape: compileattn piecewise ≤ 1.05× the best full graph: MET" in lines
    assert "full-decode ≤ 1.02× the best full graph: NOT MET" in lines
    # Llama's piecewise goal is against the best graph (issue 12): its only graph failed its check
    assert "Llama-3-8B shape: compileattn piecewise ≤ 1.02× the best full graph: not measured" in lines
    assert "reduce-overhead (issue 5): NOT MET" in lines
    assert "OPT-125m shape, warm start ≤ 2 s: MET — 1.50 s" in lines
    md = rep.render_markdown(merged)
    assert "520 / 572 / 624" in md and "**FAILED**" in md and "issue's figures" in md
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    common.write_json(pa, a)
    common.write_json(pb, b)
    assert lat.main(["--merge", str(pa), str(pb), "-o", str(tmp_path / "m"), "--no-plot"]) == 0
    assert (tmp_path / "m.md").exists() and len(common.read_json(tmp_path / "m.json")["rows"]) == 8


def test_latency_goal_is_not_met_where_a_decode_cell_has_no_ratio():
    """"Every decode cell": a cell whose compileattn column FAILED (or was skipped) has no ratio;
    the cells that were measured passing must not make the goal MET."""
    rows = [_lat_row(0, "opt", "graph-eager", 1, 500), _lat_row(0, "opt", "ca-piecewise", 1, 510),
            _lat_row(0, "opt", "ca-full", 1, 505),
            _lat_row(0, "opt", "graph-eager", 8, 600), _lat_row(0, "opt", "ca-piecewise", 8, None, status="FAILED"),
            _lat_row(0, "opt", "ca-full", 8, None, status="skipped")]
    payload = {"benchmark": "latency", "config": {}, "runs": [{"label": "opt"}], "stats": [], "probes": [], "rows": rows}
    got = {g["goal"]: g for g in rep.goal_records(payload)}
    pw = got["OPT-125m shape: compileattn piecewise ≤ 1.05× the best full graph"]
    assert pw["met"] is None and "1 decode cell(s) not measured" in pw["measured"]
    assert got["OPT-125m shape: compileattn full-decode ≤ 1.02× the best full graph"]["met"] is None
    rows[1] = _lat_row(0, "opt", "ca-piecewise", 1, 560)  # a measured miss stays a miss
    assert {g["goal"]: g for g in rep.goal_records(payload)}[pw["goal"]]["met"] is False
    rows[4] = _lat_row(0, "opt", "ca-piecewise", 8, 610)
    rows[1] = _lat_row(0, "opt", "ca-piecewise", 1, 510)
    assert {g["goal"]: g for g in rep.goal_records(payload)}[pw["goal"]]["met"] is True


def test_latency_ratios_goals_and_floors_pair_within_one_run():
    """A merged report's ratio divides two p50s of one run (clocks and host load differ between
    runs): each column's shown row can come from another run. A ratio no run measured both sides
    of is marked * and counts toward no goal; each cell's (N×) divides by its own run's floor."""
    counts = {"weight_bytes": 170_000_000, "kv_bytes_per_token": 36_864, "layers": 12}
    runs = [{"label": "a", "copy_bandwidth": {"GBps": 4000.0}, "models": {"opt": counts}},
            {"label": "b", "copy_bandwidth": {"GBps": 2000.0}, "models": {"opt": counts}}]
    rows = [_lat_row(0, "opt", "graph-eager", 1, 500), _lat_row(0, "opt", "ca-piecewise", 1, 520),
            _lat_row(0, "opt", "ca-full", 1, None, status="FAILED"),
            _lat_row(1, "opt", "graph-eager", 1, 400), _lat_row(1, "opt", "graph-inductor", 1, 380),
            _lat_row(1, "opt", "ca-full", 1, 385)]
    payload = {"benchmark": "latency", "config": {}, "runs": runs, "rows": rows, "stats": [], "probes": []}
    cell = ("opt", "decode", 1, 512, 0)
    got = {g["goal"]: g for g in rep.goal_records(payload)}
    assert got["OPT-125m shape: compileattn piecewise ≤ 1.05× the best full graph"]["met"] is True
    md = rep.render_markdown(payload)
    line = next(ln for ln in md.splitlines() if ln.startswith("| decode | 1 | 512 |"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    floor0, floor1 = rep.floor_us(payload, rows[0]), rep.floor_us(payload, rows[3])
    assert cells[4] == f"{floor0:.0f}–{floor1:.0f}"
    assert f"520 / 572 / 624 ({520 / floor0:.1f}×)" in cells and f"385 / 424 / 462 ({385 / floor1:.1f}×)" in cells
    assert cells[-3:-1] == ["1.04", "1.01"]
    rt = rep.ratios(rep.select(rows), cell, rows)
    # shown: piecewise 520 (run 0, the only one), graph-inductor 380 (run 1); paired: run 0's 520 / 500
    assert rt["piecewise_vs_best_graph"] == pytest.approx(520 / 500) and not rt["cross_run"]
    assert rt["full_vs_best_graph"] == pytest.approx(385 / 380)

    # no run measured both sides: the ratio is shown marked, and the goal is not met by it
    crossed = [_lat_row(0, "opt", "graph-eager", 1, 600), _lat_row(1, "opt", "ca-full", 1, 500)]
    payload = {**payload, "rows": crossed}
    line = next(ln for ln in rep.render_markdown(payload).splitlines() if ln.startswith("| decode | 1 | 512 |"))
    assert "| 0.83* |" in line
    full = {g["goal"]: g for g in rep.goal_records(payload)}[
        "OPT-125m shape: compileattn full-decode ≤ 1.02× the best full graph"]
    assert full["met"] is None and "only across runs" in full["measured"], full
    rt = rep.ratios(rep.select(crossed), cell, crossed)
    assert rt["full_vs_best_graph"] == pytest.approx(500 / 600) and rt["cross_run"] == ["full_vs_best_graph"]


def test_latency_interleaved_ratio_wins_and_counts_toward_the_goal():
    """A compileattn row timed side by side with the full graphs (``paired``) gives the goal's
    ratio from those timings, not from the columns' own p50s taken minutes apart; marked † in the
    table, with the side-by-side table after it."""
    full = _lat_row(0, "opt", "ca-full", 8, 560)  # alone: 560 / 500 = 1.12, a miss
    full["paired"] = {"rounds": 3, "p50_us": {"ca-full": 505.0, "graph-eager": 600.0, "graph-inductor": 500.0}}
    pw = _lat_row(0, "opt", "ca-piecewise", 8, 600)
    pw["paired"] = {"rounds": 3, "p50_us": {"ca-piecewise": 540.0, "graph-eager": 610.0}}  # no inductor floor
    rows = [_lat_row(0, "opt", "graph-eager", 8, 600), _lat_row(0, "opt", "graph-inductor", 8, 500), full, pw]
    payload = {"benchmark": "latency", "config": {}, "runs": [{"label": "opt"}], "stats": [], "probes": [], "rows": rows}
    rt = rep.ratios(rep.select(rows), ("opt", "decode", 8, 512, 0), rows)
    assert rt["full_vs_best_graph"] == pytest.approx(505 / 500)
    assert rt["piecewise_vs_best_graph"] == pytest.approx(540 / 610)
    assert sorted(rt["interleaved"]) == ["full_vs_best_graph", "piecewise_vs_best_graph"] and not rt["cross_run"]
    got = {g["goal"]: g for g in rep.goal_records(payload)}
    assert got["OPT-125m shape: compileattn full-decode ≤ 1.02× the best full graph"]["met"] is True
    md = rep.render_markdown(payload)
    line = next(ln for ln in md.splitlines() if ln.startswith("| decode | 8 | 512 |"))
    assert "| 0.89† | 1.01† |" in line, line
    assert "| decode | 8 | 512 | ca-full | 3 | 505.0 | 600.0 | 500.0 | 1.010 |" in md
    assert "| decode | 8 | 512 | ca-piecewise | 3 | 540.0 | 610.0 | — | 0.885 |" in md
    # a row without side-by-side timing of a denominator falls back to the run's own p50s
    full["paired"] = {"rounds": 3, "p50_us": {"ca-full": 505.0}}
    rt = rep.ratios(rep.select(rows), ("opt", "decode", 8, 512, 0), rows)
    assert rt["full_vs_best_graph"] == pytest.approx(560 / 500) and "full_vs_best_graph" not in rt["interleaved"]


def test_latency_interleaved_steps_rotate_their_order(monkeypatch):
    """Each round runs every step once; the order rotates, so no step always follows the same one."""
    monkeypatch.setattr(lat, "DEVICE", "cpu")
    order = []
    steps = {name: (lambda name=name: order.append(name)) for name in ("col", "g1", "g2")}
    samples = lat.interleaved_steps(steps, 4)
    assert order == ["col", "g1", "g2", "g1", "g2", "col", "g2", "col", "g1", "col", "g1", "g2"]
    assert {k: len(v) for k, v in samples.items()} == {"col": 4, "g1": 4, "g2": 4}


class _FakeFloors(lat.Group):
    """A full-graph group whose 'graphs' exist for the token counts in ``sizes``."""

    def __init__(self, column, sizes, calls):
        self.columns, self.sizes, self.calls, self.column = (column,), sizes, calls, column

    def captured_graph(self, column, num_tokens):
        return object() if column == self.column and num_tokens in self.sizes else None

    def floor_step(self, column, ids, pos):
        if self.captured_graph(column, ids.shape[0]) is None:
            return None
        return lambda: self.calls.append(self.column)


def test_latency_paired_timing_uses_the_floors_with_a_graph_of_the_cells_size(monkeypatch):
    monkeypatch.setattr(lat, "DEVICE", "cpu")
    calls = []
    floors = {"graph-eager": _FakeFloors("graph-eager", {8}, calls),
              "graph-inductor": _FakeFloors("graph-inductor", {16}, calls)}
    ids = torch.zeros(8, dtype=torch.long)
    got = lat.paired_timing(lambda: calls.append("ca-full"), "ca-full", floors, ids, ids, 5)
    assert got["rounds"] == 5 and set(got["p50_us"]) == {"ca-full", "graph-eager"}
    assert calls.count("ca-full") == 5 and calls.count("graph-eager") == 5 and "graph-inductor" not in calls
    assert lat.paired_timing(lambda: None, "ca-full", floors, torch.zeros(4, dtype=torch.long), ids, 5) is None

@pytest.fixture
def latency_on_tiny_opt(monkeypatch):
    """latency.py on the CPU with a tiny random OPT for every model it builds."""
    from compileattn.models.opt import OPTConfig, OPTForCausalLM

    monkeypatch.setattr(lat, "DEVICE", "cpu")
    monkeypatch.setattr(lat, "build_model", lambda name, **kw: OPTForCausalLM(
        OPTConfig.tiny(), dtype=torch.float32, device="cpu"))


def test_latency_keeps_the_full_graphs_for_the_compileattn_columns_only(monkeypatch, latency_on_tiny_opt):
    """run_model's order: the full graphs' groups first, kept while the compileattn columns are
    timed side by side with them, released (compilers reset) before reduce-overhead."""
    events = []

    class Fake(lat.Group):
        def __init__(self, name, bench):
            self.name, self.bench = name, bench
            self.columns = dict(lat.GROUPS)[name]

        def step(self, column, cell, ids, pos):
            model = self.bench.model
            return lambda: (events.append(("step", column)), model(ids, pos))[1]

        def captured_graph(self, column, num_tokens):
            return object() if column.startswith("graph-") else None

        def floor_step(self, column, ids, pos):
            return (lambda: events.append(("floor", column))) if column.startswith("graph-") else None

    monkeypatch.setattr(lat, "make_group", lambda name, bench: Fake(name, bench))
    monkeypatch.setattr(lat, "replay_gpu_us", lambda graph, replays=20: 1.0)
    monkeypatch.setattr(lat, "_reset_compilers", lambda: events.append(("reset",)))
    args = lat.parse_args(["--models", "opt", "--batches", "3", "--contexts", "20", "--steps", "2", "--warmup", "1",
                           "--backend", "reference", "--no-mixed", "--no-cold-warm"])
    rows, stats = [], []
    lat.run_model("opt", args, common.Budget(0), common.Log(), rows, stats)
    by = {r["column"]: r for r in rows}
    for col in ("ca-piecewise", "ca-full"):
        assert set(by[col]["paired"]["p50_us"]) == {col, "graph-eager", "graph-inductor"}, by[col]
        assert by[col]["paired"]["rounds"] == 2
    assert "paired" not in by["reduce-overhead"] and "paired" not in by["eager"]
    order = [e[1] if e[0] != "reset" else "reset" for e in events if e[0] in ("step", "reset")]
    first = {c: order.index(c) for c in lat.COLUMNS}
    assert first["graph-eager"] < first["graph-inductor"] < first["ca-piecewise"] < first["ca-full"] < first["reduce-overhead"]
    # after ca-full's group: its own reset, then the floors' release (a second reset) before reduce-overhead
    between = order[max(i for i, c in enumerate(order) if c == "ca-full"):first["reduce-overhead"]]
    assert between.count("reset") == 2, order
    assert not [e for e in events[events.index(("step", "reduce-overhead")):] if e[0] == "floor"]


def _run_fake_groups(monkeypatch, group_class, batches: str, columns: str) -> list:
    """run_model's rows for OPT decode cells (context 20) with ``group_class`` as every group."""
    monkeypatch.setattr(lat, "make_group", lambda name, bench: group_class(name, bench))
    monkeypatch.setattr(lat, "_reset_compilers", lambda: None)
    args = lat.parse_args(["--models", "opt", "--batches", batches, "--contexts", "20", "--steps", "2", "--warmup",
                           "1", "--backend", "reference", "--no-mixed", "--no-cold-warm", "--columns", columns])
    rows = []
    lat.run_model("opt", args, common.Budget(0), common.Log(), rows, [])
    return rows


def test_latency_pairs_a_cell_only_with_the_full_graphs_ok_in_it(monkeypatch, latency_on_tiny_opt):
    """A full graph whose own row of a cell FAILED the check against eager (its graph was captured
    all the same) is no floor for that cell: the compileattn columns are not timed beside it there,
    as the ratios of unpaired rows divide ok rows only; in a cell where it was ok, it is."""

    class Fake(lat.Group):
        def __init__(self, name, bench):
            self.bench, self.columns = bench, dict(lat.GROUPS)[name]

        def step(self, column, cell, ids, pos):
            model = self.bench.model
            wrong = column == "graph-inductor" and cell.batch == 3
            return lambda: model(ids, pos) * (3.0 if wrong else 1.0)

        def floor_step(self, column, ids, pos):
            return (lambda: None) if column.startswith("graph-") else None

    rows = _run_fake_groups(monkeypatch, Fake, "3,2", "graph-eager,graph-inductor,ca-full")
    by = {(r["column"], r["batch"]): r for r in rows}
    assert by[("graph-inductor", 3)]["status"] == "FAILED" and by[("graph-inductor", 2)]["status"] == "ok"
    assert set(by[("ca-full", 3)]["paired"]["p50_us"]) == {"ca-full", "graph-eager"}
    assert set(by[("ca-full", 2)]["paired"]["p50_us"]) == {"ca-full", "graph-eager", "graph-inductor"}


def test_latency_side_by_side_failure_keeps_the_columns_own_row(monkeypatch, latency_on_tiny_opt):
    """A floor whose replay raises during the side-by-side rounds (code first run on the GPU there)
    costs the pairing only: the compileattn column's row stays ok with its own timings, records
    why (``paired_error``), and its ratio falls back to the run's own p50s, without a dagger."""

    class Fake(lat.Group):
        def __init__(self, name, bench):
            self.bench, self.columns = bench, dict(lat.GROUPS)[name]

        def step(self, column, cell, ids, pos):
            model = self.bench.model
            return lambda: model(ids, pos)

        def floor_step(self, column, ids, pos):
            def replay():
                raise RuntimeError("replay of a kept graph failed")

            return replay if column == "graph-eager" else None

    rows = _run_fake_groups(monkeypatch, Fake, "3", "graph-eager,ca-full")
    full = next(r for r in rows if r["column"] == "ca-full")
    assert full["status"] == "ok" and full["p50_us"] > 0 and "paired" not in full
    assert "replay of a kept graph failed" in full["paired_error"]
    payload = {"benchmark": "latency", "config": {}, "runs": [{"label": "cpu"}], "rows": rows, "stats": [],
               "probes": []}
    rt = rep.ratios(rep.select(rows), ("opt", "decode", 3, 20, 0), rows)
    assert rt["full_vs_best_graph"] is not None and not rt["interleaved"]
    assert "ca-full — side-by-side timing failed in 1 cell(s): RuntimeError" in rep.render_markdown(payload)


def test_latency_real_groups_time_side_by_side_under_simulated_graphs(monkeypatch, latency_on_tiny_opt):
    """The GPU command's groups themselves (not fakes): the hand-captured full graphs (eager, and
    Inductor through _inductor_keeping), kept across the compilers' resets, replayed side by side
    with the compileattn columns' steps; the report marks the ratios with a dagger and the goals
    count them. CUDA graphs simulated (the reference backend counts as capturable), pieces eager."""
    from compileattn.testing import simulated_cuda_graphs

    monkeypatch.setattr(lat, "replay_gpu_us", lambda graph, replays=20: 1.0)  # CUDA events
    made = []
    make_group = lat.make_group
    monkeypatch.setattr(lat, "make_group", lambda name, bench: made.append(make_group(name, bench)) or made[-1])
    args = lat.parse_args(["--models", "opt", "--batches", "3", "--contexts", "20", "--steps", "2", "--warmup", "1",
                           "--backend", "reference", "--no-mixed", "--no-cold-warm",
                           "--columns", "graph-eager,graph-inductor,ca-piecewise,ca-full"])
    args.piece_compiler = "eager"
    rows, stats = [], []
    with simulated_cuda_graphs():
        lat.run_model("opt", args, common.Budget(0), common.Log(), rows, stats)
    by = {r["column"]: r for r in rows}
    assert {c: r["status"] for c, r in by.items()} == dict.fromkeys(by, "ok"), rows
    for col in ("ca-piecewise", "ca-full"):
        assert set(by[col]["paired"]["p50_us"]) == {col, "graph-eager", "graph-inductor"}, by[col]
    inductor = next(g for g in made if isinstance(g, lat.InductorGroup))
    assert inductor.kept and inductor.graphs.graphs  # what Inductor compiled, held past the resets
    payload = {"benchmark": "latency", "config": {}, "runs": [{"label": "cpu"}], "rows": rows, "stats": stats,
               "probes": []}
    json.dumps(payload)
    md = rep.render_markdown(payload)
    assert "†" in md and "Side by side" in md
    verdicts = {g["goal"]: g for g in rep.goal_records(payload)}
    assert all(g["met"] is not None and g["cells"] == 1 for g in verdicts.values()), verdicts


def test_latency_plumbing_on_a_tiny_cpu_model(monkeypatch, latency_on_tiny_opt, tmp_path):
    """Bench, metadata per cell, the eager reference, fail-soft columns and the report, on the CPU
    with the reference backend (graph columns are unavailable there: it is not capturable)."""
    args = lat.parse_args(["--models", "opt", "--batches", "1,3", "--contexts", "20", "--steps", "2",
                           "--warmup", "1", "--backend", "reference", "--columns", "eager,graph-eager",
                           "--mixed-decodes", "1", "--mixed-prefill", "4", "--no-cold-warm"])
    rows, stats, saves = [], [], []
    lat.run_model("opt", args, common.Budget(0), common.Log(), rows, stats, checkpoint=lambda: saves.append(len(rows)))
    assert saves == [1, 2, 3, 4, 5, 6, 6]  # one checkpoint per measured cell, one per group (eager + graph-eager)
    res = {"rows": rows, "stats": stats}
    by = {(r["column"], r["kind"], r["batch"]): r for r in rows}
    for key in [("eager", "decode", 1), ("eager", "decode", 3), ("eager", "mixed", 1)]:
        assert by[key]["status"] == "ok" and by[key]["rel_err"] == 0.0 and by[key]["steps"] == 2
    assert by[("graph-eager", "decode", 3)]["status"] == "unavailable"
    assert "capturable" in by[("graph-eager", "decode", 3)]["reason"]
    payload = {"benchmark": "latency", "config": {}, "runs": [{"label": "cpu"}], "rows": res["rows"],
               "stats": res["stats"], "probes": []}
    md = rep.render_markdown(payload)
    assert "OPT-125m shape" in md and "n/a" in md


# -- region_trace.py ----------------------------------------------------------------------------------


def test_region_trace_measures_each_row_and_restores_the_model(tmp_path):
    from compileattn import _torch_compat, layer_ids
    from compileattn.models.llama import LlamaDecoderLayer

    forward = LlamaDecoderLayer.__dict__["forward"]
    assert rt.main(["--layers", "3", "--out", str(tmp_path / "rt")]) == 0
    rows = {r["row"]: r for r in common.read_json(tmp_path / "rt.json")["rows"]}
    assert rows["flat"]["status"] == "ok" and rows["flat"]["region_calls"] == 0
    by_id = rows["regions, layer ids"]
    assert by_id["status"] == "ok" and by_id["region_calls"] == 3
    if _torch_compat.compile_region() is not None:  # torch 2.13: one layer traced, reused twice
        assert by_id["subgraphs"] == 1 and by_id["top_nodes"] < rows["flat"]["top_nodes"]
    assert "| 3 | regions, layer names |" in (tmp_path / "rt.md").read_text()
    assert LlamaDecoderLayer.__dict__["forward"] is forward and not layer_ids.tracing_regions


# -- coldwarm.py ------------------------------------------------------------------------------------------


def test_coldwarm_writes_its_files_after_each_phase(tmp_path, monkeypatch):
    """coldwarm.py runs under a timeout in issue12_gpu.sh: its files are written after each phase
    (the report renders a run cut short), so a kill keeps the phases that finished."""
    ran = []

    def fake_phase(model, phase, dirs, args, budget, log):
        ran.append((model, phase))
        if len(ran) == 3:
            raise KeyboardInterrupt  # killed during the third phase
        return {"model": model, "phase": phase, "status": "ok", "reason": "", "first_call_s": 1.0, "path": phase,
                "process_s": 2.0, "dtype": "float32", "rel_err": 0.0, "import_s": 0.5, "build_s": 0.1}

    monkeypatch.setattr(coldwarm, "run_phase", fake_phase)
    out = tmp_path / "cw"
    with pytest.raises(KeyboardInterrupt):
        coldwarm.main(["--device", "cpu", "--models", "opt,llama", "--out", str(out)])
    rows = common.read_json(str(out) + ".json")["rows"]
    assert [(r["model"], r["phase"]) for r in rows] == ran[:2] == [("opt", "cold"), ("opt", "warm")]
    assert "warm start ≤ 2 s" in (tmp_path / "cw.md").read_text()


def test_coldwarm_plumbing_on_the_cpu(tmp_path):
    """The GPU command's code path end to end on tiny CPU configs: fresh processes per phase, the
    warm one loads (no Dynamo, no compile), every row checked against eager, the report's goals."""
    out = tmp_path / "cw"
    assert coldwarm.main(["--device", "cpu", "--models", "opt", "--out", str(out)]) == 0
    rows = {r["phase"]: r for r in common.read_json(str(out) + ".json")["rows"]}
    assert {p: r["status"] for p, r in rows.items()} == {"cold": "ok", "warm": "ok", "cold, dynamic only": "ok",
                                                         "cold, waiting for static": "ok",
                                                         "cold, workers after dynamic": "ok",
                                                         "cold, layers traced flat": "ok",
                                                         "cold, fork server at first call": "ok",
                                                         "cold, attention kernels at first launch": "ok"}
    assert rows["cold"]["path"] == "cold" and rows["cold"]["counters"]["dynamo_graphs"] == 1
    assert rows["cold"]["regions"] == "on: OPTDecoderLayer x2" and rows["cold"]["counters"]["regions_inlined"] == 2
    assert rows["cold, layers traced flat"]["regions"] == "off: config.trace_layers_once is False"
    assert rows["cold"]["torch_compile_times"]["bytecode_tracing"] > 0  # torch's own phases, recorded
    assert "bytecode_tracing" not in rows["warm"]["torch_compile_times"]  # a warm start runs no Dynamo
    assert rows["warm"]["path"] == "warm" and rows["warm"]["counters"]["dynamo_graphs"] == 0
    assert rows["warm"]["counters"]["backend_compiles"] == 0 and rows["warm"]["load_s"] > 0
    md = (tmp_path / "cw.md").read_text()
    assert "CPU plumbing run" in md and "warm start ≤ 2 s" in md and "Inside torch's compile" in md
    assert "with the layers traced once (regions on: OPTDecoderLayer x2) against" in md
    # each row's first call, as compileattn logged it (DEBUG included), in time order
    times = [t for t, _ in rows["cold"]["timeline"]]
    assert times == sorted(times) and times[0] >= 0
    assert any(message.startswith("compiled ") for _, message in rows["cold"]["timeline"])
    assert any("warm start" in message for _, message in rows["warm"]["timeline"])
    for phase in ("cold\n", "warm\n", "cold, dynamic only\n"):
        assert f"## Timeline: OPT-125m shape, {phase}" in md


def test_coldwarm_removes_the_phases_caches_also_on_an_error(tmp_path, monkeypatch):
    """Each cold phase made a compileattn_coldwarm_* dir in the system's temp dir and nothing
    removed them: every run left its cache trees behind."""
    import subprocess
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real_run, caches = subprocess.run, []

    def failing_probe(argv, **kwargs):
        if "--_probe" not in argv:
            return real_run(argv, **kwargs)
        cache = Path(json.loads(argv[-1])["cache_dir"])
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "entry").write_text("cached")
        caches.append(cache)
        return subprocess.CompletedProcess(argv, 1, "", "probe failed")

    monkeypatch.setattr(coldwarm.subprocess, "run", failing_probe)
    args = coldwarm.parse_args(["--device", "cpu", "--models", "opt"])
    rows = coldwarm.run_benchmark(args, common.Log())["rows"]
    assert {r["status"] for r in rows} == {"error"} and len(caches) == len(rows) > 2
    assert caches[0] == caches[1] and len(set(caches)) == len(rows) - 1  # the warm phase reads the cold one's
    assert all(c.is_relative_to(tmp_path) for c in caches) and not list(tmp_path.iterdir())

    def crashing_probe(argv, **kwargs):
        failing_probe(argv, **kwargs)
        raise RuntimeError("probe crashed")

    monkeypatch.setattr(coldwarm.subprocess, "run", crashing_probe)
    with pytest.raises(RuntimeError, match="probe crashed"):
        coldwarm.run_benchmark(args, common.Log())
    assert not list(tmp_path.iterdir())


def test_coldwarm_timeline_recorder_takes_debug_and_restores_the_level():
    log = logging.getLogger("compileattn")
    before = log.level
    log.setLevel(logging.WARNING)
    try:
        with coldwarm.TimelineRecorder(time.perf_counter()) as rec:
            log.debug("worker %d ready", 3)
        log.debug("after the first call")
        assert [m for _, m in rec.events] == ["worker 3 ready"] and rec.events[0][0] >= 0
        assert log.level == logging.WARNING and rec not in log.handlers
    finally:
        log.setLevel(before)


def test_inductor_options_on_the_command_line_must_be_a_json_object():
    """``--inductor-options`` of latency.py and piecewise_gaps.py (``common.json_object``)."""
    assert common.json_object('{"post_grad_custom_post_pass": null}') == {"post_grad_custom_post_pass": None}
    with pytest.raises(ValueError, match="expected a JSON object"):
        common.json_object('["post_grad_custom_post_pass"]')
    with pytest.raises(ValueError):
        common.json_object("{post_grad_custom_post_pass: null}")  # not JSON at all


def test_latency_cold_warm_probes_run_coldwarms_phases(monkeypatch, tmp_path):
    """latency.py's cold/warm subprocesses go through coldwarm.run_phase with every option it
    reads (one it lacked would crash the probes after a model's whole column run), in
    coldwarm.phase_dirs, which removes their caches."""
    import tempfile

    monkeypatch.setattr(lat, "DEVICE", "cpu")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = lat.parse_args(["--models", "opt"])
    rows = lat.run_probes("opt", args, common.Budget(300), common.Log())
    assert [(r["phase"], r["status"]) for r in rows] == [("cold", "ok"), ("warm", "ok")], rows
    assert rows[1]["path"] == "warm" and rows[0]["first_call_s"] > 0
    assert not list(tmp_path.iterdir())


def test_coldwarm_report_marks_failures_and_skips():
    rows = [{"model": "llama", "phase": "cold", "status": "FAILED", "reason": "differs from eager"},
            {"model": "llama", "phase": "warm", "status": "ok", "path": "warm", "first_call_s": 2.5, "load_s": 0.3,
             "import_s": 3.0, "build_s": 1.0, "process_s": 9.0, "rel_err": 0.01, "dtype": "bfloat16",
             "counters": {"backend_compiles": 0, "piece_reuses": 0}},
            {"model": "opt", "phase": "cold", "status": "skipped", "reason": "budget"}]
    lines = coldwarm.goal_lines(rows)
    assert "- Llama-3-8B shape, cold start ≤ 15 s: not measured — FAILED: differs from eager" in lines
    assert "- Llama-3-8B shape, warm start ≤ 2 s: NOT MET — 2.50 s" in lines
    assert "| **FAILED** | differs from eager" in coldwarm.render({"rows": rows})
    # a warm phase that found nothing to load (its cold phase failed) compiled: no warm-start figure
    rows[1]["path"] = "cold"
    assert ("- Llama-3-8B shape, warm start ≤ 2 s: not measured — the warm phase compiled instead of loading "
            "(path 'cold'), 2.50 s") in coldwarm.goal_lines(rows)


def test_coldwarm_merge_compares_two_phases_within_one_run(tmp_path):
    """A merged report's line comparing two phases takes both from one run (another run's machine
    and load differ): the last ok row of each phase could come from two runs. Where no run measured
    both, the line is marked * with the two runs."""
    def row(phase, first_call_s, status="ok"):
        r = {"model": "opt", "phase": phase, "status": status, "reason": "" if status == "ok" else "budget"}
        if status == "ok":
            r.update(path="cold", first_call_s=first_call_s, static_s=1.5, import_s=1.0, build_s=1.0, process_s=9.0,
                     rel_err=0.01, dtype="float16", counters={})
        return r

    def run(name, *rows):
        path = tmp_path / f"{name}.json"
        common.write_json(path, {"benchmark": "coldwarm", "config": {}, "runs": [{"env": {}}], "rows": list(rows)})
        return str(path)

    a = run("a", row("cold", 8.0), row("cold, dynamic only", 5.0), row("cold, fork server at first call", 9.0))
    b = run("b", row("cold", 6.0), row("cold, dynamic only", None, "skipped"))
    assert coldwarm.main(["--merge", a, b, "-o", str(tmp_path / "m")]) == 0
    merged = common.read_json(tmp_path / "m.json")
    assert [r["run"] for r in merged["rows"]] == [0, 0, 0, 1, 1]
    lines = coldwarm.goal_lines(merged["rows"])
    assert "- OPT-125m shape: static compiles (compile_sizes='auto') add 3.00 s to the cold start (1.50 s of compiling)" in lines
    assert any("the first call took 9.00 s (default: 8.00 s)" in ln and "*" not in ln for ln in lines), lines
    c = run("c", row("cold, fork server at first call", 9.0), row("cold", None, "skipped"))
    d = run("d", row("cold", 6.0))
    assert coldwarm.main(["--merge", c, d, "-o", str(tmp_path / "n")]) == 0
    lines = coldwarm.goal_lines(common.read_json(tmp_path / "n.json")["rows"])
    assert any("took 9.00 s (default: 6.00 s) (* runs 0 and 1: not one run)" in ln for ln in lines), lines
    assert "| cold (run 1) |" in (tmp_path / "n.md").read_text()


# -- latency: the report module and the roofline --------------------------------------------------------


def test_latency_measuring_and_reporting_are_split(tmp_path):
    """latency.py measures; merging, goals, markdown and plots live in latency_report.py, which
    imports neither torch nor latency.py (``--merge`` and these tests need no GPU)."""
    for name in ("merge_payloads", "select", "ratios", "goal_lines", "render_markdown", "plot", "cell_text"):
        assert hasattr(rep, name) and not hasattr(lat, name), name
    text = (BENCH / "latency_report.py").read_text()
    assert "import torch" not in text and "import latency\n" not in text
    assert lat.COLUMNS is rep.COLUMNS and ltp.report is rep


@pytest.mark.parametrize("name", ["latency", "latency_opt", "latency_llama"])
def test_committed_latency_results_render_with_the_report(name):
    """The committed tables are what the report renders from the committed JSON (those runs predate
    the roofline: their floor is n/a and their cells carry no ratio)."""
    payload = common.read_json(BENCH / "results" / f"{name}.json")
    md = rep.render_markdown(payload)
    committed = (BENCH / "results" / f"{name}.md").read_text()
    rows = [ln for ln in committed.splitlines() if ln.startswith(("| decode |", "| mixed"))]
    assert rows and all(ln in md.splitlines() for ln in rows)
    assert all(ln.split(" | ")[4] == "n/a" for ln in rows)


#: Committed decode tables that hold a written analysis beside the rendered report (a comparison
#: of runs before it, or after it), which must still contain that report whole.
_COMPOSED_DECODE_TABLES = ("decode_inf_fix_S25-2", "decode_merge_S6")


@pytest.mark.parametrize("name", sorted(p.stem for p in (BENCH / "results").glob("decode_*.json")))
def test_committed_decode_attention_results_render_with_the_report(name):
    """Each committed table is what ``render_markdown`` makes of its committed JSON, with the
    plot's link ``write_outputs`` appends where the plot is committed: a table left as an earlier
    renderer wrote it (other goal lines, no kernel table or KV-waste section) would disagree with
    what re-running ``--merge`` makes."""
    payload = common.read_json(BENCH / "results" / f"{name}.json")
    assert payload["benchmark"] == "decode_attention"
    committed = (BENCH / "results" / f"{name}.md").read_text(encoding="utf-8")
    report = dec.render_markdown(payload)
    if name in _COMPOSED_DECODE_TABLES:
        assert report in committed
    elif (BENCH / "results" / f"{name}.png").exists():
        assert committed == report + f"\n![decode attention]({name}.png)\n"
    else:
        assert committed == report


def _roofline_payload():
    counts = {"weight_bytes": 170_000_000, "kv_bytes_per_token": 36_864, "layers": 12}
    runs = [{"label": "new", "copy_bandwidth": {"GBps": 4000.0}, "models": {"opt": counts}},
            {"label": "old run: no bandwidth recorded"}]
    rows = [_lat_row(0, "opt", "ca-full", 8, 600.0), _lat_row(0, "opt", "graph-eager", 8, 500.0),
            _lat_row(1, "opt", "eager", 64, 3000.0, context=4096)]
    mixed = lat.base_row("opt", lat.Cell("mixed", 8, 512, 248), "ca-full", 256)
    mixed.update(status="ok", p50_us=700.0, p90_us=710.0, p99_us=720.0)
    rows.append(mixed)
    return {"benchmark": "latency", "config": {}, "runs": runs, "rows": rows, "stats": [], "probes": []}, counts


def test_roofline_bytes_floor_and_column():
    payload, counts = _roofline_payload()
    # decode: weights + batch x (context + new token) x K/V bytes per token
    assert rep.step_bytes(counts, "decode", 8, 512, 0) == 170_000_000 + 8 * 513 * 36_864
    # mixed: the prefill sequence attends its own tokens
    assert rep.step_bytes(counts, "mixed", 8, 512, 248) == 170_000_000 + (8 * 513 + 248) * 36_864
    floor = (170_000_000 + 8 * 513 * 36_864) / 4000e9 * 1e6
    assert rep.floor_us(payload, payload["rows"][0]) == pytest.approx(floor)
    assert rep.floor_us(payload, payload["rows"][2]) is None  # its run has no bandwidth
    md = rep.render_markdown(payload)
    row = next(ln for ln in md.splitlines() if ln.startswith("| decode | 8 | 512 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[4] == f"{floor:.0f}"
    assert f"600 / 660 / 720 ({600 / floor:.1f}×)" in cells and f"500 / 550 / 600 ({500 / floor:.1f}×)" in cells
    old = next(ln for ln in md.splitlines() if ln.startswith("| decode | 64 | 4096 |"))
    assert old.split(" | ")[4] == "n/a" and "3000 / 3300 / 3600 |" in old
    mixed = next(ln for ln in md.splitlines() if ln.startswith("| mixed"))
    assert f"({700 / rep.floor_us(payload, payload['rows'][3]):.1f}×)" in mixed


def test_step_byte_counts_of_a_model():
    """Decoder-stack parameters without the gathered embedding tables; K/V bytes of one token over
    every layer's cache."""
    import compileattn as ca
    from compileattn.models.opt import OPTConfig, OPTForCausalLM

    model = OPTForCausalLM(OPTConfig.tiny(), dtype=torch.float16, device="cpu")
    caches = ca.allocate_kv_caches(model.attention_specs(), 4, 16, dtype=torch.float16, device="cpu")
    counts = lat.step_byte_counts(model, caches)
    m = model.model
    want = sum(p.numel() * 2 for p in m.layers.parameters()) + sum(p.numel() * 2 for p in m.final_layer_norm.parameters())
    spec = next(iter(model.attention_specs().values()))
    assert counts["weight_bytes"] == want and counts["layers"] == len(m.layers)
    assert counts["kv_bytes_per_token"] == len(m.layers) * 2 * spec.num_kv_heads * spec.head_dim * 2


def test_latency_baseline_comparison_marks_slower_rows(tmp_path):
    payload, _ = _roofline_payload()
    base = {"benchmark": "latency", "runs": [{"label": "committed", "env": {"time_utc": "then"}}],
            "rows": [_lat_row(0, "opt", "ca-full", 8, 500.0), _lat_row(0, "opt", "graph-eager", 8, 505.0),
                     _lat_row(0, "opt", "eager", 64, 1000.0, context=4096, status="FAILED")]}
    lines = "\n".join(rep.baseline_lines(payload, base))
    assert "2 rows measured in both" in lines and "1 row(s)" in lines
    assert "| ca-full | 500 | 600 | 1.20 **slower** |" in lines and "| graph-eager | 505 | 500 | 0.99 |" in lines
    pa, pb = tmp_path / "a.json", tmp_path / "base.json"
    common.write_json(pa, payload)
    common.write_json(pb, base)
    assert lat.main(["--merge", str(pa), "--baseline", str(pb), "-o", str(tmp_path / "m"), "--no-plot"]) == 0
    assert "## Against the baseline: committed (then)" in (tmp_path / "m.md").read_text()


def test_latency_plot_draws_the_floor(tmp_path):
    payload, _ = _roofline_payload()
    assert common.try_plot(tmp_path / "p.png", rep.plot(payload)) is None
    assert (tmp_path / "p.png").stat().st_size > 1000


# -- op_overhead: layouts, merge, after ÷ before ---------------------------------------------------------


def _old_op_payload():
    """The pre-redesign script's layout (benchmarks/results/op_overhead.json is one)."""
    res = lambda v, b, cpu, gpu=20.0: {"variant": v, "batch": b, "cpu_us": cpu, "cpu_us_min": cpu, "gpu_us": gpu,  # noqa: E731
                                       "loops_longer_than_sleep": 0}
    return {"meta": {"gpu": "NVIDIA H200", "cpu": "Xeon", "versions": {"torch": "2.11"}, "command": "python old.py",
                     "date": "d", "skipped": {"x": "why"},
                     "shape": {"heads": 64, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "block_size": 16,
                               "context": 1024, "batches": [1, 64]}},
            "results": [res(opr.EMPTY_ADD, 1, 10.0, 1.8), res(opr.EMPTY_ADD, 64, 10.0, 1.8),
                        res("op flash (kv=triton): attend_impl (piecewise, KV write captured)", 1, 12.0),
                        res("op flash (kv=triton): attend_impl (piecewise, KV write captured)", 64, 9.0),
                        res("op triton: attend_impl (piecewise, KV write captured)", 1, 80.0),
                        res("KV write: triton", 1, 30.0, 2.0), res("op flash (kv=torch): attention_impl", 1, 70.0)]}


def _new_op_payload():
    row = lambda v, b, cpu, status="ok", gpu=20.0: {"run": 0, "variant": v, "batch": b, "status": status,  # noqa: E731
                                                   "reason": "" if status == "ok" else "wrong", "cpu_us": cpu,
                                                   "gpu_us": gpu, "py_frames": 3, "loops_longer_than_sleep": 0}
    shape = {"heads": 64, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "block_size": 16, "context": 1024,
             "batches": [1, 64]}
    return {"benchmark": "op_overhead", "config": {"shape": shape},
            "runs": [{"label": "after", "env": {}, "skipped": {}, "frames": {opr.op_caller("triton"): ["a", "b"]}}],
            "rows": [row(opr.EMPTY_ADD, 1, 11.0, gpu=1.8), row(opr.EMPTY_ADD, 64, 10.0, gpu=1.8),
                     row(opr.op_caller("flash"), 1, 6.0), row(opr.op_caller("flash"), 64, 4.5),
                     row(opr.op_caller("triton"), 1, 40.0), row(opr.KV_TRITON, 1, None, status="FAILED")]}


def test_op_overhead_merge_old_and_new_layouts_with_ratios():
    merged = opr.merge_payloads([_old_op_payload(), _new_op_payload()], ["before: old", "after: new"])
    assert [r["label"] for r in merged["runs"]] == ["before: old", "after: new"]
    assert merged["config"]["shape"]["batches"] == [1, 64]
    comp = {(c["row"], c["batch"]): c for c in opr.comparison(merged)}
    assert comp[("flash op per layer, compiled runtime", 1)]["cpu_ratio"] == pytest.approx(0.5)
    assert comp[("flash op per layer, compiled runtime", 64)]["cpu_ratio"] == pytest.approx(0.5)
    assert comp[("triton op per layer, compiled runtime", 1)]["cpu_ratio"] == pytest.approx(0.5)
    assert comp[("control: empty torch.add launch", 1)]["cpu_ratio"] == pytest.approx(1.1)
    assert ("KV write: triton kernel", 1) not in comp  # FAILED after: no ratio
    assert not any(c["row"].startswith("KV write: torch") for c in comp.values())  # measured by neither
    md = opr.render_markdown(merged)
    assert "## After ÷ before: run 1 (after: new) ÷ run 0 (before: old)" in md
    assert "| flash op per layer, compiled runtime | 12.0 → 6.0 (0.50×) | 9.0 → 4.5 (0.50×) | 3 |" in md
    assert "**FAILED**" in md and "wrong" in md and "- x: why" in md
    assert "- op triton: attend_caller (compiled runtime, per layer): 2: `a` → `b`" in md
    with pytest.raises(ValueError, match="labels"):
        opr.merge_payloads([_old_op_payload()], ["a", "b"])
    other = _new_op_payload()
    other["config"]["shape"]["context"] = 4096
    with pytest.raises(ValueError, match="context=4096"):
        opr.merge_payloads([_old_op_payload(), other])


def test_op_overhead_goal_counts_a_batch_whose_setup_failed():
    """A batch whose setup failed leaves no row, only run["skipped"]["batch N"]: the host-cost goal
    (every batch) is then not measured, not MET on the batches left."""
    payload = _new_op_payload()
    payload["rows"] = [r for r in payload["rows"] if r["batch"] == 1]
    payload["rows"][-2]["cpu_us"] = 9.0  # triton at batch 1, under the goal
    payload["runs"][0]["skipped"] = {"batch 64": "setup failed: OutOfMemoryError: CUDA out of memory"}
    (g,) = opr.goal_records(payload)
    assert g["met"] is None and "1 batch(es) not measured" in g["measured"]
    payload["runs"][0]["skipped"] = {}
    assert opr.goal_records(payload)[0]["met"] is True


def test_op_overhead_merge_reads_a_cut_short_stdout(tmp_path):
    """The pre-redesign script writes its JSON at the end only; its printed rows stand in for it."""
    log = tmp_path / "before.log"
    log.write_text("some warning\nbatch   1  empty launch: torch.add (1 element)                         cpu   "
                   "11.02 µs  gpu     1.79 µs\nbatch   1  op flash (kv=triton): attend_impl (piecewise, KV write "
                   "captured) cpu   12.00 µs  gpu    19.46 µs\n| table | line |\n")
    after = tmp_path / "after.json"
    common.write_json(after, _new_op_payload())
    assert op.main(["--merge", str(log), str(after), "-o", str(tmp_path / "m"), "--no-plot"]) == 0
    saved = common.read_json(tmp_path / "m.json")
    assert saved["runs"][0]["layout"].startswith("stdout") and len(saved["rows"]) == 2 + 6
    assert "12.0 → 6.0 (0.50×)" in (tmp_path / "m.md").read_text()
    empty = tmp_path / "empty.log"
    empty.write_text("op_overhead: no CUDA device here\n")
    with pytest.raises(ValueError, match="no 'batch N"):
        opr.read_result(empty)


def test_op_overhead_reads_the_committed_pre_redesign_result(tmp_path):
    """The pre-redesign tree's own script wrote the S3-2 "before" run in its old layout."""
    payload = opr.read_result(BENCH / "results" / "op_overhead_before.json")
    assert payload["runs"][0]["layout"] == "meta/results" and len(payload["rows"]) == 60
    assert common.try_plot(tmp_path / "p.png", opr.plot(opr.merge_payloads([payload, _new_op_payload()]))) is None


# -- op_overhead: the measuring plumbing on the CPU --------------------------------------------------------


def _fake_timer(fn):
    fn()
    return {"cpu_us": 1.0, "cpu_us_min": 1.0, "gpu_us": 2.0, "loops_longer_than_sleep": 0}


cpu_interpreter = pytest.mark.skipif(torch.cuda.is_available(),
                                     reason="CPU interpreter plumbing (the GPU runs the script itself)")


@pytest.fixture
def op_cpu(monkeypatch):
    from compileattn.backends.triton import _mode

    _mode.sync_interpreter_mode()
    monkeypatch.setattr(op, "DEVICE", "cpu")
    monkeypatch.setattr(op, "DTYPE", "float32")  # the interpreter's bf16 dot is wrong (README)
    args = op.parse_args(["--batches", "2", "--context", "40", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
                          "--backends", "reference"])
    st = op.Setup(args, 2)
    return args, st


@cpu_interpreter
def test_op_overhead_variants_checked_counted_and_timed_on_cpu(op_cpu):
    """Every variant is checked before it is timed, its Python frames counted; without FlashAttention
    its rows are skipped with the reason."""
    args, st = op_cpu
    notes = {}
    variants, skipped = op.build_variants(args, st, notes)
    names = [v.name for v in variants]
    assert names[:2] == [opr.EMPTY_ADD, opr.EMPTY_TRITON] and opr.op_caller("reference") in names
    assert opr.KV_TRITON in names and opr.KV_TORCH in names
    for fa4_row in (opr.FA4_PUBLIC, opr.FA4_PREPARED, opr.op_caller("flash"), opr.UNHOISTED):
        assert fa4_row not in names and "not importable" in skipped[fa4_row]
    rows = {}
    for v in variants:
        row, chain = op.measure(v, st, _fake_timer, common.Budget(0))
        rows[v.name] = (row, chain)
        assert row["status"] == "ok", (v.name, row["reason"])
        assert row["cpu_us"] == 1.0 and row["batch"] == 2
    row, chain = rows[opr.op_caller("reference")]
    assert chain[0] == "compileattn/ops.py:attend_caller.<locals>.call_attend" and row["py_frames"] == len(chain)
    assert rows[opr.EMPTY_ADD][0]["py_frames"] == 0  # a C call, and the benchmark's own lambda is not counted
    assert rows[opr.KV_TORCH][1][0].endswith("prepare_torch_write.<locals>.write_indexed")


@cpu_interpreter
def test_op_overhead_never_times_a_wrong_variant(op_cpu):
    args, st = op_cpu
    timed = []

    def timer(fn):
        timed.append(fn)
        return _fake_timer(fn)

    wrong = op.Variant("attention into nothing", lambda: None, None,
                       op._attention_check(op._into(lambda: None, st.out), st.q.float()))
    row, _ = op.measure(wrong, st, timer, common.Budget(0))
    assert row["status"] == "FAILED" and "rel. error" in row["reason"] and not timed
    slots = st.step("reference")[0].slot_mapping
    no_write = op.Variant("a writer that writes nothing", lambda: None, None, op._kv_check(lambda: None, st, slots))
    row, _ = op.measure(no_write, st, timer, common.Budget(0))
    assert row["status"] == "FAILED" and "K/V" in row["reason"] and not timed

    def boom():
        raise RuntimeError("launch failed")

    row, _ = op.measure(op.Variant("crash", boom, None, None), st, timer, common.Budget(0))
    assert row["status"] == "error" and "launch failed" in row["reason"]
    row, _ = op.measure(op.Variant("late", lambda: None, None, None), st, timer, common.Budget(1e-9))
    assert row["status"] == "skipped" and not timed


# -- latency_tp.py ---------------------------------------------------------------------------------------


def _tp_row(bench, column, batch, p50, status="ok", **extra):
    return {"bench": bench, "tp": 1 if bench.endswith("tp1") else 2, "model": bench.split("-")[0], "kind": "decode",
            "batch": batch, "context": 1024, "prefill": 0, "tokens": batch, "padded_tokens": batch, "column": column,
            "status": status, "reason": "" if status == "ok" else "why", "p50_us": p50, "p90_us": p50, "p99_us": p50,
            **extra}


def test_latency_tp_report_ratios_goal_and_failures():
    rows = [_tp_row("llama8b-tp1", "ca-full", 1, 5000.0), _tp_row("llama8b-tp2", "ca-full", 1, 2800.0, rank1_p50_us=2790.0),
            _tp_row("llama8b-tp1", "ca-piecewise", 1, 5000.0), _tp_row("llama8b-tp2", "ca-piecewise", 1, 3500.0),
            _tp_row("llama70b-tp2", "ca-full", 1, None, status="skipped")]
    payload = {"rows": rows, "config": {"backend": "auto", "context": 1024}, "layers": {"llama8b-tp1": 32},
               "checks": [{"check": "8B eager TP=2 vs TP=1", "batch": 1, "rel_err": 0.02, "tolerance": 0.1, "ok": True}]}
    md = ltp.render_markdown(payload)
    lines = ltp.goal_lines(rows)
    assert "- ca-full: TP=2 2800 µs / TP=1 5000 µs = 0.56× at batch 1 — MET (goal ≤ 0.6×)." in lines
    assert "- ca-piecewise: TP=2 3500 µs / TP=1 5000 µs = 0.70× at batch 1 — NOT MET (goal ≤ 0.6×)." in lines
    assert any(ln.startswith("- reduce-overhead: not checked") for ln in lines)
    assert "(rank 1 p50 2790)" in md and "| 1 | 0.70 | 0.56 | — |" in md and "llama70b-tp2 ca-full — skipped" in md
    assert "32 layers, TP=1" in md and "0.02" in md


def test_latency_tp_merge_ranks_keeps_rank0_numbers_and_any_failure():
    ok0, ok1 = _tp_row("x-tp2", "ca-full", 1, 100.0), _tp_row("x-tp2", "ca-full", 1, 90.0)
    merged = ltp.merge_ranks([ok0, ok1])
    assert merged["p50_us"] == 100.0 and merged["rank1_p50_us"] == 90.0 and merged["status"] == "ok"
    bad = ltp.merge_ranks([ok0, _tp_row("x-tp2", "ca-full", 1, None, status="FAILED")])
    assert bad["status"] == "FAILED" and bad["reason"] == "rank 1: why"


def test_latency_tp_quick_args():
    a = ltp.parse_args(["--quick"])
    assert a.batches == [1, 8] and a.benches == ["llama8b-tp1", "llama8b-tp2"] and "reduce-overhead" not in a.columns


def test_latency_tp_merge_takes_measured_rows_over_skipped(tmp_path):
    first = {"benchmark": "latency_tp", "config": {}, "checks": [], "stats": [], "layers": {"llama8b-tp1": 32},
             "rows": [_tp_row("llama8b-tp1", "ca-full", 1, 5000.0),
                      _tp_row("llama8b-tp1", "reduce-overhead", 1, None, status="skipped")]}
    second = {"benchmark": "latency_tp", "config": {}, "checks": [], "stats": [],
              "rows": [_tp_row("llama8b-tp1", "reduce-overhead", 1, 5200.0)]}
    merged = ltp.merge_payloads([first, second])
    by = {k[:2]: r for k, r in ltp.shown(merged["rows"]).items()}
    assert by[("llama8b-tp1", "reduce-overhead")]["p50_us"] == 5200.0 and len(by) == 2
    assert [r["run"] for r in merged["rows"]] == [0, 0, 1]  # every run's rows, each with its run
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    common.write_json(pa, first)
    common.write_json(pb, second)
    assert ltp.main(["--merge", str(pa), str(pb), "-o", str(tmp_path / "m"), "--no-plot"]) == 0
    assert "5200 / 5200 / 5200" in (tmp_path / "m.md").read_text()
    with pytest.raises(ValueError, match="not a latency_tp result"):
        ltp.merge_payloads([{"benchmark": "latency", "rows": []}])


def test_latency_tp_ratio_and_goal_pair_tp1_and_tp2_within_one_run():
    """TP=2 ÷ TP=1 divides two p50s of one run: the first ok row of each bench can come from two
    runs (another run's clocks). A ratio no run measured both sides of is marked * and is neither
    MET nor NOT MET."""
    def run(*rows):
        return {"benchmark": "latency_tp", "config": {}, "checks": [], "stats": [], "rows": list(rows)}

    merged = ltp.merge_payloads([run(_tp_row("llama8b-tp1", "ca-full", 1, 5000.0),
                                     _tp_row("llama8b-tp2", "ca-full", 1, None, status="skipped")),
                                 run(_tp_row("llama8b-tp1", "ca-full", 1, 4000.0),
                                     _tp_row("llama8b-tp2", "ca-full", 1, 2800.0))])
    lines = ltp.goal_lines(merged["rows"])
    assert "- ca-full: TP=2 2800 µs / TP=1 4000 µs = 0.70× at batch 1 — NOT MET (goal ≤ 0.6×)." in lines, lines
    md = ltp.render_markdown(merged)
    assert "| 1 | — | 0.70 | — |" in md and "llama8b-tp2 ca-full — skipped" not in md
    crossed = ltp.merge_payloads([run(_tp_row("llama8b-tp1", "ca-full", 1, 5000.0)),
                                  run(_tp_row("llama8b-tp2", "ca-full", 1, 2800.0))])
    line = next(ln for ln in ltp.goal_lines(crossed["rows"]) if ln.startswith("- ca-full"))
    assert "0.56×*" in line and "MET" not in line, line
    assert "| 1 | — | 0.56* | — |" in ltp.render_markdown(crossed)


def test_concat_runs_keeps_every_row_and_refuses_another_benchmark():
    a = {"benchmark": "throughput", "environment": {"run": 1}, "config": {"x": 1}, "rows": [{"r": 1}]}
    b = {"benchmark": "throughput", "environment": {"run": 2}, "config": {"x": 2}, "rows": [{"r": 2}, {"r": 3}]}
    merged = common.concat_runs([a, b], "throughput")
    assert merged["rows"] == [{"r": 1, "run": 0}, {"r": 2, "run": 1}, {"r": 3, "run": 1}]
    assert merged["runs"] == [{"run": 1}, {"run": 2}]
    again = common.concat_runs([merged, a], "throughput")  # a merged report merges as its runs
    assert [r["run"] for r in again["rows"]] == [0, 1, 1, 2] and len(again["runs"]) == 3
    with pytest.raises(ValueError, match="input 1 is not a throughput.py result"):
        common.concat_runs([a, {"benchmark": "latency", "rows": []}], "throughput")


def test_throughput_goal_pairs_its_columns_within_one_run():
    """A merged report's speed-up divides one run's compileattn by the same run's transformers:
    the last row of each column could come from two runs (a later run's skipped column also hid
    an earlier run's measured pair). Where no run measured both, the speed-up is marked * and
    has no verdict."""
    def run(ca, hf):
        rows = [{"model": "opt", "column": c, "status": "ok" if tps else "skipped", "output_tokens_per_s": tps}
                for c, tps in (("ca-full", ca), ("hf-cb", hf)) if tps is not False]
        return {"benchmark": "throughput", "environment": {}, "config": {}, "rows": rows}

    speedup = [ln for ln in tp.goal_lines(common.concat_runs([run(900, 100), run(None, 100)], "throughput"))
               if "continuous batching" in ln]
    assert speedup and "9.0×" in speedup[0], speedup
    crossed = tp.goal_lines(common.concat_runs([run(900, False), run(False, 10)], "throughput"))
    line = next(ln for ln in crossed if "continuous batching" in ln)
    assert "90.0×* — not checked (ca-full run 0, hf-cb run 1: not one run)" in line and "MET" not in line, crossed
    never = tp.goal_lines(common.concat_runs([run(900, None), run(None, False)], "throughput"))
    assert any("not measured (ca-full skipped, hf-cb None)" in ln for ln in never), never


def test_prefix_sharing_on_off_ratio_pairs_one_run():
    """A merged report's caching on ÷ off divides two modes of one run (the last run that measured
    both): a later run's skipped mode hid an earlier run's pair. Where no run measured both, the
    ratio is marked * as across runs."""
    def mode(name, elapsed, status="ok"):
        if status != "ok":
            return {"mode": name, "status": status, "reason": "why"}
        return {"mode": name, "status": "ok", "reason": None, "elapsed_s": elapsed, "output_tokens_per_s": 1000 / elapsed,
                "step": {"p50_us": 1e3, "p90_us": 2e3, "p99_us": 100 * elapsed, "max_us": 4e3}, "hit_rate": 0.5}

    def run(off, on):
        return {"benchmark": "prefix_sharing", "config": {}, "environment": {}, "rows": [off, on]}

    merged = common.concat_runs([run(mode("off", 10.0), mode("on", 5.0)),
                                 run(mode("off", 12.0), mode("on", None, "skipped"))], "prefix_sharing")
    md = ps.render_markdown(merged)
    assert "Caching on ÷ off (run 0): total time 0.50×, output tokens/s 2.00×, step p99 0.50×." in md, md
    assert "| off (run 1) |" in md
    crossed = common.concat_runs([run(mode("off", None, "skipped"), mode("on", 5.0)),
                                  run(mode("off", 20.0), mode("on", None, "FAILED"))], "prefix_sharing")
    md = ps.render_markdown(crossed)
    assert "total time 0.25×*" in md and "No run measured both modes: on is run 0's, off run 1's" in md, md


def test_run_pair_takes_the_latest_run_that_measured_enough():
    def row(run, side, v=1.0, status="ok"):
        return {"run": run, "side": side, "v": v, "status": status}

    sides = {s: (lambda r, s=s: r["side"] == s) for s in ("a", "b", "c")}
    rows = [row(0, "a", 1), row(0, "b", 2), row(1, "a", 3), row(1, "c", 4), row(1, "a", 5), row(2, "b", 6, "skipped")]
    picked, same = common.run_pair(rows, sides, lambda names: "a" in names and bool(names & {"b", "c"}))
    assert same and {k: r["v"] for k, r in picked.items()} == {"a": 5, "c": 4}
    picked, same = common.run_pair(rows, {k: sides[k] for k in ("a", "b")})
    assert same and (picked["a"]["v"], picked["b"]["v"]) == (1, 2)
    assert common.run_pair(rows, sides) == ({"a": rows[4], "b": rows[1], "c": rows[3]}, False)
    assert common.run_pair(rows[:1], {k: sides[k] for k in ("a", "b")}) is None


# One scenario per line: the runs (each a list of (side, value), None for a skipped side), then the
# ratio a ÷ b the reports must show and whether it is from one run.
PAIR_SCENARIOS = {
    "the latest run that measured both wins": ([[("a", 300), ("b", 100)], [("a", 500), ("b", 100)]], 5.0, True),
    "within a run, the last row of each side": ([[("a", 300), ("b", 100), ("a", 600)]], 6.0, True),
    "a later run of one side does not pair": ([[("a", 300), ("b", 100)], [("a", 700)]], 3.0, True),
    "a skipped side is not measured": ([[("a", 300), ("b", 100)], [("a", 800), ("b", None)]], 3.0, True),
    "the latest of several pairs": ([[("a", 300), ("b", 100)], [("a", 400), ("b", 200)], [("b", 800)]], 2.0, True),
    "no run measured both: latest of each, *": ([[("a", 900)], [("b", 100)], [("a", 300)], [("b", 200)]], 1.5, False),
}


def _pair_latency_report(runs):
    rows = [_lat_row(i, "opt", {"a": "ca-full", "b": "graph-eager"}[side], 1, v, "ok" if v else "skipped")
            for i, run in enumerate(runs) for side, v in run]
    rt = rep.ratios(rep.select(rows), ("opt", "decode", 1, 512, 0), rows)
    return rt["full_vs_best_graph"], "full_vs_best_graph" not in rt["cross_run"]


def _pair_latency_tp(runs):
    rows = [{**_tp_row({"a": "llama8b-tp2", "b": "llama8b-tp1"}[side], "ca-full", 1, v, "ok" if v else "skipped"),
             "run": i} for i, run in enumerate(runs) for side, v in run]
    one, two, same = ltp.pair(rows, "llama8b-tp1", "llama8b-tp2", "ca-full", 1)
    return two / one, same


def _pair_throughput(runs):
    import re

    rows = [{"model": "opt", "column": {"a": "ca-full", "b": "hf-cb"}[side], "status": "ok" if v else "skipped",
             "output_tokens_per_s": v, "run": i} for i, run in enumerate(runs) for side, v in run]
    line = next(ln for ln in tp.goal_lines({"rows": rows}) if "continuous batching" in ln)
    x, star = re.search(r": ([0-9.]+)×(\*?) — ", line).groups()
    assert ("MET" in line) == (not star), line  # a ratio across runs has no verdict
    return float(x), not star


def _pair_prefix_sharing(runs):
    rows = [{"mode": {"a": "on", "b": "off"}[side], "status": "ok" if v else "skipped", "elapsed_s": v, "run": i}
            for i, run in enumerate(runs) for side, v in run]
    on, off, same = ps.on_off_pair(rows)
    return on["elapsed_s"] / off["elapsed_s"], same


def _pair_coldwarm(runs):
    phases = {"a": "cold", "b": "cold, dynamic only"}
    rows = [{"model": "opt", "phase": phases[side], "status": "ok" if v else "skipped", "first_call_s": v, "run": i}
            for i, run in enumerate(runs) for side, v in run]
    a, b, mark = coldwarm.phase_pair(rows, "opt", phases["a"], phases["b"])
    assert mark == ("" if a["run"] == b["run"] else f" (* runs {a['run']} and {b['run']}: not one run)")
    return a["first_call_s"] / b["first_call_s"], not mark


@pytest.mark.parametrize("scenario", PAIR_SCENARIOS)
@pytest.mark.parametrize("report", [_pair_latency_report, _pair_latency_tp, _pair_throughput, _pair_prefix_sharing,
                                    _pair_coldwarm], ids=lambda f: f.__name__.removeprefix("_pair_"))
def test_every_report_pairs_two_measurements_by_one_rule(report, scenario):
    """Every report that divides two measurements of one cell picks them alike (``common.run_pair``):
    the latest run that measured both, the last row of each side within it; a side only one run
    measured never pairs with another run's other side, except as a ratio marked * (no verdict)."""
    runs, ratio, same_run = PAIR_SCENARIOS[scenario]
    got, same = report(runs)
    assert (got, same) == (pytest.approx(ratio), same_run)


def test_bench_commit_names_the_tree(monkeypatch):
    monkeypatch.setenv("BENCH_COMMIT", "abc123")
    assert common.git_commit() == "abc123 (BENCH_COMMIT)"


# -- piecewise_gaps: the gap analysis on synthetic events ---------------------------------------------


def test_gap_analysis_overlaps_gaps_and_order():
    # out of order, with an overlap (b inside a's tail) and a kernel fully inside another (c in a)
    evs = [("k3", 40.0, 5.0), ("a", 0.0, 10.0), ("b", 8.0, 4.0), ("c", 2.0, 1.0),
           ("k2", 13.0, 20.0)]
    r = pg.analyze_step(evs, gap_us=2.0, top=3)
    assert r["kernels"] == 5 and r["events"] == 5
    assert r["kernel_sum_us"] == pytest.approx(40.0)
    assert r["span_us"] == pytest.approx(45.0)
    # busy union: [0,12] + [13,33] + [40,45] = 37
    assert r["busy_union_us"] == pytest.approx(37.0) and r["idle_us"] == pytest.approx(8.0)
    assert r["gaps"] == 2 and r["gaps_over"] == 1 and r["gaps_over_us"] == pytest.approx(7.0)
    big, small = r["largest"]
    # the gap after the event that finished last (b, not a), before the next to start
    assert (big["before"], big["after"], big["us"], big["at_us"]) == ("k2", "k3", pytest.approx(7.0), pytest.approx(33.0))
    assert (small["before"], small["after"], small["us"]) == ("b", "k2", pytest.approx(1.0))
    assert r["largest"] == pg.analyze_step(list(reversed(evs)), top=3)["largest"]  # input order does not matter
    assert pg.analyze_step([])["span_us"] == 0.0 and pg.analyze_step([("x", 5.0, 2.0)])["idle_us"] == 0.0
    with pytest.raises(ValueError):
        pg.analyze_step([("x", 0.0, -1.0)])


def test_gap_analysis_boundaries_host_wait_and_memcpy():
    E = pg.GpuEvent
    evs = [E("g0.k0", 0.0, 5.0, "kernel", 1, "cudaGraphLaunch", -20.0),
           E("g0.k1", 8.0, 5.0, "kernel", 1, "cudaGraphLaunch", -20.0),  # 3 µs inside one replay
           E("attn", 23.0, 10.0, "kernel", 2, "cuLaunchKernel", 20.0),  # 10 µs gap, 7 of them host wait
           E("copy", 34.0, 1.0, "memcpy", 3, "cudaMemcpyAsync", 0.0),
           E("g1.k0", 40.0, 5.0, "kernel", 4, "cudaGraphLaunch", 10.0)]  # launched long before: no wait
    r = pg.analyze_step(evs, gap_us=2.0)
    assert (r["kernels"], r["memcpy"]) == (4, 1) and r["kernel_sum_us"] == pytest.approx(25.0)
    assert r["busy_sum_us"] == pytest.approx(26.0) and r["idle_us"] == pytest.approx(19.0)
    by = r["by_boundary"]
    assert by["in-graph"]["us"] == pytest.approx(3.0)
    assert by["graph->eager"]["us"] == pytest.approx(10.0) and by["graph->eager"]["host_wait_us"] == pytest.approx(7.0)
    assert by["eager->eager"]["us"] == pytest.approx(1.0) and by["eager->eager"]["over"] == 0
    assert by["eager->graph"]["us"] == pytest.approx(5.0) and by["eager->graph"]["host_wait_us"] == 0.0
    assert r["host_wait_us"] == pytest.approx(7.0) and r["gaps_over"] == 3
    agg = pg.aggregate_steps([r, pg.analyze_step(evs)], gap_us=2.0)
    assert agg["steps"] == 2 and agg["idle_us"] == pytest.approx(19.0)
    top = agg["top_gaps"][0]
    assert (top["boundary"], top["before"], top["after"], top["per_step"]) == ("graph->eager", "g0.k1", "attn", 1.0)
    assert top["us_per_step"] == pytest.approx(10.0) and top["host_wait_us_per_step"] == pytest.approx(7.0)
    assert list(agg["by_boundary"])[0] == "graph->eager"


def test_gap_analysis_reads_a_chrome_trace_by_correlation():
    def x(cat, name, ts, dur, corr=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {} if corr is None else {"correlation": corr}}

    trace = {"traceEvents": [
        x("user_annotation", "gaps_step_3", 100.0, 50.0), x("user_annotation", "gaps_step_2", 0.0, 50.0),
        x("user_annotation", "ProfilerStep#2", 0.0, 60.0),
        x("cuda_runtime", "cudaGraphLaunch", 1.0, 3.0, 7), x("cuda_runtime", "cudaLaunchKernel", 5.0, 2.0, 8),
        x("cuda_runtime", "cudaGraphLaunch", 101.0, 3.0, 9),
        x("kernel", "void gemm(int)", 10.0, 5.0, 7), x("kernel", "relu", 16.0, 2.0, 7),
        x("kernel", "attn", 20.0, 4.0, 8), x("gpu_memset", "Memset", 25.0, 1.0, None),
        # launched in step 3's range, so step 3's even though the GPU starts it late
        x("kernel", "gemm2", 152.0, 3.0, 9), {"ph": "i", "name": "instant", "ts": 1.0},
        # a corrupt head record: launched in step 2, timestamp far before its launch call
        x("cuda_runtime", "cudaLaunchKernel", 30.0, 2.0, 10), x("kernel", "bogus", -1e8, 2.0, 10)]}
    steps, extra = pg.step_events_from_trace(trace)
    assert extra["dropped"] == [1, 0] and extra["window_us"] == [50.0, 50.0]
    assert [[e.name for e in s] for s in steps] == [["void gemm(int)", "relu", "attn", "Memset"], ["gemm2"]]
    gemm = steps[0][0]
    assert (gemm.api, gemm.launch, gemm.launch_start_us, gemm.kind) == ("cudaGraphLaunch", 7, 1.0, "kernel")
    assert steps[0][3].launch is None and steps[0][3].kind == "memset"
    assert extra["launch_calls"] == [{"cudaGraphLaunch": 1, "cudaLaunchKernel": 2}, {"cudaGraphLaunch": 1}]
    assert pg.median_calls(extra["launch_calls"]) == {"cudaGraphLaunch": 1, "cudaLaunchKernel": 1}
    r = pg.analyze_step(steps[0])
    assert r["by_boundary"]["graph->eager"]["us"] == pytest.approx(2.0) and r["kernels"] == 3
    assert not pg.graph_kernels_missing(steps, {"cudaGraphLaunch": 1})
    no_kernels = [[e for e in s if e.api != "cudaGraphLaunch"] for s in steps]
    assert pg.graph_kernels_missing(no_kernels, {"cudaGraphLaunch": 1})
    assert pg.short_name("void at::native::kernel<float, (int)2>(Foo<int>, int)") == "at::native::kernel<float, (int)2>"


def test_piecewise_gaps_report_and_args(tmp_path):
    a = pg.parse_args([])
    assert (a.batches, a.context, a.steps, a.backend, a.budget_s) == ([1, 8], 512, 50, "flash", 90.0)
    assert (a.model, a.llama_layers) == ("opt", None)
    assert a.columns == list(pg.COLUMNS)
    b = pg.parse_args(["--model", "llama", "--llama-layers", "4"])
    assert (b.model, b.llama_layers) == ("llama", 4)
    with pytest.raises(SystemExit):
        pg.parse_args(["--columns", "eager"])
    with pytest.raises(SystemExit):
        pg.parse_args(["--model", "gpt2"])
    evs = [("a", 0.0, 10.0, "kernel", 1, "cudaGraphLaunch", -5.0), ("b", 30.0, 5.0, "kernel", 2, "cuLaunchKernel", 25.0)]
    prof = pg.aggregate_steps([pg.analyze_step(evs)])
    row = {"column": "ca-piecewise", "batch": 1, "context": 512, "status": "ok", "mode": "kernels",
           "wall": {"p50_us": 600.0}, "traced_wall_p50_us": 700.0, "dropped_gpu_events": 1, "pipelined_gpu_us": 520.0, "pipelined_host_us": 400.0,
           "launch_calls_per_step": {"cudaGraphLaunch": 13, "cuLaunchKernel": 12}, "profile": prof}
    ref = dict(row, column="graph-inductor", wall={"p50_us": 510.0}, profile=pg.aggregate_steps([pg.analyze_step(evs[:1])]))
    payload = {"benchmark": "piecewise_gaps", "environment": common.environment(["x"]),
               "config": {"batches": [1], "context": 512, "gap_us": 2.0},
               "rows": [row, ref, {"column": "ca-full", "batch": 1, "context": 512, "status": "skipped", "reason": "budget"}]}
    md = pg.write_outputs(payload, str(tmp_path / "g"))
    assert "Minus graph-inductor" in md and "graph->eager" in md and "| ca-full | 1 | skipped |" in md
    assert "| ca-piecewise | 1 | +90.0 |" in md and "No gaps" in md and "1 GPU events with impossible" in md
    assert common.read_json(tmp_path / "g.json")["rows"][0]["profile"]["kernels"] == 2
    assert md.startswith("# Piecewise decode step: where the GPU time goes (OPT-125m shape, float16")
    llama = pg.markdown(dict(payload, config=dict(payload["config"], model="llama")))
    assert llama.startswith("# Piecewise decode step: where the GPU time goes (Llama-3-8B shape, bfloat16")
    four = pg.markdown(dict(payload, config=dict(payload["config"], model="llama", llama_layers=4)))
    assert four.startswith("# Piecewise decode step: where the GPU time goes (Llama-3-8B shape with 4 layers, ")



def test_latency_tables_show_the_rows_their_ratios_divide():
    """Where two runs measured a cell, the table shows the latest run's p50s, the ones its ratio
    divides (``common.run_pair``), not an earlier run's beside a later run's ratio."""
    rows = [_lat_row(0, "opt", "graph-eager", 1, 500), _lat_row(0, "opt", "ca-full", 1, 520),
            _lat_row(1, "opt", "graph-eager", 1, 400), _lat_row(1, "opt", "ca-full", 1, 404),
            _lat_row(2, "opt", "ca-full", 1, None, status="FAILED")]
    chosen = rep.select(rows)
    assert chosen[("opt", "decode", 1, 512, 0, "ca-full")]["run"] == 1  # an ok row over a later failure
    assert chosen[("opt", "decode", 1, 512, 0, "graph-eager")]["run"] == 1
    assert rep.ratios(chosen, ("opt", "decode", 1, 512, 0), rows)["full_vs_best_graph"] == pytest.approx(1.01)
    tp_rows = [{"bench": "tp1", "column": "ca-full", "batch": 1, "status": "ok", "p50_us": 900.0, "run": 0},
               {"bench": "tp1", "column": "ca-full", "batch": 1, "status": "ok", "p50_us": 800.0, "run": 1}]
    assert ltp.shown(tp_rows)[("tp1", "ca-full", 1)]["p50_us"] == 800.0
    assert ltp._p50(tp_rows, "tp1", "ca-full", 1) == 800.0
