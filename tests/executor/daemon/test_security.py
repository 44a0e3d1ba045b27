"""Who may call what: TLS (and mutual TLS) with certificates made in the test, bearer tokens with a
client and an admin role, health open to probes, and a daemon that will not listen beyond
loopback unprotected unless told --insecure."""
from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from executor.cli import main
from executor.pb import executor_pb2 as pb
from executor.server.auth import ClientAuth, Tokens, is_loopback, server_credentials
from executor.server.client import ExecutorClient
from executor.server.daemon import Daemon
from executor.errors import CredentialError
from executor.server.guard import CLIENT_CALLS, OPEN_READERS
from executor.server.messages import PlanSource
from executor.server.serve import security_of, start_server
from tests.executor.daemon.certs import make_certs
from tests.executor.daemon.helpers import REPO, collect, write_plan
from tests.executor.helpers import helm_generate

CLIENT_TOKEN = "client-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"
PROMPT = [11, 12, 13, 14]


def request(n=5):
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), stopping=pb.StoppingCriteria(max_new_tokens=n,
                                                                                              ignore_eos=True))


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    model = checkpoint("qwen3", "fp32")
    plans = tmp_path_factory.mktemp("plans")
    write_plan(model, 2, plans / "plan.yaml")
    daemon = Daemon(model, max_batch=2, max_queue=2, plan_dir=plans)
    daemon.load_plan(PlanSource(path="plan.yaml"))
    yield model, daemon
    daemon.drain(5)
    daemon.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    (d / "tokens").write_text(f"# roles\nclient {CLIENT_TOKEN}\nadmin  {ADMIN_TOKEN}  # the operator\n")
    (d / "tokens").chmod(0o600)
    (d / "client").write_text(CLIENT_TOKEN + "\n")
    return d


def test_roles_over_tls(served, certs, token_files, capsys):
    model, daemon = served
    credentials = server_credentials(str(certs.server_cert), str(certs.server_key), None)
    server, port = start_server(daemon, "127.0.0.1", 0, Tokens.from_file(token_files / "tokens"), credentials)
    addr = f"127.0.0.1:{port}"
    want = helm_generate(model, [PROMPT], split=2, max_new_tokens=5, page_size=16)[0][0]
    try:
        with ExecutorClient(addr, ClientAuth(tls_ca=str(certs.ca))) as anonymous:
            assert anonymous.health_status() == health_pb2.HealthCheckResponse.SERVING  # probes need no token
            assert code_of(lambda: collect(anonymous.stub.Generate(request(), timeout=30))) \
                == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: anonymous.load_plan(path="plan.yaml")) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: anonymous.info()) == grpc.StatusCode.UNAUTHENTICATED
        with ExecutorClient(addr, ClientAuth(token="x" * 32, tls_ca=str(certs.ca))) as stranger:
            assert code_of(lambda: stranger.info()) == grpc.StatusCode.UNAUTHENTICATED
        with ExecutorClient(addr, ClientAuth(token=CLIENT_TOKEN, tls_ca=str(certs.ca))) as client:
            ids, _, _ = collect(client.stub.Generate(request(), timeout=30))
            assert ids == want and client.info().plan.split_k == 2
            for admin_only in (lambda: client.load_plan(path="plan.yaml"), lambda: client.report(),
                               lambda: client.get_plan()):
                assert code_of(admin_only) == grpc.StatusCode.PERMISSION_DENIED
        with ExecutorClient(addr, ClientAuth(token=ADMIN_TOKEN, tls_ca=str(certs.ca))) as admin:
            assert admin.report().steps > 0 and admin.get_plan().plan.split_k == 2
            assert admin.load_plan(path="plan.yaml").plan.split_k == 2
        with ExecutorClient(addr, ClientAuth(token=ADMIN_TOKEN)) as plaintext:  # TLS only: a plaintext channel fails
            assert code_of(lambda: plaintext.info(timeout_s=5)) == grpc.StatusCode.UNAVAILABLE

        assert main(["generate", "--addr", addr, "--tls-ca", str(certs.ca), "--token-file", str(token_files / "client"),
                     "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "5", "--ignore-eos",
                     "--json"]) == 0
        assert f'"token_ids": {want}' in capsys.readouterr().out
        assert main(["report", "--addr", addr, "--tls-ca", str(certs.ca), "--token-file",
                     str(token_files / "client")]) == 2
        assert "PERMISSION_DENIED" in capsys.readouterr().err
    finally:
        server.stop(0).wait(5)


def test_mutual_tls_needs_a_client_certificate(served, certs):
    _, daemon = served
    credentials = server_credentials(str(certs.server_cert), str(certs.server_key), str(certs.ca))
    server, port = start_server(daemon, "127.0.0.1", 0, None, credentials)
    addr = f"127.0.0.1:{port}"
    try:
        with ExecutorClient(addr, ClientAuth(tls_ca=str(certs.ca))) as no_cert:
            assert code_of(lambda: no_cert.info(timeout_s=5)) == grpc.StatusCode.UNAVAILABLE
        with ExecutorClient(addr, ClientAuth(tls_ca=str(certs.ca), tls_cert=str(certs.client_cert),
                                             tls_key=str(certs.client_key))) as with_cert:
            assert with_cert.info().plan.split_k == 2
    finally:
        server.stop(0).wait(5)


@pytest.mark.parametrize("text,message", [
    ("client short\nadmin " + ADMIN_TOKEN, ":1: a token needs at least 16"),
    ("root " + ADMIN_TOKEN, ":1: expected 'client TOKEN' or 'admin TOKEN'"),
    ("client " + CLIENT_TOKEN, "no admin token"),
    (f"admin {ADMIN_TOKEN}\nclient {ADMIN_TOKEN}", ":2: the same token appears twice"),
])
def test_token_file_mistakes_are_named(tmp_path, text, message):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(CredentialError, match=message):
        Tokens.from_file(path)


def test_no_listening_beyond_loopback_unprotected(served, caplog):
    model, _ = served
    run = subprocess.run([sys.executable, "-m", "executor.cli", "serve", "--model", str(model), "--host", "0.0.0.0",
                          "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "beyond loopback without TLS (--tls-cert, --tls-key) and --tokens" in run.stderr
    args = argparse.Namespace(host="0.0.0.0", tls_cert=None, tls_key=None, tls_client_ca=None, tokens=None,
                              insecure=True, metrics_port=None, metrics_host="127.0.0.1")
    with caplog.at_level(logging.WARNING):
        assert security_of(args) == (None, None)  # allowed when told, and said (not binding here)
    assert "listening beyond loopback without protection (--insecure)" in caplog.text


@pytest.mark.parametrize("flags,message", [
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-ca", "no/such/ca.pem"], "--tls-ca no/such/ca.pem: no such file"),
    (["--token-file", "no/such/token"], "cannot read the token file no/such/token"),
    (["--token-file", "{two}"], "must hold one token"),
])
def test_client_credential_mistakes_are_one_line_errors(tmp_path, capsys, flags, message):
    two = tmp_path / "two"
    two.write_text("one two\n")
    flags = [f.replace("{two}", str(two)) for f in flags]
    assert main(["info", "--addr", "127.0.0.1:1", *flags]) == 2
    assert message in capsys.readouterr().err
    from planner import cli as plan_cli

    plan = REPO / "plans" / "qwen3-8b.laptop-rtx4060.yaml"
    assert plan_cli.main(["recalibrate", str(plan), "--executor", "127.0.0.1:1", "-o", str(tmp_path / "new.yaml"),
                          *flags]) != 0
    assert message in capsys.readouterr().err and not (tmp_path / "new.yaml").exists()


def test_calls_whose_request_never_arrives_cannot_hold_the_pool(served, token_files):
    """Open calls and never send their request: unauthenticated ones are refused without reading;
    silent health checks beyond OPEN_READERS are answered from the overall status without reading,
    the rest cut off after OPEN_BODY_TIMEOUT_S; authenticated ones beyond their lane refused at
    once, the rest cut off after the body timeout; meanwhile a real call, a health probe and an
    admin call are answered at once."""
    _, daemon = served
    server, port = start_server(daemon, "127.0.0.1", 0, Tokens.from_file(token_files / "tokens"), body_timeout_s=5.0)
    never = threading.Event()

    def silent():
        never.wait(30)
        return
        yield

    token = (("authorization", f"Bearer {CLIENT_TOKEN}"),)
    try:
        with ExecutorClient(f"127.0.0.1:{port}", ClientAuth(token=CLIENT_TOKEN)) as client:
            info = client.channel.stream_unary("/helm.executor.v1.ExecutorService/Info")
            check = client.channel.stream_unary("/grpc.health.v1.Health/Check")
            anonymous = [info.future(silent(), timeout=30) for _ in range(40)]
            health = [check.future(silent(), timeout=30) for _ in range(40)]
            signed = [info.future(silent(), timeout=30, metadata=token) for _ in range(20)]
            time.sleep(0.5)
            with ExecutorClient(f"127.0.0.1:{port}", ClientAuth(token=ADMIN_TOKEN)) as admin:
                for call, answered in ((admin.info, True), (client.health_status, True),
                                       (client.info, False)):  # the client's own lane is full
                    t0 = time.perf_counter()
                    if answered:
                        assert call(timeout_s=10)
                    else:
                        with pytest.raises(grpc.RpcError) as refused:
                            call(timeout_s=10)
                        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert time.perf_counter() - t0 < 1.0  # far below either body timeout
            codes = lambda calls: [c.exception(timeout=15) and c.exception().code() for c in calls]  # noqa: E731
            assert codes(anonymous) == [grpc.StatusCode.UNAUTHENTICATED] * 40
            health_codes = codes(health)
            assert health_codes.count(grpc.StatusCode.CANCELLED) == OPEN_READERS
            assert [health_pb2.HealthCheckResponse.FromString(h.result()).status for h in health if not h.exception()] == \
                [health_pb2.HealthCheckResponse.SERVING] * (40 - OPEN_READERS)
            signed_codes = codes(signed)
            assert signed_codes.count(grpc.StatusCode.CANCELLED) == CLIENT_CALLS
            assert signed_codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 20 - CLIENT_CALLS
            assert client.info(timeout_s=10).plan.split_k == 2  # the lane is free again
            assert client.health_status(timeout_s=5) == health_pb2.HealthCheckResponse.SERVING
    finally:
        never.set()
        server.stop(0).wait(5)


def test_a_key_that_is_not_the_certificates_is_named(certs):
    with pytest.raises(CredentialError, match="are not a certificate and its unencrypted key"):
        server_credentials(str(certs.server_cert), str(certs.client_key), None)


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("localhost", True), ("LOCALHOST", True), ("::1", True),
    ("[::1]", True), ("0.0.0.0", False), ("::", False), ("[::]", False), ("", False), ("10.0.0.5", False),
    ("example.com", False), ("localhost.example.com", False),
])
def test_what_counts_as_loopback(host, loopback):
    assert is_loopback(host) == loopback


def test_metrics_beyond_loopback_need_insecure(served, token_files, certs):
    args = argparse.Namespace(host="127.0.0.1", tls_cert=str(certs.server_cert), tls_key=str(certs.server_key),
                              tls_client_ca=None, tokens=str(token_files / "tokens"), insecure=False,
                              metrics_port=0, metrics_host="0.0.0.0")
    with pytest.raises(ValueError, match="the metrics endpoint has no TLS or authentication"):
        security_of(args)
    args.insecure = True
    tokens, credentials = security_of(args)
    assert tokens is not None and credentials is not None


def test_a_token_is_never_sent_in_plaintext_beyond_loopback():
    with pytest.raises(CredentialError, match="not sending a token in plaintext"):
        ExecutorClient("10.1.2.3:50051", ClientAuth(token=CLIENT_TOKEN))
    ExecutorClient("127.0.0.1:50051", ClientAuth(token=CLIENT_TOKEN)).close()


def test_refused_calls_cannot_fill_the_log(caplog, monkeypatch):
    """A flood of refused calls logs REFUSALS_LOGGED lines a minute; the next minute's first line
    counts the rest."""
    from executor.server import guard

    now = [600.0]
    monkeypatch.setattr(guard.time, "monotonic", lambda: now[0])
    refused = guard._RefusalLog()
    with caplog.at_level("INFO", logger="helm.guard"):
        for _ in range(guard.REFUSALS_LOGGED + 140):
            refused({"rpc": "Info", "code": "UNAUTHENTICATED"})
        assert len(caplog.records) == guard.REFUSALS_LOGGED
        now[0] += 60
        refused({"rpc": "Info", "code": "UNAUTHENTICATED"})
    assert len(caplog.records) == guard.REFUSALS_LOGGED + 1
    assert caplog.records[-1].fields["not_logged_before"] == 140


def test_a_drain_waits_for_generate_streams_not_for_calls_whose_request_never_came():
    """serve's drain watches the Generate lane's `serving`: calls that never send their request
    (anyone may open them on a daemon without tokens) would otherwise hold shutdown for the whole
    drain timeout. A guarded server whose Generate streams until told to stop."""
    from concurrent import futures

    from executor.server.guard import RpcGuard

    release, never = threading.Event(), threading.Event()

    def generate(request, context):
        yield request
        release.wait(30)

    guard = RpcGuard(None, generate_streams=4)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=(guard,))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("helm.executor.v1.ExecutorService", {
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate, pb.GenerateRequest.FromString, pb.GenerateRequest.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def silent():
        never.wait(30)
        return
        yield

    lane = guard.generate
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        raw = channel.stream_stream("/helm.executor.v1.ExecutorService/Generate")
        calls = [raw(silent(), timeout=30) for _ in range(2)]
        stream = channel.unary_stream("/helm.executor.v1.ExecutorService/Generate",
                                      request_serializer=pb.GenerateRequest.SerializeToString)(
            request_of_tokens(5), timeout=30)
        next(stream)  # being served, until released
        deadline = time.monotonic() + 5
        while lane.open < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (lane.open, lane.serving) == (3, 1)
        release.set()
        never.set()
        list(stream)
        for call in calls:
            with pytest.raises(grpc.RpcError):
                list(call)
        while (lane.open or lane.serving) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (lane.open, lane.serving) == (0, 0)
    finally:
        release.set()
        never.set()
        server.stop(0).wait(5)


def request_of_tokens(n: int):
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), stopping=pb.StoppingCriteria(
        max_new_tokens=n, ignore_eos=True))


def test_a_full_daemon_still_names_what_is_wrong_with_a_request(served):
    """The cheap refusal of a full daemon (before tokenizing) comes after the checks that make a
    request invalid however long the client waits: those are INVALID_ARGUMENT, not a retryable
    RESOURCE_EXHAUSTED."""
    from executor.errors import OverloadedError, RequestError
    from executor.request_params import SamplingParams, StopCriteria
    from executor.server.messages import GenerateSpec

    _, daemon = served
    spec = lambda **kw: GenerateSpec(prompt_text=kw.get("text"), prompt_ids=kw.get("ids"),  # noqa: E731
                                     sampling=SamplingParams(), stop=StopCriteria(max_new_tokens=4))
    fillers = [f"filler-{i}" for i in range(daemon.max_batch + daemon.max_queue)]
    try:
        for key in fillers:
            daemon._active[key] = None
        with pytest.raises(RequestError, match="token_ids is empty"):
            daemon.submit(spec(ids=()))
        with pytest.raises(RequestError, match="exceeds the plan's context"):
            daemon.submit(spec(ids=(1,) * 100_000))
        with pytest.raises(RequestError, match="more than .* bytes"):
            daemon.submit(spec(text="x" * (daemon.max_prompt_bytes + 1)))
        with pytest.raises(OverloadedError):
            daemon.submit(spec(text="hello"))
    finally:
        for key in fillers:
            daemon._active.pop(key, None)
