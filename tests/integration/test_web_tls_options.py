"""docs/limits.md, "TLS and basic auth": `tls_server_config` takes `client_auth_type`,
`client_ca_file`, `min_version` and `max_version`, as exporter-toolkit does. On a real
`llm-health serve` (the three servers share this code, llm_health.config.web), with a CA,
a client certificate it signed and a server certificate all made in the test:

* `RequireAndVerifyClientCert` with `client_ca_file`: no client certificate, or one the CA
  did not sign, and the TLS connection is refused; the CA's client certificate gets a 200;
* `min_version: TLS13`: a client capped at TLS 1.2 is refused, with that same certificate;
* `max_version: TLS12`: a client that asks for TLS 1.3 at least is refused; one that
  allows both speaks TLS 1.2.
"""

from __future__ import annotations

import json
import socket
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.fixtures.websec import DEADLINE, certificate, exporter_config, key_usage, self_signed, trusting, web_config, write_pem


def make_ca(directory: Path, name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"llm-health test CA {name}")])
    cert = (
        certificate(subject, subject, key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    path = directory / f"ca-{name}.crt"
    write_pem(cert, path)
    return cert, key, path


def client_cert(directory: Path, name: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
    """A client certificate (clientAuth) signed by `ca`, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"llm-health test client {name}")]), ca.subject, key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"client-{name}.crt", directory / f"client-{name}.key"
    write_pem(cert, cert_path, key, key_path)
    return cert_path, key_path


def client(server_cert: Path, cert: tuple[Path, Path] | None = None, low: ssl.TLSVersion | None = None, high: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    context = trusting(server_cert)
    if cert is not None:
        context.load_cert_chain(*cert)
    if low is not None:
        context.minimum_version = low
    if high is not None:
        context.maximum_version = high
    return context


def get_metrics(port: int, context: ssl.SSLContext) -> tuple[str | None, bytes]:
    """GET /metrics over TLS: (the TLS version spoken, the first bytes of the answer), or
    (None, b"") when the handshake or the connection after it was refused."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as raw, context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return s.version(), s.recv(64)  # a refused client certificate ends TLS 1.3 here, after the client's handshake
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        return None, b""


def refused(answer: tuple[str | None, bytes]) -> bool:
    return not answer[1].startswith(b"HTTP/")


def test_client_certificates_verified_against_client_ca_file_and_min_version(tmp_path, llm_health):
    server_cert, server_key = self_signed(tmp_path)
    ca, ca_key, ca_file = make_ca(tmp_path, "clients")
    signed = client_cert(tmp_path, "signed", ca, ca_key)
    other_ca, other_key, _ = make_ca(tmp_path, "other")
    stranger = client_cert(tmp_path, "stranger", other_ca, other_key)
    tls = ("client_auth_type: RequireAndVerifyClientCert", f"client_ca_file: {json.dumps(str(ca_file))}", "min_version: TLS13")
    path = web_config(tmp_path / "web.yml", server_cert, server_key, {}, tls_extra=tls)
    cfg = exporter_config(tmp_path / "exporter.yml", ["gpu0"])
    good = client(server_cert, signed)
    proc = llm_health("serve", "--config.file", cfg, "--web.config.file", path, scheme="https").wait_ready(context=good)

    version, answer = get_metrics(proc.port, good)
    assert (version, answer[:12]) == ("TLSv1.3", b"HTTP/1.1 200"), answer
    assert refused(get_metrics(proc.port, client(server_cert)))  # no client certificate
    assert refused(get_metrics(proc.port, client(server_cert, stranger)))  # one the CA did not sign
    assert refused(get_metrics(proc.port, client(server_cert, signed, high=ssl.TLSVersion.TLSv1_2)))  # below min_version
    assert get_metrics(proc.port, good)[1][:12] == b"HTTP/1.1 200"  # and the server still serves


def test_max_version_caps_the_tls_version(tmp_path, llm_health):
    server_cert, server_key = self_signed(tmp_path)
    path = web_config(tmp_path / "web.yml", server_cert, server_key, {}, tls_extra=("min_version: TLS12", "max_version: TLS12"))
    cfg = exporter_config(tmp_path / "exporter.yml", ["gpu0"])
    both = client(server_cert, low=ssl.TLSVersion.TLSv1_2, high=ssl.TLSVersion.TLSv1_3)
    proc = llm_health("serve", "--config.file", cfg, "--web.config.file", path, scheme="https").wait_ready(context=both)
    version, answer = get_metrics(proc.port, both)
    assert (version, answer[:12]) == ("TLSv1.2", b"HTTP/1.1 200"), answer
    assert refused(get_metrics(proc.port, client(server_cert, low=ssl.TLSVersion.TLSv1_3)))
