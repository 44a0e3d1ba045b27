"""The one error type the planner raises for bad input.

Every user-facing failure (unknown architecture, malformed config or profile, a plan that fails
its schema or whose digest no longer matches, impossible memory caps) is a `PlanError`; the CLI
prints its message and exits non-zero, never a traceback.
"""
from __future__ import annotations


class PlanError(ValueError):
    """Bad input to the planner or a plan/profile that fails validation. The message says what
    is wrong and where (for schema failures: the field path, e.g. `partition.stages[0].device`)."""


class InfeasibleError(PlanError):
    """The input is fine, but no split fits the machine (or none serves what was asked): an
    answer, not a mistake. `reason` says why in one line (the message may say more)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason
