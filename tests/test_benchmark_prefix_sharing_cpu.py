"""benchmarks/prefix_sharing.py without a GPU: arguments, the no-CUDA exit, and its plumbing (the
on/off check, timed runs from an empty cache, step times, hit rates, report, merge) on a tiny model
on the CPU. No timing is asserted."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import common  # noqa: E402
from hf_families import tiny_llama  # noqa: E402
import prefix_sharing as ps  # noqa: E402
import throughput as bench  # noqa: E402  (benchmarks/throughput.py)


def tiny(layers=None):  # prefix_sharing.build_model's signature
    return tiny_llama()


ARGS = ["--compile", "eager", "--num-requests", "5", "--prefix-len", "40", "--suffix-len", "2:6", "--output-len",
        "3:5", "--check-prompts", "3", "--check-tokens", "4", "--kv-gib", "0.01", "--max-num-batched-tokens", "64",
        "--repeats", "2", "--budget-s", "0", "--no-plot"]


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(ps, "build_model", tiny)


def test_args_defaults_quick_and_bad_values():
    a = ps.parse_args([])
    assert (a.num_requests, a.prefix_len, a.suffix_len, a.output_len, a.repeats, a.compile) == (
        64, 1024, (32, 128), (64, 128), 3, "full")
    q = ps.parse_args(["--quick"])
    assert (q.num_requests, q.repeats, q.check_prompts) == (32, 2, 2)
    for argv in (["--num-requests", "0"], ["--prefix-len", "0"], ["--suffix-len", "9:3"], ["--kv-gib", "0"],
                 ["--compile", "inductor"], ["--num-requests", "2", "--check-prompts", "3"]):
        with pytest.raises(SystemExit):
            ps.parse_args(argv)


def test_plumbing_on_a_tiny_cpu_model(on_cpu, tmp_path):
    assert ps.main([*ARGS, "--out", str(tmp_path / "a")]) == 0
    payload = common.read_json(tmp_path / "a.json")
    assert "error" not in payload
    check = payload["check"]
    assert check["problems"] == [] and check["token_agreement"] == 1.0 and check["hit_tokens"] > 0
    off, on = payload["rows"]
    assert (off["mode"], on["mode"]) == ("off", "on")
    assert off["status"] == on["status"] == "ok" and off["runs"] == on["runs"] == 2
    assert off["hit_rate"] == 0 and on["hit_rate"] > 0.3  # 2 of each prompt's 2-3 blocks, from the second on
    assert on["tokens_computed_per_run"] < off["tokens_computed_per_run"]
    assert on["output_tokens"] == off["output_tokens"] >= 15  # same workload, full lengths
    for row in (off, on):
        assert row["step"]["steps"] == 2 * (row["steps_per_run"] - 1)  # every step but each run's first
        assert row["decode_step"]["steps"] + row["prefill_step"]["steps"] == row["step"]["steps"]
        assert row["step"]["p50_us"] <= row["step"]["p99_us"] <= row["step"]["max_us"]
    md = (tmp_path / "a.md").read_text()
    assert "Caching on ÷ off" in md and "p99" in md and "100% of tokens agree" in md
    assert ps.main(["--merge", str(tmp_path / "a.json"), "-o", str(tmp_path / "m"), "--no-plot"]) == 0
    assert len(common.read_json(tmp_path / "m.json")["rows"]) == 2


def test_wrong_hits_fail_the_check_and_caching_on_is_not_timed(on_cpu, monkeypatch, tmp_path):
    """A prefix cache that serves the wrong K/V (here: its first block in place of every hit)
    changes fp32 tokens: the check reports it and only caching off is timed."""
    from compileattn.engine.block_allocator import BlockAllocator

    lookup = BlockAllocator.lookup
    monkeypatch.setattr(BlockAllocator, "lookup", lambda self, *a, **k: [b for b in lookup(self, *a, **k)[:1]
                                                                          for _ in lookup(self, *a, **k)])
    assert ps.main([*ARGS, "--out", str(tmp_path / "w")]) == 0
    payload = common.read_json(tmp_path / "w.json")
    assert payload["check"]["problems"] and payload["check"]["hit_tokens"] > 0
    off, on = payload["rows"]
    assert off["status"] == "ok" and on["status"] == "FAILED" and "caching on" in on["reason"]
    assert "FAILED" in (tmp_path / "w.md").read_text()


def test_shared_prefix_workload():
    from compileattn.engine.throughput import shared_prefix_workload

    w = shared_prefix_workload(6, 10, (2, 5), (3, 4), vocab_size=50, seed=1)
    assert len(w.prompts) == len(w.output_lens) == 6
    assert all(p[:10] == w.prompts[0][:10] and 12 <= len(p) <= 15 for p in w.prompts)
    assert len({tuple(p[10:]) for p in w.prompts}) == 6 and all(3 <= n <= 4 for n in w.output_lens)
    assert w == shared_prefix_workload(6, 10, (2, 5), (3, 4), vocab_size=50, seed=1)
    for bad in (dict(prefix_len=0), dict(suffix_lens=(0, 3)), dict(output_lens=(5, 4))):
        kw = {**dict(num_requests=2, prefix_len=4, suffix_lens=(1, 2), output_lens=(1, 2), vocab_size=50), **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            shared_prefix_workload(**kw)
