"""The bearer-token and basic-auth checks the three servers share (llm_health.web), on
the functions themselves: docs/restarts.md "The token is compared in constant time";
docs/limits.md "A bcrypt check runs off the event loop, two at a time, and a successful
one is remembered, so a scraper pays once"."""

from __future__ import annotations

import asyncio
import base64
import threading
import time

import bcrypt
import pytest
from aiohttp.test_utils import make_mocked_request

from llm_health import web
from llm_health.web import BasicAuth, BearerToken

TOKEN = "restarter-token-4d1f0c"


def request(authorization: str | None):
    return make_mocked_request("GET", "/status", headers={} if authorization is None else {"Authorization": authorization})


def basic(user: str, password: str):
    return request("Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())


def test_the_bearer_token_is_compared_in_constant_time(monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    real = web.hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(web.hmac, "compare_digest", spy)
    check = BearerToken(TOKEN).check
    assert check(request(f"Bearer {TOKEN}")) and check(request(f"bearer  {TOKEN} "))
    refused = ["", "Bearer", "Bearer ", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer " + "x" * 10_000, f"Basic {TOKEN}", TOKEN, f"Token {TOKEN}"]
    for header in refused:
        assert not check(request(header)), header
    assert not check(request(None))
    # every check, whatever was offered (its length, its scheme), compared two 32-byte digests
    assert len(compared) == 2 + len(refused) + 1
    assert all(isinstance(a, bytes) and isinstance(b, bytes) and len(a) == len(b) == 32 for a, b in compared)
    assert len({b for _, b in compared}) == 1 and TOKEN.encode() not in {b for _, b in compared}


async def test_a_successful_bcrypt_check_is_remembered(monkeypatch):
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4))
    calls: list[bytes] = []
    real = bcrypt.checkpw

    def spy(password, hashed_password):
        calls.append(password)
        return real(password, hashed_password)

    monkeypatch.setattr(bcrypt, "checkpw", spy)
    auth = BasicAuth({"prometheus": hashed})
    for _ in range(5):
        assert await auth.user(basic("prometheus", "s3cret")) == "prometheus"
    assert calls == [b"s3cret"]  # the scraper paid once
    for _ in range(2):  # a wrong password is checked every time, never remembered
        assert await auth.user(basic("prometheus", "wrong")) is None
    assert calls == [b"s3cret", b"wrong", b"wrong"]


async def test_bcrypt_checks_run_off_the_event_loop_two_at_a_time(monkeypatch):
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4))
    lock = threading.Lock()
    release = threading.Event()
    active, peak, threads = 0, 0, set()
    loop_thread = threading.get_ident()

    def blocking_check(password, hashed_password):
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
            threads.add(threading.get_ident())
        release.wait(30)
        with lock:
            active -= 1
        return False

    monkeypatch.setattr(bcrypt, "checkpw", blocking_check)
    auth = BasicAuth({"prometheus": hashed})
    tasks = [asyncio.create_task(auth.user(basic("prometheus", f"wrong-{i}"))) for i in range(6)]
    try:
        deadline = time.monotonic() + 30
        while active < 2:  # two checks under way, and the event loop still runs this test
            assert time.monotonic() < deadline, f"{active} checks started"
            await asyncio.sleep(0.01)
        settle = time.monotonic() + 1.0
        while time.monotonic() < settle and peak <= 2:  # a third would start now if the bound were not two
            await asyncio.sleep(0.01)
        assert (peak, active) == (2, 2)
        assert not any(t.done() for t in tasks)
    finally:
        release.set()
    assert await asyncio.gather(*tasks) == [None] * 6
    assert peak == 2 and loop_thread not in threads


@pytest.mark.parametrize("value", ["RequestClientCert", "RequireAnyClientCert"])
def test_client_auth_types_that_take_an_unverified_certificate_are_refused_by_name(tmp_path, value):
    """exporter-toolkit's two values that accept a client certificate without verifying it:
    Python's ssl cannot do that, so they are refused, naming the key, instead of silently
    verifying (docs/limits.md)."""
    from llm_health.config.errors import ConfigError
    from llm_health.config.web import parse_web_config

    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    tls = {"cert_file": str(cert), "key_file": str(key), "client_auth_type": value}
    with pytest.raises(ConfigError, match=rf"web\.yml: tls_server_config\.client_auth_type: {value} .*not supported"):
        parse_web_config({"tls_server_config": tls}, "web.yml")
