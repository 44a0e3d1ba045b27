"""Sampler: validation, seeding, and the filters against direct computation."""
import pytest
import torch

from executor.errors import RequestError
from executor import sampling
from executor.request_params import SamplingParams, StopCriteria
from executor.sampling import NUCLEUS_PROBE, candidates, candidates_by_sorting, make_generator, sample, sample_rows


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


def _distribution(ids, probs, vocab):
    """{token: probability}, renormalised, of a sampler's candidates."""
    ids = torch.arange(vocab) if ids is None else ids
    probs = probs / probs.sum()
    return {int(i): float(p) for i, p in zip(ids, probs) if p > 0}


def _logits(kind, vocab=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g)
    if kind == "flat":          # random weights: the nucleus spans most of the vocabulary
        return x
    if kind == "peaked":        # a trained model's: a nucleus of a few tokens
        return x * 2 + torch.where(torch.arange(vocab) % 997 == 3, 12.0, 0.0)
    if kind == "medium":        # a nucleus of some hundreds of tokens
        return x * 2.5
    if kind == "ties":          # many logits equal to the k-th's (fp32 rounding of a bf16 head)
        return (x * 2).round() / 2
    if kind == "masked":        # tokens a caller masked out (-inf), the rest flat
        return torch.where(torch.arange(vocab) % 3 == 0, float("-inf"), x)
    if kind == "small":         # a vocabulary smaller than the first probe
        return x[:100] * 2
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["flat", "peaked", "medium", "ties", "masked", "small"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=0.6, top_k=20),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=3000, top_p=0.7),
    SamplingParams(temperature=1e-300, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=1 - 1e-12),
    SamplingParams(temperature=0.5, top_k=19999, top_p=0.99),
], ids=lambda p: f"T{p.temperature:g}-k{p.top_k}-p{p.top_p:g}")
def test_the_candidates_are_the_whole_vocabularys_sorted_filters(kind, params):
    """The sampler's candidates — looked for among the most likely tokens first — are the tokens
    and probabilities that the filters give over the whole vocabulary, sorted whole."""
    logits = _logits(kind)
    got = _distribution(*candidates(logits, params), len(logits))
    want = _distribution(*candidates_by_sorting(logits, params), len(logits))
    # where the nucleus ends among tied tokens, which of them it keeps is either's choice: the same
    # number, and every token more likely than the least likely kept one
    assert sorted(got.values()) == pytest.approx(sorted(want.values()), rel=1e-9, abs=1e-300)
    least = min(want.values())
    above = {t for t, p in want.items() if p > least * (1 + 1e-9)}
    assert above <= got.keys() and all(got[t] == pytest.approx(want[t], rel=1e-9) for t in above)


def test_a_large_nucleus_is_found_without_sorting_the_vocabulary(monkeypatch):
    """The cases above take each path — a nucleus within the first probe, and larger ones found
    from the mass by bucket — and ties at the k-th logit; a large nucleus sorts one bucket only."""
    sorted_sizes = []
    sort = torch.sort
    monkeypatch.setattr(sampling.torch, "sort", lambda x, **kw: (sorted_sizes.append(len(x)), sort(x, **kw))[1])
    params = SamplingParams(temperature=0.8, top_p=0.9)
    assert len(candidates(_logits("peaked"), params)[0]) < NUCLEUS_PROBE
    assert max(sorted_sizes) < NUCLEUS_PROBE                       # the probe's few, put in order
    for kind in ("medium", "flat"):
        sorted_sizes.clear()
        assert len(candidates(_logits(kind), params)[0]) > NUCLEUS_PROBE
        assert len(sorted_sizes) == 1 and sorted_sizes[0] < 20000 / 50
    ids, _ = candidates(_logits("ties"), SamplingParams(temperature=0.6, top_k=20))
    assert len(ids) > 20


@pytest.mark.parametrize("top_p", [1 - 1e-15, 1 - 2 ** -53])
def test_a_nucleus_of_almost_all_the_mass_keeps_no_token_of_none(top_p):
    """top_p · total rounding past the whole mass: the nucleus is every token of any probability,
    not the ones masked out (-inf) or below the last bucket's edge with none."""
    logits = torch.randn(151936, generator=torch.Generator().manual_seed(11))  # a seed whose sums round so
    logits[torch.arange(151936) % 20 != 0] = float("-inf")
    params = SamplingParams(temperature=1.0, top_p=top_p)
    ids, probs = candidates(logits, params)
    finite = int(torch.isfinite(logits).sum())
    assert bool((probs > 0).all()) and len(ids) == len(candidates_by_sorting(logits, params)[0]) == finite


@pytest.mark.parametrize("kept", [NUCLEUS_PROBE - 1, NUCLEUS_PROBE, NUCLEUS_PROBE + 1])
def test_a_nucleus_ending_at_the_first_probes_edge_keeps_what_a_whole_sort_keeps(kept):
    """300 equally likely tokens over a tail of unlikely ones, top_p just under `kept` of them: the
    nucleus ends just before, at or just after the first probe's last token."""
    logits = torch.full((20000,), -30.0)
    logits[torch.arange(300) * 61] = 0.0
    params = SamplingParams(temperature=1.0, top_p=(kept - 0.5) / 300)
    ids, _ = candidates(logits, params)
    assert len(ids) == len(candidates_by_sorting(logits, params)[0]) == kept
    assert set(ids.tolist()) <= set((torch.arange(300) * 61).tolist())


def test_logits_that_are_not_finite_are_an_error_not_a_token():
    for logits in (torch.tensor([0.0, float("nan"), 1.0]), torch.tensor([0.0, float("inf"), 1.0])):
        for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=0),
                       SamplingParams(temperature=1.0, top_p=0.5, seed=0), SamplingParams(temperature=1.0, top_k=2, seed=0)):
            with pytest.raises(ValueError, match="not finite"):
                sample(logits, params, make_generator(params))


def test_draws_follow_the_candidates_probabilities():
    logits = _logits("peaked", vocab=3000) / 3
    params = SamplingParams(temperature=1.0, top_k=8, top_p=0.9, seed=5)
    ids, probs = candidates_by_sorting(logits, params)
    n = 4000
    got = draws(params, logits, n)
    assert set(got) <= set(ids.tolist())
    counts = torch.tensor([got.count(int(i)) for i in ids], dtype=torch.float64)
    expected = probs * n
    assert torch.all((counts - expected).abs() < 4 * expected.sqrt() + 5)


ROW_PARAMS = [SamplingParams(), SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=1),
              SamplingParams(temperature=0.9, top_k=300, seed=2), SamplingParams(temperature=0.8, top_p=0.9, seed=3),
              SamplingParams(temperature=1.2, seed=4), SamplingParams(temperature=0.7, top_k=5, seed=5),
              SamplingParams(temperature=1.0, top_k=5000, top_p=0.8, seed=6)]   # past BATCHED_TOP_K: alone


def test_a_rows_token_depends_on_its_logits_and_seed_not_on_its_batch():
    """sample_rows takes the top-k rows' candidates from one topk over them all (as many as the
    largest k needs), the rest row by row: each row draws, round after round, what it draws alone."""
    logits = torch.stack([_logits("ties", seed=s) for s in range(len(ROW_PARAMS))])  # ties inside the top k
    batched = [make_generator(p) for p in ROW_PARAMS]
    alone = [make_generator(p) for p in ROW_PARAMS]
    for _ in range(25):
        got = sample_rows(logits, ROW_PARAMS, batched)
        assert got == [sample(row, p, g) for row, p, g in zip(logits, ROW_PARAMS, alone)]
    assert got[0] == int(torch.argmax(logits[0]))


def test_rows_share_a_topk_only_up_to_its_bound_and_take_the_global_generator_without_one(monkeypatch):
    from executor import sampling
    calls = []
    topk = torch.topk
    monkeypatch.setattr(sampling.torch, "topk", lambda x, k, **kw: (calls.append((tuple(x.shape), k)),
                                                                      topk(x, k, **kw))[1])
    logits = torch.stack([_logits("flat", seed=s) for s in range(len(ROW_PARAMS))])
    sample_rows(logits, ROW_PARAMS, [make_generator(p) for p in ROW_PARAMS])
    assert calls[0] == ((3, 20000), 301)      # the three rows of k <= BATCHED_TOP_K, at the largest of them
    assert all(k <= 1024 for _, k in calls)   # the row past it: a mask at its k-th logit, never a topk of k
    torch.manual_seed(3)
    first = sample_rows(logits[1:2], [ROW_PARAMS[1]], [None])
    torch.manual_seed(3)
    assert sample_rows(logits[1:2], [ROW_PARAMS[1]], [None]) == first


def test_top_k_candidates_come_most_likely_first_ties_by_id():
    logits = _logits("ties")
    ids, probs = candidates(logits, SamplingParams(temperature=0.6, top_k=40))
    order = sorted(range(len(ids)), key=lambda i: (-float(logits[ids[i]]), int(ids[i])))
    assert order == list(range(len(ids))) and len(set(logits[ids].tolist())) < len(ids)   # ties inside


def test_a_topk_that_orders_ties_otherwise_gives_the_same_candidates():
    """Another device's topk (or one asked for more values) may list tied logits in another order:
    the candidates come out the same, so a seeded draw does too."""
    from executor.sampling import _top_k
    logits = torch.tensor([0.0, 1.0, 4.0, 2.0, 1.0, 4.0, 3.0, 4.0, 0.5, 5.0])
    params = SamplingParams(temperature=1.0, top_k=5)
    one = _top_k(torch.tensor([5.0, 4.0, 4.0, 4.0, 3.0, 2.0]), torch.tensor([9, 7, 2, 5, 6, 3]), 5,
                 lambda: logits, params)
    other = _top_k(torch.tensor([5.0, 4.0, 4.0, 4.0, 3.0, 2.0]), torch.tensor([9, 2, 5, 7, 6, 3]), 5,
                   lambda: logits, params)
    assert one[0].tolist() == other[0].tolist() == [9, 2, 5, 7, 6] and torch.equal(one[1], other[1])


def test_a_nucleus_is_the_same_whatever_order_a_topk_gives_its_ties():
    """The probe's nucleus in a fixed order, and where it ends among tied tokens the lowest ids
    stay: another device's topk (another order of ties) changes no seeded draw."""
    from executor.sampling import _first
    probs = torch.tensor([0.1, 0.5, 0.2, 0.05, 0.2, 0.9, 0.2, 0.01], dtype=torch.float64)
    one = _first(torch.tensor([5, 1, 6, 2, 4]), torch.tensor([0.9, 0.5, 0.2, 0.2, 0.2], dtype=torch.float64), 3, probs)
    other = _first(torch.tensor([5, 1, 4, 6, 2]), torch.tensor([0.9, 0.5, 0.2, 0.2, 0.2], dtype=torch.float64), 3, probs)
    assert one[0].tolist() == other[0].tolist() == [5, 1, 2] and torch.equal(one[1], other[1])
    # and through candidates: a row of ties crossing the nucleus' end, its ids in two orders
    logits = torch.full((5000,), -20.0)
    logits[torch.arange(40) * 97] = 0.0                      # 40 equally likely tokens
    params = SamplingParams(temperature=1.0, top_p=0.3)
    ids, _ = candidates(logits, params)
    assert ids.tolist() == (torch.arange(40) * 97)[:len(ids)].tolist() and 0 < len(ids) < 40


def test_a_failing_row_leaves_every_generator_as_it_was():
    logits = torch.stack([_logits("flat", seed=s) for s in range(len(ROW_PARAMS))])
    logits[4, 7] = float("nan")          # a row without top-k, drawn after the top-k rows
    generators = [make_generator(p) for p in ROW_PARAMS]
    before = [g.get_state() for g in generators if g is not None]
    with pytest.raises(ValueError, match="not finite"):
        sample_rows(logits, ROW_PARAMS, generators)
    assert all(torch.equal(g.get_state(), b) for g, b in zip([g for g in generators if g is not None], before))


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
