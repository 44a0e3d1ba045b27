"""Measured vs predicted: predictions are the plan's cost model, rows aggregate per stage, phase
and context bucket, and the JSON matches schemas/report.schema.json."""
import json

import pytest

from executor.pb import executor_pb2 as pb
from executor.report import Recorder
from planner.errors import PlanError
from planner.planning import plan_for_split
from planner.predict import predict
from planner.report import Report, context_bucket, validate_report


@pytest.fixture(scope="module")
def plan(checkpoint):
    return plan_for_split(checkpoint("qwen3", "fp32"), 2, page_size_tokens=16)


def test_context_buckets_are_powers_of_two():
    assert [context_bucket(c) for c in (1, 2, 3, 4, 7, 8, 1000)] == \
        [(1, 2), (2, 4), (2, 4), (4, 8), (4, 8), (8, 16), (512, 1024)]


def test_decode_prediction_is_the_plans_cost_model(plan):
    rec = Recorder(plan, "test", "Qwen3ForCausalLM", "torch")
    predicted = rec.record("decode", 100, 3, 3, (1.0, 2.0))
    want = predict(plan, 100, 3)
    assert predicted[0].ms == pytest.approx(want.stages[0].ms_per_token)
    # The second stage receives the hidden state over the link: its prediction carries T_comm.
    assert predicted[1].ms == pytest.approx(want.stages[1].ms_per_token + want.comm_ms_per_token)
    assert predicted[0].roofline_ms == pytest.approx(want.stages[0].roofline_ms_per_token)
    prefill = rec.record("prefill", 64, 1, 64, (5.0, 6.0))
    assert prefill[0].ms > predicted[0].ms  # 64 prompt tokens cost more than one decode


def test_an_attached_recorder_predicts_each_step_as_it_launches_and_stores_it_once_timed(plan, checkpoint):
    """Recorder.attach: the prediction is made in Engine.on_launched (while a GPU stage computes)
    and the step's record, once timed, finds it made; the report holds every step once."""
    from executor.engine import Engine
    from executor.loader import load_model
    from executor.model_config import ModelConfig
    from executor.plan_io import placement_for
    from executor.request_params import StopCriteria

    path = checkpoint("qwen3", "fp32")
    config = ModelConfig.from_dir(path)
    engine = Engine(load_model(path, placement_for(plan, config), config), eos_token_ids=())
    rec = Recorder(plan, "test", config.architecture, "torch")
    rec.attach(engine)
    made = []
    predict = rec.predict
    rec.predict = lambda *shape: (made.append((shape, predict.cache_info().misses)), predict(*shape))[1]
    engine.generate([[11, 12, 13]], stop=StopCriteria(max_new_tokens=4, ignore_eos=True))
    assert len(made) == 2 * 4
    for (launched, misses), (recorded, misses_then) in zip(made[0::2], made[1::2]):
        assert launched == recorded and misses_then == misses + 1  # made at launch, found when timed
    assert sum(r.samples for r in rec.report().rows if r.stage == 0) == 4 == rec.report().steps


def test_rows_aggregate_per_stage_phase_and_bucket(plan):
    rec = Recorder(plan, "test", "Qwen3ForCausalLM", "helm-avx2")
    for i in range(100):
        rec.record("decode", 20 + i % 10, 1, 1, (1.0 + i, 2.0))
    rec.record("decode", 40, 2, 2, (7.0, 7.0))
    rec.record("prefill", 12, 1, 12, (9.0, 9.0))
    report = rec.report()
    keys = [(r.stage, r.phase, r.context_min) for r in report.rows]
    assert keys == [(0, "decode", 16), (0, "decode", 32), (0, "prefill", 8),
                    (1, "decode", 16), (1, "decode", 32), (1, "prefill", 8)]
    row = report.rows[0]
    assert row.samples == 100 and row.measured_mean_ms == pytest.approx(50.5)
    assert row.measured_p50_ms == pytest.approx(51.0) and row.measured_p99_ms == pytest.approx(100.0)
    assert row.context_mean == pytest.approx(24.5) and row.batch_mean == 1
    assert row.error_pct == pytest.approx((50.5 - row.predicted_ms) / row.predicted_ms * 100)
    assert report.steps == 102 and report.plan.digest == plan.digest


def test_report_json_round_trips_and_validates(plan, tmp_path):
    rec = Recorder(plan, "plans/x.yaml", "Qwen3ForCausalLM", "helm-avx512")
    rec.record("decode", 5, 1, 1, (0.5, 0.25))
    report = rec.report()
    back = Report.from_pb(report.to_pb(pb), pb)
    assert back.rows[0].measured_mean_ms == pytest.approx(0.5) and back.plan.digest == report.plan.digest
    # protobuf carries integer nanoseconds
    assert back.plan.predicted_ms_per_token == pytest.approx(report.plan.predicted_ms_per_token, abs=1e-6)
    path = tmp_path / "report.json"
    back.write(path)
    data = json.loads(path.read_text())
    validate_report(data)
    assert data["kind"] == "report" and data["plan"]["source"] == "plans/x.yaml"
    data["rows"][0]["phase"] = "warmup"
    with pytest.raises(PlanError, match=r"field .rows\[0\]\.phase."):
        validate_report(data)
