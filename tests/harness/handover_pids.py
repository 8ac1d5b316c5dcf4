"""A `capture.pids_command` for the llama.cpp loop test: says it is ready (a file), waits
for the test to hand the ptrace-frozen inference thread over to a SIGSTOP of the whole
process (a second file; a debugger cannot attach to a thread another tracer holds), then
prints the server's pid. Stdlib only.

    handover_pids.py READY_FILE DONE_FILE PID_FILE
"""

import sys
import time
from pathlib import Path

ready, done, pid_file = (Path(a) for a in sys.argv[1:4])
ready.write_text("ready\n")
deadline = time.monotonic() + 6.0
while not done.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
print(pid_file.read_text().strip())
