"""A restart script as users write them: stop the old server (vLLM, llama-server), start
a new one in the background, exit 0 without waiting for it (the shape of
`pkill -g $OLD; setsid nohup vllm serve ... &`).

    python restart_server.py SPEC_JSON

SPEC_JSON (written by the test): `pid_file` (the running server's pid, its process
group: the server was started in its own session), `argv`, `env`, `cwd`, `host`,
`port`. The old process group is SIGKILLed (a hung engine does not stop on SIGTERM),
the port awaited, and the new server started in a new session with this script's stdout
and stderr: the restarter's output file. Its pid goes to `pid_file`. Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time


def _group(pgid: int) -> list[int]:
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read().decode("utf-8", "replace")
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(name))
    return members


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    old = int(open(spec["pid_file"]).read())
    print(f"stopping process group {old}", flush=True)
    try:
        os.killpg(old, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 60
    while _group(old) and time.monotonic() < deadline:
        time.sleep(0.1)
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((spec["host"], spec["port"]))
                break
            except OSError:
                time.sleep(0.2)
    proc = subprocess.Popen(spec["argv"], env=spec["env"], cwd=spec["cwd"], stdin=subprocess.DEVNULL, start_new_session=True)
    with open(spec["pid_file"], "w") as f:
        f.write(str(proc.pid))
    print(f"started server pid {proc.pid} in the background", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
