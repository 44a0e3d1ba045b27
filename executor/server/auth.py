"""Credentials, both sides: the daemon's bearer tokens and roles, its TLS credentials and the
loopback rule; a client's token, CA and certificate (`ClientAuth`, the flags every client
command takes). Light on purpose (grpc, no torch): `helm-plan recalibrate` uses it too."""
from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import select
import ssl
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from executor.errors import CredentialError
from planner.errors import PlanError
from planner.yamlio import read_text_file

log = logging.getLogger("helm.auth")

MAX_CREDENTIAL_BYTES = 1 << 20  # a token file, a PEM chain
PIPE_WAIT_S = 10.0  # a credential read from a pipe (`--token-file <(pass show helm)`) arrives within this


def read_credential(path: str | Path, what: str, pipes: bool = False) -> str:
    """A credential file's text, at most MAX_CREDENTIAL_BYTES, read without quoting it in any
    error: a regular file, or with `pipes` (a client's flags) also a pipe or a device, read until
    its end for at most PIPE_WAIT_S (a secret kept off the disk; a FIFO nobody writes to, or
    /dev/zero, is an error, not a hang)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise CredentialError(f"cannot read {what} {path}: {'no such file' if e.errno == errno.ENOENT else e.strerror}") \
            from None
    if pipes and (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        return _read_pipe(path, what)
    try:
        return read_text_file(path, what, MAX_CREDENTIAL_BYTES)
    except PlanError as e:
        raise CredentialError(str(e)) from None


def _read_pipe(path: Path, what: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise CredentialError(f"cannot read {what} {path}: {e.strerror}") from None
    data, deadline = b"", time.monotonic() + PIPE_WAIT_S
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CredentialError(f"cannot read {what} {path}: it did not end within {PIPE_WAIT_S:g} s")
            if not select.select([fd], [], [], left)[0]:
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_CREDENTIAL_BYTES:
                raise CredentialError(f"cannot read {what} {path}: more than {MAX_CREDENTIAL_BYTES} bytes")
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CredentialError(f"cannot read {what} {path}: not UTF-8 text") from None

CLIENT, ADMIN = "client", "admin"
RANK = {CLIENT: 1, ADMIN: 2}
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class Tokens:
    """Bearer tokens and their roles, from a file of `ROLE TOKEN` lines (`#` comments; several
    tokens per role, so one can be rotated while the other still works)."""
    by_role: tuple[tuple[str, str], ...]  # (token, role)

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokens":
        path = Path(path)
        text = read_credential(path, "the token file")
        try:
            info = path.stat()
        except OSError as e:
            raise CredentialError(f"cannot read the token file {path}: {e.strerror}") from None
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("the token file is readable by other users: chmod 600 it",
                        extra={"fields": {"path": str(path)}})
        pairs = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or parts[0] not in RANK:
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
        if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:].strip()
    return None


def caller_scope(context, tokens: bool) -> bytes:
    """Who is calling, by the credential the daemon checked: a digest of the bearer token where
    the daemon has tokens (the guard let the call in only with a known one); else of the client
    certificate's identities under mutual TLS, any token header ignored (nothing checked it);
    b"" for everyone on an open daemon. The kind of credential is part of the digest, so a token
    can never stand for a certificate of the same name."""
    if tokens:
        identity = b"token\0" + (bearer_token(context.invocation_metadata()) or "").encode()
    else:
        names = context.peer_identities() or ()
        identity = b"certificate\0" + b"\0".join(names) if names else b""
    return hashlib.blake2b(identity, digest_size=16, person=b"helm-scope").digest() if identity else b""


def peer_host(context) -> str:
    """The caller's address without its port ("ipv4:10.0.0.5:4242" → "ipv4:10.0.0.5")."""
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer



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
        return read_credential(path, f"the {what}").encode()

    root = read(client_ca, "client CA certificate") if client_ca else None
    key_pem, cert_pem = read(key, "TLS key"), read(cert, "TLS certificate")
    try:  # gRPC reports a key that does not match its certificate as "failed to bind"
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError) as e:
        raise CredentialError(f"--tls-cert {cert} and --tls-key {key} are not a certificate and its unencrypted key "
                              f"({getattr(e, 'reason', None) or e})") from None
    return grpc.ssl_server_credentials([(key_pem, cert_pem)],
                                       root_certificates=root, require_client_auth=root is not None)


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer TOKEN` to every call (works on plaintext loopback channels too,
    where gRPC refuses call credentials)."""

    def __init__(self, token: str):
        self._metadata = (("authorization", f"Bearer {token}"),)

    def _with_token(self, details):
        return _CallDetails(details, self._metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details, extra):
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
        self.metadata = tuple(details.metadata or ()) + extra


@dataclass(frozen=True)
class ClientAuth:
    """How a client proves itself to a daemon started with TLS or --tokens: the CA that signed the
    daemon's certificate (TLS), a client certificate and key (mutual TLS), a bearer token."""
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @staticmethod
    def add_args(parser) -> None:
        parser.add_argument("--token-file", metavar="FILE", help="file holding the bearer token (default: $HELM_TOKEN)")
        parser.add_argument("--tls-ca", metavar="PEM", help="connect over TLS, trusting this CA for the daemon")
        parser.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS, with --tls-key)")
        parser.add_argument("--tls-key", metavar="PEM", help="client private key (mutual TLS)")

    @classmethod
    def from_args(cls, args) -> "ClientAuth":
        """From the flags of `add_args`; CredentialError when they are inconsistent or unreadable."""
        if bool(args.tls_cert) != bool(args.tls_key):
            raise CredentialError("--tls-cert and --tls-key go together")
        if args.token_file:
            token = read_credential(args.token_file, "the token file", pipes=True).strip()
            if not token or len(token.split()) != 1:
                raise CredentialError(f"the token file {args.token_file} must hold one token")
        else:
            token = os.environ.get("HELM_TOKEN") or None
        for flag in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(args, flag)
            if path and not Path(path).is_file():
                raise CredentialError(f"--{flag.replace('_', '-')} {path}: no such file")
        return cls(token, args.tls_ca, args.tls_cert, args.tls_key)
