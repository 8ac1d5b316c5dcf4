"""Targeted parser of the Prometheus text exposition format.

`parse(text, names)` returns only the samples whose name is one of `names`, keyed by sample
name, each a list of `(labels, value)` in file order. Names absent from the payload are absent
from the result. Pure: stdlib only, no I/O.

Why not prometheus_client's parser: it parses every line of a 12-100 KB payload in Python
(bench_parse in docs/benchmarks.md) while the health decision needs ~20 series. Here one compiled regex, whose
alternation of the wanted names is factored into a prefix tree, skips from newline to newline
in C; Python only touches the lines that start with a wanted name.

Semantics follow `prometheus_client.parser.text_string_to_metric_families` (0.26, default
UTF-8 name validation) line for line:

* Lines are split on "\\n" only and stripped of whitespace at both ends, so CRLF payloads
  parse like LF ones. Comment lines (`# HELP`, `# TYPE`, `# EOF`, any `#`) and blank lines
  are ignored.
* Label values are unescaped exactly like prometheus_client: `\\\\`, `\\n` and `\\"`; any
  other backslash sequence is kept as written. `}`, `,`, `=` and spaces inside a quoted value
  are part of the value. `{}`, a trailing comma and spaces around `=` and `,` are accepted.
* Values and timestamps are read by `float()` (so `NaN`, `+Inf`, `-Inf`, `Inf`, `1.5e+09`,
  `-2E-3`); a number with `_` is rejected. Of the tokens after the value only the last is
  read (as the timestamp, which must be a number) and then dropped, as prometheus_client does
  (this also skips an exemplar `# {...} v`).
* A sample whose name is given inside the braces (`{"name",a="b"} 1` or
  `{__name__="name"} 1`) is found too.

Differences, deliberate:

* Sample names are kept as written. prometheus_client renames the samples of a counter
  family whose name lacks `_total` (`# TYPE app_request_success counter` gives samples named
  `app_request_success_total`, and some engines write such families); here they stay
  `app_request_success`.
* Only the lines of wanted samples are checked. A malformed line that starts with a wanted
  name raises `ParseError` (with its line number) where prometheus_client raises
  `ValueError`; malformed unwanted lines and malformed `# HELP`/`# TYPE` lines, on which
  prometheus_client raises for the whole payload, are ignored. So is a malformed line that
  starts with `{` (its name cannot be known).
* Values are floats. prometheus_client keeps integers as `int`: equal, except integers
  beyond the float range (up to 4300 digits), which are `inf` here.
* A line without whitespace is not a sample here (a wanted name alone raises ParseError).
  prometheus_client reads it as name = all but the last character and value = the whole
  line, which succeeds for `NaN`, `Inf`, `Infinity` (a sample `Na` with value NaN...).
* Wanted names must be legacy metric names (`[a-zA-Z_:][a-zA-Z0-9_:]*`), which covers every
  engine this project reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

from .errors import CoreError

__all__ = ["Budget", "Names", "ParseError", "TooManySamples", "compile_names", "parse"]

Labels = dict[str, str]
Samples = dict[str, list[tuple[Labels, float]]]


class ParseError(CoreError, ValueError):
    """A line of a wanted sample is malformed; the message names the line number."""


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")

# The scan regex, matched against "\n" + text. Its leading literal "\n" lets the regex engine
# skip from newline to newline in C; the names are a prefix tree (`_trie`), so a line that
# starts with no wanted name costs a few character tests. Groups:
#   1 a wanted name at line start (after optional whitespace), then either
#     2-4 the fast tail: `{body}` (optional; no `}` inside), one space, the value, optionally
#         one space and a timestamp, trailing whitespace. The body is checked against
#         _STRICT_BODY once per distinct body (cached); if it fails the line goes slow.
#     5   anything else after whitespace, `{` or nothing: the exact slow path, `_parse_line`.
#   6 the rest of a line starting with `{`, which may carry its name inside the braces.
# Value tokens exclude `{` (prometheus_client would take `foo 1{` as a sample `foo 1` with
# labels) and `_` (it rejects `1_000`); such lines take the slow path and get its verdict.
_SCAN = (
    r"\n[^\S\n]*(?:({names})"
    r"(?:(?:\{{([^}}\n]*)\}})? ([^\s{{_]+)(?: ([^\s{{_]+))?[^\S\n]*(?=\n|\Z)"
    r"|(?=[^\S\n]|\{{|\n|\Z)([^\n]*))"
    r"|\{{([^\n]*))"  # a literal first: lines that start otherwise fail this branch at once
)
# A label body prometheus_client reads as plain `name="value"` pairs: unquoted, unreserved
# label names, values with backslash escapes, single commas, one trailing comma allowed.
_QUOTED = r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"'  # unrolled: a run of plain characters is one step
_PAIR = r"(?!__)[a-zA-Z_][a-zA-Z0-9_]*=" + _QUOTED
_STRICT_BODY = re.compile(r"(?:" + _PAIR + r"(?:," + _PAIR + r")*,?)?")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*(?:\\.[^"\\]*)*)"')
_ESCAPE = re.compile(r'\\[\\n"]')
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}

# label body -> labels, for the fast tail: the same label sets come back in every scrape.
# Bounded: a payload with ever-new label values must not grow it forever.
_BODIES: dict[str, Labels] = {}
_NO_LABELS: Labels = {}  # never handed out: copied like the cached ones


def _fast_labels(body: str) -> Labels | None:
    """Labels of a fast-tail label body, or None if the body needs the slow path."""
    if not _STRICT_BODY.fullmatch(body):
        return None
    pairs = _LABEL_PAIR.findall(body)
    labels = {k: _unescape(v) for k, v in pairs}
    if len(labels) != len(pairs):
        return None  # duplicate label name: the slow path raises
    if len(_BODIES) >= 4096:
        _BODIES.clear()
    _BODIES[body] = labels
    return labels


def _unescape(s: str) -> str:
    return _ESCAPE.sub(lambda m: _UNESCAPED[m.group(0)], s) if "\\" in s else s


def _trie(names: Iterable[str]) -> str:
    """An alternation of `names` factored by common prefix: `vllm:(?:a|b)` rather than
    `vllm:a|vllm:b`, so that a line costs one branch test per character, not one per name."""
    root: dict = {}
    for name in names:
        node = root
        for ch in name:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict) -> str:
        alts = []
        for ch in sorted(k for k in node if k):
            s, sub = re.escape(ch), node[ch]
            while len(sub) == 1 and "" not in sub:  # a chain of single children: one literal
                ((c, sub),) = sub.items()
                s += re.escape(c)
            alts.append(s + emit(sub))
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return "(?:" + body + ")?" if "" in node else body

    return emit(root)


class Names:
    """A compiled set of wanted sample names (see `compile_names`)."""

    __slots__ = ("_scan", "names")

    def __init__(self, names: frozenset):
        self.names = names
        self._scan = re.compile(_SCAN.format(names=_trie(names))) if names else None

    def __repr__(self) -> str:
        return f"Names({sorted(self.names)!r})"


@lru_cache(maxsize=128)
def _compile(names: frozenset) -> Names:
    for name in names:
        if not isinstance(name, str) or not _METRIC_NAME.match(name):
            raise ValueError(f"not a metric name: {name!r}")
    return Names(names)


def compile_names(names: Iterable[str] | Names) -> Names:
    """Compile a set of wanted sample names once; cached, so calling `parse` with the same
    set again reuses the regex. `parse` accepts the result in place of the names."""
    if isinstance(names, Names):
        return names
    if isinstance(names, str):
        raise TypeError("names must be an iterable of sample names, not one str")
    return _compile(frozenset(names))


class TooManySamples(ParseError):
    """More wanted samples (or lines starting with `{`) than the caller allows."""


class Budget:
    """How many wanted lines (and lines starting with `{`) the parser may still read,
    over every piece of one payload."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int):
        self.left = self.limit = limit


def parse(text: str, names: Iterable[str] | Names, *, first_line: int = 1, budget: Budget | None = None, into: Samples | None = None) -> Samples:
    """Samples of `text` whose name is one of `names`: {name: [(labels, value), ...]}.

    Raises ParseError for a malformed line of a wanted sample, naming its line number
    (`first_line` is the number of the text's first line, for a text that is one piece of
    a payload). Raises TooManySamples, before any value is read, when the text has more
    wanted lines than `budget` has left. `into` collects the samples of several pieces.
    """
    compiled = compile_names(names)
    out: Samples = {} if into is None else into
    if compiled._scan is None:
        return out
    scan = "\n" + text
    wanted = compiled.names
    matches = compiled._scan.findall(scan)  # the tuples are built in C
    if budget is not None:
        budget.left -= len(matches)
        if budget.left < 0:
            raise TooManySamples(f"more than {budget.limit} wanted samples")
    for match in matches:  # once per wanted sample (and per line starting with `{`)
        name, body, value, stamp, tail, braced = match
        try:
            if value:  # the fast tail matched
                labels = (_BODIES.get(body) or _fast_labels(body)) if body else _NO_LABELS
                if labels is not None:
                    number = float(value)
                    if stamp:
                        float(stamp)  # prometheus_client rejects a line whose timestamp is no number
                    out.setdefault(name, []).append((labels.copy(), number))  # the caller owns its dicts
                    continue
                line = f"{name}{{{body}}} {value} {stamp}".strip()
            else:
                line = (name + tail if name else "{" + braced).strip()
            try:
                name, labels, number = _parse_line(line)
            except ValueError:
                if name:
                    raise
                continue  # a malformed `{...` line: no name to tell whether it was wanted
        except ValueError as e:
            # findall keeps no positions: find this match again (the first equal tuple is
            # this one, since an earlier equal line would have failed first).
            found = next(m for m, t in zip(compiled._scan.finditer(scan), matches) if t == match)
            lineno = scan.count("\n", 0, found.start() + 1) + first_line - 1
            source = found.group(0).strip()[:200]
            raise ParseError(f"line {lineno}: {str(e) or 'malformed sample'}: {source!r}") from None
        if name in wanted:
            out.setdefault(name, []).append((labels, number))
    return out


# The slow path: a port of prometheus_client.parser._parse_sample and its helpers, for the
# rare wanted line the fast tail does not match (tabs, two spaces, quoted or `:` label names,
# `{a=}`, exemplars, ...). Raises ValueError where prometheus_client raises.


def _escaped(s: str, i: int) -> bool:
    """Whether s[i] is preceded by an odd number of backslashes."""
    j = i
    while j > 0 and s[j - 1] == "\\":
        j -= 1
    return (i - j) % 2 == 1


def _unquoted(s: str, chars: str) -> int:
    """Index of the first character of `chars` outside double quotes, or -1."""
    quoted = False
    for i, c in enumerate(s):
        if c == '"' and not _escaped(s, i):
            quoted = not quoted
        if not quoted and c in chars:
            return i
    return -1


def _number(s: str) -> float:
    if "_" in s:
        raise ValueError(f"invalid number {s!r}")
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"invalid number {s!r}") from None


def _value(s: str) -> float:
    """The value; a further token is a timestamp, of which only the last must be a number."""
    s = s.lstrip()
    tokens = [t.strip() for t in s.split(" " if " " in s else "\t") if t.strip()]
    if not tokens:
        raise ValueError("missing value")
    if len(tokens) > 1:
        _number(tokens[-1])
    return _number(tokens[0])


def _unquote(s: str) -> tuple[str, bool]:
    s = s.strip()
    if not s or s[0] != '"':
        return _unescape(s), False
    if len(s) == 1 or s[-1] != '"':
        raise ValueError("missing close quote")
    return _unescape(s[1:-1]), True


def _labels(body: str) -> Labels:
    labels: Labels = {}
    rest = body.strip()
    while rest:
        if rest[0] == ",":
            rest = rest[1:]
            if not rest:
                break
            if rest[0] == ",":
                raise ValueError("multiple commas")
        pos = _unquoted(rest, "=,}")
        if pos >= 0 and rest[pos] == "=":
            key, rest = rest[:pos], rest[pos + 1 :]
            pos = _unquoted(rest, ",}")
        else:
            key = "__name__"  # a bare quoted term is the metric name
        if pos == -1:
            pos = len(rest)
        term, rest = rest[:pos].strip(), rest[pos:].strip()
        if not term:
            continue  # `a=` without a value is dropped, as prometheus_client does
        key, quoted = _unquote(key)
        if not quoted and not _METRIC_NAME.match(key):
            raise ValueError(f"invalid label name {key!r}")
        if term[0] != '"':
            raise ValueError("label value not quoted")
        i = 1  # the first unescaped quote after the opening one must close the term
        while i < len(term):
            i = term.index('"', i)  # ValueError if unterminated
            if not _escaped(term, i):
                break
            i += 1
        if i + 1 != len(term):
            raise ValueError("unexpected text after label value")
        value, _ = _unquote(term)
        if key != "__name__":
            key.encode("utf-8")  # lone surrogates: UnicodeEncodeError, a ValueError
            if key.startswith("__"):
                raise ValueError(f"reserved label name {key!r}")
        if key in labels:
            raise ValueError(f"duplicate label name {key!r}")
        labels[key] = value
    return labels


def _parse_line(line: str) -> tuple[str, Labels, float]:
    """(name, labels, value) of one stripped sample line, as prometheus_client reads it."""
    start = _unquoted(line, "{")
    if start == -1 or " # " in line[:start]:
        end = _unquoted(line, " \t")
        name = line[:end].strip()
        if not _METRIC_NAME.match(name):
            raise ValueError("missing value" if end == -1 else f"invalid metric name {name!r}")
        return name, {}, _value(line[end + 1 :])
    name = line[:start].strip()
    end = _unquoted(line[start:], "}") + start
    if end < start:
        raise ValueError("unterminated label set")
    labels = _labels(line[start + 1 : end])
    if not name:
        if "__name__" not in labels:
            raise ValueError("no metric name")
        name = labels.pop("__name__")
    elif "__name__" in labels:
        raise ValueError("metric name given twice")
    return name, labels, _value(line[end + 1 :])
