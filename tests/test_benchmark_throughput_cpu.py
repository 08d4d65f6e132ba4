"""benchmarks/throughput.py without a GPU: arguments, the no-CUDA exit, and its plumbing (checks,
compileattn and transformers columns, report, merge) on a tiny model on the CPU. No timing is
asserted."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import common  # noqa: E402
from hf_families import tiny_llama  # noqa: E402
import throughput as tp  # noqa: E402


def test_args_defaults_quick_and_bad_values():
    a = tp.parse_args([])
    assert (a.num_prompts, a.input_len, a.output_len, a.columns) == (1000, (128, 512), (128, 512), tp.COLUMNS)
    q = tp.parse_args(["--quick"])
    assert (q.num_prompts, q.output_len) == (100, (128, 256))
    for argv in (["--columns", "vllm"], ["--num-prompts", "0"], ["--input-len", "5:2"], ["--kv-gib", "0"]):
        with pytest.raises(SystemExit):
            tp.parse_args(argv)


def tiny(name=None, layers=None):  # throughput.build_model's signature
    return tiny_llama()


def test_teacher_forced_check_accepts_greedy_tokens_and_rejects_others():
    model = tiny()
    prompt = list(range(3, 20))
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    greedy = greedy[0, len(prompt):].tolist()
    assert tp.teacher_forced_greedy(model, [prompt], [greedy]) == 1.0
    with torch.no_grad():
        logits = model(torch.tensor([prompt + greedy[:-1]])).logits[0, -1]
    worst = int(logits.argmin())  # far from any tie
    assert tp.teacher_forced_greedy(model, [prompt], [greedy[:-1] + [worst]]) == 5 / 6


def test_plumbing_on_a_tiny_cpu_model(monkeypatch, tmp_path):

    monkeypatch.setattr(tp, "DEVICE", "cpu")
    monkeypatch.setattr(tp, "build_model", tiny)
    args = tp.parse_args(["--models", "llama8b", "--columns", "ca-eager,hf-cb", "--num-prompts", "5",
                          "--input-len", "4:12", "--output-len", "3:6", "--check-tokens", "4", "--kv-gib", "0.01",
                          "--max-num-batched-tokens", "32", "--no-floor"])
    rows = []
    tp.run_model("llama8b", args, common.Budget(0), common.Log(), rows)
    by = {r["column"]: r for r in rows}
    assert by["ca-eager"]["status"] == "ok" and by["ca-eager"]["check_rel_err"] < 1e-4
    assert by["ca-eager"]["num_requests"] == 5 and by["ca-eager"]["output_tokens"] >= 15
    assert by["hf-cb"]["status"] == "ok" and by["hf-cb"]["check_token_agreement"] == 1.0
    assert by["hf-cb"]["check_greedy_fraction"] == 1.0
    assert by["hf-cb"]["output_tokens"] == by["ca-eager"]["output_tokens"]  # same workload, full lengths
    payload = {"benchmark": "throughput", "config": vars(args), "rows": rows}
    md = tp.render_markdown(payload)
    assert "Goal check" in md and "ca-eager" in md and "sdpa" in by["hf-cb"]["attention"]  # paged by transformers itself
    common.write_json(tmp_path / "a.json", payload)
    assert tp.main(["--merge", str(tmp_path / "a.json"), "-o", str(tmp_path / "m"), "--no-plot"]) == 0
    assert len(common.read_json(tmp_path / "m.json")["rows"]) == 2


def test_a_wrong_column_is_failed_not_timed(monkeypatch):
    """The logits check gates timing: an engine whose logits are off is reported FAILED."""
    rows = {"status": "skipped"}
    monkeypatch.setattr(tp, "DEVICE", "cpu")
    monkeypatch.setattr(tp, "engine_logits", lambda llm, prompts, count: [torch.ones(count, 8) * 3] * len(prompts))
    monkeypatch.setattr(tp, "ca_llm", lambda *a, **k: object())
    checks = ([[1, 2]], [torch.ones(4, 8)])
    args = tp.parse_args(["--check-tokens", "4", "--no-floor"])
    tp.run_ca_column(None, "ca-eager", None, checks, args, common.Budget(0), common.Log(), rows)
    assert rows["status"] == "FAILED" and "logits differ" in rows["reason"]
