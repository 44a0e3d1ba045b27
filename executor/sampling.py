"""The sampler (what a request asks for: executor/request_params.py).

Each request owns a torch.Generator seeded from its seed, so a request's tokens depend only on
its own seed and logits — never on which other requests share its batch.
"""
from __future__ import annotations

import math

import torch

from executor.request_params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


#: The most likely tokens among which the nucleus (top-p) is looked for first: a trained model's
#: nucleus is usually a few dozen tokens. A larger one is found from the mass of the probabilities
#: by their log2, in NUCLEUS_BUCKETS_PER_OCTAVE buckets an octave (the most likely first, down to
#: 2^-NUCLEUS_OCTAVES of the top token's; all smaller ones share the last): only the bucket where
#: the mass reaches top_p is sorted, not the whole vocabulary (tools/bench_sampling.py times
#: both) — unless most of it is within 1/64 of an octave of the top token.
NUCLEUS_PROBE = 256
NUCLEUS_BUCKETS_PER_OCTAVE, NUCLEUS_OCTAVES = 64, 64


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from next-token logits [V] (fp32)."""
    return sample_rows(logits[None], [params], [generator])[0]


#: Top-k rows of a step share one topk over them all where k is at most this: a row asking for
#: more candidates would make every row's topk (and its copy to the host) that large.
BATCHED_TOP_K = 1024


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of next-token logits [R, V] (fp32, on the device the last stage left
    them on), row r by params[r] with generators[r] (None: torch's global generator). The work
    that reads whole rows runs there: the greedy rows' argmax and one topk over the top-k rows
    (k <= BATCHED_TOP_K), each over all of them at once, only their ids and candidates crossing
    to the host; the other sampled rows filtered there one by one (`candidates`). Each
    draw takes its own row's generator, so a row's token depends on its logits and seed alone; and
    where any row fails (logits not finite), every generator is put back as it was before the
    error is raised, so a retry draws the same."""
    tokens = [0] * len(params)
    vocab = logits.shape[-1]
    greedy = [r for r, p in enumerate(params) if p.greedy]
    top_k = [r for r, p in enumerate(params) if not p.greedy and _shares_a_topk(p, vocab)]
    rest = [r for r, p in enumerate(params) if not p.greedy and r not in top_k]
    # launched together, then copied
    best = _rows(logits, greedy, len(params)).max(-1) if greedy else None
    k_most = max((params[r].top_k for r in top_k), default=0)
    found = torch.topk(_rows(logits, top_k, len(params)), k_most + 1) if top_k else None
    rows = _rows(logits, rest, len(params)) if rest else None
    if best is not None:
        for value in best.values.tolist():
            _check_finite(value)
        for r, token in zip(greedy, best.indices.tolist()):  # the first of equal maxima, as argmax
            tokens[r] = token
    states = [(g, g.get_state()) for g in (generators[r] for r in top_k + rest) if g is not None]
    try:
        if found is not None:
            values, ids = found.values.cpu(), found.indices.cpu()
            for j, r in enumerate(top_k):
                k = params[r].top_k
                chosen = _top_k(values[j, :k + 1], ids[j, :k + 1], k, lambda: logits[r].cpu(), params[r])
                tokens[r] = _draw(*chosen, generators[r])
        if rows is not None:  # where they are: from a GPU stage, no row of logits crosses to the host
            for j, r in enumerate(rest):
                tokens[r] = _draw(*candidates(rows[j], params[r]), generators[r])
    except BaseException:
        for generator, state in states:
            generator.set_state(state)
        raise
    return tokens


def _shares_a_topk(params: SamplingParams, vocab: int) -> bool:
    """A top-k that filters, small enough for a topk of k + 1 (a larger one is a mask at its k-th logit)."""
    return 0 < params.top_k < vocab and params.top_k <= BATCHED_TOP_K


def _rows(logits: torch.Tensor, rows: list[int], count: int) -> torch.Tensor:
    return logits if len(rows) == count else logits[torch.tensor(rows, device=logits.device)]


def _draw(ids: torch.Tensor | None, probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Inverse CDF: the first candidate whose cumulative probability passes u · total (one with
    probability 0 never: the CDF does not rise there)."""
    cdf = torch.cumsum(probs, 0)
    u = torch.rand((), dtype=torch.float64, generator=generator)
    at = min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), len(cdf) - 1)
    return int(ids[at]) if ids is not None else at


def candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(token ids, probabilities) a sampled token is drawn from: softmax(logits / temperature)
    restricted to the top_k most likely tokens (all tokens tied with the k-th included) and then to
    the smallest set of them, most likely first, whose mass reaches top_p (the most likely always
    stays); probabilities not renormalised. ids None: every token, in id order (those a top_k over
    BATCHED_TOP_K leaves out with probability 0); otherwise in an
    order fixed by the logits alone (most likely first, ties by id, but for a large nucleus: by
    bucket of probability, then id), and of tokens tied at a cut the lowest ids stay: so neither
    the device nor another topk's order of ties changes a seeded draw. ValueError where the
    logits are not finite (NaN, +inf)."""
    vocab = logits.shape[-1]
    if _shares_a_topk(params, vocab):
        values, ids = torch.topk(logits, params.top_k + 1)
        return _top_k(values, ids, params.top_k, lambda: logits, params)
    best = logits.max()
    _check_finite(best)
    scores = _scores(logits, best, params.temperature)
    if BATCHED_TOP_K < params.top_k < vocab:
        # a large top-k: a mask at the k-th largest logit (found in linear time; its ties stay),
        # where sorting k of them would cost a whole-vocabulary sort a token
        kth = torch.kthvalue(logits, vocab - params.top_k + 1).values
        scores = scores.masked_fill(logits < kth, float("-inf"))
    probs = torch.exp(scores)
    if params.top_p >= 1.0:
        return None, probs
    total = probs.sum()
    if NUCLEUS_PROBE < vocab:
        values, ids = torch.topk(probs, NUCLEUS_PROBE)
        n = _nucleus(values, total, params.top_p)
        if n < NUCLEUS_PROBE:
            return _first(ids, values, n, probs)
    if logits.device.type != "cpu":  # the buckets' mass adds up in a fixed order on the host only
        return candidates(logits.cpu(), params)
    return _nucleus_by_mass(scores, probs, total, params.top_p)


def _first(ids: torch.Tensor, values: torch.Tensor, n: int, probs: torch.Tensor):
    """The n most likely of a topk's (ids, values) (values descending) in canonical order; where
    the n-th ties with the one after it, the tied tokens that stay are the lowest ids, read from
    the whole row `probs`."""
    last = values[n - 1]
    if n < len(values) and values[n] == last:
        above = ids[:n][values[:n] > last]
        tied = torch.nonzero(probs == last).squeeze(1)[:n - len(above)]
        ids = torch.cat([above, tied])
        return _canonical(ids, probs[ids])
    return _canonical(ids[:n], values[:n])


def _canonical(ids: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, values) most likely first, ties by id, whatever order they came in."""
    ids, by_id = torch.sort(ids)
    values, order = torch.sort(values[by_id], descending=True, stable=True)
    return ids[order], values


def _top_k(values: torch.Tensor, ids: torch.Tensor, k: int, row, params: SamplingParams):
    """`candidates` of a top-k row from its k + 1 largest logits (values descending, with their
    ids): the k best, or every token tied with the k-th, read from row() (the whole row), then the
    nucleus among them. In a canonical order (most likely first, ties by id), so that where the
    topk ran, and with how many more, changes no seeded draw."""
    _check_finite(values[0])
    if values[k] == values[k - 1]:  # ties with the k-th: all of them
        logits = row()
        ids = torch.nonzero(logits >= values[k - 1]).squeeze(1)
        ids, values = _canonical(ids, logits[ids])
    else:
        ids, values = _canonical(ids[:k], values[:k])
    probs = torch.exp(_scores(values, values[0], params.temperature))
    n = _nucleus(probs, probs.sum(), params.top_p)
    return ids[:n], probs[:n]


def _check_finite(best: torch.Tensor | float) -> None:
    """NaN anywhere makes the maximum NaN; +inf makes it infinite."""
    if not math.isfinite(float(best)):
        raise ValueError("the logits are not finite: nothing to sample from")


def _scores(logits: torch.Tensor, best: torch.Tensor, temperature: float) -> torch.Tensor:
    """(logits - best) / temperature in float64, best the largest logit: the log of each token's
    probability relative to the best's. In float64 and shifted by the maximum: any temperature > 0
    is a valid double, but in fp32 a tiny one (1e-300) is 0 and one of 1e-40 makes the raw quotient
    overflow, so softmax gave NaN. Shifted, the best token scores 0 and the rest tend to -inf:
    greedy, as the limit should be."""
    return (logits.to(torch.float64) - float(best)) / temperature


def _nucleus(probs: torch.Tensor, total: torch.Tensor, top_p: float, before: float = 0.0) -> int:
    """How many of `probs` (most likely first, of a distribution whose mass is `total`, after
    `before` of its mass in tokens more likely still) the nucleus keeps: those whose preceding mass
    stays below top_p (the first of all, at least). len(probs) where it never reaches top_p within
    them, so a caller can tell it may go on further."""
    if top_p >= 1.0:
        return len(probs)
    preceding = before + torch.cumsum(probs, 0) - probs
    reached = torch.nonzero(preceding >= top_p * total)
    first = int(reached[0]) if len(reached) else len(probs)
    return max(first, 1) if before == 0.0 else first


def _nucleus_by_mass(scores: torch.Tensor, probs: torch.Tensor, total: torch.Tensor, top_p: float):
    """The nucleus of a whole vocabulary without sorting it: the probabilities' mass by bucket of
    their log2 (bucket 0 the most likely), the bucket where the mass reaches top_p found from its
    running sum; the tokens of every bucket before it are kept whole, those of that bucket by
    `_nucleus` after sorting it alone. Bucket order is probability order, so this keeps what a
    whole sort would."""
    buckets = NUCLEUS_BUCKETS_PER_OCTAVE * NUCLEUS_OCTAVES
    # -scores / ln 2 is -log2 of the probability relative to the best (0 for it, +inf for none)
    bucket = (scores * (-NUCLEUS_BUCKETS_PER_OCTAVE / math.log(2))).clamp_(max=buckets - 1).long()
    mass = torch.bincount(bucket, weights=probs, minlength=buckets)
    reached = torch.cumsum(mass, 0)
    # the first bucket to reach it; the last with any mass where rounding puts top_p · total past all
    edge = min(int(torch.searchsorted(reached, top_p * total)), int(torch.nonzero(mass).max()))
    before = float(reached[edge - 1]) if edge else 0.0
    whole = torch.nonzero(bucket < edge).squeeze(1)
    at_edge = torch.nonzero((bucket == edge) & (probs > 0)).squeeze(1)  # not tokens of no mass
    values, order = torch.sort(probs[at_edge], descending=True, stable=True)  # ties by id
    n = _nucleus(values, total, top_p, before)
    return torch.cat([whole, at_edge[order[:n]]]), torch.cat([probs[whole], values[:n]])


def candidates_by_sorting(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """`candidates`' reference twin, written for clarity, not speed: masks over the whole
    vocabulary, sorted whole for top_p (what the sampler did before it looked among the most
    likely tokens first). → (token ids, renormalised probabilities), in id order. Tests and
    tools/bench_sampling.py compare `candidates` against it."""
    logits = logits.to(torch.float64)
    scores = (logits - logits.max()) / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        drop = torch.cumsum(probs, dim=-1) - probs >= params.top_p
        drop[0] = False
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    ids = torch.nonzero(scores > float("-inf")).squeeze(1)
    return ids, probs[ids]
