"""Run the real daemon (`helm-executor serve`) in a subprocess on a free loopback port, and read
its streams. Every wait has a timeout so a broken daemon fails a test instead of hanging CI."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from planner.plan import save_plan
from planner.planning import plan_for_split, workload_for

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 120
PAGE_SIZE = 16


def write_plan(model_dir: Path, split_k: int, out: Path) -> Path:
    """A plan for a forced split (placeholder machine: no profiling), for the tests' traffic: up
    to 8 sequences of 2048 tokens (the daemon admits by the plan's KV budget)."""
    save_plan(plan_for_split(model_dir, split_k, page_size_tokens=PAGE_SIZE,
                             workload=workload_for(512, 512, batch_size=8, context_tokens=2048)), out)
    return out


class DaemonProcess:
    """`helm-executor serve --port 0 ...` with its JSON logs in a file."""

    def __init__(self, args: list[str], log_path: Path):
        self.log_path = log_path
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "executor.cli", "serve", "--port", "0", "--threads", "1", *args],
                stdout=subprocess.DEVNULL, stderr=log, cwd=REPO, env=env)
        self.port = self._wait_for_port()
        self.addr = f"127.0.0.1:{self.port}"

    def logs(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append({"msg": line})
        return out

    def _wait_for_port(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for entry in self.logs():
                if entry.get("msg") == "listening":
                    return entry["port"]
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"the daemon did not listen within {START_TIMEOUT_S} s:\n{self.log_path.read_text()}")

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout_s: float = 60) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.contextmanager
def serving_daemon(args: list[str], log_path: Path):
    """A DaemonProcess that is SERVING; on exit SIGTERM, and it must drain and exit 0."""
    from executor.server.client import ExecutorClient

    proc = DaemonProcess(args, log_path)
    try:
        with ExecutorClient(proc.addr) as client:
            client.wait_serving(timeout_s=START_TIMEOUT_S)
        yield proc
    finally:
        proc.signal()
        code = proc.wait(60)
        assert code == 0, proc.log_path.read_text()


def collect(stream):
    """(token ids, streamed text, the result message) of a Generate stream."""
    ids, text, result = [], [], None
    for msg in stream:
        if msg.HasField("token"):
            ids.append(msg.token.token_id)
            text.append(msg.token.text)
        else:
            assert result is None, "a second result"
            result = msg.result
    assert result is not None, "the stream ended without a result"
    return ids, "".join(text), result


def wait_until(predicate, timeout_s: float = 20, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not reached within {timeout_s} s")
