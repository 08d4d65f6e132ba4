"""CUDA-graph runtime on a GPU: piecewise and full-decode modes equal eager, through padding, at
every capture size hit; replay counts; one shared pool; the address check. CI skips these."""
import random

import pytest
import torch

import compileattn as ca
from compileattn.compilation.cudagraph import CudaGraphAddressError
from compileattn.models.llama import LlamaConfig, LlamaForCausalLM
from compileattn.testing import PersistentInputs, RecordingBackend, assert_matches_eager, random_step

pytestmark = pytest.mark.cuda

BLOCK, NUM_BLOCKS, MAX_TOKENS = 16, 512, 64
SIZES = [1, 2, 4, 8, 16, 24, 32]


def _setup(dtype, backend="auto", layers=2):
    model = LlamaForCausalLM(LlamaConfig.tiny(num_layers=layers, head_dim=64), dtype=dtype, device="cuda", seed=0)
    caches = ca.allocate_kv_caches(model.attention_specs(), NUM_BLOCKS, BLOCK, dtype=dtype, device="cuda")
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_TOKENS,
                                          max_blocks_per_seq=16, device="cuda", backend=backend)
    return model, caches, builder, PersistentInputs(model.config.vocab_size, MAX_TOKENS, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_piecewise_graphs_equal_eager_through_padding(dtype):
    model, caches, builder, make_inputs = _setup(dtype)
    cfg = ca.CompileConfig(cudagraph_mode="piecewise", cudagraph_capture_sizes=SIZES)
    backend = RecordingBackend(config=cfg)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    rng = random.Random(0)
    step_of: dict[int, list] = {}  # padded size -> the first step that hit it
    for i in range(30):
        seqs = random_step(rng, num_seqs=rng.randint(1, 5), block_size=BLOCK, num_blocks=NUM_BLOCKS,
                           max_query_len=6, max_context_len=100)
        pad = cfg.padded_num_tokens(sum(s.query_len for s in seqs))
        step_of.setdefault(pad, seqs)
        with ca.counters.expect(cudagraph_replays=1):
            assert_matches_eager(model, compiled, builder, caches, seqs, make_inputs, pad_to=pad)
    # A static piece that lands drops its size's graphs until that size's next step captures them
    # again (landing.py): with 14 test workers on one H100 (S29-4) sizes 2 and 4 landed after their
    # last step. So: every static piece in, then one more step of each size hit, each a capture.
    for runtime in backend.built:
        assert runtime.wait_for_static_pieces(timeout=300)
    for pad, seqs in step_of.items():
        with ca.counters.expect(cudagraph_replays=1):
            assert_matches_eager(model, compiled, builder, caches, seqs, make_inputs, pad_to=pad)
    hit = set(step_of)
    # Dynamo specialises a 1-token step into a graph of its own (0/1 specialisation), so there may
    # be a second runtime; together they captured every size hit, each piece once per size.
    captured = set()
    for runtime in backend.built:
        wrappers = runtime.piece_graphs()
        assert len(wrappers) == sum(not p.is_splitting_op for p in runtime.pieces)
        sizes = {frozenset(w.graphs) for w in wrappers}
        assert len(sizes) == 1  # every piece captured the same sizes
        captured |= set(next(iter(sizes)))
        for w in wrappers:
            assert w.pool is runtime.pool  # all graphs of a runtime share one pool
        assert runtime.graph_pool_bytes() > 0
    assert captured == hit


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_full_decode_graphs_equal_eager(dtype):
    from compileattn.backends.selector import get_backend

    backend_name = "triton"
    get_backend(backend_name, "cuda")
    model, caches, builder, make_inputs = _setup(dtype, backend=backend_name)
    cfg = ca.CompileConfig(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=SIZES)
    backend = RecordingBackend(config=cfg)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    rng = random.Random(1)
    with ca.counters.expect(cudagraph_replays=20):
        _run_decode_and_mixed(rng, model, compiled, builder, caches, make_inputs, cfg)
    assert sum(rt.full_graph_count() for rt in backend.built) > 0, "uniform-decode steps should use full graphs"


def _run_decode_and_mixed(rng, model, compiled, builder, caches, make_inputs, cfg):
    for i in range(20):
        decode = i % 2 == 0
        seqs = random_step(rng, num_seqs=rng.randint(1, 6), block_size=BLOCK, num_blocks=NUM_BLOCKS,
                           max_query_len=5, max_context_len=150, decode_fraction=1.0 if decode else 0.3)
        pad = cfg.padded_num_tokens(sum(s.query_len for s in seqs))
        assert_matches_eager(model, compiled, builder, caches, seqs, make_inputs, pad_to=pad)


def test_replays_equal_steps_and_address_check_catches_moved_input():
    model, caches, builder, make_inputs = _setup(torch.float16)
    cfg = ca.CompileConfig(cudagraph_mode="piecewise", cudagraph_capture_sizes=SIZES)
    compiled = torch.compile(model, backend=RecordingBackend(config=cfg), fullgraph=True)
    seqs = [ca.SequenceStep(1, 10, [0]), ca.SequenceStep(3, 0, [1])]
    md = builder.build(seqs, pad_to=4)
    with ca.counters.expect(cudagraph_replays=5, cudagraph_captures=3):  # 3 pieces, 1 size
        for _ in range(5):
            ids, pos = make_inputs(4)
            with ca.set_forward_context(md, caches):
                compiled(ids, pos)
    # A fresh size: capture, then its first replay with the ids moved to a new address must raise.
    md8 = builder.build(seqs, pad_to=8)
    ids, pos = make_inputs(8)
    with ca.set_forward_context(md8, caches):
        compiled(ids, pos)
        with pytest.raises(CudaGraphAddressError, match="input"):
            compiled(ids.clone(), pos)
