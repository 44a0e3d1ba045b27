"""`helm-plan matrix`: every model on every machine, each cell the plan `helm-plan plan` makes."""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest

from planner import cli
from planner.machine import load_machine
from planner.plan import load_plan
from planner.planning import make_plan
from tests.planner.conftest import LAPTOP, MACHINES, config_path

MODELS = [str(config_path(m)) for m in ("qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")]
FLEET = [str(LAPTOP), str(MACHINES / "server-rtx3090-epyc7h12.yaml"), str(MACHINES / "server-l40s-epyc9654.yaml")]


def test_four_models_on_three_machines_in_under_30_s(tmp_path, capsys):
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    code = cli.main(["matrix", *MODELS, "--machines", *FLEET, "--json", "--out-dir", str(tmp_path)])
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    cells = json.loads(capsys.readouterr().out)
    print(f"\nbenchmark: helm-plan matrix 4 models x 3 machines: wall {wall:.1f} s, CPU {cpu:.1f} s")
    assert code == 0 and cpu < 30
    assert len(cells) == 12
    by = {(c["model"], c["machine"]): c for c in cells}
    # the 16 GB laptop cannot hold Qwen3-14B or -32B anywhere; the servers run everything
    for model in ("qwen3-14b", "qwen3-32b"):
        cell = by[(model, "laptop-rtx4060-i7-13700h")]
        assert not cell["feasible"] and "host memory" in cell["reason"] and cell["split_k"] is None
    feasible = [c for c in cells if c["feasible"]]
    assert len(feasible) == 10
    for c in feasible:
        # each cell is exactly the plan made alone, and it was written where the cell says
        plan = load_plan(c["plan_file"])
        alone = make_plan(config_path(c["model"]), load_machine(next(f for f in FLEET if c["machine"] in
                                                                      load_machine(f).name)))
        assert (plan.partition.split_k, plan.prediction.ms_per_token) == \
            (alone.partition.split_k, alone.prediction.ms_per_token) == (c["split_k"], c["ms_per_token"])
        assert c["longest_context"] == plan.longest_context.without_offload_tokens
        assert c["longest_context_offload"] >= c["longest_context"] > 0
    # a bigger model on the same machine is never faster
    for machine in ("server-rtx3090-epyc7h12", "server-l40s-epyc9654"):
        speeds = [by[(m, machine)]["tokens_per_s"] for m in ("qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")]
        assert speeds == sorted(speeds, reverse=True)


def test_the_table_names_each_cell_and_offers_a_diff(tmp_path, capsys):
    code = cli.main(["matrix", MODELS[0], MODELS[3], "--machines", str(MACHINES), "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("qwen3-")]
    machines = [p for p in MACHINES.glob("*.yaml")]
    assert len(rows) == 2 * len(machines)
    assert any("[datasheet]" in r for r in rows) and any("[measured]" in r for r in rows)
    assert any("no: all-CPU (k=66) needs" in r for r in rows)
    diff_line = next(line for line in out.splitlines() if line.startswith("compare two cells: helm-plan diff "))
    a, b = diff_line.split()[-2:]
    assert cli.main(["diff", a, b]) == 1          # one command away, and they differ


def test_the_plot_is_a_png(tmp_path, capsys):
    out = tmp_path / "matrix.png"
    assert cli.main(["matrix", MODELS[0], MODELS[3], "--machines", *FLEET, "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.parametrize("argv,message", [
    (["--machines", "nowhere"], "--machines nowhere: no such file or directory"),
    (["--machines", str(LAPTOP), str(LAPTOP)], "are both named 'laptop-rtx4060-i7-13700h'"),
    (["--machines", str(config_path("qwen3-4b"))], "machine profile"),
])
def test_bad_machines_are_one_line_errors(argv, message, capsys):
    assert cli.main(["matrix", MODELS[0], *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_bad_model_fails_before_any_planning(tmp_path, capsys):
    assert cli.main(["matrix", MODELS[0], str(tmp_path / "none.json"), "--machines", str(LAPTOP)]) == 2
    err = capsys.readouterr().err
    assert "model config not found" in err and "planning" not in err


def test_usage_errors_fail_the_matrix_and_only_infeasible_cells_are_answers(tmp_path, capsys):
    assert cli.main(["matrix", MODELS[0], "--machines", FLEET[1], "--latency-bound", "30"]) == 2
    assert "--latency-bound goes with --max-context" in capsys.readouterr().err
    assert cli.main(["matrix", MODELS[0], MODELS[0], "--machines", FLEET[1]]) == 2
    assert "both named 'qwen3-4b'" in capsys.readouterr().err
    assert cli.main(["matrix", MODELS[0], "--machines", FLEET[1], "--plot", str(tmp_path / "no" / "dir" / "m.png")]) == 2
    assert "--plot: cannot write" in capsys.readouterr().err


def test_cell_files_stay_inside_the_output_directory(tmp_path, capsys):
    odd = tmp_path / "odd.yaml"
    assert cli.main(["machine", "--cpu", "7H12", "--gpu", "L4", "--ram", "64GiB", "--name", "a/../../b", "-o",
                     str(odd)]) == 0
    out = tmp_path / "cells"
    assert cli.main(["matrix", MODELS[0], "--machines", str(odd), "--json", "--out-dir", str(out)]) == 0
    cell, = json.loads(capsys.readouterr().out)
    assert Path(cell["plan_file"]).parent == out and load_plan(cell["plan_file"]).machine.name == "a/../../b"
