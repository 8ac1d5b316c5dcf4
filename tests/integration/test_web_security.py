"""`--web.config.file` on real processes: `llm-health serve`, `gate` and `restarter` serve
TLS with a certificate made in the test and check bcrypt basic auth users; `/-/healthy`,
`/-/live` and `/-/ready` stay open; the restarter's bearer token still opens `/alerts` and
`/status`; a bad web config stops the server at start, naming the file and the field
(docs/exporter.md, "Flags"; docs/limits.md, "TLS and basic auth")."""

from __future__ import annotations

import ssl

import aiohttp
import pytest
from aiohttp import web

from llm_health.sim.servers import dead_url
from tests.fixtures.websec import (
    ADMIN_TOKEN,
    RESTARTER_ENV,
    TOKEN,
    Answer,
    bcrypt_hash,
    call,
    exporter_config,
    gate_config,
    plain_http_answer,
    restarter_config,
    self_signed,
    trusting,
    web_config,
)

USER, PASSWORD = "prometheus", "s3cret-scrape"
WRONG = [(USER, "not-the-password"), ("nobody", PASSWORD), (USER, PASSWORD + "x" * 80)]  # the last: over bcrypt's 72 bytes
HEADERS = "http_server_config:\n  headers: {X-Test-Header: from-web-config}\n"
WEBHOOK = {
    "version": "4",
    "status": "firing",
    "receiver": "llm-health",
    "alerts": [{"status": "firing", "labels": {"alertname": "NotOurs"}, "startsAt": "2026-01-01T00:00:00Z"}],
}
OK = {"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}


def secure_web_config(tmp_path) -> tuple[str, ssl.SSLContext]:
    cert, key = self_signed(tmp_path)
    return web_config(tmp_path / "web.yml", cert, key, {USER: bcrypt_hash(PASSWORD)}, HEADERS), trusting(cert)


def is_basic_challenge(a: Answer) -> bool:
    return a.status == 401 and a.headers.get("WWW-Authenticate", "").startswith("Basic ")


async def check_basic_auth(
    url: str, context: ssl.SSLContext, protected: list[tuple[str, str]], open_paths: list[str], answers_unknown_paths: bool = True
) -> None:
    """Every protected path: 401 with a Basic challenge without credentials or with wrong
    ones, 200 with the right ones; every open path: 200 without credentials."""
    for method, path in protected:
        bare = await call(url + path, method, context=context)
        assert is_basic_challenge(bare), (method, path, bare)
        assert bare.headers.get("X-Test-Header") == "from-web-config", bare.headers  # on refusals too
        for user in WRONG:
            wrong = await call(url + path, method, context=context, user=user)
            assert is_basic_challenge(wrong), (method, path, user[0], len(user[1]), wrong)
        right = await call(url + path, method, context=context, user=(USER, PASSWORD))
        assert right.status == 200, (method, path, right)
        assert right.headers.get("X-Test-Header") == "from-web-config", right.headers
    for path in open_paths:
        a = await call(url + path, context=context)
        assert a.status == 200, (path, a)
        assert a.headers.get("X-Test-Header") == "from-web-config", a.headers
    if not answers_unknown_paths:  # the gate forwards unknown paths to its upstream
        return
    missing = await call(url + "/no-such-path", context=context, user=(USER, PASSWORD))
    assert missing.status == 404 and missing.headers.get("X-Test-Header") == "from-web-config", missing


async def check_tls_only(url: str, port: int) -> None:
    """Plain HTTP gets no HTTP answer on the TLS port; a client that does not trust the
    test's certificate refuses the server's."""
    answer = plain_http_answer(port)
    assert not answer.startswith(b"HTTP/"), answer[:200]
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await call(url + "/-/healthy", context=ssl.create_default_context())


async def test_exporter_serves_tls_and_basic_auth(tmp_path, llm_health):
    web_file, context = secure_web_config(tmp_path)
    cfg = exporter_config(tmp_path / "exporter.yml", ["gpu0"])
    proc = llm_health("serve", "--config.file", cfg, "--web.config.file", web_file, scheme="https").wait_ready(context=context)
    assert proc.url.startswith("https://")
    await check_basic_auth(
        proc.url,
        context,
        protected=[("GET", "/metrics"), ("GET", "/status"), ("GET", "/"), ("POST", "/-/reload")],
        open_paths=["/-/healthy", "/-/live", "/-/live?backend=gpu0"],
    )
    # readiness is open too (a load balancer's health check sends no credentials): 200 or,
    # once a round has found this dead backend down, 503, never the Basic challenge
    ready = await call(proc.url + "/-/ready?backend=gpu0", context=context)
    assert ready.status in (200, 503) and "WWW-Authenticate" not in ready.headers, ready
    status = await call(proc.url + "/status", context=context, user=(USER, PASSWORD))
    assert [b["backend"] for b in status.json()["backends"]] == ["gpu0"]
    probe = await call(proc.url + "/probe?target=" + dead_url(), context=context)
    assert is_basic_challenge(probe), probe  # /probe makes requests for its caller: never open
    await check_tls_only(proc.url, proc.port)


async def test_gate_serves_tls_and_basic_auth_on_its_own_endpoints_only(tmp_path, llm_health, redis_url, hostile):
    """Basic auth guards /metrics and /-/...; a proxied request passes without it, its
    own Authorization header going to the upstream untouched."""
    upstream = await hostile()
    seen: list[str | None] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization"))
        return web.json_response(OK)

    upstream.on("POST", "/v1/completions", completions)
    web_file, context = secure_web_config(tmp_path)
    cfg = gate_config(tmp_path / "gate.yml", redis_url, upstream.url, {"chat": "open"})
    proc = llm_health("gate", "--config.file", cfg, "--web.config.file", web_file, scheme="https").wait_ready(context=context)
    await check_basic_auth(proc.url, context, protected=[("GET", "/metrics"), ("POST", "/-/reload")], open_paths=["/-/healthy"], answers_unknown_paths=False)
    # the operator's controls are /-/ endpoints: not open to a bare caller
    bare = await call(proc.url + "/-/routes/chat/drain", "POST", context=context)
    assert bare.status == 401, bare
    proxied = await call(
        proc.url + "/v1/completions", "POST", context=context, headers={"Authorization": "Bearer client-key", "X-Request-Id": "websec-1"}, body={"model": "m"}
    )
    assert proxied.status == 200 and proxied.json() == OK, proxied
    assert seen == ["Bearer client-key"]
    await check_tls_only(proc.url, proc.port)


async def test_decide_serves_tls_and_basic_auth_on_every_endpoint(tmp_path, llm_health, redis_url):
    """`llm-health decide` (the nginx and Envoy doors) as a real process: the doors are
    guarded like the rest (a proxy sends the credentials), the answers are the gate's."""
    web_file, context = secure_web_config(tmp_path)
    cfg = gate_config(tmp_path / "gate.yml", redis_url, dead_url(), {"chat": "open"})
    proc = llm_health("decide", "--config.file", cfg, "--web.config.file", web_file, scheme="https").wait_ready(context=context)
    await check_basic_auth(
        proc.url,
        context,
        protected=[("GET", "/metrics"), ("POST", "/-/reload"), ("POST", "/-/ext_authz/v1/completions")],
        open_paths=["/-/healthy"],
    )
    bare = await call(proc.url + "/-/auth_request/v1/completions", context=context, headers={"X-Original-Method": "POST"})
    assert is_basic_challenge(bare), bare
    headers = {"X-Original-Method": "POST", "X-Request-Id": "websec-d1", "X-Request-Timeout-Ms": "30000"}
    admitted = await call(proc.url + "/-/auth_request/v1/completions", context=context, user=(USER, PASSWORD), headers=headers)
    assert admitted.status == 200 and admitted.headers["X-LLM-Health-Decision"] == "admit_once" and "x-deadline-slack-ms" in admitted.headers
    hostile = await call(proc.url + "/-/ext_authz/v1/completions", "POST", context=context, user=(USER, PASSWORD), headers={"X-Retry-Count": "1e3"})
    assert hostile.status == 400 and "X-Retry-Count" in hostile.json()["error"]["message"], hostile
    await check_tls_only(proc.url, proc.port)


async def test_gate_admin_controls_work_with_basic_auth_on(tmp_path, llm_health, redis_url):
    """The operator's bearer token (gate.admin_token_file) opens /-/routes/... with basic
    auth on, as without it; a wrong token, or basic auth alone, does not."""
    web_file, context = secure_web_config(tmp_path)
    cfg = gate_config(tmp_path / "gate.yml", redis_url, dead_url(), {"chat": "open"})
    proc = llm_health("gate", "--config.file", cfg, "--web.config.file", web_file, scheme="https").wait_ready(context=context)
    url = proc.url + "/-/routes/chat/reject_all"
    wrong = await call(url, "POST", context=context, headers={"Authorization": "Bearer not-the-token"})
    assert wrong.status == 401, wrong
    basic_only = await call(url, "POST", context=context, user=(USER, PASSWORD))
    assert basic_only.status == 401, basic_only
    right = await call(url, "POST", context=context, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert right.status == 200 and right.json() == {"route": "chat", "mode": "reject_all"}, right
    metrics = await call(proc.url + "/metrics", context=context, user=(USER, PASSWORD))
    assert 'llm_gate_route_closed{route="chat"} 1.0' in metrics.text


async def test_restarter_serves_tls_basic_auth_and_its_bearer_token(tmp_path, llm_health):
    """Basic auth on every path but the probes'; `/alerts` and `/status` also take the
    bearer token Alertmanager sends (checked by the restarter itself), and nothing else
    does."""
    web_file, context = secure_web_config(tmp_path)
    cfg = restarter_config(tmp_path / "restarter.yml", ["gpu0"])
    proc = llm_health("restarter", "--config.file", cfg, "--web.config.file", web_file, env=RESTARTER_ENV, scheme="https").wait_ready(context=context)
    await check_basic_auth(
        proc.url,
        context,
        protected=[("GET", "/metrics"), ("GET", "/status"), ("GET", "/"), ("POST", "/-/reload")],
        open_paths=["/-/healthy", "/-/ready?backend=gpu0"],
    )
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    # /alerts: without credentials the Basic challenge; a basic auth user or the bearer token is let in
    bare = await call(proc.url + "/alerts", "POST", context=context, body=WEBHOOK)
    assert is_basic_challenge(bare), bare
    by_token = await call(proc.url + "/alerts", "POST", context=context, body=WEBHOOK, headers=bearer)
    by_user = await call(proc.url + "/alerts", "POST", context=context, body=WEBHOOK, user=(USER, PASSWORD))
    for a in (by_token, by_user):
        assert a.status == 200, a
        assert [x["decision"] for x in a.json()["alerts"]] == ["ignored"], a
    status = await call(proc.url + "/status", context=context, headers=bearer)
    assert status.status == 200 and [b["backend"] for b in status.json()["backends"]] == ["gpu0"], status
    # a wrong bearer token is refused by the restarter's own check
    for path, method in (("/alerts", "POST"), ("/status", "GET")):
        wrong = await call(
            proc.url + path, method, context=context, headers={"Authorization": "Bearer not-the-token"}, body=WEBHOOK if method == "POST" else None
        )
        assert wrong.status == 401 and wrong.headers.get("WWW-Authenticate", "").startswith("Bearer "), (path, wrong)
    # the bearer token opens nothing else
    for method, path in (("GET", "/metrics"), ("POST", "/-/reload"), ("GET", "/")):
        other = await call(proc.url + path, method, context=context, headers=bearer)
        assert is_basic_challenge(other), (path, other)
    refused = await call(proc.url + "/metrics", context=context, user=(USER, PASSWORD))
    assert 'llm_restarter_refusals_total{reason="unauthorised"} 2.0' in refused.text, refused.text
    await check_tls_only(proc.url, proc.port)


def start_args(kind: str, tmp_path) -> tuple[list[str], dict[str, str]]:
    if kind == "serve":
        return ["serve", "--config.file", exporter_config(tmp_path / "exporter.yml", ["gpu0"])], {}
    if kind in ("gate", "decide"):
        return [kind, "--config.file", gate_config(tmp_path / "gate.yml", "redis://127.0.0.1:1/0", dead_url(), {"chat": "open"})], {}
    return ["restarter", "--config.file", restarter_config(tmp_path / "restarter.yml", ["gpu0"])], RESTARTER_ENV


BAD_WEB_CONFIGS = {
    "missing-cert-file": ("tls_server_config.cert_file", "cannot read"),
    "cert-not-pem": ("tls_server_config.cert_file", "cannot load the certificate"),
    "plain-password": (f"basic_auth_users.{USER}", "bcrypt hash"),
    "cut-bcrypt-hash": (f"basic_auth_users.{USER}", "bcrypt hash"),
    "cipher-suites": ("tls_server_config.cipher_suites", "not supported"),
    "curve-preferences": ("tls_server_config.curve_preferences", "not supported"),
    "prefer-server-cipher-suites": ("tls_server_config.prefer_server_cipher_suites", "not supported"),
    "http2": ("http_server_config.http2", "not supported"),
}
# exporter-toolkit's keys Python's TLS server cannot honour as Go does (docs/limits.md)
GO_ONLY_TLS = {
    "cipher-suites": "cipher_suites: [TLS_AES_128_GCM_SHA256]",
    "curve-preferences": "curve_preferences: [X25519]",
    "prefer-server-cipher-suites": "prefer_server_cipher_suites: true",
}


@pytest.mark.parametrize("case", sorted(BAD_WEB_CONFIGS))
@pytest.mark.parametrize("kind", ["serve", "gate", "decide", "restarter"])
def test_a_bad_web_config_is_refused_at_start(tmp_path, llm_health, kind, case):
    cert, key = self_signed(tmp_path)
    users = {USER: bcrypt_hash(PASSWORD)}
    tls_extra: tuple[str, ...] = ()
    extra = ""
    if case == "missing-cert-file":
        cert = tmp_path / "no-such.crt"
    elif case == "cert-not-pem":
        cert.write_text("not a certificate\n")
    elif case == "plain-password":
        users = {USER: PASSWORD}
    elif case == "cut-bcrypt-hash":  # a hash cut short when pasted: every check of it would fail with an error
        users = {USER: bcrypt_hash(PASSWORD)[:40]}
    elif case == "http2":
        extra = "http_server_config:\n  http2: false\n"
    else:
        tls_extra = (GO_ONLY_TLS[case],)
    path = web_config(tmp_path / "web.yml", cert, key, users, extra=extra, tls_extra=tls_extra)
    args, env = start_args(kind, tmp_path)
    proc = llm_health(*args, "--web.config.file", path, env=env)
    code = proc.proc.wait(timeout=60)
    out = proc.output()
    field, problem = BAD_WEB_CONFIGS[case]
    assert code != 0, out
    assert f"{path}: {field}: " in out and problem in out, out
    assert "Traceback" not in out, out
