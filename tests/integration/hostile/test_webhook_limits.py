"""The restarter's webhook limits (docs/limits.md, "The restarter's webhook bodies") at
each bound and one past it, against a real `llm-health restarter` process on loopback,
posted with the bearer token as Alertmanager sends it.

Every body here holds, first, a plain `LLMBackendHung` for the configured backend gpu0,
and the alert that carries the bound. At the bound the body is processed: answered alert
by alert, its `LLMBackendHung`s acted on (re-verified against an idle simulated vLLM,
refused `not_hung`, so no restart command runs). One past the bound the body is refused
whole, with the status and the field named, and nothing acts on any of it, not even on the
plain alert before the bad one. A good body sent after the refused one is processed.

The count of alerts is no such bound: past 1,000 the notification is read for the alerts
the restarter acts on, wherever they are in it, and the rest left unread (a 4xx would make
Alertmanager drop a hung alert inside it). Tested with the restarter alone and behind a
real Alertmanager that sends it one notification of 1,500 alerts with one real hang inside.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llm_health.core.webhook import fingerprint
from llm_health.sim import servers as sim
from tests.fixtures.webhooks import BODY_2447

# The bounds as docs/limits.md states them (test_limits_doc.py holds the doc to the code):
# written out here, so that a bound the code moves by one fails these tests too.
MAX_BODY = 8 * 1024 * 1024  # bytes of a body
MAX_ALERTS = 1000  # alerts in one notification read, of those the restarter acts on
MAX_LABELS_CHARS = 64 * 1024  # characters of one alert's label names and values (and of its annotations')
MAX_FIELD = 1024  # characters of startsAt, of fingerprint

TOKEN = "limits-token-0c1d2e3f"
# What Alertmanager's webhook notifier sends with `http_config.authorization.credentials`.
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", "User-Agent": "Alertmanager/0.27.0"}
DEADLINE = 60.0  # a failure bound for polls, never a measured time


@dataclass
class Restarter:
    url: str
    marker: Path  # the restart command appends to it: it must never exist here (but in the hung tests)
    servers: list[Any]

    async def post(self, body: bytes) -> tuple[int, str]:
        async with aiohttp.ClientSession() as http, http.post(self.url + "/alerts", data=body, headers=HEADERS) as r:
            return r.status, await r.text()

    async def status(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as http, http.get(self.url + "/status", headers=HEADERS) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def finished(self, ids: list[int]) -> list[dict[str, Any]]:
        """The actions `ids`, once every one of them is done."""
        deadline = time.monotonic() + DEADLINE
        while True:
            actions = {a["id"]: a for a in (await self.status())["actions"]}
            if all(actions[i]["phase"] == "done" for i in ids):
                return [actions[i] for i in ids]
            if time.monotonic() > deadline:
                raise AssertionError(f"actions {ids} not done: {[actions[i] for i in ids]}")
            await asyncio.sleep(0.1)


@pytest.fixture
async def restarter(tmp_path, llm_health, sim_server) -> Restarter:
    """`llm-health restarter` for gpu0 and gpu1, two idle simulated vLLM servers."""
    servers = [await sim_server(f"gpu{i}", scenario="idle") for i in range(2)]
    marker = tmp_path / "restarted"
    restart = json.dumps([sys.executable, "-c", f"open({str(marker)!r}, 'a').write('restart\\n')"])
    cfg = tmp_path / "restarter.yml"
    cfg.write_text(
        "restarter:\n"
        "  verify: {interval: 0.2s, hung_after_seconds: 0.4, probe_timeout: 5s, metrics_timeout: 10s}\n"
        "  raw_alert_hold: 0s\n"
        f"  output_dir: '{tmp_path / 'output'}'\n"
        "backends:\n" + "".join(f"  - {{name: gpu{i}, url: '{s.url}', restart: {restart}}}\n" for i, s in enumerate(servers))
    )
    proc = llm_health("restarter", "--config.file", str(cfg), env={"LLM_HEALTH_RESTARTER_TOKEN": TOKEN}).wait_ready()
    return Restarter(proc.url, marker, servers)


_seq = itertools.count(1)


@functools.cache
def captured() -> str:
    return BODY_2447.read_text()


def starts_at() -> str:
    """A fresh startsAt (RFC 3339, as Alertmanager writes it): every alert is a new instance."""
    n = next(_seq)
    return f"2025-03-01T12:{n // 60 % 60:02d}:{n % 60:02d}.{n % 10**9:09d}Z"


def alert(alertname: str = "LLMBackendHung", labels: dict[str, str] | None = None, **fields: Any) -> dict[str, Any]:
    """One alert as Alertmanager 0.21+ writes it (the captured body's shape)."""
    labels = {"alertname": alertname, **({"backend": "gpu0", "severity": "critical"} if labels is None else labels)}
    out = json.loads(captured())["alerts"][0]
    out.update(labels=labels, annotations={"summary": f"{alertname} on {labels.get('backend', '-')}"}, startsAt=starts_at(), fingerprint=fingerprint(labels))
    out.update(fields)
    return out


def body(*alerts: dict[str, Any]) -> bytes:
    """The captured Alertmanager body with these alerts, compact as Go's encoding/json writes it."""
    data = json.loads(captured())
    data.update(receiver="restarter", alerts=list(alerts), groupLabels={}, commonLabels={}, commonAnnotations={})
    return json.dumps(data, separators=(",", ":")).encode()


def padded(pad: str, total: int, **fixed: str) -> dict[str, str]:
    """`fixed` and one more entry `pad`, whose value makes names and values `total` characters."""
    rest = total - sum(len(k) + len(v) for k, v in fixed.items()) - len(pad)
    return {**fixed, pad: "x" * rest}


# --- one case per bound: the body holding `n` (the bound, or one past it) -------------------
FILLERS = MAX_BODY // 60_000 + 1  # Watchdog alerts filling a body: each description under the labels' bound


def body_of_bytes(n: int) -> bytes:
    """A body of exactly n bytes: the plain alert, then Watchdog alerts whose descriptions fill it."""
    fillers = FILLERS
    fill = [alert("Watchdog", labels={"severity": "none"}) for _ in range(fillers)]
    for a in fill:
        a["annotations"] = {"description": ""}
    room = n - len(body(alert(), *fill))
    for i, a in enumerate(fill):
        a["annotations"]["description"] = "x" * (room // fillers + (room % fillers if i == fillers - 1 else 0))
    out = body(alert(), *fill)
    assert len(out) == n
    return out


def body_of_alerts(n: int) -> bytes:
    return body(alert(), *(alert("Watchdog", labels={"severity": "none", "n": str(i)}) for i in range(n - 1)))


def body_of_labels(n: int) -> bytes:
    labels = padded("pad", n, alertname="LLMBackendHung", backend="gpu1", severity="critical")
    return body(alert(), alert(labels=labels))


def body_of_annotations(n: int) -> bytes:
    return body(alert(), alert(labels={"backend": "gpu1"}, annotations=padded("description", n, summary="gpu1 hung")))


def long_starts_at(n: int) -> str:
    """A valid RFC 3339 time of n characters: its fraction of a second is as long as it takes."""
    head = "2025-03-01T12:00:00."
    return head + "1" + "0" * (n - len(head) - 2) + "Z"


def body_of_starts_at(n: int) -> bytes:
    return body(alert(), alert(labels={"backend": "gpu1"}, startsAt=long_starts_at(n)))


def body_of_fingerprint(n: int) -> bytes:
    return body(alert(), alert(labels={"backend": "gpu1"}, fingerprint=("0123456789abcdef" * n)[:n]))


@dataclass(frozen=True)
class Case:
    build: Callable[[int], bytes]
    bound: int
    refused: int  # the status one past the bound
    named: str  # what the refusal must say
    alerts: int  # alerts in the body at the bound
    accepted: int  # of which acted on


CASES = {
    "body bytes": Case(body_of_bytes, MAX_BODY, 413, f"Maximum request body size {MAX_BODY} exceeded", FILLERS + 1, 1),
    "labels": Case(body_of_labels, MAX_LABELS_CHARS, 400, f"alerts[1].labels: more than {MAX_LABELS_CHARS} characters", 2, 2),
    "annotations": Case(body_of_annotations, MAX_LABELS_CHARS, 400, f"alerts[1].annotations: more than {MAX_LABELS_CHARS} characters", 2, 2),
    "startsAt": Case(body_of_starts_at, MAX_FIELD, 400, f"alerts[1].startsAt: missing or longer than {MAX_FIELD} characters", 2, 2),
    "fingerprint": Case(body_of_fingerprint, MAX_FIELD, 400, f"alerts[1].fingerprint: expected a non-empty string of at most {MAX_FIELD}", 2, 2),
}


def test_the_cases_hold_what_they_say():
    """The builders put exactly the bound (as the code counts it) in the body, and one more past it."""
    for n in (MAX_LABELS_CHARS, MAX_LABELS_CHARS + 1):
        labels = json.loads(body_of_labels(n))["alerts"][1]["labels"]
        annotations = json.loads(body_of_annotations(n))["alerts"][1]["annotations"]
        assert sum(len(k) + len(v) for k, v in labels.items()) == n
        assert sum(len(k) + len(v) for k, v in annotations.items()) == n
    for n in (MAX_FIELD, MAX_FIELD + 1):
        assert len(json.loads(body_of_starts_at(n))["alerts"][1]["startsAt"]) == n
        assert len(json.loads(body_of_fingerprint(n))["alerts"][1]["fingerprint"]) == n
    for n in (MAX_ALERTS, MAX_ALERTS + 1):
        assert len(json.loads(body_of_alerts(n))["alerts"]) == n
    for n in (MAX_BODY, MAX_BODY + 1):
        assert len(body_of_bytes(n)) == n


async def accepted(restarter: Restarter, raw: bytes, alerts: int, acted_on: int) -> list[dict[str, Any]]:
    """Post `raw`: it must be answered alert by alert, `acted_on` of them acted on and refused
    `not_hung` (the backend is idle) with nothing restarted. The answers."""
    status, text = await restarter.post(raw)
    assert status == 202, text
    answer = json.loads(text)
    assert answer["accepted"] == acted_on and len(answer["alerts"]) == alerts, answer["accepted"]
    sent = json.loads(raw)["alerts"]
    for got, want in zip(answer["alerts"], sent):
        assert (got["alertname"], got["fingerprint"], got["startsAt"]) == (want["labels"]["alertname"], want["fingerprint"], want["startsAt"])
        assert got["decision"] == ("accepted" if want["labels"]["alertname"] == "LLMBackendHung" else "ignored"), got
    ids = [a["action"] for a in answer["alerts"] if a["decision"] == "accepted"]
    for action, want in zip(await restarter.finished(ids), (a for a in sent if a["labels"]["alertname"] == "LLMBackendHung")):
        assert (action["fingerprint"], action["starts_at"], action["labels"]) == (want["fingerprint"], want["startsAt"], want["labels"])
        assert (action["refusal"], action["outcome"]) == ("not_hung", None), action
    return answer["alerts"]


@pytest.mark.parametrize("name", list(CASES))
async def test_webhook_limit_at_and_one_past_the_bound(restarter, name):
    case = CASES[name]
    at = await accepted(restarter, case.build(case.bound), case.alerts, case.accepted)
    assert at[0]["backend"] == "gpu0"

    before = await restarter.status()
    status, text = await restarter.post(case.build(case.bound + 1))
    assert status == case.refused and case.named in text, (status, text[:500])
    after = await restarter.status()
    assert len(after["actions"]) == len(before["actions"]), "a refused body was acted on"
    assert after["refusals"]["malformed"] == before["refusals"]["malformed"] + (case.refused == 400)

    await accepted(restarter, body(alert(), alert(labels={"backend": "gpu1"})), 2, 2)  # the next good one
    assert not restarter.marker.exists()


# --- past 1,000 alerts: read for the alerts the restarter acts on ---------------------------
async def restart_when_asked(restarter: Restarter, server: Any) -> None:
    """What the restart command would do to a real server: once the marker says it ran, a
    new process, idle."""
    deadline = time.monotonic() + DEADLINE
    while not restarter.marker.exists():
        assert time.monotonic() < deadline, "the hung backend was never restarted"
        await asyncio.sleep(0.05)
    server.restart()
    sim.idle(server)


async def unread_total(restarter: Restarter) -> float:
    async with aiohttp.ClientSession() as http, http.get(restarter.url + "/metrics") as r:
        text = await r.text()
    (line,) = [x for x in text.splitlines() if x.startswith("llm_restarter_unread_alerts_total ")]
    return float(line.split()[1])


async def test_past_max_alerts_a_hung_alert_at_the_end_is_acted_on(restarter):
    """1,499 alerts the restarter does not act on, then an LLMBackendHung for gpu1, which is
    hung: answered 202 (never a 400 for the count), only the hung alert read and answered, the
    others counted unread, gpu1 restarted once and back."""
    sim.hang(restarter.servers[1])
    raw = body(*(alert("KubeJobFailed", labels={"severity": "warning", "n": str(i)}) for i in range(1499)), alert(labels={"backend": "gpu1"}))
    status, text = await restarter.post(raw)
    assert status == 202, text[:500]
    answer = json.loads(text)
    assert (answer["accepted"], answer["unread"], answer["unread_watched"]) == (1, 1499, 0)
    ((a,),) = [answer["alerts"]]
    assert (a["alertname"], a["backend"], a["decision"]) == ("LLMBackendHung", "gpu1", "accepted")
    await restart_when_asked(restarter, restarter.servers[1])
    (action,) = await restarter.finished([a["action"]])
    assert (action["verification"]["state"], action["outcome"]) == ("hung", "recovered"), action
    assert restarter.marker.read_text() == "restart\n"
    assert await unread_total(restarter) == 1499


async def test_a_real_alertmanager_notification_of_1500_alerts_with_a_hang_inside(restarter, alertmanager_factory, tmp_path):
    """A real Alertmanager groups 1,500 alerts into one notification (a route without
    max_alerts, grouped by one label they share) and sends it to the real restarter process:
    the one hung backend among them is restarted, and Alertmanager records no failed
    notification (a 400 it would not retry)."""
    token = tmp_path / "am-token"
    token.write_text(TOKEN + "\n")
    config = {
        "route": {"receiver": "restarter", "group_by": ["fleet"], "group_wait": "1s", "group_interval": "10m", "repeat_interval": "1h"},
        "receivers": [
            {
                "name": "restarter",
                "webhook_configs": [
                    {
                        "url": restarter.url + "/alerts",
                        "send_resolved": False,
                        "http_config": {"authorization": {"type": "Bearer", "credentials_file": str(token)}},
                    }
                ],
            }
        ],
    }
    am = alertmanager_factory(json.dumps(config))
    sim.hang(restarter.servers[1])
    others = [{"labels": {"alertname": "KubeJobFailed", "fleet": "a", "severity": "warning", "n": str(i)}} for i in range(1499)]
    hung = {"labels": {"alertname": "LLMBackendHung", "fleet": "a", "severity": "critical", "backend": "gpu1"}, "annotations": {"summary": "gpu1 hung"}}
    am.post_alerts([*others[:700], hung, *others[700:]])
    await restart_when_asked(restarter, restarter.servers[1])
    deadline = time.monotonic() + DEADLINE
    while not (actions := (await restarter.status())["actions"]) or actions[0]["phase"] != "done":
        assert time.monotonic() < deadline, actions
        await asyncio.sleep(0.1)
    (action,) = actions
    assert (action["backend"], action["outcome"]) == ("gpu1", "recovered"), action
    assert await unread_total(restarter) == 1499  # one notification of 1,500: all but the hung one unread
    async with aiohttp.ClientSession() as http, http.get(am.url + "/metrics") as r:
        metrics = await r.text()
    failed = [x for x in metrics.splitlines() if x.startswith("alertmanager_notifications_failed_total") and 'integration="webhook"' in x]
    assert failed and all(x.endswith(" 0") for x in failed), failed
    sent = [x for x in metrics.splitlines() if x.startswith("alertmanager_notifications_total") and 'integration="webhook"' in x]
    assert sent and float(sent[0].split()[-1]) == 1, sent


async def test_at_max_alerts_every_alert_is_answered_and_past_it_only_the_watched(restarter):
    await accepted(restarter, body_of_alerts(MAX_ALERTS), MAX_ALERTS, 1)
    status, text = await restarter.post(body_of_alerts(MAX_ALERTS + 1))
    answer = json.loads(text)
    assert (status, answer["accepted"], len(answer["alerts"]), answer["unread"]) == (202, 1, 1, MAX_ALERTS), text[:300]
    await restarter.finished([answer["alerts"][0]["action"]])
    assert not restarter.marker.exists()
