"""The decode launch's autotuner (compileattn/backends/triton/autotune.py) on the CPU.

The kernels run under the Triton interpreter (tests/conftest.py), so the timings here are an
injected timer's: what these tests check is which candidates are tried, that only candidates
agreeing with the heuristic's output can win, that the winner is what later launches use, and the
cache. Whether a tuned launch is faster is the GPU's question (benchmarks/decode_attention.py).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from compileattn.backends.reference import ReferenceBackend
from compileattn.backends.triton.autotune import (CACHE_FILE, DEFAULT_CONTEXTS, MARGIN, WORST_SLOWDOWN, Candidate,
                                                  DecodeAutotuner, DecodeShape, candidates, summarize)
from compileattn.backends.triton.backend import TritonBackend
from compileattn.backends.triton.config import MAX_SPLITS, DecodeConfig, Tuning

SHAPE = DecodeShape("cpu", 2, 4, 2, 32, 16, "torch.float32", "torch.float32", False, False, "plain", Tuning())


def test_candidates_are_the_heuristic_then_one_step_in_each_knob():
    cfg = DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
    options = candidates(Tuning(), cfg, splits=4)
    assert options[0] == Tuning()
    assert options[1:] == [Tuning(decode_block_n=32), Tuning(decode_block_n=128), Tuning(decode_num_stages=2),
                           Tuning(decode_num_warps=8), Tuning(num_splits=2), Tuning(num_splits=8)]


def test_candidates_leave_the_backends_own_overrides_alone():
    cfg = DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
    forced = Tuning(num_splits=3, decode_num_warps=8)
    options = candidates(forced, cfg, splits=3)
    assert options[0] == forced and all(t.num_splits == 3 and t.decode_num_warps == 8 for t in options)
    assert len(options) == 4  # block_n x1/2, x2, the other stage count


def test_candidates_stay_within_bounds_and_do_not_repeat():
    edge = candidates(Tuning(), DecodeConfig(block_m=16, block_n=128, num_warps=8, num_stages=2), splits=MAX_SPLITS)
    assert Tuning(decode_block_n=256) not in edge and Tuning(num_splits=2 * MAX_SPLITS) not in edge
    assert Tuning(decode_num_stages=3) in edge and Tuning(decode_num_warps=4) in edge
    one = candidates(Tuning(), DecodeConfig(block_m=16, block_n=16, num_warps=4, num_stages=3), splits=1)
    assert Tuning(num_splits=0) not in one and Tuning(num_splits=2) in one and Tuning(decode_block_n=8) not in one


def _fake(outputs: dict[Tuning, object], after: dict[Tuning, object] | None = None):
    """prepare(tuning) for the tuner: each candidate's check output (an exception is raised);
    ``after``: a different output once it has been timed."""
    timed_once: set[Tuning] = set()

    def prepare(tuning):
        result = outputs[tuning]
        if isinstance(result, Exception):
            raise result

        def check():
            return after[tuning] if after and tuning in after and tuning in timed_once else result

        def timed(context, i):
            timed_once.add(tuning)

        return Candidate(check, timed)
    return prepare


def _timer(us: dict[Tuning, float | dict[int, float]], tunings, contexts=DEFAULT_CONTEXTS):
    """A timer that runs the call once and reports the time set for the candidate (and context)
    it belongs to: one number for every context, or one per context."""
    calls = iter([(t, c) for t in tunings for c in contexts])

    def timer(fn):
        fn(0)
        tuning, context = next(calls)
        return us[tuning][context] if isinstance(us[tuning], dict) else us[tuning]
    return timer


def _each(us: float) -> dict[int, float]:
    return {c: us for c in DEFAULT_CONTEXTS}


def test_the_fastest_candidate_that_agrees_with_the_heuristic_wins():
    a, b, c, d, e = Tuning(), Tuning(num_splits=2), Tuning(num_splits=4), Tuning(num_splits=8), Tuning(num_splits=16)
    x = torch.randn(8)
    tuner = DecodeAutotuner(timer=_timer({a: 10.0, c: 5.0, e: 1.0}, [a, c, e]))
    chosen = tuner.tuning_for(SHAPE, [a, b, c, d, e], _fake({a: x, b: x + 1, c: x.clone(), d: RuntimeError("no such config"),
                                                             e: x.clone()}, after={e: torch.full_like(x, float("nan"))}))
    assert chosen == c  # b computes something else; d does not run; e writes nothing once timed
    notes = {t.tuning: (t.us, t.note) for t in tuner.trials[tuner.key(SHAPE)]}
    assert notes[a] == (_each(10.0), "") and notes[c] == (_each(5.0), "")
    assert notes[b][0] is None and "differs" in notes[b][1] and notes[d][0] is None and "no such config" in notes[d][1]
    assert notes[e][0] is None and "after timing" in notes[e][1]


def test_a_candidate_within_the_margin_does_not_replace_the_heuristic():
    a, b = Tuning(), Tuning(num_splits=2)
    x = torch.randn(8)
    tuner = DecodeAutotuner(timer=_timer({a: 10.0, b: 10.0 * (1 - MARGIN / 2)}, [a, b]))
    assert tuner.tuning_for(SHAPE, [a, b], _fake({a: x, b: x.clone()})) == a


def test_one_choice_must_serve_every_context():
    """A graph replays one launch at every context: a candidate much faster at 1024 keys but
    slower at 4096 (more than WORST_SLOWDOWN) is not chosen; one a little faster at both is."""
    a, fast_short, even = Tuning(), Tuning(num_splits=16), Tuning(decode_num_stages=2)
    x = torch.randn(8)
    slower = 10.0 * (1 + 2 * WORST_SLOWDOWN)
    tuner = DecodeAutotuner(timer=_timer({a: 10.0, fast_short: {1024: 5.0, 4096: slower}, even: 9.5},
                                         [a, fast_short, even]))
    chosen = tuner.tuning_for(SHAPE, [a, fast_short, even], _fake({a: x, fast_short: x.clone(), even: x.clone()}))
    assert chosen == even
    trials = tuner.trials[tuner.key(SHAPE)]
    assert trials[1].ratio < trials[2].ratio  # the better mean, refused for its worst context
    line = summarize(trials, chosen)
    assert line.startswith("µs at 1024/4096 keys: heuristic 10.0/10.0, num_splits=16 5.0/10.2")
    assert line.endswith("; chosen decode_num_stages=2")


def test_contexts_are_capped_at_what_the_layer_cache_holds():
    """A context longer than the cache holds for every sequence (pages read twice in a call would
    come from L2) is timed at what it holds; repeats collapse; the key names what was timed."""
    tuner = DecodeAutotuner(timer=lambda fn: 1.0)
    assert tuner.timed_contexts(4) == (1024, 4096)
    assert tuner.timed_contexts(4, cache_blocks=4 * 4096 // 16, page=16) == (1024, 4096)
    assert tuner.timed_contexts(64, cache_blocks=64 * 1024 // 16, page=16) == (1024,)
    assert tuner.timed_contexts(3, cache_blocks=100, page=16) == (528,)  # 33 whole pages each
    assert tuner.key(SHAPE, (1024,)).endswith("|contexts=1024") and tuner.key(SHAPE) != tuner.key(SHAPE, (1024,))


def test_a_timer_without_a_time_and_missing_options_are_handled():
    a, b = Tuning(), Tuning(num_splits=2)
    x = torch.randn(8)
    tuner = DecodeAutotuner(timer=_timer({a: 10.0, b: 0.0}, [a, b]))
    assert tuner.tuning_for(SHAPE, [a, b], _fake({a: x, b: x.clone()})) == a
    assert "the timer gave" in tuner.trials[tuner.key(SHAPE)][1].note
    with pytest.raises(ValueError, match="options"):
        DecodeAutotuner(timer=lambda fn: 1.0).tuning_for(SHAPE, [], _fake({}))


def test_a_heuristic_failing_its_check_is_kept_and_not_tried_again():
    a, b = Tuning(), Tuning(num_splits=2)
    x = torch.randn(8)
    tuner = DecodeAutotuner(timer=_timer({a: 1.0, b: 1.0}, [a, b]))
    prepare = _fake({a: x, b: x.clone()}, after={a: torch.full_like(x, float("nan"))})
    assert tuner.tuning_for(SHAPE, [a, b], prepare) == a

    def must_not_run(tuning):
        raise AssertionError("tried again")

    assert tuner.tuning_for(SHAPE, [a, b], must_not_run) == a


def test_a_heuristic_that_cannot_run_is_an_error():
    tuner = DecodeAutotuner(timer=lambda fn: 1.0)
    with pytest.raises(RuntimeError, match="broken"):
        tuner.tuning_for(SHAPE, [Tuning()], _fake({Tuning(): RuntimeError("broken")}))


def test_choices_are_cached_in_a_private_directory(tmp_path):
    cache = tmp_path / "cache"
    a, b = Tuning(), Tuning(num_splits=2)
    first = DecodeAutotuner(cache, timer=_timer({a: 2.0, b: 1.0}, [a, b]))
    assert first.tuning_for(SHAPE, [a, b], _fake({a: torch.ones(4), b: torch.ones(4)})) == b
    assert (cache.stat().st_mode & 0o777) == 0o700
    stored = json.loads((cache / CACHE_FILE).read_text())
    (key, entry), = stored.items()
    assert key == first.key(SHAPE) and key.startswith("v2|triton ") and entry["num_splits"] == 2
    assert key.endswith("|contexts=1024,4096")

    def must_not_run(tuning):
        raise AssertionError("a cached choice is not timed again")

    later = DecodeAutotuner(cache, timer=lambda fn: 0.0)
    assert later.cached(SHAPE) == b and later.tuning_for(SHAPE, [a], must_not_run) == b
    other_base = dataclasses.replace(SHAPE, base=Tuning(decode_tail_stages=1))
    assert later.cached(other_base) is None  # the backend's own overrides are part of the key
    assert DecodeAutotuner(cache, contexts=(1024,), timer=lambda fn: 0.0).cached(SHAPE) is None  # and the contexts


_NONE = {"decode_block_n": None, "decode_num_warps": None, "decode_num_stages": None, "decode_tail_stages": None,
         "num_splits": None}


@pytest.mark.parametrize("entry", [{**_NONE, "decode_block_n": 48}, {**_NONE, "num_splits": 10 ** 6},
                                   {**_NONE, "decode_tail_stages": -1}, {"num_splits": 2}, "fast"])
def test_invalid_cache_entries_are_ignored(tmp_path, entry, caplog):
    tmp_path.chmod(0o700)
    (tmp_path / CACHE_FILE).write_text(json.dumps({DecodeAutotuner().key(SHAPE): entry}))
    assert DecodeAutotuner(tmp_path, timer=lambda fn: 1.0).cached(SHAPE) is None
    assert "invalid entry" in caplog.text


def test_an_unreadable_cache_file_is_ignored(tmp_path, caplog):
    tmp_path.chmod(0o700)
    (tmp_path / CACHE_FILE).write_text("{not json")
    tuner = DecodeAutotuner(tmp_path, timer=lambda fn: 1.0)
    assert tuner.tuning_for(SHAPE, [Tuning()], _fake({Tuning(): torch.ones(2)})) == Tuning()
    assert "ignoring unreadable" in caplog.text


def test_autotuning_off_cuda_needs_a_timer_and_contexts():
    with pytest.raises(ValueError, match="timer="):
        TritonBackend("cpu").enable_autotune()
    for bad in (0, (), (1024, -1)):
        with pytest.raises(ValueError, match="contexts"):
            TritonBackend("cpu").enable_autotune(timer=lambda call: 1.0, contexts=bad)


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

    def timer(fn):
        fn(0)
        order.append(len(order))
        return 100.0 / len(order)  # each candidate well faster than the one before

    tuner = backend.enable_autotune(timer=timer, contexts=(32,))
    out = torch.empty_like(q)
    args = (cu, cu, lens, table, 1, int(lens.max()), 32 ** -0.5, True, -1, 0.0)
    backend.varlen_attention(q, k, v, out, *args)
    (key, trials), = tuner.trials.items()
    timed = [t for t in trials if t.us is not None]
    assert len(timed) >= 4 and "|cpu|3|4|2|32|16|" in key
    want = torch.empty_like(q)
    ReferenceBackend("cpu").varlen_attention(q, k, v, want, *args)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    chosen = tuner.chosen[key]  # stored as the explicit configuration that was timed, not as "heuristic"
    assert all(getattr(chosen, f) is not None for f in ("decode_block_n", "decode_num_warps", "decode_num_stages",
                                                        "decode_tail_stages", "num_splits"))
    assert all(getattr(chosen, f) == v for f, v in dataclasses.asdict(timed[-1].tuning).items() if v is not None)


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
    tuner = backend.enable_autotune(contexts=(256, 1024))
    out = torch.empty_like(q)
    backend.varlen_attention(q, k, v, out, *args)
    (trials,) = tuner.trials.values()
    notes = [(t.tuning, t.note) for t in trials]
    assert min(trials[0].us.values()) > 0 and sum(t.us is not None for t in trials) >= 3, notes
    timed = tuner.timed_contexts(num_seqs, k.shape[0], page)  # 1024 keys exceed this small cache: capped
    assert sorted(trials[0].us) == list(timed) and max(timed) < 1024
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


def test_the_prepared_decode_call_uses_the_choice_and_leaves_its_counters_at_zero():
    """The path compiled models take (``prepare_attend`` with the builder's persistent scratch):
    the tuned split count is the launch's, the call is right, and the in-kernel merge's arrival
    counters are zero after it (a CUDA-graph replay relies on that)."""
    from compileattn import AttentionMetadataBuilder, AttentionSpec, SequenceStep

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32)
    q, k, v, cu, lens, table = _paged_decode()
    backend = TritonBackend("cpu")
    want_splits = Tuning(num_splits=4)  # the heuristic gives 2 here (4 stand-in SMs x 4 / 6 programs)
    backend.enable_autotune(timer=lambda fn: (fn(0), 1.0)[1], contexts=(32,))
    backend.autotuner.cached = lambda shape, contexts=None: dataclasses.replace(shape.base, num_splits=4)  # the choice
    builder = AttentionMetadataBuilder(block_size=16, num_blocks=k.shape[0], max_num_tokens=3,
                                       max_blocks_per_seq=table.shape[1], backend=backend)
    md = builder.build([SequenceStep(1, int(n) - 1, row) for n, row in zip(lens.tolist(), table.tolist())])
    call = backend.prepare_attend(md.shape, md.tensors, spec, q.dtype, k, v, md.selector.buffers)
    out = torch.empty_like(q)
    call(q, out)
    launch = next(x for key, x in md.selector.buffers._memo.items() if key[0] == "triton.decode")
    assert launch.splits == want_splits.num_splits
    assert not launch.arrivals.any()
    want = torch.empty_like(q)
    ReferenceBackend("cpu").varlen_attention(q, k, v, want, cu, cu, lens, table, 1, int(lens.max()), 32 ** -0.5,
                                             True, -1, 0.0)
    torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4)


def test_prepared_decode_launches_are_planned_per_timed_contexts():
    """Two layers of one spec whose caches differ in block count are timed at different contexts
    (``timed_contexts`` caps them at what each cache holds), so each gets the choice made for its
    own contexts, not the launch planned first for the other."""
    from compileattn import AttentionMetadataBuilder, AttentionSpec, SequenceStep

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32)
    q, k, v, cu, lens, table = _paged_decode()
    small_k, small_v = k[:4].clone(), v[:4].clone()  # 4 blocks: 16 keys for each of 3 sequences
    backend = TritonBackend("cpu")
    tuner = backend.enable_autotune(timer=lambda fn: (fn(0), 1.0)[1], contexts=(64,))
    assert tuner.timed_contexts(3, k.shape[0], 16) == (64,) and tuner.timed_contexts(3, 4, 16) == (16,)
    splits_for = {(64,): 4, (16,): 1}
    tuner.cached = lambda shape, contexts=None: dataclasses.replace(shape.base, num_splits=splits_for[contexts])
    builder = AttentionMetadataBuilder(block_size=16, num_blocks=k.shape[0], max_num_tokens=3,
                                       max_blocks_per_seq=table.shape[1], backend=backend)
    md = builder.build([SequenceStep(1, int(n) - 1, row) for n, row in zip(lens.tolist(), table.tolist())])
    buffers = md.selector.buffers
    for key_cache, value_cache in ((k, v), (small_k, small_v), (k, v)):
        backend.prepare_attend(md.shape, md.tensors, spec, q.dtype, key_cache, value_cache, buffers)
    assert sorted(x.splits for key, x in buffers._memo.items() if key[0] == "triton.decode") == [1, 4]
