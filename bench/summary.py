"""The summary table of docs/benchmarks.md, computed from the goal lines in the outputs
pasted there: each benchmark prints `goal: ...; measured: ...: met|NOT met` (bench/_goal.py),
and this lists every such line, under the section it was pasted in, so the summary can
say nothing the runs did not.

    python -m bench.summary            # print the table
    python -m bench.summary --write    # put it into docs/benchmarks.md between the markers
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
GOAL = re.compile(r"^goal: (?P<goal>.+); measured: (?P<measured>.+): (?P<verdict>met|NOT met)$")
START = "<!-- summary: made by `python -m bench.summary --write` from the goal lines below; do not edit by hand -->"
END = "<!-- end of summary -->"


def goals(text: str) -> list[tuple[str, str, str, bool]]:
    """(section, goal, measured, met) for every goal line inside a code block, in order."""
    rows = []
    section, in_code = "", False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("## "):
            section = line[3:].strip()
        elif in_code and (m := GOAL.match(line.strip())):
            rows.append((section, m["goal"], m["measured"], m["verdict"] == "met"))
    return rows


def render(rows: list[tuple[str, str, str, bool]]) -> str:
    lines = [START, "", "| section | goal | measured | met? |", "|---|---|---|---|"]
    for section, goal, measured, met in rows:
        cell = lambda s: s.replace("|", "\\|")  # noqa: E731
        lines.append(f"| {cell(section)} | {cell(goal)} | {cell(measured)} | {'met' if met else '**not met**'} |")
    met = sum(1 for *_, ok in rows if ok)
    lines += ["", f"{met} of {len(rows)} goal lines met.", "", END]
    return "\n".join(lines)


def current(text: str) -> str:
    """What docs/benchmarks.md holds between the markers (with them)."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{DOC}: no summary markers")
    return text[start : end + len(END)]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    text = DOC.read_text(encoding="utf-8")
    table = render(goals(text))
    if args.write:
        DOC.write_text(text.replace(current(text), table), encoding="utf-8")
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
