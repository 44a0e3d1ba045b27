"""Prompt prefix reuse (executor/prefix_cache.py): a request that starts with a kept prefix
computes only the rest, and its tokens are transformers' all the same; shared pages are counted
once and given up when a pool needs room; scopes never share."""
import random

import pytest

from executor.prefix_cache import shared_pages
from executor.request_params import SamplingParams, StopCriteria
from tests.executor.helpers import budget_engine, hf_greedy, pages_in_use, prompt_ids

STOP = StopCriteria(max_new_tokens=6, ignore_eos=True)


@pytest.fixture
def path(checkpoint):
    return checkpoint("qwen3", "fp32")


def used_pages(engine):
    return [s.kv.stats().device_pages_used + s.kv.stats().host_pages_used for s in engine.model.stages if s.kv]


@pytest.mark.parametrize("device_kv_pages", [None, 2])
def test_a_chats_next_turn_reuses_the_last_turns_kv_and_its_tokens_are_transformers(path, device_kv_pages):
    """Turn 2 resends turn 1's prompt and reply: it starts on turn 1's kept K/V, four shared pages
    and three tokens copied out of the partial fifth, and computes only what follows. Both turns'
    tokens equal transformers' greedy tokens. With a 2-page device pool, kept pages are evicted to
    the host and read back from there."""
    eng = budget_engine(path, sequences=2, context=40, device_kv_pages=device_kv_pages)
    turn1 = prompt_ids(14, 256, seed=70)
    first = eng.generate([turn1], stop=STOP)[0]
    assert first.output_ids == hf_greedy(path, turn1, 6) and first.reused.tokens(4) == 0
    turn2 = turn1 + first.output_ids + prompt_ids(5, 256, seed=71)  # K/V of 14 + 5 tokens were written
    second = eng.generate([turn2], stop=STOP)[0]
    assert len(second.reused.full) == 4 and second.reused.tail_tokens == 3 and eng.prefix.hit_tokens == 19
    assert second.output_ids == hf_greedy(path, turn2, 6)
    if device_kv_pages:
        assert eng.model.stages[1].kv.stats().evictions > 0


def test_a_whole_prompt_kept_still_computes_its_last_token(path):
    """The same prompt again: everything but its last token is reused (its logits give the first
    new token), and the tokens are the first run's."""
    eng = budget_engine(path, sequences=1, context=32)
    prompt = prompt_ids(12, 256, seed=72)
    first = eng.generate([prompt], stop=STOP)[0]
    again = eng.generate([prompt], stop=STOP)[0]
    assert again.reused.tokens(4) == 11 and again.output_ids == first.output_ids


def test_requests_that_share_a_system_prompt_share_its_pages_counted_once(path):
    """Two requests on one kept prefix run together: its pages exist once in each stage and the
    ledger counts them once; the tokens equal each request's run alone."""
    system = prompt_ids(16, 256, seed=73)
    eng = budget_engine(path, sequences=2, context=32)
    eng.generate([system + [42]], stop=STOP)  # keeps 4 full pages of the system prompt
    prompts = [system + prompt_ids(3, 256, seed=74), system + prompt_ids(5, 256, seed=75)]
    seqs = [eng.add_request(p, stop=STOP) for p in prompts]
    eng.step()
    assert [len(s.reused.full) for s in seqs] == [4, 4]
    # each may grow to 16 + 3|5 + 6 tokens, 7 pages of 4: 3 of its own past the 4 shared, which count once
    assert eng.kv_pages_reserved == 3 + 3 + 4
    kv = eng.model.stages[0].kv
    assert kv.pages_of(seqs[0].request_id)[:4] == kv.pages_of(seqs[1].request_id)[:4]
    while eng.has_work():
        eng.step()
    for seq, prompt in zip(seqs, prompts):
        assert seq.output_ids == hf_greedy(path, prompt, 6)
    assert eng.kv_pages_reserved == 0 and pages_in_use(eng) == 0


def test_kept_pages_give_way_to_new_requests_and_never_exceed_the_budget(path):
    """A budget of 2 × 8 pages, many distinct prompts: kept pages fill the pools, then give way
    (least recently used first) to every new request; nothing runs out and nothing leaks."""
    eng = budget_engine(path, sequences=2, context=32, device_kv_pages=3)
    capacity = [s.kv.device_pool.capacity_pages + (s.kv.host_pool.capacity_pages if s.kv.host_pool else 0)
                for s in eng.model.stages]
    kept = []
    for i in range(6):
        prompts = [prompt_ids(20, 256, seed=80 + 2 * i), prompt_ids(9, 256, seed=81 + 2 * i)]
        seqs = [eng.add_request(p, stop=STOP) for p in prompts]
        while eng.has_work():
            eng.step()
            assert all(u <= c for u, c in zip(used_pages(eng), capacity))
        assert all(s.finish_reason == "length" for s in seqs)
        kept.append(eng.prefix.kept_pages())
    # the pools filled with kept pages (16 a stage), and the oldest gave way: the first prompt's are gone
    assert max(kept) == 16 and eng.prefix.match(prompt_ids(20, 256, seed=80)).tokens(4) == 0
    assert seqs[1].output_ids == hf_greedy(path, prompts[1], 6)
    assert pages_in_use(eng) == 0 and eng.prefix.kept_pages() > 0
    eng.prefix.clear()
    assert used_pages(eng) == [0, 0]


def test_a_scope_never_reuses_another_scopes_prefix(path):
    eng = budget_engine(path, sequences=1, context=32)
    prompt = prompt_ids(12, 256, seed=90)
    eng.generate([prompt], stop=STOP)
    other = eng.add_request(prompt, stop=STOP, scope=b"another caller")
    eng.step()
    assert other.reused.tokens(4) == 0
    while eng.has_work():
        eng.step()
    same = eng.add_request(prompt, stop=STOP, scope=b"another caller")
    eng.step()
    assert same.reused.tokens(4) == 11


def test_a_failed_request_keeps_only_what_its_good_steps_filled(path, monkeypatch):
    """The pages a request's steps filled are shared as they fill; a step that fails adds nothing,
    and the request's partial page is not kept: a later request reuses the good pages only."""
    eng = budget_engine(path, sequences=1, context=32)
    stage = eng.model.stages[1]
    real_forward = stage.forward

    def forward(x, batch):
        if any(s.start >= 9 for s in batch.slices):  # its first decode step, after a 9-token prompt
            raise RuntimeError("simulated kernel failure")
        return real_forward(x, batch)

    monkeypatch.setattr(stage, "forward", forward)
    prompt = prompt_ids(9, 256, seed=91)
    seq = eng.generate([prompt], stop=STOP)[0]
    assert seq.finish_reason == "error" and eng.prefix.kept_pages() == 2 and used_pages(eng) == [2, 2]
    monkeypatch.undo()
    again = eng.generate([prompt + [5]], stop=STOP)[0]
    assert again.reused_tokens == 8 and again.output_ids == hf_greedy(path, prompt + [5], 6)
    eng.prefix.clear()
    assert used_pages(eng) == [0, 0]


def test_sampled_requests_reuse_too_and_draw_what_they_draw_without(path):
    """Reuse changes no sampled token: a seeded request on a kept prefix draws what it draws on an
    engine that keeps nothing."""
    prompt = prompt_ids(13, 256, seed=92)
    sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    cold = budget_engine(path, sequences=1, context=32, prefix_cache=False)
    want = cold.generate([prompt], sampling, STOP)[0].output_ids
    warm = budget_engine(path, sequences=1, context=32)
    warm.generate([prompt[:10]], stop=STOP)
    got = warm.generate([prompt], sampling, STOP)[0]
    assert got.reused.tokens(4) == 10 and got.output_ids == want and cold.prefix is None


def test_an_engine_without_a_budget_keeps_nothing(path):
    """Without a plan's budget the pools are unbounded: keeping pages would grow them forever."""
    from tests.executor.helpers import helm_generate

    _, model = helm_generate(path, [prompt_ids(9, 256, seed=93)], split=2, max_new_tokens=3, page_size=4)
    assert all(s.kv.stats().cached_pages == 0 and s.kv.stats().device_pages_used == 0
               for s in model.stages if s.kv)


def test_a_copy_that_would_not_fit_the_budget_is_left_out_and_the_tokens_computed(path):
    """The partial page a copy reads is held while the copy's page is made. At batch 1 with two
    pages, the same 7-token prompt again would need the shared page, the held source and a page of
    its own: three. It runs on the shared page alone (before: the copy found no page, the step
    raised, and a shared page stayed counted with nothing running)."""
    eng = budget_engine(path, sequences=1, context=8)
    prompt = prompt_ids(7, 256, seed=120)
    stop = StopCriteria(max_new_tokens=1, ignore_eos=True)
    first = eng.generate([prompt], stop=stop)[0]
    again = eng.generate([prompt], stop=stop)[0]
    assert again.finish_reason == "length" and again.reused_tokens == 4 and again.output_ids == first.output_ids
    assert eng.kv_pages_reserved == 0 and pages_in_use(eng) == 0


def test_a_request_whose_start_fails_computes_its_prompt_and_lets_go_of_what_it_took(path, monkeypatch):
    """Starting on a kept prefix can fail (a copy, memory for a page brought back): the request then
    computes its whole prompt, and what the failed start took is given back."""
    eng = budget_engine(path, sequences=2, context=32)
    prompt = prompt_ids(10, 256, seed=121)
    eng.generate([prompt], stop=STOP)
    kv = eng.model.stages[1].kv

    def copy_tokens(seq_id, src, n):
        raise RuntimeError("simulated: the copy failed")

    monkeypatch.setattr(kv, "copy_tokens", copy_tokens)
    bystander = eng.add_request(prompt_ids(6, 256, seed=122), stop=STOP)
    doomed = eng.add_request(prompt, stop=STOP)  # it would copy 1 token of the kept partial page
    while eng.has_work():
        eng.step()
    assert doomed.finish_reason == "length" and doomed.reused_tokens == 0
    assert doomed.output_ids == hf_greedy(path, prompt, 6)
    assert bystander.finish_reason == "length" and bystander.output_ids == hf_greedy(path, bystander.prompt_ids, 6)
    assert eng.kv_pages_reserved == 0 and pages_in_use(eng) == 0 and eng.prefix.pages_in_use() == 0
    monkeypatch.undo()
    assert eng.generate([prompt], stop=STOP)[0].reused_tokens == 9


def test_kept_pages_leave_the_device_before_a_running_requests_do(path):
    """With room on the host, a kept page on the device (a partial one too: no one writes it now)
    moves there before a running request's page would (which on a GPU would take that request off
    its static decode step)."""
    eng = budget_engine(path, sequences=2, context=16, device_kv_pages=2)
    kv = eng.model.stages[1].kv
    eng.generate([prompt_ids(3, 256, seed=123)], stop=StopCriteria(max_new_tokens=1, ignore_eos=True))
    assert kv.stats().cached_pages == 1 and kv.stats().host_pages_used == 0  # one partial page, on the device
    seq = eng.add_request(prompt_ids(7, 256, seed=124), stop=StopCriteria(max_new_tokens=3, ignore_eos=True))
    eng.step()
    assert [p.on_device for p in kv.pages_of(seq.request_id)] == [True, True] and kv.stats().host_pages_used == 1


def test_reused_pages_on_the_host_come_back_to_the_device(path):
    """A request that reuses kept pages the host holds brings them back to the device, making
    room there by moving (or dropping) pages only the prefix cache holds: a sequence with a page
    on the host streams it every step of its life."""
    eng = budget_engine(path, sequences=2, context=16, device_kv_pages=4)
    kv = eng.model.stages[1].kv
    system = prompt_ids(8, 256, seed=125)
    stop = StopCriteria(max_new_tokens=4, ignore_eos=True)
    eng.generate([system + [7]], stop=StopCriteria(max_new_tokens=1, ignore_eos=True))  # 2 full pages kept
    eng.generate([prompt_ids(11, 256, seed=126)], stop=stop)  # takes the whole device
    shared = [e.pages[1] for e in eng.prefix._full.values() if e.tokens == tuple(system[:4])]
    assert shared and not shared[0].on_device  # the system prompt's first page went to the host
    again = eng.add_request(system + [9, 10], stop=stop)
    eng.step()
    assert again.reused_tokens == 8 and kv.resident(again.request_id)
    while eng.has_work():
        eng.step()
    assert again.output_ids == hf_greedy(path, system + [9, 10], 4)


def test_a_page_that_cannot_come_back_to_the_device_drops_no_kept_pages(path):
    """Bringing a reused page back needs a device page that only the prefix cache holds: where the
    device holds running requests' pages only, kept pages elsewhere stay (dropping them freed host
    pages, never a device one, and emptied the cache of every stage for nothing)."""
    eng = budget_engine(path, sequences=3, context=12, device_kv_pages=2)
    kv = eng.model.stages[1].kv
    one = StopCriteria(max_new_tokens=1, ignore_eos=True)
    prompts = [prompt_ids(5, 256, seed=130 + i) for i in range(3)]
    for p in prompts:
        eng.generate([p], stop=one)  # each keeps a full page and a partial one
    running = eng.add_request(prompt_ids(5, 256, seed=140), stop=StopCriteria(max_new_tokens=3, ignore_eos=True))
    eng.step()  # its two pages take the whole device: the kept pages are all on the host
    assert kv.resident(running.request_id) and kv.stats().device_pages_used == 2
    assert all(not p.on_device for e in eng.prefix._entries() for p in e.pages[1:] if p.refs == 1)  # (its own: 2)
    kept = eng.prefix.kept_pages()
    again = eng.add_request(prompts[0] + [9], stop=one)
    eng.step()
    assert again.reused_tokens == 5 and again.finish_reason == "length"
    assert all(eng.prefix.match(p + [1]).tokens(4) == 5 for p in prompts[1:])  # the other prefixes are kept
    assert eng.prefix.kept_pages() >= kept


def test_a_running_requests_filled_pages_are_shared_while_it_runs(path):
    """A request's pages are shared as soon as they fill, not when it ends: one arriving while the
    first still decodes starts on the first's system prompt (counted once in the ledger), and both
    produce transformers' tokens."""
    system = prompt_ids(16, 256, seed=150)
    eng = budget_engine(path, sequences=2, context=40)
    long_stop = StopCriteria(max_new_tokens=12, ignore_eos=True)
    first = eng.add_request(system + prompt_ids(3, 256, seed=151), stop=long_stop)
    eng.step()  # its prompt: 4 pages filled
    assert first in eng.running and eng.prefix.kept_pages() == 4
    second = eng.add_request(system + prompt_ids(5, 256, seed=152), stop=STOP)
    eng.step()
    assert second.reused_tokens == 16 and first in eng.running
    kv = eng.model.stages[0].kv
    assert kv.pages_of(first.request_id)[:4] == kv.pages_of(second.request_id)[:4]
    assert eng.kv_pages_reserved <= eng.kv_budget_pages
    while eng.has_work():
        eng.step()
    assert first.output_ids == hf_greedy(path, first.prompt_ids, 12)
    assert second.output_ids == hf_greedy(path, second.prompt_ids, 6)
    assert eng.kv_pages_reserved == 0 and pages_in_use(eng) == 0


def test_a_running_request_that_computed_a_kept_page_itself_shares_nothing_under_it(path):
    """A request can compute a page that another fills with its first new token in the same step:
    the other's copy is kept (it commits first). The request's next pages must not be kept under
    that page while it runs: the kept page could then not give way (it would have a child) while
    no ledger counted it, and a third request found the pools full (out of KV pages)."""
    eng = budget_engine(path, sequences=2, context=16)  # 8 pages
    system = prompt_ids(4, 256, seed=160)
    a = eng.add_request(system + prompt_ids(3, 256, seed=161), stop=StopCriteria(max_new_tokens=2, ignore_eos=True))
    eng.step()  # its prompt, 7 tokens: the system prompt's page kept, and its first new token drawn
    # b's prompt goes on with a's first new token, whose K/V a writes in the next step, filling its page 2
    b = eng.add_request(a.prompt_ids + a.output_ids + prompt_ids(1, 256, seed=162),
                        stop=StopCriteria(max_new_tokens=5, ignore_eos=True))
    eng.step()  # a decodes into its page 2 while b computes its own copy of it; a ends, its page kept
    assert a.finish_reason == "length" and b in eng.running and b.reused_tokens == 4
    assert not eng.prefix.indexing(b.request_id)
    for _ in range(3):  # b fills its page 3 (whose parent would be a's page 2, which b does not hold)
        eng.step()
    # b's next page and c's four: room only where a's kept page gives way
    c = eng.add_request(prompt_ids(13, 256, seed=163), stop=StopCriteria(max_new_tokens=3, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert b.finish_reason == c.finish_reason == "length", (b.error, c.error)
    assert b.output_ids == hf_greedy(path, b.prompt_ids, 5) and c.output_ids == hf_greedy(path, c.prompt_ids, 3)


def test_requests_arriving_together_on_a_new_system_prompt_compute_it_once(path):
    """Three requests arrive together on a 16-token system prompt nobody computed yet, prefilled 8
    tokens a step: the first computes it, the others wait for its pages and start on all four once
    they fill, computing only their own tokens. Each one's tokens are transformers'. Without
    waiting, each computes the system prompt itself."""
    system = prompt_ids(16, 256, seed=170)
    prompts = [system + prompt_ids(n, 256, seed=171 + n) for n in (3, 4, 5)]
    eng = budget_engine(path, sequences=3, context=32, prefill_chunk=8)
    first, *others = [eng.add_request(p, stop=STOP) for p in prompts]
    eng.step()
    assert first.num_computed == 8 and all(o.num_computed == 0 for o in others)
    assert eng.kv_pages_reserved == 7  # the first's alone: 16 + 3 + 6 tokens, 7 pages of 4
    eng.step()  # the first's 4 system pages have filled
    assert all(o.num_computed == 0 for o in others)
    eng.step()
    assert [o.reused_tokens for o in others] == [16, 16] and first.reused_tokens == 0
    # the 4 shared pages are the first's own, in its 7; the others hold 3 each past them
    assert eng.kv_pages_reserved == 7 + 3 + 3
    while eng.has_work():
        eng.step()
    for seq, prompt in zip((first, *others), prompts):
        assert seq.output_ids == hf_greedy(path, prompt, 6)
    assert eng.prefix.hit_tokens == 32

    alongside = budget_engine(path, sequences=3, context=32, prefill_chunk=8, wait_for_shared_prefill=False)
    seqs = [alongside.add_request(p, stop=STOP) for p in prompts]
    alongside.step()
    assert all(s.num_computed == 8 for s in seqs)
    while alongside.has_work():
        alongside.step()
    assert [s.reused_tokens for s in seqs] == [0, 0, 0]
    assert [s.output_ids for s in seqs] == [s.output_ids for s in (first, *others)]


def test_only_a_request_on_the_same_prompt_and_scope_waits_and_never_past_its_leader(path):
    """A request of another scope, or on another prompt, starts at once beside the first; one that
    waits on the first starts on the pages kept so far when the first is aborted."""
    system = prompt_ids(16, 256, seed=180)
    eng = budget_engine(path, sequences=4, context=32, prefill_chunk=8)
    first = eng.add_request(system + prompt_ids(3, 256, seed=181), stop=STOP)
    follower = eng.add_request(system + prompt_ids(4, 256, seed=182), stop=STOP)
    stranger = eng.add_request(system + prompt_ids(5, 256, seed=183), stop=STOP, scope=b"another caller")
    unrelated = eng.add_request(prompt_ids(8, 256, seed=184), stop=STOP)
    eng.step()  # 8-token chunks: the first, the stranger (its own scope), the unrelated one
    assert follower.num_computed == 0
    assert first.num_computed == stranger.num_computed == unrelated.num_computed == 8
    assert eng.abort(first.request_id)
    eng.step()
    assert follower.reused_tokens == 8 and stranger.reused_tokens == 0
    while eng.has_work():
        eng.step()
    for seq in (follower, stranger, unrelated):
        assert seq.finish_reason == "length" and seq.output_ids == hf_greedy(path, seq.prompt_ids, 6)


def test_shared_pages_counts_the_full_pages_two_prompts_start_with():
    """Against a token-by-token count, on prompts that share random prefixes."""
    rng = random.Random(5)
    for _ in range(2000):
        common = [rng.randrange(4) for _ in range(rng.randrange(40))]
        a = common + [rng.randrange(4) for _ in range(rng.randrange(20))]
        b = common + [rng.randrange(4) for _ in range(rng.randrange(20))]
        page, limit = rng.randrange(1, 9), rng.randrange(60)
        n = 0
        while n < min(len(a), len(b), limit) and a[n] == b[n]:
            n += 1
        assert shared_pages(a, b, page, limit) == n // page, (a, b, page, limit)


@pytest.mark.parametrize("sequences,context,max_running", [(1, 16, 8), (4, 32, 2)])
def test_a_request_that_started_while_another_waited_is_never_held_back_by_it(path, sequences, context, max_running):
    """A follower waits for its leader's first page; an unrelated request behind it starts
    meanwhile. When the follower no longer waits but cannot start (the budget: the unrelated one
    holds the pages it needs; or the running limit), the unrelated one must still be scheduled:
    a deadlock with a 4-page budget, a stall with max_running 2 (found by a stress harness)."""
    eng = budget_engine(path, sequences=sequences, context=context, prefill_chunk=1, max_running=max_running)
    system = prompt_ids(4, 256, seed=190)
    leader = eng.add_request(system, stop=StopCriteria(max_new_tokens=1 if sequences == 1 else 12, ignore_eos=True))
    one = StopCriteria(max_new_tokens=1, ignore_eos=True)
    follower = eng.add_request(system + prompt_ids(8, 256, seed=191), stop=one)
    other = eng.add_request(prompt_ids(7, 256, seed=192), stop=one)
    for _ in range(100):
        if not eng.has_work():
            break
        held_back = other in eng.waiting and other.num_computed > 0
        before = other.num_computed
        eng.step()
        assert not held_back or other.num_computed > before or other.output_ids, "a started request was skipped"
    assert [s.finish_reason for s in (leader, follower, other)] == ["length"] * 3
    for seq in (follower, other):
        assert seq.output_ids == hf_greedy(path, seq.prompt_ids, 1)


def test_a_request_id_that_comes_back_is_another_request_to_wait_for(path):
    """What a waiting request shares with each started one is remembered per request, not per
    request id: an id comes back once its request ended. Here the leader `x` is aborted and a new,
    unrelated `x` starts; the follower must not go on waiting for it."""
    eng = budget_engine(path, sequences=4, context=64, prefill_chunk=4)
    system = prompt_ids(16, 256, seed=193)
    x = eng.add_request(system + [7], stop=STOP, request_id="x")
    y = eng.add_request(system[:8] + prompt_ids(12, 256, seed=194), stop=STOP, request_id="y")  # 2 pages of x's
    f = eng.add_request(system + prompt_ids(3, 256, seed=195), stop=STOP, request_id="f")  # 4 pages of x's
    eng.step()  # x computes its first page; y and f wait for x
    assert x.num_computed == 4 and y.num_computed == f.num_computed == 0
    eng.abort("x")  # its first page kept
    eng.add_request(prompt_ids(40, 256, seed=196), stop=STOP, request_id="x")
    eng.step()  # y starts on x's page and computes its second; f waits for that page; the new x starts
    assert y.reused_tokens == 4 and f.num_computed == 0
    eng.step()
    assert f.reused_tokens == 8  # both of y's pages, without waiting on the new x
    while eng.has_work():
        eng.step()
    assert f.output_ids == hf_greedy(path, f.prompt_ids, 6)


def test_kept_through_agrees_with_a_prompts_match(path):
    """The O(1) check a waiting request makes every step (its last page's digest) says what
    matching the prompt page by page says, before and after kept pages give way."""
    eng = budget_engine(path, sequences=2, context=40)
    system = prompt_ids(12, 256, seed=200)
    eng.generate([system + prompt_ids(9, 256, seed=201), prompt_ids(15, 256, seed=202)], stop=STOP)
    rng = random.Random(7)
    for reclaimed in range(4):
        for _ in range(50):
            prompt = (system[:rng.randrange(13)] + prompt_ids(9, 256, seed=203))[:rng.randrange(1, 22)]
            keys = []
            for pages in range((len(prompt) - 1) // 4 + 1):
                assert eng.prefix.kept_through(prompt, b"", pages, keys) == \
                    (len(eng.prefix.match(prompt).full) >= pages), (prompt, pages)
            assert not eng.prefix.kept_through(system + [1], b"another caller", 1, [])
        assert eng.prefix.reclaim()


@pytest.mark.parametrize("sequences,max_running", [(4, 2), (2, 8)])
def test_a_request_waiting_for_a_shared_prefill_keeps_its_place(path, sequences, max_running):
    """While it waits, a later unrelated request must not take the slot (max_running 2) or the
    pages (a budget of two sequences, 32 pages: the leader's 15 and the unrelated one's 16 leave
    the follower's 2 no room) it would have started in: it would then wait for that one's whole
    generation. Its first token comes no later than without waiting (found by a review)."""
    def first_token_steps(wait):
        eng = budget_engine(path, sequences=sequences, context=64, prefill_chunk=4, max_running=max_running,
                            wait_for_shared_prefill=wait)
        system = prompt_ids(16, 256, seed=210)
        seqs = [eng.add_request(system + prompt_ids(3, 256, seed=211), stop=StopCriteria(max_new_tokens=40,
                                                                                         ignore_eos=True)),
                eng.add_request(system + prompt_ids(3, 256, seed=212), stop=StopCriteria(max_new_tokens=2,
                                                                                         ignore_eos=True)),
                eng.add_request(prompt_ids(20, 256, seed=213), stop=StopCriteria(max_new_tokens=44, ignore_eos=True))]
        steps, n = {}, 0
        while eng.has_work():
            eng.step()
            n += 1
            steps.update({i: n for i, seq in enumerate(seqs) if seq.output_ids and i not in steps})
        assert all(seq.finish_reason == "length" for seq in seqs)
        return steps, seqs[1]

    (waited, follower), (alongside, _) = first_token_steps(True), first_token_steps(False)
    assert follower.reused_tokens == 16 and waited[1] <= alongside[1], (waited, alongside)
    assert follower.output_ids == hf_greedy(path, follower.prompt_ids, 2)


def test_a_burst_at_a_tight_budget_fits_by_counting_shared_pages_once(path):
    """A budget of 14 pages and three 7-page requests on one new 16-token system prompt: counted
    once, the followers' 3 + 3 pages fit beside the leader's 7 (counted twice, 17, the third
    computed the prompt itself); and every step, each stage's pages in use stay within the ledger,
    the ledger within the budget (from a review)."""
    system = prompt_ids(16, 256, seed=170)
    prompts = [system + prompt_ids(n, 256, seed=171 + n) for n in (3, 4, 5)]
    eng = budget_engine(path, sequences=2, context=28, prefill_chunk=8)
    assert eng.kv_budget_pages == 14
    seqs = [eng.add_request(p, stop=STOP) for p in prompts]
    for _ in range(3):
        eng.step()
    assert [s.reused_tokens for s in seqs[1:]] == [16, 16] and eng.kv_pages_reserved == 13
    while eng.has_work():
        eng.step()
        for st in (s.kv.stats() for s in eng.model.stages if s.kv):
            assert st.device_pages_used + st.host_pages_used - st.cached_pages <= eng.kv_pages_reserved <= 14
    for seq, prompt in zip(seqs, prompts):
        assert seq.finish_reason == "length", seq.error
        assert seq.output_ids == hf_greedy(path, prompt, 6)


def test_a_waiting_requests_place_leaves_out_the_pages_it_will_share(path):
    """A budget of 32 pages: the leader (16 shared + 3 own tokens, 40 new: 15 pages), a follower on
    the same 16 tokens (6 pages, 4 of them the leader's) and an unrelated request of 14 pages. The
    follower's place is its 2 own pages, so the unrelated request starts beside it while it waits
    (15 + 2 + 14 fit; holding all 6 would have kept it out until the follower started); every step
    the ledger stays within the budget and the pages in use within the ledger."""
    eng = budget_engine(path, sequences=2, context=64, prefill_chunk=4, max_running=4)
    assert eng.kv_budget_pages == 32
    system = prompt_ids(16, 256, seed=220)
    leader, follower, unrelated = (
        eng.add_request(system + prompt_ids(3, 256, seed=221), stop=StopCriteria(max_new_tokens=40, ignore_eos=True)),
        eng.add_request(system + prompt_ids(3, 256, seed=222), stop=StopCriteria(max_new_tokens=2, ignore_eos=True)),
        eng.add_request(prompt_ids(20, 256, seed=223), stop=StopCriteria(max_new_tokens=36, ignore_eos=True)))
    eng.step()
    started = set(eng._kv_pages)
    assert started == {leader.request_id, unrelated.request_id}, started  # the follower waits, keeping 2 pages
    assert eng.kv_pages_reserved + 2 <= 32
    while eng.has_work():
        eng.step()
        for st in (s.kv.stats() for s in eng.model.stages if s.kv):
            assert st.device_pages_used + st.host_pages_used - st.cached_pages <= eng.kv_pages_reserved <= 32
    assert follower.reused_tokens == 16
    for seq, n in ((leader, 40), (follower, 2), (unrelated, 36)):
        assert seq.finish_reason == "length", seq.error
        assert seq.output_ids == hf_greedy(path, seq.prompt_ids, n)
