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
FAILED = re.compile(r"^FAILED: (?P<goal>.+); (?P<failures>.+): no figure judged$")  # bench/_unjudged.py failed_line
PROJECTED = re.compile(r"^projected: (?P<what>.+); (?P<figure>[^;]+)$")  # bench/_unjudged.py projected_line
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


def _code_lines(body: str) -> list[str]:
    """The lines inside the code blocks of a section's body, stripped."""
    rows, in_code = [], False
    for line in body.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif in_code:
            rows.append(line.strip())
    return rows


def goals(body: str) -> list[tuple[str, str, bool]]:
    """(goal, measured, met) for every goal line inside a code block of a section's body."""
    return [(m["goal"], m["measured"], m["verdict"] == "met") for line in _code_lines(body) if (m := GOAL.match(line))]


def failed(body: str) -> list[tuple[str, str]]:
    """(goal or figure, how many requests failed) for every FAILED line: a figure of a run
    with failed requests, not judged."""
    return [(m["goal"], m["failures"]) for line in _code_lines(body) if (m := FAILED.match(line))]


def projected(body: str) -> list[tuple[str, str]]:
    """(what, figure) for every projected line: computed, not measured; never a goal's verdict."""
    return [(m["what"], m["figure"]) for line in _code_lines(body) if (m := PROJECTED.match(line))]


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)


class MissingPath(ValueError):
    """A section names a path that was not there: its staleness would be blind to it."""


def _tree(root: Path, commit: str) -> set[str]:
    """Every file and folder of `commit`."""
    files = _git(root, "ls-tree", "-r", "--name-only", commit).stdout.split("\n")
    return {"/".join(f.split("/")[:i]) for f in files if f for i in range(1, f.count("/") + 2)}


def now_measured(name: str) -> tuple[str, ...]:
    """What the section `name` measures now (bench/sections.py: its module's imports, computed
    from the source); () for a name that is no section."""
    from bench.sections import BY_NAME  # here: sections imports the import closure, summary is imported by tests alone

    return BY_NAME[name].measured if name in BY_NAME else ()


def staleness(block: Block, root: Path = ROOT, now: tuple[str, ...] | None = None) -> str:
    """'fresh', 'not run', or why the section is stale: a change since its commit to a path
    it recorded or to one it measures now (`now`, by default bench/sections.py's: a module
    its code imports since, or that a hand list left out). Raises MissingPath when a
    recorded path was not in its commit, or a path it measures now is not here: a path that
    is not there can never change, and a section measuring it would stay fresh blind."""
    if block.commit == NOT_RUN:
        return "not run"
    if _git(root, "cat-file", "-e", f"{block.commit}^{{commit}}").returncode != 0:
        return "stale: its commit is not in this history"
    now = now_measured(block.name) if now is None else now
    if gone := [p for p in block.paths if p not in _tree(root, block.commit)]:
        raise MissingPath(f"{block.name}: measured paths not in its commit {block.commit[:12]}: {', '.join(gone)}")
    if gone := [p for p in now if not (root / p).exists()]:
        raise MissingPath(f"{block.name}: measured paths that do not exist: {', '.join(gone)}")
    diff = _git(root, "diff", "--name-only", block.commit, "--", *dict.fromkeys((*block.paths, *now)))
    if diff.returncode != 0:
        raise RuntimeError(f"git diff {block.commit} failed: {diff.stderr.strip()}")
    changed = diff.stdout.split()
    if not changed:
        return "fresh"
    return f"stale: {len(changed)} measured file{'s' if len(changed) != 1 else ''} changed since"


def cell(s: str) -> str:
    return s.replace("|", "\\|")


def render(found: list[Block], root: Path = ROOT, measured: dict[str, tuple[str, ...]] | None = None) -> str:
    """The summary: a row per section: when it ran, stale or fresh, how many of its goal
    lines were met (each goal line, met or NOT met, is in the section's output), and the
    paths it measures now (`measured`, by name; bench/sections.py's by default, else the
    block's). Projections and figures of runs with failed requests are counted apart."""
    now = {b.name: (measured or {}).get(b.name, now_measured(b.name)) for b in found}
    marks = {b.name: staleness(b, root, now[b.name]) for b in found}
    by_section = {b.name: goals(b.body) for b in found}
    lines = [
        START,
        "",
        "| section | ran at | status | goals met | failed runs | projected | measures |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in found:
        at = "not run" if b.commit == NOT_RUN else f"`{b.commit[:12]}`, {b.date}"
        status = marks[b.name] if marks[b.name] in ("fresh", "not run") else f"**{marks[b.name]}**"
        met = by_section[b.name]
        tally = f"{sum(1 for g in met if g[2])} of {len(met)}" if met else "-"
        if met and not all(g[2] for g in met):
            tally = f"**{tally}**"
        bad = f"**{len(failed(b.body))}**" if failed(b.body) else "-"
        guessed = str(len(projected(b.body))) if projected(b.body) else "-"
        lines.append(f"| {b.name} | {at} | {cell(status)} | {tally} | {bad} | {guessed} | {cell(measures(now[b.name] or b.paths))} |")
    rows = [(name, *g) for name, gs in by_section.items() for g in gs]
    fresh = [r for r in rows if marks[r[0]] == "fresh"]
    lines += [
        "",
        f"{sum(1 for r in fresh if r[3])} of {len(fresh)} goal lines of fresh sections met; "
        f"{sum(1 for r in rows if r[3])} of {len(rows)} in all; "
        f"{sum(1 for m in marks.values() if m == 'fresh')} of {len(marks)} sections fresh. "
        f"Not counted as goals: {sum(len(failed(b.body)) for b in found)} figures of runs with failed requests (FAILED), "
        f"{sum(len(projected(b.body)) for b in found)} projections (computed from a measurement, never a goal's verdict).",
        "",
        END,
    ]
    return "\n".join(lines)


def measures(paths: tuple[str, ...]) -> str:
    """A section's paths in a table cell: its module, how many files its code imports, and
    every path that is not a Python file (data, configuration, programs it runs); the block
    below lists them all."""
    if not paths:
        return "-"
    code = [p for p in paths[1:] if p.endswith(".py")]
    rest = [p for p in paths[1:] if not p.endswith(".py")]
    return ", ".join([f"`{paths[0]}` and {len(code)} files it imports", *(f"`{p}`" for p in rest)])


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
    try:
        table = render(blocks(text))
    except MissingPath as exc:
        print(f"bench.summary: {exc}", file=sys.stderr)
        return 1
    if args.write:
        args.doc.write_text(text.replace(current(text), table), encoding="utf-8")
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
