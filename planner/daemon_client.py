"""The planner's one way to a running executor: gRPC, through the daemon's client
(executor.server.client). `helm-plan recalibrate --executor` fetches a plan's report and
applies the next plan version with it."""
from __future__ import annotations

import re

import grpc

from executor.errors import CredentialError
from executor.server.auth import ClientAuth
from executor.server.client import ExecutorClient
from planner.errors import PlanError
from planner.plan import Plan
from planner.report import Report

_ADDR = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


def check_addr(addr: str) -> str:
    if not _ADDR.match(addr) or not 0 < int(addr.rsplit(":", 1)[1]) < 65536:
        raise PlanError(f"--executor {addr!r}: expected HOST:PORT, e.g. 127.0.0.1:50051")
    return addr


def add_credential_flags(group) -> None:
    """The daemon's client credential flags (--token-file, --tls-ca, ...) on an argparse group."""
    ClientAuth.add_args(group)


def client_auth(args) -> ClientAuth:
    """The daemon credentials helm-plan's flags name (cli_args adds them: --token-file, --tls-*)."""
    try:
        return ClientAuth.from_args(args)
    except CredentialError as e:
        raise PlanError(str(e)) from None


def _rpc_error(addr: str, what: str, e) -> PlanError:
    code, details = e.code(), (e.details() or "").strip()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return PlanError(f"cannot reach the executor daemon at {addr} ({what}): {code.name}: "
                         f"{' '.join(details.split())[:300]}; is `helm-executor serve` running there?")
    return PlanError(f"the executor daemon at {addr} refused {what}: {code.name}: {' '.join(details.split())}")


def fetch_report(addr: str, plan: Plan, timeout_s: float = 30.0, auth=None) -> Report:
    """The live report of `plan` from the daemon at `addr` (GetReport with the plan's digest;
    `auth`: an executor.server.auth.ClientAuth for a daemon with TLS or tokens)."""
    check_addr(addr)
    with ExecutorClient(addr, auth) as client:
        try:
            return client.report(plan_digest=plan.digest, timeout_s=timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise PlanError(f"the executor daemon at {addr} has no measurements of this plan (v{plan.plan_version} "
                                f"{plan.digest[:19]}…): {' '.join((e.details() or '').split())}; load it "
                                f"(LoadPlan, or `helm-executor serve --plan`) and send requests first") from None
            raise _rpc_error(addr, "GetReport", e) from None


def apply_plan(addr: str, plan: Plan, timeout_s: float = 600.0, auth=None) -> str:
    """LoadPlan the plan (inline YAML) into the daemon at `addr` and confirm it serves it.
    Returns a one-line confirmation."""
    with ExecutorClient(addr, auth) as client:
        try:
            loaded = client.load_plan(yaml=plan.to_yaml(), timeout_s=timeout_s)
            serving = client.get_plan(timeout_s=30.0)
        except grpc.RpcError as e:
            raise _rpc_error(addr, "LoadPlan", e) from None
    if loaded.plan.digest != plan.digest or serving.plan.digest != plan.digest:
        raise PlanError(f"the executor daemon at {addr} did not confirm the new plan: it loaded "
                        f"{loaded.plan.digest[:19]}… and serves {serving.plan.digest[:19]}…, "
                        f"not {plan.digest[:19]}…")
    previous = f", replacing {loaded.previous_digest[:19]}…" if loaded.previous_digest else ""
    return (f"applied: the daemon at {addr} serves plan v{serving.plan.version} {plan.digest[:19]}… "
            f"(split k={serving.plan.split_k}{previous}; load {loaded.load_ns / 1e9:.1f} s, "
            f"warm-up {loaded.warmup_ns / 1e9:.1f} s)")
