"""Run the real daemon (`helm-executor serve`) in a subprocess on a free loopback port, and read
its streams. Every wait has a timeout so a broken daemon fails a test instead of hanging CI."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from planner.plan import save_plan
from planner.planning import plan_for_split, workload_for
from tools import daemon_process

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 120
PAGE_SIZE = 16


def write_plan(model_dir: Path, split_k: int, out: Path) -> Path:
    """A plan for a forced split (placeholder machine: no profiling), for the tests' traffic: up
    to 8 sequences of 2048 tokens (the daemon admits by the plan's KV budget)."""
    save_plan(plan_for_split(model_dir, split_k, page_size_tokens=PAGE_SIZE,
                             workload=workload_for(512, 512, batch_size=8, context_tokens=2048)), out)
    return out


class DaemonProcess(daemon_process.DaemonProcess):
    """The daemon as the tests run it: one CPU thread (OpenMP and the CPU stage)."""

    def __init__(self, args: list[str], log_path: Path, program: tuple[str, ...] = ("-m", "executor.cli")):
        super().__init__(["--threads", "1", *args], log_path, START_TIMEOUT_S, {**os.environ, "OMP_NUM_THREADS": "1"},
                         program)


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
