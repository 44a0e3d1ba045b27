"""What every RPC passes before the servicer sees it: a credential, a decodable request, and a
lane: a bounded number of calls of its kind at once.

- **Roles.** With a token file, every call but health checking carries `authorization: Bearer
  TOKEN`. A `client` token may Generate, Info and use reflection; an `admin` token may also
  LoadPlan, GetPlan and GetReport. A missing or unknown token is UNAUTHENTICATED, a client token on
  an admin call PERMISSION_DENIED. Health stays open: it tells one bit (serving or not), and load
  balancers' probes send no credentials.
- **Undecodable requests** (random bytes, a string field that is not UTF-8) are INVALID_ARGUMENT,
  not gRPC's INTERNAL "Exception deserializing request!" with an error-level traceback.
- **Lanes.** gRPC runs each call on a thread of one pool, from its start, while it waits for its
  request message, to its end; a stream holds its thread for as long as it is open. So every
  call runs in a lane for its whole life, the lanes together are the pool (`pool_threads`), and
  a call beyond its lane is refused at once (RESOURCE_EXHAUSTED) instead of queueing for a
  thread: Generate streams (`generate_streams`); health Watch and reflection streams
  (`WATCH_STREAMS` each); unary calls of admin callers (`ADMIN_CALLS`: LoadPlan, GetPlan,
  GetReport, and their Info) apart from those of client callers (`CLIENT_CALLS`), so a client
  flooding Info cannot hold LoadPlan off; and health Check (`OPEN_READERS`). A Check beyond its
  lane is not refused: it is answered from the daemon's overall status without its request
  being read, on one of `SPARE_THREADS` threads kept for what takes no time (refusals too). So
  anyone may flood health with calls whose request never comes, and a probe is still answered.
- **Shares.** One caller holds at most its share of a lane (`_Lane.per_caller`): half of
  Watch's and reflection's; where serve holds callers to a share of the admission slots (the
  daemon's `max_per_caller`, daemon.caller_share), twice that of Generate streams and half of
  the client calls' lane. A caller is the credential checked (auth.caller_scope), or the address
  for what anyone may open; without credentials Generate and unary calls are one trust domain,
  held to the lane only.
- **Request bodies.** A call whose request has not arrived within `BODY_TIMEOUT_S` is cancelled
  (`OPEN_BODY_TIMEOUT_S` for health, open to anyone); refusals do not read the request at all.
  (A server on grpc.aio would read requests without holding threads at all.)
- **Refusals are logged** at most `REFUSALS_LOGGED` a minute, then counted: a flood of
  unauthenticated calls cannot fill the log.
"""
from __future__ import annotations

import logging
import threading
import time

import grpc

from executor.server.auth import ADMIN, CLIENT, RANK, Tokens, bearer_token, caller_scope, peer_host

log = logging.getLogger("helm.guard")

CLIENT_CALLS = 6  # unary calls (Info...) of client callers at once, request read to answer
ADMIN_CALLS = 4  # ... of admin callers (LoadPlan, GetPlan, GetReport, Info)
WATCH_STREAMS = 8  # health Watch streams (open to anyone), and as many reflection streams
OPEN_READERS = 4  # health Check calls at once whose request is read (one more: the overall status)
SPARE_THREADS = 2  # beyond the lanes: refusals and health answers, which wait for nothing
BODY_TIMEOUT_S = 10.0  # from a call's start to its request message (a 1 MiB plan at 100 KB/s)
OPEN_BODY_TIMEOUT_S = 2.0  # ... for health, open to anyone
REFUSALS_LOGGED = 60  # refused calls logged a minute; the rest counted in the next minute's line

_SERVICE = "/helm.executor.v1.ExecutorService/"
GENERATE = _SERVICE + "Generate"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
METHOD_ROLES = {  # the role a method needs; None: open to anyone; a method not listed needs CLIENT
    GENERATE: CLIENT,
    _SERVICE + "Info": CLIENT,
    _SERVICE + "LoadPlan": ADMIN,
    _SERVICE + "GetPlan": ADMIN,
    _SERVICE + "GetReport": ADMIN,
    HEALTH_CHECK: None,
    HEALTH_WATCH: None,
}


def pool_threads(generate_streams: int) -> int:
    """The gRPC pool's threads: every lane's calls, and the spare ones."""
    return generate_streams + 2 * WATCH_STREAMS + OPEN_READERS + CLIENT_CALLS + ADMIN_CALLS + SPARE_THREADS


class _Undecodable:
    """What a request deserializer returns instead of raising."""


_UNDECODABLE = _Undecodable()


class _Lane:
    """At most `size` calls of a kind at once, and at most `per_caller` of them from one caller;
    one more is refused at once (RESOURCE_EXHAUSTED). `open`: calls in the lane now; `serving`:
    those of them whose request has arrived."""

    def __init__(self, size: int, what: str, per_caller: int | None = None):
        self.size, self.what, self.per_caller = size, what, per_caller or size
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._held: dict[object, int] = {}  # caller → its calls in the lane
        self.open = self.serving = 0

    def try_enter(self, caller=None) -> str | None:
        """Take a place for a call of `caller` (None: one no caller's share limits); None if
        taken, else why not."""
        if not self._slots.acquire(blocking=False):
            return f"{self.size} {self.what} are open, the most this daemon serves at once; retry later"
        with self._lock:
            held = self._held.get(caller, 0) if caller is not None else 0
            if held >= self.per_caller:
                self._slots.release()
                return (f"this caller has {held} {self.what} open, the most one caller may hold of the "
                        f"daemon's {self.size}; retry when one ends")
            if caller is not None:
                self._held[caller] = held + 1
            self.open += 1
        return None

    def enter(self, context, caller=None) -> None:
        refused = self.try_enter(caller)
        if refused is not None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)

    def count_serving(self, delta: int) -> None:
        with self._lock:
            self.serving += delta

    def leave(self, caller=None) -> None:
        """Give back a place taken by try_enter(caller) (the same caller)."""
        try:
            with self._lock:
                self.open -= 1
                held = self._held.get(caller, 0) if caller is not None else 0
                if held > 1:
                    self._held[caller] = held - 1
                elif held == 1:
                    del self._held[caller]
                elif caller is not None:
                    log.error("a lane place given back for a caller that held none", extra={"fields": {"lane": self.what}})
        finally:
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


class _RefusalLog:
    """Refused calls, logged at most `per_minute` a minute; those beyond are counted and the count
    logged with the first refusal of a later minute."""

    def __init__(self, per_minute: int = REFUSALS_LOGGED):
        self.per_minute = per_minute
        self._lock = threading.Lock()
        self._minute = 0
        self._logged = self._dropped = 0

    def __call__(self, fields: dict) -> None:
        minute = int(time.monotonic() // 60)
        with self._lock:
            if minute != self._minute:
                self._minute, self._logged = minute, 0
            if self._logged >= self.per_minute:
                self._dropped += 1
                return
            self._logged += 1
            dropped, self._dropped = self._dropped, 0
        if dropped:
            fields = {**fields, "not_logged_before": dropped}
        log.info("rpc refused", extra={"fields": fields})


class RpcGuard(grpc.ServerInterceptor):
    def __init__(self, tokens: Tokens | None, generate_streams: int, body_timeout_s: float = BODY_TIMEOUT_S,
                 generate_per_caller: int | None = None, client_shares: bool = False):
        self.tokens = tokens
        self.generate = _Lane(generate_streams, "Generate streams", generate_per_caller)
        self.lanes = {HEALTH_WATCH: _Lane(WATCH_STREAMS, "health Watch streams", WATCH_STREAMS // 2),
                      REFLECTION: _Lane(WATCH_STREAMS, "reflection streams", WATCH_STREAMS // 2),
                      GENERATE: self.generate, HEALTH_CHECK: _Lane(OPEN_READERS, "health checks being read")}
        self.client_calls = _Lane(CLIENT_CALLS, "calls of client callers", CLIENT_CALLS // 2 if client_shares else None)
        self.admin_calls = _Lane(ADMIN_CALLS, "calls of admin callers")
        self.body_timeout_s = body_timeout_s
        self.bodies = _BodyDeadlines()
        self.refused = _RefusalLog()
        # The daemon's overall health (a grpc.health.v1 ServingStatus), set by whoever serves it:
        # the answer to a Check beyond its lane. None: no answer yet, such a Check is refused.
        self.health_status: int | None = None

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        required = METHOD_ROLES.get(method, CLIENT)
        role = None
        if self.tokens is not None and required is not None:
            role = self.tokens.role_of(bearer_token(details.invocation_metadata))
            if role is None:
                return self._refusal(handler, method, grpc.StatusCode.UNAUTHENTICATED,
                                     "this daemon needs a token: send 'authorization: Bearer TOKEN' metadata")
            if RANK[role] < RANK[required]:
                return self._refusal(handler, method, grpc.StatusCode.PERMISSION_DENIED,
                                     f"{method.rsplit('/', 1)[-1]} needs an {required} token")
        lane = self.lanes.get(method)
        if lane is None:  # a unary call: by its caller's role (without tokens, by what it needs)
            lane = self.admin_calls if (role or required) == ADMIN else self.client_calls
        return self._checked(handler, method, lane, open_to_anyone=required is None)

    def _caller(self, context, lane: _Lane, open_to_anyone: bool):
        """Whose share of `lane` a call takes: its checked credential (auth.caller_scope); by
        address where there is none to check, for the streams anyone may open (health Watch) and
        reflection on a daemon without credentials; None (no share) for Generate and unary calls
        on such a daemon, one trust domain."""
        if lane.per_caller >= lane.size:
            return None
        scope = b"" if open_to_anyone else caller_scope(context, self.tokens is not None)
        if scope:
            return scope
        return peer_host(context) if open_to_anyone or lane is self.lanes[REFLECTION] else None

    def _checked(self, handler, method: str, lane: _Lane, open_to_anyone: bool):
        """`handler` run in its lane from its start, with its request read here (under a deadline,
        decoded safely)."""
        if handler.request_streaming:  # reflection: its messages are decoded one by one, as they come
            if handler.stream_stream is None or method not in self.lanes:
                return handler  # client streaming, or a stream we do not know: none in our services
            duplex = handler.stream_stream

            def laned(requests, context):
                caller = self._caller(context, lane, open_to_anyone)
                lane.enter(context, caller)
                try:
                    yield from duplex(requests, context)
                finally:
                    lane.leave(caller)

            return grpc.stream_stream_rpc_method_handler(laned, handler.request_deserializer,
                                                         handler.response_serializer)

        decode = handler.request_deserializer

        def safe_decode(data: bytes):
            try:
                return decode(data) if decode is not None else data
            except Exception:  # noqa: BLE001 — any decoding failure is the caller's bad bytes
                return _UNDECODABLE

        timeout_s = OPEN_BODY_TIMEOUT_S if open_to_anyone else self.body_timeout_s

        def request_of(requests, context):
            request = self.bodies.first_message(requests, context, timeout_s)
            if request is NO_MESSAGE:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
            if request is None:  # the client is gone, or we cut it off: the status it sees is CANCELLED
                context.abort(grpc.StatusCode.CANCELLED, f"no request message arrived within {timeout_s:g} s")
            if request is _UNDECODABLE:
                self.refused({"rpc": method, "code": "INVALID_ARGUMENT", "message": "undecodable request",
                              "peer": context.peer()})
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              "the request is not a valid message: malformed protobuf, or a string field that is "
                              "not valid UTF-8")
            return request

        # Registered as request-streaming (the wire format is the same) so that the request is read
        # here, under a deadline and in the call's lane, instead of by gRPC for as long as the
        # client takes.
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary(requests, context):
                caller = self._caller(context, lane, open_to_anyone)
                refused = lane.try_enter(caller)
                if refused is not None:
                    if method == HEALTH_CHECK and self.health_status is not None:
                        return self._overall_health()
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
                try:
                    return inner(request_of(requests, context), context)
                finally:
                    lane.leave(caller)

            return grpc.stream_unary_rpc_method_handler(unary, safe_decode, handler.response_serializer)

        inner_stream = handler.unary_stream

        def stream(requests, context):
            caller = self._caller(context, lane, open_to_anyone)
            lane.enter(context, caller)
            try:
                request = request_of(requests, context)
                lane.count_serving(1)  # a drain waits for these, not for calls whose request never came
                try:
                    yield from inner_stream(request, context)
                finally:
                    lane.count_serving(-1)
            finally:
                lane.leave(caller)

        return grpc.stream_stream_rpc_method_handler(stream, safe_decode, handler.response_serializer)

    def _overall_health(self):
        from grpc_health.v1 import health_pb2

        return health_pb2.HealthCheckResponse(status=self.health_status)

    def _refusal(self, handler, method: str, code: grpc.StatusCode, message: str):
        """A handler that refuses without reading the request (registered as request-streaming: an
        unauthenticated caller cannot hold a thread by sending its request slowly)."""

        def refuse(requests, context):
            self.refused({"rpc": method, "code": code.name, "peer": context.peer()})
            context.abort(code, message)

        def refuse_stream(requests, context):
            refuse(requests, context)
            yield  # a generator, as a streaming handler must be

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse_stream)
        return grpc.stream_unary_rpc_method_handler(refuse)
