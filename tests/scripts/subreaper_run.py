"""Run a command as the child of a child subreaper (a PID 1 that does not reap); report
what is left of its descendants after it exited, as JSON on stdout.

argv[1]: seconds to watch after the command exited; argv[2:]: the command. Its stdout and
stderr go to our stderr. Every leftover is then killed and reaped.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def children() -> list[dict]:
    """Our children (adopted orphans included): pid, state, name, command line."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if int(fields[1]) == me:  # a zombie has no cmdline left, still its name
            comm = stat[stat.find(b"(") + 1:stat.rfind(b")")].decode(errors="replace")
            found.append({"pid": int(name), "state": fields[0].decode(), "comm": comm,
                          "cmdline": cmdline})
    return found


def main() -> None:
    watch_s = float(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    proc = subprocess.Popen(sys.argv[2:], stdout=sys.stderr, stderr=sys.stderr)
    code = proc.wait()
    seen: dict[int, dict] = {}
    end = time.monotonic() + watch_s
    while time.monotonic() < end:
        for child in children():
            seen[child["pid"]] = child
        time.sleep(0.02)
    for pid in seen:  # clean up whatever was left
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for pid in seen:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    print(json.dumps({"returncode": code, "leftovers": list(seen.values())}))


if __name__ == "__main__":
    main()
