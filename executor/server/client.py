"""A small client of the daemon, used by `helm-executor generate --addr`, `helm-executor report`,
tools/load_test.py and the end-to-end tests. Messages are the generated helm.executor.v1 types;
results convert to domain types with their `from_pb`."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor.errors import CredentialError
from executor.pb import executor_pb2 as pb, executor_pb2_grpc as pb_grpc
from executor.server.auth import BearerToken, ClientAuth, is_loopback, read_credential
from planner.report import Report

if TYPE_CHECKING:  # the messages import torch; a client (helm-plan's among them) does not need it
    from executor.server.messages import GenerateSpec

SERVING = health_pb2.HealthCheckResponse.SERVING


class ExecutorClient:
    """A channel to the daemon: plaintext, or TLS when `auth` names a CA or a client certificate;
    the token, if any, goes with every call."""

    def __init__(self, addr: str, auth: ClientAuth | None = None):
        self.addr = addr
        auth = auth or ClientAuth()
        tls = bool(auth.tls_ca or auth.tls_cert)
        if auth.token and not tls and not is_loopback(addr.rsplit(":", 1)[0]):
            raise CredentialError(f"not sending a token in plaintext to {addr}: connect over TLS (--tls-ca)")
        if tls:
            def read(path):
                return read_credential(path, "the PEM file", pipes=True).encode() if path else None

            creds = grpc.ssl_channel_credentials(read(auth.tls_ca), read(auth.tls_key), read(auth.tls_cert))
            channel = grpc.secure_channel(addr, creds)
        else:
            channel = grpc.insecure_channel(addr)
        self.channel = channel
        if auth.token:
            channel = grpc.intercept_channel(channel, BearerToken(auth.token))
        self.stub = pb_grpc.ExecutorServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    def __enter__(self) -> "ExecutorClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def health_status(self, service: str = "", timeout_s: float = 5.0) -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status

    def wait_serving(self, timeout_s: float = 60.0) -> None:
        """Block until the daemon's health is SERVING; TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                status = self.health_status(timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
                if status == SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            time.sleep(0.2)
        raise TimeoutError(f"the daemon at {self.addr} is not SERVING after {timeout_s:g} s ({last})")

    def generate(self, spec: GenerateSpec, timeout_s: float | None = None):
        """The response stream (iterate it; `.cancel()` it to stop)."""
        return self.stub.Generate(spec.to_pb(pb), timeout=timeout_s)

    def info(self, timeout_s: float = 10.0):
        return self.stub.Info(pb.InfoRequest(), timeout=timeout_s)

    def load_plan(self, path: str | None = None, yaml: str | None = None, timeout_s: float = 300.0):
        request = pb.LoadPlanRequest(path=path) if path is not None else pb.LoadPlanRequest(yaml=yaml)
        return self.stub.LoadPlan(request, timeout=timeout_s)

    def get_plan(self, timeout_s: float = 10.0):
        return self.stub.GetPlan(pb.GetPlanRequest(), timeout=timeout_s)

    def report(self, plan_digest: str = "", timeout_s: float = 30.0) -> Report:
        return Report.from_pb(self.stub.GetReport(pb.GetReportRequest(plan_digest=plan_digest), timeout=timeout_s), pb)
