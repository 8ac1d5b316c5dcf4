"""The retry fingerprint: what a client re-sends unchanged on a retry (the OpenAI SDK re-sends
the request byte for byte, its retry count aside) and what tells one caller's request from
another's."""

from __future__ import annotations

import json

from multidict import CIMultiDict

from llm_health.gate.headers import retry_fingerprint
from llm_health.gate.litellm_hook import request_of

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
HEADERS = {"Authorization": "Bearer sk-a", "X-Request-Timeout-Ms": "3000", "X-Stainless-Retry-Count": "0", "User-Agent": "OpenAI/Python 3.63.0"}


def fp(headers=None, body=BODY, tenant="default", route="chat", method="POST", path="/v1/chat/completions"):
    return retry_fingerprint(tenant, route, method, path, CIMultiDict(headers if headers is not None else HEADERS), body)


def test_a_retry_as_the_sdk_sends_it_has_its_first_copys_fingerprint():
    assert fp({**HEADERS, "X-Stainless-Retry-Count": "2"}) == fp()
    assert fp({k.lower(): v for k, v in HEADERS.items()}) == fp()  # header names are case-insensitive


def test_what_tells_requests_apart():
    base = fp()
    others = {
        fp(body=BODY.replace(b"hi", b"ho")),
        fp({**HEADERS, "Authorization": "Bearer sk-b"}),  # another caller
        fp({**HEADERS, "X-Request-Timeout-Ms": "3001"}),
        fp({**HEADERS, "X-Request-Deadline-Ms": "1800000000000"}),
        fp(tenant="acme"),
        fp(route="batch"),
        fp(path="/v1/completions"),
        fp(method="PUT"),
    }
    assert base not in others and len(others) == 8


def test_a_door_without_the_body_uses_its_length():
    assert fp({**HEADERS, "X-Original-Content-Length": "120"}, body=None) == fp({**HEADERS, "X-Original-Content-Length": "120"}, body=None)
    assert fp({**HEADERS, "X-Original-Content-Length": "120"}, body=None) != fp({**HEADERS, "X-Original-Content-Length": "121"}, body=None)


def test_the_digest_keeps_no_credential():
    digest = fp()
    assert "sk-a" not in digest and len(digest) == 32


def test_the_litellm_hook_hands_over_the_body_as_sent_and_the_callers_key():
    data = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "litellm_call_id": "x",
        "metadata": {"t": 1},
        "proxy_server_request": {"url": "http://litellm/v1/chat/completions", "method": "POST", "headers": {}, "body": {}},
    }
    method, raw, headers, body = request_of(data, "hashed-key")
    assert (method, raw, body, headers["Api-Key"]) == (
        "POST",
        "/v1/chat/completions",
        b'{"messages":[{"content":"hi","role":"user"}],"model":"m"}',
        "hashed-key",
    )
    _, _, _, again = request_of({**data, "litellm_call_id": "y", "metadata": {"t": 2}})
    assert again == body  # LiteLLM's own per-call fields are not part of what the client sent
