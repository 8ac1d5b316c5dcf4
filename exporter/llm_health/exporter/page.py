"""The exporter's status page (`/`): the fleet's states, the GPU pools and the admission
routes, for a team without Grafana at hand. Pure: it renders what `/status` reports
(each backend's `Slot.status()`, the Redis view's `redis_status`) and does no I/O.

Every string that comes from a configuration file, a backend or Redis (backend, pool,
route and model names, reasons, error messages) goes through `html.escape`, attributes
quoted. The page refreshes itself in place: a small inline script fetches `/` again every
refresh interval and swaps the `<main>` it got for the one shown (the answer is parsed
with `DOMParser`, whose scripts never run), so every byte the browser shows was escaped
here, and there is one renderer. With JavaScript off, a `<noscript>` meta refresh
reloads the page instead. No external asset, no framework; `CSP` allows exactly the
inline style and script below (by hash), requests to this origin, and nothing else.

Large fleets: the worst `MAX_BACKEND_ROWS` backends are listed (hung first, then down,
... idle last), with the count of every state above the table; `/status` has them all.
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..core.states import State

MAX_BACKEND_ROWS = 200
MAX_ENGINES_SHOWN = 8  # per backend; the rest are counted
MAX_POOL_ROWS = 100
MAX_ROUTE_ROWS = 100
REFRESH_MIN_S, REFRESH_MAX_S = 1.0, 30.0

T = TypeVar("T")

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1em 2em;color:#1b1f24;background:#fff}
h1{font-size:1.4em;margin:.2em 0}h2{font-size:1.1em;margin:1.2em 0 .4em}
nav,#refresh{color:#555}#refresh-error{color:#a00;font-weight:600}
table{border-collapse:collapse;margin:.3em 0}
th,td{border:1px solid #d0d7de;padding:.25em .5em;text-align:left;vertical-align:top}
th{background:#f3f5f7}td.n{text-align:right;font-variant-numeric:tabular-nums}
td.reason{max-width:42em;overflow-wrap:anywhere}
.st{display:inline-block;padding:0 .45em;border-radius:.3em;font-weight:600;white-space:nowrap}
.s-hung,.s-stalled{background:#ffd7d5;color:#82071e}
.s-down,.s-unresponsive,.s-no_metrics{background:#ffe2b8;color:#7a3e00}
.s-busy{background:#ddf4ff;color:#0a3069}.s-restarted{background:#fbefff;color:#6e40c9}
.s-idle,.s-sleeping,.s-paused,.s-up{background:#dafbe1;color:#116329}
.s-unknown,.s-other{background:#eaeef2;color:#424a53}
.shed{display:inline-block;margin-left:.3em;padding:0 .45em;border-radius:.3em;background:#fff8c5;color:#7d4e00;font-weight:600}
ul.eng{margin:0;padding-left:1em}.muted{color:#666}.bad{color:#a00;font-weight:600}
"""

SCRIPT = """
(function () {
  var main = document.getElementById("page");
  var every = Number(main.getAttribute("data-refresh-ms")) || 5000;
  var note = document.getElementById("refresh-error");
  var done = 0;
  function tick() {
    fetch(location.origin + location.pathname, {headers: {"Accept": "text/html"}, cache: "no-store", credentials: "same-origin"})
      .then(function (r) {
        if (!r.ok) { throw new Error("HTTP " + r.status); }
        return r.text();
      })
      .then(function (text) {
        var fresh = new DOMParser().parseFromString(text, "text/html").getElementById("page");
        if (!fresh) { throw new Error("no status in the answer"); }
        done += 1;
        fresh.setAttribute("data-refreshes", String(done));
        main.replaceWith(fresh);
        main = fresh;
        note.textContent = "";
      })
      .catch(function (e) {
        note.textContent = " refresh failed (" + e.message + "): showing the last status";
      })
      .finally(function () { setTimeout(tick, every); });
  }
  setTimeout(tick, every);
})();
"""


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


# The page's own Content-Security-Policy: its inline style and script (by hash), fetches
# to this origin, nothing else (no images, fonts, frames, forms, plugins or base URL).
CSP = f"default-src 'none'; script-src 'sha256-{_sha256(SCRIPT)}'; style-src 'sha256-{_sha256(STYLE)}'; connect-src 'self'; base-uri 'none'; form-action 'none'"
HEADERS = {"Content-Security-Policy": CSP, "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def esc(value: object) -> str:
    """Text for an element or a quoted attribute: & < > " ' escaped."""
    return html.escape(str(value), quote=True)


def state_of(value: object) -> State | None:
    try:
        return State(str(value))
    except ValueError:
        return None


def badge(value: object) -> str:
    """A state as a coloured badge; a class only for a known state."""
    state = state_of(value)
    cls = f"s-{state.value}" if state is not None else "s-other"
    return f'<span class="st {cls}">{esc(value)}</span>'


def worst_first(items: Iterable[tuple[str, T]], limit: int) -> list[T]:
    """The `limit` items of the worst states (`State.severity`), in their given order
    within a state; unknown state names after the known ones. One pass: a bucket per state."""
    buckets: dict[int, list[T]] = {}
    for state, item in items:
        buckets.setdefault(_RANK.get(state, len(_RANK)), []).append(item)
    out: list[T] = []
    for rank in sorted(buckets):
        out.extend(buckets[rank][: limit - len(out)])
        if len(out) >= limit:
            break
    return out


_RANK = {s.value: s.severity for s in State}


def _severity(name: str) -> int:
    return _RANK.get(name, len(_RANK))


def refresh_seconds(interval: float) -> float:
    """The page's refresh: the exporter's round interval, within 1-30 s."""
    if not math.isfinite(interval):
        return REFRESH_MAX_S
    return min(max(interval, REFRESH_MIN_S), REFRESH_MAX_S)


@dataclass
class PageData:
    """What one rendering shows. `backends`: the `/status` entries of the backends to
    list (worst first, at most MAX_BACKEND_ROWS); `counts`: every watched backend's state;
    `redis`: the `/status` Redis section, or None without a `redis:` section."""

    backends: Sequence[Mapping[str, Any]]
    counts: Mapping[str, int]
    now: float  # wall clock, seconds
    refresh_s: float
    redis: Mapping[str, Any] | None = None
    shard: Mapping[str, int] = field(default_factory=lambda: {"index": 0, "total": 1, "configured": 0})
    version: str = ""


def render(data: PageData) -> str:
    refresh = refresh_seconds(data.refresh_s)
    main = [_summary(data), _backends(data)]
    if data.redis is not None:
        main.append(_redis(data.redis))
    updated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(data.now))
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>llm-health exporter</title><style>{STYLE}</style>"
        f'<noscript><meta http-equiv="refresh" content="{refresh:g}"></noscript></head>\n<body>'
        f"<header><h1>llm-health exporter</h1>"
        '<nav><a href="/metrics">Metrics</a> · <a href="/status">Status (JSON)</a> · '
        "<code>/probe?target=http://host:8000&amp;kind=engine</code>"
        f"{' · version ' + esc(data.version) if data.version else ''}</nav>"
        f'<p id="refresh">Refreshed in place every {refresh:g} s (read-only).<span id="refresh-error"></span></p></header>\n'
        f'<main id="page" data-refresh-ms="{int(refresh * 1000)}" data-refreshes="0">'
        f'<p class="muted">Status at <time id="updated">{esc(updated)}</time>.</p>\n' + "\n".join(main) + f"</main>\n<script>{SCRIPT}</script></body></html>\n"
    )


# --- backends ------------------------------------------------------------------------------


def _summary(data: PageData) -> str:
    total = sum(data.counts.values())
    parts = [f"{badge(s)} {n}" for s, n in sorted(data.counts.items(), key=lambda c: (_severity(c[0]), c[0])) if n]
    shard = data.shard
    where = ""
    if shard.get("total", 1) > 1:
        where = f" (shard {esc(shard['index'])} of {esc(shard['total'])}; {esc(shard.get('configured', total))} configured in all)"
    return f'<p id="summary">{total} backend{"" if total == 1 else "s"} watched{where}: {", ".join(parts) or "none"}</p>'


def _num(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return '<span class="muted">–</span>'
    return esc(f"{value:,.{digits}f}") if isinstance(value, int | float) else esc(value)


def _ago(at: Any, now: float) -> str:
    if not isinstance(at, int | float):
        return '<span class="muted">never</span>'
    return f"{max(0.0, now - at):.0f} s ago"


def _engines(entries: Sequence[Mapping[str, Any]]) -> str:
    if not entries:
        return '<span class="muted">–</span>'
    items = []
    for e in entries[:MAX_ENGINES_SHOWN]:
        unit = esc(e.get("model_name") or "") or '<span class="muted">(no model label)</span>'
        if e.get("engine"):
            unit += f' <span class="muted">engine {esc(e["engine"])}</span>'
        items.append(f"<li>{unit}: {badge(e.get('state', 'unknown'))} run {_num(e.get('running'))}, wait {_num(e.get('waiting'))}</li>")
    more = len(entries) - MAX_ENGINES_SHOWN
    if more > 0:
        items.append(f'<li class="muted">{more} more engine units in /status</li>')
    return f'<ul class="eng">{"".join(items)}</ul>'


def _engine_age(b: Mapping[str, Any]) -> str:
    """The engine's queue age (`queue_age_ms`): `unknown` while it cannot be known (absent
    from /status only for a document of another version)."""
    if b.get("queue_age_ms") is None:
        return '<span class="muted">unknown</span>' if "queue_age_ms" in b else '<span class="muted">–</span>'
    return _ms(b["queue_age_ms"])


def _backends(data: PageData) -> str:
    rows = []
    for b in data.backends:
        state = b.get("state", "unknown")
        rows.append(
            f'<tr data-backend="{esc(b.get("backend", ""))}" data-state="{esc(state)}">'
            f"<td>{esc(b.get('backend', ''))}</td><td>{badge(state)}{_shedding(b)}</td>"
            f'<td class="reason">{esc(b.get("reason", ""))}</td>'
            f"<td>{_engines(b.get('engines') or ())}</td>"
            f'<td class="n">{_num(b.get("running"))}</td><td class="n">{_num(b.get("waiting"))}</td>'
            f'<td class="n">{_engine_age(b)}</td>'
            f'<td class="n">{_num(b.get("generation_tokens_per_second"), 1)}</td>'
            f"<td>{esc(b.get('profile') or b.get('kind', ''))}</td><td>{_ago(b.get('last_round_at'), data.now)}</td></tr>"
        )
    total = sum(data.counts.values())
    note = ""
    if total > len(data.backends):
        note = f'<p class="muted">The {len(data.backends)} worst of {total} backends are listed; /status has every one.</p>'
    head = "<tr><th>backend</th><th>state</th><th>reason</th><th>engines</th><th>running</th><th>waiting</th><th>queue age</th><th>tokens/s</th><th>engine kind</th><th>last round</th></tr>"
    return f'<h2>Backends</h2><table id="backends">{head}{"".join(rows)}</table>{note}'


# --- Redis: pools and routes -------------------------------------------------------------


def _shedding(b: Mapping[str, Any]) -> str:
    """The mark of an engine refusing requests itself (its own queue cap) since the
    previous round: beside its state, which it does not change."""
    if not b.get("shedding"):
        return ""
    said = ", ".join(f"{_num(n)} {reason}" for reason, n in (b.get("refused") or {}).items())
    return f' <span class="shed" title="the engine refused {esc(said)} since the previous round">shedding</span>'


def _ms(value: Any) -> str:
    """Milliseconds as read (`queue_age_ms`, `deadline_slack_ms`), in seconds past 10 s."""
    if not isinstance(value, int | float) or not math.isfinite(value):
        return '<span class="muted">–</span>'
    if abs(value) >= 10_000:
        return esc(f"{value / 1000:,.1f} s")
    return esc(f"{value:,.0f} ms")


def _redis(r: Mapping[str, Any]) -> str:
    up = bool(r.get("up"))
    head = f"Redis {esc(r.get('url', ''))}: {'up' if up else '<span class=bad>down</span>'}"
    if r.get("error"):
        head += f' <span class="bad">({esc(r["error"])})</span>'
    if r.get("stale"):
        head += " <span class=bad>: the pools and routes below are from the last refresh that read it</span>"
    keyspace = r.get("keyspace_events") or {}
    if keyspace.get("ok") is False:
        head += f'<br><span class="bad">notify-keyspace-events is {esc(keyspace.get("flags"))}: lease releases are not counted from events; run {esc(keyspace.get("fix"))}</span>'
    return f'<p id="redis">{head}</p>{_pools(r.get("pools") or {})}{_routes(r.get("routes") or {})}'


def _pools(pools: Mapping[str, Mapping[str, Any]]) -> str:
    rows = []
    for name, p in list(pools.items())[:MAX_POOL_ROWS]:
        releases = p.get("releases") or {}
        drift = p.get("drift") or {}
        drifted = ", ".join(f"{esc(kind)}: {esc(d.get('count', 0))}" for kind, d in sorted(drift.items()) if d.get("count"))
        rows.append(
            f'<tr data-pool="{esc(name)}"><td>{esc(name)}</td><td class="n">{_num(p.get("size"))}</td>'
            f'<td class="n">{_num(p.get("leases_held"))}</td><td class="n">{_num(p.get("free"))}</td>'
            f'<td class="n">{_num(p.get("waiters"))}</td><td class="n">{_ms(p.get("lease_ttl_min_ms"))}</td>'
            f'<td class="n">{_ms(p.get("lease_age_max_ms"))}</td>'
            f'<td class="n">{_num(releases.get("del"))} / {_num(releases.get("expired"))}</td>'
            f"<td>{drifted or '<span class=muted>none</span>'}</td></tr>"
        )
    head = ("pool", "GPUs", "leased", "free", "waiters", "lease TTL (min)", "oldest lease", "released / expired", "drift")
    return _table("GPU pools", "pools", head, rows, "no pools configured", len(pools) - MAX_POOL_ROWS, "pools")


def _routes(routes: Mapping[str, Mapping[str, Any]]) -> str:
    rows = []
    for name, q in sorted(routes.items())[:MAX_ROUTE_ROWS]:
        ratio = q.get("token_duplication_ratio_max")
        slack = q.get("deadline_slack_ms")
        late = isinstance(slack, int | float) and slack < 0
        rows.append(
            f'<tr data-route="{esc(name)}"><td>{esc(name)}</td><td class="n">{_num(q.get("queue_depth"))}</td>'
            f'<td class="n">{_ms(q.get("queue_age_ms"))}</td>'
            f'<td class="n{" bad" if late else ""}">{_ms(slack)}</td><td class="n">{_num(q.get("past_deadline"))}</td>'
            f'<td class="n">{_num(q.get("retried_requests"))}</td><td class="n">{_num(ratio, 2)}</td></tr>'
        )
    head = (
        "route",
        "queued",
        "oldest (queue_age_ms)",
        "smallest slack (deadline_slack_ms)",
        "past deadline",
        "retried",
        "token duplication (max)",
    )
    return _table("Admission routes", "routes", head, rows, "no routes", len(routes) - MAX_ROUTE_ROWS, "routes")


def _table(title: str, table_id: str, head: Sequence[str], rows: Sequence[str], empty: str, more: int, noun: str) -> str:
    """A section's table: its fixed header (constant text), its rows (escaped by the
    caller), a row saying `empty` when there are none, and how many more /status has."""
    header = "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
    body = "".join(rows) or f'<tr><td colspan="{len(head)}" class="muted">{empty}</td></tr>'
    note = f'<p class="muted">{more} more {noun} in /status.</p>' if more > 0 else ""
    return f'<h2>{title}</h2><table id="{table_id}">{header}{body}</table>{note}'
