"""The summary of docs/benchmarks.md, computed from the doc's section blocks and git.

Each section is a block `bench/snapshot.py` wrote from one run of one benchmark: the commit it
ran at, the date, the paths it measures, the output. This lists, per section, that commit and
those paths, and whether the section is **stale**: one of its paths changed between that
commit and the work tree (`git diff --name-only COMMIT -- PATHS`), or the commit is not in
this history. Then every goal line the outputs printed, with the verdict as printed and the
section's freshness beside it: the summary says nothing the runs did not, and shows which
figures no longer describe the code.

    python -m bench.summary            # print the summary
    python -m bench.summary --write    # put it into docs/benchmarks.md between the markers

tests/unit/test_benchmarks_doc.py fails when the doc's summary differs from what this
computes, so a doc claiming fresh figures for changed code fails the tests: rerun the
benchmark (`make bench`), or `python -m bench.summary --write` to mark it stale.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
GOAL = re.compile(r"^goal: (?P<goal>.+); measured: (?P<measured>.+): (?P<verdict>met|NOT met)$")
START = "<!-- summary: made by `python -m bench.summary --write` from the section blocks below and git; do not edit by hand -->"
END = "<!-- end of summary -->"
BLOCK = re.compile(r"^<!-- bench (?P<name>[a-z_]+) (?P<fields>[^\n]*?) -->\n(?P<body>.*?)^<!-- end bench (?P=name) -->$", re.M | re.S)
NOT_RUN = "none"


@dataclass(frozen=True)
class Block:
    name: str
    commit: str  # the full hash the benchmark ran at, or NOT_RUN
    date: str
    paths: tuple[str, ...]
    body: str

    def fields(self) -> str:
        return f"commit={self.commit} date={self.date} paths={','.join(self.paths)}"


def parse_fields(name: str, fields: str) -> tuple[str, str, tuple[str, ...]]:
    values = dict(f.split("=", 1) for f in fields.split() if "=" in f)
    missing = {"commit", "date", "paths"} - set(values)
    if missing:
        raise ValueError(f"{DOC.name}: the block of {name} lacks {sorted(missing)}")
    return values["commit"], values["date"], tuple(p for p in values["paths"].split(",") if p)


def blocks(text: str) -> list[Block]:
    """Every section block of the doc, in order."""
    out = []
    for m in BLOCK.finditer(text):
        commit, date, paths = parse_fields(m["name"], m["fields"])
        out.append(Block(m["name"], commit, date, paths, m["body"]))
    return out


def goals(body: str) -> list[tuple[str, str, bool]]:
    """(goal, measured, met) for every goal line inside a code block of a section's body."""
    rows, in_code = [], False
    for line in body.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif in_code and (m := GOAL.match(line.strip())):
            rows.append((m["goal"], m["measured"], m["verdict"] == "met"))
    return rows


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)


def staleness(block: Block, root: Path = ROOT) -> str:
    """'fresh', 'not run', or why the section is stale."""
    if block.commit == NOT_RUN:
        return "not run"
    if _git(root, "cat-file", "-e", f"{block.commit}^{{commit}}").returncode != 0:
        return "stale: its commit is not in this history"
    diff = _git(root, "diff", "--name-only", block.commit, "--", *block.paths)
    if diff.returncode != 0:
        raise RuntimeError(f"git diff {block.commit} failed: {diff.stderr.strip()}")
    changed = diff.stdout.split()
    if not changed:
        return "fresh"
    return f"stale: {len(changed)} measured file{'s' if len(changed) != 1 else ''} changed since"


def cell(s: str) -> str:
    return s.replace("|", "\\|")


def render(found: list[Block], root: Path = ROOT) -> str:
    """The summary: a row per section: when it ran, stale or fresh, how many of its goal
    lines were met (each goal line, met or NOT met, is in the section's output), and the
    paths it measures."""
    marks = {b.name: staleness(b, root) for b in found}
    by_section = {b.name: goals(b.body) for b in found}
    lines = [START, "", "| section | ran at | status | goals met | measures |", "|---|---|---|---|---|"]
    for b in found:
        at = "not run" if b.commit == NOT_RUN else f"`{b.commit[:12]}`, {b.date}"
        status = marks[b.name] if marks[b.name] in ("fresh", "not run") else f"**{marks[b.name]}**"
        met = by_section[b.name]
        tally = f"{sum(1 for g in met if g[2])} of {len(met)}" if met else "-"
        if met and not all(g[2] for g in met):
            tally = f"**{tally}**"
        lines.append(f"| {b.name} | {at} | {cell(status)} | {tally} | {cell(', '.join(f'`{p}`' for p in b.paths))} |")
    rows = [(name, *g) for name, gs in by_section.items() for g in gs]
    fresh = [r for r in rows if marks[r[0]] == "fresh"]
    lines += [
        "",
        f"{sum(1 for r in fresh if r[3])} of {len(fresh)} goal lines of fresh sections met; "
        f"{sum(1 for r in rows if r[3])} of {len(rows)} in all; "
        f"{sum(1 for m in marks.values() if m == 'fresh')} of {len(marks)} sections fresh.",
        "",
        END,
    ]
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
    ap.add_argument("--doc", type=Path, default=DOC, help="the file to read and write (default docs/benchmarks.md)")
    args = ap.parse_args(argv)
    text = args.doc.read_text(encoding="utf-8")
    table = render(blocks(text))
    if args.write:
        args.doc.write_text(text.replace(current(text), table), encoding="utf-8")
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
