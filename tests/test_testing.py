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
