"""The engine's sampler: greedy rows, temperature, top-p, per-request seeded draws, batched in one call."""
import numpy as np
import pytest
import torch

from compileattn.engine.request import SamplingParams
from compileattn.engine.sampler import sample, sampling_key, uniform

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def draws(n, temperature, top_p, seed=0):
    """n requests seeded together, each drawing its first token."""
    uniforms = [uniform(sampling_key(seed, i), 0) for i in range(n)]
    return sample(LOGITS.expand(n, -1).clone(), [temperature] * n, [top_p] * n, uniforms)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(6, 50)
    assert sample(logits, [0.0] * 6, [1.0] * 6, [0.5] * 6).tolist() == logits.argmax(-1).tolist()
    mixed = sample(logits, [0.0, 1.0] * 3, [1.0] * 6, [0.999] * 6)
    assert mixed[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_a_row_takes_the_token_where_its_cumulative_distribution_passes_its_uniform():
    probs = torch.tensor([0.1, 0.0, 0.3, 0.6])
    logits = probs.log().expand(7, -1).clone()
    got = sample(logits, [1.0] * 7, [1.0] * 7, [0.0, 0.05, 0.11, 0.25, 0.39, 0.41, 0.99]).tolist()
    assert got == [0, 0, 2, 2, 2, 3, 3]  # never token 1, of probability 0


def test_no_uniform_reaches_a_token_of_probability_zero():
    """Top-p removes the tail; uniforms at the very top of [0, 1) still land on kept tokens, and
    so does 1.0 (which ``uniform`` never gives): it stands for a target rounded past the last
    kept token's sum, or a GPU scan whose sums dip by an ulp."""
    torch.manual_seed(0)
    top = 1.0 - 2.0 ** -53
    for dtype in (torch.float32, torch.bfloat16):  # bf16: ties in the sorted probabilities
        logits = torch.randn(64, 1000).to(dtype).float()
        logits[:, 500:] = -float("inf")  # half the vocabulary impossible
        uniforms = [top, 1 - 1e-9, 1.0, 0.0] * 16
        picked = sample(logits, [1.0] * 64, [0.7] * 64, uniforms)
        probs = torch.softmax(logits, -1)
        kept = probs.sort(-1, descending=True)
        mass_above = kept.values.cumsum(-1) - kept.values
        allowed = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, kept.indices, mass_above < 0.7)
        assert allowed.gather(1, picked.unsqueeze(1)).all()


def test_uniforms_are_uniform_and_independent_across_keys_and_tokens():
    us = torch.tensor([uniform(sampling_key(3, i), k) for i in range(200) for k in range(100)], dtype=torch.float64)
    assert 0 <= us.min() and us.max() < 1
    counts = torch.histc(us, bins=20, min=0, max=1)
    assert ((counts - 1000).abs() < 150).all(), counts  # 1000 +- ~32 per bin
    grid = us.view(200, 100)
    for a, b in ((grid[:, :-1], grid[:, 1:]), (grid[:-1], grid[1:])):  # next token, next request
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 0.05
    assert sampling_key(3, 0) != sampling_key(4, 0) and sampling_key(3, 0) != sampling_key(3, 1)
    assert sampling_key(None) != sampling_key(None)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_follow_the_tempered_softmax(temperature):
    counts = torch.bincount(draws(40000, temperature, 1.0), minlength=5).float() / 40000
    torch.testing.assert_close(counts, torch.softmax(LOGITS / temperature, -1), atol=0.01, rtol=0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1)  # 0.56, 0.21, 0.13, 0.08, 0.03
    counts = torch.bincount(draws(40000, 1.0, 0.8), minlength=5).float() / 40000
    kept = probs[:3] / probs[:3].sum()  # 0.56 + 0.21 < 0.8 <= 0.56 + 0.21 + 0.13
    torch.testing.assert_close(counts[:3], kept, atol=0.01, rtol=0)
    assert counts[3:].sum() == 0
    assert set(draws(2000, 1.0, 0.01).tolist()) == {0}  # the most likely token always stays


def test_top_p_breaks_ties_by_token_id():
    """Among equally likely tokens at the top-p cut, the lower token ids stay: an unstable sort
    kept whichever tied tokens its implementation put first (torch's CPU sort put token 62 first
    of 100 equal values), so the kept set, and the draws, depended on the device."""
    n, vocab = 400, 100
    uniforms = [uniform(sampling_key(5, i), 0) for i in range(n)]
    drawn = sample(torch.zeros(n, vocab), [1.0] * n, [0.025] * n, uniforms)  # 0, .01, .02 < .025
    assert set(drawn.tolist()) == {0, 1, 2}


def test_a_seed_repeats_its_draws():
    assert torch.equal(draws(64, 1.0, 0.9, seed=3), draws(64, 1.0, 0.9, seed=3))
    assert not torch.equal(draws(64, 1.0, 0.9, seed=3), draws(64, 1.0, 0.9, seed=4))


def test_a_rows_draw_does_not_depend_on_its_batch():
    """The same request's uniform gives the same token alone and among other rows, wherever it sits."""
    torch.manual_seed(1)
    logits = torch.randn(9, 300)
    uniforms = [uniform(sampling_key(11, i), 4) for i in range(9)]
    together = sample(logits, [0.8] * 9, [0.95] * 9, uniforms).tolist()
    alone = [sample(logits[i:i + 1], [0.8], [0.95], uniforms[i:i + 1]).item() for i in range(9)]
    order = [4, 0, 8, 2, 6, 1, 7, 3, 5]
    shuffled = sample(logits[order], [0.8] * 9, [0.95] * 9, [uniforms[i] for i in order]).tolist()
    assert together == alone == [shuffled[order.index(i)] for i in range(9)]


def test_a_full_distribution_row_keeps_its_tail_beside_a_top_p_row():
    """A top_p=1 row draws from its whole distribution even when another row of the batch has a
    nucleus: its float32 sorted sum reaches 1.0 after the first token here, which must not drop the
    tail tokens (of probability ~1e-13) that its top uniform lands on alone."""
    logits = torch.zeros(1, 8)
    logits[0, 0] = 30.0
    top = 1 - 2.0 ** -53  # the largest uniform ``uniform`` gives
    alone = sample(logits, [1.0], [1.0], [top]).item()
    assert alone == 7
    beside = sample(torch.cat([logits, torch.randn(1, 8)]), [1.0, 1.0], [1.0, 0.5], [top, 0.5])
    assert beside[0].item() == alone


def test_sampling_params_are_validated():
    for bad in (dict(max_new_tokens=-1), dict(temperature=-0.1), dict(temperature=float("nan")),
                dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(TypeError):
        SamplingParams(stop_token_ids=["a"])
    for bad_seed in (1.5, "3", True):
        with pytest.raises(TypeError, match="seed"):
            SamplingParams(seed=bad_seed)
    # max_new_tokens by argtypes' rule for a count: 2.0 and True were refused as ValueErrors
    for bad_length in (2.0, True, "3"):
        with pytest.raises(TypeError, match=f"max_new_tokens must be an int, got {bad_length!r}"):
            SamplingParams(max_new_tokens=bad_length)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -1"):
        SamplingParams(max_new_tokens=-1)
    assert SamplingParams(max_new_tokens=np.int64(0)).max_new_tokens == 0


@pytest.mark.cuda
def test_cuda_draws_equal_the_cpus_and_keep_to_the_nucleus():
    """The CUDA sampler (a parallel float64 scan, batched searchsorted) picks the CPU's tokens for
    the same logits and uniforms, and never a token top-p removed."""
    torch.manual_seed(2)
    logits = torch.randn(256, 32000) * 3
    uniforms = [uniform(sampling_key(5, i), 0) for i in range(255)] + [1.0]
    temperatures = [0.7] * 128 + [1.3] * 127 + [1.0]
    top_ps = [0.9, 1.0] * 128
    on_cpu = sample(logits, temperatures, top_ps, uniforms)
    on_gpu = sample(logits.cuda(), temperatures, top_ps, uniforms)
    assert on_gpu.device.type == "cuda"
    assert (on_gpu.cpu() == on_cpu).float().mean() > 0.99  # a boundary within rounding may differ
    probs = torch.softmax(logits / torch.tensor(temperatures).unsqueeze(1), -1)
    kept = probs.sort(-1, descending=True)
    mass_above = kept.values.cumsum(-1) - kept.values
    allowed = torch.zeros_like(probs, dtype=torch.bool).scatter_(
        1, kept.indices, mass_above < torch.tensor(top_ps).unsqueeze(1))
    assert allowed.gather(1, on_gpu.cpu().unsqueeze(1)).all()


def test_ignore_eos_must_be_a_bool():
    """A truthy string ("no", "false") was kept as is and read as True: EOS silently ignored."""
    for bad in ("no", "false", 0, 1, None):
        with pytest.raises(TypeError, match="ignore_eos must be a bool"):
            SamplingParams(ignore_eos=bad)
    np = pytest.importorskip("numpy")
    assert SamplingParams(ignore_eos=np.True_).ignore_eos is True


def test_stop_token_ids_must_be_a_sequence_named_when_it_is_not():
    """None or a bare int failed inside ``map`` with "'int' object is not iterable", naming nothing."""
    for bad in (None, 3, "12", b"\x01"):
        with pytest.raises(TypeError, match="stop_token_ids must be a sequence of token ids"):
            SamplingParams(stop_token_ids=bad)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=torch.tensor([5])).stop_token_ids == (5,)
