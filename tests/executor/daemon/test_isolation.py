"""One request's failure never affects another: the culprit's stream ends with INTERNAL, the
requests batched with it finish with the right tokens, and the daemon keeps serving. (In-process
server, so that a stage can be made to fail for one request.)"""
import threading

import grpc
import pytest

from executor.pb import executor_pb2 as pb
from executor.server.client import ExecutorClient
from executor.server.daemon import Daemon
from executor.errors import RequestFailedError
from executor.request_params import SamplingParams, StopCriteria
from executor.server.messages import GenerateSpec, PlanSource
from executor.server.serve import start_server
from tests.executor.daemon.helpers import PAGE_SIZE, collect, wait_until, write_plan
from tests.executor.helpers import helm_generate, prompt_ids


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


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


def lose_the_gpu_on(stage, request_prefix: str, monkeypatch):
    """The stage fails every step that carries a `request_prefix` request, and the device check
    after a failed step says the GPU is gone (on the CPU, as a sticky CUDA error would on a GPU:
    tests/executor/test_cuda.py provokes a real one)."""
    real_forward = stage.forward

    def forward(x, batch):
        if any(str(s.seq_id).startswith(f"{request_prefix}#") for s in batch.slices):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return real_forward(x, batch)

    monkeypatch.setattr(stage, "forward", forward)
    monkeypatch.setattr("executor.engine.lost_device",
                        lambda devices: "cuda:0: AcceleratorError: CUDA error: an illegal memory access (simulated)")


def test_a_lost_gpu_stops_the_daemon_serving_for_good(checkpoint, tmp_path, monkeypatch):
    """A sticky device error fails every request, the batch's innocent ones too (nothing can run),
    turns health NOT_SERVING, refuses requests and LoadPlan saying to restart, and calls the hook
    serve exits by. Before, each step failed its requests and the daemon said it served."""
    from grpc_health.v1 import health_pb2

    model = checkpoint("qwen3", "fp32")
    plan = write_plan(model, 2, tmp_path / "plan.yaml").read_text()
    daemon = Daemon(model, max_batch=4, max_queue=4)
    daemon.load_plan(PlanSource(yaml=plan))
    worker = daemon._serving.worker
    lose_the_gpu_on(worker.engine.model.stages[1], "doomed", monkeypatch)
    lost = threading.Event()
    daemon.on_device_lost = lost.set
    server, port = start_server(daemon, "127.0.0.1", 0)
    try:
        with ExecutorClient(f"127.0.0.1:{port}") as client:
            bystander = client.stub.Generate(request(prompt_ids(7, 256, seed=51), 200, "bystander"), timeout=60)
            next(bystander)  # it runs
            doomed = rpc_error(lambda: collect(client.stub.Generate(request([11, 12, 13], 8, "doomed"), timeout=60)))
            assert doomed.code() == grpc.StatusCode.INTERNAL and "illegal memory access" in doomed.details()
            cut = rpc_error(lambda: collect(bystander))  # nothing runs on a lost GPU
            assert cut.code() == grpc.StatusCode.INTERNAL and "the GPU can run nothing more" in cut.details()
            assert lost.wait(10) and worker.join(10) and worker.device_lost
            assert client.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING
            after = rpc_error(lambda: collect(client.stub.Generate(request([1, 2, 3], 4, "after"), timeout=30)))
            assert after.code() == grpc.StatusCode.FAILED_PRECONDITION and "the daemon must restart" in after.details()
            load = rpc_error(lambda: client.load_plan(yaml=plan, timeout_s=60))
            assert load.code() == grpc.StatusCode.UNAVAILABLE and "restart the daemon" in load.details()
    finally:
        daemon.drain(5)
        server.stop(0).wait(5)
        daemon.close()


def test_a_failed_step_on_a_working_device_does_not_stop_the_daemon(checkpoint, tmp_path, monkeypatch):
    """The device check runs after any failed step; where it finds the device working (an OOM, a
    bad request), only the failing request ends."""
    checked = []
    model = checkpoint("qwen3", "fp32")
    daemon = Daemon(model, max_batch=4, max_queue=4)
    daemon.load_plan(PlanSource(yaml=write_plan(model, 2, tmp_path / "plan.yaml").read_text()))
    stage = daemon._serving.worker.engine.model.stages[1]
    lose_the_gpu_on(stage, "poison", monkeypatch)
    monkeypatch.setattr("executor.engine.lost_device", lambda devices: checked.append(list(devices)))
    try:
        spec = GenerateSpec(prompt_text=None, prompt_ids=(5, 6, 7), sampling=SamplingParams(),
                            stop=StopCriteria(max_new_tokens=3, ignore_eos=True), request_id="poison")
        with pytest.raises(RequestFailedError, match="illegal memory access"):
            list(daemon.submit(spec))
        assert checked and checked[0] == [s.device for s in daemon._serving.worker.engine.model.stages]
        assert daemon.state == "serving" and daemon.device_lost is None
    finally:
        daemon.drain(5)
        daemon.close()


@pytest.mark.parametrize("how", ["the warm-up's step", "a load failure on a lost device"])
def test_a_gpu_lost_while_a_plan_loads_stops_the_daemon_too(checkpoint, tmp_path, monkeypatch, how):
    """The device can be lost under LoadPlan too: its warm-up step finds it (DeviceLostError), or
    its load fails and the device check after it finds the GPU gone. Either way no plan can run
    in this process: the daemon stops serving and calls the hook serve exits by, once; the next
    LoadPlan is refused at once (before: refused, but the daemon served on NOT_SERVING, and the
    next LoadPlan went to the dead GPU)."""
    from executor.errors import DeviceLostError

    model = checkpoint("qwen3", "fp32")
    plan = write_plan(model, 2, tmp_path / "plan.yaml").read_text()
    daemon = Daemon(model, max_batch=4, max_queue=4)
    daemon.load_plan(PlanSource(yaml=plan))
    lost = []
    daemon.on_device_lost = lambda: lost.append(1)

    def warm_up(engine):
        if how == "the warm-up's step":
            raise DeviceLostError("the GPU can run nothing more in this process (cuda:0: simulated)")
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    monkeypatch.setattr(daemon, "_warm_up", warm_up)
    monkeypatch.setattr("executor.server.daemon.lost_device", lambda devices: "cuda:0: simulated")
    try:
        with pytest.raises(DeviceLostError):
            daemon.load_plan(PlanSource(yaml=plan))
        assert lost == [1] and daemon.device_lost is not None and daemon.state != "serving"
        with pytest.raises(DeviceLostError, match="restart the daemon"):
            daemon.load_plan(PlanSource(yaml=plan))
        assert lost == [1]
    finally:
        daemon.drain(5)
        daemon.close()
