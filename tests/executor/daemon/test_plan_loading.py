"""LoadPlan's attack surface, on the daemon's core in-process: paths are read only inside
--plan-dir and every way a path can fail gives one answer, a 16M-token KV page is refused and a
page longer than the model's context shrinks to it before anything is allocated, and a plan whose
warm-up fails is refused while the old plan keeps serving."""
from __future__ import annotations

import os
import threading
from dataclasses import replace

import pytest
import torch

from executor.errors import LoadInProgressError, PlacementError, PlanLoadError, PlanNotFoundError, RequestError
from executor.kv_cache import PagePool
from executor.request_params import SamplingParams, StopCriteria
from executor.server.daemon import Daemon
from executor.server.messages import GenerateSpec, GenerationResult, PlanSource
from planner.plan import load_plan, parse_plan, plan_digest
from tests.executor.daemon.helpers import write_plan
from tests.executor.helpers import helm_generate

SECRET = "CANARY-51c2"


@pytest.fixture
def plan_dir(model, tmp_path):
    d = tmp_path / "plans"
    d.mkdir()
    write_plan(model, 2, d / "good.yaml")
    return d


def with_page_size(plan_path, tokens: int) -> str:
    """The plan with another KV page size and a digest that matches it (what an attacker can make)."""
    plan = load_plan(plan_path)
    bad = replace(plan, kv=replace(plan.kv, page_size_tokens=tokens))
    return replace(bad, digest=plan_digest(bad)).to_yaml()


def tokens_of(daemon: Daemon, prompt=(11, 12, 13), n=4) -> list[int]:
    spec = GenerateSpec(None, tuple(prompt), SamplingParams(), StopCriteria(max_new_tokens=n, ignore_eos=True))
    events = list(daemon.submit(spec))
    assert isinstance(events[-1], GenerationResult)
    return [e.token_id for e in events[:-1]]


def assert_serves_split_2(daemon: Daemon, model) -> None:
    """The daemon's tokens are the offline engine's on good.yaml's split."""
    assert tokens_of(daemon) == helm_generate(model, [[11, 12, 13]], split=2, max_new_tokens=4, page_size=16)[0][0]


def test_paths_outside_the_plans_directory_are_one_answer(model, plan_dir, tmp_path):
    outside = tmp_path / "secret.yaml"
    outside.write_text(f"password: {SECRET}\n")
    (plan_dir / "escape.yaml").symlink_to(outside)
    with open(plan_dir / "huge.yaml", "wb") as f:
        f.truncate(200 << 20)  # 200 MB, sparse
    os.mkfifo(plan_dir / "fifo.yaml")
    (plan_dir / "subdir").mkdir()
    (plan_dir / "one-line.yaml").write_text(SECRET)  # no newline: must not be read as a path, nor echoed
    (plan_dir / "redirect.yaml").write_text(str(outside))  # ...nor lead outside the directory
    daemon = Daemon(model, plan_dir=plan_dir)
    try:
        for path in ("one-line.yaml", "redirect.yaml"):
            with pytest.raises(PlacementError) as err:
                daemon.load_plan(PlanSource(path=path))
            assert SECRET not in str(err.value) and "expected a YAML mapping" in str(err.value)
        for path in ("../secret.yaml", str(outside), "escape.yaml", "huge.yaml", "fifo.yaml", "subdir",
                     "missing.yaml", "/etc/passwd", ".", "a\0b"):
            with pytest.raises(PlanNotFoundError) as err:
                daemon.load_plan(PlanSource(path=path))
            assert str(err.value) == f"plan {path!r} is not available in the daemon's plans directory"
        assert daemon.state == "loading"  # nothing was loaded
        daemon.load_plan(PlanSource(path="good.yaml"))
        daemon.load_plan(PlanSource(path=str(plan_dir / "good.yaml")))  # absolute, but inside
        assert daemon.state == "serving"
    finally:
        daemon.close()


def test_without_a_plans_directory_paths_are_off(model, plan_dir):
    daemon = Daemon(model)
    with pytest.raises(PlanNotFoundError, match="without --plan-dir"):
        daemon.load_plan(PlanSource(path=str(plan_dir / "good.yaml")))
    with pytest.raises(ValueError, match="not a directory"):
        Daemon(model, plan_dir=plan_dir / "good.yaml")


def test_oversized_pages_are_refused_or_bounded_and_the_old_plan_serves(model, plan_dir):
    daemon = Daemon(model, plan_dir=plan_dir)
    try:
        daemon.load_plan(PlanSource(path="good.yaml"))
        before = daemon.plan()[0].digest
        with pytest.raises(PlacementError, match="page_size_tokens"):  # schema maximum
            daemon.load_plan(PlanSource(yaml=with_page_size(plan_dir / "good.yaml", 16 << 20)))
        assert daemon.plan()[0].digest == before and daemon.state == "serving"
        assert_serves_split_2(daemon, model)
        # Within the schema but longer than the context: the page is the context, no longer.
        daemon.load_plan(PlanSource(yaml=with_page_size(plan_dir / "good.yaml", 1 << 20)))
        assert {s.page_size_tokens for s in daemon.info().stages} == {daemon.config.max_position_embeddings}
        assert_serves_split_2(daemon, model)
    finally:
        daemon.close()


def test_a_failed_warm_up_refuses_the_plan_and_the_old_plan_serves(model, plan_dir, monkeypatch):
    daemon = Daemon(model, plan_dir=plan_dir)
    try:
        daemon.load_plan(PlanSource(path="good.yaml"))
        before = daemon.plan()[0].digest
        other = write_plan(model, 4, plan_dir / "other.yaml")
        real_allocate = PagePool.allocate

        def allocate(self):
            raise RuntimeError("simulated: cannot allocate a KV page")

        monkeypatch.setattr(PagePool, "allocate", allocate)
        with pytest.raises(PlanLoadError, match="warm-up.*cannot allocate a KV page.*previous plan still serves"):
            daemon.load_plan(PlanSource(path=other.name))
        monkeypatch.setattr(PagePool, "allocate", real_allocate)
        assert daemon.plan()[0].digest == before and daemon.state == "serving"
        assert_serves_split_2(daemon, model)
    finally:
        daemon.close()


def held_warm_up(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Every plan's warm-up from here on signals `started`, then waits for `release`."""
    started, release = threading.Event(), threading.Event()
    real_warm_up = Daemon._warm_up

    def slow_warm_up(self, engine):
        started.set()
        release.wait(30)
        real_warm_up(self, engine)

    monkeypatch.setattr(Daemon, "_warm_up", slow_warm_up)
    return started, release


def test_one_load_at_a_time(model, plan_dir, monkeypatch):
    daemon = Daemon(model, plan_dir=plan_dir)
    started, release = held_warm_up(monkeypatch)
    first = threading.Thread(target=daemon.load_plan, args=(PlanSource(path="good.yaml"),))
    first.start()
    try:
        assert started.wait(30)
        with pytest.raises(LoadInProgressError, match="another LoadPlan"):  # an answer now, not a wait
            daemon.load_plan(PlanSource(path="good.yaml"))
    finally:
        release.set()
        first.join(30)
    assert daemon.state == "serving"
    daemon.close()


def test_pages_the_host_cannot_hold_for_every_sequence_are_refused(model, plan_dir, monkeypatch):
    daemon = Daemon(model, max_batch=64, plan_dir=plan_dir)
    try:
        daemon.load_plan(PlanSource(path="good.yaml"))
        before = daemon.plan()[0].digest
        cfg = daemon.config
        big = with_page_size(plan_dir / "good.yaml", cfg.max_position_embeddings)  # one page: the whole context
        plan = parse_plan(big)
        # the engine holds at most the plan's budget: its batch, each sequence one context-long page
        assert plan.workload.context_tokens <= cfg.max_position_embeddings
        pages = plan.workload.batch_size
        # Split 2: units 0-1 (block 0) on the CPU, the rest on CUDA, which runs on the CPU without one.
        host_layers = 1 if torch.cuda.is_available() else cfg.num_layers
        need = pages * cfg.max_position_embeddings * host_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32
        monkeypatch.setattr("executor.plan_io.host_memory_available", lambda: need - 1)
        with pytest.raises(PlacementError, match=f"the plan's KV budget of {pages} pages .* need .* GiB of host"):
            daemon.load_plan(PlanSource(yaml=big))
        monkeypatch.setattr("executor.plan_io.host_memory_available", lambda: need)
        daemon.load_plan(PlanSource(yaml=big))
        assert daemon.plan()[0].digest != before
    finally:
        daemon.close()


def test_a_plan_with_a_tiny_context_loads_and_bounds_requests(model, plan_dir):
    """The warm-up fits the plan's context, and a request longer than that context is refused
    before it starts (the daemon admits by the plan, not by the model's 2048 positions)."""
    from planner.planning import plan_for_split, workload_for

    tiny = plan_for_split(str(model), 2, page_size_tokens=16, workload=workload_for(2, 1, context_tokens=3))
    daemon = Daemon(model, max_batch=4, plan_dir=plan_dir)
    try:
        daemon.load_plan(PlanSource(yaml=tiny.to_yaml()))
        assert daemon.info().context_tokens == 3
        assert daemon.info().max_batch == 1  # not --max-batch 4: the plan's working sets are priced for one
        assert tokens_of(daemon, prompt=(11, 12), n=1)
        with pytest.raises(RequestError, match="exceeds the plan's context of 3 tokens"):
            tokens_of(daemon, prompt=(11, 12), n=4)
    finally:
        daemon.close()


def test_steps_served_while_another_plan_loads_are_not_measured(model, plan_dir, monkeypatch):
    """A plan's load copies weights and warms up on the GPU's stream and the host beside the plan
    that serves: the steps it serves meanwhile are timed against that, so its report leaves them
    out (they still stream their tokens), and measures again once the load is over."""
    write_plan(model, 3, plan_dir / "other.yaml")
    daemon = Daemon(model, plan_dir=plan_dir)
    try:
        first = daemon.load_plan(PlanSource(path="good.yaml")).plan.digest
        tokens_of(daemon)
        measured = daemon.report(first).steps
        assert measured > 0
        started, release = held_warm_up(monkeypatch)
        loading = threading.Thread(target=daemon.load_plan, args=(PlanSource(path="other.yaml"),))
        loading.start()
        try:
            assert started.wait(30)
            assert len(tokens_of(daemon)) == 4  # served by the first plan, not measured
            assert daemon.report(first).steps == measured
        finally:
            release.set()
            loading.join(30)
        assert daemon.report().plan.digest != first
        tokens_of(daemon)
        assert daemon.report().steps > 0  # the plan now serving measures its steps
        assert daemon.report(first).steps == measured
    finally:
        daemon.close()


def test_a_plan_priced_above_the_daemons_gpu_memory_is_refused_and_the_old_plan_serves(model, plan_dir,
                                                                                       monkeypatch):
    """--gpu-memory: a plan whose GPU stage is priced above it, alone or beside the plan serving
    (a swap holds both), is refused before anything loads, naming the sizes and how to plan for
    the cap; one within it loads. (On CUDA the cap also holds PyTorch's allocator:
    tests/executor/test_cuda.py.)"""
    from executor.plan_io import plan_gpu_bytes
    from executor.server import daemon as daemon_module

    capped = []  # on a CUDA machine the cap would hold this test process's allocator (test_cuda.py tests it)
    monkeypatch.setattr(daemon_module, "cap_gpu_memory", capped.append)
    need = plan_gpu_bytes(load_plan(plan_dir / "good.yaml"))
    assert need > 0   # split 2: the rest of the tiny model on the GPU stage
    daemon = Daemon(model, plan_dir=plan_dir, gpu_memory_bytes=need)
    try:
        daemon.load_plan(PlanSource(path="good.yaml"))
        assert_serves_split_2(daemon, model)
        daemon.gpu_memory_bytes = need - 1
        with pytest.raises(PlacementError, match=rf"over this daemon's --gpu-memory of .*helm-plan plan --gpu-memory {need - 1}`"):
            daemon.load_plan(PlanSource(path="good.yaml"))
        # a swap holds the plan serving and the new one until the new one serves: both must fit
        daemon.gpu_memory_bytes = 2 * need - 1
        with pytest.raises(PlacementError, match=r"beside the .* of the 1 plan\(s\) loaded"):
            daemon.load_plan(PlanSource(path="good.yaml"))
        assert daemon.state == "serving"
        assert_serves_split_2(daemon, model)
        daemon.gpu_memory_bytes = 2 * need
        daemon.load_plan(PlanSource(path="good.yaml"))
        assert_serves_split_2(daemon, model)
        # the plan swapped out, still finishing requests (held so here), holds its memory too
        retired = daemon._retired[-1]
        monkeypatch.setattr(type(retired), "alive", property(lambda worker: True))
        with pytest.raises(PlacementError, match=r"beside the .* of the 2 plan\(s\) loaded"):
            daemon.load_plan(PlanSource(path="good.yaml"))
        monkeypatch.setattr(type(retired), "alive", property(lambda worker: worker is not retired))
        daemon.load_plan(PlanSource(path="good.yaml"))  # once it has ended: room again
        assert_serves_split_2(daemon, model)
    finally:
        daemon.close()
    assert capped == [need]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="must be positive"):
        Daemon(model, gpu_memory_bytes=0)
