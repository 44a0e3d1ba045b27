"""The control plane under abuse, on the real daemon in a subprocess: clients that stop reading
hold no admission slot and are cut off after the stall timeout; Info, health and LoadPlan answer
while Generate is flooded; hostile LoadPlan inputs fail fast with bounded memory and no echo;
undecodable requests are INVALID_ARGUMENT; and /metrics reports what happened."""
from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from executor.pb import executor_pb2 as pb
from executor.pb import executor_pb2_grpc as pb_grpc
from executor.server.client import ExecutorClient
from executor.server.guard import WATCH_STREAMS
from tests.executor.daemon.helpers import collect, serving_daemon, wait_until, write_plan
from tests.planner.test_yamlio import SECRET, alias_bomb

STALL_S = 6.0  # longer than the engine takes for the stalled requests: the slots free first
SLOTS = 4  # --max-batch 1 + --max-queue 3
GENERATE = "/helm.executor.v1.ExecutorService/Generate"
# A client whose receive window is 1 KiB: once it stops reading, the daemon's sends block.
SMALL_WINDOW = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))


@pytest.fixture(scope="module")
def plan_dir(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    write_plan(model, 2, d / "plan.yaml")
    with open(d / "huge.yaml", "wb") as f:
        f.truncate(200 << 20)  # 200 MB, sparse
    return d


@pytest.fixture(scope="module")
def daemon(plan_dir, tmp_path_factory):
    with serving_daemon(["--plan", str(plan_dir / "plan.yaml"), "--plan-dir", str(plan_dir), "--max-batch", "1",
                         "--max-queue", "3", "--stall-timeout", str(STALL_S), "--metrics-port", "0"],
                        tmp_path_factory.mktemp("daemon") / "daemon.log") as proc:
        yield proc


def request(n: int, seed: int = 0) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[11 + seed, 12, 13]),
                              stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True))


def idle(client) -> bool:
    q = client.info().queue
    return q.waiting + q.running == 0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_clients_that_stop_reading_hold_no_slot_and_are_cut_off(daemon, client):
    channels = [grpc.insecure_channel(daemon.addr, options=SMALL_WINDOW) for _ in range(SLOTS)]
    try:
        stalled = []
        for i, channel in enumerate(channels):
            stream = pb_grpc.ExecutorServiceStub(channel).Generate(request(400, seed=i), timeout=120)
            assert next(stream).HasField("token")  # then never read again
            stalled.append(stream)
        wait_until(lambda: idle(client), timeout_s=60, what="the engine finished every stalled request")
        cut = lambda: [e for e in daemon.logs() if e.get("msg") == "client stopped reading: stream cut off"]  # noqa: E731
        assert not cut()  # the stalled streams are still open...
        ids, _, result = collect(client.stub.Generate(request(5, seed=9), timeout=30))  # ...yet a fifth gets a slot
        assert len(ids) == 5 and result.finish_reason == pb.FINISH_REASON_LENGTH and not cut()
        wait_until(lambda: len(cut()) == SLOTS, timeout_s=STALL_S + 10, what="every stalled stream cut off")
        assert all(e["stalled_s"] >= STALL_S for e in cut())
        # each cut-off's cancellation is logged by gRPC's callback thread, after the cut-off's own line
        cancelled = lambda: [e for e in daemon.logs()  # noqa: E731
                             if e.get("msg") == "request cancelled" and e.get("why") == "stalled"]
        wait_until(lambda: len(cancelled()) >= SLOTS, timeout_s=10, what="every stalled request cancelled")
        assert len(cancelled()) == SLOTS
        for stream in stalled:
            with pytest.raises(grpc.RpcError) as err:
                collect(stream)
            assert err.value.code() == grpc.StatusCode.CANCELLED
    finally:
        for channel in channels:
            channel.close()


def test_control_calls_answer_during_a_generate_flood(daemon, client, plan_dir):
    stop = threading.Event()
    refused = []

    def flood():
        with ExecutorClient(daemon.addr) as c:
            while not stop.is_set():
                try:
                    collect(c.stub.Generate(request(200), timeout=30))
                except grpc.RpcError as e:
                    refused.append(e.code())

    threads = [threading.Thread(target=flood) for _ in range(32)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(refused) > 100, timeout_s=30, what="the flood being refused")
        slowest = 0.0
        for _ in range(20):
            t0 = time.perf_counter()
            assert client.info(timeout_s=5).state == pb.SERVING_STATE_SERVING
            assert client.health_status(timeout_s=5) == 1
            slowest = max(slowest, time.perf_counter() - t0)
        loaded = client.load_plan(yaml=(plan_dir / "plan.yaml").read_text(), timeout_s=60)
        assert loaded.plan.split_k == 2
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED} and slowest < 5


def test_watch_streams_cannot_take_the_pool(daemon, client):
    """Health Watch is open to anyone and holds a thread while open: its lane is bounded, and one
    address holds at most half of it."""
    from grpc_health.v1 import health_pb2

    # One at a time: opened at once, their requests would also compete for the lane of requests
    # being read (OPEN_READERS), and a slow machine would see refusals from that lane too.
    watches = []
    try:
        refused = 0
        for _ in range(WATCH_STREAMS + 4):
            w = client.health.Watch(health_pb2.HealthCheckRequest(), timeout=60)
            watches.append(w)
            try:
                assert next(w).status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                refused += 1
        assert refused == WATCH_STREAMS + 4 - WATCH_STREAMS // 2
        assert client.info(timeout_s=5).state == pb.SERVING_STATE_SERVING  # control calls still answer
        ids, _, _ = collect(client.stub.Generate(request(3), timeout=30))
        assert len(ids) == 3
    finally:
        for w in watches:
            w.cancel()


def test_hostile_plans_fail_fast_with_bounded_memory_and_no_echo(daemon, client, tmp_path):
    outside = tmp_path / "secret.yaml"
    outside.write_text(f"password: {SECRET}\n")
    before = client.info().plan.digest
    rss0 = rss_bytes(daemon.proc.pid)
    for path in ("huge.yaml", str(outside), "../secret.yaml", "missing.yaml"):
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as err:
            client.load_plan(path=path)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and time.perf_counter() - t0 < 2
        assert err.value.details() == f"plan {path!r} is not available in the daemon's plans directory"
    for text in (alias_bomb(), f"password: {SECRET}: x\n", f"kind: plan\n{SECRET}: 1\n"):
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as err:
            client.load_plan(yaml=text)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and time.perf_counter() - t0 < 2
        assert SECRET not in err.value.details() and len(err.value.details()) < 1000
    assert rss_bytes(daemon.proc.pid) - rss0 < 20 << 20
    assert client.info().plan.digest == before


@pytest.mark.parametrize("body", [
    b"\x12\x02\xff\xfe",                     # field 2 (text): a string that is not UTF-8
    b"\x0a\x03\xc3\x28\x41\x12\x02hi",       # request_id not UTF-8
    bytes(range(256)) * 4,                   # random bytes
], ids=["text", "request_id", "random"])
def test_undecodable_requests_are_invalid_argument(client, body):
    raw = client.channel.unary_stream(GENERATE)  # no serializer: the bytes go as they are
    with pytest.raises(grpc.RpcError) as err:
        list(raw(body, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid message" in err.value.details()


def test_metrics_report_what_happened(daemon, client):
    for seed in (3, 4):
        collect(client.stub.Generate(request(6, seed=seed), timeout=30))
    with pytest.raises(grpc.RpcError):
        collect(client.stub.Generate(pb.GenerateRequest(), timeout=30))  # no prompt: refused
    stream = client.stub.Generate(request(1500, seed=5), timeout=30)
    next(stream)
    stream.cancel()
    wait_until(lambda: idle(client), timeout_s=30, what="the cancelled request ended")
    port = next(e["port"] for e in daemon.logs() if e.get("msg") == "metrics")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def value(name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("helm_requests_total", outcome="length", code="OK") >= 2
    assert value("helm_requests_total", outcome="refused", code="INVALID_ARGUMENT") >= 1
    assert value("helm_requests_total", outcome="cancelled", code="CANCELLED") >= 1
    for stage, device in (("0", "cpu"), ("1", "cuda")):
        steps = value("helm_stage_step_seconds_count", stage=stage, device=device, phase="decode")
        assert steps > 0 and steps == value("helm_stage_predicted_step_seconds_count", stage=stage, device=device,
                                            phase="decode")
    assert value("helm_ttft_seconds_count") >= 2 and value("helm_decode_tokens_per_second_count") >= 2
    assert value("helm_queue_requests", state="in_flight") == 0
    assert ("helm_kv_pages", (("pool", "device"), ("stage", "1"), ("state", "used"))) in samples
    digest = client.info().plan.digest
    assert value("helm_plan_info", digest=digest, version="1", split_k="2") == 1
    assert value("helm_serving_state", state="serving") == 1
