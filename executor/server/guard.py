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

import hmac
import ipaddress
import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("helm.guard")

CLIENT, ADMIN = "client", "admin"
_RANK = {CLIENT: 1, ADMIN: 2}
MIN_TOKEN_CHARS = 16
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


class CredentialError(ValueError):
    pass


@dataclass(frozen=True)
class Tokens:
    """Bearer tokens and their roles, from a file of `ROLE TOKEN` lines (`#` comments; several
    tokens per role, so one can be rotated while the other still works)."""
    by_role: tuple[tuple[str, str], ...]  # (token, role)

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokens":
        path = Path(path)
        try:
            info = path.stat()
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise CredentialError(f"cannot read the token file {path}: {getattr(e, 'strerror', None) or e}") from None
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("the token file is readable by other users: chmod 600 it",
                        extra={"fields": {"path": str(path)}})
        pairs = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or parts[0] not in _RANK:
                raise CredentialError(f"{path}:{n}: expected 'client TOKEN' or 'admin TOKEN'")
            if len(parts[1]) < MIN_TOKEN_CHARS:
                raise CredentialError(f"{path}:{n}: a token needs at least {MIN_TOKEN_CHARS} characters "
                                     "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
            if any(parts[1] == t for t, _ in pairs):
                raise CredentialError(f"{path}:{n}: the same token appears twice")
            pairs.append((parts[1], parts[0]))
        if not any(role == ADMIN for _, role in pairs):
            raise CredentialError(f"{path}: no admin token (LoadPlan and reports would be unreachable)")
        return cls(tuple(pairs))

    def role_of(self, token: str | None) -> str | None:
        if not token:
            return None
        found = None
        for known, role in self.by_role:  # compare with every token, in constant time each
            if hmac.compare_digest(known.encode(), token.encode()):
                found = role
        return found


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):].strip()
    return None


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
            if _RANK[role] < _RANK[required]:
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


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def server_credentials(cert: str, key: str, client_ca: str | None):
    """TLS credentials; with `client_ca`, clients must present a certificate it signed (mutual TLS)."""
    def read(path: str, what: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise CredentialError(f"cannot read the {what} {path}: {e.strerror}") from None

    root = read(client_ca, "client CA certificate") if client_ca else None
    return grpc.ssl_server_credentials([(read(key, "TLS key"), read(cert, "TLS certificate"))],
                                       root_certificates=root, require_client_auth=root is not None)


def client_token(path: str | None) -> str | None:
    """A client's token: the content of `path` (the token alone), else $HELM_TOKEN, else None."""
    if not path:
        return os.environ.get("HELM_TOKEN") or None
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CredentialError(f"cannot read the token file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not token or len(token.split()) != 1:
        raise CredentialError(f"the token file {path} must hold one token")
    return token
