"""Sampler: validation, seeding, and the filters against direct computation."""
import pytest
import torch

from executor.errors import RequestError
from executor.sampling import SamplingParams, StopCriteria, make_generator, sample


def draws(params, logits, n):
    gen = make_generator(params)
    return [sample(logits, params, gen) for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample(logits, SamplingParams(), None) == 1


def test_same_seed_same_tokens_other_seed_differs():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=7)
    assert draws(p, logits, 50) == draws(p, logits, 50)
    assert draws(p, logits, 50) != draws(SamplingParams(temperature=1.0, seed=8), logits, 50)


def test_top_k_samples_only_from_the_k_best():
    logits = torch.randn(200, generator=torch.Generator().manual_seed(1))
    top = set(torch.topk(logits, 5).indices.tolist())
    got = set(draws(SamplingParams(temperature=5.0, top_k=5, seed=0), logits, 400))
    assert got <= top and len(got) == 5


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    got = set(draws(SamplingParams(temperature=1.0, top_p=0.8, seed=0), logits, 400))
    assert got == {0, 1}  # 0.5 + 0.3 reaches 0.8
    got = set(draws(SamplingParams(temperature=1.0, top_p=0.81, seed=0), logits, 400))
    assert got == {0, 1, 2}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.1, seed=0), logits, 50)) == {0}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-40, seed=0),              # logits / T overflows fp32
    SamplingParams(temperature=1e-300, seed=0),
    SamplingParams(temperature=1.0, top_p=1e-300, seed=0),  # top_p rounds to 0 in fp32
    SamplingParams(temperature=1e-40, top_k=3, top_p=1e-300, seed=0),
])
def test_vanishing_temperature_or_top_p_is_greedy(params):
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(4)) * 30
    assert draws(params, logits, 20) == [int(torch.argmax(logits))] * 20


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0])
    n = 4000
    counts = torch.bincount(torch.tensor(draws(SamplingParams(temperature=1.0, seed=3), logits, n)), minlength=3)
    expected = torch.softmax(logits, 0) * n
    assert torch.all((counts - expected).abs() < 4 * expected.sqrt() + 5)


@pytest.mark.parametrize("params,field", [
    (SamplingParams(temperature=-0.5), "temperature"),
    (SamplingParams(temperature=float("nan")), "temperature"),
    (SamplingParams(top_k=-1), "top_k"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(seed=-3), "seed"),
])
def test_invalid_sampling_values_named(params, field):
    with pytest.raises(RequestError, match=field):
        params.validate()


@pytest.mark.parametrize("stop,field", [
    (StopCriteria(max_new_tokens=0), "max_new_tokens"),
    (StopCriteria(stop_token_ids=(-1,)), "stop token"),
])
def test_invalid_stop_criteria_named(stop, field):
    with pytest.raises(RequestError, match=field):
        stop.validate()
