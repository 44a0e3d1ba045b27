"""tools/bench_host_step.py's code path on a tiny model: the benchmark itself runs on a real
model's shapes (its figures go to the README); this keeps it from rotting."""
from __future__ import annotations

from executor.device_step import ResidentDecode
from tools import bench_host_step


def test_the_host_step_benchmark_times_every_setting_through_the_static_step(checkpoint, monkeypatch):
    calls = []
    call = ResidentDecode.__call__
    monkeypatch.setattr(ResidentDecode, "__call__", lambda self, x, batch: (calls.append(1), call(self, x, batch))[1])
    rows = bench_host_step.host_step_ms(checkpoint("qwen3", "bf16"), steps=6)
    assert [(r["sampling"], r["recorder"]) for r in rows] == [(s, rec) for s in bench_host_step.SETTINGS
                                                              for rec in (False, True)]
    assert all(r["steps"] == 6 and r["host_ms_per_step"] > 0 for r in rows)
    # the Recorder's prediction is made in Engine.on_launched, timed apart; without it nothing is
    assert all((r["while_gpu_computes_ms"] > 0) == r["recorder"] for r in rows)
    assert all(r["while_gpu_computes_ms"] < r["host_ms_per_step"] for r in rows)
    assert len(calls) == 6 * len(rows)      # every decode step took the (stubbed) static step
