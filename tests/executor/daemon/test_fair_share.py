"""One caller cannot lock the others out: each holds at most its share of the admission slots and
of the Generate streams (by the credential the daemon checked), its request ids are its own, and a
caller is whom the daemon authenticated, never what an unchecked header claims. In-process
daemon with two client tokens; the engine is held where requests must stay in flight."""
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from executor.errors import OverloadedError, RequestError
from executor.pb import executor_pb2 as pb
from executor.server.auth import ADMIN, CLIENT, Tokens, caller_scope
from executor.server.client import ClientAuth, ExecutorClient
from executor.server.daemon import Daemon
from executor.server.messages import GenerateSpec, PlanSource
from executor.server.serve import start_server
from tests.executor.daemon.helpers import collect, wait_until, write_plan

ALICE, BOB, ADMIN_TOKEN = "alice-" + "a" * 24, "bob-" + "b" * 24, "admin-" + "c" * 24
PROMPT = (11, 12, 13, 14)


def spec(request_id: str = "", n: int = 4) -> GenerateSpec:
    return GenerateSpec.from_pb(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), request_id=request_id,
                                                   stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True)))


@pytest.fixture
def held_daemon(model, tmp_path):
    """A daemon of 1 running + 3 waiting slots, 2 per caller, whose engine steps only once
    `release` is set."""
    daemon = Daemon(model, max_batch=1, max_queue=3, max_per_caller=2)
    daemon.load_plan(PlanSource(yaml=write_plan(model, 2, tmp_path / "plan.yaml").read_text()))
    engine = daemon._serving.worker.engine
    real_step, release = engine.step, threading.Event()

    def held_step():
        release.wait(30)
        return real_step()

    engine.step = held_step
    yield daemon, release
    release.set()
    daemon.drain(5)
    daemon.close()


def test_one_caller_holds_at_most_its_share_of_the_slots(held_daemon):
    daemon, release = held_daemon
    assert daemon.max_per_caller == 2
    alice, bob = b"a" * 16, b"b" * 16
    handles = [daemon.submit(spec(), alice), daemon.submit(spec(), alice)]
    with pytest.raises(OverloadedError, match="this caller has 2 requests in flight.*per-caller 2"):
        daemon.submit(spec(), alice)
    handles += [daemon.submit(spec(), bob), daemon.submit(spec(), bob)]  # alice's share left bob his
    with pytest.raises(OverloadedError, match="the daemon is full"):
        daemon.submit(spec(), b"c" * 16)
    release.set()
    for h in handles:
        assert list(h)[-1].completion_tokens == 4
    assert daemon.in_flight == 0 and not daemon._per_caller
    assert daemon.submit(spec(), alice) is not None  # her slots came back when her requests ended


def test_a_daemon_without_credentials_is_one_caller_with_every_slot(held_daemon):
    daemon, release = held_daemon
    handles = [daemon.submit(spec(), b"") for _ in range(4)]
    with pytest.raises(OverloadedError, match="the daemon is full"):
        daemon.submit(spec(), b"")
    release.set()
    assert all(list(h)[-1].completion_tokens == 4 for h in handles)


def test_request_ids_are_each_callers_own(held_daemon):
    """Another caller's id in flight is neither refused nor revealed; a caller's own is refused."""
    daemon, release = held_daemon
    alice, bob = b"a" * 16, b"b" * 16
    mine = daemon.submit(spec("job-1"), alice)
    theirs = daemon.submit(spec("job-1"), bob)
    with pytest.raises(RequestError, match="'job-1' is already in flight"):
        daemon.submit(spec("job-1"), alice)
    mine.cancel()
    again = daemon.submit(spec("job-1"), alice)  # ended: the id is free again
    release.set()
    assert list(theirs)[-1].completion_tokens == 4 and list(again)[-1].completion_tokens == 4


def test_max_per_caller_is_checked():
    with pytest.raises(ValueError, match="max_per_caller must be >= 1"):
        Daemon("/nonexistent", max_per_caller=0)


@pytest.mark.parametrize("client_tokens,mutual_tls,share", [
    (0, False, 8), (1, False, 8), (1, True, 8),   # one client, or none told apart: every slot
    (2, False, 4), (5, True, 4), (0, True, 4),    # several: half each
])
def test_a_share_is_set_only_where_several_clients_can_be_told_apart(client_tokens, mutual_tls, share):
    """A one-token deployment (the admin's token beside it is the operator's) keeps the whole
    daemon; two client tokens, or client certificates, split it."""
    from executor.server.daemon import caller_share

    assert caller_share(5, 3, client_tokens, mutual_tls) == share


def _context(token: str | None = None, certificate: bytes | None = None):
    return SimpleNamespace(invocation_metadata=lambda: (("authorization", f"Bearer {token}"),) if token else (),
                           peer_identities=lambda: [certificate] if certificate else None)


def test_a_caller_is_the_credential_checked_not_a_header_claimed():
    """Under mutual TLS without tokens nothing checks a bearer header: it must not stand for
    another certificate (a token named like a certificate's identity reused that client's pages);
    with tokens, a token is never the same caller as a certificate of its name."""
    alice = caller_scope(_context(certificate=b"alice"), tokens=False)
    mallory = caller_scope(_context(certificate=b"mallory"), tokens=False)
    assert alice and mallory and alice != mallory
    assert caller_scope(_context(token="alice", certificate=b"mallory"), tokens=False) == mallory
    assert caller_scope(_context(token="alice"), tokens=False) == b""  # no certificate: an open daemon
    assert caller_scope(_context(token="alice"), tokens=True) not in (alice, b"")
    assert caller_scope(_context(token="alice", certificate=b"x"), tokens=True) == \
        caller_scope(_context(token="alice"), tokens=True)


def test_calls_that_never_send_their_request_hold_only_their_callers_share(model, tmp_path):
    """Bob opens Generate calls and never sends the request: he gets his share of the streams
    (twice his slots), the next is refused at once, and Alice is served meanwhile. A client token
    is told file names, not the server's paths."""
    daemon = Daemon(model, max_batch=1, max_queue=3, max_per_caller=2)  # serve's share for two client tokens
    plan_path = write_plan(model, 2, tmp_path / "plan.yaml")  # as serve --plan names it: the operator's path
    daemon.load_plan(PlanSource(yaml=plan_path.read_text(), name=str(plan_path)))
    tokens = Tokens(((ALICE, CLIENT), (BOB, CLIENT), (ADMIN_TOKEN, ADMIN)))
    server, port = start_server(daemon, "127.0.0.1", 0, tokens=tokens, body_timeout_s=20.0)
    never = threading.Event()

    def silent():
        never.wait(30)
        return
        yield

    addr = f"127.0.0.1:{port}"
    try:
        with ExecutorClient(addr, ClientAuth(token=BOB)) as bob, ExecutorClient(addr, ClientAuth(token=ALICE)) as alice:
            raw = bob.channel.stream_stream("/helm.executor.v1.ExecutorService/Generate")
            share = 2 * daemon.max_per_caller
            assert share < server.helm_guard.generate.size
            token = (("authorization", f"Bearer {BOB}"),)  # the client's interceptor signs unary requests only
            held = [raw(silent(), timeout=30, metadata=token) for _ in range(share)]
            wait_until(lambda: server.helm_guard.generate.open == share, what="bob's calls in the lane")
            with pytest.raises(grpc.RpcError) as refused:
                list(raw(iter([pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT)).SerializeToString()]),
                         timeout=10, metadata=token))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "this caller has 4 Generate streams open" in refused.value.details()
            t0 = time.perf_counter()
            ids, _, result = collect(alice.stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=PROMPT), stopping=pb.StoppingCriteria(max_new_tokens=3, ignore_eos=True)),
                timeout=30))
            assert len(ids) == 3 and time.perf_counter() - t0 < 10
            assert result.plan.source == "plan.yaml" and alice.info().plan.source == "plan.yaml"
            assert alice.info().model.directory == model.name
            with ExecutorClient(addr, ClientAuth(token=ADMIN_TOKEN)) as admin:
                assert admin.info().model.directory == str(model) and admin.info().plan.source == str(plan_path)
            for call in held:
                call.cancel()
    finally:
        never.set()
        server.stop(0).wait(5)
        daemon.drain(5)
        daemon.close()


def test_a_lane_holds_each_caller_to_its_share_and_all_to_its_size():
    from executor.server.guard import _Lane

    lane = _Lane(5, "streams", per_caller=2)
    assert lane.try_enter("a") is None and lane.try_enter("a") is None
    assert "this caller has 2 streams open" in lane.try_enter("a")
    assert lane.try_enter("b") is None and lane.try_enter("b") is None
    assert lane.try_enter(None) is None  # no share to hold it to (one trust domain)
    assert "5 streams are open" in lane.try_enter("c")
    lane.leave("a")
    assert lane.try_enter("a") is None and lane.open == 5
    for caller in ("a", "a", "b", "b", None):
        lane.leave(caller)
    assert lane.open == 0 and not lane._held
    lane.try_enter("a")
    lane.leave("b")  # a caller that held none: logged; the place still comes back
    assert lane.open == 0 and lane.try_enter("c") is None and lane.try_enter(None) is None


def test_connections_left_half_sent_cannot_pile_up_metrics_threads(model, monkeypatch):
    """prometheus_client's server started a thread per connection and waited for its request
    without a limit: 500 half-sent requests held 500 threads. Now at most MAX_SCRAPES are served,
    each closed at its deadline, and a scrape after them is answered."""
    import socket
    import urllib.request

    from executor.server import metrics

    monkeypatch.setattr(metrics, "SCRAPE_DEADLINE_S", 1.0)
    served = metrics.DaemonMetrics(Daemon(model))
    port = served.serve_http("127.0.0.1", 0)
    before = threading.active_count()
    held = []
    try:
        for _ in range(60):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            held.append(s)
        time.sleep(0.3)
        # a thread and a deadline timer per connection served
        assert threading.active_count() - before <= 2 * metrics.MAX_SCRAPES
        wait_until(lambda: threading.active_count() <= before, timeout_s=10, what="the held connections closed")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "helm_serving_state" in text
    finally:
        for s in held:
            s.close()
        served.close()
