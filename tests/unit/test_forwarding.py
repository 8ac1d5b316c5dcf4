"""core.forwarding: what a door forwards to an engine (the inference API), what it never does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_health.core.forwarding import DEFAULT_ALLOW, NEVER, AllowError, check, never, parse_allow, parse_rule

ROUTES = Path(__file__).parent.parent / "data" / "engine-routes"


def test_the_inference_api_is_forwarded():
    for entry in DEFAULT_ALLOW:
        method, path = entry.split()
        path = path.replace("*", "resp_0123")
        assert check(method, path).forward, entry


@pytest.mark.parametrize("path", [*NEVER, "/slots/0", "/fault_tolerance/status", "/metrics/x"])
def test_admin_and_dev_endpoints_are_never_forwarded(path):
    for method in ("GET", "POST"):
        v = check(method, path)
        assert (v.forward, v.status) == (False, 404) and "never forwarded" in v.reason


@pytest.mark.parametrize(
    "raw",
    [
        "/v1/completions/../../sleep",
        "/v1/completions/./x",
        "/%73leep",
        "//sleep",
        "/v1/chat/completions/",
        "/v1/chat/completions%2F..%2F..%2Fsleep",
        "/v1//chat/completions",
        "/V1/chat/completions",
        "",
        "/",
        "/v1/chat/completions\x00",
    ],
)
def test_a_path_is_matched_as_sent_byte_for_byte(raw):
    v = check("POST", raw)
    assert (v.forward, v.status) == (False, 404)


def test_a_wrong_method_is_405_and_names_the_method_that_is_forwarded():
    v = check("GET", "/v1/chat/completions")
    assert (v.forward, v.status, v.allow) == (False, 405, ("POST",))
    assert check("DELETE", "/v1/models").status == 405


def test_a_route_allow_list_replaces_the_default():
    rules = parse_allow(["POST /v1/chat/completions", "GET /v1/responses/*"])
    assert check("POST", "/v1/chat/completions", rules).forward
    assert check("GET", "/v1/responses/abc-1", rules).forward
    assert not check("GET", "/v1/responses/abc/def", rules).forward  # * is one segment
    assert check("POST", "/v1/completions", rules).status == 404


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ("POST /sleep", "/sleep is an engine admin or dev endpoint"),
        ("POST /slots/*", "/slots is an engine admin or dev endpoint"),
        ("GET /metrics", "/metrics is an engine admin"),
        ("PUT /v1/models", "method 'PUT'"),
        ("POST v1/completions", "path segments"),
        ("POST /v1/../sleep", "path segments"),
        ("POST /v1/chat/completions/", "path segments"),
        ("/v1/completions", "expected 'METHOD /path'"),
    ],
)
def test_a_bad_allow_entry_is_refused_naming_it(entry, named):
    with pytest.raises(AllowError) as err:
        parse_rule(entry)
    assert named in str(err.value) and repr(entry) in str(err.value)
    with pytest.raises(AllowError, match="empty"):
        parse_allow([])


def test_every_admin_route_of_the_real_engines_is_never_forwarded():
    """The route lists read from vLLM 0.32.0's and llama-server b11434's code
    (tests/data/engine-routes/SOURCES.md): each is in DEFAULT_ALLOW or under NEVER, and
    none of NEVER is in DEFAULT_ALLOW."""
    allowed = {e.split()[1] for e in DEFAULT_ALLOW}
    for engine in ("vllm-0.32.0", "llama-server-b11434"):
        data = json.loads((ROUTES / f"{engine}.json").read_text())
        for path in data["inference"]:
            assert path in allowed or any(p.endswith("*") and path.startswith(p[:-1]) for p in allowed), (engine, path)
        for path in data["admin"]:
            assert never(path) is not None, (engine, path)
            assert not check("POST", path).forward and not check("GET", path).forward
    assert not {p for p in allowed if never(p.replace("*", "x"))}
