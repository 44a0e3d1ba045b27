"""A small client of the daemon, used by `helm-executor generate --addr`, `helm-executor report`,
tools/load_test.py and the end-to-end tests. Messages are the generated helm.executor.v1 types;
results convert to domain types with their `from_pb`."""
from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor.pb import executor_pb2 as pb
from executor.pb import executor_pb2_grpc as pb_grpc
from executor.report import Report
from executor.server.messages import GenerateSpec

SERVING = health_pb2.HealthCheckResponse.SERVING


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer TOKEN` to every call (works on plaintext loopback channels too,
    where gRPC refuses call credentials)."""

    def __init__(self, token: str):
        self._metadata = (("authorization", f"Bearer {token}"),)

    def _with_token(self, details):
        return _CallDetails(details, self._metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details, extra):
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
        self.metadata = tuple(details.metadata or ()) + extra


class ExecutorClient:
    """A channel to the daemon: plaintext, or TLS with `tls_ca` (the CA that signed the daemon's
    certificate; `tls_cert` + `tls_key` for mutual TLS); `token` is sent with every call."""

    def __init__(self, addr: str, token: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, server_name: str | None = None):
        self.addr = addr
        if tls_ca or tls_cert:
            def read(path):
                return open(path, "rb").read() if path else None

            creds = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
            options = (("grpc.ssl_target_name_override", server_name),) if server_name else ()
            channel = grpc.secure_channel(addr, creds, options=options)
        else:
            channel = grpc.insecure_channel(addr)
        self.channel = channel
        if token:
            channel = grpc.intercept_channel(channel, _BearerToken(token))
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
