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
  Generate its own (`generate_streams`), health Watch and reflection another (`WATCH_STREAMS`,
  open to anyone, so it must not take the pool); the pool has `CONTROL_THREADS` more, so Info,
  health Check and LoadPlan answer while the lanes are full, and a stream beyond its lane is
  refused at once (RESOURCE_EXHAUSTED) instead of queueing behind the others.
"""
from __future__ import annotations

import logging
import threading

import grpc

from executor.server.auth import ADMIN, CLIENT, RANK, Tokens, bearer_token

log = logging.getLogger("helm.guard")

CONTROL_THREADS = 8  # threads beyond the lanes, for unary calls (Info, LoadPlan, health Check...)
WATCH_STREAMS = 8  # streams other than Generate (health Watch, reflection): each holds a thread

_SERVICE = "/helm.executor.v1.ExecutorService/"
GENERATE = _SERVICE + "Generate"
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

    def enter(self, context) -> None:
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.size} {self.what} are open, the most this daemon serves at once; retry later")

    def leave(self) -> None:
        self._slots.release()


class RpcGuard(grpc.ServerInterceptor):
    def __init__(self, tokens: Tokens | None, generate_streams: int):
        self.tokens = tokens
        self.generate = _Lane(generate_streams, "Generate streams")
        self.watches = _Lane(WATCH_STREAMS, "other streams (health Watch, reflection)")

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
        return self._checked(handler, method)

    def _checked(self, handler, method: str):
        """`handler` with safe decoding, and in a lane when it streams (a stream holds a thread)."""
        lane = self.generate if method == GENERATE else self.watches

        if handler.request_streaming:  # reflection: its messages are decoded one by one, as they come
            if handler.stream_stream is None:
                return handler  # client streaming: none in our services
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

        def refuse_undecodable(context) -> None:
            log.info("rpc refused", extra={"fields": {"rpc": method, "code": "INVALID_ARGUMENT",
                                                      "message": "undecodable request"}})
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "the request is not a valid message: malformed protobuf, or a string field that is "
                          "not valid UTF-8")

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary(request, context):
                if request is _UNDECODABLE:
                    refuse_undecodable(context)
                return inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, safe_decode, handler.response_serializer)

        inner = handler.unary_stream

        def stream(request, context):
            if request is _UNDECODABLE:
                refuse_undecodable(context)
            lane.enter(context)
            try:
                yield from inner(request, context)
            finally:
                lane.leave()

        return grpc.unary_stream_rpc_method_handler(stream, safe_decode, handler.response_serializer)


def _refusal(handler, method: str, code: grpc.StatusCode, message: str):
    """A handler of the same shape as `handler` that only refuses (the request is not decoded)."""

    def refuse(request, context):
        log.info("rpc refused", extra={"fields": {"rpc": method, "code": code.name, "peer": context.peer()}})
        context.abort(code, message)

    def refuse_stream(request, context):
        refuse(request, context)
        yield  # a generator, as a streaming handler must be

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    return grpc.unary_unary_rpc_method_handler(refuse)
