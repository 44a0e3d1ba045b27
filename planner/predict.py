"""A plan's cost model evaluated for other steps than the one it was made for: what the executor
compares its measurements against (executor.report.Recorder) and what recalibration fits
(planner.fit). One function per question, one place that spells out the cost model's inputs."""
from __future__ import annotations

from dataclasses import dataclass, replace

from planner.cost import streamed_riders_ms
from planner.step_shape import streams
from planner.machine import Calibration
from planner.plan import Plan, Prediction
from planner.planning import plan_space, prediction_of
from planner.search import evaluate_at


def predict(plan: Plan, context_tokens: int, batch_size: int | None = None, prefix_tokens: int = 0,
            logits: bool = True) -> Prediction:
    """The plan's cost model evaluated for one decode step at another context length / batch;
    its prefill figures are for the workload's prompt_tokens after `prefix_tokens` cached ones,
    taken in the executor's steps (one step where they fit in one: a chunk of a longer prompt)."""
    batch = batch_size or plan.workload.batch_size
    space = replace(plan_space(plan), batch=batch, context=context_tokens)
    cost = evaluate_at(plan.partition.split_k, plan.ir.units, plan.ir.shared_weights, plan.machine, space,
                       plan.calibration, prefix=prefix_tokens, logits=logits)
    return prediction_of(cost, replace(plan.workload, batch_size=batch), context_tokens)


def predict_ttft_ms(plan: Plan, prompt_tokens: int) -> float:
    """The plan's time to first token for a prompt of `prompt_tokens` at batch 1, prefilled the way
    the executor does it (planner.step_shape.prompt_steps): in prompt chunks, or in the plan's
    streamed steps where they stream, each after the steps before it, the logits computed by the
    last one only (cost.evaluate_split prices a plan's own prompt so)."""
    return predict(replace(plan, workload=replace(plan.workload, prompt_tokens=prompt_tokens)),
                   max(1, prompt_tokens), 1).ttft_ms


@dataclass(frozen=True)
class StepCost:
    """One engine step's predicted time per stage, as the executor measures it."""
    stages: tuple[tuple[float, float], ...]   # per stage: (ms with its overheads·δ, roofline ms before δ)
    link_ms: float                            # the hand-off; the receiving stage's clock includes it
    # per stage: the per-block overheads δ the step pays (n_blocks; times the sub-steps the GPU
    # stage takes a streamed prompt step in)
    overheads: tuple[float, ...]


AS_PLANNED = "as planned"  # predict_step's streaming policy: the plan's own


def predict_step(plan: Plan, phase: str, context: float, batch: float, tokens: float,
                 calibration: Calibration | None = None, stream_prefill: bool | int | str = AS_PLANNED,
                 riders: float = 0, rider_context: float = 0) -> StepCost:
    """The cost model for one executor step of `plan` (with `calibration`, default the plan's).
    Decode: `batch` sequences at mean context `context`. Prefill (a step with prompt chunks):
    `batch` chunks of tokens/batch tokens each, ending at `context` on average, so each after the
    cached prefix that implies (the step's decodes, a few tokens, are left out). Arguments may be
    means over many steps (recalibration's rows), hence floats. stream_prefill: the CPU stage's
    prompt steps streamed to the GPU from that many tokens, or never (False), where the executor
    runs another policy than the plan's (it could not page-lock the weights, say). riders: the
    decodes in a prefill step, attending over rider_context cached tokens in all: left out, but
    where the step streams they copy their K/V over the link (cost.streamed_riders_ms)."""
    decode = phase == "decode"
    chunk = max(1.0, tokens / max(batch, 1.0))
    space = replace(plan_space(plan), batch=batch, context=context if decode else max(context, 1.0),
                    prompt=plan.workload.prompt_tokens if decode else chunk, prompt_in_steps=False)
    if stream_prefill != AS_PLANNED:
        space = replace(space, stream_prefill=stream_prefill)
    cost = evaluate_at(plan.partition.split_k, plan.ir.units, plan.ir.shared_weights, plan.machine, space,
                       calibration or plan.calibration, prefix=0 if decode else max(0.0, context - chunk),
                       riders=0 if decode else riders)
    if decode:
        return StepCost(tuple((s.ms, s.roofline_ms) for s in cost.stages), cost.comm_ms,
                        tuple(float(s.num_blocks) for s in cost.stages))
    stages = [(s.prefill_ms, s.prefill_roofline_ms) for s in cost.stages]
    if riders and streams(tokens, cost.stream_prefill_min_rows):
        k = plan.partition.split_k
        extra = streamed_riders_ms(plan.ir.units[:k], plan.machine.link, riders, rider_context)
        stages[0] = (stages[0][0] + extra, stages[0][1] + extra)  # the CPU stage: stage 0
    return StepCost(tuple(stages), cost.comm_prefill_ms, tuple(s.prefill_overheads for s in cost.stages))
