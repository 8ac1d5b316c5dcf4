"""Reload on real processes: `llm-health serve`, `gate` and `restarter` re-read their file
on `POST /-/reload` and on SIGHUP; a good file is picked up (seen on /status or /metrics),
a bad one is refused with its error (a 400, or "reload refused" in the log) and the
running configuration is kept and still served (README.md, "Commands"; docs/exporter.md, "Flags")."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from llm_health.sim.servers import dead_url
from tests.fixtures.procs import LlmHealth
from tests.fixtures.websec import RESTARTER_ENV, TOKEN, call, exporter_config, gate_config, metric_lines, poll, restarter_config

Observe = Callable[[], Awaitable[object]]


@dataclass
class Case:
    """One server, its file, and what reloading it should show."""

    proc: LlmHealth
    path: Path
    write_good: Callable[[], object]  # a file that changes what `observe` sees
    write_bad: Callable[[], object]  # a file with one bad key, and changes that must not be applied
    bad_key: str
    observe: Observe
    before: object  # what `observe` sees with the file the server started with
    after: object  # ... with the good file


def exporter_case(tmp_path: Path, llm_health: type[LlmHealth], redis_url: str) -> Case:
    path = tmp_path / "exporter.yml"
    proc = llm_health("serve", "--config.file", exporter_config(path, ["gpu0"])).wait_ready()

    async def backends() -> object:
        return sorted(b["backend"] for b in (await call(proc.url + "/status")).json()["backends"])

    return Case(
        proc,
        path,
        lambda: exporter_config(path, ["gpu0", "gpu1"]),
        lambda: exporter_config(path, ["gpu0", "gpu1", "gpu2"], global_extra=", hung_after_seconds: .nan"),
        "global.hung_after_seconds",
        backends,
        ["gpu0"],
        ["gpu0", "gpu1"],
    )


def gate_case(tmp_path: Path, llm_health: type[LlmHealth], redis_url: str) -> Case:
    path = tmp_path / "gate.yml"
    upstream = dead_url()
    proc = llm_health("gate", "--config.file", gate_config(path, redis_url, upstream, {"chat": "open"})).wait_ready()

    async def routes() -> object:
        closed = metric_lines((await call(proc.url + "/metrics")).text, "llm_gate_route_closed")
        # a request routed to `batch`: unknown (400) before the reload, refused as closed (503) after
        # (90 s to live: a closed route's Retry-After of 30 s still lands before its deadline)
        headers = {"X-Route": "batch", "X-Request-Id": "reload-probe", "X-Request-Timeout-Ms": "90000"}
        answer = await call(proc.url + "/v1/completions", "POST", headers=headers, body={"model": "m"})
        return closed, answer.status

    return Case(
        proc,
        path,
        lambda: gate_config(path, redis_url, upstream, {"chat": "open", "batch": "reject_all"}),
        lambda: gate_config(
            path, redis_url, upstream, {"chat": "open", "batch": "reject_all", "more": "open"}, admission_extra=", reject_if_retry_count_gte: -1"
        ),
        "admission.reject_if_retry_count_gte",
        routes,
        ({'{route="chat"}': 0.0}, 400),
        ({'{route="chat"}': 0.0, '{route="batch"}': 1.0}, 503),
    )


def restarter_case(tmp_path: Path, llm_health: type[LlmHealth], redis_url: str) -> Case:
    path = tmp_path / "restarter.yml"
    proc = llm_health("restarter", "--config.file", restarter_config(path, ["gpu0"]), env=RESTARTER_ENV).wait_ready()

    async def settings() -> object:
        status = (await call(proc.url + "/status", headers={"Authorization": f"Bearer {TOKEN}"})).json()
        exhausted = metric_lines((await call(proc.url + "/metrics")).text, "llm_restarter_budget_exhausted")
        return sorted(b["backend"] for b in status["backends"]), status["budget"]["max_restarts"], sorted(exhausted)

    return Case(
        proc,
        path,
        lambda: restarter_config(path, ["gpu0", "gpu1"], max_restarts=7),
        lambda: restarter_config(path, ["gpu0", "gpu1", "gpu2"], max_restarts=9, budget_extra=", backoff: 1000"),
        "restarter.budget.backoff",
        settings,
        (["gpu0"], 3, ['{backend="gpu0"}']),
        (["gpu0", "gpu1"], 7, ['{backend="gpu0"}', '{backend="gpu1"}']),
    )


CASES = {"serve": exporter_case, "gate": gate_case, "restarter": restarter_case}


@pytest.fixture(params=sorted(CASES))
def case(request, tmp_path, llm_health) -> Case:
    # the gate keeps its queue in a real redis-server; the others need none
    redis_url = request.getfixturevalue("redis_url") if request.param == "gate" else ""
    return CASES[request.param](tmp_path, llm_health, redis_url)


async def sees(case: Case, wanted: object, what: str) -> None:
    async def check() -> bool | None:
        return True if await case.observe() == wanted else None

    try:
        await poll(check, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen {await case.observe()!r}, wanted {wanted!r}\n{case.proc.output()}") from None


async def test_post_reload_picks_up_a_good_file_and_refuses_a_bad_one(case: Case):
    assert await case.observe() == case.before
    case.write_good()
    answer = await call(case.proc.url + "/-/reload", "POST")
    assert answer.status == 200 and answer.json()["reloaded"] is True, answer
    await sees(case, case.after, "the good file's configuration")

    case.write_bad()
    answer = await call(case.proc.url + "/-/reload", "POST")
    assert answer.status == 400, answer
    body = answer.json()
    assert body["reloaded"] is False and body["detail"].startswith(f"{case.path}: {case.bad_key}: "), body
    assert await case.observe() == case.after  # the running configuration, kept
    assert "reload refused, configuration kept: " + body["detail"] in case.proc.output()
    assert case.proc.proc.poll() is None


async def test_sighup_picks_up_a_good_file_and_refuses_a_bad_one(case: Case):
    assert await case.observe() == case.before
    case.write_good()
    case.proc.proc.send_signal(signal.SIGHUP)
    await sees(case, case.after, "the good file's configuration after SIGHUP")

    case.write_bad()
    case.proc.proc.send_signal(signal.SIGHUP)
    refusal = f"reload refused, configuration kept: {case.path}: {case.bad_key}: "

    async def refused() -> bool | None:
        return True if refusal in case.proc.output() else None

    try:
        await poll(refused, "the refusal in the log")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{case.proc.output()}") from None
    assert case.proc.proc.poll() is None
    assert await case.observe() == case.after  # the running configuration, kept and served
    assert (await call(case.proc.url + "/-/healthy")).status == 200
