"""Duty-cycle processes with SIGSTOP/SIGCONT: a slow but healthy engine.

    python throttler.py RUN_MS PERIOD_MS PID [PID ...]

Runs in its own process (so the test process's GIL and load threads cannot stretch
the run windows), at real-time priority where allowed, else at the lowest nice.
Each period: SIGCONT, sleep RUN_MS, SIGSTOP, sleep the rest, on an absolute clock.
Stops on SIGTERM/SIGINT or when stdin closes, and then leaves every PID continued;
on SIGUSR1 it stops at once and leaves every PID stopped (a hang at a moment the
engine was surely mid-batch, with no full-speed gap between the throttle and the stop).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


def main(argv: list[str]) -> int:
    run_s = float(argv[1]) / 1000
    period_s = float(argv[2]) / 1000
    pids = [int(p) for p in argv[3:]]
    done = threading.Event()
    freeze = threading.Event()

    def on_signal(*_):
        done.set()

    def on_freeze(*_):
        freeze.set()
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGUSR1, on_freeze)

    def watch_stdin():  # parent died or closed the pipe: stop
        try:
            sys.stdin.buffer.read()
        except Exception:
            pass
        done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        try:
            os.nice(-20)
        except OSError:
            pass

    # Each pid with its start time: a pid whose process ended may be given to another
    # process (numbers wrap), which must never be stopped. As processes.signal_same, which
    # this script (run by path, standard library only) cannot import.
    def started(pid: int) -> int | None:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            return None
        return int(stat[stat.rfind(")") + 2 :].split()[19])

    born = {p: started(p) for p in pids}

    def send(sig: int) -> None:
        for p in pids:
            if born[p] is None or started(p) != born[p]:
                continue
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass

    t = time.monotonic()
    sys.stdout.write("started\n")
    sys.stdout.flush()
    try:
        while not done.is_set():
            send(signal.SIGCONT)
            if done.wait(max(0.0, t + run_s - time.monotonic())):
                break
            send(signal.SIGSTOP)
            t += period_s
            now = time.monotonic()
            if t < now:  # fell behind: do not burst to catch up
                t = now
            done.wait(max(0.0, t - now))
    finally:
        send(signal.SIGSTOP if freeze.is_set() else signal.SIGCONT)
    sys.stdout.write("frozen\n" if freeze.is_set() else "continued\n")
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown racing the stdin watcher thread


if __name__ == "__main__":
    sys.exit(main(sys.argv))
