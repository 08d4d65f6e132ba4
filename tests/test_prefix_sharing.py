"""Prefix sharing: the allocator's reference counts, free pools and exact-key index; then the
engine with ``enable_prefix_caching`` giving exactly the tokens it gives without (fp32), while
hits happen and shared blocks are held once."""
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compileattn as ca
from compileattn.engine import BlockAllocator, Engine, OutOfBlocksError, SamplingParams
from compileattn.models.llama import LlamaConfig, LlamaForCausalLM

BS = 4  # block size of the engine tests


@pytest.fixture(scope="module")
def llama():
    return LlamaForCausalLM(LlamaConfig.tiny())


def engine_for(model, caching=True, **kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("max_num_tokens", 64)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("block_size", BS)
    return Engine(model, enable_prefix_caching=caching, **kw)


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def shared_prompts(prefix_len, suffix_lens, seed=0):
    prefix = tokens(prefix_len, seed)
    return [prefix + tokens(n, seed + 1 + i) for i, n in enumerate(suffix_lens)]


def cached(allocator, token_ids, blocks):
    """Register ``blocks`` (allocated) as holding ``token_ids`` in order; returns the content ids."""
    ids, parent = [], None
    for i, b in enumerate(blocks):
        parent = allocator.register(b, parent, token_ids[i * BS:(i + 1) * BS])
        ids.append(parent)
    return ids


# -- allocator -------------------------------------------------------------------------------------

def test_a_block_is_free_only_when_its_last_holder_frees_it():
    a = BlockAllocator(4, enable_caching=True)
    blocks = a.allocate(2)
    cached(a, list(range(8)), blocks)
    a.share(blocks)
    assert [a.refcount(b) for b in blocks] == [2, 2] and a.num_free == 2
    a.free(blocks)
    assert [a.refcount(b) for b in blocks] == [1, 1] and a.num_free == 2
    a.free(blocks)
    assert a.num_free == 4 and a.num_cached_free == 2  # free, and still findable
    with pytest.raises(ValueError, match="not allocated"):
        a.free(blocks[:1])
    b = a.allocate(1)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(b + b)  # held once, freed twice in one call: nothing changes
    assert a.refcount(b[0]) == 1
    with pytest.raises(ValueError, match="not allocated"):
        a.free([9])


def test_cached_blocks_are_evicted_after_uncached_ones_least_recently_freed_first():
    a = BlockAllocator(6, enable_caching=True)
    first, second = a.allocate(2), a.allocate(2)
    plain = a.allocate(2)
    cached(a, list(range(8)), first)
    cached(a, list(range(100, 108)), second)
    a.free(first)  # freed before `second`: evicted before it, its tail (first[1]) before its head
    a.free(second)
    a.free(plain)
    assert a.num_free == 6 and a.num_cached_free == 4
    assert sorted(a.allocate(2)) == sorted(plain)  # blocks without content go first (LIFO)
    assert a.lookup(list(range(8)), BS) == first
    assert a.allocate(1) == [first[1]]
    assert a.lookup(list(range(8)), BS) == first[:1]  # the evicted block's key is gone
    assert not a.is_registered(first[1])
    assert a.allocate(2) == [first[0], second[1]]
    assert a.lookup(list(range(100, 108)), BS) == second[:1]  # `second`'s tail went first
    assert a.lookup(list(range(8)), BS) == []
    with pytest.raises(OutOfBlocksError):
        a.allocate(2)


def test_without_caching_blocks_are_reused_lifo_and_nothing_is_found():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    assert blocks == [0, 1, 2]
    a.free(blocks)
    assert a.allocate(3) == [2, 1, 0]
    assert a.lookup(list(range(12)), BS) == []
    with pytest.raises(ValueError, match="enable_caching"):
        a.register(0, None, [1, 2, 3, 4])


def test_lookup_follows_the_exact_chain_of_whole_blocks_and_stops_at_the_first_miss():
    a = BlockAllocator(8, enable_caching=True)
    seq = list(range(10, 22))  # 3 blocks
    blocks = a.allocate(3)
    ids = cached(a, seq, blocks)
    assert len(set(ids)) == 3
    assert a.lookup(seq, BS) == blocks
    assert a.lookup(seq + [1, 2, 3], BS) == blocks  # a partial last block is never a hit
    assert a.lookup(seq[:11], BS) == blocks[:2]
    assert a.lookup(seq, BS, max_blocks=1) == blocks[:1]
    assert a.lookup(seq[:4] + [0] + seq[5:], BS) == blocks[:1]  # block 1 differs: blocks 1 and 2 miss
    assert a.lookup(seq[4:], BS) == []  # block 1's tokens, but not after block 0: another prefix
    assert a.content_id(blocks[2]) == ids[2]


def test_an_orphan_is_unreachable_once_its_parent_is_evicted():
    a = BlockAllocator(3, enable_caching=True)
    seq = list(range(12))
    blocks = a.allocate(3)
    cached(a, seq, blocks)
    a.free([blocks[0]])  # the head alone is freed first, so evicted first
    a.free(blocks[1:])
    assert a.allocate(1) == [blocks[0]]
    assert a.lookup(seq, BS) == []  # blocks 1 and 2 still hold their K/V but cannot be reached
    assert a.num_registered == 2
    # Recomputed into other blocks, the prefix is found again, through the new parent.
    a.free([blocks[0]])
    again = a.allocate(1)
    cached(a, seq[:4], again)
    assert a.lookup(seq, BS) == again


def test_registering_known_content_again_keeps_the_first_copy_and_continues_its_chain():
    a = BlockAllocator(6, enable_caching=True)
    seq = list(range(8))
    first, copy = a.allocate(2), a.allocate(2)
    ids = cached(a, seq, first)
    parent = a.register(copy[0], None, seq[:4])
    assert parent == ids[0] and not a.is_registered(copy[0])
    assert a.register(copy[1], parent, seq[4:]) == ids[1]
    # The chain continues past the copies: a third block after them is found through `first`.
    tail = a.allocate(1)
    a.register(tail[0], ids[1], [7, 7, 7, 7])
    assert a.lookup(seq + [7, 7, 7, 7], BS) == first + tail
    a.free(copy)
    assert a.num_cached_free == 0  # unregistered copies are plain free blocks


def test_allocator_refuses_bad_use():
    with pytest.raises(TypeError, match="enable_caching"):
        BlockAllocator(4, enable_caching=1)
    a = BlockAllocator(4, enable_caching=True)
    with pytest.raises(ValueError, match="not allocated"):
        a.register(0, None, [1, 2, 3, 4])
    b = a.allocate(1)
    a.register(b[0], None, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="already registered"):
        a.register(b[0], None, [5, 6, 7, 8])
    with pytest.raises(ValueError, match="no cached content"):
        a.share(a.allocate(1))
    with pytest.raises(ValueError, match="not registered"):
        a.content_id(3)
    with pytest.raises(TypeError, match="enabled"):
        a.set_caching("yes")


def test_allocator_refuses_bool_block_ids_and_a_bad_block_size():
    a = BlockAllocator(4, enable_caching=True)
    blocks = a.allocate(2)
    cached(a, list(range(8)), blocks)
    with pytest.raises(TypeError, match="block ids must be ints"):
        a.share([True])  # was block 1, held once more
    assert a.refcount(1) == 1
    b = a.allocate(1)
    with pytest.raises(TypeError, match="block ids must be ints"):
        a.register(True, None, [5, 6, 7, 8])
    with pytest.raises(ValueError, match="block_size"):
        a.lookup(list(range(8)), 0)  # was a ZeroDivisionError
    with pytest.raises(TypeError, match="^max_blocks must be an int, got 1.5"):
        a.lookup(list(range(8)), BS, max_blocks=1.5)
    with pytest.raises(TypeError, match="^max_blocks must be an int, got True"):
        a.lookup(list(range(8)), BS, max_blocks=True)
    with pytest.raises(ValueError, match="^max_blocks must be >= 0, got -1"):
        a.lookup(list(range(8)), BS, max_blocks=-1)
    assert a.lookup(list(range(8)), BS, max_blocks=1) == blocks[:1]
    assert a.refcount(b[0]) == 1 and not a.is_registered(b[0])


def test_lookup_finds_what_register_keyed_whatever_holds_the_token_ids():
    np = pytest.importorskip("numpy")
    a = BlockAllocator(4, enable_caching=True)
    seq = torch.arange(20, 28)
    blocks = a.allocate(2)
    cached(a, seq, blocks)  # registered from tensor slices
    assert a.lookup(seq, BS) == blocks  # a tensor's elements, looked up raw, hashed by identity: []
    assert a.lookup(seq.tolist(), BS) == blocks
    assert a.lookup(np.arange(20, 28), BS) == blocks
    with pytest.raises(TypeError, match="token_ids"):
        a.register(a.allocate(1)[0], None, [1.5, 2.0, 3.0, 4.0])  # int() made token 1 of 1.5
    with pytest.raises(TypeError, match="token_ids"):
        a.lookup([1.5, 2.0, 3.0, 4.0], BS)


def test_switching_caching_empties_the_cache():
    a = BlockAllocator(4, enable_caching=True)
    blocks = a.allocate(2)
    cached(a, list(range(8)), blocks)
    a.free(blocks)
    a.set_caching(True)
    assert a.lookup(list(range(8)), BS) == [] and a.num_cached_free == 0 and a.num_free == 4
    a.set_caching(False)
    assert not a.enable_caching


# -- the engine: the same tokens, with hits ----------------------------------------------------------

def generate(engine, prompts, new=6, budget=16):
    return engine.generate(prompts, new, budget)


@pytest.mark.parametrize("prefix_len, suffix_lens", [
    (13, [3, 0, 5, 9, 1]),  # 3 whole blocks and a partial one; one prompt is the prefix itself
    (12, [4, 0, 7, 1]),     # a multiple of the block size: the bare prefix recomputes its last block
    (3, [0, 2, 6]),         # shorter than a block: nothing to share
    (30, [2, 11, 0, 5]),    # chunked under the 16-token budget, before and after the hits
])
def test_shared_prefixes_give_the_tokens_of_caching_off(llama, prefix_len, suffix_lens):
    prompts = shared_prompts(prefix_len, suffix_lens)
    want = generate(engine_for(llama, caching=False), prompts)
    # Two sequences at a time, so later prompts are admitted after earlier ones computed the prefix.
    engine = engine_for(llama, max_num_seqs=2)
    assert generate(engine, prompts) == want
    stats = engine.prefix_cache_stats
    assert stats.queried_tokens == sum(map(len, prompts))
    if prefix_len >= BS:
        assert stats.hit_tokens > 0
    else:
        assert stats.hit_tokens == 0
    assert engine.allocator.num_free == 64 and engine.allocator.num_cached_free > 0
    # And against the uncached engine one prompt at a time (batching cannot hide a wrong hit).
    alone = engine_for(llama, caching=False)
    assert [generate(alone, [p])[0] for p in prompts] == want


def test_later_requests_hit_the_blocks_of_running_and_finished_requests(llama):
    prompts = shared_prompts(14, [3, 6, 2])
    want = generate(engine_for(llama, caching=False), prompts, new=5)
    engine = engine_for(llama)
    a = engine.add_request(prompts[0], 5)
    engine.step(16)
    engine.step(16)
    b = engine.add_request(prompts[1], 5)
    result = engine.step(16)
    req_a, req_b = engine.request(a), engine.request(b)
    i = result.seq_ids.index(b)
    assert result.kinds[i] == "chunked_prefill" and req_b.blocks[:3] == req_a.blocks[:3]
    assert [engine.allocator.refcount(x) for x in req_a.blocks[:3]] == [2, 2, 2]
    while engine.has_unfinished():
        engine.step(16)
    held = req_a.blocks, req_b.blocks
    assert held == ([], []) and engine.allocator.num_free == 64
    c = engine.add_request(prompts[2], 5)  # both finished: the blocks wait in the cached pool
    hits_before = engine.prefix_cache_stats.hit_tokens
    engine.step(16)
    assert engine.prefix_cache_stats.hit_tokens - hits_before == 12
    while engine.has_unfinished():
        engine.step(16)
    assert [engine.pop_request(i).output for i in (a, b, c)] == want


def test_shared_blocks_are_held_once(llama):
    prompts = shared_prompts(24, [3, 5, 2, 7, 4, 1])

    def peak_blocks(engine):
        peak = 0

        def watch(_step):
            nonlocal peak
            peak = max(peak, engine.allocator.num_blocks - engine.allocator.num_free)
        engine.on_step_done = watch
        out = generate(engine, prompts, new=4, budget=64)
        return out, peak

    # One admission per step: every prompt after the first finds the prefix registered.
    off, off_peak = peak_blocks(engine_for(llama, caching=False, max_num_tokens=32))
    on, on_peak = peak_blocks(engine_for(llama, max_num_tokens=32))
    assert on == off
    assert on_peak < off_peak - 10  # six sequences, 6 prefix blocks each, held once instead of ~5 times


def test_preemption_under_block_pressure_with_sharing_gives_the_unpressured_tokens(llama):
    prompts = shared_prompts(16, [4, 4, 5, 2, 9])
    want = generate(engine_for(llama, caching=False), prompts, new=8, budget=64)
    for num_blocks in (10, 12, 17):
        engine = engine_for(llama, num_blocks=num_blocks)
        assert generate(engine, prompts, new=8, budget=64) == want, num_blocks
        assert engine.num_preemptions > 0 and engine.prefix_cache_stats.hit_tokens > 0
        assert engine.allocator.num_free == num_blocks


def test_chunked_prefill_over_a_cached_prefix_under_a_small_budget(llama):
    prompts = shared_prompts(21, [9, 1, 6])
    want = generate(engine_for(llama, caching=False), prompts)
    for budget in (1, 3, 5):
        engine = engine_for(llama, max_num_seqs=1)
        assert generate(engine, prompts, budget=budget) == want
        assert engine.prefix_cache_stats.hit_tokens == 2 * 20


def test_run_with_steps_in_flight_registers_after_launch_and_never_writes_a_shared_block(llama):
    """``run`` plans step N+1 while N runs; hits may point at blocks N writes (queued before
    N+1), never at blocks of the step being planned. In every planned step, the blocks a sequence
    writes are held by it alone and are not registered."""
    prompts = shared_prompts(18, [2, 7, 3, 5, 9, 1, 4])
    want = generate(engine_for(llama, caching=False), prompts, budget=12)
    engine = engine_for(llama, max_num_seqs=3, num_blocks=12)
    alloc, schedule, planned = engine.allocator, engine.scheduler.schedule, []

    def checked(budget=None):
        step = schedule(budget)
        if step is not None:
            planned.append(step)
            for seq in step.seqs:
                q, ctx, table = seq
                written = table[ctx // BS: -(-(ctx + q) // BS)]
                assert all(alloc.refcount(b) == 1 and not alloc.is_registered(b) for b in written)
                assert not set(written) & {b for other in step.seqs if other is not seq for b in other[2]}
        return step
    engine.scheduler.schedule = checked
    assert generate(engine, prompts, budget=12) == want
    assert engine.prefix_cache_stats.hit_tokens > 0 and engine.num_preemptions > 0
    assert sum(len(p.pending_rows) for p in planned) > 0


@settings(max_examples=10, deadline=None)
@given(prefix=st.integers(1, 26), suffixes=st.lists(st.integers(0, 12), min_size=1, max_size=5),
       budget=st.integers(1, 24), block_size=st.sampled_from([1, 3, 4, 16]), seqs=st.integers(1, 4),
       new=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_tokens_do_not_depend_on_prefix_caching(llama, prefix, suffixes, budget, block_size, seqs, new, seed):
    prompts = shared_prompts(prefix, suffixes, seed)
    want = engine_for(llama, caching=False, block_size=16, num_blocks=64).generate(prompts, new, 64)
    engine = engine_for(llama, block_size=block_size, num_blocks=120 // block_size + 6, max_num_seqs=seqs)
    assert engine.generate(prompts, new, budget) == want
    assert engine.generate(prompts, new, budget) == want  # again, over a warm cache


def test_caching_off_registers_nothing_and_the_switch_needs_an_idle_engine(llama):
    prompts = shared_prompts(12, [3, 4])
    off = engine_for(llama, caching=False)
    want = generate(off, prompts)
    assert off.allocator.num_registered == 0 and off.prefix_cache_stats.queried_tokens == 0
    off.set_prefix_caching(True)
    assert generate(off, prompts) == want and off.allocator.num_registered > 0
    off.add_request(prompts[0], 2)
    with pytest.raises(ValueError, match="idle"):
        off.set_prefix_caching(False)
    off.step(16)
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        engine_for(llama, caching="on")


# -- compiled, and through LLM ----------------------------------------------------------------------

def test_compiled_with_simulated_cuda_graphs_gives_the_eager_uncached_tokens(llama, simulated_graphs):
    prompts = shared_prompts(17, [2, 6, 0, 9])
    want = generate(engine_for(llama, caching=False), prompts, budget=8)
    cfg = ca.CompileConfig(attention_backend="reference", cudagraph_mode="full_and_piecewise",
                           cudagraph_capture_sizes=[1, 2, 4, 8], piece_compiler="eager")
    with ca.counters.expect(dynamo_graphs=1):
        engine = engine_for(llama, compile_config=cfg, max_num_seqs=2)
    replays, full = ca.counters.cudagraph_replays, ca.counters.full_graph_steps
    with ca.counters.expect(dynamo_graphs=0):
        assert generate(engine, prompts, budget=8) == want
    assert engine.prefix_cache_stats.hit_tokens > 0
    assert ca.counters.cudagraph_replays - replays == len(engine.history)
    assert ca.counters.full_graph_steps > full


def test_llm_with_prefix_caching_equals_hf_generate_across_calls(tmp_path, caplog):
    from hf_families import hf_greedy, load_reference, save_family
    from hf_families import prompts as family_prompts

    directory = save_family("qwen2", tmp_path / "qwen2")  # a sliding window shorter than the prefix
    reference = load_reference(directory)
    prefix, *suffixes = family_prompts(seed=3, lengths=(19, 3, 1, 0, 6))
    prompts = [prefix + s for s in suffixes]
    expected = [hf_greedy(reference, p, 6)[0] for p in prompts]
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        ca.LLM(str(directory), compile_config=None, enable_prefix_caching=1)
    llm = ca.LLM(str(directory), compile_config=None, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                 num_blocks=64, enable_prefix_caching=True)
    assert [o.token_ids for o in llm.generate(prompts, 6, use_tqdm=False)] == expected
    first = llm.engine.prefix_cache_stats.hit_tokens
    assert first > 0
    with caplog.at_level(logging.INFO, logger="compileattn"):
        assert [o.token_ids for o in llm.generate(prompts[::-1], 6, use_tqdm=False)] == expected[::-1]
    # The second call finds every prompt's whole blocks, the first one's included.
    hits = sum((len(p) - 1) // 4 * 4 for p in prompts)
    assert llm.engine.prefix_cache_stats.hit_tokens - first == hits
    assert f"prefix cache: {hits} of {sum(map(len, prompts))} looked-up tokens hit" in caplog.text


def test_seeded_sampling_is_unchanged_by_caching_and_batching(llama):
    """Seeded requests draw the same tokens with the cache on and off, one at a time or batched,
    preempted and recomputed, or stepped with each step planned while the previous one runs:
    all of these move a request to other steps and rows, not to other draws."""
    prompts = shared_prompts(15, [3, 1, 6])
    params = [SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.8, seed=100 + i) for i in range(3)]

    def sampled(caching, max_num_seqs, num_blocks=64, overlapped=False):
        engine = engine_for(llama, caching=caching, max_num_seqs=max_num_seqs, num_blocks=num_blocks)
        ids = engine.add_requests(params, prompts)
        if overlapped:  # each step planned while the previous one's token is pending
            engine.run(max_tokens_per_step=16)
        else:
            while engine.has_unfinished():
                engine.step(16)
        assert (engine.num_preemptions > 0) == (num_blocks == 10)
        return [engine.pop_request(i).output for i in ids], engine.prefix_cache_stats.hit_tokens

    (off, _), (on, hits), (on_batched, _) = sampled(False, 1), sampled(True, 1), sampled(True, 3)
    assert on == off == on_batched and hits > 0
    assert sampled(False, 3, num_blocks=10)[0] == sampled(True, 3, overlapped=True)[0] == off  # preempted; overlapped
    greedy = generate(engine_for(llama, caching=False), prompts, new=6, budget=16)
    assert off != greedy  # the draws were not all the argmax


def test_a_seeded_generate_repeats_with_prefix_caching():
    """The LLM's seed gives every prompt its own stream: a second call, served from the prefix
    cache the first one filled, draws the same tokens; another seed draws others."""
    llm = ca.LLM(LlamaForCausalLM(LlamaConfig.tiny()), compile_config=None, num_blocks=64, block_size=BS,
                 max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    prompts = shared_prompts(16, [2, 5, 3, 2])
    kw = dict(temperature=1.0, top_p=0.95, use_tqdm=False)
    first = [o.token_ids for o in llm.generate(prompts, 8, seed=7, **kw)]
    hits = llm.engine.prefix_cache_stats.hit_tokens
    assert [o.token_ids for o in llm.generate(prompts, 8, seed=7, **kw)] == first
    assert llm.engine.prefix_cache_stats.hit_tokens > hits
    assert [o.token_ids for o in llm.generate(prompts, 8, seed=8, **kw)] != first
    with pytest.raises(TypeError, match="seed"):
        llm.generate(prompts, 8, seed=7.0, **kw)


def test_requests_arriving_together_compute_their_prefix_once(llama):
    """Four prompts with a 6-block prefix, all waiting, budget for all of them: the first computes
    the prefix, the others wait one step (the step is filling their next block) and then find it
    in the cache. Caching off they all compute it in the first step."""
    prompts = shared_prompts(24, [3, 5, 2, 7])
    want = generate(engine_for(llama, caching=False), prompts, new=4, budget=64)
    engine = engine_for(llama, max_num_tokens=64)
    ids = engine.add_requests([SamplingParams(max_new_tokens=4)] * 4, prompts)
    first = engine.step()
    assert first.seq_ids == [ids[0]] and engine.prefix_cache_stats.deferred_admissions == 1
    second = engine.step()
    assert set(ids[1:]) <= set(second.seq_ids)
    assert engine.prefix_cache_stats.hit_tokens == 3 * 24
    while engine.has_unfinished():
        engine.step()
    assert [engine.pop_request(i).output for i in ids] == want


def test_no_admission_waits_without_caching_or_for_another_prefix(llama):
    same = shared_prompts(24, [3, 5])
    other = [tokens(27, 50), tokens(26, 60)]  # no common block
    for caching, prompts, admitted in ((False, same, 2), (True, other, 2)):
        engine = engine_for(llama, caching=caching, max_num_tokens=64)
        engine.add_requests([SamplingParams(max_new_tokens=2)] * 2, prompts)
        assert len(engine.step().seq_ids) == admitted
        assert engine.prefix_cache_stats.deferred_admissions == 0


def test_a_request_waits_while_a_chunked_prefill_fills_its_next_block(llama):
    """A long prompt chunked over several steps: an identical one arriving meanwhile waits until
    the blocks it needs are in the cache, and never computes them itself."""
    prompt = tokens(40, 7)
    want = generate(engine_for(llama, caching=False), [prompt, prompt], new=3, budget=16)
    engine = engine_for(llama, max_num_tokens=16)
    a = engine.add_request(prompt, 3)
    engine.step()  # a computes tokens 0-15
    b = engine.add_request(prompt, 3)
    while engine.has_unfinished():
        engine.step()
    # Step 2 is a's 16 tokens (the whole budget); in step 3 a fills blocks 8-9 with 8 tokens and
    # b, which could have taken the other 8, waits; in step 4 it starts from all 9 blocks it may take.
    assert engine.prefix_cache_stats.deferred_admissions == 1
    assert engine.prefix_cache_stats.hit_tokens == 36  # (40 - 1) // 4 blocks of 4
    assert [engine.pop_request(i).output for i in (a, b)] == want
