"""Test certificates, made in the test: a CA, a server certificate for localhost/127.0.0.1 and a
client certificate, all signed by the CA (EC P-256, valid for a day)."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _cert(subject: str, key, issuer: str, issuer_key, ca: bool, usage=None, sans=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certs(out: Path) -> Certs:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("helm test CA", ca_key, "helm test CA", ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _cert("localhost", server_key, "helm test CA", ca_key, ca=False, usage=ExtendedKeyUsageOID.SERVER_AUTH,
                   sans=(x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))))
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _cert("helm test client", client_key, "helm test CA", ca_key, ca=False,
                   usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    pem = serialization.Encoding.PEM
    (out / "ca.pem").write_bytes(ca.public_bytes(pem))
    (out / "server.pem").write_bytes(server.public_bytes(pem))
    (out / "client.pem").write_bytes(client.public_bytes(pem))
    return Certs(out / "ca.pem", out / "server.pem", _write_key(server_key, out / "server.key"),
                 out / "client.pem", _write_key(client_key, out / "client.key"))
