"""docs/limits.md states each limit's default; these are the code's defaults, read from the
doc's tables and sentences, so the doc cannot drift from the code (what each limit does is
tested at and past its bound in test_payload_limits.py, test_webhook_limits.py and
test_gate_and_restarter.py)."""

from __future__ import annotations

import re

from llm_health.config.exporter import ProbeConfig, Timing
from llm_health.core import webhook
from llm_health.core.engines import Limits
from llm_health.gate import headers
from llm_health.gate.headers import BadRequest, read_tenant
from llm_health.probe import client, fast_http, pieces
from llm_health.restarter import app as restarter
from tests.fixtures.paths import ROOT

DOC = (ROOT / "docs" / "limits.md").read_text()
UNITS = {"": 1, "KiB": 1024, "MiB": 1024**2}


def number(text: str) -> int:
    """`16 MiB`, `64 KiB`, `10,000`, `256` as a number."""
    m = re.fullmatch(r"\s*([\d,]+)\s*(KiB|MiB|)\s*", text)
    assert m, f"not a number docs/limits.md could mean: {text!r}"
    return int(m.group(1).replace(",", "")) * UNITS[m.group(2)]


def table(header: str) -> list[list[str]]:
    """The rows of the doc's table whose header line starts with `header`, cells stripped."""
    lines = DOC.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    assert start is not None, f"docs/limits.md has no table {header!r}"
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def sentence(pattern: str) -> re.Match[str]:
    """`pattern` in the doc's text with its line breaks as spaces."""
    m = re.search(pattern, " ".join(DOC.split()))
    assert m, f"docs/limits.md no longer says {pattern!r}"
    return m


def test_per_backend_payload_limits_are_the_code_defaults():
    rows = {row[2]: number(row[1]) for row in table("| limit | default | key (`global:` or per backend)")}
    assert rows == {
        "`max_metrics_bytes`": Timing.max_metrics_bytes,
        "`max_engines`": Limits.max_engines,
        "`max_samples`": Limits.max_samples,
        "`max_label_length`": Limits.max_label_length,
        "(fixed)": client.SMALL_BODY,
    }
    # The exporter's configuration and the reader agree on the defaults the doc states.
    assert (Timing.max_engines, Timing.max_samples, Timing.max_label_length) == (Limits.max_engines, Limits.max_samples, Limits.max_label_length)
    assert Timing.max_metrics_bytes == client.DEFAULT_MAX_BYTES


def test_probe_limits_are_the_code_defaults():
    rows = {row[2]: row[1] for row in table("| limit | default | key |")}
    assert number(rows["`global.max_probe_targets`"]) == Timing.max_probe_targets
    assert number(rows["`probe.max_engines`"]) == ProbeConfig.max_engines
    assert rows["`probe.allowed_targets` (regular expressions, full match on the normalised target URL)"] == "any http(s) URL"
    assert ProbeConfig.allowed_targets == ()
    assert rows["`probe.enabled`"] == "on" and ProbeConfig.enabled is True


def test_the_metrics_head_caps_are_the_code_constants():
    m = sentence(
        r"capped too, at ([\d,]+ (?:KiB|MiB)) and ([\d,]+) header lines \(fixed\): past either the read fails with \"response head larger than ([\d,]+) bytes\" or \"more than ([\d,]+) response headers\""
    )
    assert [number(g) for g in m.groups()] == [fast_http.MAX_HEAD, fast_http.MAX_HEADERS, fast_http.MAX_HEAD, fast_http.MAX_HEADERS]


def test_the_kept_connection_numbers_are_the_code_constants():
    m = sentence(r"for the next round, (\d+) s at most; at most half the exporter's open-file limit")
    assert float(m.group(1)) == fast_http.KEEP_IDLE
    m = sentence(r"before (two) rounds in a row came .* is read with `Connection: close` for the next (\d+) rounds")
    assert ({"two": 2}[m.group(1)], int(m.group(2))) == (fast_http.MISSES, fast_http.PLAIN_READS)


def test_payload_pieces_are_the_code_size():
    assert number(sentence(r"A payload is parsed in pieces of ([\d,]+ (?:KiB|MiB)) cut at line ends").group(1)) == pieces.PIECE


def test_webhook_limits_are_the_code_constants():
    m = sentence(
        r"At most ([\d,]+ (?:KiB|MiB)) \(a larger body is answered 413\); JSON nested too deeply, more than ([\d,]+) characters of labels in one "
        r"alert, or a `startsAt` or `fingerprint` over ([\d,]+) characters is refused as malformed \(400"
    )
    assert [number(g) for g in m.groups()] == [restarter.MAX_BODY, webhook.MAX_LABELS_CHARS, webhook.MAX_FIELD]
    alerts = sentence(r"A notification of up to ([\d,]+) alerts is read and validated whole")
    past = sentence(r"wherever they are in the body, up to the first ([\d,]+) of them")
    shipped = sentence(r"configurations set `max_alerts: ([\d,]+)` on every webhook")
    assert number(alerts.group(1)) == number(past.group(1)) == number(shipped.group(1)) == webhook.MAX_ALERTS
    assert number(sentence(r"A body past ([\d,]+ (?:KiB|MiB)) is parsed off the event").group(1)) == restarter.PARSE_IN_THREAD_OVER


def span(text: str, rest: str = "") -> tuple[int, int]:
    """`0 to 1,000` (followed by `rest`, a pattern) as (0, 1000)."""
    m = re.fullmatch(r"([\d,]+) to ([\d,]+)" + rest, text)
    assert m, f"not a range docs/limits.md could mean: {text!r}"
    return number(m.group(1)), number(m.group(2))


def test_gate_header_ranges_are_the_code_constants():
    rows = {row[0]: row[1] for row in table("| header | range |")}
    assert rows["`X-Request-Deadline-Ms`"] == "Unix ms, from a day ago to a week ahead"
    assert (headers.DEADLINE_PAST_MS, headers.MAX_TIMEOUT_MS) == (86_400_000, 7 * 86_400_000)
    assert span(rows["`X-Request-Timeout-Ms`, `X-Envoy-Expected-Rq-Timeout-Ms`"]) == (0, headers.MAX_TIMEOUT_MS)
    assert span(rows["`X-Retry-Count`, `X-Stainless-Retry-Count`, `X-Retry-Attempt`"]) == (0, headers.MAX_RETRY_COUNT)
    assert span(rows["`X-Request-Id`, `Idempotency-Key`"], " printable ASCII characters, no spaces") == (1, headers.MAX_ID_LENGTH)
    low, high = span(rows["`X-Tenant`"], r" of letters, digits and `_ \. : -`")
    # The tenant's bound lives in a regular expression: read it by what it accepts.
    assert low == 1 and read_tenant({"X-Tenant": "t" * high}) == "t" * high
    for bad in ("", "t" * (high + 1)):
        try:
            read_tenant({"X-Tenant": bad})
        except BadRequest:
            continue
        raise AssertionError(f"X-Tenant {bad!r} was accepted")
