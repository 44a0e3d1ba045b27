"""What every RPC passes before the servicer sees it: a credential, a decodable request, and a
bounded number of open Generate streams.

- **Roles.** With a token file, every call but health checking carries `authorization: Bearer
  TOKEN`. A `client` token may Generate, Info and use reflection; an `admin` token may also
  LoadPlan, GetPlan and GetReport. A missing or unknown token is UNAUTHENTICATED, a client token on
  an admin call PERMISSION_DENIED. Health stays open: it tells one bit (serving or not), and load
  balancers' probes send no credentials.
- **Undecodable requests** (random bytes, a string field that is not UTF-8) are INVALID_ARGUMENT,
  not gRPC's INTERNAL "Exception deserializing request!" with an error-level traceback.
- **Lanes.** A stream holds a thread for as long as it is open, so streams get bounded lanes:
  Generate its own (`generate_streams`), health Watch (open to anyone) and reflection one each
  (`WATCH_STREAMS`); the pool has `CONTROL_THREADS` more, so Info, health Check and LoadPlan
  answer while the lanes are full, and a stream beyond its lane is refused at once
  (RESOURCE_EXHAUSTED) instead of queueing behind the others.
- **Request bodies.** gRPC reads a call's request on a pool thread; a client that opens calls
  and never sends the body would hold them all. Requests are read here, and a call whose body
  has not arrived within `BODY_TIMEOUT_S` is cancelled; refusals do not read the body at all,
  and the methods open to anyone (health) read theirs in a lane of `OPEN_READERS`, within
  `OPEN_BODY_TIMEOUT_S`. (A server on grpc.aio would read bodies without threads at all.)
"""
from __future__ import annotations

import logging
import threading
import time

import grpc

from executor.server.auth import ADMIN, CLIENT, RANK, Tokens, bearer_token

log = logging.getLogger("helm.guard")

CONTROL_THREADS = 8  # threads beyond the lanes, for unary calls (Info, LoadPlan, health Check...)
WATCH_STREAMS = 8  # health Watch streams (open to anyone), and as many reflection streams
BODY_TIMEOUT_S = 10.0  # from a call's start to its request message (a 1 MiB plan at 100 KB/s)
OPEN_READERS = 4  # requests of calls open to anyone (health) being read at once
OPEN_BODY_TIMEOUT_S = 2.0  # ... and how long each may take

_SERVICE = "/helm.executor.v1.ExecutorService/"
GENERATE = _SERVICE + "Generate"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
METHOD_ROLES = {  # the role a method needs; None: open to anyone; a method not listed needs CLIENT
    GENERATE: CLIENT,
    _SERVICE + "Info": CLIENT,
    _SERVICE + "LoadPlan": ADMIN,
    _SERVICE + "GetPlan": ADMIN,
    _SERVICE + "GetReport": ADMIN,
    "/grpc.health.v1.Health/Check": None,
    "/grpc.health.v1.Health/Watch": None,
}


class _Undecodable:
    """What a request deserializer returns instead of raising."""


_UNDECODABLE = _Undecodable()


class _Lane:
    """At most `size` calls of a kind at once; one more is refused at once (RESOURCE_EXHAUSTED)."""

    def __init__(self, size: int, what: str):
        self.size, self.what = size, what
        self._slots = threading.BoundedSemaphore(size)
        self.open = 0  # calls in the lane now

    def enter(self, context) -> None:
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.size} {self.what} are open, the most this daemon serves at once; retry later")
        self.open += 1

    def leave(self) -> None:
        self.open -= 1
        self._slots.release()


class _BodyDeadlines:
    """Cancels calls whose request message has not arrived `timeout_s` after they began: gRPC
    reads a request on a pool thread, so a client that opens calls and never sends their body
    would otherwise hold the pool's threads for as long as it likes."""

    def __init__(self):
        self._waiting: dict[object, float] = {}  # context → monotonic deadline
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="body-deadlines", daemon=True).start()

    def first_message(self, requests, context, timeout_s: float):
        """The call's one request message, waited for at most timeout_s; NO_MESSAGE when the
        client sent none, None when the call ended first (cut off here, or by the client)."""
        with self._lock:
            self._waiting[context] = time.monotonic() + timeout_s
        try:
            return next(requests, NO_MESSAGE)
        except Exception:  # noqa: BLE001 — the call was cancelled while we waited
            return None
        finally:
            with self._lock:
                self._waiting.pop(context, None)

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            with self._lock:  # cancel under the lock: a body that arrives meanwhile pops its entry first
                for context in [c for c, deadline in self._waiting.items() if deadline < now]:
                    del self._waiting[context]
                    log.debug("rpc cut off: its request did not arrive", extra={"fields": {"peer": context.peer()}})
                    context.cancel()


NO_MESSAGE = object()


class RpcGuard(grpc.ServerInterceptor):
    def __init__(self, tokens: Tokens | None, generate_streams: int, body_timeout_s: float = BODY_TIMEOUT_S):
        self.tokens = tokens
        self.generate = _Lane(generate_streams, "Generate streams")
        self.lanes = {"/grpc.health.v1.Health/Watch": _Lane(WATCH_STREAMS, "health Watch streams"),
                      REFLECTION: _Lane(WATCH_STREAMS, "reflection streams"), GENERATE: self.generate}
        # Methods open to anyone read their request in a small lane, with a short deadline: an
        # unauthenticated caller holds at most OPEN_READERS threads, each for OPEN_BODY_TIMEOUT_S.
        self.open_readers = _Lane(OPEN_READERS, "requests of unauthenticated calls being read")
        self.body_timeout_s = body_timeout_s
        self.bodies = _BodyDeadlines()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        required = METHOD_ROLES.get(method, CLIENT)
        if self.tokens is not None and required is not None:
            role = self.tokens.role_of(bearer_token(details.invocation_metadata))
            if role is None:
                return _refusal(handler, method, grpc.StatusCode.UNAUTHENTICATED,
                                "this daemon needs a token: send 'authorization: Bearer TOKEN' metadata")
            if RANK[role] < RANK[required]:
                return _refusal(handler, method, grpc.StatusCode.PERMISSION_DENIED,
                                f"{method.rsplit('/', 1)[-1]} needs an {required} token")
        return self._checked(handler, method, open_to_anyone=required is None)

    def _checked(self, handler, method: str, open_to_anyone: bool):
        """`handler` with its request read here (under a deadline, decoded safely) and, when it
        streams, in its lane (a stream holds a thread for as long as it is open)."""
        lane = self.lanes.get(method)

        if handler.request_streaming:  # reflection: its messages are decoded one by one, as they come
            if handler.stream_stream is None or lane is None:
                return handler  # client streaming, or a stream we do not know: none in our services
            duplex = handler.stream_stream

            def laned(requests, context):
                lane.enter(context)
                try:
                    yield from duplex(requests, context)
                finally:
                    lane.leave()

            return grpc.stream_stream_rpc_method_handler(laned, handler.request_deserializer,
                                                         handler.response_serializer)

        decode = handler.request_deserializer

        def safe_decode(data: bytes):
            try:
                return decode(data) if decode is not None else data
            except Exception:  # noqa: BLE001 — any decoding failure is the caller's bad bytes
                return _UNDECODABLE

        timeout_s = OPEN_BODY_TIMEOUT_S if open_to_anyone else self.body_timeout_s

        def read(requests, context):
            if not open_to_anyone:
                return self.bodies.first_message(requests, context, timeout_s)
            self.open_readers.enter(context)
            try:
                return self.bodies.first_message(requests, context, timeout_s)
            finally:
                self.open_readers.leave()

        def request_of(requests, context):
            request = read(requests, context)
            if request is NO_MESSAGE:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
            if request is None:  # the client is gone, or we cut it off: the status it sees is CANCELLED
                context.abort(grpc.StatusCode.CANCELLED, f"no request message arrived within {timeout_s:g} s")
            if request is _UNDECODABLE:
                log.info("rpc refused", extra={"fields": {"rpc": method, "code": "INVALID_ARGUMENT",
                                                          "message": "undecodable request"}})
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              "the request is not a valid message: malformed protobuf, or a string field that is "
                              "not valid UTF-8")
            return request

        # Registered as request-streaming (the wire format is the same) so that the request is read
        # here, under BODY_TIMEOUT_S, instead of by gRPC for as long as the client takes.
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary(requests, context):
                return inner(request_of(requests, context), context)

            return grpc.stream_unary_rpc_method_handler(unary, safe_decode, handler.response_serializer)

        inner_stream = handler.unary_stream

        def stream(requests, context):
            request = request_of(requests, context)
            if lane is None:
                yield from inner_stream(request, context)
                return
            lane.enter(context)
            try:
                yield from inner_stream(request, context)
            finally:
                lane.leave()

        return grpc.stream_stream_rpc_method_handler(stream, safe_decode, handler.response_serializer)


def _refusal(handler, method: str, code: grpc.StatusCode, message: str):
    """A handler that refuses without reading the request (registered as request-streaming: an
    unauthenticated caller cannot hold a thread by sending its request slowly)."""

    def refuse(requests, context):
        log.info("rpc refused", extra={"fields": {"rpc": method, "code": code.name, "peer": context.peer()}})
        context.abort(code, message)

    def refuse_stream(requests, context):
        refuse(requests, context)
        yield  # a generator, as a streaming handler must be

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    return grpc.stream_unary_rpc_method_handler(refuse)
