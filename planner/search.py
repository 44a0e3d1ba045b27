"""The split search: enumerate every k in 0..N, score it, keep the feasible one that serves the
workload's request fastest: its prompt, then a decode step per further token (SplitCost.request_ms).
Decode is most of that, but not all: where a split leaves no VRAM for the streamed prompt steps'
ring, its prompts run on the CPU, which a few % of decode speed elsewhere does not make up for.

Boring on purpose (FlexGen): no pruning, every candidate recorded so a reviewer sees why k won.
Ties go to the larger k (same speed, more VRAM left free), which also keeps the choice monotone
where no split streams its prompts: a tighter VRAM budget never moves units from the CPU to the
GPU. Where prompt steps stream, the streamed steps' ring (and their size, and with KV offload the
pages parked) compete for the VRAM with the KV pages, and a tighter budget can move the choice
either way: taking the ring from the split that streamed leaves the prompts to the CPU, where a
split with fewer units there computes them sooner.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.cost import SplitCost, evaluate_split
from planner.machine import Calibration, MachineProfile
from planner.ir import SharedWeight, UnitIR


@dataclass(frozen=True)
class SearchSpace:
    """Inputs of the search other than the model and the machine."""
    batch: int
    context: int
    prompt: int
    page_size_tokens: int
    watermark: float
    offload: bool
    gpu_budget_bytes: int
    host_budget_bytes: int
    dtype: str | None = None    # the weights' (selects the CPU kernels' measured rates)
    # The CPU stage's prompt steps streamed to the GPU: True, from where the cost model prices it
    # faster (the search); False, never; a number, from that many tokens (an existing plan's policy)
    stream_prefill: bool | int = True
    # the most tokens a streamed step takes: None, as many as fit beside the split at its context
    # (the search); a number, an existing plan's
    stream_step_tokens: int | None = None
    # the step the GPU stage is priced for, which it takes a streamed step in sub-steps of: None,
    # this space's (step_shape.step_tokens at its batch and context); a number, an existing plan's
    priced_step_tokens: int | None = None
    # tokens a request of the workload generates: with KV offload a split takes the layout (the
    # ring, pages parked) that serves such a request soonest; None: the first that fits (an
    # existing plan's)
    new_tokens: int | None = None
    # the prefill figures for a request's whole prompt, in the executor's steps (a plan's TTFT);
    # False: for one step of `prompt` tokens (predict.predict_step's)
    prompt_in_steps: bool = False
    # --latency-bound (ms per decode step): with offload, a split's layouts within it rank first
    latency_bound_ms: float | None = None


def evaluate_at(k: int, units: tuple[UnitIR, ...], shared: tuple[SharedWeight, ...], machine: MachineProfile,
                space: SearchSpace, calibration: Calibration | None = None, prefix: float = 0,
                logits: bool = True, riders: float = 0) -> SplitCost:
    """Score split k (units [0, k) on the CPU) in `space`; `prefix`, `logits`, `riders`: see
    evaluate_split."""
    return evaluate_split(k, units, shared, machine, batch=space.batch, context=space.context,
                          prompt=space.prompt, page_size_tokens=space.page_size_tokens,
                          watermark=space.watermark, offload=space.offload,
                          gpu_budget_bytes=space.gpu_budget_bytes, host_budget_bytes=space.host_budget_bytes,
                          calibration=calibration, prefix=prefix, dtype=space.dtype, logits=logits,
                          stream_prefill=space.stream_prefill, stream_step_tokens=space.stream_step_tokens,
                          priced_rows=space.priced_step_tokens, riders=riders, new_tokens=space.new_tokens,
                          prompt_in_steps=space.prompt_in_steps, bound_ms=space.latency_bound_ms)


def evaluate_all(units: tuple[UnitIR, ...], shared: tuple[SharedWeight, ...], machine: MachineProfile,
                 space: SearchSpace, calibration: Calibration | None = None) -> tuple[SplitCost, ...]:
    """Score every split k = 0 (all GPU) .. N (all CPU)."""
    return tuple(evaluate_at(k, units, shared, machine, space, calibration) for k in range(len(units) + 1))


def best_split(candidates: tuple[SplitCost, ...], new_tokens: int,
               bound_ms: float | None = None) -> SplitCost | None:
    """The feasible candidate that serves a request of `new_tokens` fastest (ties: larger k),
    among those whose decode step is within `bound_ms` where one is given (--latency-bound);
    None when there is none."""
    feasible = [c for c in candidates if c.feasible and (bound_ms is None or c.ms <= bound_ms)]
    if not feasible:
        return None
    return min(feasible, key=lambda c: (c.request_ms(new_tokens), -c.split_k))
