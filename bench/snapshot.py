"""Write docs/benchmarks.md from one run of every benchmark, at one commit, on this machine.

    python -m bench.snapshot                 # every section but the long ones (make bench)
    python -m bench.snapshot --long          # the long ones: real engines, the whole loop (make bench-long)
    python -m bench.snapshot --only bench_parse,bench_gate
    python -m bench.snapshot --empty         # rewrite the doc around its blocks, running nothing

Each benchmark runs once, as `python -m bench.NAME ARGS` (bench/sections.py), and its
output goes into its section's block with the commit, the date and the paths it measures;
the sections not run this time keep their blocks (and their own commit). Then the summary
is computed (bench/summary.py). It refuses to run with uncommitted changes under a path a
chosen section measures: the commit it records must be the code that ran. History lives in
git, not in the doc.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

from bench import summary
from bench.sections import SECTIONS, Section

HEAD = """# Benchmarks

One snapshot, written by `make bench` (every benchmark once, at one commit, on one machine;
`bench/snapshot.py`) and `make bench-long` (real engines, the whole loop, with their own commit).
Each output starts with its machine line: CPU, cores, memory, kernel, Python, a calibration (best
of 5 runs of a fixed Python workload, `bench/_machine.py`: compare absolute times only at the same
calibration) and the load average. The machine is shared: compare figures within a section. A goal
is judged on a measured figure only: a figure computed from one prints as `projected:`, a figure of
a run with failed requests as `FAILED:` with the count; neither judges a goal, and the summary counts
them apart. A section measures its benchmark's imports (computed from the source, `bench/_imports.py`)
and what it runs; it is **stale** when one of those changed since its commit (`python -m bench.summary`,
which exits 1 on a path that is not there). `tests/unit/test_bench_figures.py` and the smoke test
recompute each goal figure from its section's table (`tests/fixtures/bench_tables.py`). Earlier
snapshots are in git (before one snapshot: `git show ceeb71b:docs/benchmarks.md`).

```sh
make bench && make bench-long                   # every section below
python -m bench.snapshot --only bench_parse     # one section again, at the current commit
python -m bench.summary --write                 # the summary again (the stale marks), running nothing
```
"""


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(summary.ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def dirty(paths: tuple[str, ...]) -> list[str]:
    """Uncommitted changes (tracked or not) under `paths`."""
    return [line[3:] for line in _git("status", "--porcelain", "--", *paths).splitlines()]


def run(section: Section, commit: str) -> summary.Block:
    print(f"bench.snapshot: {section.command}", file=sys.stderr, flush=True)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", f"bench.{section.name}", *section.args], cwd=summary.ROOT, capture_output=True, text=True, check=False)
    took = time.monotonic() - started
    text = out.stdout.rstrip("\n")
    if out.returncode != 0:
        text += f"\n(exit status {out.returncode}; the last lines of its stderr follow)\n" + "\n".join(out.stderr.rstrip().splitlines()[-15:])
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ")
    print(f"bench.snapshot: {section.name} exited {out.returncode} after {took:.0f} s", file=sys.stderr, flush=True)
    return summary.Block(section.name, commit, date, section.measured, f"\n```\n{text}\n```\n")


def not_run(section: Section) -> summary.Block:
    target = "make bench-long" if section.long else "make bench"
    return summary.Block(section.name, summary.NOT_RUN, summary.NOT_RUN, section.measured, f"\nNot run in this snapshot (`{target}`).\n")


NOTES = Path(__file__).resolve().parent / "notes"  # NAME.md: prose after a section's block, kept by hand


def document(found: dict[str, summary.Block]) -> str:
    parts = [HEAD]
    ordered = [found.get(s.name) or not_run(s) for s in SECTIONS]
    parts.append(summary.render(ordered) + "\n")
    for s, b in zip(SECTIONS, ordered, strict=True):
        parts.append(f"## {s.title}\n`{s.command}`. {s.about}\n<!-- bench {b.name} {b.fields()} -->\n{b.body.strip(chr(10))}\n<!-- end bench {b.name} -->\n")
        if (notes := NOTES / f"{s.name}.md").is_file():  # not a run's output: the profiles, what remains and why
            parts.append(notes.read_text(encoding="utf-8"))
    return "".join(parts[:2]) + "\n" + "".join(parts[2:])  # a heading needs no blank line after a block's end


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--long", action="store_true", help="run the long sections only")
    which.add_argument("--only", help="comma-separated section names")
    which.add_argument("--empty", action="store_true", help="run nothing, rewrite the doc around its blocks")
    ap.add_argument("--doc", type=Path, default=summary.DOC, help="the file to write (default docs/benchmarks.md)")
    ap.add_argument(
        "--allow-dirty", action="store_true", help="run with uncommitted changes under measured paths (the summary marks those sections stale at once)"
    )
    args = ap.parse_args(argv)
    names = {s.name for s in SECTIONS}
    if args.only:
        chosen = [n.strip() for n in args.only.split(",") if n.strip()]
        if unknown := sorted(set(chosen) - names):
            ap.error(f"--only: no such section {unknown}; known: {sorted(names)}")
        todo = [s for s in SECTIONS if s.name in chosen]
    elif args.empty:
        todo = []
    else:
        todo = [s for s in SECTIONS if s.long == args.long]
    changed = sorted({p for s in todo for p in dirty(s.measured)})
    if changed and not args.allow_dirty:
        print(f"bench.snapshot: uncommitted changes under measured paths, commit them first: {', '.join(changed)}", file=sys.stderr)
        return 2
    doc: Path = args.doc
    text = doc.read_text(encoding="utf-8") if doc.exists() else ""
    found = {b.name: b for b in summary.blocks(text) if b.name in names}
    commit = _git("rev-parse", "HEAD")
    for s in todo:
        found[s.name] = run(s, commit)
        doc.write_text(document(found), encoding="utf-8")  # each section kept as soon as it ran
    doc.write_text(document(found), encoding="utf-8")
    print(f"bench.snapshot: wrote {doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
