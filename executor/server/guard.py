"""What every RPC passes before the servicer sees it: a credential, a decodable request, and a
bounded number of open Generate streams.

- **Roles.** With a token file, every call but health checking carries `authorization: Bearer
  TOKEN`. A `client` token may Generate, Info and use reflection; an `admin` token may also
  LoadPlan, GetPlan and GetReport. A missing or unknown token is UNAUTHENTICATED, a client token on
  an admin call PERMISSION_DENIED. Health stays open: it tells one bit (serving or not), and load
  balancers' probes send no credentials.
- **Undecodable requests** (random bytes, a string field that is not UTF-8) are INVALID_ARGUMENT,
  not gRPC's INTERNAL "Exception deserializing request!" with an error-level traceback.
- **Two lanes.** Generate streams hold a thread each for as long as they send, so they get their
  own bounded lane (`generate_streams`); the pool has `CONTROL_THREADS` more, so Info, health and
  LoadPlan answer while generation is saturated, and a Generate beyond the lane is refused at
  once (RESOURCE_EXHAUSTED) instead of queueing behind the streams.
"""
from __future__ import annotations

import logging
import threading

import grpc

from executor.server.auth import ADMIN, CLIENT, RANK, Tokens, bearer_token

log = logging.getLogger("helm.guard")

CONTROL_THREADS = 8  # threads beyond the Generate lane, for every other call

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


class RpcGuard(grpc.ServerInterceptor):
    def __init__(self, tokens: Tokens | None, generate_streams: int):
        self.tokens = tokens
        self.generate_streams = generate_streams
        self._generate_lane = threading.BoundedSemaphore(generate_streams)

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
        if handler.request_streaming:  # reflection: its messages are decoded one by one, as they come
            return handler
        decode = handler.request_deserializer
        lane = self._generate_lane if method == GENERATE else None

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
            if lane is not None and not lane.acquire(blocking=False):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{self.generate_streams} Generate streams are open, the most this daemon sends at "
                              "once; retry later")
            try:
                yield from inner(request, context)
            finally:
                if lane is not None:
                    lane.release()

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
