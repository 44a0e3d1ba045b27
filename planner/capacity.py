"""The longest context a split can serve: the thesis' headline figure, stated in every plan.

Contexts are whole pages (the KV cache's unit of allocation), so the figure is a multiple of the
page size unless the model's limit caps it, also with a latency bound, which the step's time
could meet for a few tokens more. A split serves a context when its KV pages fit (DESIGN §5 feasibility, the one rule in
planner/cost.py): the GPU stage's pages in the VRAM left after its weights and working set (with
KV offload, the pages that do not fit parked in pinned host memory), the CPU stage's pages
and the parked ones in the host RAM left after the CPU stage's weights and working set, for every
sequence of the batch. The
context is also capped by the model's position limit. Feasibility only changes at page
boundaries and only gets harder as the context grows (the stages' working sets, planner/working_set.py,
grow with it too), so a binary search over the number of pages
finds the longest one; with a latency bound the predicted ms/token, which grows with the context,
must stay within it as well.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.machine import Calibration, MachineProfile
from planner.search import SearchSpace, evaluate_at
from planner.ir import SharedWeight, UnitIR

UNKNOWN_MODEL_LIMIT = 1 << 24   # a config without max_position_embeddings: search up to 16M tokens


@dataclass(frozen=True)
class LongestContext:
    """The longest context (tokens per sequence) the plan's split serves at its batch size."""
    batch_size: int
    model_max_tokens: int                # the model's max_position_embeddings (0: the config has none)
    without_offload_tokens: int          # every KV page on its stage's device (0: not even one page fits)
    without_offload_bound: str           # what stops it: the model's limit, or the memory that runs out
    with_offload_tokens: int             # GPU-stage pages that do not fit parked in pinned host memory
    with_offload_bound: str              # (the same as without when the split has no GPU stage)


def model_max_tokens(config: dict) -> int:
    """The model's position limit from its config (text_config for multimodal wrappers); 0 if none."""
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def longest_at(k: int, units: tuple[UnitIR, ...], shared: tuple[SharedWeight, ...], machine: MachineProfile,
               space: SearchSpace, calibration: Calibration, model_max: int,
               bound_ms: float | None = None) -> tuple[int, str]:
    """(tokens, what stops it) for split k in `space` (its batch, budgets and offload setting): the
    longest context whose KV fits and, with `bound_ms`, whose predicted decode step stays within it."""
    tokens, why, _ = _longest(k, units, shared, machine, space, calibration, model_max, bound_ms)
    return tokens, why


def _longest(k, units, shared, machine, space, calibration, model_max, bound_ms) -> tuple[int, str, float | None]:
    """longest_at, plus the ms/token of one page when only the latency bound refuses it."""
    page = space.page_size_tokens
    limit = model_max or UNKNOWN_MODEL_LIMIT

    def check(pages: int) -> tuple[bool, str, float | None]:
        at = replace(space, context=min(pages * page, limit), latency_bound_ms=bound_ms)
        cost = evaluate_at(k, units, shared, machine, at, calibration)
        if not cost.feasible:
            return False, cost.reason, None
        if bound_ms is not None and cost.ms > bound_ms:
            return False, f"{cost.ms:.4g} ms/token > the {bound_ms:g} ms bound", cost.ms
        return True, "", None

    top = math.ceil(limit / page)
    ok, why, _ = check(top)
    if ok:
        return limit, (f"the model's max_position_embeddings ({model_max})" if model_max
                       else f"the search's {UNKNOWN_MODEL_LIMIT} tokens (the config has no max_position_embeddings)"), None
    ok, why_first, slow_ms = check(1)
    if not ok:
        return 0, why_first, slow_ms
    lo, hi = 1, top                        # check(lo) holds, check(hi) fails for `why`
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok, reason, _ = check(mid)
        if ok:
            lo = mid
        else:
            hi, why = mid, reason
    return lo * page, why, None


def longest_context(k: int, units: tuple[UnitIR, ...], shared: tuple[SharedWeight, ...], machine: MachineProfile,
                    space: SearchSpace, calibration: Calibration, model_max: int) -> LongestContext:
    """What a plan states: split k's longest context with and without KV offload."""
    plain, plain_bound = longest_at(k, units, shared, machine, replace(space, offload=False), calibration, model_max)
    if k < len(units) and machine.has_gpu:
        off, off_bound = longest_at(k, units, shared, machine, replace(space, offload=True), calibration, model_max)
    else:
        off, off_bound = plain, plain_bound
    return LongestContext(batch_size=space.batch, model_max_tokens=model_max, without_offload_tokens=plain,
                          without_offload_bound=plain_bound, with_offload_tokens=off, with_offload_bound=off_bound)


def longest_any_split(units: tuple[UnitIR, ...], shared: tuple[SharedWeight, ...], machine: MachineProfile,
                      space: SearchSpace, calibration: Calibration, model_max: int, bound_ms: float | None = None,
                      splits: range | None = None) -> tuple[int, int | None, str]:
    """(tokens, k, what stops it): the longest context any split in `splits` (default: all) serves in
    `space`, with its predicted decode step within `bound_ms` when given; k None when none serves
    one page (the reason then names the fastest split the bound refused, if any, else the last)."""
    best, best_k, best_why = 0, None, "no split fits one KV page"
    fastest_refused: tuple[float, int] | None = None
    for k in splits if splits is not None else range(len(units) + 1):
        if k < len(units) and not machine.has_gpu:
            continue
        tokens, why, slow_ms = _longest(k, units, shared, machine, space, calibration, model_max, bound_ms)
        if tokens > best:
            best, best_k, best_why = tokens, k, why
        elif best_k is None:
            best_why = why
            if slow_ms is not None and (fastest_refused is None or slow_ms < fastest_refused[0]):
                fastest_refused = (slow_ms, k)
    if best_k is None and fastest_refused is not None:
        best_why = (f"the fastest split that fits one page, k={fastest_refused[1]}, predicts "
                    f"{fastest_refused[0]:.4g} ms/token > the {bound_ms:g} ms bound")
    return best, best_k, best_why
