"""The helm-plan commands, their exit codes, and bad input as one-line errors (no tracebacks)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from planner import cli
from tests.planner.conftest import LAPTOP, REPO, config_path

PLAN_8B = REPO / "plans" / "qwen3-8b.laptop-rtx4060.yaml"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_writes_a_valid_plan_and_a_summary(tmp_path, capsys):
    out = tmp_path / "sub" / "plan.yaml"
    code, stdout, err = run(capsys, "plan", config_path("qwen3-0.6b"), "--machine", LAPTOP, "-o", out,
                            "--prompt-tokens", 128, "--max-new-tokens", 64, "--batch-size", 2,
                            "--gpu-memory", "1GiB", "--page-size", 64)
    assert code == 0 and stdout == ""
    assert "split     k=" in err and "planned in" in err
    code, stdout, _ = run(capsys, "show", "--json", out)
    data = json.loads(stdout)
    assert {"split_k", "num_units", "predicted_ms_per_token", "plan_version", "stages"} <= set(data)
    assert data["num_units"] == 30 and data["context_tokens"] == 192
    assert data["kv"]["page_size_tokens"] == 64
    code, stdout, _ = run(capsys, "plan", config_path("qwen3-0.6b"), "--machine", LAPTOP, "--split", 5)
    assert code == 0 and stdout.startswith("# HELM plan v1") and "forced: true" in stdout


def test_show_prints_summary_and_every_candidate(capsys):
    code, out, _ = run(capsys, "show", PLAN_8B)
    assert code == 0
    assert "split     k=22 of 38 units" in out and "predicted 214.584 ms/token" in out
    rows = [line for line in out.splitlines() if re.match(r"^[ *]\s*\d+\s+(yes|no) ", line)]
    assert len(rows) == 39
    assert "*  22  yes" in out and "working set" in out


def test_show_plot_without_matplotlib_degrades_with_a_message(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # as if not installed
    code, out, err = run(capsys, "show", PLAN_8B, "--plot", tmp_path / "p.png")
    assert code == 2 and "split     k=22" in out
    assert "--plot needs matplotlib" in err and "pip install" in err and "Traceback" not in err


def test_validate_reports_each_file(tmp_path, capsys):
    code, out, _ = run(capsys, "validate", PLAN_8B, LAPTOP)
    assert code == 0 and out.count("ok ") == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(PLAN_8B.read_text().replace("device: cuda", "device: tpu", 1))
    junk = tmp_path / "junk.yaml"
    junk.write_text("kind: [unclosed")
    other = tmp_path / "other.yaml"
    other.write_text("kind: recipe\n")
    code, out, _ = run(capsys, "validate", PLAN_8B, bad, junk, other, tmp_path / "missing.yaml")
    assert code == 1 and out.count("FAIL") == 4
    assert "field 'partition.stages[1].device': must be one of 'cpu', 'cuda'" in out and "tpu" not in out
    assert "malformed YAML" in out and "expected 'plan' or 'machine_profile'" in out and "no such file" in out


@pytest.mark.parametrize("argv,message", [
    (["plan", "{cfg}", "--machine", "{laptop}", "--gpu-memory", "100GiB"], "is more than the GPU has"),
    (["plan", "{cfg8}", "--machine", "{laptop}", "--host-memory", "1MiB"], "no feasible split"),
    (["plan", "{cfg}", "--machine", "{laptop}", "--split", "99"], "out of range"),
    (["plan", "{tmp}/unknown.json", "--machine", "{laptop}"], "unknown architecture"),
    (["plan", "{tmp}/broken.json", "--machine", "{laptop}"], "malformed model config"),
    (["plan", "{cfg}", "--machine", "{tmp}/broken-machine.yaml"], "field 'cpu.dram_read_gibps'"),
    (["plan", "{cfg}", "--machine", "{tmp}/nope.yaml"], "machine profile not found"),
    (["plan", "{cfg32}", "--machine", "{laptop}"], "all-CPU (k=66) needs"),
    (["show", "{tmp}/tampered.yaml"], "digest mismatch"),
])
def test_bad_input_is_a_one_line_error(argv, message, tmp_path, capsys):
    (tmp_path / "unknown.json").write_text('{"model_type": "warp-drive", "hidden_size": 8}')
    (tmp_path / "broken.json").write_text('{"model_type": "qwen3",')
    (tmp_path / "broken-machine.yaml").write_text(LAPTOP.read_text().replace("dram_read_gibps: 45 GB/s", "dram_read_gibps: -1"))
    (tmp_path / "tampered.yaml").write_text(PLAN_8B.read_text().replace("watermark: 0.8", "watermark: 0.5"))
    subst = dict(cfg=config_path("qwen3-0.6b"), cfg8=config_path("qwen3-8b"), cfg32=config_path("qwen3-32b"), laptop=LAPTOP, tmp=tmp_path)
    code, out, err = run(capsys, *[a.format(**subst) for a in argv])
    assert code == 2 and message in err and err.startswith("helm-plan: error:") and "Traceback" not in err


def test_bad_sizes_and_numbers_are_usage_errors(capsys):
    for argv in (["plan", "x", "--gpu-memory", "lots"], ["plan", "x", "--batch-size", "0"], ["diff", "a"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


def test_trace_prints_the_units(capsys):
    code, out, _ = run(capsys, "trace", config_path("llama-3.2-1b"))
    assert code == 0 and "18 units" in out and "shared: model.embed_tokens.weight" in out
    code, out, _ = run(capsys, "trace", "--json", config_path("llama-3.2-1b"))
    assert json.loads(out)["num_blocks"] == 16


def test_the_installed_entry_point_exits_cleanly_on_bad_input(tmp_path):
    """A real interpreter, as a user runs it: no traceback, exit 2."""
    r = subprocess.run([sys.executable, "-m", "planner", "plan", str(tmp_path / "nothing"), "--machine", str(LAPTOP)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "model config not found" in r.stderr and "Traceback" not in r.stderr


def test_show_plot_draws_a_png(tmp_path, capsys):
    """matplotlib is in the test extra: the plot path runs in CI, it is not skipped."""
    out = tmp_path / "t_plan.png"
    code, _, _ = run(capsys, "show", PLAN_8B, "--plot", out)
    assert code == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(shutil.which("helm-plan") is None, reason="helm-plan console script not installed (pip install -e .)")
def test_console_script_is_installed():
    r = subprocess.run(["helm-plan", "validate", str(PLAN_8B)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok")


def test_show_names_the_measured_kernels_when_the_profile_has_them(capsys):
    """A profile with `cpu.kernels` (helm-dev-2core-avx2) prints what they do for the plan's dtype;
    one without (the laptop's, entered by hand) prints no kernels line."""
    import yaml

    machine = yaml.safe_load((REPO / "plans" / "machines" / "helm-dev-2core-avx2.yaml").read_text())
    bf16 = next(r for r in machine["cpu"]["kernels"]["dtypes"] if r["dtype"] == "bfloat16")
    code, out, _ = run(capsys, "show", REPO / "plans" / "qwen3-0.6b.helm-dev-2core-avx2.yaml")
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("kernels"))
    assert f"prompt GEMMs on {bf16['gemm_path']} from {bf16['gemm_min_rows']} rows" in line
    assert f"our kernel up to {bf16['attention_kernel_max_queries']} queries" in line
    code, out, _ = run(capsys, "show", PLAN_8B)
    assert code == 0 and not any(line.startswith("kernels") for line in out.splitlines())


def test_the_command_line_answers_without_loading_torch():
    """helm-plan's parser (its daemon credential flags included) and reading a plan import neither
    torch nor transformers: `--help`, `show`, `diff` and `validate` stay fast."""
    code = ("import sys, planner.cli; planner.cli.parser(); import planner.daemon_client, planner.plan; "
            "planner.plan.load_plan(sys.argv[1]); print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, str(PLAN_8B)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_profile_refuses_an_unwritable_output_before_measuring(tmp_path, capsys, monkeypatch):
    """It measured for half a minute, then failed to write."""
    from planner import profile
    from planner.cli import main

    monkeypatch.setattr(profile, "profile_machine", lambda **kw: (_ for _ in ()).throw(AssertionError("measured")))
    blocker = tmp_path / "a file"
    blocker.write_text("")
    assert main(["profile", "--quick", "-o", str(blocker / "machine.yaml")]) != 0
    assert "cannot write -o" in capsys.readouterr().err
    assert main(["profile", "--quick", "-o", str(blocker / "sub" / "machine.yaml")]) != 0  # under a file
    assert "is not a directory" in capsys.readouterr().err
