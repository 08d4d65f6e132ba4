"""The step driver: block allocator, scheduling, greedy generation eager vs compiled, padding."""
import collections
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compileattn import SequenceStep, counters
from compileattn.engine import BlockAllocator, Engine, OutOfBlocksError
from compileattn.models.llama import LlamaConfig, LlamaForCausalLM
from compileattn.models.opt import OPTConfig, OPTForCausalLM

@pytest.fixture(scope="module")
def llama():
    return LlamaForCausalLM(LlamaConfig.tiny())


def engine_for(model, **kw):
    kw.setdefault("num_blocks", 48)
    kw.setdefault("max_num_tokens", 64)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("block_size", 4)
    return Engine(model, **kw)


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


# -- allocator -------------------------------------------------------------------------------------

def test_allocator_hands_out_distinct_blocks_and_reuses_freed_ones():
    a = BlockAllocator(5)
    first = a.allocate(3)
    assert sorted(first) == first == [0, 1, 2] and a.num_free == 2
    second = a.allocate(2)
    assert set(first).isdisjoint(second) and a.num_free == 0
    with pytest.raises(OutOfBlocksError, match="1 KV-cache blocks but only 0 of 5"):
        a.allocate(1)
    a.free([first[1]])
    assert a.allocate(1) == [first[1]]
    assert a.allocate(0) == []


def test_allocator_rejects_bad_use():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    a.free(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(blocks[:1])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([7])
    with pytest.raises(ValueError, match="n must be"):
        a.allocate(-1)
    assert a.num_free == 4


def test_allocator_reads_block_ids_and_counts_by_the_int_rule():
    np = pytest.importorskip("numpy")
    a = BlockAllocator(np.int64(4))
    assert type(a.num_blocks) is int and a.num_free == 4
    blocks = a.allocate(np.int64(2))
    assert blocks == [0, 1] and a.can_allocate(np.int64(2)) and not a.can_allocate(3)
    a.free([np.int64(0)])  # was refused as "block 0 is not allocated"
    assert a.refcount(np.int64(0)) == 0 and a.refcount(1) == 1
    with pytest.raises(TypeError, match="block ids must be ints"):
        a.free([True])  # was block 1, freed
    with pytest.raises(TypeError, match="block ids must be ints"):
        a.free([1.0])
    assert a.refcount(1) == 1
    with pytest.raises(ValueError, match="not allocated"):
        a.refcount(-1)  # was the last block's count, through Python's negative indexing
    with pytest.raises(ValueError, match="^n must be >= 0, got -1"):
        a.can_allocate(-1)  # was True
    for bad in (1.0, True, "1"):  # the int rule's refusals, by type (argtypes.non_negative_int)
        with pytest.raises(TypeError, match="^n must be an int"):
            a.allocate(bad)
        with pytest.raises(TypeError, match="^n must be an int"):
            a.can_allocate(bad)
    with pytest.raises(TypeError, match="num_blocks"):
        BlockAllocator(4.0)


def test_allocator_refuses_more_blocks_than_int32_block_ids_address():
    """Its block ids go into int32 block tables: with more blocks, ids past 2**31 - 1 would wrap
    (refused before the per-block lists are made)."""
    with pytest.raises(ValueError, match="^num_blocks must be at most 2147483647"):
        BlockAllocator(2**62)


# -- scheduling ------------------------------------------------------------------------------------

def test_steps_mix_decodes_prefills_and_chunked_prefills(llama):
    engine = engine_for(llama, max_num_seqs=3)
    for p in prompts_of([6, 25, 3, 9, 14]):
        engine.add_request(p, 5)
    steps = []
    seen_running = 0
    while engine.has_unfinished():
        r = engine.step(12)
        steps.append(r)
        seen_running = max(seen_running, len(r.seq_ids))
        assert r.num_tokens <= 12
        # Decodes come first: the metadata counts the leading q_len-1 sequences as decodes.
        first_other = next((i for i, k in enumerate(r.kinds) if k != "decode"), len(r.kinds))
        assert "decode" not in r.kinds[first_other:]
        assert engine.last_metadata.num_decodes >= r.count("decode")
    assert seen_running <= 3
    assert any(r.count("decode") and (r.count("prefill") or r.count("chunked_prefill")) for r in steps)
    assert any(r.count("chunked_prefill") and r.count("decode") for r in steps)
    assert sum(r.count("decode") for r in steps) == 5 * 4  # the first new token comes from the prefill
    assert [h[:3] for h in engine.history] == [(r.count("decode"), r.count("prefill"), r.count("chunked_prefill"))
                                               for r in steps]
    assert engine.allocator.num_free == 48  # every block returned


def test_chunked_prompt_is_scheduled_over_several_steps(llama):
    engine = engine_for(llama)
    engine.add_request(prompts_of([20])[0], 2)
    kinds = [engine.step(8).kinds for _ in range(4)]
    assert kinds == [["chunked_prefill"], ["chunked_prefill"], ["chunked_prefill"], ["decode"]]
    assert not engine.has_unfinished()


def test_preemption_under_block_pressure_gives_the_unpressured_tokens(llama):
    # 12 blocks of 4 = 48 slots; each request grows to ceil((20 + 7) / 4) = 7 blocks: two are admitted,
    # and when they outgrow the free list the newer one is preempted and later recomputed.
    prompts = prompts_of([20, 20, 20, 9])
    pressured = engine_for(llama, num_blocks=12)
    outs = pressured.generate(prompts, 8, 64)
    assert pressured.num_preemptions > 0
    assert max(h[0] + h[1] + h[2] for h in pressured.history) >= 2  # not one request at a time
    assert outs == engine_for(llama).generate(prompts, 8, 64)
    assert pressured.allocator.num_free == 12
    with pytest.raises(ValueError, match="max_model_len"):
        pressured.add_request([1] * 40, 10)


# -- generation ------------------------------------------------------------------------------------

def test_batched_generation_equals_one_prompt_at_a_time(llama):
    prompts = prompts_of([5, 33, 17, 1, 23])
    batched = engine_for(llama).generate(prompts, 6, 16)
    single = engine_for(llama)
    alone = [single.generate([p], 6, 64)[0] for p in prompts]
    assert batched == alone
    assert all(len(o) == 6 for o in batched)
    # Not a degenerate model: different prompts continue differently.
    assert len({tuple(o) for o in batched}) > 1


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4), budget=st.integers(1, 24),
       block_size=st.sampled_from([1, 3, 16]), new=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_tokens_do_not_depend_on_batching_chunking_or_blocks(llama, lengths, budget, block_size, new, seed):
    prompts = prompts_of(lengths, seed)
    ref = engine_for(llama, num_blocks=64, block_size=16).generate(prompts, new, 64)
    got = engine_for(llama, num_blocks=160 // block_size + 8, block_size=block_size).generate(prompts, new, budget)
    assert got == ref


def assert_blocks_held_by_running_requests(engine):
    """Every block's reference count is the number of running requests holding it, and the free
    blocks are exactly those no one holds (each in one pool, a cached one with its key). A
    registered block that a request holds at index i names, through its chain of parents, exactly
    that request's first i + 1 blocks of tokens (a key naming other tokens serves wrong K/V)."""
    alloc, held, bs = engine.allocator, collections.Counter(), engine.block_size
    key_of_content = {cid: key for key, (_, cid) in alloc._by_key.items()}

    def tokens_named(key):
        parent, tokens = key
        if parent is None:
            return tokens
        above = key_of_content.get(parent)
        return None if above is None else (None if (t := tokens_named(above)) is None else t + tokens)
    for req in engine.scheduler.running.values():
        assert len(set(req.blocks)) == len(req.blocks)
        held.update(req.blocks)
        for i, b in enumerate(req.blocks):
            named = tokens_named(alloc._key_of[b]) if alloc.is_registered(b) else None
            assert named is None or list(named) == req.token_ids[:(i + 1) * bs], (req.seq_id, i)
    assert all(not req.blocks for req in engine.scheduler.waiting)
    assert [alloc.refcount(b) for b in range(alloc.num_blocks)] == [held[b] for b in range(alloc.num_blocks)]
    free, cached = alloc._free, list(alloc._cached_free)
    assert sorted(free + cached) == [b for b in range(alloc.num_blocks) if not held[b]]
    assert all(alloc.is_registered(b) for b in cached) and not any(alloc.is_registered(b) for b in free)


_ALONE: dict[tuple, list[int]] = {}


def alone(model, prompt, n=6):
    """``prompt``'s first ``n`` greedy tokens, alone in a roomy cache (memoised: hypothesis repeats prompts)."""
    key = (id(model), *prompt)
    if key not in _ALONE:
        _ALONE[key] = engine_for(model, num_blocks=64, block_size=16).generate([prompt], 6, 64)[0]
    return _ALONE[key][:n]


@settings(max_examples=20, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 3, 4]), caching=st.booleans(), pipelined=st.booleans(),
       budget=st.integers(1, 24), max_num_seqs=st.integers(1, 4), spare_blocks=st.integers(0, 2))
def test_a_mixed_workload_under_block_pressure_gives_each_request_its_tokens_alone(
        llama, data, block_size, caching, pipelined, budget, max_num_seqs, spare_blocks):
    """Prompts that share prefixes (or are another's prefix, or equal), each with its own
    max_new_tokens (0 included) and maybe a stop token, some added while others run, in a cache
    of just enough blocks for the longest: preemptions, block reuse and prefix hits change no
    request's tokens from those it gets alone. After every step each block is held exactly by the
    running requests that list it; at the end every block is free."""
    from compileattn.engine import SamplingParams

    base = prompts_of([20], data.draw(st.integers(0, 2**16), label="seed"))[0]
    specs = data.draw(st.lists(st.tuples(st.sampled_from([1, 3, 4, 8, 12, 13, 20]), st.integers(0, 6),
                                         st.integers(0, 6), st.booleans(), st.integers(0, 5)),
                               min_size=1, max_size=6), label="requests")
    requests = []  # (prompt, params, step it arrives at)
    for shared, own, new, stop, arrival in specs:
        prompt = base[:shared] + prompts_of([own], seed=own)[0]  # equal (shared, own): equal prompts
        stop_ids = (alone(llama, prompt)[data.draw(st.integers(0, 5), label="stop at")],) if stop else ()
        requests.append((prompt, SamplingParams(max_new_tokens=new, stop_token_ids=stop_ids), arrival))
    longest = max(len(p) + max(sp.max_new_tokens - 1, 0) for p, sp, _ in requests)
    engine = engine_for(llama, block_size=block_size, num_blocks=-(-longest // block_size) + spare_blocks,
                        max_num_tokens=budget, max_num_seqs=max_num_seqs, enable_prefix_caching=caching)
    ids = {}
    if pipelined:
        engine.on_step_done = lambda _step: assert_blocks_held_by_running_requests(engine)
        ids = dict(enumerate(engine.add_requests([sp for _, sp, _ in requests], [p for p, _, _ in requests])))
        engine.run()
    else:
        step = 0
        while len(ids) < len(requests) or engine.has_unfinished():
            ids.update((i, engine.add_request(p, params=sp)) for i, (p, sp, arrival) in enumerate(requests)
                       if i not in ids and (arrival <= step or not engine.has_unfinished()))
            if engine.has_unfinished():
                engine.step()
                assert_blocks_held_by_running_requests(engine)
            step += 1
    assert engine.allocator.num_free == engine.allocator.num_blocks
    for i, (prompt, sp, _) in enumerate(requests):
        want = alone(llama, prompt, sp.max_new_tokens)
        stops = [k for k, t in enumerate(want) if t in sp.stop_token_ids]
        want = want[:stops[0] + 1] if stops else want
        assert engine.pop_request(ids[i]).output == want, (i, prompt, sp)


def test_a_request_preempted_and_readmitted_without_hits_registers_its_blocks_from_its_first(llama):
    """Two requests in four blocks of 2: the second one's growth preempts it, the first one's
    growth then evicts its cached blocks, and it is readmitted with no prefix hit. Its count of
    registered blocks must restart with its blocks (``Scheduler._preempt``): a count kept from
    before would skip its first blocks and register a later one as a sequence's first, whose K/V
    (computed at later positions) another prompt starting with those tokens would then be served."""
    from compileattn.engine import SamplingParams

    engine = engine_for(llama, block_size=2, num_blocks=4, max_num_tokens=16, max_num_seqs=2,
                        enable_prefix_caching=True)
    first, second = prompts_of([2, 2], seed=1)
    ids = [engine.add_request(first, params=SamplingParams(max_new_tokens=6))]
    engine.step()
    ids.append(engine.add_request(second, params=SamplingParams(max_new_tokens=4)))
    while engine.has_unfinished():
        engine.step()
        assert_blocks_held_by_running_requests(engine)
    assert engine.scheduler.num_preemptions == 1
    assert [engine.pop_request(i).output for i in ids] == [alone(llama, first), alone(llama, second, 4)]


def test_run_plans_each_step_while_the_previous_one_runs_and_matches_step_by_step(llama):
    """``run`` schedules step N+1 before step N's tokens reach the host: decodes of a pending token
    get it written into the inputs at launch; a request stopped by a token of step N has already
    been planned into N+1, whose token for it is dropped."""
    from compileattn.engine import SamplingParams

    prompts = prompts_of([5, 33, 17, 1, 23])
    greedy = engine_for(llama).generate(prompts, 6, 16)
    stop = greedy[1][2]  # stops prompt 1 at its third token (and any other prompt that samples it)
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(stop,))

    def outputs(drive):
        engine = engine_for(llama)
        ids = engine.add_requests([params] * len(prompts), prompts)
        planned = []
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda budget=None: planned.append(schedule(budget)) or planned[-1]
        drive(engine)
        assert engine.allocator.num_free == 48 and not engine.has_unfinished()
        reqs = [engine.pop_request(i) for i in ids]
        return [r.output for r in reqs], [r.finish_reason for r in reqs], [p for p in planned if p is not None]

    def step_by_step(engine):
        while engine.has_unfinished():
            engine.step(16)

    stepped, reasons, _ = outputs(step_by_step)
    ran, ran_reasons, planned = outputs(lambda engine: engine.run(max_tokens_per_step=16))
    assert ran == stepped and ran_reasons == reasons
    assert stepped[1] == greedy[1][:3] and reasons[1] == "stop"
    assert all(o == g[: len(o)] for o, g in zip(stepped, greedy))
    assert sum(len(p.pending_rows) for p in planned) > 0  # decodes planned before their token arrived


def test_llm_serves_an_own_model_too(llama):
    import compileattn as ca

    prompts = prompts_of([5, 33, 17])
    llm = ca.LLM(llama, compile_config=None, block_size=4, num_blocks=48, max_num_batched_tokens=16)
    out = llm.generate(prompts, 6, use_tqdm=False)
    assert [o.token_ids for o in out] == engine_for(llama).generate(prompts, 6, 16)
    assert out[0].text is None and out[0].prompt_token_ids == prompts[0]
    with pytest.raises(ValueError, match="dtype/device apply to transformers models"):
        ca.LLM(llama, dtype="float16")


def test_llm_generates_without_tqdm(llama, monkeypatch):
    """tqdm comes with the ``hf`` extra only: an own model's generate, which draws a progress bar by
    default, failed with ModuleNotFoundError on the core install."""
    import compileattn as ca

    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    prompts = prompts_of([5, 9])
    llm = ca.LLM(llama, compile_config=None, block_size=4, num_blocks=48)
    assert [o.token_ids for o in llm.generate(prompts, 3)] == engine_for(llama).generate(prompts, 3, 64)


def test_llm_logs_counts_in_the_singular_for_one(llama, caplog):
    """The summary said "for 1 requests"."""
    import compileattn as ca

    llm = ca.LLM(llama, compile_config=None, block_size=4, num_blocks=48)
    with caplog.at_level("INFO", logger="compileattn"):
        llm.generate(prompts_of([5]), 1, use_tqdm=False)
        llm.generate(prompts_of([5, 9]), 2, use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generated ")]
    assert lines[0].startswith("generated 1 token for 1 request in ") and lines[0].endswith(", 0 preemptions)")
    assert lines[1].startswith("generated 4 tokens for 2 requests in ")


def test_throughput_description_counts_in_the_singular_for_one():
    """``describe`` said "1 requests, 1 prompt + 1 output tokens ... 1 preemptions"."""
    from compileattn.engine.throughput import ThroughputResult, describe

    one = describe(ThroughputResult(1, 1, 1, 0.5, 2.0, 2.0, None, None, 1))
    assert one.startswith("1 request, 1 prompt token + 1 output token in 0.50 s: ") and one.endswith(", 1 preemption")
    two = describe(ThroughputResult(2, 7, 0, 0.5, 0.0, 4.0, None, None, 0))
    assert two.startswith("2 requests, 7 prompt tokens + 0 output tokens in ") and two.endswith(", 0 preemptions")


def test_reused_blocks_with_stale_kv_do_not_leak(llama):
    engine = engine_for(llama, num_blocks=16)
    engine.generate(prompts_of([30], seed=5), 4, 64)  # fills blocks with another sequence's K/V
    second = engine.generate(prompts_of([9, 14], seed=6), 5, 8)
    assert second == engine_for(llama).generate(prompts_of([9, 14], seed=6), 5, 64)


@pytest.mark.parametrize("pad_fn", [lambda n: n + 5, lambda n: -(-n // 8) * 8, lambda n: 64])
def test_padding_does_not_change_tokens(llama, pad_fn):
    prompts = prompts_of([7, 12, 3])
    ref = engine_for(llama).generate(prompts, 5, 10)
    padded = engine_for(llama, pad_fn=pad_fn)
    assert padded.generate(prompts, 5, 10) == ref
    assert all(h[4] == pad_fn(h[3]) for h in padded.history)
    assert any(h[4] > h[3] for h in padded.history)


def test_inputs_are_views_of_persistent_buffers(llama):
    seen = []

    def forward(ids, pos):
        seen.append((ids.data_ptr(), pos.data_ptr(), ids.shape[0], ids[-2:].tolist()))
        return llama.forward(ids, pos)
    engine = engine_for(llama, forward=forward, pad_fn=lambda n: n + 2)
    engine.generate(prompts_of([5, 9]), 3, 64)
    assert len({(a, b) for a, b, _, _ in seen}) == 1
    assert {n for _, _, n, _ in seen} == {16, 4}  # one prefill step of 14 + 2, then decodes of 2 + 2
    assert all(tail == [0, 0] for *_, tail in seen)  # padded input ids are zero


def test_opt_generates_through_the_engine():
    model = OPTForCausalLM(OPTConfig.tiny())
    prompts = prompts_of([4, 18])
    batched = engine_for(model).generate(prompts, 4, 8)
    assert batched == [engine_for(model).generate([p], 4, 64)[0] for p in prompts]


def test_generation_compiled_equals_eager(llama):
    prompts = prompts_of([5, 40, 17, 1, 23], seed=3)
    ref = engine_for(llama).generate(prompts, 6, 24)
    compiled = torch.compile(llama.forward, backend="compileattn")
    # Size 1 padded to 2: Dynamo specialises a dynamic dim of size 1, which would be a second graph.
    engine = engine_for(llama, forward=compiled, pad_fn=lambda n: max(n, 2))
    with counters.expect(dynamo_graphs=1):
        got = engine.generate(prompts, 6, 24)
    assert got == ref
    assert any(h[0] and (h[1] or h[2]) for h in engine.history)  # mixed steps went through it
    assert 1 in {h[3] for h in engine.history}  # and so did a padded single-token step


# -- errors ----------------------------------------------------------------------------------------

def test_bad_requests_raise_before_running(llama):
    engine = engine_for(llama)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 256], 2)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request([1], -1)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate([[1, 2], [999]], 2, 8)
    assert not engine.has_unfinished()  # the valid prompt was not left queued
    with pytest.raises(ValueError, match="no unfinished"):
        engine.step(8)
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        engine.generate([[1]], 2, 0)
    assert engine.generate([[1, 2]], 0, 8) == [[]]


def test_add_requests_queues_all_or_none(llama):
    """zip dropped the prompts past the last params; a float token was truncated into another one;
    only a ValueError took the earlier prompts back out of the queue."""
    from compileattn.engine import SamplingParams

    engine = engine_for(llama)
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="1 SamplingParams for 3 prompts"):
        engine.add_requests([params], [[1], [2], [3]])
    with pytest.raises(TypeError, match=r"prompt tokens must be ints, got float 2\.7"):
        engine.add_request([1, 2.7])
    with pytest.raises(TypeError, match=r"^prompts\[1\]: prompt tokens must be ints, got NoneType"):
        engine.add_requests([params] * 2, [[1, 2], [None]])
    # A bool is no token id (the int rule): True was served as token 1.
    with pytest.raises(TypeError, match=r"prompt tokens must be ints, got bool True"):
        engine.add_request([5, True])
    assert not engine.has_unfinished()


def test_bad_engine_arguments_raise(llama):
    with pytest.raises(TypeError, match="dtype"):
        engine_for(llama, dtype=torch.float16)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_for(llama, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len"):
        engine_for(llama, max_model_len=10_000)
    engine = engine_for(llama, pad_fn=lambda n: n - 1)
    with pytest.raises(ValueError, match="pad_fn"):
        engine.run_step([SequenceStep(2, 0, [0])], [1, 2], [0, 1])
    with pytest.raises(ValueError, match="positions"):
        engine_for(llama).run_step([SequenceStep(2, 0, [0])], [1, 2], [0])


# -- the demo --------------------------------------------------------------------------------------

def test_demo_runs_and_agrees(capsys):
    from compileattn.__main__ import main

    assert main(["--layers", "1", "--steps", "4", "--new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "OK: compiled matches eager" in out
    assert 'torch.compile(backend="compileattn")' in out
    assert "dynamo_graphs 1" in out  # one compile for every step size, no recompiles


def test_demo_rejects_bad_flags():
    from compileattn.__main__ import main

    with pytest.raises(SystemExit):
        main(["--steps", "0"])
    with pytest.raises(SystemExit):
        main(["--dtype", "float64"])


@pytest.mark.parametrize("device", ["mps", "meta", "bogus", "cuda:99"])
def test_demo_refuses_a_device_other_than_cpu_or_cuda_with_usage(device, capsys):
    """``--device mps`` failed inside the model's build with a dispatcher error listing every
    registered kernel. The demo and ``LLM`` refuse by one rule (``argtypes.serving_device``)."""
    from compileattn.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--device", device, "--layers", "1", "--steps", "1", "--new-tokens", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --device: expected cpu, cuda (cuda:N) or auto: --device={device!r}" in err, err


# -- CUDA (run on the device) ----------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_compiled_with_cudagraphs_matches_eager_on_mixed_steps(dtype):
    """compileattn backend on CUDA (piecewise + full CUDA graphs by default) against eager, step by
    step on teacher-forced mixed steps padded to capture sizes."""
    from compileattn.config import default_capture_sizes

    model = LlamaForCausalLM(LlamaConfig.tiny(head_dim=64, hidden_size=256, num_heads=4, num_kv_heads=2),
                             dtype=dtype, device="cuda")
    sizes = default_capture_sizes(64)

    def pad_fn(n):
        return next((s for s in sizes if s >= max(n, 2)), n)
    kw = dict(num_blocks=64, max_num_tokens=64, max_num_seqs=8, block_size=16, pad_fn=pad_fn)
    eager = Engine(model, **kw)
    compiled = Engine(model, forward=torch.compile(model.forward, backend="compileattn"), **kw)
    prompts = prompts_of([7, 40, 1, 13, 30, 3])

    def fixed(logits, seq_ids):
        return [(37 * s + logits.shape[0]) % 256 for s in seq_ids]
    for e in (eager, compiled):
        for p in prompts:
            e.add_request(p, 6)
    before = counters.snapshot()
    while eager.has_unfinished():
        a = eager.step(24, fixed)
        b = compiled.step(24, fixed)
        assert a.kinds == b.kinds
        err = ((b.hidden.float() - a.hidden.float()).norm() / a.hidden.float().norm()).item()
        assert err < 2e-2, (a.kinds, err)
    assert counters.dynamo_graphs - before["dynamo_graphs"] == 1
    assert counters.cudagraph_replays > before["cudagraph_replays"]


def test_engine_compiles_with_the_compile_config_and_takes_backend_and_padding_from_it(llama):
    import compileattn as ca

    cfg = ca.CompileConfig(attention_backend="reference", cudagraph_capture_sizes=[4, 8, 16], piece_compiler="eager")
    with counters.expect(dynamo_graphs=1):  # compiled at construction, on a warm-up step
        engine = Engine(llama, num_blocks=32, max_num_tokens=32, max_num_seqs=4, compile_config=cfg)
    assert engine.builder.selector.requested_name == "reference"
    assert engine.pad_fn(3) == 4 and engine.pad_fn(9) == 16 and engine.pad_fn(17) == 17
    prompts = prompts_of([5, 1, 12])
    with counters.expect(dynamo_graphs=0):  # 1-token steps included: no recompile
        assert engine.generate(prompts, 4, 8) == engine_for(llama).generate(prompts, 4, 8)
    with pytest.raises(ValueError, match="attention_backend"):
        Engine(llama, num_blocks=32, max_num_tokens=32, max_num_seqs=4, compile_config=cfg,
               attention_backend="triton")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_deleted_engine_frees_its_kv_cache(llama, compiled):
    """Nothing process-wide (forward context, backends, compiled code) keeps an engine's KV cache
    or its builder's buffers alive: a serving process that builds a second engine must get the
    memory of the first back (on the H200 an 80 GiB cache held this way made the next one fail)."""
    import gc
    import weakref

    import compileattn as ca

    cfg = ca.CompileConfig(attention_backend="reference", cudagraph_capture_sizes=[4, 8], piece_compiler="eager")
    engine = engine_for(llama, compile_config=cfg if compiled else None)
    engine.generate(prompts_of([5, 1, 12]), 3, 8)
    cache = next(iter(engine.kv_caches.values()))
    kept = [weakref.ref(cache.key_cache), weakref.ref(engine.builder.selector.buffers)]
    del engine, cache
    if compiled:
        torch.compiler.reset()
    gc.collect()
    assert [ref() is None for ref in kept] == [True, True]


def test_a_non_int_step_budget_is_refused_before_anything_is_scheduled(llama):
    """A float budget reached the allocator as a float block count ("n must be an int >= 0, got
    1.0") after the request had been moved from the queue into the running set."""
    engine = engine_for(llama)
    engine.add_request(prompts_of([9])[0], 2)
    for bad in (2.5, 4.0, True, "4", 0):
        with pytest.raises(ValueError, match="max_tokens_per_step must be a positive int"):
            engine.step(bad)
        with pytest.raises(ValueError, match="max_tokens_per_step must be a positive int"):
            engine.run(max_tokens_per_step=bad)
    assert len(engine.scheduler.waiting) == 1 and not engine.scheduler.running
    np = pytest.importorskip("numpy")
    assert engine.step(np.int64(4)).num_tokens == 4


def test_a_callers_sampler_must_give_one_token_in_the_vocabulary_per_row(llama):
    """Tokens were zipped with the rows: a short list left a request waiting for ever for a token
    (IndexError at its next step); an id past the vocabulary was appended and failed in the next
    step's embedding."""
    engine = engine_for(llama)
    for p in prompts_of([5, 7]):
        engine.add_request(p, 3)
    with pytest.raises(ValueError, match=r"sampler returned 1 tokens for 2 rows"):
        engine.step(64, sampler=lambda logits, ids: [1])
    with pytest.raises(ValueError, match=r"sampler returned token 256 .*\[0, 256\)"):
        engine.step(64, sampler=lambda logits, ids: [1, 256])
    with pytest.raises(ValueError, match=r"sampler returned token -1"):
        engine.step(64, sampler=lambda logits, ids: [-1, 2])
    with pytest.raises(TypeError, match="sampler must return integer token ids"):
        engine.step(64, sampler=lambda logits, ids: [1.7, 2])
    engine.reset()
    prompts = prompts_of([5, 7])
    assert engine.generate(prompts, 3, 64, sampler=lambda logits, ids: logits.argmax(-1)) == \
        engine_for(llama).generate(prompts, 3, 64)


def test_add_request_names_a_prompt_or_params_of_the_wrong_kind(llama):
    """A bare int or None as the prompt failed with "'int' object is not iterable"; a dict as
    ``params`` with "'dict' object has no attribute 'max_new_tokens'"."""
    engine = engine_for(llama)
    for bad in (5, None):
        with pytest.raises(TypeError, match=r"prompt must be a sequence of token ids, got"):
            engine.add_request(bad, 2)
    with pytest.raises(TypeError, match=r"params must be a SamplingParams, got dict"):
        engine.add_request([1, 2], params={"max_new_tokens": 2})
    assert not engine.has_unfinished()


def test_engine_sizes_follow_the_int_rule(llama):
    """``argtypes``' one rule for every public entry: numpy's integers are ints, a bool is not.
    ``Engine`` refused ``np.int64(4)`` as "must be a positive int" (``LLM`` took it), and took
    ``max_model_len=True`` as 1."""
    np = pytest.importorskip("numpy")
    engine = engine_for(llama, block_size=np.int64(4), num_blocks=np.int32(48), max_num_tokens=np.int64(64),
                        max_num_seqs=np.int64(8), max_model_len=np.int64(40))
    assert (engine.block_size, engine.max_model_len) == (4, 40)
    assert all(type(v) is int for v in (engine.block_size, engine.max_num_tokens, engine.max_num_seqs,
                                        engine.max_model_len))
    with pytest.raises(ValueError, match="max_model_len must be in"):
        engine_for(llama, max_model_len=True)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        engine_for(llama, block_size=True)
    assert engine.generate(prompts_of([3]), 2, max_tokens_per_step=np.int64(16)) == \
        engine_for(llama).generate(prompts_of([3]), 2, max_tokens_per_step=16)
    with pytest.raises(ValueError, match="max_tokens_per_step must be a positive int"):
        engine.generate(prompts_of([3]), 2, max_tokens_per_step=True)


def test_the_step_history_keeps_the_latest_steps_only(monkeypatch):
    """A served engine runs steps for its whole life: its per-step record is bounded."""
    from compileattn.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "HISTORY_STEPS", 2)
    engine = Engine(LlamaForCausalLM(LlamaConfig.tiny(), seed=0), num_blocks=16, max_num_tokens=16, max_num_seqs=4,
                    block_size=4)
    engine.generate([[1, 2, 3]], 5, 16)
    assert len(engine.history) == 2 and engine.history[-1][:3] == (1, 0, 0)  # the last two: decodes


def test_arguments_beyond_the_cache_are_a_typed_refusal(llama):
    """A max_model_len longer than the cache the given num_blocks hold, and a KV-cache budget that
    holds no block, can only be refused while the LLM is built: they raise ``ServingRefused`` (a
    ValueError), which a caller tells from a failure of the build by type (a plain ValueError
    before, like any bug's)."""
    from compileattn.engine import kv_budget
    from compileattn.refusals import ServingRefused

    with pytest.raises(ServingRefused, match=r"max_model_len must be in \[1, 8\] .* got 1000"):
        engine_for(llama, num_blocks=2, block_size=4, max_model_len=1000)
    specs = llama.attention_specs()
    per_block = kv_budget.bytes_per_block(specs, 4, torch.float32)
    assert kv_budget.blocks_for_memory(specs, 4, torch.float32, per_block) == 1
    with pytest.raises(ServingRefused, match="holds no block of 4 tokens"):
        kv_budget.blocks_for_memory(specs, 4, torch.float32, per_block - 1)
