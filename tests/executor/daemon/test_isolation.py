"""One request's failure never affects another: the culprit's stream ends with INTERNAL, the
requests batched with it finish with the right tokens, and the daemon keeps serving. (In-process
server, so that a stage can be made to fail for one request.)"""
import threading

import grpc

from executor.pb import executor_pb2 as pb
from executor.server.client import ExecutorClient
from executor.server.daemon import Daemon
from executor.server.messages import PlanSource
from executor.server.serve import start_server
from tests.executor.daemon.helpers import PAGE_SIZE, collect, wait_until, write_plan
from tests.executor.helpers import helm_generate, prompt_ids


def request(prompt, n, request_id):
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt),
                              stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True))


def test_a_failing_request_fails_alone(checkpoint, tmp_path, monkeypatch):
    model = checkpoint("qwen3", "fp32")
    daemon = Daemon(model, max_batch=8, max_queue=8)
    daemon.load_plan(PlanSource(yaml=write_plan(model, 2, tmp_path / "plan.yaml").read_text()))
    stage = daemon._serving.worker.engine.model.stages[0]
    real_forward = stage.forward

    def forward(x, batch):
        if any(str(s.seq_id).startswith("poison#") and s.start + s.count > 6 for s in batch.slices):
            raise RuntimeError("simulated kernel failure")
        return real_forward(x, batch)

    monkeypatch.setattr(stage, "forward", forward)
    server, port = start_server(daemon, "127.0.0.1", 0)
    good_prompt = prompt_ids(7, 256, seed=50)
    try:
        with ExecutorClient(f"127.0.0.1:{port}") as client:
            good = client.stub.Generate(request(good_prompt, 30, "good"), timeout=60)
            first = next(good)
            outcome = {}

            def run_poison():
                try:
                    collect(client.stub.Generate(request([11, 12, 13, 14], 30, "poison"), timeout=60))
                except grpc.RpcError as e:
                    outcome["error"] = e

            t = threading.Thread(target=run_poison)
            t.start()
            ids, _, result = collect(good)
            t.join(60)
            assert outcome["error"].code() == grpc.StatusCode.INTERNAL
            assert "simulated kernel failure" in outcome["error"].details()
            want, _ = helm_generate(model, [good_prompt], split=2, max_new_tokens=30, page_size=PAGE_SIZE)
            assert [first.token.token_id] + ids == want[0] and result.finish_reason == pb.FINISH_REASON_LENGTH
            again, _, _ = collect(client.stub.Generate(request(good_prompt, 5, "again"), timeout=60))
            assert again == want[0][:5]
            wait_until(lambda: all(s.kv.sequences == 0 for s in client.info().stages), what="pages freed")
    finally:
        daemon.drain(5)
        server.stop(0).wait(5)
        daemon.close()


def test_a_stopped_engine_is_not_serving_until_a_plan_loads(checkpoint, tmp_path):
    """A fault outside any request (here in the engine thread's command loop) ends the engine
    thread: its requests fail, health turns NOT_SERVING at once (a probe routes traffic away) and
    a request is refused saying why; LoadPlan serves again."""
    from grpc_health.v1 import health_pb2

    model = checkpoint("qwen3", "fp32")
    plan = write_plan(model, 2, tmp_path / "plan.yaml").read_text()
    daemon = Daemon(model, max_batch=4, max_queue=4)
    daemon.load_plan(PlanSource(yaml=plan))
    worker = daemon._serving.worker
    server, port = start_server(daemon, "127.0.0.1", 0)
    try:
        with ExecutorClient(f"127.0.0.1:{port}") as client:
            assert client.health_status() == health_pb2.HealthCheckResponse.SERVING

            def broken(block):
                raise RuntimeError("simulated fault in the engine loop")

            worker._take_commands = broken
            worker.abort("nothing")  # wakes the thread, which then meets the fault
            worker.join(10)
            assert not worker.alive and "simulated fault" in worker.crashed
            assert client.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING
            try:
                collect(client.stub.Generate(request([1, 2, 3], 4, "after"), timeout=30))
                raise AssertionError("a stopped engine served a request")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "the engine stopped (RuntimeError: simulated fault" in e.details()
            client.load_plan(yaml=plan, timeout_s=60)
            assert client.health_status() == health_pb2.HealthCheckResponse.SERVING
            ids, _, _ = collect(client.stub.Generate(request([1, 2, 3], 4, "again"), timeout=60))
            assert len(ids) == 4
    finally:
        daemon.drain(5)
        server.stop(0).wait(5)
        daemon.close()


def test_a_plan_whose_engine_stops_as_it_starts_is_refused(checkpoint, tmp_path, monkeypatch):
    """The new plan's engine thread starts before the swap; one that has already stopped is not
    swapped in (it would say SERVING and fail every request): the previous plan serves on."""
    import pytest

    from executor.errors import PlanLoadError
    from executor.server.worker import EngineWorker

    model = checkpoint("qwen3", "fp32")
    plan = write_plan(model, 2, tmp_path / "plan.yaml").read_text()
    daemon = Daemon(model, max_batch=4, max_queue=4)
    daemon.load_plan(PlanSource(yaml=plan))
    serving = daemon._serving
    real_start = EngineWorker.start

    def start_and_stop(worker):
        def broken(block):
            raise RuntimeError("simulated fault as the engine starts")

        worker._take_commands = broken
        real_start(worker)
        worker.join(10)

    monkeypatch.setattr(EngineWorker, "start", start_and_stop)
    try:
        with pytest.raises(PlanLoadError, match="engine stopped as it started .*simulated fault"):
            daemon.load_plan(PlanSource(yaml=plan))
        assert daemon._serving is serving and daemon.state == "serving" and serving.worker.alive
    finally:
        daemon.drain(5)
        daemon.close()
