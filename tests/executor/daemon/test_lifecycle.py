"""The daemon's life: NOT_SERVING → SERVING, no plan → FAILED_PRECONDITION, a full queue →
RESOURCE_EXHAUSTED, SIGTERM drains (UNAVAILABLE for new work, in-flight streams finish, exit 0),
a drain that runs out of time aborts, and a second signal exits at once."""
from __future__ import annotations

import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2

from executor.pb import executor_pb2 as pb
from executor.server.client import ExecutorClient
from tests.executor.daemon.helpers import DaemonProcess, collect, wait_until, write_plan

RPC_TIMEOUT_S = 60
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def plan(model, tmp_path_factory):
    return write_plan(model, 2, tmp_path_factory.mktemp("plans") / "split2.yaml")


def long_request(n=1500, seed=0):
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[11 + seed, 12, 13, 14]),
                              stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True))


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_health_queue_limit_and_clean_drain(model, plan, tmp_path):
    daemon = DaemonProcess(["--model", str(model), "--max-batch", "1", "--max-queue", "1", "--drain-timeout", "60",
                            "--plan-dir", str(plan.parent)],
                           tmp_path / "daemon.log")
    try:
        with ExecutorClient(daemon.addr) as client:
            wait_until(lambda: _health(client) is not None, what="health answers")
            assert client.health_status() == NOT_SERVING
            assert client.info().state == pb.SERVING_STATE_LOADING
            assert code_of(lambda: collect(client.stub.Generate(long_request(4), timeout=RPC_TIMEOUT_S))) \
                == grpc.StatusCode.FAILED_PRECONDITION
            assert code_of(lambda: client.get_plan()) == grpc.StatusCode.FAILED_PRECONDITION

            client.load_plan(path=plan.name)
            assert client.health_status() == SERVING
            assert client.health_status("helm.executor.v1.ExecutorService") == SERVING

            # max batch 1 + max queue 1: a third request in flight is refused.
            running = client.stub.Generate(long_request(seed=1), timeout=RPC_TIMEOUT_S)
            assert next(running).HasField("token")
            queued = client.stub.Generate(long_request(seed=2), timeout=RPC_TIMEOUT_S)
            wait_until(lambda: client.info().queue.waiting == 1, what="the second request queued")
            assert code_of(lambda: collect(client.stub.Generate(long_request(4), timeout=RPC_TIMEOUT_S))) \
                == grpc.StatusCode.RESOURCE_EXHAUSTED
            running.cancel()
            queued.cancel()
            wait_until(lambda: client.info().queue.running + client.info().queue.waiting == 0, what="queue empty")

            # SIGTERM: the stream in flight finishes, new work is refused, the process exits 0.
            stream = client.stub.Generate(long_request(600, seed=3), timeout=RPC_TIMEOUT_S)
            assert next(stream).HasField("token")
            daemon.signal(signal.SIGTERM)
            wait_until(lambda: _health(client) == NOT_SERVING, what="NOT_SERVING while draining")
            assert code_of(lambda: collect(client.stub.Generate(long_request(4), timeout=RPC_TIMEOUT_S))) \
                == grpc.StatusCode.UNAVAILABLE
            ids, _, result = collect(stream)
            assert result.finish_reason == pb.FINISH_REASON_LENGTH and len(ids) == 599
        assert daemon.wait(60) == 0
        assert any(e.get("msg") == "stopped" and e.get("drained") is True for e in daemon.logs())
    finally:
        daemon.kill()


def _health(client):
    try:
        return client.health_status(timeout_s=2)
    except grpc.RpcError:
        return None


def _terminated_mid_request(client, daemon):
    """A long request streaming its first token, then SIGTERM to the daemon: the stream."""
    client.wait_serving(timeout_s=120)
    stream = client.stub.Generate(long_request(1900), timeout=RPC_TIMEOUT_S)
    assert next(stream).HasField("token")
    daemon.signal(signal.SIGTERM)
    return stream


def test_drain_timeout_aborts_what_is_left(plan, tmp_path):
    """A drain that runs out of time aborts what is left: the stream ends ABORTED, and a
    `helm-executor generate` client streaming beside it exits 1 (its text is incomplete)."""
    import subprocess
    import sys

    daemon = DaemonProcess(["--plan", str(plan), "--drain-timeout", "0.5"], tmp_path / "daemon.log")
    try:
        with ExecutorClient(daemon.addr) as client:
            client.wait_serving(timeout_s=120)
            cli = subprocess.Popen([sys.executable, "-m", "executor.cli", "generate", "--addr", daemon.addr,
                                    "--prompt-ids", "21,22,23", "--max-new-tokens", "1900", "--ignore-eos"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            wait_until(lambda: client.info().queue.running == 1 or cli.poll() is not None, timeout_s=60,
                       what="the CLI's request decoding")
            stream = _terminated_mid_request(client, daemon)
            ids, _, result = collect(stream)
            assert result.finish_reason == pb.FINISH_REASON_ABORTED and len(ids) < 1899
            _, err = cli.communicate(timeout=60)
            assert cli.returncode == 1 and "aborted the request" in err, err[-2000:]
        assert daemon.wait(60) == 0
    finally:
        daemon.kill()


def test_second_signal_exits_at_once(plan, tmp_path):
    daemon = DaemonProcess(["--plan", str(plan), "--drain-timeout", "600"], tmp_path / "daemon.log")
    try:
        with ExecutorClient(daemon.addr) as client:
            stream = _terminated_mid_request(client, daemon)
            wait_until(lambda: _health(client) == NOT_SERVING, what="draining")
            daemon.signal(signal.SIGTERM)
            assert daemon.wait(20) == 128 + signal.SIGTERM
            stream.cancel()
    finally:
        daemon.kill()


# helm-executor with a GPU that is lost at a "doomed" request's first step (simulated on the CPU:
# the stage raises what CUDA raises, and the device check after it finds the device gone).
LOSES_ITS_GPU = '''
import sys
from executor import engine
from executor.cli import main
from executor.stage import Stage

real_forward = Stage.forward

def forward(self, x, batch):
    if any(str(s.seq_id).startswith("doomed#") for s in batch.slices):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
    return real_forward(self, x, batch)

Stage.forward = forward
engine.lost_device = lambda devices: "cuda:0: AcceleratorError: CUDA error: an illegal memory access (simulated)"
sys.exit(main(sys.argv[1:]))
'''


def test_a_lost_gpu_drains_and_exits_for_a_supervisor_to_restart(plan, tmp_path):
    """Nothing can run on a GPU after a sticky CUDA error, so the daemon does not sit there saying
    NOT_SERVING: it fails what it runs, drains and exits EXIT_DEVICE_LOST (systemd's
    Restart=on-failure, a Kubernetes restart policy), logging why."""
    from executor.server.serve import EXIT_DEVICE_LOST

    script = tmp_path / "loses_its_gpu.py"
    script.write_text(LOSES_ITS_GPU)
    daemon = DaemonProcess(["--plan", str(plan)], tmp_path / "daemon.log", program=(str(script),))
    try:
        with ExecutorClient(daemon.addr) as client:
            client.wait_serving(timeout_s=120)
            request = pb.GenerateRequest(request_id="doomed", token_ids=pb.TokenIds(ids=[11, 12, 13]),
                                         stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True))
            with pytest.raises(grpc.RpcError) as err:
                collect(client.stub.Generate(request, timeout=RPC_TIMEOUT_S))
            assert "the GPU can run nothing more" in err.value.details()
        assert daemon.wait(60) == EXIT_DEVICE_LOST
        last = daemon.logs()[-1]
        assert last["msg"] == "stopped: a GPU was lost, restart the daemon" and "illegal memory" in last["error"]
    finally:
        daemon.kill()


def test_a_second_daemon_on_a_busy_port_is_refused(model, plan, tmp_path):
    """gRPC binds with SO_REUSEPORT unless told not to: a second daemon on the first one's port
    then shared it, the kernel handing each some of the connections (two models behind one
    address). It must refuse to start, and the first serves on."""
    import subprocess
    import sys

    first = DaemonProcess(["--plan", str(plan)], tmp_path / "daemon.log")
    try:
        second = subprocess.run([sys.executable, "-m", "executor.cli", "serve", "--model", str(model), "--port",
                                 str(first.port), "--threads", "1"], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "cannot listen" in second.stderr, second.stderr[-2000:]
        with ExecutorClient(first.addr) as client:
            client.wait_serving(timeout_s=120)
            assert client.info().model.directory == str(model)
    finally:
        first.stop()
