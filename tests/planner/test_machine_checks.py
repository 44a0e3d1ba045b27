"""A machine profile that contradicts itself is refused by `validate` and by loading, naming the
field: the planner once put a 32B model on a 24 GB card whose profile claimed 93 GiB usable."""
from __future__ import annotations

import pytest
import yaml

from planner import cli
from planner.errors import PlanError
from planner.machine import complete_profile, load_machine
from planner.plan import load_plan
from tests.planner.conftest import LAPTOP, REPO

GIB = 2**30


def edited(**changes) -> str:
    """The laptop's profile in full (the file is shorthand), with `changes` made."""
    data = complete_profile(yaml.safe_load(LAPTOP.read_text()))
    for path, value in changes.items():
        section, field = path.split("__")
        if value is None:
            data[section] = None
        else:
            data[section][field] = value
    return yaml.safe_dump(data, sort_keys=False)


CONTRADICTIONS = [
    ({"gpu__vram_usable_bytes": 93 * GIB}, "gpu.vram_usable_bytes", "93.0 GiB usable is more than the"),
    ({"gpu__cuda_context_reserve_bytes": 1}, "gpu.cuda_context_reserve_bytes", "is not total - usable"),
    ({"gpu__hbm_gibps": 0.0}, "gpu.hbm_gibps", "must be > 0"),
    ({"cpu__dram_read_gibps": -1.0}, "cpu.dram_read_gibps", "must be > 0"),
    ({"cpu__ram_available_bytes": 10**15}, "cpu.ram_available_bytes", "available is more than the"),
    ({"cpu__threads": 1}, "cpu.threads", "fewer than the"),
    ({"link__": None}, "link", "go together"),
]


@pytest.mark.parametrize("changes,field,message", CONTRADICTIONS, ids=[c[1] for c in CONTRADICTIONS])
def test_a_contradiction_is_refused_naming_its_field(tmp_path, capsys, changes, field, message):
    text = edited(**changes)
    with pytest.raises(PlanError, match=f"field '{field}'"):
        load_machine(text)
    path = tmp_path / "machine.yaml"
    path.write_text(text)
    assert cli.main(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"field '{field}'" in out and message in out


def test_a_plan_carrying_a_contradictory_machine_is_refused():
    from dataclasses import replace

    from planner.plan import plan_digest

    plan = load_plan(REPO / "plans" / "qwen3-8b.laptop-rtx4060.yaml")
    gpu = replace(plan.machine.gpu, vram_usable_bytes=93 * GIB)
    bad = replace(plan, machine=replace(plan.machine, gpu=gpu))
    bad = replace(bad, digest=plan_digest(bad))
    with pytest.raises(PlanError, match="field 'machine.gpu.vram_usable_bytes'"):
        load_plan(bad.to_yaml())
