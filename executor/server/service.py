"""The gRPC servicer of helm.executor.v1.ExecutorService.

It only converts: protobuf in → domain objects → `Daemon` → domain objects → protobuf out, and
maps the daemon's errors to status codes (`status_for`). Any other exception becomes INTERNAL
with its message, so a request never crashes the daemon or leaves a stream hanging. Generate
streams are watched for clients that stopped reading (`StallWatch`) and counted in the metrics.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import PurePath

import grpc

from executor.errors import (ConfigError, DeviceLostError, HelmError, LoadInProgressError, NotReadyError,
                             OverloadedError, PlacementError, PlanNotFoundError, RequestError, RequestFailedError,
                             ShuttingDownError, WeightsError)
from executor.pb import executor_pb2 as pb
from executor.pb import executor_pb2_grpc as pb_grpc
from executor.server.auth import CLIENT, Tokens, bearer_token, caller_scope
from executor.server.daemon import Daemon
from executor.server.messages import GenerateSpec, PlanSource, finish_reason_name
from executor.server.metrics import DaemonMetrics

log = logging.getLogger("helm.service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExecutorService"].full_name

_STATUS = (  # the first matching class wins: subclasses before their bases
    (PlanNotFoundError, grpc.StatusCode.NOT_FOUND),
    (NotReadyError, grpc.StatusCode.FAILED_PRECONDITION),
    (LoadInProgressError, grpc.StatusCode.ABORTED),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (DeviceLostError, grpc.StatusCode.UNAVAILABLE),     # the daemon exits; a restarted one serves
    (RequestFailedError, grpc.StatusCode.INTERNAL),
    (RequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (PlacementError, grpc.StatusCode.INVALID_ARGUMENT),   # a bad plan (the message names the field)
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),   # the daemon's checkpoint is broken
    (WeightsError, grpc.StatusCode.FAILED_PRECONDITION),
    (HelmError, grpc.StatusCode.INVALID_ARGUMENT),
    (MemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def status_for(error: BaseException) -> grpc.StatusCode:
    return next((code for cls, code in _STATUS if isinstance(error, cls)), grpc.StatusCode.INTERNAL)


MAX_MESSAGE_CHARS = 1024  # a status message never carries an unbounded value back (or into the log)


def _abort(context, method: str, error: Exception):
    code = status_for(error)
    message = str(error) if isinstance(error, (HelmError, MemoryError)) else f"{type(error).__name__}: {error}"
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS - 1] + "…"
    fields = {"rpc": method, "code": code.name, "message": message}
    if code == grpc.StatusCode.INTERNAL:
        log.error("rpc failed", extra={"fields": fields}, exc_info=not isinstance(error, HelmError))
    else:
        log.info("rpc refused", extra={"fields": fields})
    context.abort(code, message)


def _unary(method):
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as e:  # noqa: BLE001 — every failure becomes a status
            _abort(context, method.__name__, e)
    return wrapper


def _file_name(path: str) -> str:
    """What a client token is told of a server path: its last part ("inline" stays)."""
    return PurePath(path).name or path


def _past_deadline(context) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


class ExecutorServicer(pb_grpc.ExecutorServiceServicer):
    """`tokens`: the daemon's (None: it has none). A request's caller is the credential the guard
    checked (auth.caller_scope): its admission share, its request ids and the prompt prefixes it
    may reuse (a shorter TTFT would tell one caller that another sent the same prompt) are its
    own. A client token is told file names, not the server's paths."""

    def __init__(self, daemon: Daemon, stall_timeout_s: float = 30.0, metrics: DaemonMetrics | None = None,
                 tokens: Tokens | None = None):
        self.daemon = daemon
        self.stalls = StallWatch(stall_timeout_s)
        self.metrics = metrics
        self.tokens = tokens

    def _a_client(self, context) -> bool:
        return self.tokens is not None and self.tokens.role_of(bearer_token(context.invocation_metadata())) == CLIENT

    def Generate(self, request, context):
        outcome = "error"
        try:
            for message in self._generate(request, context):
                if message.HasField("result"):
                    r = message.result
                    outcome = finish_reason_name(r.finish_reason, pb)
                    if self.metrics:
                        self.metrics.request_finished(outcome, r.ttft_ns / 1e9, r.decode_tokens_per_s,
                                                      r.completion_tokens, r.prompt_tokens, r.cached_prompt_tokens)
                yield message
        except GeneratorExit:  # gRPC stopped pulling: the client left or was cut off
            if self.metrics and outcome == "error":
                self.metrics.request_ended("cancelled", "DEADLINE_EXCEEDED" if _past_deadline(context) else "CANCELLED")
            raise
        except Exception as e:  # noqa: BLE001 — every failure becomes a status
            if self.metrics:
                self.metrics.request_ended("refused" if status_for(e) != grpc.StatusCode.INTERNAL else "failed",
                                           status_for(e).name)
            _abort(context, "Generate", e)

    def _generate(self, request, context):
        handle = self.daemon.submit(GenerateSpec.from_pb(request), caller_scope(context, self.tokens is not None))
        client = self._a_client(context)
        sending = self.stalls.watch(context, handle.request_id)

        def on_end():  # the RPC is over: a no-op if the request ended; else the client went away
            if sending.cut_off:
                why = "stalled"
            elif _past_deadline(context):
                why = "deadline exceeded"
            else:
                why = "client cancelled or disconnected"
            handle.cancel(why)

        if not context.add_callback(on_end):  # already over: the client left before we started
            on_end()
        try:
            for event in handle:
                sending.begin()
                message = event.to_pb(pb, handle.request_id)
                if client and message.HasField("result"):
                    message.result.plan.source = _file_name(message.result.plan.source)
                yield message  # returns once gRPC has sent it
                sending.end()
        finally:
            self.stalls.forget(sending)

    @_unary
    def LoadPlan(self, request, context):
        return self.daemon.load_plan(PlanSource.from_pb(request)).to_pb(pb)

    @_unary
    def GetPlan(self, request, context):
        summary, text = self.daemon.plan()
        return pb.GetPlanResponse(plan=summary.to_pb(pb), yaml=text)

    @_unary
    def Info(self, request, context):
        info = self.daemon.info().to_pb(pb)
        if self._a_client(context):
            info.model.directory = _file_name(info.model.directory)
            if info.HasField("plan"):
                info.plan.source = _file_name(info.plan.source)
        return info

    @_unary
    def GetReport(self, request, context):
        return self.daemon.report(request.plan_digest).to_pb(pb)


class _Sending:
    def __init__(self, context, request_id: str):
        self.context, self.request_id = context, request_id
        self.since: float | None = None  # when the message now being sent was handed to gRPC
        self.cut_off = False

    def begin(self) -> None:
        self.since = time.monotonic()

    def end(self) -> None:
        self.since = None


class StallWatch:
    """Cuts off Generate streams whose client stopped reading: a send that has not completed
    for `timeout_s` (HTTP/2 flow control holds it once the client's window is full) cancels the
    RPC, which frees its thread and its Generate lane place. The engine freed the request's
    admission slot as soon as it finished; this frees the rest."""

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"the stall timeout must be > 0 s, got {timeout_s}")
        self.timeout_s = timeout_s
        self._open: set[_Sending] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        self._thread.start()

    def watch(self, context, request_id: str) -> _Sending:
        sending = _Sending(context, request_id)
        with self._lock:
            self._open.add(sending)
        return sending

    def forget(self, sending: _Sending) -> None:
        with self._lock:
            self._open.discard(sending)

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            try:
                self._cut_off_stalled()
            except Exception:  # noqa: BLE001 — the watch must outlive any one stream's surprise
                log.exception("stall watch: checking the open streams failed")

    def _cut_off_stalled(self) -> None:
        now = time.monotonic()
        with self._lock:  # `since` is read once: the send may complete (since = None) meanwhile
            stalled = [(s, now - since) for s in self._open
                       for since in (s.since,) if since is not None and now - since > self.timeout_s]
        for s, stalled_s in stalled:
            if s.cut_off:
                continue
            s.cut_off = True
            log.warning("client stopped reading: stream cut off", extra={"fields": {
                "request_id": s.request_id, "stalled_s": round(stalled_s, 1)}})
            s.context.cancel()
