"""The decode launch's autotuner (compileattn/backends/triton/autotune.py) on the CPU.

The kernels run under the Triton interpreter (tests/conftest.py), so the timings here are an
injected timer's: what these tests check is which candidates are tried, that only candidates
agreeing with the heuristic's output can win, that the winner is what later launches use, and the
cache. Whether a tuned launch is faster is the GPU's question (benchmarks/decode_attention.py).
"""
from __future__ import annotations

import json

import pytest
import torch

from compileattn.backends.reference import ReferenceBackend
from compileattn.backends.triton.autotune import CACHE_FILE, DecodeAutotuner, DecodeShape, candidates
from compileattn.backends.triton.backend import TritonBackend
from compileattn.backends.triton.config import MAX_SPLITS, DecodeConfig, Tuning

SHAPE = DecodeShape("cpu", 2, 4, 2, 32, 16, "torch.float32", "torch.float32", False)


def test_candidates_are_the_heuristic_then_one_step_in_each_knob():
    cfg = DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
    options = candidates(Tuning(), cfg, splits=4)
    assert options[0] == Tuning()
    assert options[1:] == [Tuning(decode_block_n=32), Tuning(decode_block_n=128), Tuning(decode_num_stages=2),
                           Tuning(decode_num_warps=8), Tuning(num_splits=2), Tuning(num_splits=8)]


def test_candidates_stay_within_bounds_and_do_not_repeat():
    edge = candidates(Tuning(), DecodeConfig(block_m=16, block_n=128, num_warps=8, num_stages=2), splits=MAX_SPLITS)
    assert Tuning(decode_block_n=256) not in edge and Tuning(num_splits=2 * MAX_SPLITS) not in edge
    assert Tuning(decode_num_stages=3) in edge and Tuning(decode_num_warps=4) in edge
    one = candidates(Tuning(), DecodeConfig(block_m=16, block_n=16, num_warps=4, num_stages=3), splits=1)
    assert Tuning(num_splits=0) not in one and Tuning(num_splits=2) in one and Tuning(decode_block_n=8) not in one
    assert len(one) == len(set(one))


def _fake_runs(outputs: dict[Tuning, object]):
    """run(tuning) for the tuner: each candidate's output (an exception is raised)."""
    def run(tuning):
        result = outputs[tuning]
        if isinstance(result, Exception):
            raise result
        return lambda: result
    return run


def test_the_fastest_candidate_that_agrees_with_the_heuristic_wins():
    a, b, c, d = Tuning(), Tuning(num_splits=2), Tuning(num_splits=4), Tuning(num_splits=8)
    x = torch.randn(8)
    speed = {id(x): 10.0}
    wrong, same, broken = x + 1, x.clone(), RuntimeError("no such config")
    speed[id(wrong)], speed[id(same)] = 1.0, 5.0
    tuner = DecodeAutotuner(timer=lambda call: speed[id(call())])
    chosen = tuner.tuning_for(SHAPE, [a, b, c, d], _fake_runs({a: x, b: wrong, c: same, d: broken}))
    assert chosen == c  # b is faster but computes something else; d does not run
    notes = {t.tuning: (t.us, t.note) for t in tuner.trials[SHAPE.key()]}
    assert notes[a] == (10.0, "") and notes[c] == (5.0, "") and notes[b][0] is None and notes[d][0] is None
    assert "differs" in notes[b][1] and "no such config" in notes[d][1]


def test_a_heuristic_that_cannot_run_is_an_error():
    tuner = DecodeAutotuner(timer=lambda call: 1.0)
    with pytest.raises(RuntimeError, match="broken"):
        tuner.tuning_for(SHAPE, [Tuning()], _fake_runs({Tuning(): RuntimeError("broken")}))


def test_choices_are_cached_in_a_private_directory(tmp_path):
    cache = tmp_path / "cache"
    runs = _fake_runs({Tuning(): torch.ones(4), Tuning(num_splits=2): torch.ones(4)})
    times = iter([2.0, 1.0])
    first = DecodeAutotuner(cache, timer=lambda call: next(times))
    assert first.tuning_for(SHAPE, [Tuning(), Tuning(num_splits=2)], runs) == Tuning(num_splits=2)
    assert (cache.stat().st_mode & 0o777) == 0o700
    stored = json.loads((cache / CACHE_FILE).read_text())
    assert stored[SHAPE.key()]["num_splits"] == 2

    def must_not_run(tuning):
        raise AssertionError("a cached choice is not timed again")

    later = DecodeAutotuner(cache, timer=lambda call: 0.0)
    base = Tuning(decode_tail_stages=1)  # the backend's own overrides survive a cached choice
    assert later.tuning_for(SHAPE, [base], must_not_run) == Tuning(decode_tail_stages=1, num_splits=2)


def test_an_unreadable_cache_file_is_ignored(tmp_path, caplog):
    tmp_path.chmod(0o700)
    (tmp_path / CACHE_FILE).write_text("{not json")
    tuner = DecodeAutotuner(tmp_path, timer=lambda call: 1.0)
    assert tuner.tuning_for(SHAPE, [Tuning()], _fake_runs({Tuning(): torch.ones(2)})) == Tuning()
    assert "ignoring unreadable" in caplog.text


def test_autotuning_off_cuda_needs_a_timer_and_a_context():
    with pytest.raises(ValueError, match="timer="):
        TritonBackend("cpu").enable_autotune()
    with pytest.raises(ValueError, match="context"):
        TritonBackend("cpu").enable_autotune(timer=lambda call: 1.0, context=0)


def _paged_decode(num_seqs=3, heads=4, kv_heads=2, head_dim=32, page=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([37, 5, 64][:num_seqs], dtype=torch.int32)
    pages = -(-int(lens.max()) // page)
    k = torch.randn(num_seqs * pages + 1, page, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(k.shape, generator=gen).to(dtype)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).to(dtype)
    table = (1 + torch.arange(num_seqs * pages, dtype=torch.int32)).view(num_seqs, pages)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32)
    return q, k, v, cu, lens, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_tuned_launch_computes_what_the_reference_does(dtype):
    """The tuner's winner (here the last candidate, by a timer that favours it) is what the
    decode path then runs, and it is right."""
    q, k, v, cu, lens, table = _paged_decode(dtype=dtype)
    backend = TritonBackend("cpu")
    order: list[int] = []

    def timer(call):
        order.append(len(order))
        return 100.0 - len(order)  # each candidate faster than the one before

    tuner = backend.enable_autotune(timer=timer, context=32)
    out = torch.empty_like(q)
    args = (cu, cu, lens, table, 1, int(lens.max()), 32 ** -0.5, True, -1, 0.0)
    backend.varlen_attention(q, k, v, out, *args)
    (key, trials), = tuner.trials.items()
    timed = [t for t in trials if t.us is not None]
    assert len(timed) >= 4 and key.startswith("cpu|3|4|2|32|16|")
    want = torch.empty_like(q)
    ReferenceBackend("cpu").varlen_attention(q, k, v, want, *args)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    assert tuner._chosen[key] == timed[-1].tuning


@pytest.mark.cuda
@pytest.mark.parametrize("num_seqs", [1, 64])
def test_cuda_autotuned_decode_is_timed_and_right(num_seqs):
    """On the GPU: real timings (CUDA events), no candidate disagreeing with the heuristic (that
    would be a kernel bug), the winner's output equal to the reference's in bf16."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, d, page = 32, 8, 128, 16
    lens = torch.randint(1, 600, (num_seqs,), generator=gen, device="cuda", dtype=torch.int32)
    pages = -(-int(lens.max()) // page)
    k = torch.randn(num_seqs * pages + 1, page, kv_heads, d, generator=gen, device="cuda").bfloat16()
    v = torch.randn(k.shape, generator=gen, device="cuda").bfloat16()
    q = torch.randn(num_seqs, heads, d, generator=gen, device="cuda").bfloat16()
    table = (1 + torch.arange(num_seqs * pages, dtype=torch.int32, device="cuda")).view(num_seqs, pages)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    args = (cu, cu, lens, table, 1, int(lens.max()), d ** -0.5, True, -1, 0.0)
    backend = TritonBackend("cuda")
    tuner = backend.enable_autotune(context=512)
    out = torch.empty_like(q)
    backend.varlen_attention(q, k, v, out, *args)
    (trials,) = tuner.trials.values()
    notes = [(t.tuning, t.note) for t in trials]
    assert trials[0].us > 0 and sum(t.us is not None for t in trials) >= 3, notes
    assert not [n for n in notes if "differs" in n[1]], notes  # a candidate computing something else is a bug
    want = torch.empty_like(q)
    ReferenceBackend("cuda").varlen_attention(q, k, v, want, *args)
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_agreement_ignores_non_finite_entries_only_where_the_heuristic_has_them():
    from compileattn.backends.triton.autotune import _close

    ref = torch.tensor([1.0, float("nan"), 3.0])
    assert _close(torch.tensor([1.0, float("nan"), 3.0]), ref, 1e-3)
    assert not _close(torch.tensor([1.0, 2.0, 3.0]), ref, 1e-3)
    assert not _close(torch.tensor([1.0, float("nan"), 3.5]), ref, 1e-3)
