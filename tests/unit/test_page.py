"""The exporter's status page (exporter.page), rendered without a server: what it shows,
that every string from a configuration, a backend or Redis is text (parsed back with the
standard library's HTML parser), its Content-Security-Policy, and its bounds. The page in
a real browser: tests/integration/test_status_page.py."""

from __future__ import annotations

import base64
import hashlib
import re
from html.parser import HTMLParser
from typing import Any

from llm_health.core.states import State
from llm_health.exporter import page

EVIL = "</td></tr></table><script>alert(1)</script><img src=x onerror=alert(2)>\"'&amp;<!--"


class Parsed(HTMLParser):
    """Start tags (with attributes), text and the raw content of <script> and <style>."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.raw: dict[str, list[str]] = {"script": [], "style": []}
        self._in: str | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag in self.raw:
            self._in = tag

    def handle_endtag(self, tag: str) -> None:
        if tag == self._in:
            self._in = None

    def handle_data(self, data: str) -> None:
        if self._in:
            self.raw[self._in].append(data)
        else:
            self.text.append(data)

    def names(self) -> list[str]:
        return [t for t, _a in self.tags]

    def joined(self) -> str:
        return "".join(self.text)


def backend(name: str, state: str, reason: str = "", model: str = "m", engines: int = 1, **kw: Any) -> dict[str, Any]:
    entry = {
        "backend": name,
        "state": state,
        "reason": reason,
        "kind": "vllm",
        "profile": "vllm_v1",
        "running": 4,
        "waiting": 0,
        "generation_tokens_per_second": 12.5,
        "last_round_at": 1000.0,
        "engines": [{"model_name": model, "engine": str(i), "state": state, "running": 4, "waiting": 0} for i in range(engines)],
    }
    entry.update(kw)
    return entry


def redis_section(pool: str = "a100", route: str = "chat", **kw: Any) -> dict[str, Any]:
    section = {
        "up": True,
        "error": None,
        "url": "redis://127.0.0.1:6379/0",
        "keyspace_events": {"flags": "Egx", "ok": True, "fix": None},
        "pools": {
            pool: {
                "releases": {"del": 3, "expired": 1},
                "size": 4,
                "leases_held": 3,
                "free": 1,
                "waiters": 2,
                "lease_ttl_min_ms": 4200,
                "lease_age_max_ms": 61_000,
                "drift": {"busy_without_lease": {"count": 1, "gpus": ["g3"]}, "lease_on_idle_backend": {"count": 0, "gpus": []}},
            }
        },
        "routes": {
            route: {
                "queue_depth": 5,
                "queue_age_ms": 4033,
                "deadline_slack_ms": -250,
                "past_deadline": 1,
                "retried_requests": 2,
                "token_duplication_ratio_max": 3.0,
            }
        },
        "stale": False,
    }
    section.update(kw)
    return section


def render(backends: list[dict[str, Any]], redis: dict[str, Any] | None = None, counts: dict[str, int] | None = None, **kw: Any) -> str:
    if counts is None:
        counts = {}
        for b in backends:
            counts[b["state"]] = counts.get(b["state"], 0) + 1
    return page.render(page.PageData(backends=backends, counts=counts, now=1002.0, refresh_s=kw.pop("refresh_s", 2.0), redis=redis, **kw))


def rows(parsed: Parsed, attr: str) -> list[dict[str, str | None]]:
    return [a for t, a in parsed.tags if t == "tr" and attr in a]


def test_states_reasons_engines_pools_and_routes_are_shown():
    html = render(
        [backend("gpu0", "hung", "12 running, no engine progress for 2 rounds (4s)", engines=2), backend("gpu1", "busy", "engine progressing")],
        redis_section(),
    )
    parsed = Parsed(html)
    assert [(r["data-backend"], r["data-state"]) for r in rows(parsed, "data-backend")] == [("gpu0", "hung"), ("gpu1", "busy")]
    text = parsed.joined()
    assert "no engine progress for 2 rounds (4s)" in text and "2 backends watched" in text
    assert text.count("m engine ") == 3  # gpu0's two ranks, gpu1's one
    assert [r["data-pool"] for r in rows(parsed, "data-pool")] == ["a100"]
    assert [r["data-route"] for r in rows(parsed, "data-route")] == ["chat"]
    assert "4,033 ms" in text and "-250 ms" in text and "61.0 s" in text and "busy_without_lease: 1" in text
    assert ("a", {"href": "/metrics"}) in parsed.tags and ("a", {"href": "/status"}) in parsed.tags  # the landing page's links


def test_strings_from_configs_backends_and_redis_are_text():
    """Backend names are restricted by the config, but model names, engines, reasons,
    Redis errors and route names (from the routes set in Redis) are anyone's."""
    b = backend(EVIL, EVIL, reason=EVIL, model=EVIL, profile=EVIL)
    b["engines"][0]["engine"] = EVIL
    html = render([b], redis_section(pool=EVIL, route=EVIL, error=EVIL, url=EVIL, keyspace_events={"flags": EVIL, "ok": False, "fix": EVIL}))
    parsed = Parsed(html)
    assert parsed.names().count("script") == 1 and "img" not in parsed.names()
    assert "alert" not in "".join(parsed.raw["script"])
    text = parsed.joined()
    assert text.count(EVIL) >= 9, text  # backend, state, reason, model, engine, profile, pool, route, error, url, flags, fix
    for tag, attrs in parsed.tags:  # attribute values come back whole
        for name in ("data-backend", "data-state", "data-pool", "data-route"):
            if name in attrs:
                assert attrs[name] == EVIL, (tag, attrs)
    assert "<!--" not in html.replace("&lt;!--", "")  # no comment opened in the document


def test_csp_allows_exactly_the_inline_style_and_script():
    html = render([backend("gpu0", "idle")])
    parsed = Parsed(html)
    (script,), (style,) = parsed.raw["script"], parsed.raw["style"]

    def sha(text: str) -> str:
        return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()

    assert f"script-src 'sha256-{sha(script)}'" in page.CSP and f"style-src 'sha256-{sha(style)}'" in page.CSP
    assert page.CSP.startswith("default-src 'none';") and "connect-src 'self'" in page.CSP and "unsafe" not in page.CSP
    assert page.HEADERS["Content-Security-Policy"] == page.CSP


def test_no_external_asset_and_a_fallback_without_javascript():
    html = render([backend("gpu0", "idle")], redis_section())
    parsed = Parsed(html)
    assert not any("src" in a for _t, a in parsed.tags)  # no image, no external script
    assert "link" not in parsed.names() and "iframe" not in parsed.names()
    assert all(str(a["href"]).startswith("/") for t, a in parsed.tags if t == "a")
    assert "url(" not in "".join(parsed.raw["style"]) and "@import" not in "".join(parsed.raw["style"])
    assert re.search(r'<noscript><meta http-equiv="refresh" content="2"></noscript>', html)
    main = next(a for t, a in parsed.tags if t == "main")
    assert main == {"id": "page", "data-refresh-ms": "2000", "data-refreshes": "0"}


def test_refresh_interval_is_the_round_interval_within_bounds():
    assert page.refresh_seconds(2.0) == 2.0
    assert page.refresh_seconds(0.1) == 1.0 and page.refresh_seconds(600.0) == 30.0
    assert page.refresh_seconds(float("inf")) == 30.0 and page.refresh_seconds(float("nan")) == 30.0
    assert 'data-refresh-ms="1000"' in render([], refresh_s=0.05)


def test_worst_first_keeps_order_within_a_state_and_bounds_the_rows():
    items = [("idle", "a"), ("hung", "b"), ("busy", "c"), ("nonsense", "d"), ("hung", "e"), ("down", "f")]
    assert page.worst_first(items, 10) == ["b", "e", "f", "c", "a", "d"]
    assert page.worst_first(items, 2) == ["b", "e"]
    assert [s.value for s in sorted(State, key=lambda s: s.severity)][:2] == ["hung", "down"]


def test_a_large_fleet_lists_the_worst_rows_and_counts_every_state():
    shown = [backend(f"b{i}", "hung") for i in range(page.MAX_BACKEND_ROWS)]
    html = render(shown, counts={"hung": page.MAX_BACKEND_ROWS, "idle": 9_800})
    parsed = Parsed(html)
    assert len(rows(parsed, "data-backend")) == page.MAX_BACKEND_ROWS
    text = parsed.joined()
    assert f"The {page.MAX_BACKEND_ROWS} worst of 10000 backends are listed" in text and "10000 backends watched" in text
    many = backend("wide", "busy", engines=page.MAX_ENGINES_SHOWN + 5)
    assert "5 more engine units in /status" in Parsed(render([many])).joined()


def test_redis_down_stale_and_absent():
    down = Parsed(render([], redis_section(up=False, error="ConnectionError: refused", stale=True))).joined()
    assert "down" in down and "ConnectionError: refused" in down and "from the last refresh that read it" in down
    fresh = Parsed(render([], redis_section(pools={"a100": {"releases": {"del": 0, "expired": 0}}}, routes={}))).joined()
    assert "a100" in fresh and "no routes" in fresh
    without = Parsed(render([backend("gpu0", "idle")]))
    assert "pools" not in [a.get("id") for _t, a in without.tags] and "GPU pools" not in without.joined()


def test_missing_figures_are_dashes_not_errors():
    b = backend("gpu0", "down", running=None, waiting=None, generation_tokens_per_second=float("nan"), last_round_at=None, engines=0)
    text = Parsed(render([b])).joined()
    assert "never" in text and text.count("–") >= 4


def test_the_engine_queue_age_is_shown_and_unknown_says_so():
    html = render([backend("old", "busy", queue_age_ms=47_210), backend("young", "busy", queue_age_ms=850), backend("restarted", "busy", queue_age_ms=None)])
    text = Parsed(html).joined()
    assert "queue age" in text and "47.2 s" in text and "850 ms" in text
    assert "unknown" in text  # null in /status: unknown, never shown as 0
