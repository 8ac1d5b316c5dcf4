"""`--web.config.file`: TLS and basic auth for the exporter, the gate and the restarter, in
the format Prometheus exporters read (prometheus/exporter-toolkit):

```yaml
tls_server_config:
  cert_file: /etc/llm-health/tls.crt
  key_file: /etc/llm-health/tls.key
  client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (default), VerifyClientCertIfGiven
  client_ca_file: /etc/llm-health/ca.crt
  min_version: TLS12                             # TLS10 .. TLS13
  max_version: TLS13
http_server_config:
  headers: {Strict-Transport-Security: max-age=31536000}
basic_auth_users:                                # bcrypt hashes: htpasswd -nBC 10 "" | tr -d ':\n'
  prometheus: $2y$10$...
```

Keys this implementation cannot honour the way Go does (`cipher_suites`,
`curve_preferences`, `prefer_server_cipher_suites`, `http2`) are refused by name rather
than ignored: a TLS setting silently dropped is a weaker server than its operator thinks.
"""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError
from .fields import Section
from .load import load_yaml

CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
# exporter-toolkit's values that take a client certificate without verifying it: Python's
# ssl module cannot, so they are refused rather than silently made to verify.
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
NOT_SUPPORTED = ("cipher_suites", "curve_preferences", "prefer_server_cipher_suites")
# A whole bcrypt hash: prefix, cost 04 to 31, 22 characters of salt and 31 of hash. Anything
# else would make every check of that user's password fail with an error.
BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")


@dataclass(frozen=True)
class WebConfig:
    ssl_context: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict, repr=False)  # user -> bcrypt hash
    headers: dict[str, str] = field(default_factory=dict)
    source: str = "<none>"


def _readable(s: Section, key: str) -> str | None:
    path = s.string(key, None)
    if path is not None and not Path(path).is_file():
        raise s.error(key, f"cannot read {path}")
    return path


def parse_web_config(data: object, where: str) -> WebConfig:
    top = Section(data, where)
    tls = top.section("tls_server_config")
    context = None
    if tls.data:
        for key in NOT_SUPPORTED:
            if key in tls:
                raise tls.error(key, "not supported by llm-health's TLS server: remove it (Python's defaults apply)")
        cert, key_file = _readable(tls, "cert_file"), _readable(tls, "key_file")
        if cert is None or key_file is None:
            raise tls.error("cert_file" if cert is None else "key_file", "missing: TLS needs both cert_file and key_file")
        if tls.raw("client_auth_type") in UNVERIFIED_CLIENT_AUTH:
            raise tls.error(
                "client_auth_type",
                f"{tls.raw('client_auth_type')} (a client certificate taken unverified) is not supported: "
                "use VerifyClientCertIfGiven or RequireAndVerifyClientCert with client_ca_file",
            )
        auth = tls.choice("client_auth_type", tuple(CLIENT_AUTH), "NoClientCert")
        ca = _readable(tls, "client_ca_file")
        if auth in ("RequireAndVerifyClientCert", "VerifyClientCertIfGiven") and ca is None:
            raise tls.error("client_ca_file", f"missing: client_auth_type {auth} verifies client certificates against it")
        low = tls.choice("min_version", tuple(TLS_VERSIONS), "TLS12")
        high = tls.choice("max_version", tuple(TLS_VERSIONS), "TLS13")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version, context.maximum_version = TLS_VERSIONS[low], TLS_VERSIONS[high]
        try:
            context.load_cert_chain(cert, key_file)
            if ca is not None:
                context.load_verify_locations(ca)
        except (ssl.SSLError, OSError) as exc:
            raise tls.error("cert_file", f"cannot load the certificate, key or CA: {exc}") from None
        context.verify_mode = CLIENT_AUTH[auth]
        tls.done()
    http = top.section("http_server_config")
    if "http2" in http:
        raise http.error("http2", "not supported: llm-health serves HTTP/1.1")
    headers = {str(k): str(v) for k, v in http.mapping("headers").items()}
    http.done()
    users: dict[str, bytes] = {}
    for user, hashed in top.mapping("basic_auth_users").items():
        if not isinstance(hashed, str) or not BCRYPT_HASH.fullmatch(hashed):
            raise top.error(f"basic_auth_users.{user}", "expected a bcrypt hash ($2y$...), never a plain password")
        users[str(user)] = hashed.encode()
    if users:
        try:
            import bcrypt  # noqa: F401 - the `auth` extra
        except ImportError:
            raise top.error("basic_auth_users", "needs the bcrypt package: pip install 'llm-health[auth]'") from None
    top.done()
    return WebConfig(context, users, headers, where)


def load_web_config(path: str | os.PathLike[str] | None) -> WebConfig:
    """The web config of `--web.config.file`, or none (plain HTTP, no basic auth)."""
    if path is None:
        return WebConfig()
    data = load_yaml(path)
    if data is None:
        raise ConfigError(str(path), "(top level)", "empty: give tls_server_config and/or basic_auth_users")
    return parse_web_config(data, str(path))
