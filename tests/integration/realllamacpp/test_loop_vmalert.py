"""The whole loop with VictoriaMetrics as the monitoring engine, on a real llama.cpp
llama-server: the same exporter, restarter and Alertmanager with the same committed files
as test_loop_llamacpp.py, and in place of Prometheus single-node victoria-metrics scraping
the same jobs (`-promscrape.config`) and vmalert evaluating the same rule files
(rules/fast/, compose's intervals) against it and notifying that Alertmanager
(tests/fixtures/loop.py, `monitoring="victoriametrics"`; docs/victoriametrics.md).

Phases as in test_loop_llamacpp.py: (1) two long generations in flight on a throttled
server for 70 s: no hung alert (neither LLMBackendHung nor LlamaCppServerHung, in any
state), no webhook. (2) The inference loop stopped inside a decode: the exporter says
hung, vmalert's LLMBackendHung fires with the evidence its `query` template renders, the
restarter confirms it from that evidence and restarts exactly once, `recovered`, the alert
resolves. (3) Duplicates and wrong tokens: nothing more happens. Then what vmalert wrote
back into victoria-metrics: the ALERTS series of the hang (its `-remoteWrite.url`: what a
restarted vmalert restores `for:` state from through `-remoteRead.url`) and the evidence record
`instance:llamacpp_scrapes:count2m` at llamacpp.evidence_samples or more (15 s scrapes).

VictoriaMetrics answers an instant query for the last 30 s (`-search.latencyOffset`, kept
at its default, as a user runs it) as of 30 s ago; vmalert sends no `nocache`, so its
alerts come about 30 s later than Prometheus' (the timeline shows it). Every wait here is
on a condition with a generous bound.
"""

from __future__ import annotations

import time

import pytest
import yaml

from tests.fixtures.ci import require
from tests.fixtures.loop import STACKS, Loop
from tests.fixtures.stack import wait_until
from tests.fixtures.summary import show
from tests.fixtures.victoriametrics import install_problem
from tests.integration.realllamacpp.test_loop_llamacpp import llamacpp_loop, slow_and_busy

pytestmark = pytest.mark.realllamacpp


def _evidence_samples(loop: Loop) -> tuple[str, int]:
    """The llama.cpp scrape-count record of the stack's rule file and the scrapes its hung alert needs."""
    rules = yaml.safe_load((STACKS[loop.stack] / "llamacpp.rules.yml").read_text())
    (alert,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "LlamaCppScrapeTooSlow"]
    record, _, needed = alert["expr"].strip().partition(" < ")
    return record.removeprefix("min_over_time(").split("[", 1)[0], int(needed)


def test_the_whole_loop_with_vmalert(llamacpp_server_factory, tmp_path):
    require(install_problem("victoria-metrics", "vmalert"))
    srv = llamacpp_server_factory()
    old_header = srv.start_header()
    loop = llamacpp_loop(tmp_path, srv, monitoring="victoriametrics")
    load = None
    try:
        load = slow_and_busy(srv, loop)

        # --- (2) the inference loop stopped inside a decode: vmalert's alert, one restart, back ---------
        with srv.frozen_in_decode() as freeze:
            t0 = time.time() - (time.monotonic() - freeze.frozen_at)
            action = loop.follow(t0, on_restarted=srv.adopt)
        loop.print_timeline("recovery timeline on llama.cpp with VictoriaMetrics and vmalert, seconds after the inference loop stopped:")
        assert action["outcome"] == "recovered" and action["restart_seen"] is True, action
        v = action["verification"]
        assert (v["method"], v["state"], v["reads"]) == ("evidence", "hung", 2), v  # vmalert's `query` template gave the exporter's digests
        expected = {"exporter says hung", "LLMBackendHung firing", "webhook LLMBackendHung reaches the restarter", "hung alerts resolved"}
        assert expected <= set(loop.timeline), loop.timeline
        assert srv.start_header() != old_header
        load.cancel()

        # --- (3) duplicates, concurrent deliveries, wrong tokens ------------------------------------
        loop.after(action)

        # --- what vmalert wrote back into victoria-metrics ----------------------------------------------
        fired = loop.prom.query('max_over_time(ALERTS{alertname="LLMBackendHung", alertstate="firing"}[30m])')
        assert [s["metric"]["backend"] for s in fired] == ["gpu0"], fired
        record, needed = _evidence_samples(loop)
        counts = wait_until(
            lambda: [float(s["value"][1]) for s in loop.prom.query(f'{record}{{job="llamacpp"}}') if float(s["value"][1]) >= needed],
            timeout=240,
            interval=2,
            what=f"{record} to reach {needed} (two windows of scraping)",
        )
        show(f"vmalert: ALERTS{{alertname=LLMBackendHung}} written back; {record} = {counts[0]:g} (the hung alert needs {needed})")
    finally:
        loop.stop()
        if load is not None:
            load.cancel()
