"""The generation engine: requests in, tokens out, one step at a time.

A long-running server drives it: requests arrive (`add_request`) and leave (finish or `abort`)
independently, and every `step()` is

    schedule → run the stages → sample → update

Scheduling is continuous batching over a flat token list: every running sequence decodes one
token, and waiting sequences join with chunks of their prompt (chunked prefill) while the step's
token budget lasts. A sequence's KV pages are freed the moment it finishes or is aborted.

Admission follows the plan's KV budget (`Placement.kv_budget_pages`, what the planner checked
fits in VRAM and host RAM): a sequence starts only when the pages it may grow to (its prompt and
max_new_tokens, within the context) are free in the ledger, in arrival order (one waiting for a
prompt prefix another is computing keeps its place meanwhile: `_schedule`). A sequence never
outgrows the context, so each fits the budget alone, and the pools cannot run out mid-sequence.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from executor.batch import StepBatch
from executor.capture_gate import GATE
from executor.errors import DeviceLostError, HelmError, RequestError
from executor.loader import LoadedModel
from executor.prefix_cache import Match, PrefixCache, shared_pages
from executor.request_params import SamplingParams, StopCriteria
from executor.sampling import make_generator, sample_rows
from planner.step_shape import MAX_RUNNING_SEQUENCES, MAX_STEP_TOKENS, PREFILL_CHUNK_TOKENS, step_tokens

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    request_id: object
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: StopCriteria
    generator: torch.Generator | None
    arrival_s: float
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "context" | "aborted" | "error"
    error: str | None = None  # what went wrong, when finish_reason is "error"
    scope: bytes = b""  # whose kept prompt prefixes it may reuse (executor/prefix_cache.py)
    reused: Match = Match()  # the kept prefix it started on
    reused_tokens: int = 0  # prompt tokens whose K/V it took from that prefix, not computed
    # before it starts: full pages of its prompt that each started request's prompt begins with
    # (computed once per pair, by their serials: prompts never change, request ids come back)
    shared_with: dict[int, int] = field(default_factory=dict)
    serial: int = field(default_factory=itertools.count().__next__)  # unique in this process
    page_keys: list[bytes] = field(default_factory=list)  # its prompt's first pages' chain digests, as needed

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, n: int) -> list[int]:
        """Its first n tokens (prompt, then output)."""
        extra = n - len(self.prompt_ids)
        return self.prompt_ids[:n] if extra <= 0 else self.prompt_ids + self.output_ids[:extra]

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_s is None else (self.first_token_s - self.arrival_s) * 1e3

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first, per second after the first token."""
        if self.finish_s is None or self.first_token_s is None or len(self.output_ids) < 2:
            return None
        elapsed = self.finish_s - self.first_token_s
        return (len(self.output_ids) - 1) / elapsed if elapsed > 0 else None


@dataclass(frozen=True)
class TokenEvent:
    """What one step produced for one request."""
    request_id: object
    token_id: int | None  # None when a request ends without a new token (abort)
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True)
class StageClock:
    """One stage's measured time in one step (CUDA events on a GPU, the wall clock on the CPU)."""
    stage: int
    device: str
    ms: float


@dataclass(frozen=True)
class StepRecord:
    """What a measurement of one step needs (executor.report.Recorder pairs it with the plan's
    prediction). A step with prompt chunks (more than one token of a sequence) is a prefill step:
    `batch` chunks of `tokens` in all, ending on average at `context` (its decodes, a few tokens,
    left out); otherwise a decode step: `batch` sequences at mean context `context` (each attends
    over its tokens through the new one). `streamed`: a CPU stage ran the step's blocks on the GPU,
    their weights streamed (executor/streamed_prefill.py); a prefill step's decodes (`riders`)
    then copy their cached K/V over the link, `rider_context` tokens of it in all (whole pages of
    `page` tokens, as that path copies them)."""
    phase: str                          # "decode" | "prefill"
    context: int
    batch: int
    tokens: int
    stages: tuple[StageClock, ...]
    streamed: bool = False
    riders: int = 0
    rider_context: int = 0

    @classmethod
    def of(cls, batch: StepBatch, stages: tuple[StageClock, ...], streamed: bool = False,
           page: int = 1) -> "StepRecord":
        chunks = [(s.start, s.count) for s in batch.slices if s.count > 1]
        if chunks:
            riders = [-(-s.start // page) * page for s in batch.slices if s.count == 1]
            return cls("prefill", round(sum(s + n for s, n in chunks) / len(chunks)), len(chunks),
                       sum(n for _, n in chunks), stages, streamed, len(riders), sum(riders))
        ends = [s.start + s.count for s in batch.slices]
        return cls("decode", round(sum(ends) / len(ends)), len(ends), batch.num_tokens, stages, streamed)


class Engine:
    def __init__(self, model: LoadedModel, eos_token_ids: tuple[int, ...] = (),
                 context_limit: int | None = None, max_step_tokens: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK_TOKENS, max_running: int = MAX_RUNNING_SEQUENCES,
                 prefix_cache: bool = True, wait_for_shared_prefill: bool = True,
                 stream_chunk: int | None = None):
        """stream_chunk: where the load streams a CPU stage's prompt steps to the GPU
        (LoadedModel.stream_prefill), a prompt's chunks grow to this many tokens while they stream
        (each such step crosses the stage's weights once), and no step holds more
        (priced_step_tokens keeps what the other stages are priced for); None: the placement's
        (its plan's, priced in its GPU memory), else a prompt chunk. prefix_cache: keep requests'
        K/V pages (as they fill, and after the request) for later prompts that start the same way
        (executor/prefix_cache.py); only within a plan's KV budget, which bounds what is kept.
        wait_for_shared_prefill: with it, a request whose prompt starts with pages a started
        request is still computing waits for them rather than computing them too (False: it
        computes them beside it, as without a prefix cache)."""
        self.model = model
        self.config = model.config
        self.eos_token_ids = tuple(eos_token_ids or model.config.eos_token_ids)
        placement = model.placement
        self.context_limit = min(x for x in (context_limit, placement.context_tokens,
                                             model.config.max_position_embeddings) if x)
        self.page_size = placement.page_size_tokens
        self.kv_budget_pages = placement.kv_budget_pages  # None: unbounded (no plan)
        self._kv_pages: dict[object, int] = {}  # the ledger: pages held for each started sequence
        # Called with every executed step's record (a measurement: executor.report.Recorder.record_step).
        self.on_step: Callable[[StepRecord], object] | None = None
        # Called with each step's record before its times are known, once its device work is queued
        # and before the host waits for it: host work that needs only the step's shape (the plan's
        # prediction: Recorder.prepare) then runs while a GPU stage computes, not after it.
        self.on_launched: Callable[[StepRecord], object] | None = None
        on_gpu = any(s.device == "cuda" for s in placement.stages)
        if max_step_tokens is None:  # a plan prices the GPU stage's working set for its batch's prompt chunks
            max_step_tokens = (step_tokens(placement.kv_sequences, self.context_limit)
                               if placement.kv_sequences and on_gpu else MAX_STEP_TOKENS)
        # the step the stages' working sets are priced for; a streaming load's larger steps reach
        # the stages but the streaming one in sub-steps of it (`_forward`)
        self.priced_step_tokens = max_step_tokens
        self.prefill_chunk = prefill_chunk
        self.stream_min_rows = model.stream_prefill or None
        self.stream_chunk = stream_chunk or placement.stream_prefill_step_tokens or PREFILL_CHUNK_TOKENS
        # a streaming load's step holds no more than its streamed steps are priced for (the plan's
        # stream_prefill_step_tokens, decodes riding along included), whatever the stages' step
        self.max_step_tokens = self.stream_chunk if self.stream_min_rows else max_step_tokens
        # A plan prices its stages' working sets (logits, decode rows, a GPU stage's graphs) for this
        # many sequences at most (planner/working_set.py): more would run in memory nobody
        # reserved. Short of a --page-size override its KV budget admits no more anyway. Without a
        # plan a GPU stage's decode graphs are captured for MAX_RUNNING_SEQUENCES rows.
        priced = placement.max_running or (MAX_RUNNING_SEQUENCES if on_gpu else None)
        if priced is not None and max_running > priced:
            log.info("at most %d sequences run at once (the plan's working sets are priced for them; the running "
                     "batch allows %d), the rest wait", priced, max_running)
            max_running = priced
        self.max_running = max_running
        kvs = [stage.kv for stage in model.stages if stage.kv is not None]
        self.prefix = PrefixCache(kvs, self.page_size) if prefix_cache and self.kv_budget_pages and kvs else None
        self.wait_for_shared_prefill = wait_for_shared_prefill
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._by_id: dict[object, Sequence] = {}
        self._ids = itertools.count()
        self.last_step: StepRecord | None = None

    # -- request lifecycle ----------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
                    stop: StopCriteria | None = None, request_id=None, scope: bytes = b"") -> Sequence:
        """Queue a request. scope: requests reuse kept prompt prefixes of their own scope only
        (the daemon's: the caller's credential)."""
        sampling = sampling or SamplingParams()
        stop = stop or StopCriteria()
        sampling.validate()
        stop.validate()
        self._check_prompt(prompt_ids)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._by_id:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, list(prompt_ids), sampling, stop, make_generator(sampling), time.perf_counter(),
                       scope=scope)
        self.waiting.append(seq)
        self._by_id[request_id] = seq
        return seq

    def _check_prompt(self, ids) -> None:
        if len(ids) == 0:
            raise RequestError("the prompt is empty: give at least one token")
        vocab = self.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise RequestError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.context_limit:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; the context holds {self.context_limit}, "
                f"leaving no room to generate"
            )

    def _pages_needed(self, prompt_tokens: int, stop: StopCriteria) -> int:
        """KV pages a sequence may grow to: its prompt and every new token, within the context."""
        return -(-min(prompt_tokens + stop.max_new_tokens, self.context_limit) // self.page_size)

    @property
    def kv_pages_reserved(self) -> int:
        """Pages held for started sequences: each one's own, and the kept pages they share, once."""
        return sum(self._kv_pages.values()) + (self.prefix.pages_in_use() if self.prefix else 0)

    def abort(self, request_id) -> bool:
        """Stop a request now and free its KV pages. False if it was not active."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return False
        with GATE.step():  # its pages are freed (a device synchronise)
            self._finish(seq, "aborted")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Run one step for every scheduled sequence; return what each produced.

        If the batched step fails, each sequence is retried alone (writing K/V at the same
        positions again is harmless), so a failure caused by one request ends only that request
        (finish_reason "error") and the others carry on. Only the computation is retried: once
        tokens are drawn they are committed, each sequence on its own.
        """
        with GATE.step():  # no CUDA graph capture (a plan loading beside this one) while it runs
            return self._step()

    def _step(self) -> list[TokenEvent]:
        failed: list[TokenEvent] = []
        scheduled = self._schedule(failed)
        if not scheduled:
            return failed
        try:
            drawn = [(scheduled, self._draw(scheduled))]
            events = failed
        except Exception as batch_error:  # noqa: BLE001 — isolate, then report per request
            self._check_devices(batch_error)
            if len(scheduled) == 1:
                return failed + [self._fail(scheduled[0][0], batch_error)]
            log.warning("batched step failed (%s); retrying its %d sequences one by one",
                        batch_error, len(scheduled))
            drawn, events = [], failed
            for item in scheduled:
                item = self._alone(item)
                try:
                    drawn.append(([item], self._draw([item])))
                except Exception as e:  # noqa: BLE001
                    self._check_devices(e)
                    events.append(self._fail(item[0], e))
        for part, tokens in drawn:
            events += self._commit(part, tokens)
        return events

    def _check_devices(self, error: Exception) -> None:
        """After a step failed: raise DeviceLostError if a stage's GPU can run nothing more.
        Failing the step's requests one by one would then fail every later request the same
        way, with the daemon still saying it serves."""
        if isinstance(error, HelmError):
            return
        fault = lost_device(stage.device for stage in self.model.stages)
        if fault is not None:
            raise DeviceLostError(f"the GPU can run nothing more in this process ({fault}); the step failed with "
                                  f"{type(error).__name__}: {str(error)[:200]}") from error

    @staticmethod
    def _emitting(scheduled: list[tuple[Sequence, int, int]]) -> list[Sequence]:
        """The sequences whose newest token the step reaches: each gets a new token."""
        return [seq for seq, start, count in scheduled if start + count == seq.num_tokens]

    def _draw(self, scheduled: list[tuple[Sequence, int, int]]) -> list[int]:
        """Run the step and draw the emitting sequences' tokens, changing no sequence (a failed
        draw leaves every generator as it was, for the retry)."""
        parts, rows, offset = [], [], 0
        for seq, start, count in scheduled:
            parts.append((seq.request_id, start, count))
            offset += count
            if start + count == seq.num_tokens:
                rows.append(offset - 1)
        batch = StepBatch.build(parts, rows)
        ids = torch.tensor([seq.token(i) for seq, start, count in scheduled for i in range(start, start + count)],
                           dtype=torch.int64)
        emitting = self._emitting(scheduled)
        logits, clocks = self._run_stages(ids, batch)
        streamed = any(s.streamed is not None and s.streamed.accepts(batch) for s in self.model.stages)
        step = StepRecord.of(batch, (), streamed, self.page_size)  # its times once the device is done
        if self.on_launched is not None:
            try:
                self.on_launched(step)
            except Exception:  # noqa: BLE001 — a measurement's; the step's requests do not depend on it
                log.exception("announcing a step failed; the step runs on")
        try:  # the sampler's device work queues behind the stages'; reading its tokens waits for both
            return sample_rows(logits, [seq.sampling for seq in emitting], [seq.generator for seq in emitting])
        finally:  # the stages ran and are measured, whether or not their logits gave tokens
            self._measured(step, clocks)

    def _measured(self, step: StepRecord, clocks: list) -> None:
        """Time the step's stages and hand its record on (on_step). The sampler has drawn by now,
        moving the requests' generators: a measurement that fails is logged, never failing the
        step's requests (a retry would draw anew), unless the GPU is gone (DeviceLostError)."""
        try:
            self.last_step = replace(step, stages=self._stage_clocks(clocks))
            if self.on_step is not None:
                self.on_step(self.last_step)
        except Exception as e:  # noqa: BLE001
            self._check_devices(e)
            log.exception("measuring a step failed; its tokens stand")

    def _commit(self, scheduled: list[tuple[Sequence, int, int]], tokens: list[int]) -> list[TokenEvent]:
        """Advance the step's sequences and append their tokens; a sequence whose ending fails
        (freeing its pages) fails alone, never re-running the step for the others."""
        emitting = self._emitting(scheduled)
        P = self.page_size
        for seq, start, count in scheduled:
            seq.num_computed = start + count
            if self.prefix is not None and (start + count) // P > start // P:  # a page filled: shared from now
                try:
                    self.prefix.keep(seq.request_id, seq.tokens((start + count) // P * P), seq.scope, partial=False)
                except Exception:  # noqa: BLE001 — sharing is an optimisation; the step's tokens stand
                    log.exception("request %s: keeping its filled KV pages failed", seq.request_id)
        events = []
        for seq, token in zip(emitting, tokens):
            try:
                events.append(self._append(seq, token))
            except Exception as e:  # noqa: BLE001
                self._check_devices(e)
                events.append(self._fail(seq, e))
        return events

    def _fail(self, seq: Sequence, error: Exception) -> TokenEvent:
        log.error("request %s failed: %s: %s", seq.request_id, type(error).__name__, error)
        seq.error = f"{type(error).__name__}: {error}"
        self._finish(seq, "error")
        return TokenEvent(seq.request_id, None, True, "error")

    def _schedule(self, failed: list[TokenEvent]) -> list[tuple[Sequence, int, int]]:
        """(sequence, first position, token count) for this step: decodes first, then prefill
        chunks. A request that fails to start (its kept prefix's pages) goes to `failed`."""
        schedule = [(seq, seq.num_computed, 1) for seq in self.running]
        budget = self.max_step_tokens - len(schedule)
        # Once a request cannot start, none after it does (arrival order: a later request never
        # overtakes a waiting one), but started ones after it go on. A request waiting for a shared
        # prefill keeps its place: a slot, and the pages it will hold once started, every page it
        # may grow to but those it will share with the request it waits for (in that one's
        # reservation); a later one starts beside it only where it would have beside that.
        closed, held_pages, held_slots, reserved = False, 0, 0, None
        leaders = [seq for seq in self.waiting if seq.request_id in self._kv_pages]  # started, prefilling
        for seq in list(self.waiting):
            if budget <= 0:
                break
            if seq.num_computed == 0 and seq.request_id not in self._kv_pages:   # not started yet
                # started sequences (prefilling or running) count: all of them decode together later
                if closed or len(self._kv_pages) + held_slots >= self.max_running:
                    closed = True
                    continue
                shared = self._awaits_shared_prefill(seq, leaders)
                if shared:
                    need = self._pages_needed(len(seq.prompt_ids), seq.stop) - shared
                    if reserved is None:  # (the ledger's sum, once a pass until a request starts)
                        reserved = self.kv_pages_reserved
                    if not self._fits(Match(), need, reserved + held_pages):
                        closed = True  # its place does not fit beside the earlier ones: none after it starts
                        continue
                    held_pages, held_slots = held_pages + need, held_slots + 1
                    continue  # it starts on those pages once they are all kept
                try:
                    started = self._reserve_kv(seq, held=held_pages)
                except Exception as e:  # noqa: BLE001 — without its kept prefix, then failing alone
                    self._check_devices(e)
                    log.warning("request %s: starting on its kept prompt prefix failed (%s: %s); computing the "
                                "whole prompt", seq.request_id, type(e).__name__, e)
                    try:
                        started = self._reserve_kv(seq, reuse=False, held=held_pages)
                    except Exception as e:  # noqa: BLE001
                        self._check_devices(e)
                        failed.append(self._fail(seq, e))
                        continue
                if not started:
                    closed = True
                    continue
                leaders.append(seq)
                reserved = None
            count = min(self.prefill_chunk, budget, len(seq.prompt_ids) - seq.num_computed)
            schedule.append((seq, seq.num_computed, count))
            budget -= count
        return self._unstreamed_within_price(self._topped_up(schedule, budget))

    def _topped_up(self, schedule: list[tuple[Sequence, int, int]], budget: int) -> list[tuple[Sequence, int, int]]:
        """A streaming load's prompt chunks, each first a prefill_chunk (so a short prompt behind a
        long one starts beside it), then grown in order up to stream_chunk with what the step's
        budget has left: larger steps cross the weights fewer times per prompt."""
        if not self.stream_min_rows or budget <= 0:
            return schedule
        running = len(self.running)  # their decodes come first
        grown = schedule[:running]
        for seq, start, count in schedule[running:]:
            if budget > 0:
                extra = min(budget, self.stream_chunk - count, len(seq.prompt_ids) - start - count)
                if extra > 0:
                    count += extra
                    budget -= extra
            grown.append((seq, start, count))
        return grown

    def _alone(self, item: tuple[Sequence, int, int]) -> tuple[Sequence, int, int]:
        """A step's item retried in a step of its own: a prompt chunk that streamed only beside
        others' falls short of the threshold alone, so it runs on the CPU stage's kernels, in a
        chunk they are priced for (as `_unstreamed_within_price`)."""
        seq, start, count = item
        if self.stream_min_rows and 1 < count < self.stream_min_rows:
            count = min(count, self.prefill_chunk, self.priced_step_tokens)
        return seq, start, count

    def _unstreamed_within_price(self, schedule: list[tuple[Sequence, int, int]]) -> list[tuple[Sequence, int, int]]:
        """A streaming load's step whose prompt chunks fall short of its threshold runs on the CPU
        stage's kernels, priced for chunks of prefill_chunk within priced_step_tokens: cut to those
        (a started sequence left out computes in a later step). As planner.step_shape.prompt_steps."""
        if not self.stream_min_rows or sum(n for _, _, n in schedule if n > 1) >= self.stream_min_rows:
            return schedule
        running = len(self.running)
        budget = self.priced_step_tokens - running
        kept = schedule[:running]
        for seq, start, count in schedule[running:]:
            count = min(count, self.prefill_chunk, budget)
            if count <= 0:
                break
            kept.append((seq, start, count))
            budget -= count
        return kept

    def _awaits_shared_prefill(self, seq: Sequence, leaders: list[Sequence]) -> int:
        """The full pages `seq`'s prompt shares with one of `leaders` (started requests still
        computing their prompts) that is computing some of them, beyond the kept ones `seq` would
        start on now; 0: it need not wait. A burst of requests on one new system prompt then
        computes it once, not once per request: its tokens cost the same in the leader's steps
        whoever waits, and each follower starts on the shared pages once they are kept (`_commit`
        indexes them as they fill), with its own tokens left to compute. While the leader runs,
        those pages are in the ledger (its own, or kept ones it shares), so the follower's place
        leaves them out. Should the leader end first, they are kept pages no one counts, which
        the follower's start (`_reserve_kv`) counts again; the leader's end took at least as many
        out of the ledger, and no later request starts before the follower, so it still fits."""
        if self.prefix is None or not self.wait_for_shared_prefill:
            return 0
        for other in leaders:
            if other.scope != seq.scope or not self.prefix.indexing(other.request_id):
                continue  # another caller's, or its pages are not shared while it runs
            shared = seq.shared_with.get(other.serial)
            if shared is None:
                shared = seq.shared_with[other.serial] = shared_pages(other.prompt_ids, seq.prompt_ids, self.page_size,
                                                                      len(seq.prompt_ids) - 1)
            if not self.prefix.kept_through(seq.prompt_ids, seq.scope, shared, seq.page_keys):
                return shared  # (where they are kept, by it or by an earlier request, `seq` starts on them now)
        return 0

    def _reserve_kv(self, seq: Sequence, reuse: bool = True, held: int = 0) -> bool:
        """Hold the pages `seq` may grow to, if the plan's budget has them free beside `held` (pages
        earlier requests keep while they wait), and start it on the longest kept prefix of its
        prompt (pages it shares are counted once, not per sharer)."""
        match = self.prefix.match(seq.prompt_ids, seq.scope) if self.prefix and reuse else Match()
        need = self._pages_needed(len(seq.prompt_ids), seq.stop)
        used = self.kv_pages_reserved + held
        # What fits: the whole match, without the copy (its source is held while the copy's page is
        # made), or none of it (kept pages give way to a request's own as it grows).
        reuse = next((m for m in (match, Match(match.full), Match()) if self._fits(m, need, used)), None)
        if reuse is None:
            return False
        self._kv_pages[seq.request_id] = need - len(reuse.full)
        if reuse.full or reuse.tail:
            try:
                self.prefix.start(seq.request_id, reuse)  # undoes itself if it fails
            except BaseException:
                del self._kv_pages[seq.request_id]
                raise
            seq.reused = reuse
            seq.num_computed = seq.reused_tokens = reuse.tokens(self.page_size)
        return True

    def _fits(self, reuse: Match, need: int, used: int) -> bool:
        """Whether a sequence that may grow to `need` pages fits the budget beside `used` pages (the
        ledger's, and those earlier requests keep while they wait), starting on `reuse` (kept pages
        no one counts yet count now: `PrefixCache.counted`)."""
        if self.kv_budget_pages is None:
            return True
        shared_anew = sum(1 for entry in reuse.full if not self.prefix.counted(entry))
        held_source = int(reuse.tail is not None and not self.prefix.counted(reuse.tail))
        own = need - len(reuse.full)
        return used + shared_anew + held_source + own <= self.kv_budget_pages

    def _run_stages(self, ids: torch.Tensor, batch: StepBatch) -> tuple[torch.Tensor, list]:
        """Run the stages in order, each timed (CUDA events on a GPU, the wall clock on the CPU):
        the last stage's logits [rows, V] fp32, left on its device for the sampler and maybe still
        being computed there, and each stage's clock (`_stage_clocks` reads them)."""
        x, clocks = ids, []
        for stage in self.model.stages:
            if stage.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                x = self._forward(stage, x, batch)
                end.record()
                clocks.append((start, end))
            else:
                t0 = time.perf_counter()
                x = self._forward(stage, x, batch)
                clocks.append((time.perf_counter() - t0) * 1e3)
        return x.float(), clocks

    def _stage_clocks(self, clocks: list) -> tuple[StageClock, ...]:
        """Each stage's time in ms from `_run_stages`' clocks (waiting for a GPU stage's end)."""
        timings = []
        for i, (stage, clock) in enumerate(zip(self.model.stages, clocks)):
            if isinstance(clock, tuple):
                clock[1].synchronize()
                clock = clock[0].elapsed_time(clock[1])
            timings.append(StageClock(i, stage.device.type, clock))
        return tuple(timings)

    def _forward(self, stage, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """stage.forward of the step; a step larger than the stage is priced for (a streaming
        load's: only its streaming stage is priced for it) in consecutive sub-steps that are not."""
        if stage.streamed is not None or (batch.num_tokens <= self.priced_step_tokens
                                          and max(s.count for s in batch.slices) <= self.prefill_chunk):
            return stage.forward(x, batch)
        return torch.cat([stage.forward(x[first:end], sub)
                          for first, end, sub in batch.split(self.priced_step_tokens, self.prefill_chunk)])

    def _append(self, seq: Sequence, token: int) -> TokenEvent:
        seq.output_ids.append(token)
        now = time.perf_counter()
        if seq.first_token_s is None:
            seq.first_token_s = now
            self.waiting.remove(seq)
            self.running.append(seq)
        reason = None
        if not seq.stop.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif token in seq.stop.stop_token_ids:
            reason = "stop"
        elif len(seq.output_ids) >= seq.stop.max_new_tokens:
            reason = "length"
        elif seq.num_tokens >= self.context_limit:
            reason = "context"
        if reason:
            self._finish(seq, reason)
        return TokenEvent(seq.request_id, token, reason is not None, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.finish_s = time.perf_counter()
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        self._by_id.pop(seq.request_id, None)
        started = self._kv_pages.pop(seq.request_id, None) is not None
        # The request is over whatever happens to its pages: a failure here is logged, not raised
        # into a step whose tokens are already drawn.
        try:
            if started and self.prefix is not None:
                written = seq.tokens(seq.num_computed) if reason != "error" else None
                self.prefix.finish(seq.request_id, written, seq.reused, seq.scope)
        except Exception:  # noqa: BLE001
            log.exception("request %s: keeping its prompt's KV pages failed", seq.request_id)
        try:
            self.model.free_sequence(seq.request_id)
        except Exception:  # noqa: BLE001
            log.exception("request %s: freeing its KV pages failed; they stay held", seq.request_id)

    # -- convenience ----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None,
                 stop: StopCriteria | None = None) -> list[Sequence]:
        """Run prompts to completion together (offline use and tests)."""
        seqs = [self.add_request(p, sampling, stop) for p in prompts]
        while self.has_work():
            self.step()
        return seqs


def lost_device(devices) -> str | None:
    """What makes one of these CUDA devices unusable for this process, or None if each still runs
    a kernel. A sticky error (an illegal address, a device-side assert) fails every later call on
    the context, synchronize included; an out-of-memory or a bad launch does not."""
    for device in dict.fromkeys(devices):
        if device.type != "cuda" or not torch.cuda.is_available():  # (a planned GPU stage ran on the CPU)
            continue
        try:
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            with torch.cuda.device(device):
                torch.cuda.synchronize(device)
                torch.ones(1, device=device).add_(1).item()
        except torch.OutOfMemoryError:  # the failed step's tensors may still be held: pressure, not loss
            continue
        except Exception as e:  # noqa: BLE001 — any failure here is the answer
            first_line = (str(e).strip().splitlines() or [""])[0]
            return f"{device}: {type(e).__name__}: {first_line[:200]}"
    return None
