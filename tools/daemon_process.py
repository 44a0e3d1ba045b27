"""`helm-executor serve --port 0 ...` in a subprocess, for the tests and the benchmarks: it waits
for the daemon's `listening` log line (its JSON logs go to a file) and every wait has a timeout,
so a broken daemon fails its caller instead of hanging it."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class DaemonProcess:
    def __init__(self, args: list[str], log_path: Path, start_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None, program: tuple[str, ...] = ("-m", "executor.cli")):
        """`args`: what follows `helm-executor serve --port 0`; `program`: what python runs to be
        helm-executor (a test's script that wraps executor.cli.main)."""
        self.log_path = Path(log_path)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, *program, "serve", "--port", "0", *args],
                                         stdout=subprocess.DEVNULL, stderr=log, cwd=REPO, env=env)
        self.port = self._wait_for_port(start_timeout_s)
        self.addr = f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def logs(self) -> list[dict]:
        """Every log line, parsed (a line that is not JSON, e.g. a crash, as {"msg": line})."""
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append({"msg": line})
        return out

    def _wait_for_port(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for entry in self.logs():
                if entry.get("msg") == "listening":
                    return entry["port"]
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"the daemon did not listen within {timeout_s:g} s:\n{self.log_path.read_text()}")

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout_s: float = 60) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def stop(self, timeout_s: float = 120) -> int | None:
        """SIGTERM (the daemon drains), then the exit status; killed if it does not exit in time."""
        if self.proc.poll() is None:
            self.signal()
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
