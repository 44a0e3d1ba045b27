"""One Engine on its own thread, the only thread that touches it (the Engine is not thread-safe).

gRPC handler threads talk to an `EngineWorker` through a command queue (submit, abort, retire)
and read each request's events from the request's own queue. The worker thread loops

    take commands → step the engine → record the step → hand out the events → publish a snapshot

and sleeps on the command queue while the engine has nothing to do. A worker serves one plan;
when the daemon swaps plans it retires the old worker, which finishes the requests it holds and
then exits, dropping its model.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from executor.engine import Engine
from executor.errors import DeviceLostError, HelmError, RequestFailedError
from executor.kv_cache import KVStats
from executor.report import Recorder
from executor.request_params import SamplingParams, StopCriteria

log = logging.getLogger("helm.worker")


@dataclass(frozen=True)
class Submission:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: StopCriteria
    scope: bytes = b""  # whose kept prompt prefixes it may reuse (the caller's credential)


# -- what a request's queue receives: Accepted or Rejected, then Produced..., then Ended ----------
@dataclass(frozen=True)
class Accepted:
    pass


@dataclass(frozen=True)
class Rejected:
    error: HelmError  # the engine refused the request (e.g. a token id outside the vocabulary)


@dataclass(frozen=True)
class Produced:
    token_id: int
    index: int  # position in the completion
    time_s: float  # time.perf_counter() after the step
    stage_ms: tuple[tuple[float, float], ...]  # (measured, predicted) ms per stage of the step


@dataclass(frozen=True)
class Ended:
    reason: str  # stop | length | context | aborted | error
    error: str | None
    time_s: float
    reused_tokens: int = 0  # prompt tokens whose K/V came from an earlier request's kept prefix


@dataclass(frozen=True)
class WorkerSnapshot:
    """Queue and KV state after the worker's latest loop, readable from any thread."""
    waiting: int
    running: int
    kv: tuple[KVStats | None, ...]  # per stage


@dataclass
class _Stream:
    events: queue.SimpleQueue
    sequence: object  # the engine's Sequence
    prompt_len: int
    produced: int = 0


class EngineWorker:
    IDLE_POLL_S = 1.0

    def __init__(self, engine: Engine, recorder: Recorder, name: str, on_end=lambda request_id: None,
                 on_step=lambda phase, stage_ms: None, on_exit=lambda worker: None, measuring=lambda: True):
        self.engine = engine
        self.recorder = recorder
        self.name = name
        self._on_end = on_end  # called on the engine thread when a request is over for the engine
        self._on_step = on_step  # called on the engine thread with each step's (measured, predicted) ms
        self._on_exit = on_exit  # called on the engine thread as it ends (`crashed` says whether by a fault)
        # whether a step's times go into the report: not while another plan loads beside it, whose
        # weight copies and warm-up share the GPU's stream and the host (the step is still predicted)
        self._measuring = measuring
        self.crashed: str | None = None  # what stopped the engine thread, where a fault did
        self.device_lost = False  # that fault left a GPU unusable for this process (DeviceLostError)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._retired = False
        self._stage_ms: tuple[tuple[float, float], ...] = ()  # the step's (measured, predicted) ms per stage
        engine.on_launched = recorder.prepare  # every step from now on (the plan's warm-up is not measured)
        engine.on_step = self._record
        self.snapshot = self._snapshot()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- any thread -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, sub: Submission) -> queue.SimpleQueue:
        """Queue a request; its events arrive on the returned queue (Accepted or Rejected first)."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        self._commands.put(("submit", sub, events))
        return events

    def abort(self, request_id: str) -> None:
        """End a request now and free its KV pages (a no-op if it already ended)."""
        self._commands.put(("abort", request_id))

    def retire(self) -> None:
        """Finish the requests already submitted, then stop."""
        self._commands.put(("retire",))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._take_commands(block=not self.engine.has_work())
                if self._retired and not self.engine.has_work() and not self._streams:
                    break
                if self.engine.has_work():
                    try:
                        self._step()
                    except DeviceLostError:
                        raise  # nothing more can run here: end the thread (below)
                    except Exception as e:  # noqa: BLE001 — the engine isolates request failures; this is not one
                        log.exception("engine step failed on %s; ending its requests", self.name)
                        self._fail_all(e)
                self.snapshot = self._snapshot()
        except BaseException as e:  # noqa: BLE001 — a bug here must end requests, not hang them
            log.exception("engine worker %s stopped", self.name)
            self.device_lost = isinstance(e, DeviceLostError)
            self.crashed = str(e)[:400] if self.device_lost else f"{type(e).__name__}: {str(e)[:200]}"
            self._fail_all(e)
        finally:
            log.info("engine worker %s exits", self.name)
            self.engine = None  # drop the model (its weights and KV pages)
            try:
                self._on_exit(self)
            except Exception:  # noqa: BLE001 — the thread is ending either way
                log.exception("engine worker %s: its exit hook failed", self.name)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 — ending the stream matters more than freeing pages here
                log.exception("abort of %s failed", request_id)
            stream.events.put(Ended("error", f"{type(error).__name__}: {error}", time.perf_counter()))
            self._on_end(request_id)
        self._streams.clear()

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self.IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "submit":
            _, sub, events = command
            try:
                seq = self.engine.add_request(list(sub.prompt_ids), sub.sampling, sub.stop, sub.request_id,
                                              sub.scope)
            except HelmError as e:
                events.put(Rejected(e))
                self._on_end(sub.request_id)
                return
            except Exception as e:  # noqa: BLE001 — refuse this request, keep serving
                events.put(Rejected(RequestFailedError(f"{type(e).__name__}: {e}")))
                self._on_end(sub.request_id)
                return
            self._streams[sub.request_id] = _Stream(events, seq, len(sub.prompt_ids))
            events.put(Accepted())
        elif kind == "abort":
            stream = self._streams.pop(command[1], None)
            if stream is not None:
                self.engine.abort(command[1])
                stream.events.put(Ended("aborted", None, time.perf_counter(), stream.sequence.reused_tokens))
                self._on_end(command[1])
        elif kind == "retire":
            self._retired = True

    def _step(self) -> None:
        self._stage_ms = ()
        events = self.engine.step()
        now = time.perf_counter()
        stage_ms = self._stage_ms
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue
            if event.token_id is not None:
                stream.events.put(Produced(event.token_id, stream.produced, now, stage_ms))
                stream.produced += 1
            if event.finished:
                error = stream.sequence.error if event.finish_reason == "error" else None
                stream.events.put(Ended(event.finish_reason, error, now, stream.sequence.reused_tokens))
                del self._streams[event.request_id]
                self._on_end(event.request_id)

    def _record(self, record) -> None:
        """Pair an executed step's stage times with the plan's prediction and store them."""
        predicted = self.recorder.record_step(record, store=self._measuring())
        self._stage_ms = tuple((t.ms, p.ms) for t, p in zip(record.stages, predicted))
        self._on_step(record.phase, self._stage_ms)

    def _snapshot(self) -> WorkerSnapshot:
        return WorkerSnapshot(len(self.engine.waiting), len(self.engine.running),
                              tuple(s.kv.stats() if s.kv is not None else None for s in self.engine.model.stages))
