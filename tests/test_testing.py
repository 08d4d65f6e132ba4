"""compileattn.testing's comparison helpers: the rules every equality check (demo, TP check, GPU
tests, benchmarks) judges two runs by."""
import math

import pytest
import torch

from compileattn.testing import near_tie, recording_greedy, rel_error


def test_rel_error_is_never_nan():
    e = torch.tensor([3.0, 4.0])
    assert rel_error(e, e) == 0.0
    assert rel_error(torch.tensor([3.0, 0.0]), e) == pytest.approx(0.8)
    assert rel_error(torch.tensor([float("nan"), 4.0]), e) == math.inf
    assert rel_error(torch.ones(2), torch.zeros(2)) == math.inf
    assert rel_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert max(rel_error(a, e) for a in (e, torch.tensor([float("nan"), 4.0]), e)) == math.inf


def test_rel_error_is_never_nan_for_a_broken_reference_or_large_values():
    """A NaN/inf in the reference, or values whose squares overflow fp32, gave NaN (inf / inf),
    which ``max()`` over errors drops unless it comes first: a wrong result then passed."""
    e = torch.tensor([3.0, 4.0])
    broken = torch.tensor([float("nan"), 4.0])
    assert rel_error(e, broken) == math.inf
    assert rel_error(e, torch.tensor([float("inf"), 4.0])) == math.inf
    assert max(rel_error(a, r) for a, r in ((e, e), (e, broken))) == math.inf
    large = torch.tensor([3e38, 3e38])
    assert rel_error(torch.tensor([3e38, 0.0]), large) == pytest.approx(2 ** -0.5)
    assert rel_error(large.bfloat16(), large.bfloat16()) == 0.0


def test_near_tie_compares_the_reference_margin_with_twice_the_logit_difference():
    reference = torch.tensor([1.0, 0.9, -3.0])
    assert near_tie(reference, reference + torch.tensor([0.0, 0.06, 0.0]), 0, 1) == (True, pytest.approx(0.1))
    assert near_tie(reference, reference + torch.tensor([0.0, 0.04, 0.0]), 0, 1) == (False, pytest.approx(0.1))
    tie, margin = near_tie(reference, reference, 0, 2)
    assert not tie and margin == pytest.approx(4.0)


def test_recording_greedy_picks_the_argmax_and_keeps_rows_per_sequence():
    record: dict = {}
    sample = recording_greedy(record)
    assert sample(torch.tensor([[0.0, 2.0], [5.0, 1.0]], dtype=torch.float16), [7, 3]) == [1, 0]
    assert sample(torch.tensor([[1.0, 0.0]]), [7]) == [0]
    assert sorted(record) == [3, 7] and len(record[7]) == 2 and record[7][0].dtype == torch.float32
    assert torch.equal(record[3][0], torch.tensor([5.0, 1.0]))


def test_assert_matches_eager_compares_fp8_caches_by_value_and_still_fails_on_a_wrong_one():
    """fp8 caches were compared with the output dtype's tolerances, which torch refuses for
    float8: the helper failed every fp8 model, matching or not."""
    import random

    import compileattn as ca
    from compileattn.testing import AttentionBlock, assert_matches_eager, random_step

    spec = ca.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32)
    torch.manual_seed(0)
    block = AttentionBlock(spec, 64)
    caches = ca.allocate_kv_caches({"block.attn": spec}, num_blocks=32, block_size=16, dtype=torch.float32,
                                   kv_cache_dtype=torch.float8_e4m3fn, k_scale=0.01, v_scale=0.01)
    builder = ca.AttentionMetadataBuilder(block_size=16, num_blocks=32, max_num_tokens=64, max_blocks_per_seq=4)
    seqs = random_step(random.Random(0), num_seqs=3, block_size=16, num_blocks=32)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))

    def tripling_v(inputs):
        out = block(inputs)
        cache = caches["block.attn"].value_cache
        cache.copy_((cache.float() * 3).clamp(-448, 448).to(torch.float8_e4m3fn))
        return out

    with torch.no_grad():
        assert_matches_eager(block, block, builder, caches, seqs, lambda n: (x[:n],))
        with pytest.raises(AssertionError):
            assert_matches_eager(block, tripling_v, builder, caches, seqs, lambda n: (x[:n],))


def test_simulated_cuda_graphs_reference_capturable_holds_for_a_builder_used_before_and_after():
    """A builder memoises its step's call table, capturability included: one used before the
    block kept the reference backend uncapturable inside it (no full-graph decode steps), and one
    used inside kept it capturable after the block, past the restore of the class attribute."""
    import compileattn as ca
    from compileattn import SequenceStep
    from compileattn.testing import simulated_cuda_graphs

    spec = ca.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32)
    caches = ca.allocate_kv_caches({"layer": spec}, num_blocks=8, block_size=4, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=4, num_blocks=8, max_num_tokens=16, max_blocks_per_seq=4,
                                          backend="reference")

    def capturable():
        with ca.set_forward_context(builder.build([SequenceStep(1, 3, [0])]), caches) as ctx:
            return ctx.table.capturable

    assert capturable() is False
    with simulated_cuda_graphs():
        assert capturable() is True
    assert capturable() is False
