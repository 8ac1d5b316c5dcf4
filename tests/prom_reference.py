"""prometheus_client's reading of a payload, in the shape `llm_health.exposition.parse`
returns, for comparing the two (tests/test_exposition.py, bench/bench_parse.py)."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

_COUNTER_TYPE = re.compile(r"^\s*#\s+TYPE\s+(\S+)\s+counter\s*$", re.M)


def reference(text: str) -> dict:
    """prometheus_client's samples as {sample name: [(labels, value)]}, sample names as
    written: prometheus_client appends `_total` to the samples of a counter family whose
    name lacks it; that is undone here (our parser keeps names as written)."""
    bare_counters = {n for n in _COUNTER_TYPE.findall(text) if not n.endswith("_total")}
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if family.type == "counter" and family.name in bare_counters and name == family.name + "_total":
                name = family.name
            out.setdefault(name, []).append((s.labels, float(s.value)))
    return out
