"""Semantic diff: nothing from formatting, exactly the sections that differ between machines."""
from __future__ import annotations

import json

import pytest
import yaml

from planner import cli
from planner.diff import diff_plans, format_diff
from planner.plan import load_plan
from tests.planner.conftest import REPO

LAPTOP_8B = REPO / "plans" / "qwen3-8b.laptop-rtx4060.yaml"
DEV_8B = REPO / "plans" / "qwen3-8b.helm-dev-2core.yaml"


def test_a_plan_equals_itself_and_its_reformatted_copy(tmp_path, capsys):
    a = load_plan(LAPTOP_8B)
    assert diff_plans(a, a) == []
    copy = tmp_path / "copy.yaml"   # same data: other key order, flow style, no comments
    copy.write_text(yaml.safe_dump(yaml.safe_load(LAPTOP_8B.read_text()), sort_keys=True, default_flow_style=True))
    assert copy.read_text() != LAPTOP_8B.read_text()
    assert cli.main(["diff", str(LAPTOP_8B), str(copy)]) == 0
    assert "equivalent" in capsys.readouterr().out


def test_laptop_and_dev_plans_differ_exactly_where_they_should(capsys):
    a, b = load_plan(LAPTOP_8B), load_plan(DEV_8B)
    changes = diff_plans(a, b)
    sections = {c.section for c in changes}
    # same model, same workload, same trace; different machine, hence a different budget, split,
    # KV placement, prediction and search table, and the dev profile's measured η_kv (the laptop's
    # profile was entered by hand: default calibration)
    assert sections == {"machine", "limits", "partition", "kv", "prediction", "longest_context", "search", "calibration"}
    by_path = {c.path: c for c in changes}
    assert (by_path["partition.split_k"].a, by_path["partition.split_k"].b) == (22, 38)
    assert by_path["partition.stages[cuda]"].b_present is False
    assert (by_path["partition.stages[cpu].unit_end"].a, by_path["partition.stages[cpu].unit_end"].b) == (22, 38)
    assert by_path["machine.gpu"].b is None and by_path["machine.gpu"].a["name"].startswith("NVIDIA")
    assert by_path["machine.cpu.dram_read_gibps"].a == pytest.approx(45e9 / 2**30, rel=1e-5)   # 45 GB/s
    assert "prediction.ms_per_token" in by_path and "prediction.stages[cuda]" in by_path
    assert not any(p.startswith(("model", "workload", "ir", "digest")) for p in by_path)
    calibration = {p for p in by_path if p.startswith("calibration")}
    assert calibration == {"calibration.cpu.eta_kv", "calibration.provenance"}
    assert by_path["calibration.provenance"].b == "profiled" and by_path["calibration.cpu.eta_kv"].a == 1.0

    assert cli.main(["diff", str(LAPTOP_8B), str(DEV_8B)]) == 1
    out = capsys.readouterr().out
    assert "partition.split_k: 22 -> 38 (+72.7%)" in out
    assert "search.candidates: " in out and "rows differ" in out
    assert cli.main(["diff", "--json", str(LAPTOP_8B), str(DEV_8B)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["equal"] is False and data["sections"][:2] == ["partition", "kv"]
    assert {"section", "path", "a", "b"} <= set(data["changes"][0])


def test_diff_reports_errors_with_exit_2(tmp_path, capsys):
    assert cli.main(["diff", str(LAPTOP_8B), str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "helm-plan: error: plan not found" in err and "Traceback" not in err


def test_format_lists_calibration_changes():
    from dataclasses import replace

    from planner.machine import DeviceCalibration
    a = load_plan(LAPTOP_8B)
    b = replace(a, calibration=replace(a.calibration, cuda=DeviceCalibration(delta_ms_per_block=0.14),
                                       provenance="recalibrated", samples=40), plan_version=2)
    text = format_diff(a, b, diff_plans(a, b))
    assert "calibration.cuda.delta_ms_per_block: 0 -> 0.14" in text
    assert "calibration.provenance: default -> recalibrated" in text and "plan_version: 1 -> 2" in text


def test_a_profiles_kernel_rates_are_matched_by_dtype_and_rows():
    """A profile without bf16 kernels: that one row gone, not every dtype's rates shifted by one."""
    from planner.plan import plan_from_dict

    a = load_plan(REPO / "plans" / "qwen3-0.6b.helm-dev-2core-avx2.yaml")
    data = a.to_dict()
    dtypes = data["machine"]["cpu"]["kernels"]["dtypes"]
    assert [d["dtype"] for d in dtypes][:2] == ["bfloat16", "float16"]
    del dtypes[0]
    del dtypes[0]["prompt_gflops"][0]   # float16's first row
    changes = {c.path: c for c in diff_plans(a, plan_from_dict(data, verify_digest=False))}
    gone = changes.pop("machine.cpu.kernels.dtypes[bfloat16]")
    assert gone.a["dtype"] == "bfloat16" and not gone.b_present
    rows = a.machine.cpu.kernels.dtypes[1].prompt_gflops[0].rows
    assert not changes.pop(f"machine.cpu.kernels.dtypes[float16].prompt_gflops[{rows}]").b_present
    assert changes == {}
