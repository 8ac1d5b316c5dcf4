"""The incident record's pure parts (core.incident: the threads of a dump, the summary)
and the `capture:` / `incidents:` configuration (config.capture): errors name file and key."""

from __future__ import annotations

import pytest

from llm_health.config.errors import ConfigError
from llm_health.config.restarter import parse_config
from llm_health.core.incident import INCIDENT_ID, summary, threads
from llm_health.restarter.capture import redact

PY_SPY = """Process 4242: VLLM::EngineCore
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    wait (threading.py:327)
    run_busy_loop (vllm/v1/engine/core.py:700)
    run_engine_core (vllm/v1/engine/core.py:650)
Thread 4250 (idle): "output-thread"
    process_output_sockets (vllm/v1/engine/core.py:800)
"""

GDB = """[New LWP 11]
0x00007f in clock_nanosleep () from /lib/libc.so.6
Thread 2 (Thread 0x7f1 (LWP 11) "llama-server"):
#0  0x00007f in futex_wait () from /lib/libc.so.6
#1  0x00007f in pthread_cond_wait () from /lib/libc.so.6

Thread 1 (Thread 0x7f0 (LWP 10) "llama-server"):
#0  0x00007f in ggml_graph_compute (cgraph=0x1, cplan=0x2) at ggml.c:100
#1  0x00007f in llama_decode () from /lib/libllama.so
#2  0x00005 in main ()
[Inferior 1 (process 10) detached]
"""


def test_py_spy_threads():
    ts = threads("py-spy", PY_SPY)
    assert [t.name for t in ts] == ["MainThread (tid 4242, idle)", "output-thread (tid 4250, idle)"]
    assert ts[0].frames[1] == "run_busy_loop (vllm/v1/engine/core.py:700)"


def test_gdb_threads():
    ts = threads("gdb", GDB)
    assert [t.name for t in ts] == ['Thread 0x7f1 (LWP 11) "llama-server"', 'Thread 0x7f0 (LWP 10) "llama-server"']
    assert ts[1].frames[:2] == ("ggml_graph_compute at ggml.c:100", "llama_decode () from /lib/libllama.so")


def test_a_stripped_frame_is_named_by_its_file_offset():
    dump = 'Thread 1 (Thread 0x7f0 (LWP 10) "llama-server"):\n#0  0x0000560a6d3b3be3 in ?? ()\n#1  0x00007fa3aa56524a in __libc_start_call_main () at x.c:58\n'
    maps = "560a6cb00000-560a6d600000 r-xp 00100000 fd:01 42 /opt/llama/bin/llama-server\n"
    (t,) = threads("gdb", dump, maps)
    assert t.frames == ("llama-server+0x9b3be3", "__libc_start_call_main at x.c:58")
    assert threads("gdb", dump)[0].frames[0] == "?? ()"  # no mappings: as gdb said


def test_summary_names_the_engine_the_wait_the_work_and_the_frames():
    index = {
        "id": "20261202T141503Z-gpu0-1",
        "backend": "gpu0",
        "url": "http://127.0.0.1:8000",
        "action": 1,
        "alert": {"alertname": "LLMBackendHung", "startsAt": "2026-12-02T14:14:00Z", "evidence": "123"},
        "engine": {"profile": "vllm"},
        "no_progress": {"at_least_seconds": 63.0, "how": "since the alert started"},
        "reads": [{"engines": [{"model_name": "m", "engine": "0", "running": 4, "waiting": 0, "unmoved": ["vllm:generation_tokens_total"]}]}],
        "verification": {"method": "evidence", "state": "hung", "reason": "unchanged"},
        "processes": [{"pid": 4242, "state": "T"}],
        "stacks": [{"pid": 4242, "comm": "VLLM::EngineCor", "tool": "py-spy", "outcome": "ok", "file": "stacks-4242-py-spy.txt", "detail": ""}],
        "capture": {"failures": [{"pid": 4300, "reason": "process_exited", "detail": "gone"}]},
        "files": {"stacks-4242-py-spy.txt": {}},
    }
    text = summary(index, {"stacks-4242-py-spy.txt": PY_SPY}, top=2)
    assert "no progress for at least 63s" in text
    assert "stacks of pid 4242 (VLLM::EngineCor, stopped) by py-spy: ok" in text
    assert "m/0: 4 running, 0 waiting; unchanged over both reads: vllm:generation_tokens_total" in text
    assert "thread MainThread (tid 4242, idle)\n      wait (threading.py:327)\n      run_busy_loop" in text
    assert "... 1 more" in text and "not captured: process_exited (pid 4300): gone" in text


def test_redact_removes_keys_and_secret_flags():
    text = "python -m vllm serve --api-key sk-1 --model m; token tok-9 --password=hunter2"
    out = redact(text, ("tok-9",))
    assert "sk-1" not in out and "tok-9" not in out and "hunter2" not in out and "--model m" in out


def test_redact_leaves_words_that_only_contain_a_flag_name():
    help_line = "# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.\n"
    assert redact(help_line, ("sk-1",)) == help_line
    assert redact("--api-key sk-1 -x my-token-file", ()) == "--api-key <redacted> -x my-token-file"
    # The index is JSON: an argv is a list there.
    assert redact('{"argv": ["vllm", "--api-key", "sk-2", "--port", "8000"]}', ()) == '{"argv": ["vllm", "--api-key", "<redacted>", "--port", "8000"]}'
    # A /metrics payload: only a configured secret, never a flag pattern.
    assert redact("x --token abc", ("sk-1",), flags=False) == "x --token abc"


def test_incident_ids_refuse_paths():
    assert INCIDENT_ID.match("20261202T141503Z-gpu0-1")
    for bad in ("../x", "20261202T141503Z-gpu0-1/../../etc", "index.json", ""):
        assert not INCIDENT_ID.match(bad)


def config(capture=None, incidents=None) -> dict:
    backend = {"name": "gpu0", "url": "http://127.0.0.1:8000", "restart": ["true"]}
    if capture is not None:
        backend["capture"] = capture
    restarter = {} if incidents is None else {"incidents": incidents}
    return {"restarter": restarter, "backends": [backend]}


def test_capture_defaults_and_values():
    c = parse_config(config()).targets[0].capture
    assert (c.enabled, c.budget, c.stacks, c.pid_file, c.pids_command, c.native) == (True, 10.0, "auto", None, (), False)
    c = parse_config(config({"pids_command": ["pgrep", "-o", "vllm"], "budget": "5s", "stacks": "eu-stack"})).targets[0].capture
    assert (c.pids_command, c.budget, c.stacks) == (("pgrep", "-o", "vllm"), 5.0, "eu-stack")
    assert parse_config(config(False)).targets[0].capture.enabled is False
    i = parse_config(config(incidents={"dir": "/var/lib/x", "keep": 3})).incidents
    assert (i.dir, i.keep) == ("/var/lib/x", 3)


@pytest.mark.parametrize(
    ("capture", "incidents", "key", "problem"),
    [
        ({"pid_file": "/run/a.pid", "pids_command": ["x"]}, None, "backends[0].capture.pids_command", "not both"),
        ({"pids_command": "pgrep vllm"}, None, "backends[0].capture.pids_command", "expected a list"),
        ({"stacks": "perf"}, None, "backends[0].capture.stacks", "perf"),
        ({"budget": "2m"}, None, "backends[0].capture.budget", "at most 60s"),
        ({"locals": True}, None, "backends[0].capture.locals", "unknown key"),
        ("yes", None, "backends[0].capture", "expected a mapping"),
        (None, {"keep": 0}, "restarter.incidents.keep", ""),
        (None, {"max_bytes": 100}, "restarter.incidents.max_bytes", ""),
    ],
)
def test_capture_errors_name_file_and_key(capture, incidents, key, problem):
    with pytest.raises(ConfigError) as e:
        parse_config(config(capture, incidents), "restarter.yml")
    assert e.value.where == "restarter.yml" and e.value.key == key, str(e.value)
    assert problem in str(e.value)
