"""Prompt prefix reuse: the K/V pages of requests, kept for later requests that start with the
same tokens.

A chat's next turn resends the whole conversation, and a shared system prompt starts every
request; on a CPU stage a prompt's prefill is seconds per thousand tokens, while reusing its K/V
costs nothing (a shared page) or a page copy. A request's pages are indexed here as they fill
(shared while it still runs: it only writes past them), and its partial last page when it ends;
they stay in the stages' KV pools after it, and a new request starts on the longest run of them
its prompt begins with:

- full pages are shared (the new sequence only writes past them), each keyed by a chain digest
  of every token through it and of the request's `scope` (the daemon's caller, so one caller's
  prompts are never another's to probe through their speed);
- where the match goes on inside a page, its matching tokens' K/V are copied into the new
  sequence's own page (it goes on writing that page).

At least the prompt's last token is always computed, for the logits of the first new token.

Requests that arrive together on one new system prompt would each compute it, side by side: the
engine holds a request back while a started one still computes the pages it would reuse
(`shared_pages`), and starts it on them once they are kept (one prefill, not one per request).

Kept pages cost nothing the plan did not reserve: they live in the plan's KV budget, and one no
running sequence uses gives way (least recently used, leaves of the prefix tree first) whenever a
pool needs its page. The engine's ledger counts a page shared by running sequences once.
K/V computed in another batch can differ in the last bits (bf16), so a greedy token at a near tie
may differ from a run that computed the prefix itself, as with any batch composition.
"""
from __future__ import annotations

import hashlib
import itertools
from array import array
from dataclasses import dataclass, field

from executor.kv_cache import KVCache, Page


@dataclass(eq=False)
class Entry:
    """One kept page (a Page per stage) of a prefix: a full page (shared), or the partial page a
    prefix ends in (copied)."""
    key: bytes | None  # the chain digest through this page; None: a partial page
    scope: bytes
    parent: "Entry | None"
    tokens: tuple[int, ...]
    pages: tuple[Page, ...]  # one per stage with KV, in stage order
    users: int = 0  # running sequences sharing it (or copying from it, for the moment of the copy)
    owner: object = None  # the running sequence whose own page it is (counted in its reservation)
    children: list["Entry"] = field(default_factory=list)  # the pages that follow it in kept prefixes
    last_used: int = 0


@dataclass(frozen=True)
class Match:
    """What a prompt reuses: shared full pages, then `tail_tokens` tokens copied from `tail`."""
    full: tuple[Entry, ...] = ()
    tail: Entry | None = None
    tail_tokens: int = 0

    def tokens(self, page_size: int) -> int:
        return len(self.full) * page_size + self.tail_tokens


def chain_key(parent: bytes, tokens, scope: bytes) -> bytes:
    """A digest of every token of a prefix through this page, and of its scope."""
    h = hashlib.blake2b(digest_size=16)
    for part in (hashlib.blake2b(scope, digest_size=16).digest(), parent, array("q", tokens).tobytes()):
        h.update(part)
    return h.digest()


def shared_pages(a, b, page_size: int, limit: int) -> int:
    """How many full pages of `page_size` tokens `a` and `b` both start with, within their first
    `limit` tokens (a binary search over slice comparisons: long prompts compare in C, not token by
    token in Python)."""
    lo, hi = 0, min(len(a), len(b), limit) // page_size
    if hi and a[:page_size] != b[:page_size]:  # (most prompts differ from the first page)
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid * page_size] == b[:mid * page_size]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, kvs: list[KVCache], page_size: int):
        self.kvs = kvs
        self.page_size = page_size
        self._full: dict[bytes, Entry] = {}
        self._roots: dict[bytes, list[Entry]] = {}  # each scope's entries for a prompt's first page
        self._clock = itertools.count(1)
        # Where indexing a running sequence's filled pages goes on: (pages done, last entry), or
        # None where it stopped (`keep`); so each page filled is hashed once, not the whole prefix again.
        self._cursors: dict[object, tuple[int, Entry | None] | None] = {}
        self._owned: dict[object, list[Entry]] = {}  # a running sequence's own pages kept (Entry.owner)
        self.hit_tokens = 0  # prompt tokens whose K/V were reused, since the engine started
        for kv in kvs:
            kv.reclaim = self.reclaim

    # -- a new request --------------------------------------------------------------------
    def match(self, prompt: list[int], scope: bytes = b"") -> Match:
        """The longest kept prefix of `prompt` short of its last token."""
        limit, P = len(prompt) - 1, self.page_size
        full, key, following = [], b"", self._roots.get(scope, [])
        while (len(full) + 1) * P <= limit:
            entry = self._full.get(chain_key(key, prompt[len(full) * P:(len(full) + 1) * P], scope))
            if entry is None:
                break
            full.append(entry)
            key, following = entry.key, entry.children
        done = len(full) * P
        tail, tail_tokens = None, 0
        for entry in following:  # the page after the shared ones: its longest common run is copied
            n = _common(entry.tokens, prompt[done:limit])
            if n > tail_tokens:
                tail, tail_tokens = entry, n
        now = next(self._clock)
        for entry in (*full, *((tail,) if tail else ())):
            self._touch(entry, now)
        return Match(tuple(full), tail, tail_tokens)

    @staticmethod
    def _touch(entry: Entry, now: int) -> None:
        entry.last_used = now
        for page in entry.pages:
            page.used = now

    def indexing(self, seq_id) -> bool:
        """Whether a running sequence's pages are indexed as they fill (not where it computed its
        own copy of a kept page: `keep`)."""
        return self._cursors.get(seq_id, ()) is not None

    def kept_through(self, prompt: list[int], scope: bytes, pages: int, keys: list[bytes]) -> bool:
        """Whether `prompt`'s first `pages` full pages are all kept (for `scope`), in O(1) once its
        pages' chain digests are known: `keys` holds those computed before for this prompt and scope,
        extended here as needed. The last page tells, since a kept page's parent stays kept as long
        as it does (`reclaim` drops leaves only)."""
        P = self.page_size
        while len(keys) < pages:
            i = len(keys)
            keys.append(chain_key(keys[-1] if keys else b"", prompt[i * P:(i + 1) * P], scope))
        return pages == 0 or keys[pages - 1] in self._full

    @staticmethod
    def counted(entry: Entry) -> bool:
        """Whether the engine's ledger counts this kept page: a running sequence's own (in its
        reservation) or one running sequences share (`pages_in_use`)."""
        return entry.users > 0 or entry.owner is not None

    def pages_in_use(self) -> int:
        """Kept full pages that running sequences share and none holds as its own (the ledger
        counts each once: an owner's page is in its own reservation)."""
        return sum(1 for e in self._full.values() if e.users and e.owner is None)

    def start(self, seq_id, match: Match) -> None:
        """Give a new sequence its matched K/V in every stage: the shared pages, then the copy."""
        # In use from here: the pages that adopting brings back to the device, and the copy's own
        # page, may make room by reclaiming kept pages, but never these (the copy's source included).
        taken = (*match.full, *((match.tail,) if match.tail else ()))
        for entry in taken:
            entry.users += 1
        try:
            for s, kv in enumerate(self.kvs):
                kv.adopt(seq_id, [entry.pages[s] for entry in match.full])
            if match.tail is not None:
                for s, kv in enumerate(self.kvs):
                    kv.copy_tokens(seq_id, match.tail.pages[s], match.tail_tokens)
        except BaseException:  # the sequence starts on nothing: let go of what it took
            for entry in match.full:
                entry.users -= 1
            for kv in self.kvs:
                kv.free(seq_id)
            raise
        finally:
            if match.tail is not None:
                match.tail.users -= 1
        self.hit_tokens += match.tokens(self.page_size)

    # -- a request that ended -------------------------------------------------------------
    def finish(self, seq_id, written: list[int] | None, match: Match, scope: bytes = b"") -> None:
        """A sequence ended: keep its pages (`written`: the tokens whose K/V it wrote; None: keep
        nothing more: it failed; the full pages it kept while it ran stay, written by steps that
        succeeded), then let go of the pages it shared. The caller frees its pages."""
        for entry in self._owned.pop(seq_id, ()):  # first: nothing here may fail before the ledger is right
            entry.owner = None
        for entry in match.full:
            entry.users -= 1
        self._cursors.pop(seq_id, None)
        if written:
            self.keep(seq_id, written, scope)

    def keep(self, seq_id, written: list[int], scope: bytes = b"", partial: bool = True) -> None:
        """Index a sequence's pages of `written` tokens (whose K/V it wrote in every stage): the full
        ones, shared from now on (a running sequence's too: it writes past them), and with
        `partial` the partial page at the end (a sequence that ended: no one writes it now)."""
        start, parent = (0, None) if partial else self._cursors.get(seq_id, (0, None)) or (None, None)
        if start is None:
            return
        pages = [kv.pages_of(seq_id) for kv in self.kvs]
        P = self.page_size
        key, following = (parent.key, parent.children) if parent else (b"", self._roots.setdefault(scope, []))
        now = next(self._clock)
        for i in range(start, -(-len(written) // P)):
            chunk = tuple(written[i * P:(i + 1) * P])
            if len(chunk) < P:  # the partial page at the end, unless a kept page starts the same way
                if partial and not any(e.tokens[:len(chunk)] == chunk for e in following):
                    self._touch(self._keep(None, scope, parent, chunk, [p[i] for p in pages], following), now)
                break
            key = chain_key(key, chunk, scope)
            entry = self._full.get(key)
            if entry is None:
                entry = self._full[key] = self._keep(key, scope, parent, chunk, [p[i] for p in pages], following)
                if not partial:  # a running sequence's own page, counted in its reservation until it ends
                    self._owned.setdefault(seq_id, []).append(entry)  # (first: `finish` clears what it lists)
                    entry.owner = seq_id
            elif not partial and any(a is not b[i] for a, b in zip(entry.pages, pages)):
                # Kept already, but this running sequence computed its own copy: its next pages would
                # hang under a page it does not hold, which nothing could reclaim while it runs and
                # no ledger counts. They are kept when it ends (its pages are then the cache's alone).
                self._cursors[seq_id] = None
                return
            self._touch(entry, now)
            parent, following = entry, entry.children
            if not partial:
                self._cursors[seq_id] = (i + 1, entry)

    def _keep(self, key, scope, parent, tokens, pages, following) -> Entry:
        for kv, page in zip(self.kvs, pages):
            kv.retain(page)
        entry = Entry(key, scope, parent, tokens, tuple(pages))
        following.append(entry)
        return entry

    # -- memory ---------------------------------------------------------------------------
    def reclaim(self) -> bool:
        """Drop the least recently used entry that no sequence uses and no other entry extends, whose
        pages only this cache holds (a running sequence's own pages free nothing); True if there
        was one (its pages are freed in every stage)."""
        leaves = [e for e in self._entries() if not e.users and not e.children and all(p.refs == 1 for p in e.pages)]
        if not leaves:
            return False
        entry = min(leaves, key=lambda e: e.last_used)
        (entry.parent.children if entry.parent else self._roots[entry.scope]).remove(entry)
        if not self._roots.get(entry.scope, True):
            del self._roots[entry.scope]
        if entry.key is not None:
            del self._full[entry.key]
        for kv, page in zip(self.kvs, entry.pages):
            kv.drop(page)
        return True

    def clear(self) -> None:
        while self.reclaim():
            pass

    def kept_pages(self) -> int:
        return sum(1 for _ in self._entries())

    def _entries(self):
        stack = [e for roots in self._roots.values() for e in roots]
        while stack:
            entry = stack.pop()
            yield entry
            stack.extend(entry.children)
