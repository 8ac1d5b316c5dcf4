"""The figures the README and the docs quote from a benchmark are those of the
section of docs/benchmarks.md that measures it, and name that section: a new run of the
benchmark that moves a figure fails here until the quote follows, and a quote left from an
older run (73-79 s where the doc's run measured 63.1-74.2 s) cannot stand.

- loop_recovery (a real hang to its restart): every range of seconds in a paragraph or
  table row that names the section is one of its table's ranges; a projection says
  `projected` and adds to its worst measured figure; a paragraph that quotes seconds to
  the restart command names the section.
- bench_decision (a day of watchdogs): the README's restart counts of the naive watchdog
  are its table's, at each share of busy requests answered (tests/unit/test_replay.py
  holds the replay itself to them).
- bench_admission (the doors side by side): docs/admission.md's CPU ratios of the gate,
  `decide` and the Lua door are the section's.
"""

from __future__ import annotations

import re

from bench.summary import DOC, blocks

from tests.fixtures.paths import ROOT

README = ROOT / "README.md"
RESTARTS = ROOT / "docs" / "restarts.md"
ADMISSION = ROOT / "docs" / "admission.md"
RANGE = re.compile(r"(\d+(?:\.\d+)?)\s*[-–]\s*(\d+(?:\.\d+)?) s\b")


def section(name: str) -> str:
    (body,) = [b.body for b in blocks(DOC.read_text()) if b.name == name]
    return body


def rows(body: str, sep: str = "|") -> dict[str, list[str]]:
    """A table in the section's output, by its first cell: the other cells."""
    out = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(sep)]
        if len(cells) > 2 and not set(cells[1]) <= set("-:"):
            out[cells[0]] = cells[1:]
    return out


def loop_runs() -> dict[str, list[float]]:
    """loop_recovery's table: an event -> its seconds in each run."""
    return {
        k: [float(v) for v in vals]
        for k, vals in rows(section("loop_recovery")).items()
        if k.startswith(("exporter", "**restart", "vLLM", "capture", "LLMBackendHung firing", "VLLMEngineHung firing"))
    }


def span(values: list[float], digits: int = 1) -> str:
    return f"{min(values):.{digits}f}–{max(values):.{digits}f} s"


def measured() -> dict[str, str]:
    runs = loop_runs()
    gap = [b - a for a, b in zip(runs["VLLMEngineHung firing"], runs["LLMBackendHung firing"], strict=True)]
    return {
        "hung": span(runs["exporter `hung`"]),
        "restart": span(runs["**restart command starts**"]),
        "ready": span(runs["vLLM ready again (`recovered`)"]),
        "capture": span(runs["capture of the incident record took (s, before the restart command)"], 2),
        "evidence after the raw alert": span(gap),
    }


def paragraphs(text: str) -> list[str]:
    """Paragraphs, and each table row on its own."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.splitlines()
        out.extend(lines) if lines and lines[0].startswith("|") else out.append(" ".join(lines))
    return out


def test_the_loop_recovery_figures_quoted_are_the_sections_and_name_it():
    want = measured()
    quoted = {
        "README.md": ("restart",),
        "docs/restarts.md": ("restart", "capture", "ready", "hung", "evidence after the raw alert"),
        "docs/deploy.md": ("restart", "hung"),  # the scrape intervals' paragraph, moved from the README
    }
    for rel, keys in quoted.items():
        text = (ROOT / rel).read_text()
        for key in keys:
            assert want[key] in text, f"{rel} does not quote loop_recovery's {key}: {want[key]}"
        for para in paragraphs(text):
            ranges = {f"{m[1]}–{m[2]} s" for m in RANGE.finditer(para)}
            if "loop_recovery" in para:
                assert ranges <= set(want.values()), f"{rel}: {sorted(ranges - set(want.values()))} is no figure of loop_recovery: {para[:300]}"
            else:
                assert not ("restart command" in para and ranges), (
                    f"{rel} quotes {sorted(ranges)} to the restart command without naming loop_recovery: {para[:300]}"
                )


def test_a_projection_says_so_and_adds_to_the_worst_measured_proof():
    worst = max(loop_runs()["exporter `hung`"])
    found = re.findall(r"up to ([\d.]+) \+ (\d+) \+ 1 = ([\d.]+) s \(projected\)", RESTARTS.read_text())
    assert len(found) == 2, found
    for proof, bound, total in found:
        assert float(proof) == worst and abs(float(total) - (worst + int(bound) + 1)) < 0.05, (proof, bound, total)


def test_the_readmes_day_of_naive_restarts_is_bench_decisions_table():
    table = rows(section("bench_decision"))
    header = ["restarts", "false_restarts", "true_restarts"]

    def counts(row: str) -> tuple[int, ...]:
        return tuple(int(table[row][i]) for i in range(len(header)))

    (para,) = [p for p in paragraphs(README.read_text()) if "bench.bench_decision" in p and "restarts" in p]
    assert "section bench_decision" in para and "`naive_busy_success` 0" in para, para
    m = re.search(r"makes the same (\d+) restarts \((\d+) of a healthy server, (\d+) for the one real hang\)", para)
    assert m and tuple(map(int, m.groups())) == counts("naive"), (para, table["naive"])
    assert f"that meant {counts('naive')[0]} restarts" in para  # the field report's count, which the replay reproduces
    m = re.search(r"where a quarter of them do, (\d+) restarts; half, (\d+)", para)
    assert m and (int(m[1]), int(m[2])) == (counts("naive, 25% answered when busy")[0], counts("naive, 50% answered when busy")[0]), para


def test_the_documented_door_costs_are_bench_admissions_cpu_lines():
    """docs/admission.md's CPU ratios of the gate, `decide` and the Lua door (its "In short",
    moved from the README) are the section's "CPU per request at 500 req/s" lines, as printed."""
    body = section("bench_admission")
    ratio = {m[1]: m[2] for m in re.finditer(r"^CPU per request at 500 req/s: (.+?) \d\.\d{3} ms / nginx \d\.\d{3} ms = (\d+\.\d\d)$", body, re.M)}
    (para,) = [p for p in paragraphs(ADMISSION.read_text()) if "Admission doors side by side" in p and "Lua door spends" in p]
    quoted = {
        "gate": re.search(r"gate's own CPU per request is (\d+\.\d\d)x", para),
        "decide": re.search(r"`decide` (\d+\.\d\d)x", para),
        "the Lua door": re.search(r"Lua door spends (\d+\.\d\d)x", para),
    }
    for role, m in quoted.items():
        assert m and m[1] == ratio[role], (role, m and m[1], ratio)
    # the README's gate paragraph quotes the gate's and the Lua door's, with its advice
    (readme,) = [p for p in paragraphs(README.read_text()) if "Admission doors side by side" in p]
    for role, pattern in (("gate", r"gate's own CPU per\s+request is (\d+\.\d\d)x"), ("the Lua door", r"Lua door spends (\d+\.\d\d)x")):
        m = re.search(pattern, readme)
        assert m and m[1] == ratio[role], (role, m and m[1], ratio)
    assert "For production at high" in readme
