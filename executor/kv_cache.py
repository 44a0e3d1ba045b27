"""Paged KV cache of one stage: a device page pool, a host page pool, and the eviction policy.

Why pages: sequences grow one token at a time and finish at unpredictable moments; fixed-size
pages (default 512 tokens) let a sequence's cache grow without copies, be freed at once when the
sequence ends, and move between device and host memory a page at a time. A page holds the K and
V of `page_size` consecutive tokens for every layer of the stage:

    page: [num_layers, 2 (K, V), H_kv, page_size, D]

so a layer's K of one page is a contiguous [H_kv, n, D] block, what attention reads.

`PagePool` is the mechanism (bounded memory on one device, with a free list so pinned host pages
are not re-allocated); `KVCache` is the policy: which pages a sequence owns, where they live,
and which to evict (the oldest full pages, when a new page needs room on the device). How many
pages the device holds is the plan's decision (the planner parks only the pages that do not fit,
keeping those under the watermark of the VRAM left after weights and working set), not the cache's.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch

from executor.host_memory import page_aligned
from planner.step_shape import longest_gather

log = logging.getLogger(__name__)

# One page of a layer's K/V as attention reads it: K [H_kv, n, D], V [H_kv, n, D], first position.
KVChunk = tuple[torch.Tensor, torch.Tensor, int]

# Freed pages of host memory a pool keeps for the next request: a fresh page's first touch
# page-faults every 4 KiB, a cost of the same order as a short prompt's prefill, which a reused
# page does not pay; bounded so a burst of requests does not hold memory idle.
KEEP_FREE_HOST_BYTES = 1 << 30


class PagePool:
    """Up to `capacity_pages` page buffers on one device (None: bounded only by memory). Freed
    buffers are kept for reuse: all of them when pinned (costly to allocate), up to
    KEEP_FREE_HOST_BYTES of ordinary host memory, none on a GPU (PyTorch's caching allocator
    already reuses those).

    slab: the pages are slots of one buffer allocated up front, `capacity_pages` + 1 pages (the
    last, `scratch_slot`, is written by padded rows of a static-shape step and never handed
    out). A page then has a fixed slot index (`slot_of`), so a step can address pages by index
    from a device tensor (executor/device_step.py: CUDA graphs), and the planned VRAM is taken
    at load, where a plan that does not fit fails, never mid-request."""

    def __init__(self, device: torch.device, page_shape: tuple[int, ...], dtype: torch.dtype,
                 capacity_pages: int | None, pin_memory: bool = False, slab: bool = False,
                 pin_optional: bool = False):
        if capacity_pages is not None and capacity_pages < 0:
            raise ValueError(f"capacity_pages must be >= 0, got {capacity_pages}")
        if slab and not capacity_pages:
            raise ValueError("a slab pool needs a capacity of at least one page")
        self.device = torch.device(device)
        self.page_shape = page_shape
        self.dtype = dtype
        self.capacity_pages = capacity_pages
        self.pin_memory = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
        self.pin_optional = pin_optional  # a page that cannot be locked is an ordinary one (else: MemoryError)
        self.page_bytes = math.prod(page_shape) * torch.empty((), dtype=dtype).element_size()
        self.used_pages = 0
        self._free: list[torch.Tensor] = []
        self.keep_free = (capacity_pages or 1 << 30) if self.pin_memory else \
            max(1, KEEP_FREE_HOST_BYTES // self.page_bytes) if self.device.type == "cpu" else 0
        self._locked: list[torch.Tensor] = []  # every pinned page, kept (and kept registered) while the pool lives
        self._locked_ptrs: set[int] = set()
        if self.pin_memory:
            weakref.finalize(self, unlock, self._locked)
        self.slab = None
        if slab:
            # Zeroed: a static step reads whole pages, masking the slots after a sequence's end,
            # and a masked slot still enters as 0 · V, which must not be 0 · NaN. A page is zeroed
            # again when it is released (`release`): the model can write non-finite K/V (an
            # overflowed activation fails its request), which must not reach the page's next owner.
            self.slab = torch.zeros((capacity_pages + 1, *page_shape), dtype=dtype, device=self.device)
            self._free = [self.slab[i] for i in reversed(range(capacity_pages))]  # slot 0 first
            self.keep_free = capacity_pages

    @property
    def scratch_slot(self) -> int:
        """The slab's slot that is never a page (slab pools only)."""
        return self.capacity_pages

    def slot_of(self, buf: torch.Tensor) -> int:
        """The slab slot of a page buffer this pool handed out (slab pools only)."""
        return (buf.data_ptr() - self.slab.data_ptr()) // self.page_bytes

    @property
    def full(self) -> bool:
        return self.capacity_pages is not None and self.used_pages >= self.capacity_pages

    def allocate(self) -> torch.Tensor | None:
        """A page buffer, or None when the pool is at capacity. Contents are undefined."""
        if self.full:
            return None
        if self._free:
            buf = self._free.pop()
        elif self.pin_memory:
            try:
                buf = page_locked(self.page_shape, self.dtype)
            except MemoryError as e:
                if not self.pin_optional:
                    raise
                # pages the host computes in, page-locked only so copies to the GPU run asynchronously:
                # ordinary ones from here on (the copies wait for the host, nothing else changes)
                log.warning("%s: this pool's pages are ordinary host memory from here on", e)
                self.unpin()
                buf = torch.empty(self.page_shape, dtype=self.dtype)
            else:
                self._locked.append(buf)
                self._locked_ptrs.add(buf.data_ptr())
        else:
            buf = torch.empty(self.page_shape, dtype=self.dtype, device=self.device)
        self.used_pages += 1  # after the allocation: one that raises takes no page
        return buf

    def unpin(self) -> None:
        """New pages are ordinary host memory from here on, and freed ones are kept as an ordinary
        host pool keeps them (pages already locked stay so, and are always kept for reuse)."""
        self.pin_memory = False
        self.keep_free = max(1, KEEP_FREE_HOST_BYTES // self.page_bytes)

    @property
    def free_pages(self) -> int:
        """Freed buffers held for reuse."""
        return len(self._free)

    def release(self, buf: torch.Tensor) -> None:
        if self.slab is not None:
            # on the stream of the steps that last read it (KVCache.free has waited for the copy
            # stream, eviction made this stream wait for its copy), before a later step can take
            # the page: a memset, once a sequence or an eviction
            buf.zero_()
        self.used_pages -= 1
        # a page-locked buffer stays for reuse whatever the bound: the pool holds it registered anyway
        if len(self._free) < self.keep_free or buf.data_ptr() in self._locked_ptrs:
            self._free.append(buf)


def page_locked(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor of its size rounded up to a page. PyTorch's pinned allocator
    rounds every allocation up to a power of two (a 75 MiB page would take 128 MiB), which would
    break the plan's host-RAM budget; so the memory is ordinary host memory registered with the
    driver, over pages of its own (a page shared with another registered tensor would be
    refused: executor/host_memory.py). The caller keeps it alive until `unlock` (see PagePool)."""
    return lock_in_place(page_aligned(shape, dtype), "KV pages")


def lock_in_place(t: torch.Tensor, what: str) -> torch.Tensor:
    """Page-lock host tensor t where it is (returned): a tensor over pages of its own
    (host_memory.page_aligned), which `unlock` lets go of."""
    size = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), size, 0) if size else 0
    if int(err) != 0:
        _clear_cuda_error()
        raise MemoryError(f"could not page-lock {size} bytes of host memory for {what} (cudaHostRegister "
                          f"error {int(err)}); the locked-memory limit (ulimit -l) may be too low")
    return t


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call PyTorch did not make (and so does
    not clear): left pending, the next kernel launch anywhere would report it as its own failure.
    torch.cuda.cudart() does not bind cudaGetLastError: call it in the runtime this process loaded."""
    import ctypes
    try:
        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps if "libcudart.so" in line)
        ctypes.CDLL(path).cudaGetLastError()
    except (OSError, StopIteration):
        log.warning("could not clear the CUDA runtime's last error after a failed cudaHostRegister")


# Page-locked tensors of pools collected while CUDA graphs are being captured (say, the old
# model's, freed by the garbage collector during a new load's captures, in any thread): neither a
# synchronise nor cudaHostUnregister may run then, so they stay registered, and alive, until the
# captures are over (`holding_unlocks`), or the next unlock after them.
# Reentrant: the garbage collector may run a pool's finalizer, which unlocks, on this very thread
# while it holds the lock (any allocation can start a collection).
_unlock_lock = threading.RLock()
_unlock_later: list[torch.Tensor] = []
_captures = 0  # `holding_unlocks` blocks running


@contextlib.contextmanager
def holding_unlocks():
    """While CUDA graphs are captured (ResidentDecode.capture): unlocks wait until it is over."""
    global _captures
    with _unlock_lock:
        _captures += 1
    try:
        yield
    finally:
        with _unlock_lock:
            _captures -= 1
        unlock([])


def unlock(tensors: list[torch.Tensor]) -> None:
    """Unregister page_locked tensors, then let them go (the memory must not be freed while
    registered, nor while a copy may still use it: the device is synchronised first); with those
    held back from a capture. During one, only holds them back."""
    global _unlock_later
    try:
        capturing = torch.cuda.is_current_stream_capturing()
    except Exception:  # interpreter shutdown, or no CUDA here
        capturing = False
    fresh: list[torch.Tensor] = []  # made before the swap: an allocation there could run a finalizer
    # Held to the end: a capture (holding_unlocks takes this lock) must not begin between the
    # check and the synchronise.
    with _unlock_lock:
        if capturing or _captures:
            _unlock_later.extend(tensors)
            tensors.clear()
            return
        # one swap, allocating nothing: a finalizer run meanwhile appends to one list or the other
        pending, _unlock_later = _unlock_later, fresh
        tensors.extend(pending)
        if not tensors:
            return
        try:
            torch.cuda.synchronize()
        except Exception:  # interpreter shutdown, or no CUDA here
            pass
        for t in tensors:
            if t.numel():
                try:
                    err = torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
                except Exception:  # interpreter shutdown: the driver is gone, and so is the memory's pinning
                    continue
                if int(err) != 0:  # left pending, the next kernel launch would report it as its own
                    _clear_cuda_error()
                    log.warning("cudaHostUnregister of a %d-byte page-locked tensor failed (error %d)",
                                t.numel() * t.element_size(), int(err))
        tensors.clear()


@dataclass(eq=False)
class Page:
    data: torch.Tensor  # [num_layers, 2, H_kv, page_size, D]
    on_device: bool
    serial: int  # allocation order: lower is older
    num_tokens: int = 0
    slot: int | None = None  # its slot in the device pool's slab (None: on the host, or no slab)
    refs: int = 1  # its holders: sequences, and the prefix cache (`retain`); released at 0
    used: int = 0  # when the prefix cache last matched it (its clock): kept pages leave oldest first


@dataclass
class SequencePages:
    pages: list[Page] = field(default_factory=list)
    length: int = 0  # tokens whose K/V are written
    table: torch.Tensor | None = None  # page addresses for the CPU kernels; None: rebuild


@dataclass(frozen=True)
class KVStats:
    device_pages_used: int
    device_pages_capacity: int | None
    host_pages_used: int
    evictions: int
    sequences: int
    cached_pages: int = 0  # of those used, pages only the prefix cache holds (given up when a pool needs room)


class KVCache:
    """The KV pages of every sequence for the layers of one stage."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, page_size: int = 512, device_pages: int | None = None,
                 host_pages: int | None = None, slab: bool = False, pin_pages: bool = False):
        """device_pages: pages on `device` (None: unbounded); host_pages: pages the full device
        pool may evict to, in pinned host memory (None: unbounded; 0: none, a full device pool
        is out of KV memory). A cache with an unbounded device pool never evicts. slab: the
        device pool is one buffer of fixed page slots (PagePool; the loader decides). pin_pages:
        a cache in host memory whose pages are page-locked, where CUDA is (a CPU stage whose
        prompt steps run on the GPU copies K/V to and from them: executor/streamed_prefill.py)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_layers, self.num_kv_heads, self.head_dim, self.dtype = num_layers, num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        shape = (num_layers, 2, num_kv_heads, page_size, head_dim)
        self.device_pool = PagePool(self.device, shape, dtype, device_pages, pin_memory=pin_pages, slab=slab,
                                    pin_optional=True)
        self.host_pool = PagePool(torch.device("cpu"), shape, dtype, host_pages, pin_memory=True) \
            if device_pages is not None and host_pages != 0 else None
        self._seqs: dict[object, SequencePages] = {}
        self._retained: dict[int, Page] = {}  # pages the prefix cache holds, by id
        # Called when both pools are full: drops a prefix-cache entry no sequence uses (freeing a
        # page here), True if it did (executor/prefix_cache.py sets it).
        self.reclaim = lambda: False
        self._serial = itertools.count()
        self.evictions = 0
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # -- sequence lifecycle ---------------------------------------------------------------
    def length(self, seq_id) -> int:
        seq = self._seqs.get(seq_id)
        return seq.length if seq else 0

    def reserve(self, seq_id, new_length: int) -> None:
        """Make sure pages exist for token positions < new_length."""
        seq = self._seqs.setdefault(seq_id, SequencePages())
        while len(seq.pages) * self.page_size < new_length:
            seq.pages.append(self._new_page())
            seq.table = None

    def free(self, seq_id) -> None:
        """Let go of every page of a finished or cancelled sequence at once (a page the prefix
        cache or another sequence still holds stays)."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._unref(seq.pages)  # first: a synchronise that raises leaves the sequence whole
            del self._seqs[seq_id]

    def _unref(self, pages: list[Page]) -> None:
        done = [page for page in pages if page.refs == 1]
        if self._copy_stream is not None and any(not page.on_device for page in done):
            # Pinned host pages go back to the free list: no async copy may still read them.
            torch.cuda.synchronize(self.device)
        for page in pages:
            page.refs -= 1
        for page in done:
            (self.device_pool if page.on_device else self.host_pool).release(page.data)

    # -- sharing (executor/prefix_cache.py) -----------------------------------------------
    def pages_of(self, seq_id) -> list[Page]:
        return list(self._seqs[seq_id].pages)

    def retain(self, page: Page) -> None:
        """The prefix cache holds `page` (full or not, no longer written) beyond its sequence."""
        page.refs += 1
        self._retained[id(page)] = page

    def drop(self, page: Page) -> None:
        """The prefix cache lets go of `page`."""
        del self._retained[id(page)]
        self._unref([page])

    def adopt(self, seq_id, pages: list[Page]) -> None:
        """Start a sequence on full pages it shares (read only: its own writes come after them).
        Those on the host come back to the device while it has free pages: a sequence with a page
        on the host streams it every step of its life."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has pages")
        for page in pages:
            page.refs += 1
        self._seqs[seq_id] = SequencePages(list(pages), len(pages) * self.page_size)
        for page in pages:
            if not page.on_device and not self._promote(page):
                break

    def _promote(self, page: Page) -> bool:
        """Move a host page to the device, where a page is free or pages only the prefix cache
        holds make room (moved to the host, or dropped where it is full): a page read every step
        outranks one kept in case. No running sequence's page leaves for it; False if none can."""
        while True:
            buf = self.device_pool.allocate()
            if buf is None and self._evict_oldest(kept_only=True):
                buf = self.device_pool.allocate()
            if buf is not None:
                break
            if not self._idle_kept_on_device():
                return False  # the device holds only running pages: dropping kept ones frees none of it
            if not self.reclaim():  # the host is full: a kept page dropped makes room there
                return False
        try:
            if self._copy_stream is not None:  # an eviction into this host page may be in flight
                torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            buf.copy_(page.data, non_blocking=True)
            if self._copy_stream is not None:
                # the host page goes back to its pool: the copy out of it done
                torch.cuda.current_stream(self.device).synchronize()
        except BaseException:
            self.device_pool.release(buf)
            raise
        self.host_pool.release(page.data)
        page.data, page.on_device = buf, True
        page.slot = self.device_pool.slot_of(buf) if self.device_pool.slab is not None else None
        for seq in self._seqs.values():  # the page's buffer moved: page tables are stale
            seq.table = None
        return True

    def copy_tokens(self, seq_id, src: Page, n: int) -> None:
        """Append the K/V of `src`'s first n tokens to the sequence (which ends on a page boundary):
        a prefix that ends inside a cached page is copied, never shared, since the sequence goes on
        writing that page."""
        seq = self._seqs[seq_id]
        start = seq.length
        if start % self.page_size or not 0 < n <= src.num_tokens:
            raise ValueError(f"cannot copy {n} tokens of a {src.num_tokens}-token page to position {start}")
        self.reserve(seq_id, start + n)  # may evict `src` to the host
        dst = seq.pages[-1]
        if self._copy_stream is not None and not (src.on_device and dst.on_device):
            # A strided copy from or to a host page goes through the host: the page must be as
            # the streams left it (an eviction's copy into it, a prompt chunk's writes).
            self._copy_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        dst.data[:, :, :, :n].copy_(src.data[:, :, :, :n], non_blocking=src.on_device and dst.on_device)
        self.mark_written(seq_id, start, n)

    def sequences(self) -> list:
        return list(self._seqs)

    # -- data -----------------------------------------------------------------------------
    def write(self, layer: int, seq_id, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of tokens at positions start..start+n-1. k, v: [n, H_kv, D]."""
        seq = self._seqs[seq_id]
        n = k.shape[0]
        done = 0
        waited = self._copy_stream is None
        while done < n:
            pos = start + done
            page = seq.pages[pos // self.page_size]
            slot = pos % self.page_size
            take = min(n - done, self.page_size - slot)
            dst = page.data[layer]  # [2, H_kv, P, D]
            if k.device == dst.device:
                dst[0, :, slot:slot + take].copy_(k[done:done + take].transpose(0, 1), non_blocking=True)
                dst[1, :, slot:slot + take].copy_(v[done:done + take].transpose(0, 1), non_blocking=True)
            else:  # a host page (evicted, or a CPU stage's written by its streamed prompt steps)
                if not waited:  # the page may still be on its way out (evicted)
                    torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
                    waited = True
                self._write_host_page(dst, slot, k[done:done + take], v[done:done + take])
            done += take
        self.mark_written(seq_id, start, n)

    @staticmethod
    def _write_host_page(dst: torch.Tensor, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V [n, H_kv, D] on the GPU into slots slot.. of a pinned host page's layer slice dst
        [2, H_kv, P, D]. One copy into that strided slice would convert the dtype through pageable
        memory and block the host; so the K/V block is made contiguous in the page's dtype on the
        GPU and each head's run of slots (contiguous in the page) is copied asynchronously, on
        the compute stream (a later prefetch of the page waits for it)."""
        n = k.shape[0]
        src = torch.stack((k, v)).transpose(1, 2).to(dst.dtype).contiguous()  # [2, H_kv, n, D]
        for kv in range(2):
            for h in range(src.shape[1]):
                dst[kv, h, slot:slot + n].copy_(src[kv, h], non_blocking=True)

    def mark_written(self, seq_id, start: int, n: int) -> None:
        """Record that positions start..start+n-1 hold K/V (written by `write` or by a kernel
        through `page_table`)."""
        seq = self._seqs[seq_id]
        for i in range(start // self.page_size, -(-(start + n) // self.page_size)):
            page = seq.pages[i]
            if page.refs > 1:  # shared pages are read only: their other holders read what they hold
                raise RuntimeError(f"K/V written into a shared page (sequence {seq_id!r}, page {i})")
            page.num_tokens = max(page.num_tokens, min(self.page_size, start + n - i * self.page_size))
        seq.length = max(seq.length, start + n)

    def page_table(self, seq_id) -> torch.Tensor:
        """int64 [pages] of the sequence's page buffer addresses, oldest first, for the CPU
        attention kernels (executor.kernels.PagedKV describes a page). Valid until the next
        reserve or eviction; only for a cache whose pages are all in host memory."""
        if self.device.type != "cpu":
            raise RuntimeError("page_table is for CPU caches (the kernels read pages in host memory)")
        seq = self._seqs[seq_id]
        if seq.table is None:
            seq.table = torch.tensor([p.data.data_ptr() for p in seq.pages], dtype=torch.int64)
        return seq.table

    def device_slots(self, seq_id) -> list[int] | None:
        """The slab slots of the sequence's pages, oldest first; None when one of its pages is on
        the host or the device pool is not a slab."""
        if self.device_pool.slab is None:
            return None
        slots = [p.slot for p in self._seqs[seq_id].pages]
        return None if None in slots else slots

    def resident(self, seq_id) -> bool:
        """Whether every page of the sequence is on the compute device."""
        return all(p.on_device for p in self._seqs[seq_id].pages)

    def gathers(self, seq_id, length: int) -> bool:
        """Whether a prompt chunk's fused attention may gather the sequence's positions < length:
        every page of it on the device, or no more tokens than the device pool holds (the plan
        prices a gather of that many, planner/working_set.py: a sequence whose pages the pool
        parked on the host while others held it brings them back into the one gather)."""
        capacity = self.device_pool.capacity_pages
        return self.resident(seq_id) or capacity is None or length <= longest_gather(capacity, self.page_size)

    def gathered(self, layer: int, seq_id, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions < length as one [H_kv, length, D] tensor each, on the compute
        device (a prompt chunk's fused attention reads them so); a view when one page holds them.
        Filled a page at a time (a parked page's copy let go once it is in), so it takes the
        gather's memory and a page's, never all the copies beside it."""
        chunks = self.chunks(layer, seq_id, length)
        k0, v0, _ = next(chunks)
        if k0.shape[1] >= length:
            return k0, v0
        k = torch.empty(k0.shape[0], length, k0.shape[2], dtype=k0.dtype, device=k0.device)
        v = torch.empty_like(k)
        k[:, :k0.shape[1]], v[:, :v0.shape[1]] = k0, v0
        del k0, v0
        for kc, vc, start in chunks:
            k[:, start:start + kc.shape[1]], v[:, start:start + vc.shape[1]] = kc, vc
            del kc, vc
        return k, v

    def chunks(self, layer: int, seq_id, length: int) -> Iterator[KVChunk]:
        """K/V of positions < length, page by page, oldest first, on the compute device.

        Evicted pages are brought back one layer-slice at a time; on CUDA the next evicted slice
        is copied on a side stream while attention runs over the pages before it (resident ones
        too: a sequence's newest page may be on the host behind resident ones).
        """
        seq = self._seqs[seq_id]
        count = -(-length // self.page_size)
        on_cuda = self._copy_stream is not None
        if on_cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self._copy_stream)  # pending evictions land before we read them
        prefetched = None  # (page index, device buffer, ready event)
        ahead = on_cuda  # a host page may lie ahead: False once a look found none
        for i in range(count):
            page = seq.pages[i]
            n = min(self.page_size, length - i * self.page_size)
            if page.on_device or not on_cuda:
                kv = page.data[layer]  # resident, or host memory is the compute memory
            else:
                if prefetched is not None and prefetched[0] == i:
                    _, kv, ready = prefetched
                    compute.wait_event(ready)
                    kv.record_stream(compute)
                else:
                    kv = page.data[layer].to(self.device, non_blocking=True)
            if ahead and (prefetched is None or prefetched[0] <= i):
                prefetched = self._prefetch(seq, i + 1, count, layer)
                ahead = prefetched is not None
            yield kv[0, :, :n], kv[1, :, :n], i * self.page_size

    def _prefetch(self, seq: SequencePages, i: int, count: int, layer: int):
        """Start copying the layer slice of the first page from i on that is on the host to the
        device on the copy stream, after the compute stream's work so far: a host page may just
        have been written by it (a page that started on the host, filled by a prompt chunk), and
        the copy must read what was written. None where no page from i on is on the host."""
        while i < count and seq.pages[i].on_device:
            i += 1
        if i >= count:
            return None
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            buf = seq.pages[i].data[layer].to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        return i, buf, ready

    # -- placement policy -----------------------------------------------------------------
    def _new_page(self) -> Page:
        while True:
            page = self._try_new_page()
            if page is not None:
                return page
            if not self.reclaim():  # pages the prefix cache holds for no one give way first
                raise MemoryError(f"out of KV pages: the device pool holds {self.device_pool.used_pages} and the "
                                  f"host pool {self.host_pool.used_pages if self.host_pool else 0} (the plan's "
                                  "budget)")

    def _try_new_page(self) -> Page | None:
        buf = self.device_pool.allocate()
        if buf is None and self._evict_oldest():
            buf = self.device_pool.allocate()
        if buf is not None:
            slot = self.device_pool.slot_of(buf) if self.device_pool.slab is not None else None
            return Page(buf, on_device=True, serial=next(self._serial), slot=slot)
        # Device full of partial pages: the new page lives on the host from the start.
        host = self.host_pool.allocate() if self.host_pool is not None else None
        return Page(host, on_device=False, serial=next(self._serial)) if host is not None else None

    def _idle_kept_on_device(self) -> list[Page]:
        """Device pages only the prefix cache holds (its hold is their last reference)."""
        return [p for p in self._retained.values() if p.on_device and p.refs == 1]

    def _evict_oldest(self, kept_only: bool = False) -> bool:
        """Move a device page to the host: one only the prefix cache holds where there is one (no
        step reads it; the least recently matched), else (unless `kept_only`) a sequence's oldest
        full page (a partial one is still being written)."""
        if self.host_pool is None or self.host_pool.full:
            return False
        kept = self._idle_kept_on_device()
        if kept:
            page = min(kept, key=lambda p: p.used)
        elif kept_only:
            return False
        else:
            held = {id(p): p for seq in self._seqs.values() for p in seq.pages}
            candidates = [p for p in held.values() if p.on_device and p.num_tokens == self.page_size]
            if not candidates:
                return False
            page = min(candidates, key=lambda p: p.serial)
        for seq in self._seqs.values():  # the page's buffer moves: page tables are stale
            seq.table = None
        host = self.host_pool.allocate()
        if self._copy_stream is not None:
            # Copy after the compute stream's writes, then free the device buffer only once the
            # copy is done (the caching allocator reuses it in stream order).
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                host.copy_(page.data, non_blocking=True)
                page.data.record_stream(self._copy_stream)
            if self.device_pool.slab is not None:
                # A slab slot is reused at once (by the page being made): its next write must not
                # overtake the copy out of it, which record_stream guards only for the allocator's
                # own buffers.
                torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        else:
            host.copy_(page.data)
        self.device_pool.release(page.data)
        page.data, page.on_device, page.slot = host, False, None
        self.evictions += 1
        return True

    def stats(self) -> KVStats:
        return KVStats(
            device_pages_used=self.device_pool.used_pages,
            device_pages_capacity=self.device_pool.capacity_pages,
            host_pages_used=self.host_pool.used_pages if self.host_pool else 0,
            evictions=self.evictions,
            sequences=len(self._seqs),
            cached_pages=sum(1 for p in self._retained.values() if p.refs == 1),
        )
