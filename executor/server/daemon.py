"""The daemon's core, free of gRPC: one model, the plan serving it, admission and shutdown.

    daemon = Daemon("models/qwen3-0.6b", max_batch=64, max_queue=64, plan_dir="plans")
    daemon.load_plan(PlanSource(path="qwen3.yaml"))     # validate, load, warm up, then swap
    for event in daemon.submit(spec): ...               # TokenChunk..., then GenerationResult
    daemon.info(); daemon.report(); daemon.drain(30.0)

A plan swap is atomic: the new plan's stages are loaded and warmed up while the old plan serves;
then new requests go to the new plan's worker and the old worker finishes what it holds. Both
models are in memory during the swap. Admission counts every request from `submit` to its end:
at most `max_batch + max_queue` at once, and at most `max_per_caller` of one caller's (its
checked credential: a token, a client certificate), beyond that OverloadedError; so one client
cannot hold every slot while others are refused (serve sets a share where callers can be told
apart: `caller_share`). Requests without a caller (b"": no credentials) are held to no share.
"""
from __future__ import annotations

import gc
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.engine import Engine, lost_device
from executor.errors import (DeviceLostError, HelmError, LoadInProgressError, NotReadyError, OverloadedError,
                             PlanLoadError, PlanNotFoundError, RequestError, RequestFailedError, ShuttingDownError)
from executor.loader import load_model
from executor.model_config import ModelConfig
from executor.plan_io import (check_gpu_memory_fits, check_host_kv_fits, check_plan_fits, load_checked_plan,
                              placement_for)
from executor.report import Recorder, kernel_isa
from executor.request_params import SamplingParams, StopCriteria
from executor.server.messages import (MAX_PROMPT_BYTES_PER_TOKEN, GenerateSpec, GenerationResult, LoadResult,
                                      PlanSource, ServerInfo, StageInfo, StageTiming, TokenChunk)
from executor.server.text import TextStream
from executor.server.worker import Ended, EngineWorker, Produced, Rejected, Submission
from executor.tokenizer import Tokenizer
from planner import __version__
from planner.errors import PlanError
from planner.plan import Plan
from planner.report import PlanSummary, Report
from planner.step_shape import MAX_RUNNING_SEQUENCES
from planner.yamlio import read_text_file

log = logging.getLogger("helm.daemon")

KEEP_REPORTS = 8  # plans whose measurements stay available after they were replaced
WARMUP_PROMPT_TOKENS = 4
WARMUP_NEW_TOKENS = 2


@dataclass(frozen=True)
class _Serving:
    """A loaded plan and the worker running it."""
    plan: Plan
    summary: PlanSummary
    worker: EngineWorker
    stages: tuple[StageInfo, ...]  # static part (kv filled in from the worker's snapshot)
    kernel_isa: str
    context_tokens: int  # the longest sequence the plan serves (its context, within the model's)
    max_running: int  # the most sequences its engine runs at once (--max-batch, within what the plan priced)


def caller_share(max_batch: int, max_queue: int, client_tokens: int, mutual_tls: bool) -> int:
    """The admission slots one caller may hold by default: half of them where several clients
    can be told apart (two client tokens or more, or client certificates under mutual TLS, with
    no tokens), so one cannot lock the others out; all of them where there is one client (one
    client token, the admin's trusted beside it) or none can be told apart."""
    slots = max_batch + max_queue
    several = client_tokens >= 2 or (mutual_tls and client_tokens == 0)
    return -(-slots // 2) if several else slots


def cap_gpu_memory(cap_bytes: int) -> None:
    """Hold what PyTorch's CUDA allocator may reserve in this process to cap_bytes (the CUDA
    context and libraries' handles come on top): an allocation beyond it raises OutOfMemoryError,
    which fails that request or that plan's load, and the daemon goes on serving; so the daemon
    shares a GPU (a desktop, another process) within a known bound. Without CUDA there is nothing to
    hold (plans are still checked against the cap at load)."""
    if cap_bytes < 1:
        raise ValueError(f"--gpu-memory must be positive, got {cap_bytes}")
    if not torch.cuda.is_available():
        log.warning("--gpu-memory: no CUDA device here; plans are checked against it, nothing is capped")
        return
    device = torch.cuda.current_device()  # the GPU stages' ("cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
    log.info("GPU memory capped", extra={"fields": {"cap_bytes": cap_bytes, "device_bytes": total}})


class Daemon:
    def __init__(self, model_dir: str | Path, max_batch: int = MAX_RUNNING_SEQUENCES, max_queue: int = 64,
                 backend: str = "auto", threads: int | None = None, plan_dir: str | Path | None = None,
                 prefix_cache: bool = True, gpu_memory_bytes: int | None = None, max_per_caller: int | None = None):

        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        if max_per_caller is not None and max_per_caller < 1:
            raise ValueError(f"max_per_caller must be >= 1, got {max_per_caller}")
        self.max_per_caller = max_per_caller or max_batch + max_queue  # one caller's slots (default: all)
        self.model_dir = Path(model_dir)
        self.config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir) if (self.model_dir / "tokenizer.json").is_file() else None
        self.max_batch, self.max_queue, self.backend = max_batch, max_queue, backend
        self.threads = threads  # CPU-stage threads for every plan; None: each plan's profiled cores
        self.prefix_cache = prefix_cache  # keep requests' K/V for later prompts that start the same way
        self.plan_dir = Path(plan_dir) if plan_dir is not None else None  # LoadPlan paths; None: inline only
        if self.plan_dir is not None and not self.plan_dir.is_dir():
            raise ValueError(f"--plan-dir {plan_dir}: not a directory")
        self.gpu_memory_bytes = gpu_memory_bytes  # --gpu-memory: what every plan's GPU stage may hold
        if gpu_memory_bytes is not None:
            cap_gpu_memory(gpu_memory_bytes)
        self.state = "loading"  # loading | serving | draining
        self.on_state_change = lambda state: None  # health checking hooks in here
        self.on_step = lambda phase, devices, stage_ms: None  # metrics hook in here (engine threads)
        self.on_device_lost = lambda: None  # serve hooks in here: it exits, for a supervisor to restart it
        self.device_lost: str | None = None  # why a GPU can run nothing more in this process
        self._serving: _Serving | None = None
        self._stopped: str | None = None  # why the serving engine stopped, until a plan loads again
        self._retired: list[EngineWorker] = []
        self._active: dict[str, EngineWorker] = {}  # engine key of each admitted request → its worker
        self._client_ids: dict[tuple[bytes, str], str] = {}  # (caller, request_id) in flight → its engine key
        self._owners: dict[str, tuple[bytes, str]] = {}  # engine key → (caller, request_id)
        self._per_caller: dict[bytes, int] = {}  # requests in flight of each caller (b"": none checked)
        self._keys = itertools.count()
        self._recorders: OrderedDict[str, Recorder] = OrderedDict()
        self._lock = threading.Condition()
        self._load_lock = threading.Lock()
        self._started_s = time.perf_counter()

    # -- plans ----------------------------------------------------------------------------
    def load_plan(self, source: PlanSource) -> LoadResult:
        """Validate, load and warm up a plan, then make it the one serving new requests. Any
        failure before the swap (a bad plan, weights that do not fit, a failed warm-up) raises
        and leaves the plan that was serving in place."""
        if not self._load_lock.acquire(blocking=False):  # one load at a time; others get an answer now
            raise LoadInProgressError("another LoadPlan is loading a plan; retry when it is done")
        try:
            return self._load(source)
        finally:
            self._load_lock.release()

    def _load(self, source: PlanSource) -> LoadResult:
        if self.state == "draining":
            raise ShuttingDownError("the daemon is shutting down; not loading a plan")
        if self.device_lost is not None:
            raise self._refusal_for_lost_device()
        t0 = time.perf_counter()
        plan = check_plan_fits(source.plan, self.model_dir, self.config) if source.plan is not None else \
            load_checked_plan("plan", self.model_dir, self.config, text=self._plan_text(source))
        with self._lock:  # the plans whose models are loaded: the one serving, earlier ones finishing requests
            loaded = tuple(w.recorder.plan for w in self._retired if w.alive) + \
                ((self._serving.plan,) if self._serving is not None else ())
        check_gpu_memory_fits(plan, self.gpu_memory_bytes, loaded)
        placement = placement_for(plan, self.config, cpu_threads=self.threads)
        check_host_kv_fits(placement, self.config, self.max_batch)
        failure = None
        try:
            model = load_model(self.model_dir, placement, self.config, backend=self.backend)
            engine = Engine(model, max_running=self.max_batch, prefix_cache=self.prefix_cache)
            t1 = time.perf_counter()
            self._warm_up(engine)
        except DeviceLostError as e:  # its warm-up found the GPU gone: so is every plan's
            self._lose_device(str(e))
            raise
        except HelmError:
            raise
        except Exception as e:  # noqa: BLE001 — out of memory, a CUDA error...: the plan cannot serve here
            log.warning("plan refused: its load or warm-up failed", exc_info=True,
                        extra={"fields": {"digest": plan.digest, "source": source.label}})
            failure = f"{type(e).__name__}: {str(e)[:300]}"
        if failure is not None:  # out of the except block: its traceback no longer holds the model
            model = engine = None
            fault = lost_device(torch.device(spec.device) for spec in placement.stages)
            if fault is not None:
                self._lose_device(f"the GPU can run nothing more in this process ({fault}); the plan's load failed "
                                  f"with {failure}")
                raise self._refusal_for_lost_device()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise PlanLoadError(f"the plan cannot serve on this machine: its load or warm-up generation failed "
                                f"({failure}); {self._what_serves()}")
        t2 = time.perf_counter()

        summary = PlanSummary.of(plan, source.label)
        isa = kernel_isa(model)
        recorder = Recorder(plan, source.label, self.config.architecture, isa, stream_prefill=model.stream_prefill)
        stages = tuple(StageInfo(i, spec.device, str(stage.device), stage.unit_start, stage.unit_end,
                                 stage.backend, placement.page_size_tokens, None)
                       for i, (spec, stage) in enumerate(zip(placement.stages, model.stages)))
        devices = tuple(s.planned_device for s in stages)
        worker = EngineWorker(engine, recorder, name=f"engine-v{plan.plan_version}-{plan.digest[7:15]}",
                              on_end=self._release,
                              on_step=lambda phase, stage_ms: self.on_step(phase, devices, stage_ms),
                              on_exit=self._worker_exited, measuring=lambda: not self._load_lock.locked())
        worker.start()
        with self._lock:
            if self.state == "draining":  # shutdown began while the plan loaded
                worker.retire()
                raise ShuttingDownError("the daemon is shutting down; the plan was loaded but not swapped in")
            if self.device_lost is not None:  # lost while this plan warmed up
                worker.retire()
                raise self._refusal_for_lost_device()
            if worker.crashed is not None:  # its engine stopped before it served (set before its exit hook)
                raise PlanLoadError(f"the plan's engine stopped as it started ({worker.crashed}); "
                                    f"{self._what_serves()}")
            previous = self._serving
            self._serving = _Serving(plan, summary, worker, stages, isa, engine.context_limit, engine.max_running)
            self._stopped = None
            if previous is not None:
                previous.worker.retire()
                self._retired.append(previous.worker)
            self._recorders.pop(plan.digest, None)
            self._recorders[plan.digest] = recorder
            while len(self._recorders) > KEEP_REPORTS:
                self._recorders.popitem(last=False)
            self._set_state("serving")
        log.info("plan loaded", extra={"fields": {
            "plan_version": plan.plan_version, "digest": plan.digest, "split_k": plan.partition.split_k,
            "source": source.label, "kernels": isa, "cpu_threads": placement.cpu_threads,
            "kv_budget": f"{placement.kv_sequences} x {placement.context_tokens} tokens "
                         f"({placement.kv_budget_pages} pages of {placement.page_size_tokens})", "load_s": round(t1 - t0, 3), "warmup_s": round(t2 - t1, 3),
            "previous_digest": previous.summary.digest if previous else None}})
        return LoadResult(summary, previous.summary.digest if previous else None, t1 - t0, t2 - t1)

    def _refusal_for_lost_device(self) -> DeviceLostError:
        return DeviceLostError(f"{self.device_lost}: restart the daemon to load a plan")

    def _what_serves(self) -> str:
        return "the previous plan still serves" if self._serving is not None else "no plan serves"

    def _plan_text(self, source: PlanSource) -> str:
        """The plan's YAML text. A path is only read inside --plan-dir (symlinks resolved first),
        and every way it can fail there gives the same answer, so a caller learns nothing about
        the daemon's files; the text is never quoted back."""
        if source.yaml is not None:
            return source.yaml  # parse_yaml bounds its size
        if self.plan_dir is None:
            raise PlanNotFoundError("LoadPlan by path is off: the daemon was started without --plan-dir; "
                                    "send the plan's YAML instead")
        unavailable = PlanNotFoundError(f"plan {source.path!r} is not available in the daemon's plans directory")
        root = self.plan_dir.resolve()
        try:
            path = (root / source.path).resolve()
        except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
            raise unavailable from None
        if not path.is_relative_to(root) or path == root:
            raise unavailable
        try:
            return read_text_file(path, "plan")
        except PlanError:
            raise unavailable from None

    def _warm_up(self, engine: Engine) -> None:
        """One short generation before the plan takes requests (first-call allocations, kernels)."""
        vocab = self.config.vocab_size
        length = max(1, min(WARMUP_PROMPT_TOKENS, engine.context_limit - 1))   # a prompt the plan's context holds
        prompt = [min(i + 1, vocab - 1) for i in range(length)]
        seq, = engine.generate([prompt], SamplingParams(), StopCriteria(max_new_tokens=WARMUP_NEW_TOKENS,
                                                                         ignore_eos=True))
        if seq.finish_reason == "error":  # the engine isolates a request's failure; here it fails the plan
            raise RuntimeError(seq.error)
        if engine.prefix is not None:
            engine.prefix.clear()  # its pages are nobody's prompt

    def plan(self) -> tuple[PlanSummary, str]:
        serving = self._require_plan()
        return serving.summary, serving.plan.to_yaml()

    def _require_plan(self) -> _Serving:
        serving = self._serving
        if serving is None:
            raise NotReadyError(self._stopped or "no plan is loaded yet: call LoadPlan (or start the daemon with --plan)")
        return serving

    def _worker_exited(self, worker: EngineWorker) -> None:
        """A worker's engine thread ended. Where a fault ended the serving one, nothing serves
        until a plan loads again: health says NOT_SERVING, requests are refused saying why (its
        requests in flight have already failed)."""
        if worker.crashed is None:
            return
        if worker.device_lost:  # whichever plan it served: no plan can run on that GPU in this process
            self._lose_device(worker.crashed)
            return
        with self._lock:
            if self._serving is None or self._serving.worker is not worker or self.state != "serving":
                return
            self._serving = None
            self._stopped = f"the engine stopped ({worker.crashed}): LoadPlan to serve again"
            self._set_state("loading")
        log.error("the serving engine stopped: not serving until LoadPlan",
                  extra={"fields": {"worker": worker.name, "error": worker.crashed}})

    def _lose_device(self, why: str) -> None:
        """A GPU can run nothing more in this process: nothing serves, and the hook (serve's exit)
        runs once."""
        with self._lock:
            first = self.device_lost is None
            if first:
                self.device_lost = why
            if self._serving is not None and self.state == "serving":
                worker = self._serving.worker  # its requests fail on the dead GPU: it ends, and close joins it
                worker.retire()
                self._retired.append(worker)
                self._serving = None
                self._stopped = f"{why}: the daemon must restart"
                self._set_state("loading")
        if first:
            log.error("a GPU was lost: nothing serves until the daemon restarts", extra={"fields": {"error": why}})
            self.on_device_lost()

    # -- requests -------------------------------------------------------------------------
    def submit(self, spec: GenerateSpec, scope: bytes = b"") -> "RequestHandle":
        """Admit a request; iterate the handle for its events. Raises before admitting when the
        request is invalid, no plan is loaded, the queue is full or the daemon is draining.

        A request holds its admission slot until the engine is done with it, not until its
        client has read every token: a client that stops reading holds no slot (its tokens wait
        in its own queue, at most max_new_tokens of them)."""
        if self.state == "draining":
            raise ShuttingDownError("the daemon is shutting down: not accepting new requests")
        self._require_plan()
        spec.sampling.validate()
        spec.stop.validate()
        if spec.stop_strings and self.tokenizer is None:
            raise RequestError("stop_strings need the model's tokenizer.json, which this model lacks")
        if any(t >= self.config.vocab_size for t in spec.stop.stop_token_ids):
            raise RequestError(f"stop token ids must be in [0, {self.config.vocab_size})")
        prompt = self._prompt_ids(spec, scope)
        with self._lock:
            serving = self._require_plan()  # checked against the plan it is submitted to, even across a LoadPlan
            if len(prompt) + spec.stop.max_new_tokens > serving.context_tokens:
                raise RequestError(
                    f"prompt ({len(prompt)} tokens) + max_new_tokens ({spec.stop.max_new_tokens}) exceeds the "
                    f"plan's context of {serving.context_tokens} tokens")
            if self.state == "draining":
                raise ShuttingDownError("the daemon is shutting down: not accepting new requests")
            self._refuse_if_full(scope)
            request_id = spec.request_id or f"req-{uuid.uuid4().hex[:16]}"
            if (scope, request_id) in self._client_ids:  # a caller's own ids: another's are none of its business
                raise RequestError(f"request_id {request_id!r} is already in flight")
            key = f"{request_id}#{next(self._keys)}"  # the engine's id: unique even when a client reuses one
            events = serving.worker.submit(Submission(key, prompt, spec.sampling, spec.stop, scope))
            self._active[key] = serving.worker
            self._client_ids[scope, request_id] = key
            self._owners[key] = (scope, request_id)
            self._per_caller[scope] = self._per_caller.get(scope, 0) + 1
        return RequestHandle(self, serving, request_id, key, spec, len(prompt), events)

    def _refuse_if_full(self, scope: bytes) -> None:
        if len(self._active) >= self.max_batch + self.max_queue:
            raise OverloadedError(f"the daemon is full: {len(self._active)} requests in flight "
                                  f"(max batch {self.max_batch} + max queue {self.max_queue}); retry later")
        held = self._per_caller.get(scope, 0) if scope else 0
        if held >= self.max_per_caller:
            raise OverloadedError(f"this caller has {held} requests in flight, the most one caller may hold "
                                  f"(--max-requests-per-caller {self.max_per_caller}); retry when one ends")

    def _prompt_ids(self, spec: GenerateSpec, scope: bytes = b"") -> tuple[int, ...]:
        if spec.prompt_ids is not None:
            if not spec.prompt_ids:
                raise RequestError("token_ids is empty: give at least one token")
            return spec.prompt_ids
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer.json: send token_ids instead of text")
        limit = self.max_prompt_bytes
        if len(spec.prompt_text) > limit or len(spec.prompt_text.encode("utf-8")) > limit:  # before tokenizing
            raise RequestError(f"the prompt text is more than {limit} bytes ({MAX_PROMPT_BYTES_PER_TOKEN} per token "
                               f"of the {self.context_tokens}-token context)")
        self._refuse_if_full(scope)  # before tokenizing: a full daemon refuses at no cost (checked again on submit)
        ids = tuple(self.tokenizer.encode(spec.prompt_text, special_tokens=not spec.raw_text))
        if not ids:
            raise RequestError("the prompt text is empty: give some text")
        return ids

    def _release(self, key: str) -> None:
        """The engine is done with a request (or its client left): free its admission slot."""
        with self._lock:
            if self._active.pop(key, None) is not None:
                owner = self._owners.pop(key)
                scope = owner[0]
                if self._client_ids.get(owner) == key:
                    del self._client_ids[owner]
                if self._per_caller[scope] > 1:
                    self._per_caller[scope] -= 1
                else:
                    del self._per_caller[scope]
                self._lock.notify_all()

    # -- inspection -----------------------------------------------------------------------
    @property
    def context_tokens(self) -> int:
        """The longest sequence a request may grow to: the serving plan's context."""
        serving = self._serving
        return serving.context_tokens if serving is not None else self.config.max_position_embeddings

    @property
    def max_prompt_bytes(self) -> int:
        return self.context_tokens * MAX_PROMPT_BYTES_PER_TOKEN

    @property
    def in_flight(self) -> int:
        """Requests holding an admission slot (at most max_batch + max_queue)."""
        return len(self._active)

    def info(self) -> ServerInfo:
        with self._lock:
            serving = self._serving
            self._retired = [w for w in self._retired if w.alive]
            on_previous = sum(1 for w in self._active.values() if serving is None or w is not serving.worker)
        stages, waiting, running = (), 0, 0
        if serving is not None:
            snap = serving.worker.snapshot
            waiting, running = snap.waiting, snap.running
            stages = tuple(StageInfo(s.index, s.planned_device, s.device, s.unit_start, s.unit_end, s.backend,
                                     s.page_size_tokens, kv) for s, kv in zip(serving.stages, snap.kv))
        cfg = self.config
        return ServerInfo(
            state=self.state, architecture=cfg.architecture, model_dir=str(self.model_dir),
            dtype=str(cfg.dtype).removeprefix("torch."), num_layers=cfg.num_layers, vocab_size=cfg.vocab_size,
            context_tokens=serving.context_tokens if serving else cfg.max_position_embeddings,
            has_tokenizer=self.tokenizer is not None,
            plan=serving.summary if serving else None, stages=stages,
            kernel_isa=serving.kernel_isa if serving else "", waiting=waiting, running=running,
            max_batch=serving.max_running if serving else self.max_batch, max_queue=self.max_queue,
            on_previous_plans=on_previous,
            uptime_s=time.perf_counter() - self._started_s, version=__version__)

    def report(self, plan_digest: str = "") -> Report:
        if not plan_digest:
            plan_digest = self._require_plan().plan.digest
        recorder = self._recorders.get(plan_digest)
        if recorder is None:
            raise PlanNotFoundError(f"no measurements for plan {plan_digest}; the daemon keeps the last "
                                    f"{KEEP_REPORTS} plans: {', '.join(self._recorders) or 'none'}")
        return recorder.report()

    # -- shutdown -------------------------------------------------------------------------
    def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, let those in flight finish within `timeout_s`, then abort the
        rest (their streams end with finish reason "aborted"). True if nothing was aborted."""
        with self._lock:
            self._set_state("draining")
            log.info("draining", extra={"fields": {"in_flight": len(self._active), "timeout_s": timeout_s}})
            self._lock.wait_for(lambda: not self._active, timeout=timeout_s)
            leftover = dict(self._active)
        for key, worker in leftover.items():
            worker.abort(key)
        if leftover:
            log.warning("drain timed out; aborted requests", extra={"fields": {"aborted": sorted(leftover)}})
            with self._lock:
                self._lock.wait_for(lambda: not self._active, timeout=5.0)
        return not leftover

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every worker (after drain)."""
        with self._lock:
            workers = self._retired + ([self._serving.worker] if self._serving else [])
        for w in workers:
            w.retire()
        for w in workers:
            w.join(timeout_s)

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.on_state_change(state)


class RequestHandle:
    """One admitted request. Iterating it yields TokenChunk for every token, then one
    GenerationResult; it raises the request's error instead (before any token when the engine
    refuses the request). Text and stop strings are handled here, on the caller's thread."""

    EVENT_POLL_S = 1.0

    def __init__(self, daemon: Daemon, serving: _Serving, request_id: str, key: str, spec: GenerateSpec,
                 prompt_tokens: int, events: queue.SimpleQueue):
        self._daemon, self._serving = daemon, serving
        self.request_id = request_id  # the client's (or the one assigned)
        self._key = key  # the engine's
        self._spec = spec
        self._prompt_tokens = prompt_tokens
        self._events = events
        self._arrival_s = time.perf_counter()
        self._done = False
        self.tokens_sent = 0

    def cancel(self, why: str = "client cancelled or disconnected") -> None:
        """The client went away (cancel, disconnect, deadline): free the request's pages now."""
        if self._done:
            return
        self._done = True
        self._serving.worker.abort(self._key)
        self._daemon._release(self._key)
        log.info("request cancelled", extra={"fields": {"request_id": self.request_id, "why": why,
                                                        "tokens_sent": self.tokens_sent}})

    def __iter__(self):
        try:
            first = self._next()
            if isinstance(first, Rejected):
                raise first.error
            yield from self._stream(first)
        finally:
            self._done = True
            self._daemon._release(self._key)  # already released when the engine ended it

    def _next(self):
        while True:
            try:
                return self._events.get(timeout=self.EVENT_POLL_S)
            except queue.Empty:
                if not self._serving.worker.alive:
                    return Ended("error", "the engine thread has stopped", time.perf_counter())

    def _stream(self, event):
        text = TextStream(self._daemon.tokenizer, self._spec.stop_strings)
        timing = _StageTotals(len(self._serving.stages))
        first_s = last_s = None
        count = 0
        while True:
            if isinstance(event, Produced) and text.stopped_by is None:  # later tokens: abort in flight
                first_s = event.time_s if first_s is None else first_s
                last_s, count = event.time_s, count + 1
                timing.add(event.stage_ms)
                delta = text.push(event.token_id)
                if text.stopped_by is not None:
                    self._serving.worker.abort(self._key)
                yield TokenChunk(event.token_id, delta, event.index, event.time_s - self._arrival_s)
                self.tokens_sent += 1
            elif isinstance(event, Ended):
                if event.reason == "error":
                    log.error("request failed", extra={"fields": {"request_id": self.request_id, "error": event.error}})
                    raise RequestFailedError(f"request {self.request_id} failed: {event.error}")
                stopped = text.stopped_by is not None
                result = GenerationResult(
                    finish_reason="stop_string" if stopped else event.reason, stop_string=text.stopped_by or "",
                    prompt_tokens=self._prompt_tokens, completion_tokens=count,
                    cached_prompt_tokens=event.reused_tokens,
                    trailing_text="" if stopped else text.finish(),
                    ttft_s=(first_s - self._arrival_s) if first_s is not None else 0.0,
                    decode_tokens_per_s=(count - 1) / (last_s - first_s) if count > 1 and last_s > first_s else 0.0,
                    total_s=event.time_s - self._arrival_s,
                    stages=timing.result(self._serving.stages), plan=self._serving.summary)
                log.info("request finished", extra={"fields": {
                    "request_id": self.request_id, "finish_reason": result.finish_reason,
                    "prompt_tokens": self._prompt_tokens, "cached_prompt_tokens": event.reused_tokens,
                    "completion_tokens": count, "ttft_ms": round(result.ttft_s * 1e3, 3),
                    "decode_tokens_per_s": round(result.decode_tokens_per_s, 2)}})
                yield result
                return
            event = self._next()


class _StageTotals:
    """Sums of measured and predicted ms per stage over the steps that produced a request's tokens."""

    def __init__(self, stages: int):
        self.measured, self.predicted, self.steps = [0.0] * stages, [0.0] * stages, 0

    def add(self, stage_ms: tuple[tuple[float, float], ...]) -> None:
        if stage_ms:
            self.steps += 1
            for i, (m, p) in enumerate(stage_ms):
                self.measured[i] += m
                self.predicted[i] += p

    def result(self, stages: tuple[StageInfo, ...]) -> tuple[StageTiming, ...]:
        n = max(self.steps, 1)
        return tuple(StageTiming(i, s.planned_device, self.steps, self.measured[i] / n, self.predicted[i] / n)
                     for i, s in enumerate(stages))
