"""The targeted exposition parser must read every wanted sample exactly as
prometheus_client.parser does (the reference), on the real payloads, on hand-written tricky
lines and on generated ones; and name the line of a malformed wanted sample."""

from __future__ import annotations

import math
import random
import re
from importlib.metadata import version

import pytest
from prometheus_client.parser import _parse_sample, text_string_to_metric_families

from llm_health.core import engines
from llm_health.core.exposition import Names, ParseError, _parse_line, compile_names, parse
from tests.fixtures.paths import REAL_METRICS, real_payloads
from tests.fixtures.prom_reference import reference

# exposition.py follows prometheus_client's current parser (rewritten for UTF-8 names in
# 0.21-0.23). Older versions read odd lines differently (an exemplar as labels, a leading
# comma into the label name, ...), so the edge cases are compared with 0.23 or later only.
PROM_VERSION = tuple(int(x) for x in re.findall(r"\d+", version("prometheus-client"))[:2])
modern_only = pytest.mark.skipif(PROM_VERSION < (0, 23), reason="prometheus_client < 0.23 reads odd lines differently")

METRICS_DIR = REAL_METRICS
REAL_FILES = real_payloads()

# The names the engine profiles ask for (core/engines/): vLLM's, and every other engine's.
VLLM_SET = frozenset().union(*(p.wanted for p in engines.PROFILES if p.prefix == "vllm:"))
OTHER_ENGINES = frozenset().union(*(p.wanted for p in engines.PROFILES if p.prefix != "vllm:")) - VLLM_SET


# --- the reference -------------------------------------------------------------------------

LEGACY_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")  # the names parse() accepts


def norm(samples: dict) -> dict:
    """NaN compares equal to NaN; everything else exactly."""
    return {name: [(labels, "NaN" if math.isnan(v) else v) for labels, v in items] for name, items in samples.items()}


def assert_agrees(text: str, names=None) -> dict:
    expected = reference(text)
    wanted = {n for n in expected if LEGACY_NAME.fullmatch(n)} if names is None else set(names)
    got = parse(text, wanted)
    assert norm(got) == norm({n: v for n, v in expected.items() if n in wanted})
    return got


# --- real payloads -------------------------------------------------------------------------


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.name)
def test_real_payload_every_sample(path):
    text = path.read_text(encoding="utf-8")
    got = assert_agrees(text)
    assert sum(map(len, got.values())) >= 10


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.name)
def test_real_payload_subsets(path):
    text = path.read_text(encoding="utf-8")
    all_names = sorted(reference(text))
    assert_agrees(text, VLLM_SET)
    assert_agrees(text, VLLM_SET | OTHER_ENGINES)
    rng = random.Random(path.name)
    for _ in range(5):
        assert_agrees(text, [*rng.sample(all_names, min(5, len(all_names))), "absent_metric_name"])


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.name)
def test_real_payload_crlf_and_indented(path):
    text = path.read_text(encoding="utf-8")
    assert_agrees(text.replace("\n", "\r\n"))
    assert_agrees("".join("  " + line for line in text.splitlines(keepends=True)))


def test_real_payloads_take_the_fast_path(monkeypatch):
    """Every line of the real payloads is read by the scan regex alone: the slow path (a
    Python loop per character) is for odd lines only, or the speed is gone."""
    import llm_health.core.exposition as exposition

    def slow(line):
        raise AssertionError(f"slow path taken for {line!r}")

    monkeypatch.setattr(exposition, "_parse_line", slow)
    for path in REAL_FILES:
        text = path.read_text(encoding="utf-8")
        parse(text, {n for n in reference(text) if LEGACY_NAME.fullmatch(n)})


def test_real_payload_known_values():
    if not REAL_FILES:
        pytest.skip("no payloads")
    vllm = (METRICS_DIR / "vllm-v1-0.11-qwen15-05b-idle-engine0-created.prom").read_text()
    got = parse(vllm, VLLM_SET)
    assert got["process_start_time_seconds"] == [({}, 1.76243836732e09)]
    assert {labels["finished_reason"] for labels, _ in got["vllm:request_success_total"]} >= {"stop", "length", "abort"}
    tgi = (METRICS_DIR / "tgi-109req-idle-after-load-datadog-fixture.prom").read_text()
    got = parse(tgi, OTHER_ENGINES)
    assert got["tgi_request_success"] == [({}, 109.0)]  # a counter without `_total`: kept as written
    assert sorted(got["tgi_batch_inference_count"], key=lambda s: s[0]["method"]) == [
        ({"method": "decode"}, 1509.0),
        ({"method": "prefill"}, 16.0),
    ]


# --- hand-written cases --------------------------------------------------------------------

CASES = {
    "escapes": 'a{l="q\\"b\\\\s\\nn"} 1\n',
    "unknown escape kept": 'a{l="x\\ty\\\\\\"z"} 1\n',
    "backslash before closing quote": 'a{l="x\\\\",m="y"} 1\n',
    "brace, comma, equals, spaces in value": 'a{l="}{,= x ",m="a=b,c}"} 2\n',
    "hash in value": 'a{l=" # x"} 3\n',
    "unicode": 'a{l="中文 é"} 4\n',
    "special values": "a NaN\nb +Inf\nc -Inf\nd Inf\ne nan\nf -inf\ng +NaN\nh Infinity\n",
    "exponents": "a 1.5e+09\nb -2E-3\nc 1e3\nd .5\ne 5.\nf -0\ng +7\nh 12345678901234567890\n",
    "timestamps": 'a 1 1700000000000\nb{l="v"} 2 -5\nc 3 1.5\nd{l="v"} 4 1e3\n',
    "created series": ("# HELP a_total A counter.\n# TYPE a_total counter\na_total 3\n# HELP a_created Created.\n# TYPE a_created gauge\na_created 1.7e+09\n"),
    "counter without _total": '# TYPE tgi_x counter\ntgi_x 5\n# TYPE tgi_y counter\ntgi_y{m="d"} 6\n',
    "histogram": ('# TYPE h histogram\nh_bucket{le="1.0"} 1\nh_bucket{le="+Inf"} 2\nh_sum 3.5\nh_count 2\nh_created 1.7e9\n'),
    "summary": '# TYPE s summary\ns{quantile="0.5"} 1\ns_sum 2\ns_count 3\n',
    "eof": "a 1\n# EOF\n",
    "eof then more": "a 1\n# EOF\nb 2\n",
    "help with trailing spaces": "# HELP a Some help.   \n# TYPE a gauge\na 1\n# HELP b \\n escaped \\\\ \nb 2\n",
    "comments": "# just a comment\n#\n#x\n# TYPEx y\na 1\n",
    "no final newline": 'a 1\nb{l="v"} 2',
    "no final newline with timestamp": "a 1 17",
    "empty label set": "a{} 1\nb {} 2\n",
    "trailing comma": 'a{l="v",} 1\nb{l="v", } 2\n',
    "leading comma": 'a{,l="v"} 1\n',
    "only comma": "a{,} 1\n",
    "spaces": 'a{ l = "v" , m="w" }  3  \n   b   4   \nc{l="v"}5\n',
    "tabs": 'a\t1\nb{l="v"}\t2\nc\t3\t4\nd 5\t6\n',
    "crlf": 'a 1\r\nb{l="v"} 2\r\n# HELP c x\r\nc 3 4\r\n',
    "blank lines": "\n\na 1\n\n   \n\t\nb 2\n\n",
    "exemplar": '# TYPE a histogram\na_bucket{le="1"} 3 # {trace_id="x"} 0.5 123\na_count 3\n',
    "exemplar without labels": 'a 1 # {t="x"} 2\n',
    "three tokens": "a 1 2 3\n",
    "quoted label name": 'a{"l.x"="v",m="w"} 1\n',
    "colon label name": 'a{l:x="v"} 1\n',
    "underscore label name": 'a{_l="v",L2="w"} 1\n',
    "empty label value": 'a{l=""} 1\n',
    "label without value dropped": 'a{l=,m="v"} 1\nb{l=} 2\n',
    "name in braces": '{"a",l="v"} 1\n{__name__="b"} 2\n{"c"} 3\n',
    "prefix names": "a_total 1\na 2\na_total_x 3\naa 4\n",
    "same name twice in order": 'a{l="1"} 1\nb 0\na{l="2"} 2\na{l="1"} 3\n',
    "many labels": "a{" + ",".join(f'k{i}="v{i}"' for i in range(40)) + "} 7\n",
    "vertical tab after name": "a\x0b 1\n",
    "space before brace": 'a {l="v"} 1\n',
    "space name then brace later": 'a b{l="v"} 1\nc 1\n',
}


# Cases prometheus_client < 0.23 reads differently or rejects.
MODERN_CASES = {
    "leading comma",
    "exemplar",
    "exemplar without labels",
    "quoted label name",
    "label without value dropped",
    "name in braces",
    "vertical tab after name",
    "space name then brace later",
}


@pytest.mark.parametrize("text", [pytest.param(text, id=k, marks=[modern_only] if k in MODERN_CASES else []) for k, text in CASES.items()])
def test_hand_written_case(text):
    got = assert_agrees(text)
    assert got  # every case has at least one sample
    for name in got:  # and each name alone
        assert_agrees(text, [name])


def test_specific_values():
    got = parse(CASES["escapes"] + CASES["brace, comma, equals, spaces in value"], ["a"])
    assert got["a"] == [({"l": 'q"b\\s\nn'}, 1.0), ({"l": "}{,= x ", "m": "a=b,c}"}, 2.0)]
    got = parse(CASES["special values"], list("abcdefgh"))
    assert math.isnan(got["a"][0][1]) and got["b"][0][1] == got["d"][0][1] == math.inf
    assert got["c"][0][1] == -math.inf
    got = parse(CASES["exponents"], ["a", "b"])
    assert got == {"a": [({}, 1.5e9)], "b": [({}, -0.002)]}


def test_specific_values_of_odd_lines():
    assert parse(CASES["name in braces"], ["a", "b"]) == {"a": [({"l": "v"}, 1.0)], "b": [({}, 2.0)]}
    assert parse(CASES["label without value dropped"], ["a", "b"]) == {"a": [({"m": "v"}, 1.0)], "b": [({}, 2.0)]}
    # `a b{...}` is a sample named "a b" for prometheus_client, so not an `a` sample.
    assert parse(CASES["space name then brace later"], ["a", "c"]) == {"c": [({}, 1.0)]}


# --- malformed lines -----------------------------------------------------------------------

MALFORMED = {
    'a{l="v" 1': "unterminated",
    'a{l="v} 1': "unterminated",
    "a zz": "zz",
    "a 1_000": "1_000",
    "a 0x10": "0x10",
    "a 1 abc": "abc",
    'a{l="v",l="w"} 1': "duplicate",
    'a{__x="v"} 1': "reserved",
    'a{l="v"}': "missing value",
    "a   ": "missing value",
    "a": "missing value",
    "a{l=v} 1": "quoted",
    'a{l="v" m="w"} 1': "after label value",
    'a{l="v",,m="w"} 1': "commas",
    'a{1l="v"} 1': "label name",
    'a{__name__="a"} 1': "twice",
    "a 1\rb 2": "",
}


@pytest.mark.parametrize("line", MALFORMED, ids=list(MALFORMED))
def test_malformed_wanted_line_raises_with_line_number(line):
    text = f"# HELP a x\nok 1\n\n{line}\nok 2\n"
    if PROM_VERSION >= (0, 23):
        with pytest.raises(ValueError):
            list(text_string_to_metric_families(text))  # the reference rejects it too
    with pytest.raises(ParseError, match=r"^line 4: ") as info:
        parse(text, ["a", "ok"])
    assert MALFORMED[line] in str(info.value)
    assert parse(text, ["ok"]) == {"ok": [({}, 1.0), ({}, 2.0)]}  # unwanted: ignored


def test_parse_error_first_line_and_is_value_error():
    with pytest.raises(ParseError, match=r"^line 1: ") as info:
        parse('a{l="v" 1\n', {"a"})
    assert isinstance(info.value, ValueError)
    with pytest.raises(ParseError, match=r"^line 3: "):
        parse("a 1\na 1\na 1 x\n", {"a"})  # equal earlier lines do not confuse the line number


def test_malformed_unwanted_lines_and_comments_are_ignored():
    text = "# TYPE\n# HELP 9bad x\nb{ 1\n{nolabel} 2\n{} 3\na 1\n"
    with pytest.raises(Exception):
        list(text_string_to_metric_families(text))
    assert parse(text, ["a", "b9"]) == {"a": [({}, 1.0)]}


# --- API -----------------------------------------------------------------------------------


def test_api():
    text = 'a{l="v"} 1\nb 2\n'
    names = compile_names(["a", "b"])
    assert isinstance(names, Names)
    assert compile_names(("b", "a")) is names  # cached by set
    assert compile_names(names) is names
    assert parse(text, names) == parse(text, iter(["a", "b"])) == {"a": [({"l": "v"}, 1.0)], "b": [({}, 2.0)]}
    assert parse(text, []) == {}
    assert parse("", ["a"]) == {}
    assert parse(text, ["zzz"]) == {}
    got = parse(text, ["a"])
    got["a"][0][0]["l"] = "changed"  # labels are the caller's own
    assert parse(text, ["a"])["a"][0][0] == {"l": "v"}
    with pytest.raises(TypeError):
        parse(text, "a")
    with pytest.raises(ValueError):
        compile_names(["not a name"])
    with pytest.raises(ValueError):
        compile_names([""])


# --- generated payloads --------------------------------------------------------------------

NAMES = ["a", "a_total", "a_created", "vllm:x", "vllm:x_count", "vllm:xy", "b_bucket", "c:d_e", "_u", "process_start_time_seconds"]
AMBIGUOUS = {n for n in NAMES if n + "_total" in NAMES}  # see reference(): no counter TYPE for these
LABEL_NAMES = ["l", "le", "model_name", "engine", "_x", "L2"]
VALUE_PIECES = ["a", "Z", "0", " ", "-", "/", ".", ":", "}", "{", ",", "=", "#", "é", "中", '\\"', "\\\\", "\\n", "\\t", "\t"]
VALUES = [
    "0",
    "1",
    "0.0",
    "42.5",
    "1.5e+09",
    "-2E-3",
    "NaN",
    "+Inf",
    "-Inf",
    "Inf",
    "nan",
    "1e3",
    ".5",
    "5.",
    "-0",
    "+7",
    "12345678901234567890",
    "0.000001",
    "3.14159265358979",
]


def gen_sample(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    sep = lambda: rng.choice(["", "", "", " ", "  "])  # noqa: E731
    out = name
    if rng.random() < 0.7:
        keys = rng.sample(LABEL_NAMES, rng.randint(0, 3))
        pairs = [f'{sep()}{k}{sep()}={sep()}"{"".join(rng.choices(VALUE_PIECES, k=rng.randint(0, 6)))}"{sep()}' for k in keys]
        body = ",".join(pairs) + ("," if pairs and rng.random() < 0.2 else "")
        out += rng.choice(["", "", "", " "]) + "{" + body + "}"
        out += rng.choice([" ", " ", " ", "", "  ", "\t"])
    else:
        out += rng.choice([" ", " ", " ", "  ", "\t"])
    out += rng.choice(VALUES)
    if rng.random() < 0.3:
        out += rng.choice([" ", " ", "\t", "  "]) + rng.choice(["1700000000000", "-5", "1.5", "0"])
    lead = rng.choice(["", "", "", "", " ", "\t"])
    trail = rng.choice(["", "", "", "", " ", "\t", "\r"])
    return lead + out + trail


def gen_comment(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    types = ["gauge", "histogram", "summary", "untyped"] + ([] if name in AMBIGUOUS else ["counter"])
    return rng.choice(
        [
            f"# HELP {name} Some help." + rng.choice(["", "   ", " \\\\n"]),
            f"# TYPE {name} {rng.choice(types)}",
            "# EOF",
            "# a comment",
            "",
            "   ",
        ]
    )


def accepted_sample(rng: random.Random) -> str:
    """A generated sample line the reference accepts (the mix of tabs and spaces it rejects
    is covered by the line fuzz below)."""
    while True:
        line = gen_sample(rng)
        try:
            _parse_sample(line.strip())
            return line
        except Exception:
            pass


@modern_only
def test_generated_payloads_agree():
    rng = random.Random(20240611)
    samples = 0
    for _ in range(400):
        lines = [accepted_sample(rng) if rng.random() < 0.65 else gen_comment(rng) for _ in range(rng.randint(1, 30))]
        text = rng.choice(["\n", "\r\n"]).join(lines) + rng.choice(["", "\n"])
        got = assert_agrees(text)
        samples += sum(map(len, got.values()))
        assert_agrees(text, rng.sample(NAMES, 3))
    assert samples > 3000


MUTATION_CHARS = ' \t{}",=\\#_\r\x0b.a1:é'


def mutate(rng: random.Random, line: str) -> str:
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(line) + 1)
        op = rng.random()
        if op < 0.4:
            line = line[:i] + rng.choice(MUTATION_CHARS) + line[i:]
        elif op < 0.8 and line:
            line = line[:i] + line[i + 1 :]
        elif line:
            line = line[:i] + line[i : i + 1] * 2 + line[i + 1 :]
    return line


def reference_or_error(text: str):
    try:
        return reference(text)
    except Exception as e:  # prometheus_client raises ValueError, sometimes IndexError
        return e


@modern_only
def test_slow_path_is_an_exact_port():
    """_parse_line against prometheus_client's _parse_sample on mutated lines."""
    rng = random.Random(7)
    agreed = raised = 0
    for _ in range(6000):
        line = mutate(rng, gen_sample(rng)).strip()
        if not line or line.startswith("#"):
            continue
        try:
            want = _parse_sample(line)
        except Exception:
            with pytest.raises(ValueError):
                _parse_line(line)
            raised += 1
            continue
        name, labels, value = _parse_line(line)
        assert (name, labels) == (want.name, want.labels), line
        assert norm({0: [({}, value)]}) == norm({0: [({}, float(want.value))]}), line
        agreed += 1
    assert agreed > 1500 and raised > 1500


@modern_only
def test_mutated_lines_agree_or_fail():
    """A payload of one mutated line: where the reference accepts it, the same sample; where
    it rejects it, ParseError or nothing."""
    rng = random.Random(11)
    outcomes = {"agree": 0, "error": 0, "skip": 0}
    for _ in range(4000):
        base = gen_sample(rng)
        line = mutate(rng, base)
        text = line + rng.choice(["", "\n", "\r\n"])
        wanted = {n for n in NAMES if n in line}
        expected = reference_or_error(text)
        if isinstance(expected, Exception):
            try:
                got = parse(text, wanted)
            except ParseError:
                outcomes["error"] += 1
                continue
            assert got == {}, (line, got)
            outcomes["skip"] += 1
            continue
        if re.fullmatch(r"(?i)[+-]?(nan|inf|infinity)", line.strip()):
            # prometheus_client reads a line without whitespace as name = all but its last
            # character, value = the whole line: `NaN` is a sample `Na` with value NaN. Skipped.
            assert parse(text, set(expected)) == {}
            continue
        wanted |= {n for n in expected if LEGACY_NAME.fullmatch(n)}
        assert norm(parse(text, wanted)) == norm({n: v for n, v in expected.items() if n in wanted}), line
        outcomes["agree"] += 1
    assert outcomes["agree"] > 1000 and outcomes["error"] > 1000, outcomes
