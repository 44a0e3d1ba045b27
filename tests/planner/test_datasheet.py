"""`helm-plan machine`: datasheet profiles reproduce budgets and rates computed by hand from the
published figures, say where every figure came from, and refuse what they cannot know."""
from __future__ import annotations

import pytest
import yaml

from planner import cli
from planner.datasheet import datasheet_machine
from planner.errors import PlanError
from planner.machine import load_machine, machine_to_yaml
from planner.planning import make_plan
from tests.planner.conftest import config_path

GIB = 2**30


def gibps(gb_per_s: float) -> float:
    return gb_per_s * 1e9 / GIB


def test_rtx3090_epyc7h12_matches_the_hand_computed_profile():
    m = datasheet_machine(gpu="RTX 3090", cpu="EPYC 7H12", ram_bytes=128 * GIB)
    assert m.source == "datasheet" and m.gpu.name == "GeForce RTX 3090" and m.cpu.model_name == "AMD EPYC 7H12"
    # GPU: 24 GiB, 1 GiB of CUDA context; 936 GB/s x 0.85; 71 TFLOPS dense x 0.5
    assert (m.gpu.vram_total_bytes, m.gpu.vram_usable_bytes, m.gpu.cuda_context_reserve_bytes) == \
        (24 * GIB, 23 * GIB, GIB)
    assert m.gpu.hbm_gibps == pytest.approx(gibps(936) * 0.85, rel=1e-5)
    assert m.gpu.prefill_gflops == pytest.approx(71_000 * 0.5, rel=1e-5)
    # PCIe 4.0 x16: 16 lanes x 16 GT/s x 128/130 / 8 bits = 31.5 GB/s, x 0.8
    assert m.link.h2d_gibps == m.link.d2h_gibps == pytest.approx(gibps(16 * 16 * 128 / 130 / 8) * 0.8, rel=1e-5)
    # CPU: 8 channels of DDR4-3200 x 8 bytes = 204.8 GB/s x 0.6; 64 cores x 32 FLOP x 2.6 GHz x 0.5
    assert m.cpu.dram_read_gibps == pytest.approx(gibps(8 * 3200e6 * 8 / 1e9) * 0.6, rel=1e-5)
    assert m.cpu.compute_gflops == pytest.approx(64 * 32 * 2.6 * 0.5, rel=1e-5)
    assert m.cpu.l3_read_gibps == pytest.approx(3 * m.cpu.dram_read_gibps, rel=1e-3)   # 4 significant digits
    assert (m.cpu.cores, m.cpu.threads, m.cpu.l3_bytes) == (64, 128, 256 << 20)
    # the OS keeps max(2 GiB, 10%) of 128 GiB
    assert m.cpu.ram_available_bytes == 128 * GIB - int(0.1 * 128 * GIB)
    # and a plan made for it has those budgets
    plan = make_plan(config_path("qwen3-8b"), m)
    assert plan.limits.gpu_budget_bytes == 23 * GIB and plan.limits.host_budget_bytes == m.cpu.ram_available_bytes
    assert plan.partition.split_k == 0          # 15.3 GiB of Qwen3-8B fits the 23 GiB
    # an Ampere card: PyTorch's flash attention runs there, so prompt chunks are priced fused
    assert m.gpu.flash_attention is True and any("flash attention: runs" in a for a in m.datasheet.assumptions)


def test_rtx4060_laptop_i7_13700h_matches_the_hand_computed_profile():
    m = datasheet_machine(gpu="rtx 4060 laptop", cpu="i7-13700H", ram_bytes=16 * GIB)
    assert m.gpu.name == "GeForce RTX 4060 Laptop GPU" and (m.gpu.vram_total_bytes, m.gpu.vram_usable_bytes) == \
        (8 * GIB, 7 * GIB)
    assert m.gpu.hbm_gibps == pytest.approx(gibps(256) * 0.85, rel=1e-5)   # 217.6 GB/s: the thesis measured 218
    assert m.link.h2d_gibps == pytest.approx(gibps(8 * 16 * 128 / 130 / 8) * 0.8, rel=1e-5)   # PCIe 4.0 x8
    assert m.cpu.dram_read_gibps == pytest.approx(gibps(2 * 5200e6 * 8 / 1e9) * 0.6, rel=1e-5)
    # 6 P-cores x 32 FLOP x 2.4 GHz + 8 E-cores x 16 FLOP x 1.8 GHz, x 0.5
    assert m.cpu.compute_gflops == pytest.approx((6 * 32 * 2.4 + 8 * 16 * 1.8) * 0.5, rel=1e-5)
    assert (m.cpu.cores, m.cpu.threads) == (14, 20) and "avx512f" not in m.cpu.isa
    assert m.cpu.ram_available_bytes == 14 * GIB          # 16 GiB less 2 GiB
    plan = make_plan(config_path("qwen3-8b"), m)
    assert plan.limits.gpu_budget_bytes == 7 * GIB and 0 < plan.partition.split_k < plan.partition.num_units


def test_every_rate_records_its_peak_efficiency_and_source():
    m = datasheet_machine(gpu="L40S", cpu="EPYC 9654", ram_bytes=192 * GIB, efficiency={"hbm": 0.9})
    rates = {r.field: r for r in m.datasheet.rates}
    assert set(rates) == {"cpu.dram_read_gibps", "cpu.compute_gflops", "gpu.hbm_gibps", "gpu.prefill_gflops",
                          "link.h2d_gibps", "link.d2h_gibps"}
    assert rates["gpu.hbm_gibps"].efficiency == 0.9 and m.gpu.hbm_gibps == pytest.approx(gibps(864) * 0.9, rel=1e-5)
    assert "864 GB/s" in rates["gpu.hbm_gibps"].basis and "12 channels x DDR5-4800" in rates["cpu.dram_read_gibps"].basis
    assert any("L40S" in s and "datasheet" in s for s in m.datasheet.sources)
    assert any("CUDA context" in a for a in m.datasheet.assumptions)
    assert load_machine(machine_to_yaml(m)) == m


def test_explicit_figures_override_the_catalogue_and_stand_alone():
    m = datasheet_machine(gpu="RTX 4060 Laptop", cpu="i7-13700H", ram_bytes=32 * GIB, pcie="4x16")
    assert m.link.h2d_gibps == pytest.approx(gibps(16 * 16 * 128 / 130 / 8) * 0.8, rel=1e-5)
    m = datasheet_machine(ram_bytes=64 * GIB, cores=8, dram="2ch-DDR5-6000", vram_bytes=24 * GIB,
                          hbm_gibps=gibps(960), gpu_gflops=100_000, pcie="32GB/s", gpu="my card")
    assert m.gpu.name == "my card" and m.datasheet.gpu == "entered" and m.datasheet.cpu == "entered"
    assert m.gpu.flash_attention is None        # an entered card: not known, prompt chunks priced streamed
    assert m.cpu.dram_read_gibps == pytest.approx(gibps(2 * 6000e6 * 8 / 1e9) * 0.6, rel=1e-5)
    assert m.link.h2d_gibps == pytest.approx(gibps(32) * 0.8, rel=1e-5)
    assert any("CPU peak assumed" in a for a in m.datasheet.assumptions)


@pytest.mark.parametrize("kwargs,message", [
    (dict(gpu="RTX 3909", cpu="EPYC 7H12"), "did you mean 'GeForce RTX 3090'"),
    (dict(cpu="EPYC 7H12", vram_bytes=8 * GIB), "needs --hbm, --gpu-tflops, --pcie"),
    (dict(gpu="L4"), "give --cpu NAME"),
    (dict(cpu="EPYC 7H12", efficiency={"dram": 1.5}), "must be in (0, 1]"),
    (dict(cpu="EPYC 7H12", efficiency={"l2": 0.5}), "--efficiency l2: unknown"),
    (dict(cpu="EPYC 7H12", dram="3 sticks"), "--dram '3 sticks'"),
    (dict(gpu="L4", cpu="EPYC 7H12", pcie="x16"), "--pcie 'x16'"),
    (dict(cpu="EPYC 7H12", ram_available_bytes=200 * GIB), "is more than --ram"),
    (dict(gpu="L4", cpu="EPYC 7H12", cuda_reserve_bytes=30 * GIB), "leaves nothing"),
])
def test_what_cannot_be_known_is_refused(kwargs, message):
    with pytest.raises(PlanError) as e:
        datasheet_machine(ram_bytes=128 * GIB, **kwargs)
    assert message in str(e.value)


def test_a_datasheet_rate_edited_by_hand_is_refused_naming_the_field():
    data = yaml.safe_load(machine_to_yaml(datasheet_machine(gpu="RTX 3090", cpu="EPYC 7H12", ram_bytes=128 * GIB)))
    data["gpu"]["hbm_gibps"] = 900.0
    with pytest.raises(PlanError, match=r"field 'gpu.hbm_gibps'.*peak 871.718 x efficiency 0.85"):
        load_machine(yaml.safe_dump(data))
    data = yaml.safe_load(machine_to_yaml(datasheet_machine(gpu="RTX 3090", cpu="EPYC 7H12", ram_bytes=128 * GIB)))
    del data["datasheet"]
    with pytest.raises(PlanError, match="field 'datasheet'"):
        load_machine(yaml.safe_dump(data))


def test_the_cli_writes_a_profile_the_plan_header_show_and_diff_call_datasheet(tmp_path, capsys):
    out = tmp_path / "m.yaml"
    assert cli.main(["machine", "--gpu", "RTX 3090", "--cpu", "EPYC 7H12", "--ram", "128GiB", "-o", str(out)]) == 0
    m = load_machine(out)
    assert m.source == "datasheet" and m.name == "rtx-3090-epyc-7h12"
    assert cli.main(["machine", "--cpu", "EPYC 7H12", "--ram", "128 GB", "--hbm", "936 GB/s", "--vram", "24GiB",
                     "--gpu-tflops", "71TFLOPS", "--pcie", "gen4x16", "--efficiency", "dram=0.7", "--name", "x"]) == 0
    explicit = load_machine(capsys.readouterr().out)
    assert explicit.gpu.hbm_gibps == pytest.approx(m.gpu.hbm_gibps, rel=1e-5)
    assert explicit.cpu.ram_total_bytes == 128 * 10**9
    assert explicit.cpu.dram_read_gibps == pytest.approx(m.cpu.dram_read_gibps * 0.7 / 0.6, rel=1e-5)
    plan = tmp_path / "p.yaml"
    assert cli.main(["plan", str(config_path("qwen3-0.6b")), "--machine", str(out), "-o", str(plan)]) == 0
    assert "on rtx-3090-epyc-7h12 (datasheet profile)" in plan.read_text().splitlines()[0]
    capsys.readouterr()
    assert cli.main(["show", str(plan)]) == 0
    assert "machine   rtx-3090-epyc-7h12 (datasheet)" in capsys.readouterr().out
    from tests.planner.conftest import REPO
    assert cli.main(["diff", str(plan), str(REPO / "plans" / "qwen3-0.6b.helm-dev-2core.yaml")]) == 1
    text = capsys.readouterr().out
    assert "[datasheet]" in text and "[measured]" in text and "machine.source: datasheet -> measured" in text
    assert cli.main(["machine", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "GeForce RTX 3090" in listing and "AMD EPYC 7H12" in listing
    assert cli.main(["machine", "--gpu", "RTX 3090"]) == 2
    assert "--ram is required" in capsys.readouterr().err


# The checked-in datasheet profiles and the commands that make them (also in plans/README.md).
CHECKED_IN = {
    "workstation-rtx4090-r9-7950x.yaml": ["--gpu", "RTX 4090", "--cpu", "Ryzen 9 7950X", "--ram", "128GiB"],
    "server-rtx3090-epyc7h12.yaml": ["--gpu", "RTX 3090", "--cpu", "EPYC 7H12", "--ram", "128GiB"],
    "server-l40s-epyc9654.yaml": ["--gpu", "L40S", "--cpu", "EPYC 9654", "--ram", "192GiB"],
}


@pytest.mark.parametrize("name", sorted(CHECKED_IN))
def test_checked_in_datasheet_profiles_are_what_the_command_writes(name, tmp_path):
    from tests.planner.conftest import MACHINES

    out = tmp_path / name
    assert cli.main(["machine", *CHECKED_IN[name], "--name", name.removesuffix(".yaml"), "-o", str(out)]) == 0
    assert out.read_text() == (MACHINES / name).read_text(), f"plans/machines/{name} is stale: rerun its command"


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["link"].__setitem__("h2d_latency_us", float("nan")), "link.h2d_latency_us"),
    (lambda d: d["gpu"].__setitem__("hbm_gibps", float("inf")), "gpu.hbm_gibps"),
    (lambda d: d["calibration"]["cuda"].__setitem__("eta_memory", float("nan")), "calibration.cuda.eta_memory"),
])
def test_non_finite_numbers_are_refused_naming_the_field(mutate, field):
    """NaN and infinity pass a JSON Schema's minimum, then crash the plan's digest: refused here."""
    data = yaml.safe_load(machine_to_yaml(datasheet_machine(gpu="RTX 3090", cpu="EPYC 7H12", ram_bytes=128 * GIB)))
    del data["datasheet"]
    data["source"] = "manual"
    mutate(data)
    with pytest.raises(PlanError, match=f"field '{field}': must be a finite number"):
        load_machine(yaml.safe_dump(data))


def test_a_non_finite_flag_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as e:        # argparse's usage error
        cli.main(["machine", "--cpu", "7H12", "--gpu", "3090", "--ram", "128GiB", "--link-latency", "nan"])
    assert e.value.code == 2 and "expected a finite number" in capsys.readouterr().err
    assert cli.main(["machine", "--cpu", "7H12", "--ram", "128GiB", "--pcie", "4x16"]) == 2
    assert "--pcie is the GPU's host link" in capsys.readouterr().err
