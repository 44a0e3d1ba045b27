"""Prompt prefix reuse through the daemon: a caller's next turn reuses its last turn's K/V (the
result says how many prompt tokens), its tokens are those of a run that computed everything, and
another caller's identical prompt reuses nothing (a shorter TTFT would tell it the prompt was
sent). In-process server with two client tokens."""
import threading
import time

from executor.pb import executor_pb2 as pb
from executor.server.auth import ADMIN, CLIENT, Tokens
from executor.server.client import ClientAuth, ExecutorClient
from executor.server.daemon import Daemon
from executor.server.messages import PlanSource
from executor.server.serve import start_server
from tests.executor.daemon.helpers import PAGE_SIZE, collect, write_plan
from tests.executor.helpers import helm_generate, prompt_ids

ALICE, BOB, ADMIN_TOKEN = "alice-" + "a" * 24, "bob-" + "b" * 24, "admin-" + "c" * 24


def request(prompt, n=8):
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                              stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True))


def serve(model, tmp_path, **daemon_kw):
    daemon = Daemon(model, max_batch=4, max_queue=4, **daemon_kw)
    daemon.load_plan(PlanSource(yaml=write_plan(model, 2, tmp_path / "plan.yaml").read_text()))
    tokens = Tokens(((ALICE, CLIENT), (BOB, CLIENT), (ADMIN_TOKEN, ADMIN)))
    server, port = start_server(daemon, "127.0.0.1", 0, tokens=tokens)
    return daemon, server, f"127.0.0.1:{port}"


def test_a_callers_next_turn_reuses_its_kv_and_another_callers_does_not(checkpoint, tmp_path):
    model = checkpoint("qwen3", "fp32")
    daemon, server, addr = serve(model, tmp_path)
    turn1 = prompt_ids(40, 256, seed=100)
    try:
        with ExecutorClient(addr, ClientAuth(token=ALICE)) as alice, ExecutorClient(addr, ClientAuth(token=BOB)) as bob:
            ids1, _, result1 = collect(alice.stub.Generate(request(turn1), timeout=60))
            assert result1.cached_prompt_tokens == 0
            turn2 = turn1 + ids1 + prompt_ids(10, 256, seed=101)
            ids2, _, result2 = collect(alice.stub.Generate(request(turn2), timeout=60))
            # K/V of 40 + 7 tokens were written: 2 pages of 16 shared, 15 tokens copied
            assert result2.cached_prompt_tokens == 47 and result2.prompt_tokens == 58
            kept = [s.kv.cached_pages for s in alice.info().stages]
            assert all(n > 0 for n in kept)
            ids_bob, _, result_bob = collect(bob.stub.Generate(request(turn2), timeout=60))
            assert result_bob.cached_prompt_tokens == 0
        want, _ = helm_generate(model, [turn2], split=2, max_new_tokens=8, page_size=PAGE_SIZE)
        assert ids2 == want[0] and ids_bob == want[0]
    finally:
        daemon.drain(5)
        server.stop(0).wait(5)
        daemon.close()


def test_no_prefix_cache_computes_every_prompt(checkpoint, tmp_path):
    model = checkpoint("qwen3", "fp32")
    daemon, server, addr = serve(model, tmp_path, prefix_cache=False)
    prompt = prompt_ids(40, 256, seed=102)
    try:
        with ExecutorClient(addr, ClientAuth(token=ALICE)) as alice:
            first = collect(alice.stub.Generate(request(prompt), timeout=60))
            again = collect(alice.stub.Generate(request(prompt), timeout=60))
            assert again[2].cached_prompt_tokens == 0 and again[0] == first[0]
            assert all(s.kv.cached_pages == 0 for s in alice.info().stages)
    finally:
        daemon.drain(5)
        server.stop(0).wait(5)
        daemon.close()


def test_requests_arriving_together_on_one_new_prompt_compute_it_once(checkpoint, tmp_path):
    """Four callers' prompts share a 600-token start (more than one 512-token prefill chunk). The
    engine's first step is held until the other three are queued, so they join while the first
    request is still computing that start: they wait for its pages instead of computing their own
    copies, and report all of it as reused (without the wait they would reuse the 512 tokens of
    its first chunk only). Their tokens are those of each prompt run alone."""
    model = checkpoint("qwen3", "fp32")
    daemon, server, addr = serve(model, tmp_path)
    worker = daemon._serving.worker
    real_step, held, burst_queued = worker.engine.step, threading.Event(), []

    def first_step_waits_for_the_burst():
        if not held.is_set():
            deadline = time.monotonic() + 10
            while worker._commands.qsize() < 3 and time.monotonic() < deadline:
                time.sleep(0.005)
            burst_queued.append(worker._commands.qsize() >= 3)
            held.set()
        return real_step()

    worker.engine.step = first_step_waits_for_the_burst
    start = prompt_ids(600, 256, seed=103)
    prompts = [start + prompt_ids(8, 256, seed=110 + i) for i in range(4)]
    results = [None] * 4
    try:
        with ExecutorClient(addr, ClientAuth(token=ALICE)) as alice:
            def call(i):
                results[i] = collect(alice.stub.Generate(request(prompts[i], n=4), timeout=120))

            first = threading.Thread(target=call, args=(0,))
            first.start()
            deadline = time.monotonic() + 30
            while not worker._streams and time.monotonic() < deadline:  # the first is in the engine first
                time.sleep(0.005)
            others = [threading.Thread(target=call, args=(i,)) for i in (1, 2, 3)]
            for t in others:
                t.start()
            for t in [first, *others]:
                t.join(150)
        assert burst_queued == [True], "the burst was not queued while the first step was held"
        assert all(r is not None for r in results)
        assert results[0][2].cached_prompt_tokens == 0
        # 37 full pages of 16 shared, and the 8 start tokens of the 38th copied
        assert [r[2].cached_prompt_tokens for r in results[1:]] == [600] * 3
        want, _ = helm_generate(model, prompts, split=2, max_new_tokens=4, page_size=PAGE_SIZE)
        assert [r[0] for r in results] == want
    finally:
        daemon.drain(5)
        server.stop(0).wait(5)
        daemon.close()
