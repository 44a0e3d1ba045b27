"""Benchmark: `helm-plan plan` for Qwen3-32B from its config, cold, as a user runs it (< 10 s)."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

from tests.planner.conftest import REPO, WORKSTATION


def test_plan_qwen3_32b_from_config_under_10_s(tmp_path):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "planner", "plan", "tools/model_configs/qwen3-32b.json",
                        "--machine", str(WORKSTATION), "-o", str(tmp_path / "p.yaml")],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert r.returncode == 0, r.stderr
    load = os.getloadavg()[0]
    inner = next(line for line in r.stderr.splitlines() if "planned in" in line)
    print(f"\nbenchmark: helm-plan plan qwen3-32b (64 blocks, 66 units): wall {wall:.2f} s, CPU {cpu:.2f} s, "
          f"load average {load:.1f} on {os.cpu_count()} CPUs; {inner.strip()}")
    assert cpu < 10, f"planning Qwen3-32B used {cpu:.1f} s of CPU"
    if load < (os.cpu_count() or 1):      # wall time is only meaningful on a machine that is not oversubscribed
        assert wall < 10, f"planning Qwen3-32B took {wall:.1f} s"
