"""Sampling parameters, stopping criteria, and the sampler.

Each request owns a torch.Generator seeded from its seed, so a request's tokens depend only on
its own seed and logits — never on which other requests share its batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from executor.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int | None = None  # None: a fresh random seed per request

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_pb(cls, msg) -> "SamplingParams":
        """From a helm.executor.v1.SamplingParameters (unset top_p: 1, unset seed: random)."""
        return cls(temperature=msg.temperature, top_k=msg.top_k,
                   top_p=msg.top_p if msg.HasField("top_p") else 1.0,
                   seed=msg.seed if msg.HasField("seed") else None)

    def validate(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")


@dataclass(frozen=True)
class StopCriteria:
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @classmethod
    def from_pb(cls, msg) -> "StopCriteria":
        """From a helm.executor.v1.StoppingCriteria (unset max_new_tokens: the default; stop
        strings are the daemon's, not the engine's)."""
        return cls(max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else cls.max_new_tokens,
                   stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos)

    def validate(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise RequestError(f"stop token ids must be non-negative integers, got {t!r}")


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


#: Sizes of the most likely tokens among which the nucleus (top-p) is looked for before the whole
#: vocabulary is sorted: a trained model's nucleus is usually a few hundred tokens, and sorting a
#: vocabulary of 10^5 logits takes milliseconds a token on a CPU (tools/bench_sampling.py).
NUCLEUS_PROBES = (256, 4096)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from next-token logits [V] (fp32, CPU)."""
    if params.greedy:
        return int(torch.argmax(logits))
    ids, probs = candidates(logits, params)
    # inverse CDF: the first candidate whose cumulative probability passes u · total (one with
    # probability 0 never: the CDF does not rise there)
    cdf = torch.cumsum(probs, 0)
    total = cdf[-1]
    if not (math.isfinite(total) and total > 0):
        raise ValueError("the logits are not finite: nothing to sample from")
    u = torch.rand((), dtype=torch.float64, generator=generator)
    at = min(int(torch.searchsorted(cdf, u * total, right=True)), len(cdf) - 1)
    return int(ids[at]) if ids is not None else at


def candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(token ids, probabilities) a sampled token is drawn from: softmax(logits / temperature)
    restricted to the top_k most likely tokens (all tokens tied with the k-th included) and then to
    the smallest set of them, most likely first, whose mass reaches top_p (the most likely always
    stays); probabilities not renormalised. ids None: every token, in id order. The tokens are
    chosen on the logits as they are (the scores' order); only the candidates are exponentiated
    where top_k leaves few."""
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        k = params.top_k
        values, ids = torch.topk(logits, k + 1)
        if values[k] == values[k - 1]:  # ties with the k-th: all of them
            ids = torch.nonzero(logits >= values[k - 1]).squeeze(1)
            values, order = torch.sort(logits[ids], descending=True, stable=True)
            ids = ids[order]
        else:
            values, ids = values[:k], ids[:k]
        probs = _scaled_exp(values, values[0], params.temperature)
        n = _nucleus(probs, probs.sum(), params.top_p)
        return ids[:n], probs[:n]
    probs = _scaled_exp(logits, logits.max(), params.temperature)
    if params.top_p >= 1.0:
        return None, probs
    total = probs.sum()
    for m in (*[m for m in NUCLEUS_PROBES if m < vocab], vocab):
        values, ids = torch.topk(probs, m) if m < vocab else torch.sort(probs, descending=True)
        n = _nucleus(values, total, params.top_p)
        if n < m or m == vocab:
            return ids[:n], values[:n]
    raise AssertionError("unreachable")


def _scaled_exp(logits: torch.Tensor, best: torch.Tensor, temperature: float) -> torch.Tensor:
    """exp((logits - best) / temperature) in float64, best the largest logit. In float64 and
    shifted by the maximum: any temperature > 0 is a valid double, but in fp32 a tiny one (1e-300)
    is 0 and one of 1e-40 makes the raw quotient overflow, so softmax gave NaN. Shifted, the best
    token scores 0 and the rest tend to -inf: greedy, as the limit should be."""
    return torch.exp((logits.to(torch.float64) - float(best)) / temperature)


def _nucleus(probs: torch.Tensor, total: torch.Tensor, top_p: float) -> int:
    """How many of `probs` (most likely first, of a distribution whose mass is `total`) the
    nucleus keeps: up to the first whose preceding mass reaches top_p (at least one). Returns
    len(probs) where their mass never reaches it, so the caller can tell it may go on further."""
    if top_p >= 1.0:
        return len(probs)
    before = (torch.cumsum(probs, 0) - probs) / total
    reached = torch.nonzero(before[1:] >= top_p)
    return int(reached[0]) + 1 if len(reached) else len(probs)


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
