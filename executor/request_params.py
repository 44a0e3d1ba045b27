"""What a request asks for: how to sample its tokens and when to stop. Plain values, light to
import: the client commands use them without loading torch (executor/sampling.py draws them)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

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
