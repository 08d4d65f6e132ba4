"""The engine's sampler: greedy rows, temperature, top-p, seeding, batched in one call."""
import pytest
import torch

from compileattn.engine.request import SamplingParams
from compileattn.engine.sampler import sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def draws(n, temperature, top_p, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return sample(LOGITS.expand(n, -1).clone(), [temperature] * n, [top_p] * n, gen)


def test_greedy_rows_take_the_argmax_and_draw_nothing():
    logits = torch.randn(6, 50)
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert sample(logits, [0.0] * 6, [1.0] * 6, gen).tolist() == logits.argmax(-1).tolist()
    assert torch.equal(gen.get_state(), state)
    mixed = sample(logits, [0.0, 1.0] * 3, [1.0] * 6, gen)
    assert mixed[0::2].tolist() == logits[0::2].argmax(-1).tolist()


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


def test_a_seed_repeats_its_draws():
    assert torch.equal(draws(64, 1.0, 0.9, seed=3), draws(64, 1.0, 0.9, seed=3))
    assert not torch.equal(draws(64, 1.0, 0.9, seed=3), draws(64, 1.0, 0.9, seed=4))


def test_sampling_params_are_validated():
    for bad in (dict(max_new_tokens=-1), dict(temperature=-0.1), dict(temperature=float("nan")),
                dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(TypeError):
        SamplingParams(stop_token_ids=["a"])
