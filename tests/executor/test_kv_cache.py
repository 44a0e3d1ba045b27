"""Paged KV cache: page accounting, eviction policy, data preserved across eviction."""
import pytest
import torch

from executor import kv_cache
from executor.kv_cache import KVCache

LAYERS, HKV, D = 2, 2, 4


def cache(page_size=4, device_pages=None, host_pages=None):
    return KVCache(LAYERS, HKV, D, torch.float32, torch.device("cpu"), page_size, device_pages, host_pages)


def fill(kv, seq, n, start=0, base=0.0):
    """Write n tokens whose K = position + base and V = -(position + base), all layers."""
    kv.reserve(seq, start + n)
    pos = torch.arange(start, start + n, dtype=torch.float32) + base
    k = pos.view(n, 1, 1).expand(n, HKV, D).contiguous()
    for layer in range(LAYERS):
        kv.write(layer, seq, start, k + layer, -(k + layer))


def gathered(kv, seq, length, layer=0):
    ks, vs, starts = zip(*[(k, v, s) for k, v, s in kv.chunks(layer, seq, length)])
    return torch.cat(ks, dim=1), torch.cat(vs, dim=1), starts


def test_pages_allocated_per_page_size_and_freed():
    kv = cache(page_size=4)
    fill(kv, "a", 9)
    assert kv.stats().device_pages_used == 3  # 4 + 4 + 1
    kv.free("a")
    assert kv.stats().device_pages_used == 0 and kv.stats().sequences == 0


def test_freed_host_pages_are_reused_up_to_a_bound(monkeypatch):
    """A finished request's pages serve the next one (no fresh page faults), up to
    KEEP_FREE_HOST_BYTES; pages beyond that go back to the allocator."""
    monkeypatch.setattr(kv_cache, "KEEP_FREE_HOST_BYTES", 2 * LAYERS * 2 * HKV * 4 * D * 4)  # two pages
    kv = cache(page_size=4)
    fill(kv, "a", 12)  # 3 pages
    first = {p.data.data_ptr() for p in kv._seqs["a"].pages}
    kv.free("a")
    assert kv.device_pool.free_pages == 2 and kv.stats().device_pages_used == 0
    fill(kv, "b", 8, base=100.0)
    assert {p.data.data_ptr() for p in kv._seqs["b"].pages} <= first and kv.device_pool.free_pages == 0
    k, v, _ = gathered(kv, "b", 8)  # what "b" wrote, nothing left over from "a"
    assert torch.equal(k[0, :, 0], torch.arange(8, dtype=torch.float32) + 100)


def test_chunks_return_written_values_in_order():
    kv = cache(page_size=4)
    fill(kv, "a", 6)
    fill(kv, "a", 3, start=6)
    k, v, starts = gathered(kv, "a", 9, layer=1)
    assert starts == (0, 4, 8)
    assert torch.equal(k[0, :, 0], torch.arange(9, dtype=torch.float32) + 1)
    assert torch.equal(v, -k)


def test_the_device_holds_every_planned_page_before_evicting_and_keeps_data():
    """The planner sized device_pages with the watermark; the cache fills all of them (issue 11:
    it used to evict down to watermark x device_pages again) and evicts the oldest full page only
    when a new page needs the room."""
    kv = cache(page_size=4, device_pages=4)
    fill(kv, "a", 8)  # two full pages, oldest
    fill(kv, "b", 8, base=100)  # two more: the device is full, nothing moved
    stats = kv.stats()
    assert (stats.device_pages_used, stats.host_pages_used, stats.evictions) == (4, 0, 0)
    before = gathered(kv, "a", 8)[0].clone(), gathered(kv, "b", 8)[0].clone()
    fill(kv, "b", 4, start=8, base=100)  # a fifth page: a's oldest page moves to the host
    stats = kv.stats()
    assert (stats.device_pages_used, stats.host_pages_used, stats.evictions) == (4, 1, 1)
    assert [p.on_device for p in kv._seqs["a"].pages] == [False, True]
    assert torch.equal(gathered(kv, "a", 8)[0], before[0])
    assert torch.equal(gathered(kv, "b", 8)[0], before[1])


def test_a_bounded_host_pool_refuses_pages_beyond_the_budget():
    kv = cache(page_size=2, device_pages=1, host_pages=2)
    fill(kv, "a", 6)  # one page on the device, two on the host: the budget
    assert (kv.stats().device_pages_used, kv.stats().host_pages_used) == (1, 2)
    with pytest.raises(MemoryError, match="out of KV pages"):
        kv.reserve("a", 8)
    no_host = cache(page_size=2, device_pages=1, host_pages=0)
    fill(no_host, "a", 2)
    with pytest.raises(MemoryError, match="out of KV pages"):
        no_host.reserve("b", 1)


def test_partial_pages_are_never_evicted_and_full_device_spills_to_host():
    kv = cache(page_size=4, device_pages=2)
    fill(kv, "a", 1)
    fill(kv, "b", 1)
    assert kv.stats().device_pages_used == 2
    fill(kv, "c", 2)  # device full of partial pages: c's page starts on the host
    assert kv._seqs["c"].pages[0].on_device is False
    assert kv.stats().evictions == 0
    assert torch.equal(gathered(kv, "c", 2)[0][0, :, 0], torch.tensor([0.0, 1.0]))


def test_new_page_evicts_oldest_full_page_when_device_is_full():
    kv = cache(page_size=2, device_pages=2)
    fill(kv, "a", 4)  # two full device pages
    fill(kv, "a", 1, start=4)  # needs a third: the oldest full page moves to the host
    assert [p.on_device for p in kv._seqs["a"].pages] == [False, True, True]
    k = gathered(kv, "a", 5)[0]
    assert torch.equal(k[0, :, 0], torch.arange(5, dtype=torch.float32))


def test_free_releases_host_pages_too():
    kv = cache(page_size=2, device_pages=1)
    fill(kv, "a", 6)
    assert kv.stats().host_pages_used == 2
    kv.free("a")
    assert kv.stats().host_pages_used == 0 and kv.stats().device_pages_used == 0


@pytest.mark.parametrize("bad", [dict(page_size=0), dict(device_pages=-1)])
def test_bad_settings_rejected(bad):
    with pytest.raises(ValueError):
        cache(**bad)


def test_a_slab_pool_hands_out_fixed_slots_and_never_its_scratch():
    from executor.kv_cache import PagePool

    pool = PagePool(torch.device("cpu"), (2, 3), torch.float32, capacity_pages=3, slab=True)
    assert pool.slab.shape == (4, 2, 3) and pool.scratch_slot == 3
    assert not pool.slab.any()  # zeroed: a masked slot enters attention as 0 · V
    pages = [pool.allocate() for _ in range(3)]
    assert [pool.slot_of(p) for p in pages] == [0, 1, 2] and pool.allocate() is None
    pages[1].fill_(7.0)
    assert pool.slab[1].eq(7.0).all()  # a page is a view of its slot
    pool.release(pages[1])
    again = pool.allocate()
    assert pool.slot_of(again) == 1 and pool.allocate() is None
    with pytest.raises(ValueError, match="capacity"):
        PagePool(torch.device("cpu"), (2, 3), torch.float32, capacity_pages=None, slab=True)


def test_device_slots_only_while_every_page_is_resident():
    kv = KVCache(LAYERS, HKV, D, torch.float32, torch.device("cpu"), 4, device_pages=2, host_pages=4, slab=True)
    kv.reserve("a", 8)
    kv.write(0, "a", 0, torch.randn(8, HKV, D), torch.randn(8, HKV, D))
    assert kv.device_slots("a") == [0, 1]
    kv.reserve("b", 1)  # the device is full of a's full pages: the oldest goes to the host
    assert kv.stats().evictions == 1
    assert kv.device_slots("a") is None and kv.device_slots("b") == [0]
    plain = KVCache(LAYERS, HKV, D, torch.float32, torch.device("cpu"), 4, device_pages=2, host_pages=4)
    plain.reserve("a", 1)
    assert plain.device_slots("a") is None  # no slab: no slots


def test_pages_collected_mid_capture_are_unregistered_after_it(monkeypatch):
    """Neither a synchronise nor cudaHostUnregister may run while a CUDA graph is being captured:
    page-locked tensors freed then (a pool collected by the garbage collector) are held, still
    registered and alive, and unregistered by the next unlock outside a capture."""
    calls, capturing = [], [True]

    class Runtime:
        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append(("synchronize",)))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    monkeypatch.setattr(kv_cache, "_unlock_later", [])
    pages = [torch.ones(4), torch.ones(8)]
    ptrs = [t.data_ptr() for t in pages]
    held = list(pages)
    kv_cache.unlock(held)                       # collected mid-capture, on the capturing thread
    assert calls == [] and held == [] and [t.data_ptr() for t in kv_cache._unlock_later] == ptrs
    capturing[0] = False
    kv_cache.unlock([])                         # the capture is over
    assert calls == [("synchronize",), ("unregister", ptrs[0]), ("unregister", ptrs[1])]
    assert kv_cache._unlock_later == []
    # on another thread while graphs are captured, and through a capture that fails
    calls.clear()
    with pytest.raises(RuntimeError, match="capture failed"):
        with kv_cache.holding_unlocks():
            other = [torch.ones(2)]
            ptr = other[0].data_ptr()
            kv_cache.unlock(other)              # is_current_stream_capturing is False here
            assert calls == [] and len(kv_cache._unlock_later) == 1
            raise RuntimeError("capture failed")
    assert calls == [("synchronize",), ("unregister", ptr)] and kv_cache._unlock_later == []


def test_a_failed_unregister_clears_the_runtime_error_and_says_so(monkeypatch, caplog):
    """cudaHostUnregister's error is not PyTorch's to clear: left pending, the next kernel launch
    anywhere would fail with it."""
    cleared = []

    class Runtime:
        def cudaHostUnregister(self, ptr):
            return 1

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    monkeypatch.setattr(kv_cache, "_clear_cuda_error", lambda: cleared.append(1))
    monkeypatch.setattr(kv_cache, "_unlock_later", [])
    held = [torch.ones(4)]
    with caplog.at_level("WARNING"):
        kv_cache.unlock(held)
    assert cleared == [1] and held == [] and "cudaHostUnregister of a 16-byte page-locked tensor failed" in caplog.text


def test_a_free_whose_synchronise_fails_keeps_the_sequence_and_its_pages(monkeypatch):
    """On CUDA `free` synchronises before pinned pages go back to the free list; where that raises
    (a capture beside it, a lost device) the sequence keeps its pages, which a later free can
    return, instead of pages counted as used that no sequence holds."""
    kv = KVCache(2, 2, 4, torch.float32, torch.device("cpu"), page_size=4, device_pages=1, host_pages=4)
    kv.reserve("a", 6)  # a page on the device, the second on the host (the first is not full: no eviction)
    kv._copy_stream = object()  # as on CUDA, where a host page goes back only once no copy reads it

    def synchronize(device=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    with pytest.raises(RuntimeError, match="capturing"):
        kv.free("a")
    assert kv.sequences() == ["a"] and (kv.device_pool.used_pages, kv.host_pool.used_pages) == (1, 1)
    monkeypatch.undo()
    kv._copy_stream = None
    kv.free("a")
    assert kv.sequences() == [] and (kv.device_pool.used_pages, kv.host_pool.used_pages) == (0, 0)


def test_a_compute_pool_whose_page_cannot_be_locked_takes_ordinary_pages(monkeypatch, caplog):
    """A CPU stage's own pages are page-locked only so copies to the GPU run asynchronously
    (executor/streamed_prefill.py): where the driver refuses, the pool goes on with ordinary pages
    and says so; a pool whose pages must be locked (KV offload's host pool) still fails."""
    from executor.kv_cache import PagePool

    def refuse(shape, dtype):
        raise MemoryError("could not page-lock 64 bytes of host memory for KV pages")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kv_cache, "page_locked", refuse)
    optional = PagePool(torch.device("cpu"), (4, 4), torch.float32, None, pin_memory=True, pin_optional=True)
    required = PagePool(torch.device("cpu"), (4, 4), torch.float32, None, pin_memory=True)
    with caplog.at_level("WARNING"):
        page = optional.allocate()
    assert page.shape == (4, 4) and not optional.pin_memory and "ordinary host memory" in caplog.text
    assert optional.keep_free == kv_cache.KEEP_FREE_HOST_BYTES // 64  # as an ordinary pool keeps freed pages
    assert optional.allocate() is not None and optional.used_pages == 2
    with pytest.raises(MemoryError, match="page-lock"):
        required.allocate()
    assert required.used_pages == 0


def test_locked_pages_are_reused_after_a_refused_lock(monkeypatch):
    """Pages locked before a lock was refused stay registered while the pool lives: every freed one
    is kept for reuse, whatever the ordinary pool's bound, rather than left idle beside new pages."""
    from executor.kv_cache import PagePool

    locked = []

    def lock(shape, dtype):
        if len(locked) == 4:
            raise MemoryError("could not page-lock 64 bytes of host memory for KV pages")
        locked.append(torch.empty(shape, dtype=dtype))
        return locked[-1]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kv_cache, "page_locked", lock)
    pool = PagePool(torch.device("cpu"), (4, 4), torch.float32, None, pin_memory=True, pin_optional=True)
    pages = [pool.allocate() for _ in range(6)]  # 4 locked, then ordinary ones
    pool.keep_free = 1  # the ordinary bound, scaled down
    for p in pages:
        pool.release(p)
    again = {pool.allocate().data_ptr() for _ in range(4)}
    assert again == {t.data_ptr() for t in locked}


class _LoggedStream:
    """A stand-in for a CUDA stream on the CPU: logs what the cache orders on it."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.name))


@pytest.mark.parametrize("layout", ["DHH", "DDH", "HDH", "DHD"])
def test_every_evicted_page_but_the_first_visited_is_prefetched_on_the_copy_stream(monkeypatch, layout):
    """chunks() on CUDA: each page on the host is copied on the copy stream while attention runs
    over the pages before it, after the compute stream's work so far (a page it just wrote), and
    the compute stream waits for that copy before reading it; also a host page behind resident
    ones (a newest page that started on the host, pages a promotion left behind), which was
    copied inline on the compute stream. The CUDA branch on the CPU, streams and events logged."""
    import contextlib

    log, current = [], []
    compute, copy = _LoggedStream("compute", log), _LoggedStream("copy", log)
    current.append(compute)
    events = []

    class Event:
        def __init__(self, *args, **kwargs):
            self.name = f"event{len(events)}"
            events.append(self)

        def record(self, stream=None):
            log.append(("record", self.name, stream.name))

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(("record_stream", s.name)))
    kv = KVCache(1, 1, 2, torch.float32, torch.device("cpu"), page_size=2, device_pages=3, host_pages=3)
    kv.reserve("s", 6)
    for page, where in zip(kv.pages_of("s"), layout):  # the layout by hand: the pools are both the CPU's
        page.on_device = where == "D"
    written = torch.arange(12, dtype=torch.float32).view(6, 1, 2)
    kv.write(0, "s", 0, written, -written)
    kv._copy_stream = copy
    got = [(k.clone(), v.clone(), start) for k, v, start in kv.chunks(0, "s", 6)]
    assert torch.equal(torch.cat([k for k, _, _ in got], 1).transpose(0, 1), written)
    assert torch.equal(torch.cat([v for _, v, _ in got], 1).transpose(0, 1), -written)
    host = [i for i, where in enumerate(layout) if where == "H"]
    # one copy-stream copy a host page but the first (copied inline: nothing runs before it), each
    # after the compute stream's work, its event waited for by the compute stream
    assert len(events) == len(host) - (host[0] == 0)
    for e in events:
        recorded = log.index(("record", e.name, "copy"))
        assert log[recorded - 1] == ("wait_stream", "copy", "compute") and ("wait_event", "compute", e.name) in log


def test_chunks_look_for_the_next_evicted_page_once_per_page_at_most(monkeypatch):
    """Resident pages behind the last evicted one (the common layout: the oldest parked, the
    newest on the device) are not searched again for every page: a look that finds no host page
    ahead is the last, so visiting a sequence stays linear in its pages."""
    kv = KVCache(1, 1, 2, torch.float32, torch.device("cpu"), page_size=2, device_pages=64, host_pages=64)
    kv.reserve("s", 2 * 64)
    kv.pages_of("s")[0].on_device = False   # the oldest parked, every later one resident
    looked = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _LoggedStream("compute", []))
    monkeypatch.setattr(KVCache, "_prefetch", lambda self, seq, i, count, layer: (looked.append(i), None)[1])
    kv._copy_stream = _LoggedStream("copy", [])
    assert len(list(kv.chunks(0, "s", 2 * 64))) == 64
    assert looked == [1]   # page 0 on the host, copied inline; one look ahead, which finds none
