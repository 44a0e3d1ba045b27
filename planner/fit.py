"""The fit behind recalibration (planner/calibrate.py): one device's measured report rows against
the cost model, two parameters per phase.

Decode rows fit DESIGN §8's

    T̂(row) = T_roofline(row; η_kv, η_m) + n_blocks · δ  (+ T_comm on the stage that receives the hidden state)

with η_kv the efficiency of KV reads relative to the weight reads' η_m (planner/cost.py: the
attention term reads W_kv at M̂·η_m·η_kv). With one split measured, a uniform inefficiency of the
weight reads adds the same time to every block, exactly what δ describes, so δ absorbs it; what
only a KV-specific factor can describe is how time grows with context (DESIGN §8 fits one η_m for
both: on helm-dev the two reads ran at ~90% and ~40% of the profiled bandwidth, which one factor
cannot follow). η_m is fitted only where δ cannot describe the level: when the model without any
overhead already over-predicts (δ would be negative: the profile caught the machine in a slow
moment), δ is held at 0 and η_m raised by the factor that fits.

Prefill rows (prompt chunks) fit the same form with δ taken from the decode rows:

    T̂(row) = T_prefill(row; η_attn, η_c) + n_blocks · δ

η_c the projections' FLOP efficiency against the profiled rate (the profile times an fp32 GEMM;
a bf16 model's GEMMs run at another rate) and η_attn the prompt attention's on top of it (a fused
attention kernel and GEMMs differ again): time grows with the cached prefix through η_attn.

So every phase has a *level* parameter (δ, or η_m / η_c as a scale on the part of the stage's
roofline that level prices), solved by Newton's method (the model is linear in it) for each value
of a *shape* parameter (η_kv / η_attn), which a 1-D search
on a log grid refined by golden section finds (variable projection); the shape parameter only
with at least MIN_BUCKETS_FOR_ETA context buckets, and kept where the buckets do not pin it to
±ETA_MAX_REL_STDERR (where the KV read or the prefix attention is a small part of the step it is
collinear with the level). That scale is the cost model's own response to the level near the
measured plan's value (a roofline term bound by another rate does not move), and the prefill fit
re-centres on the level found until it is 1; the table and the written plan use the cost model
itself at the fitted values. The loss is the sum of squared *relative* errors, as log(measured /
T̂) (every bucket counts the same, as the targets are per-bucket percentages, and a bucket
predicted several-fold too slow weighs no more than one predicted several-fold too fast), made
robust by iteratively reweighted least squares — Huber weights, then Tukey's bisquare on the MAD
scale — so one disturbed bucket (another process on the machine, a profile it disturbed) gets no
say.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from planner.machine import Calibration
from planner.plan import Plan
from planner.predict import predict_step
from planner.provenance import DeviceFit, PrefillFit
from planner.units import round_sig

MIN_BUCKETS_FOR_ETA = 3       # context buckets a phase needs before its shape parameter is fitted
ETA_MIN, ETA_MAX = 0.02, 4.0  # η_kv / η_attn search interval
LEVEL_MIN, LEVEL_MAX = 0.02, 4.0  # η_m / η_c bounds when fitted (machine schema: (0, 4])
ETA_GRID_POINTS = 97          # log-spaced starting grid for the shape parameter, then golden section
HUBER_K = 1.345               # Huber threshold in robust standard deviations (95% efficiency)
BISQUARE_C = 4.685            # Tukey bisquare cut-off after the Huber start: rows beyond it get weight 0
SIGMA_FLOOR = 0.005           # robust scale floor (0.5% relative error): exact data is not "all outliers"
MAX_IRLS_ITERATIONS = 30
MAX_RECENTRES = 8             # prefill: re-solves around the level found until the scale is 1
NEWTON_ITERATIONS = 50        # Newton steps for the level at one shape (it converges in a few)
NEWTON_TOLERANCE = 1e-8       # relative step at which they stop (the prefill re-centres below 1e-6)
NOMINAL_NOISE = 0.01          # relative noise of a bucket mean assumed at least when judging η's precision
ETA_MAX_REL_STDERR = 0.10     # a shape parameter is fitted only if the buckets pin it to ±10% (else kept)
TARGET_ERROR_PCT = 5.0        # per-bucket error the calibrated model should reach (issue 6); notes say when not
RESPONSE_STEP = 1.01          # the level's step over which a row's roofline is found to respond to it

# Per phase: (shape parameter, level parameter) as DeviceCalibration fields, and their symbols.
PARAMS = {"decode": ("eta_kv", "eta_memory"), "prefill": ("eta_attn", "eta_compute")}
SYMBOL = {"eta_kv": "η_kv", "eta_memory": "η_m", "eta_attn": "η_attn", "eta_compute": "η_c"}

METHOD = (f"robust least squares per device and phase: minimise Σ ρ(log(measured / T̂)); decode rows "
          f"T̂ = T_roofline(η_kv) + n_blocks·δ (+ link), δ >= 0 by Newton's method (where it would be < 0: "
          f"δ = 0 and the η_m that fits); prefill rows T̂ = T_prefill(η_attn, η_c) + n_blocks·δ(decode), η_c "
          f"by Newton's method; η_kv / η_attn by log-grid + golden section when >= {MIN_BUCKETS_FOR_ETA} "
          f"context buckets pin them to ±{ETA_MAX_REL_STDERR:.0%} (else kept); IRLS, Huber k={HUBER_K} then "
          f"Tukey bisquare c={BISQUARE_C}, MAD scale")


def with_values(calibration: Calibration, device: str, **values) -> Calibration:
    """`calibration` with some of one device's fields replaced."""
    return replace(calibration, **{device: replace(calibration.for_device(device), **values)})


def _stage_roofline_ms(plan: Plan, calibration: Calibration, stage: int, phase: str,
                       context: float, batch: float, tokens: float) -> tuple[float, float, float]:
    """What the executor's Recorder predicts for one step before its per-block overheads, as (the
    stage's own roofline, the link term on the receiving stage, the overheads δ the stage pays:
    n_blocks, or more where it takes the step in sub-steps): planner.predict.predict_step."""
    step = predict_step(plan, phase, context, batch, tokens, calibration)
    return step.stages[stage][1], (step.link_ms if stage else 0.0), step.overheads[stage]


class RowModel:
    """One report row and its roofline as a function of the phase's (shape, level) parameters,
    anchored to the report's own roofline prediction. The level enters the fit as `scale` =
    level(measured plan) / level, multiplying the part of the stage's roofline the level prices
    (`responsive`, at level0): a short prompt chunk on a GPU is bound by its weight reads, which
    η_c does not price, and a scale on all of it would let such rows, where they are many, pin η_c
    against the long chunks that measure it. The link is never scaled."""

    def __init__(self, plan: Plan, row, level: float | None = None, calibration: Calibration | None = None,
                 shape: float | None = None):
        """`calibration`: the other parameters' values to evaluate with (default: the measured
        plan's; the prefill fit passes the decode fit's η_m, η_kv and δ, the table the final ones);
        `level`: where `scale` is 1 and `shape` where the response to it is taken (defaults: the
        calibration's)."""
        self.row = row
        self.device = row.device
        self.measured = row.measured_mean_ms
        self._plan = plan
        self._cal = calibration or plan.calibration
        self.shape_name, self.level_name = PARAMS[row.phase]
        dev = self._cal.for_device(row.device)
        self.shape0, self.level0 = getattr(dev, self.shape_name), getattr(dev, self.level_name)
        if level is not None:
            self.level0 = level  # where `scale` is 1
        self._cache: dict[tuple[float, float], tuple[float, float]] = {}
        # The report's roofline is the mean over the row's steps; the model at the mean context
        # and batch differs from it only where the roofline bends within the bucket: the ratio of
        # the two, at the measured plan's calibration, anchors the model to those very steps.
        measured = plan.calibration
        mdev = measured.for_device(row.device)
        stage, link, overheads = self._raw(measured, getattr(mdev, self.shape_name), getattr(mdev, self.level_name))
        base = stage + link
        self.ratio = row.predicted_roofline_ms / base if base > 0 and row.predicted_roofline_ms > 0 else 1.0
        # the per-block overheads δ the row's steps pay: its blocks (a GPU stage taking a streamed
        # prompt step pays them once per sub-step): the report's mean over those very steps, where
        # it says (the model at the row's means would miscount a bucket of steps of two sizes)
        self.blocks = overheads if row.overheads_mean is None else row.overheads_mean
        # The fraction of the stage's roofline that goes as 1 / level near level0: the roofline's
        # terms are each bound by one rate, so a 1% higher level takes 1/1.01 of the responsive
        # part and none of the rest. Exact at level0, where the prefill fit re-centres.
        at = self.shape0 if shape is None else shape
        here, _ = self.parts(at)
        there, _ = self.parts(at, self.level0 * RESPONSE_STEP)
        self.responsive = min(1.0, max(0.0, (here - there) * RESPONSE_STEP / (RESPONSE_STEP - 1) / here)) \
            if here > 0 else 1.0

    def _raw(self, calibration: Calibration, shape: float, level: float) -> tuple[float, float, float]:
        cal = with_values(calibration, self.device, **{self.shape_name: shape, self.level_name: level})
        r = self.row
        return _stage_roofline_ms(self._plan, cal, r.stage, r.phase, r.context_mean, r.batch_mean, r.tokens_mean)

    def parts(self, shape: float, level: float | None = None) -> tuple[float, float]:
        """(stage roofline, link) in ms (level: default the measured plan's)."""
        key = (shape, self.level0 if level is None else level)
        if key not in self._cache:
            stage, link, _ = self._raw(self._cal, *key)
            self._cache[key] = (self.ratio * stage, self.ratio * link)
        return self._cache[key]

    def scaled_part(self, shape: float) -> float:
        """The part of the stage's roofline (ms, at level0) that `scale` multiplies."""
        return self.responsive * self.parts(shape)[0]

    def predict(self, shape: float, delta: float, scale: float = 1.0) -> float:
        stage, link = self.parts(shape)
        return stage + (scale - 1) * self.responsive * stage + link + self.blocks * delta

    def predict_at(self, shape: float, delta: float, level: float) -> float:
        """The cost model itself at (shape, δ, level): what the written plan predicts for this row."""
        stage, link = self.parts(shape, level)
        return stage + link + self.blocks * delta


# ---- the solver --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Level:
    """How a phase's level is fitted: "delta" (δ >= 0, else δ = 0 and a scale <= 1: decode) or
    "scale" (δ fixed at `delta0`, a scale either way: prefill); "fixed": nothing (no blocks)."""
    mode: str
    delta0: float = 0.0


@dataclass(frozen=True)
class Solution:
    delta: float
    shape: float
    scale: float                     # level(measured plan) / level: 1 unless the level was fitted as a scale
    weights: tuple[float, ...]       # robust weights of the final iteration (bisquare; 0: left out)
    residuals: tuple[float, ...]     # relative: log(measured / T̂)
    scaled: bool                     # the level was fitted as a scale (η_m or η_c)


def residual(measured: float, predicted: float) -> float:
    """The fit's residual of a row, log(measured / predicted): a relative error that counts over-
    and under-prediction alike. (measured − T̂) / measured does not: a bucket predicted several-
    fold too slow has a residual without bound and a leverage to match, so one such bucket can
    pull the fit to where every residual looks alike and none is an outlier."""
    return math.log(measured / max(predicted, 1e-12))


def _residual(r: RowModel, predicted: float) -> float:
    return residual(r.measured, predicted)


def _newton(rows: list[RowModel], w: list[float], theta: float, predict: Callable[[RowModel, float], float],
            slope: Callable[[RowModel, float], float], lo: float, hi: float) -> float:
    """θ in [lo, hi] minimising Σ w·log²(measured / predict(row, θ)) for a prediction linear in θ
    (slope(row, θ) = ∂predict/∂θ), from `theta`: Newton's steps on the loss (Gauss-Newton's where
    its curvature is not positive), halved where they would not lower it."""
    def at(t: float) -> tuple[float, float]:
        """(the loss, Newton's step) at t, from one pass over the rows."""
        loss = num = den = gauss = 0.0
        for r, wi in zip(rows, w):
            t_hat = max(predict(r, t), 1e-12)
            g = slope(r, t) / t_hat  # -∂res/∂θ, res = log(measured / T̂); ∂²res/∂θ² = g²
            res = _residual(r, t_hat)
            loss += wi * res * res
            num += wi * g * res
            den += wi * g * g * (1 + res)
            gauss += wi * g * g
        return loss, (num / (den if den > 0 else gauss) if gauss > 0 else 0.0)

    theta = min(hi, max(lo, theta))
    current, step = at(theta)
    for _ in range(NEWTON_ITERATIONS):
        if not step:
            break
        for _ in range(30):
            candidate = min(hi, max(lo, theta + step))
            value, next_step = at(candidate)
            if value <= current:
                break
            step /= 2
        else:
            break
        # (the loss resolves θ to about √ε of it: a tighter test would halve steps on rounding)
        converged = abs(candidate - theta) <= NEWTON_TOLERANCE * max(1.0, abs(theta))
        theta, current, step = candidate, value, next_step
        if converged:
            break
    return theta


def _linearised(rows: list[RowModel], w: list[float], predict0: Callable[[RowModel], float],
                slope: Callable[[RowModel], float]) -> float | None:
    """The least-squares θ of measured ≈ predict0 + θ·slope on (measured − T̂) / measured, the log
    residual's linearisation: Newton's start (None where no row has a slope)."""
    num = den = 0.0
    for r, wi in zip(rows, w):
        v, b = wi / r.measured ** 2, slope(r)
        num += v * b * (r.measured - predict0(r))
        den += v * b * b
    return num / den if den > 0 else None


def _level_for(rows: list[RowModel], shape: float, w: list[float], how: _Level) -> tuple[float, float, bool]:
    """The level for a fixed shape parameter: weighted least squares on log(measured / T̂), by
    Newton's method (T̂ is linear in δ, and in the scale). Returns (δ, scale, scaled)."""
    if how.mode == "fixed":
        return how.delta0, 1.0, False
    if how.mode == "delta":
        start = _linearised(rows, w, lambda r: r.predict(shape, 0.0), lambda r: r.blocks)
        if start is None:
            return how.delta0, 1.0, False
        delta = _newton(rows, w, max(0.0, start), lambda r, d: r.predict(shape, d), lambda r, d: r.blocks,
                        -math.inf, math.inf)
        if delta >= 0:
            return delta, 1.0, False
    delta = how.delta0 if how.mode == "scale" else 0.0
    lowest = max(r.level0 for r in rows) / LEVEL_MAX
    highest = 1.0 if how.mode == "delta" else min(r.level0 for r in rows) / LEVEL_MIN
    start = _linearised(rows, w, lambda r: r.predict(shape, delta, 0.0), lambda r: r.scaled_part(shape))
    scale = _newton(rows, w, 1.0 if start is None else start, lambda r, sc: r.predict(shape, delta, sc),
                    lambda r, sc: r.scaled_part(shape), lowest, highest)
    return delta, scale, True


def _loss(rows: list[RowModel], shape: float, w: list[float], how: _Level) -> float:
    delta, scale, _ = _level_for(rows, shape, w, how)
    return sum(wi * _residual(r, r.predict(shape, delta, scale)) ** 2 for r, wi in zip(rows, w))


def _argmin_log(f: Callable[[float], float], lo: float, hi: float) -> float:
    """Minimise f over [lo, hi]: a log-spaced grid, then golden section around the best point."""
    grid = [lo * (hi / lo) ** (i / (ETA_GRID_POINTS - 1)) for i in range(ETA_GRID_POINTS)]
    values = [f(x) for x in grid]
    i = min(range(len(grid)), key=values.__getitem__)
    a, b = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)])
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    while b - a > 1e-7:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(math.exp(d))
    x = math.exp((a + b) / 2)
    return min((x, grid[i]), key=f)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def robust_weights(res: list[float], bisquare: bool = True) -> list[float]:
    scale = max(1.4826 * _median([abs(x) for x in res]), SIGMA_FLOOR)
    if bisquare:
        return [(1 - (x / (BISQUARE_C * scale)) ** 2) ** 2 if abs(x) < BISQUARE_C * scale else 0.0 for x in res]
    return [min(1.0, HUBER_K * scale / abs(x)) if x else 1.0 for x in res]


def _solve(rows: list[RowModel], fit_shape: bool, shape0: float, how: _Level) -> Solution:
    """IRLS around the variable-projection fit: Huber weights to convergence (a safe start), then
    Tukey's bisquare, which gives a grossly disturbed bucket no weight at all (Huber only caps it,
    and with the two parameters nearly collinear even a capped outlier moves them)."""
    w = [1.0] * len(rows)
    shape = shape0
    for bisquare in (False, True):
        for _ in range(MAX_IRLS_ITERATIONS):
            if fit_shape:
                shape = _argmin_log(lambda e: _loss(rows, e, w, how), ETA_MIN, ETA_MAX)
            delta, scale, _ = _level_for(rows, shape, w, how)
            new_w = robust_weights([_residual(r, r.predict(shape, delta, scale)) for r in rows], bisquare)
            done = max(abs(a - b) for a, b in zip(w, new_w)) < 1e-6
            w = new_w
            if done:
                break
    if fit_shape:
        shape = _argmin_log(lambda e: _loss(rows, e, w, how), ETA_MIN, ETA_MAX)
    delta, scale, scaled = _level_for(rows, shape, w, how)
    res = tuple(_residual(r, r.predict(shape, delta, scale)) for r in rows)
    return Solution(delta, shape, scale, tuple(w), res, scaled)


def _stderrs(rows: list[RowModel], sol: Solution, fit_shape: bool, how: _Level,
             min_sigma: float = 0.0) -> dict[str, float]:
    """Standard errors of the fitted parameters — "delta" or "scale" (the level) and "shape" —
    from the weighted Jacobian of the log residuals, at the residuals' own scale (or
    `min_sigma` if larger). Missing where not estimable; inf where the two cannot be told apart."""
    params = []
    if how.mode != "fixed":
        params.append("scale" if sol.scaled else "delta")
    if fit_shape:
        params.append("shape")
    dof = sum(1 for w in sol.weights if w > 0) - len(params)
    if not params or dof <= 0:
        return {}
    h = sol.shape * 1e-4
    jac = []
    for r in rows:
        g = []
        t_hat = max(r.predict(sol.shape, sol.delta, sol.scale), 1e-12)  # ∂ log T̂ = ∂T̂ / T̂
        if "delta" in params:
            g.append(r.blocks / t_hat)
        if "scale" in params:
            g.append(r.scaled_part(sol.shape) / t_hat)
        if "shape" in params:
            g.append((r.predict(sol.shape + h, sol.delta, sol.scale) - r.predict(sol.shape - h, sol.delta, sol.scale))
                     / (2 * h) / t_hat)
        jac.append(g)
    p = len(params)
    jtj = [[sum(w * jac[i][a] * jac[i][b] for i, w in enumerate(sol.weights)) for b in range(p)] for a in range(p)]
    sigma2 = max(sum(w * x * x for w, x in zip(sol.weights, sol.residuals)) / dof, min_sigma ** 2)
    if p == 1:
        if jtj[0][0] <= 0:
            return {params[0]: math.inf}
        inv = [[1 / jtj[0][0]]]
    else:
        det = jtj[0][0] * jtj[1][1] - jtj[0][1] * jtj[1][0]
        if det <= 1e-12 * jtj[0][0] * jtj[1][1]:   # collinear: shape and level explain the same thing
            return {name: math.inf for name in params}
        inv = [[jtj[1][1] / det, -jtj[0][1] / det], [-jtj[1][0] / det, jtj[0][0] / det]]
    return {name: math.sqrt(max(sigma2 * inv[i][i], 0.0)) for i, name in enumerate(params)}


# ---- one device, one phase ---------------------------------------------------------------------

@dataclass(frozen=True)
class PhaseFit:
    """The fit of one device's rows of one phase, before it is written into the plan."""
    models: tuple[RowModel, ...]
    solution: Solution
    shape: float                     # η_kv / η_attn (fitted or kept)
    shape_fitted: bool
    level: float                     # η_m / η_c (fitted or kept), rounded as the plan stores it
    delta: float                     # rounded as the plan stores it
    stderr: dict[str, float]         # "delta" (ms), "level" (in η units), "shape"
    notes: tuple[str, ...]
    before_pct: tuple[float, ...]    # per row: the measured plan's error
    after_pct: tuple[float, ...]     # per row: the cost model at the fitted values


def rms(xs) -> float:
    xs = list(xs)
    return math.sqrt(sum(x * x for x in xs) / len(xs)) if xs else 0.0


def pct(measured: float, predicted: float) -> float:
    return (measured - predicted) / predicted * 100 if predicted > 0 else 0.0


def finite(x: float | None) -> float | None:
    return round_sig(x) if x is not None and math.isfinite(x) else None


def _unpinned(se: float | None, value: float, inestimable: str) -> str:
    """Why a fitted parameter is noise ("" where its standard error pins it to ETA_MAX_REL_STDERR):
    `inestimable` where it has none, else the spread it would have."""
    if se is None or not math.isfinite(se):
        return inestimable
    return f"would be ±{se / value * 100:.0f}%" if se / value > ETA_MAX_REL_STDERR else ""


def _fit_phase(plan: Plan, rows: list, how: _Level, what: str, calibration: Calibration | None = None) -> PhaseFit:
    """Fit one device's rows of one phase: the level as `how` says, the shape parameter where
    the buckets pin it down, the other parameters at `calibration` (default: the measured plan's).
    `what`: the part of the step the shape parameter prices, for notes."""
    models = [RowModel(plan, r, calibration=calibration) for r in rows]
    m0 = models[0]
    sym_shape = SYMBOL[m0.shape_name]
    buckets = len({r.context_min for r in rows})
    fit_shape = buckets >= MIN_BUCKETS_FOR_ETA
    notes = []
    sol = _solve(models, fit_shape, m0.shape0, how)
    if fit_shape:
        # The shape parameter is told apart from the level only by how the step time grows with
        # context; where that part is small, the two are collinear and it would be noise: keep it.
        spread = _unpinned(_stderrs(models, sol, True, how, NOMINAL_NOISE).get("shape"), sol.shape,
                           "cannot be told apart from the level")
        if spread:
            notes.append(f"{sym_shape} kept at {m0.shape0:g}: these buckets do not pin it down ({spread}; "
                         f"{what} is too small a part of the step)")
            fit_shape = False
            sol = _solve(models, False, m0.shape0, how)
    elif buckets < MIN_BUCKETS_FOR_ETA:
        notes.append(f"{sym_shape} kept at {m0.shape0:g}: {buckets} context bucket{'s' if buckets != 1 else ''}, "
                     f"it needs >= {MIN_BUCKETS_FOR_ETA}")
    if fit_shape and min(abs(math.log(sol.shape / ETA_MIN)), abs(math.log(ETA_MAX / sol.shape))) < 0.01:
        notes.append(f"{sym_shape} ran to the end of its range ({sol.shape:.3g}): the roofline's shape does not "
                     "match these measurements")
    if how.mode == "scale":
        # Rows whose steps are bound by other rates than the level's (a GPU's short prompt chunks,
        # by their weight reads) hardly respond to it: where they cannot pin it, noise would set it.
        # (judged by how much the rows respond to it, at nominal noise: not by how well they agree)
        response = sum(w * (m.scaled_part(sol.shape) / m.predict(sol.shape, sol.delta, sol.scale)) ** 2
                       for m, w in zip(models, sol.weights))
        spread = _unpinned(NOMINAL_NOISE / math.sqrt(response) if response > 0 else None, sol.scale,
                           "they do not respond to it")
        if spread:
            notes.append(f"{SYMBOL[m0.level_name]} kept at {m0.level0:g}: these steps are bound by other rates "
                         f"than it prices ({spread})")
            how = _Level("fixed", how.delta0)
            sol = _solve(models, fit_shape, sol.shape, how)
        # The scale is the level's effect linearised at level0 (a roofline term can change which
        # rate bounds it): re-centre the models on the level found and solve again until the scale
        # is 1, where the cost model itself fits.
        for _ in range(MAX_RECENTRES):
            if abs(sol.scale - 1) < 1e-6:
                break
            models = [RowModel(plan, m.row, level=m.level0 / sol.scale, calibration=calibration, shape=sol.shape)
                      for m in models]
            sol = _solve(models, fit_shape, sol.shape, how)
        m0 = models[0]
    se = _stderrs(models, sol, fit_shape, how)
    level = round_sig(m0.level0 / sol.scale) if sol.scaled else m0.level0
    stderr = {"shape": se["shape"]} if "shape" in se else {}
    if "delta" in se:
        stderr["delta"] = se["delta"]
    if "scale" in se:  # as one of level = level0 / scale
        stderr["level"] = se["scale"] * m0.level0 / sol.scale ** 2
    shape, delta = round_sig(sol.shape), round_sig(sol.delta)
    before = tuple(pct(m.measured, m.row.predicted_ms) for m in models)
    after = tuple(pct(m.measured, m.predict_at(shape, delta, level)) for m in models)
    worst = max(abs(x) for x in after)
    kept = [(m.row.context_mean, e) for m, e, w in zip(models, after, sol.weights) if w > 0]
    if worst > TARGET_ERROR_PCT and len(kept) >= 3:
        ordered = sorted(kept)
        half = len(ordered) // 2
        low = sum(e for _, e in ordered[:half]) / half
        high = sum(e for _, e in ordered[-half:]) / half
        if high - low > TARGET_ERROR_PCT:
            notes.append(f"residuals grow with context ({low:+.1f}% short, {high:+.1f}% long): {what} costs more "
                         f"than the roofline allows at long context; one {sym_shape} cannot follow it")
        elif low - high > TARGET_ERROR_PCT:
            notes.append(f"residuals shrink with context ({low:+.1f}% short, {high:+.1f}% long): {what} is "
                         "over-predicted at long context")
        else:
            notes.append(f"residuals up to {worst:.1f}% without a trend in context: noisy measurements "
                         "(a busy machine?); measure more steps")
    if any(w == 0 for w in sol.weights):
        notes.append(f"{sum(1 for w in sol.weights if w == 0)} bucket(s) left out as outliers")
    return PhaseFit(tuple(models), sol, shape, fit_shape, level, delta, stderr, tuple(notes), before, after)


def fit_decode(plan: Plan, device: str, rows: list) -> PhaseFit:
    """δ (or η_m where δ would be negative) and η_kv of one device, from its decode rows."""
    current = plan.calibration.for_device(device)
    has_blocks = any(r.num_blocks for r in rows)
    fit = _fit_phase(plan, rows, _Level("delta" if has_blocks else "fixed", current.delta_ms_per_block),
                     "the KV read")
    notes = list(fit.notes)
    if not has_blocks:
        notes.append("the stage has no transformer blocks: δ does not apply")
    elif fit.solution.scaled:
        notes.append(f"δ held at 0 and η_m fitted ({current.eta_memory:g} -> {fit.level:g}): the model without "
                     "any overhead already over-predicts, so this machine reads faster than its profile measured")
    return replace(fit, notes=tuple(notes))


def fit_prefill(plan: Plan, rows: list, calibration: Calibration) -> PhaseFit:
    """η_c and η_attn of one device from its prefill rows, with `calibration` holding what the
    decode rows gave (δ, η_m, η_kv: a prompt chunk also reads the weights and its prefix's KV)."""
    delta = calibration.for_device(rows[0].device).delta_ms_per_block
    return _fit_phase(plan, rows, _Level("scale", delta), "the attention over the cached prefix", calibration)


def device_fit(device: str, decode: PhaseFit, prefill: PhaseFit | None, prefill_note: str = "") -> DeviceFit:
    """What the plan records of one device's fit."""
    pre = None
    if prefill is not None:
        pre = PrefillFit(
            eta_compute=prefill.level, eta_compute_stderr=finite(prefill.stderr.get("level")),
            eta_attn=prefill.shape, eta_attn_fitted=prefill.shape_fitted,
            eta_attn_stderr=finite(prefill.stderr.get("shape")), note="; ".join(prefill.notes),
            buckets=len({m.row.context_min for m in prefill.models}),
            samples=sum(m.row.samples for m in prefill.models),
            rms_error_pct_before=round_sig(rms(prefill.before_pct), 4),
            rms_error_pct_after=round_sig(rms(prefill.after_pct), 4),
            max_abs_error_pct_before=round_sig(max(map(abs, prefill.before_pct)), 4),
            max_abs_error_pct_after=round_sig(max(map(abs, prefill.after_pct)), 4))
    notes = list(decode.notes) + ([prefill_note] if prefill_note else [])
    return DeviceFit(
        device=device, delta_ms_per_block=decode.delta, delta_stderr_ms=finite(decode.stderr.get("delta")),
        eta_kv=decode.shape, eta_kv_fitted=decode.shape_fitted, eta_kv_stderr=finite(decode.stderr.get("shape")),
        eta_memory=decode.level, eta_memory_fitted=decode.solution.scaled,
        eta_memory_stderr=finite(decode.stderr.get("level")), note="; ".join(notes),
        buckets=len({m.row.context_min for m in decode.models}), samples=sum(m.row.samples for m in decode.models),
        rms_error_pct_before=round_sig(rms(decode.before_pct), 4),
        rms_error_pct_after=round_sig(rms(decode.after_pct), 4),
        max_abs_error_pct_before=round_sig(max(map(abs, decode.before_pct)), 4),
        max_abs_error_pct_after=round_sig(max(map(abs, decode.after_pct)), 4), prefill=pre)
