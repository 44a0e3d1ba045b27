"""Units: sizes, bandwidths and FLOP rates read with any unit a datasheet uses, stored in one
canonical unit (bytes, GiB/s, GFLOP/s), the same numbers whichever way they were written."""
from __future__ import annotations

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from planner.errors import PlanError
from planner.machine import complete_profile, load_machine, machine_to_yaml
from planner.units import GIB, fmt_bytes, fmt_rate, parse_bytes, parse_flops, parse_rate
from tests.planner.conftest import LAPTOP

RATE_UNITS = {"GB/s": 1e9 / GIB, "GiB/s": 1.0, "MB/s": 1e6 / GIB, "MiB/s": 2**20 / GIB, "TB/s": 1e12 / GIB,
              "GBps": 1e9 / GIB, "": 1.0}
SIZE_UNITS = {"GB": 10**9, "GiB": GIB, "MiB": 2**20, "MB": 10**6, "KiB": 1024, "": 1}
FLOPS_UNITS = {"TFLOPS": 1e3, "GFLOPS": 1.0, "GFLOP/s": 1.0, "TFLOP/s": 1e3, "": 1.0}


@given(st.floats(min_value=0.01, max_value=1e5, allow_nan=False), st.sampled_from(sorted(RATE_UNITS)),
       st.sampled_from(["", " "]))
def test_a_rate_in_any_unit_reads_as_gibps(value, unit, space):
    text = f"{value!r}{space if unit else ''}{unit}"
    assert parse_rate(text) == pytest.approx(value * RATE_UNITS[unit], rel=1e-12)


@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(sorted(SIZE_UNITS)))
def test_a_size_in_any_unit_reads_as_bytes(value, unit):
    assert parse_bytes(f"{value}{unit}") == value * SIZE_UNITS[unit]


@given(st.floats(min_value=0.01, max_value=1e6, allow_nan=False), st.sampled_from(sorted(FLOPS_UNITS)))
def test_a_flop_rate_in_any_unit_reads_as_gflops(value, unit):
    assert parse_flops(f"{value!r} {unit}".strip()) == pytest.approx(value * FLOPS_UNITS[unit], rel=1e-12)


@given(st.integers(min_value=1, max_value=2**50))
def test_printed_sizes_read_back_within_their_rounding(n):
    assert parse_bytes(fmt_bytes(n)) == pytest.approx(n, rel=0.01, abs=1)


def test_printed_rates_carry_both_units():
    assert fmt_rate(parse_rate("936 GB/s")) == "871.7 GiB/s (936 GB/s)"


@pytest.mark.parametrize("text", ["936 GB", "fast", "-3 GB/s", "0 GB/s", "5 GiBs", "1e400 GB/s", "nan GB/s", "inf"])
def test_a_rate_that_is_not_one_is_refused(text):
    with pytest.raises(PlanError, match="bandwidth"):
        parse_rate(text, "bandwidth")


@pytest.mark.parametrize("text", ["1e30 GB", "8 GiB/s", "-1GB", "0", 2**65, True, 0])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(PlanError):
        parse_bytes(text)


@pytest.mark.parametrize("text,parse", [("100 Gb/s", parse_rate), ("100Gbps", parse_rate), ("800 mb/s", parse_rate),
                                        ("16Gb", parse_bytes), ("8 gib", parse_bytes)])
def test_bits_are_refused_not_read_as_bytes(text, parse):
    """A lowercase b is a bit: upper-cased, 100 Gb/s read as 100 GB/s, 8x the link."""
    with pytest.raises(PlanError, match="is in bits"):
        parse(text)


def test_a_profile_written_with_units_loads_to_the_canonical_one_and_round_trips():
    m = load_machine(LAPTOP)            # the checked-in laptop profile is written with units
    assert m.cpu.dram_read_gibps == pytest.approx(45e9 / GIB, rel=1e-5)
    assert m.gpu.hbm_gibps == pytest.approx(218e9 / GIB, rel=1e-5)
    assert m.gpu.prefill_gflops == 40_000 and m.cpu.l3_bytes == 24 << 20
    assert (m.gpu.vram_total_bytes, m.gpu.vram_usable_bytes) == (8 * GIB, 7 * GIB)
    assert m.cpu.ram_available_bytes == int(13.5 * GIB)
    assert m.link.d2h_gibps == m.link.h2d_gibps and m.cpu.threads == 20
    canonical = machine_to_yaml(m)
    assert "GB/s" not in canonical.split("\ncpu:")[1] and load_machine(canonical) == m
    again = yaml.safe_load(canonical)
    assert complete_profile(again) == again       # a complete profile comes back unchanged


def test_a_unit_that_cannot_be_read_names_the_field():
    text = LAPTOP.read_text().replace("hbm_gibps: 218 GB/s", "hbm_gibps: 218 GB")
    with pytest.raises(PlanError, match=r"field 'gpu.hbm_gibps': cannot read '218 GB' as a bandwidth"):
        load_machine(text)


@pytest.mark.parametrize("text,parse", [("936 /s", parse_rate), ("936 ps", parse_rate), ("5 /s", parse_flops),
                                        ("5 TFLOPS/s", parse_flops), ("5 GB/s", parse_flops)])
def test_a_per_second_without_its_unit_is_refused(text, parse):
    with pytest.raises(PlanError, match="cannot read"):
        parse(text)
