"""JSON Schema validation of plans and machine profiles (schemas/*.schema.json).

The schemas live in the repository's `schemas/` directory (next to this package); both the
planner and the executor validate through `validate()`, whose PlanError names the failing field
path (`partition.stages[0].device`).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from planner.errors import PlanError

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"
SCHEMA_FILES = {"plan": "plan.schema.json", "machine": "machine.schema.json", "report": "report.schema.json"}


@functools.lru_cache(maxsize=None)
def _validator(kind: str):
    import jsonschema
    from referencing import Registry, Resource

    resources = []
    for name in SCHEMA_FILES.values():
        path = SCHEMA_DIR / name
        if not path.is_file():
            raise PlanError(f"schema not found: {path} (helm-plan expects the repository's schemas/ "
                            "directory next to planner/; install with `pip install -e .`)")
        resources.append((name, Resource.from_contents(json.loads(path.read_text()))))
    registry = Registry().with_resources(resources)
    schema = json.loads((SCHEMA_DIR / SCHEMA_FILES[kind]).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, registry=registry)


def field_path(parts) -> str:
    out = ""
    for p in parts:
        p = p if isinstance(p, int) else str(p)[:64]  # keys come from the file: bounded in messages
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "<top>"


_BOUNDS = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}


def rule_broken(error) -> str:
    """What the failing schema rule requires, in the schema's words only: jsonschema's own messages
    quote the offending value, which may be anything the file holds (a secret, megabytes)."""
    rule, value, instance = error.validator, error.validator_value, error.instance
    if rule in _BOUNDS:
        return f"must be {_BOUNDS[rule]} {value}"
    if rule == "type":
        return f"must be of type {' or '.join(value) if isinstance(value, list) else value}"
    if rule == "enum":
        return f"must be one of {', '.join(map(repr, value))}"
    if rule == "const":
        return f"must be {value!r}"
    if rule == "required":
        missing = [k for k in value if isinstance(instance, dict) and k not in instance]
        return f"misses required field{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    if rule == "additionalProperties":
        known = sorted(error.schema.get("properties", {}))
        return f"has fields the schema does not define (it defines {', '.join(known) or 'none'})"
    if rule in ("minLength", "maxLength", "minItems", "maxItems"):
        return f"{'length' if 'Length' in rule else 'item count'} must be {'>=' if rule.startswith('min') else '<='} {value}"
    if rule == "pattern":
        return f"must match {value}"
    if rule in ("oneOf", "anyOf"):
        return "matches none of the allowed forms"
    return f"breaks the schema's '{rule}' rule"


def validate(instance: Any, kind: str, what: str = "") -> None:
    """Raise PlanError naming the failing field path if `instance` does not match the schema."""
    import jsonschema

    errors = list(_validator(kind).iter_errors(instance))
    if not errors:
        return
    best = jsonschema.exceptions.best_match(errors)
    where = field_path(best.absolute_path)
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    label = f"{what}: " if what else ""
    raise PlanError(f"{label}{SCHEMA_FILES[kind]} violation at field '{where}': {rule_broken(best)}{more}")
