"""Measured versus predicted step time, recorded by the executor (DESIGN §7-8).

Every engine step gives, per stage, the measured wall time with the step's phase, context
length, batch and tokens; `Recorder` pairs it with the time the plan's cost model predicts for
that same step (planner.predict.predict_step) and aggregates per stage, phase and power-of-two
context bucket into a planner.report.Report, the format recalibration reads. Prompt steps a CPU
stage streamed to the GPU get rows of their own: they time the link and the GPU, and a bucket's
means over both kinds of step would model neither.
"""
from __future__ import annotations

import functools
import random
import threading
import time
from dataclasses import dataclass

from planner.plan import Plan
from planner.predict import AS_PLANNED, predict_step
from planner.report import PHASES, PlanSummary, Report, ReportRow, context_bucket
from planner.step_shape import streams

PERCENTILE_SAMPLE = 4096  # steps kept per row for p50/p99 (a uniform reservoir); means use every step


def kernel_isa(model) -> str:
    """The CPU kernels a loaded model uses, with their instruction set: it belongs with every
    measurement ("helm-avx512", "torch", or "none" without a CPU stage)."""
    backends = {s.backend for s in model.stages if s.device.type == "cpu"}
    if "helm" in backends:
        from executor.kernels import KERNEL_ISA

        return f"helm-{KERNEL_ISA}"
    return "torch" if backends else "none"


@dataclass(frozen=True)
class StagePredicted:
    ms: float                          # roofline + overheads·δ (+ the link for the receiving stage)
    roofline_ms: float
    overheads: float = 0.0             # the per-block overheads δ: n_blocks, or more in sub-steps


class _Row:
    """Running sums of one (stage, phase, bucket) plus a reservoir of measured times."""

    def __init__(self, rng: random.Random):
        self.n = 0
        self.sums = [0.0] * 7  # measured, predicted, roofline, context, batch, tokens, overheads
        self.sample: list[float] = []
        self._rng = rng

    def add(self, measured, predicted, roofline, context, batch, tokens, overheads) -> None:
        self.n += 1
        for i, v in enumerate((measured, predicted, roofline, context, batch, tokens, overheads)):
            self.sums[i] += v
        if len(self.sample) < PERCENTILE_SAMPLE:
            self.sample.append(measured)
        else:
            j = self._rng.randrange(self.n)
            if j < PERCENTILE_SAMPLE:
                self.sample[j] = measured


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Recorder:
    """Measured and predicted time of every step of one plan. `record` runs on the engine
    thread, `report` on any thread."""

    def __init__(self, plan: Plan, source: str, architecture: str, kernel_isa: str,
                 stream_prefill: bool | int | str = AS_PLANNED):
        """stream_prefill: the policy the loaded model runs for its CPU stage's prompt steps, where
        not the plan's (LoadedModel.stream_prefill): what it is measured against, and what the
        report says ran."""
        self.plan = plan
        self.stream_prefill = stream_prefill
        self.summary = PlanSummary.of(plan, source)
        self.architecture = architecture
        self.kernel_isa = kernel_isa
        self._stages = plan.partition.stages
        self._rows: dict[tuple[int, str, int, bool], _Row] = {}  # (stage, phase, bucket, streamed)
        self._steps = 0
        self._rng = random.Random(0)
        self._lock = threading.Lock()
        self.predict = functools.lru_cache(maxsize=4096)(self._predict)
        # the load's CPU-stage prompt steps of at least this many tokens stream (None: none do)
        ran = plan.partition.stream_prefill_min_rows if stream_prefill == AS_PLANNED else stream_prefill
        self.streams_from = int(ran) if ran else None

    def _predict(self, phase: str, context: int, batch: int, tokens: int, riders: int = 0,
                 rider_context: int = 0) -> tuple[StagePredicted, ...]:
        """The cost model's time per stage for one step (planner.predict.predict_step); the link
        term goes to the stage that receives the hidden state (its clock includes the copy)."""
        step = predict_step(self.plan, phase, context, batch, tokens, stream_prefill=self.stream_prefill,
                            riders=riders, rider_context=rider_context)
        return tuple(StagePredicted(ms + (step.link_ms if i else 0.0), roof + (step.link_ms if i else 0.0), n)
                     for i, ((ms, roof), n) in enumerate(zip(step.stages, step.overheads)))

    def attach(self, engine) -> None:
        """Record every step `engine` (an executor.engine.Engine) runs from now on, each predicted
        while its device work runs (`prepare`)."""
        engine.on_launched = self.prepare
        engine.on_step = self.record_step

    def prepare(self, step) -> None:
        """Predict a step whose times are not known yet (Engine.on_launched): on the host while a
        GPU stage computes it, where it would otherwise delay the next step; `record_step` then
        finds the prediction made."""
        self.record_step(step, store=False)

    def record_step(self, step, store: bool = True) -> tuple[StagePredicted, ...]:
        """Store one engine step (an executor.engine.StepRecord; `store` False: only predict it);
        return what the plan predicted."""
        if not store:
            return self.predict(step.phase, step.context, step.batch, step.tokens, step.riders, step.rider_context)
        return self.record(step.phase, step.context, step.batch, step.tokens, tuple(t.ms for t in step.stages),
                           step.streamed, step.riders, step.rider_context)

    def record(self, phase: str, context: int, batch: int, tokens: int, measured_ms: tuple[float, ...],
               streamed: bool | None = None, riders: int = 0, rider_context: int = 0) -> tuple[StagePredicted, ...]:
        """Store one step (measured ms per stage; `streamed`: a CPU stage streamed it to the GPU,
        None: as the load's policy has it; `riders`: a prefill step's decodes, copying
        `rider_context` cached tokens where it streams); return what the plan predicted for it.
        The row keeps the step's prompt chunks' means, its prediction what the step ran, decodes
        riding along included."""
        predicted = self.predict(phase, context, batch, tokens, riders, rider_context)
        if streamed is None:  # the executor's rule, as the cost model prices it (streamed_prefill accepts)
            streamed = phase == "prefill" and streams(tokens, self.streams_from)
        lo, _ = context_bucket(context)
        key = (phase, lo, bool(streamed))
        with self._lock:
            self._steps += 1
            for i, (ms, p) in enumerate(zip(measured_ms, predicted)):
                row = self._rows.get((i, *key))
                if row is None:
                    row = self._rows[(i, *key)] = _Row(self._rng)
                row.add(ms, p.ms, p.roofline_ms, context, batch, tokens, p.overheads)
        return predicted

    def report(self) -> Report:
        rows = []
        with self._lock:
            order = sorted(self._rows, key=lambda key: (key[0], PHASES.index(key[1]), key[2], key[3]))
            for (i, phase, lo, streamed), row in ((key, self._rows[key]) for key in order):
                measured, predicted, roofline, context, batch, tokens, overheads = (s / row.n for s in row.sums)
                stage = self._stages[i]
                rows.append(ReportRow(
                    stage=i, device=stage.device, num_blocks=stage.num_blocks, phase=phase, context_min=lo,
                    context_max=2 * lo, samples=row.n, context_mean=context, batch_mean=batch, tokens_mean=tokens,
                    measured_mean_ms=measured, measured_p50_ms=_percentile(row.sample, 0.5),
                    measured_p99_ms=_percentile(row.sample, 0.99), predicted_ms=predicted,
                    predicted_roofline_ms=roofline,
                    error_pct=(measured - predicted) / predicted * 100 if predicted > 0 else 0.0, streamed=streamed,
                    overheads_mean=overheads))
            steps = self._steps
        return Report(self.summary, self.architecture, self.kernel_isa, steps, time.time_ns(), tuple(rows),
                      self.streams_from or 0)
