"""Runs inside the warm-restart zygote: import the preloads once, then fork standbys.

The launcher (``ft_launcher.warm.zygote_link``) starts this at its own start as

    python -u -c "from ft_launcher.warm.worker_side.zygote import main; main()" \\
        NONCE RUN_DIR SYS_PATH0 PRELOAD LAUNCHER_PID PRIORITY LEARN_DIR

with the interpreter and flags of a cold worker, in its own session, PDEATHSIG set (it dies
with the launcher), stdout and stderr a pipe to the launcher's zygote log and fd 0 a
``SOCK_SEQPACKET`` control socket to the launcher. With PRIORITY ``idle`` it runs under
``SCHED_IDLE`` until the launcher raises it (so its imports never slow a cycle's start);
with ``normal`` the first cycle waits for its forks and it imports at full speed. It imports
the PRELOAD modules once and checks that forking is safe: one thread in the process, no CUDA
context (``torch.cuda.is_initialized()`` when torch is loaded, no ``libcuda`` mapped, no
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
moves the pipes to fds 0, 1 and 2 and serves (``activation.serve``): ready in milliseconds,
with every imported page shared copy-on-write with the zygote and its siblings.

Learned preloads (LEARN_DIR: the run's private directory, or empty when learning is off):
each standby's worker records the installed modules its script imported there
(``learning.Recorder``). The launcher reads and checks those names and sends
``learn`` with two descriptors: a new control socket and a file of names. The zygote forks
a learner (adopted by the launcher like a standby) that says ``pid PID``, imports the names
at normal priority, saying ``importing NAME`` before each, does torch's compiler's
first-use work for what it imported (``warmups.py``), and then either
``learned COUNT IMPORT_S CPU_S WARMED`` (WARMED: the warm-ups that ran, comma-separated,
or ``-``) and serves the new socket as the next zygote, or
``refused NAME REASON`` and exits. The zygote itself imports nothing it was not started
with, so a module that starts a thread, initialises CUDA, fails or hangs spoils only the
learner: the zygote goes on forking, and the launcher tries again without that module.
(Probing each module in a throw-away fork first would import everything twice, on cores
the training is using.) The learner keeps the zygote's normal priority: a nice value
could not be undone without privileges, and every standby it forks would inherit it;
SCHED_IDLE would starve while the ranks keep every core busy. On busy cores the imports
cost the training the same CPU time at any weight; at normal weight they are done soonest,
before the first fault of a job more often.

The zygote exits when the launcher closes the socket; it dies with the launcher.
"""

import os
import sys
import time

from ft_launcher.warm.worker_side import activation, learning, warmups

EXIT_UNSAFE = 4
_PR_SET_PDEATHSIG = 1
_SIGKILL = 9
_MSG_CMSG_CLOEXEC = 0x40000000  # Linux: received descriptors are close-on-exec


def _send(ctl, text: str) -> None:
    ctl.send(text.encode(errors="replace"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def unsafe_reason(who: str = "the preloads", where: str = "the zygote") -> str | None:
    """Why forking this process now would not be safe, or None when it is."""
    threads = _threads()
    if threads > 1:
        threading = sys.modules.get("threading")
        python = f", {threading.active_count()} of them Python threads" if threading else ""
        return f"{who} started threads ({threads} threads in {where}{python})"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return f"{who} initialised CUDA (torch.cuda.is_initialized())"
    try:
        with open("/proc/self/maps") as f:
            if any("libcuda.so" in line for line in f):
                return f"{who} loaded the CUDA driver (libcuda.so is mapped)"
    except OSError:
        pass
    gpu = activation.gpu_files()
    if gpu:
        return f"{who} opened a GPU device ({gpu[0]})"
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


def _adopted(launcher: int) -> None:
    """In a grandchild of the zygote: wait until the launcher adopted it, then lead a
    session of its own and die with the launcher, like any worker."""
    import ctypes  # noqa: PLC0415 - loaded by the zygote after the preloads; forgotten later

    first_parent = os.getppid()
    deadline = time.monotonic() + 5.0
    while os.getppid() == first_parent != launcher and time.monotonic() < deadline:
        time.sleep(0.0002)  # the intermediate child exits right after the fork
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:  # not adopted (or the launcher is gone): do nothing
        os._exit(1)


def _fork_for_launcher(ctl, launcher: int, what: str) -> bool:
    """Fork a process the launcher adopts: True in that process (see ``_adopted``), False
    in the zygote once the intermediate child is reaped."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        child = os.fork()
    except OSError as exc:
        _send(ctl, f"forkfailed {what} {exc}")
        return False
    if child > 0:
        os.waitpid(child, 0)
        return False
    try:  # the intermediate child: fork and exit, orphaning the grandchild
        if os.fork() != 0:
            os._exit(0)
    except BaseException:  # noqa: BLE001 - the launcher sees the pipe close
        os._exit(1)
    _adopted(launcher)
    return True


def _become_standby(ctl, nonce: str, fds: list[int], requested: float,
                    signals: tuple[dict[int, object], set[int]], forget: set[str],
                    record: tuple[str, int] | None) -> None:
    """In the adopted grandchild: take the pipes, serve. Never returns: it exits as the
    script makes the interpreter exit (SystemExit travels up through main(), so atexit
    handlers and thread joins run as in any interpreter)."""
    stdin_fd, out_fd = fds
    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(stdin_fd)
    os.close(out_fd)
    ctl.close()
    activation.say(nonce, f"pid {os.getpid()}")  # the launcher's child now: it can reap it
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # a fresh process seeds it itself (Python's random reseeds
        numpy_random.seed()  # at fork on its own)
    handlers, mask = signals
    activation.serve(nonce, handlers, mask, requested, forget, record)
    sys.exit(0)  # the script returned


def _fork_standby(ctl, parts: list[str], fds: list[int], zygote: "_State") -> None:
    requested = time.monotonic()
    record = (zygote.learn_dir, int(parts[1])) if zygote.learn_dir else None
    if _fork_for_launcher(ctl, zygote.launcher, parts[1]):
        _become_standby(ctl, parts[2], fds, requested, zygote.signals, zygote.forget, record)
    for fd in fds:
        os.close(fd)


def _host_store(ctl, addr: str, port: int, launcher: int) -> None:
    """Fork a process that hosts a TCPStore server on ``port`` (0: one the kernel picks)
    until it is killed, and tells the launcher ``store PORT PID`` once it listens
    (``storefailed PORT ERROR`` if not). Only with torch preloaded: importing it now would
    take seconds."""
    if "torch" not in sys.modules:
        _send(ctl, f"storefailed {port} torch is not among the preloads")
        return
    if not _fork_for_launcher(ctl, launcher, f"store {port}"):
        return
    try:
        import datetime  # noqa: PLC0415

        from torch.distributed import TCPStore  # noqa: PLC0415

        store = TCPStore(addr, port, None, True, datetime.timedelta(days=7),
                         wait_for_workers=False)
    except BaseException as exc:  # noqa: BLE001 - any failure: rank 0 hosts it as before
        _send(ctl, f"storefailed {port} {' '.join(f'{type(exc).__name__}: {exc}'.split())}")
        os._exit(1)
    _send(ctl, f"store {store.port} {os.getpid()}")
    ctl.close()
    while store is not None:
        time.sleep(3600)


class _State:
    """What the zygote serves with; a learner that succeeds serves on with its own."""

    def __init__(self, ctl, launcher: int, signals: tuple[dict[int, object], set[int]],
                 forget: set[str], learn_dir: str) -> None:
        self.ctl, self.launcher, self.signals = ctl, launcher, signals
        self.forget, self.learn_dir = forget, learn_dir


def _learn(zygote: _State, fds: list[int]) -> None:
    """Fork a learner (see the module docstring); in the learner, ``zygote`` becomes its
    state once it learned, else the learner exits."""
    if not _fork_for_launcher(zygote.ctl, zygote.launcher, "learn"):
        for fd in fds:
            os.close(fd)
        return
    import _socket  # noqa: PLC0415 - loaded since start-up (the control socket)

    zygote.ctl.close()  # the zygote's socket: its requests are not the learner's
    ctl = _socket.socket(fileno=fds[0])
    names = learning.read_names(fds[1])
    os.close(fds[1])
    _send(ctl, f"pid {os.getpid()}")
    started, cpu = time.monotonic(), time.process_time()
    imported, forget, refused, warmed = learning.learn(
        names, zygote.forget, lambda: unsafe_reason("its import", "the learner"),
        lambda name: _send(ctl, f"importing {name}"))
    if refused is not None:
        _send(ctl, f"refused {refused[0]} {refused[1]}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _send(ctl, f"learned {imported} {time.monotonic() - started:.3f} "
               f"{time.process_time() - cpu:.3f} {','.join(warmed) or '-'}")
    zygote.ctl, zygote.forget = ctl, forget


def _handle(zygote: _State, request: str, fds: list[int]) -> None:
    parts = request.split()
    ctl = zygote.ctl
    if len(parts) == 3 and parts[0] == "fork" and parts[1].isdigit() and len(fds) == 2:
        _fork_standby(ctl, parts, fds, zygote)
        return
    if parts == ["learn"] and len(fds) == 2:
        _learn(zygote, fds)
        return
    for fd in fds:
        os.close(fd)
    if len(parts) == 3 and parts[0] == "store" and parts[2].isdigit():
        _host_store(ctl, parts[1], int(parts[2]), zygote.launcher)
    else:
        _send(ctl, f"bad request {request[:80]!r} with {len(fds)} descriptors")


def main() -> None:
    """Entry point of the zygote (see the module docstring)."""
    _nonce, _run_dir, path0, preload, launcher, priority = sys.argv[1:7]
    learn_dir = sys.argv[7] if len(sys.argv) > 7 else ""
    started = time.monotonic()
    signals = activation.initial_signals()
    ctl_fd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if priority == "idle":
        _set_policy("SCHED_IDLE")  # the launcher raises it once the cycle trains
    sys.path[0] = path0
    preloads = [m for m in preload.split(",") if m]
    failure = activation.import_preloads(preloads)
    if failure is None:  # what they import stays, as the preloads' own imports do
        warmups.run(preloads, lambda: None)  # a thread left is found out below
    preloaded = set(sys.modules)
    import _socket  # noqa: PLC0415 - after the preloads, so the standbys can forget them
    import ctypes  # noqa: F401, PLC0415 - for the standbys' prctl, imported once here

    forget = set(sys.modules) - preloaded
    ctl = _socket.socket(fileno=ctl_fd)
    if failure is not None:
        _send(ctl, f"failed {failure}")
        sys.exit(activation.EXIT_PRELOAD_FAILED)
    reason = unsafe_reason() or _set_policy("SCHED_OTHER")
    if reason is not None:
        _send(ctl, f"unsafe {reason}")
        sys.exit(EXIT_UNSAFE)
    _send(ctl, f"ready {time.monotonic() - started:.3f} {_threads()}")
    zygote = _State(ctl, int(launcher), signals, forget, learn_dir)
    while True:
        got = _recv_request(zygote.ctl)
        if got is None:
            sys.exit(0)
        _handle(zygote, got[0], got[1])
