"""Reading plans and profiles is safe on hostile input: size-checked before reading, regular
files only, no YAML aliases, and no error message quotes the file (the daemon sends these
messages over the network)."""
from __future__ import annotations

import os

import pytest
import yaml

from planner.errors import PlanError
from planner.plan import load_plan
from tests.planner.conftest import REPO
from planner.yamlio import MAX_FILE_BYTES, MAX_YAML_NODES, dump_yaml, parse_yaml, read_text_file

SECRET = "CANARY-7f3a9c"


def alias_bomb(levels: int = 9) -> str:
    """The billion-laughs shape: each level is a list of nine aliases of the previous one."""
    lines = [f'a0: &a0 ["{SECRET}"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_expands():
    text = alias_bomb()
    assert len(text) < 6000
    with pytest.raises(PlanError) as err:
        load_plan(text)
    assert "aliases" in str(err.value) and len(str(err.value)) < 300 and SECRET not in str(err.value)


def test_yaml_errors_give_the_place_not_the_text():
    for text in (f"password: {SECRET}: x\n", f"a: [{SECRET}\n", f"a: !!python/object:os.system {SECRET}\n",
                 f"\t{SECRET}: 1\n"):
        with pytest.raises(PlanError, match="malformed YAML at line") as err:
            load_plan(text)
        assert SECRET not in str(err.value)


def test_a_document_of_too_many_values_is_refused_early():
    with pytest.raises(PlanError, match=f"more than {MAX_YAML_NODES} values"):
        parse_yaml("[" + "1," * (MAX_YAML_NODES + 10) + "1]\n", "plan")
    for plan in sorted((REPO / "plans").rglob("*.yaml")):  # with room to spare for every real file
        text = plan.read_text()
        assert len(text) * 10 < MAX_FILE_BYTES and parse_yaml(text, str(plan))


@pytest.mark.parametrize("text", ["[" * 20000 + "\n", "a: " + "9" * 100000 + "\n"])
def test_pathological_yaml_is_a_plan_error(text):
    with pytest.raises(PlanError, match="malformed YAML"):
        parse_yaml(text, "plan")


def test_schema_errors_do_not_quote_values_or_unknown_keys():
    with pytest.raises(PlanError) as err:
        load_plan(f"kind: plan\n{SECRET}: 1\nschema_version: '{SECRET * 1000}'\n")
    assert SECRET not in str(err.value) and len(str(err.value)) < 1000


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk, and reading it would be the bug
    with pytest.raises(PlanError, match=f"{MAX_FILE_BYTES + 1} bytes, more than the limit"):  # from fstat
        load_plan(big)
    with pytest.raises(PlanError, match="more than the limit"):
        parse_yaml("a: 1\n" + "#" * MAX_FILE_BYTES, "plan")


def test_only_regular_utf8_files_are_read(tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(PlanError, match="not a regular file"):  # and does not block
        read_text_file(fifo, "plan")
    with pytest.raises(PlanError, match="not a regular file"):
        read_text_file(tmp_path, "plan")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"a: \xff\xfe" + SECRET.encode())
    with pytest.raises(PlanError, match="not UTF-8") as err:
        read_text_file(binary, "plan")
    assert SECRET not in str(err.value)


def test_the_writer_never_emits_aliases():
    shared = {"k": [1, 2]}
    text = dump_yaml({"a": shared, "b": shared})
    assert "&" not in text and "*" not in text and yaml.safe_load(text) == {"a": shared, "b": shared}
