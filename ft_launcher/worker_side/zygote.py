"""Runs inside the warm-restart zygote: import the preloads once, then fork standbys.

The launcher (``ft_launcher.standby``) starts this at its own start as

    python -u -c "from ft_launcher.worker_side.zygote import main; main()" \\
        NONCE RUN_DIR SYS_PATH0 PRELOAD LAUNCHER_PID

with the interpreter and flags of a cold worker, in its own session, PDEATHSIG set (it dies
with the launcher), stdout and stderr a pipe to the launcher's zygote log and fd 0 a
``SOCK_SEQPACKET`` control socket to the launcher. It runs under ``SCHED_IDLE`` until the
launcher raises it (so its imports never slow a cycle's start), imports the PRELOAD modules
once and checks that forking is safe: one thread in the process, no CUDA context
(``torch.cuda.is_initialized()`` when torch is loaded, no ``libcuda`` mapped, no
``/dev/nvidia*`` open). Then it tells the launcher one of, as a packet on the socket:

- ``ready IMPORT_S THREADS``: fork requests are welcome;
- ``unsafe REASON``: the launcher falls back to spawned standbys; the zygote exits;
- ``failed MODULE: ERROR``: a preload failed; the zygote exits.

A fork request is the packet ``fork LOCAL_RANK NONCE`` with two file descriptors attached
(SCM_RIGHTS): the standby's stdin (read end of a pipe) and its stdout (write end). The
zygote forks a child that forks the standby and exits at once, so the standby is orphaned
and adopted by the launcher, which is a child subreaper (``PR_SET_CHILD_SUBREAPER``): the
worker it becomes is the launcher's own child, like a cold worker (exit status, SIGCHLD), and
does not depend on the zygote staying alive. The standby then starts its own session, sets
PDEATHSIG (relative to the launcher, its parent now), checks its parent is the launcher,
moves the pipes to fds 0, 1 and 2 and serves (``standby.serve``): ready in milliseconds,
with every imported page shared copy-on-write with the zygote and its siblings.

The zygote exits when the launcher closes the socket; it dies with the launcher.
"""

import os
import sys
import time

from ft_launcher.worker_side import standby

EXIT_UNSAFE = 4
_PR_SET_PDEATHSIG = 1
_SIGKILL = 9
_MSG_CMSG_CLOEXEC = 0x40000000  # Linux: received descriptors are close-on-exec


def _send(ctl, text: str) -> None:
    ctl.send(text.encode(errors="replace"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def unsafe_reason() -> str | None:
    """Why forking this process now would not be safe, or None when it is."""
    threads = _threads()
    if threads > 1:
        threading = sys.modules.get("threading")
        python = f", {threading.active_count()} of them Python threads" if threading else ""
        return f"the preloads started threads ({threads} threads in the zygote{python})"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return "the preloads initialised CUDA (torch.cuda.is_initialized())"
    try:
        with open("/proc/self/maps") as f:
            if any("libcuda.so" in line for line in f):
                return "the preloads loaded the CUDA driver (libcuda.so is mapped)"
    except OSError:
        pass
    gpu = standby.gpu_files()
    if gpu:
        return f"the preloads opened a GPU device ({gpu[0]})"
    return None


def _set_policy(policy_name: str) -> str | None:
    """Switch this process's scheduling policy; None, or the error."""
    try:
        os.sched_setscheduler(0, getattr(os, policy_name), os.sched_param(0))
    except (AttributeError, OSError) as exc:
        return f"cannot set {policy_name}: {exc}"
    return None


def _recv_request(ctl) -> tuple[str, list[int]] | None:
    """One fork request and its descriptors; None when the launcher closed the socket."""
    import _socket  # noqa: PLC0415 - after the preloads: the standby forgets it again

    size = _socket.CMSG_SPACE(2 * 4)
    data, ancillary, _flags, _addr = ctl.recvmsg(256, size, _MSG_CMSG_CLOEXEC)
    if not data:
        return None
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds += [int.from_bytes(payload[i:i + 4], sys.byteorder) for i in range(0, usable, 4)]
    return data.decode(errors="replace"), fds


def _become_standby(ctl, nonce: str, fds: list[int], launcher: int, requested: float,
                    signals: tuple[dict[int, object], set[int]], forget: set[str]) -> None:
    """In the grandchild: wait for the adoption, set up like a spawned worker, serve."""
    import ctypes  # noqa: PLC0415 - loaded by the zygote after the preloads; forgotten later

    first_parent = os.getppid()
    deadline = time.monotonic() + 5.0
    while os.getppid() == first_parent != launcher and time.monotonic() < deadline:
        time.sleep(0.0002)  # the intermediate child exits right after the fork
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:  # not adopted (or the launcher is gone): never serve
        os._exit(1)
    stdin_fd, out_fd = fds
    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(stdin_fd)
    os.close(out_fd)
    ctl.close()
    standby.say(nonce, f"pid {os.getpid()}")  # the launcher's child now: it can reap it
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # a fresh process seeds it itself (Python's random reseeds
        numpy_random.seed()  # at fork on its own)
    handlers, mask = signals
    standby.serve(nonce, handlers, mask, requested, forget)
    sys.exit(0)  # the script returned: exit as the interpreter does (atexit, threads)


def _fork(ctl, request: str, fds: list[int], launcher: int,
          signals: tuple[dict[int, object], set[int]], forget: set[str]) -> None:
    requested = time.monotonic()
    parts = request.split()
    if len(parts) != 3 or parts[0] != "fork" or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        _send(ctl, f"bad request {request[:80]!r} with {len(fds)} descriptors")
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        child = os.fork()
    except OSError as exc:
        _send(ctl, f"forkfailed {parts[1]} {exc}")
        child = -1
    if child == 0:  # the intermediate child: fork the standby and exit, orphaning it
        try:
            standby_pid = os.fork()
        except BaseException:  # noqa: BLE001 - the launcher sees the pipe close
            os._exit(1)
        if standby_pid != 0:
            os._exit(0)
        # The standby: never returns here; it exits as the script makes the interpreter
        # exit (SystemExit travels up through main(), so atexit handlers run).
        _become_standby(ctl, parts[2], fds, launcher, requested, signals, forget)
    for fd in fds:
        os.close(fd)
    if child > 0:
        os.waitpid(child, 0)


def main() -> None:
    """Entry point of the zygote (see the module docstring)."""
    _nonce, _run_dir, path0, preload, launcher = sys.argv[1:6]
    started = time.monotonic()
    signals = standby.initial_signals()
    ctl_fd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _set_policy("SCHED_IDLE")  # the launcher raises it once the cycle trains
    sys.path[0] = path0
    failure = standby.import_preloads([m for m in preload.split(",") if m])
    preloaded = set(sys.modules)
    import _socket  # noqa: PLC0415 - after the preloads, so the standbys can forget them
    import ctypes  # noqa: F401, PLC0415 - for the standbys' prctl, imported once here

    forget = set(sys.modules) - preloaded
    ctl = _socket.socket(fileno=ctl_fd)
    if failure is not None:
        _send(ctl, f"failed {failure}")
        sys.exit(standby.EXIT_PRELOAD_FAILED)
    reason = unsafe_reason() or _set_policy("SCHED_OTHER")
    if reason is not None:
        _send(ctl, f"unsafe {reason}")
        sys.exit(EXIT_UNSAFE)
    _send(ctl, f"ready {time.monotonic() - started:.3f} {_threads()}")
    while True:
        got = _recv_request(ctl)
        if got is None:
            sys.exit(0)
        _fork(ctl, got[0], got[1], int(launcher), signals, forget)
