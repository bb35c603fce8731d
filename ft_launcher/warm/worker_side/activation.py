"""Runs inside a warm-restart standby: wait for an activation record, then become a worker.

A standby comes to life in one of two ways (``ft_launcher.warm.standby_pool`` decides):

- forked by the zygote (``zygote.py``), which imported the ``--ft-preload`` modules once;
  the zygote calls ``serve`` in the new process;
- spawned by the launcher when forking is not safe, as

      python -u -c "from ft_launcher.warm.worker_side.activation import main; main()" \\
          NONCE RUN_DIR SYS_PATH0 PRELOAD

  with the interpreter and flags of a cold worker, in its own session; ``main`` imports the
  comma-separated PRELOAD modules with ``sys.path[0]`` set to what the training script will
  see (the script's directory, or the working directory for ``-m``) and calls ``serve``.

Either way stdin is a pipe from the launcher and stdout and stderr one pipe to it. The
standby tells the launcher it is ready and blocks on stdin. When a restart needs it, the
launcher writes one activation record (working directory, ``-m`` or path, target, arguments,
the full environment of the new cycle's rank); the standby then makes itself look like a
freshly started ``python -u script.py`` (or ``-m module``) and runs the script as
``__main__``:

- ``os.environ`` is replaced entirely, the working directory is set, fd 0 is ``/dev/null``;
- signal dispositions and the signal mask are reset to what the interpreter had when it
  started (before any preload could change them): SIGINT raises KeyboardInterrupt,
  SIGPIPE and SIGXFSZ ignored, everything else default;
- ``sys.argv``, ``sys.orig_argv``, ``sys.path[0]`` and a new ``__main__`` module are set up
  as the interpreter does (``sys.orig_argv`` is the cold worker's command line, so a script
  that re-executes itself with it starts the script, not a standby); this package and
  whatever the zygote imported after the preloads leave ``sys.modules`` first;
- an uncaught exception prints its traceback (from the script's first frame) and exits 1,
  ``SystemExit`` and ``KeyboardInterrupt`` behave as in any interpreter;
- one difference, on purpose: a script that ends with status 0 and left its default
  process group up gets it destroyed at exit, after its own exit handlers (a cold worker
  can die of SIGABRT there);
- with learned preloads on (a forked standby the zygote gave a directory), a thread notes
  for 90 s which installed modules the script imports (``learning.Recorder``).

Lines that start with ``@@ft-standby NONCE`` on stdout are messages to the launcher, which
keeps them out of every log; everything else a preload prints goes to the standby log.

Limits (what a preloaded module may not rely on):

- The standby's environment is the launcher's (plus ``OMP_NUM_THREADS`` when the launcher
  sets it for workers; a forked standby's is ``OMP_NUM_THREADS=1``, and torch's thread
  count is set back to the rank's at activation): ``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``MASTER_*``, ``FT_CYCLE``, ``CUDA_VISIBLE_DEVICES`` as rotated for the
  rank, ... are not there yet. A module that reads them at import, caches ``os.environ``
  values, or derives state from the process (pid, time, random seeds) at import keeps the
  standby's values.
- A preload must not touch a GPU (the standby refuses to serve if it holds a ``/dev/nvidia*``
  file), start threads or processes, open sockets or files it keeps: all of them would
  survive into the worker.
- ``/proc/PID/cmdline`` (what ``ps`` and ``pkill -f`` read) shows the cold worker's command
  line, as one string (setproctitle); ``/proc/PID/environ`` still shows the zygote's first
  environment (with the run's ``FT_RUN_DIR``); forked standbys share the zygote's string hash seed.
"""

import _signal  # not ``signal``: a fresh interpreter has only the C module loaded
import builtins
import os
import sys
import time

from ft_launcher.warm.worker_side import learning

EXIT_PRELOAD_FAILED = 3
_ended_with_0 = False  # set when the script returns or exits with status 0


def say(nonce: str, message: str) -> None:
    """One message line to the launcher, straight to fd 1 so no buffer reorders it."""
    data = f"@@ft-standby {nonce} {message}\n".encode(errors="replace")
    while data:
        data = data[os.write(1, data):]


def _read_record(fd: int = 0) -> list[bytes] | None:
    """Read ``<length>\\n`` then that many bytes of NUL-separated fields; None at EOF."""
    header = b""
    while not header.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            return None
        header += chunk
    size = int(header)
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data.split(b"\0")


def gpu_files(pid: int | str = "self") -> list[str]:
    """Open files of a process that are GPU device nodes (a preload that created a GPU
    context)."""
    found = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                found.append(target)
    except OSError:
        pass
    return found


def import_preloads(modules: list[str]) -> str | None:
    """Import each module; ``"name: Error: message"`` for the first that fails, else None."""
    for name in modules:
        try:
            __import__(name)
        except BaseException as exc:  # noqa: BLE001 - any failure means: start cold
            text = " ".join(f"{type(exc).__name__}: {exc}".split())
            return f"{name}: {text}"
    return None


def _preload(nonce: str, modules: list[str]) -> bool:
    failure = import_preloads(modules)
    if failure is not None:
        say(nonce, f"failed {failure}")
        return False
    gpu = gpu_files()
    if gpu:
        say(nonce, f"failed {','.join(modules)}: opened a GPU device ({gpu[0]})")
        return False
    return True


def initial_signals() -> tuple[dict[int, object], set[int]]:
    """The signal dispositions and mask this interpreter has now, to restore at activation."""
    handlers = {s: _signal.getsignal(s) for s in _signal.valid_signals()}
    return handlers, _signal.pthread_sigmask(_signal.SIG_BLOCK, [])


def _restore_signals(handlers: dict[int, object], mask: set[int]) -> None:
    # Every signal is set, not only those Python knows changed: a C extension may have
    # installed a handler with sigaction() behind the signal module's back.
    for signum, handler in handlers.items():
        if handler is None:  # set outside Python before start-up: cannot happen after exec
            continue
        try:
            _signal.signal(signum, handler)
        except (OSError, ValueError, RuntimeError):  # SIGKILL, SIGSTOP, libc's reserved ones
            pass
    _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)


def _new_main() -> dict:
    """A fresh ``__main__`` module in sys.modules, as the interpreter creates it."""
    main = type(sys)("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    return vars(main)


def _run_path(script: str, args: list[str], before) -> None:
    from importlib.machinery import SourceFileLoader  # loaded by every interpreter

    path = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:  # the interpreter's own message and exit code
        sys.stderr.write(f"{sys.executable}: can't open file {path!r}: "
                         f"[Errno {exc.errno}] {exc.strerror}\n")
        sys.exit(2)
    main_globals = _new_main()
    main_globals.update(__file__=path, __cached__=None,
                        __loader__=SourceFileLoader("__main__", path))
    # dont_inherit: this module's compiler flags must not leak into the script.
    code = compile(source, path, "exec", dont_inherit=True)
    before()
    exec(code, main_globals)


def _run_module(module: str, args: list[str], before) -> None:
    import runpy  # what ``python -m`` imports too

    sys.argv = ["-m", *args]
    sys.path[0] = os.getcwd()
    _new_main()
    before()
    # The function the interpreter itself calls for ``python -m``: it runs the module in
    # sys.modules["__main__"] and sets sys.argv[0] to its file.
    runpy._run_module_as_main(module, alter_argv=True)


def cold_command_line(mode: str, target: str, args: list[str]) -> list[str]:
    """The ``sys.orig_argv`` of a cold worker for this record: the interpreter and flags this
    standby was started with (those before its ``-c``), the script or ``-m module``, the
    arguments."""
    orig = sys.orig_argv
    interpreter = orig[:orig.index("-c")] if "-c" in orig else [sys.executable]
    return [*interpreter, *(["-m", target] if mode == "module" else [target]), *args]


def _show_command_line(argv: list[str]) -> None:
    """What ``ps``, ``pgrep -f`` and ``/proc/PID/cmdline`` show: the cold worker's command
    line, so tools that find a job's workers by script name find this one too. setproctitle
    rewrites the argv area (the zygote's ``-c`` code leaves ample room); SPT_NOENV keeps it
    out of the environment's area (the standby's environment, replaced right after). Without
    the library the standby's command line stays."""
    os.environ["SPT_NOENV"] = "1"
    try:
        import setproctitle  # noqa: PLC0415 - only a worker-to-be needs it

        setproctitle.setproctitle(" ".join(argv))
    except ImportError:
        pass
    finally:
        for name in [m for m in sys.modules if m.lstrip("_").startswith("setproctitle")]:
            sys.modules.pop(name, None)  # a fresh interpreter has not imported it


def _script_traceback(tb, main_globals: dict):
    """Drop the standby's own frames: the traceback starts at the script's first frame."""
    while tb is not None and tb.tb_frame.f_globals is not main_globals:
        tb = tb.tb_next
    return tb


def _forget_modules(extra: set[str]) -> None:
    """Take this package (and what the zygote imported after the preloads) out of
    ``sys.modules``, so the script finds only a fresh interpreter's modules and the preloads."""
    side = "ft_launcher.warm.worker_side"
    for name in [m for m in sys.modules if m in extra or m.startswith(side)]:
        sys.modules.pop(name, None)
    for package in ("ft_launcher.warm", "ft_launcher"):  # the parents, once nothing is under them
        if not any(m.startswith(package + ".") for m in sys.modules):
            sys.modules.pop(package, None)


THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # what torch's default thread count reads


def _env_threads(value: str | None) -> int | None:
    """A thread count as torch reads it from a variable (``std::stoi``: the leading
    integer), or None when unset or not a positive number (torch then ignores it)."""
    text = (value or "").lstrip()
    digits = text[1:] if text[:1] in "+-" else text
    end = len(digits) - len(digits.lstrip("0123456789"))
    if end == 0:
        return None
    number = int(text[:len(text) - len(digits) + end])
    return number if number > 0 else None


def cold_thread_count(environ: dict[str, str] | os._Environ, default: int) -> int:
    """The intra-op thread count torch gives a fresh process with this environment:
    ``MKL_NUM_THREADS``, else ``OMP_NUM_THREADS``, else ``default`` (the physical cores as
    torch counts them, which ``get_num_interop_threads`` returns while unset), and never
    more than ``default`` (MKL, which sets it, caps it at the cores; measured with torch
    2.13's CPU build: ``OMP_NUM_THREADS=3`` on 2 cores gives 2)."""
    for key in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        number = _env_threads(environ.get(key))
        if number is not None:
            return min(number, default)
    return default


def restore_thread_count(before: dict[str, str | None]) -> None:
    """Give torch the thread count a cold worker would have in this environment, when the
    variables it reads for it (``THREAD_ENV``) were different at import: the zygote imports
    with ``OMP_NUM_THREADS=1`` (no OpenMP pool may exist when it forks). ``set_num_threads``
    sets OpenMP's and MKL's counts alike; no thread starts here (the pool starts at the
    first parallel operation)."""
    torch = sys.modules.get("torch")
    if torch is None or before == {k: os.environ.get(k) for k in THREAD_ENV}:
        return
    try:
        torch.set_num_threads(cold_thread_count(os.environ, torch.get_num_interop_threads()))
    except (AttributeError, RuntimeError):  # a torch without them: its count stays
        pass


def _recorder(record: tuple[str, int] | None):
    """What starts the learned-preloads recorder right before the script runs (from then
    on, what ``sys.modules`` gains is the script's): nothing without ``record``."""
    if record is None:
        return lambda: None

    def start() -> None:
        # The user's code: the script's directory (sys.path[0], as just set) and the
        # working directory.
        learning.Recorder(record[0], record[1], [sys.path[0], os.getcwd()]).start()

    return start


def _become_worker(nonce: str, fields: list[bytes], handlers: dict[int, object],
                   mask: set[int], forget: set[str],
                   record: tuple[str, int] | None = None) -> None:
    text = [os.fsdecode(f) for f in fields]
    cwd, mode, target, nargs = text[0], text[1], text[2], int(text[3])
    args, env = text[4:4 + nargs], text[4 + nargs:]
    sys.orig_argv = cold_command_line(mode, target, args)
    # Before the environment is replaced: setproctitle finds the argv area from it.
    _show_command_line(sys.orig_argv)
    threads_env = {k: os.environ.get(k) for k in THREAD_ENV}
    os.environ.clear()  # unsetenv/putenv too, so C code sees the new environment
    for item in env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    restore_thread_count(threads_env)
    os.chdir(cwd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _restore_signals(handlers, mask)
    say(nonce, "start")  # from here on, output belongs to the cycle's log
    _forget_modules(forget)
    run = _run_module if mode == "module" else _run_path
    import atexit  # built in; a standby imports it only once it becomes a worker

    # Registered before the script's own exit handlers, so it runs after them.
    atexit.register(_destroy_process_group_after_a_clean_end)
    try:
        run(target, args, _recorder(record))
    except SystemExit as exc:
        _note_the_end(exc.code)
        raise  # the interpreter's own handling of the exit code
    except KeyboardInterrupt:
        raise  # death by SIGINT
    except BaseException as exc:  # noqa: BLE001 - an uncaught exception in the script
        tb = _script_traceback(exc.__traceback__, vars(sys.modules["__main__"]))
        exc.with_traceback(tb)  # the default hook prints exc.__traceback__, not its argument
        sys.excepthook(type(exc), exc, tb)
        sys.exit(1)
    _note_the_end(0)


def _note_the_end(code: object) -> None:
    global _ended_with_0
    _ended_with_0 = code is None or code == 0


def _destroy_process_group_after_a_clean_end() -> None:
    """Destroy the default process group of a script that ended with status 0 and left
    it up (a Hugging Face ``Trainer`` does): a process that reaches the interpreter's
    finalization with a live gloo group can die of SIGABRT ("terminate called without an
    active exception", pytorch/pytorch#190489), which the launcher must count as a failed
    rank and restart the job for. torch's docs ask every script to destroy its group at the
    end; this does it for a script that did not. After a failure the group is left alone:
    its pending collectives could hold the exit."""
    dist = sys.modules.get("torch.distributed")
    if not _ended_with_0 or dist is None:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the script's exit status stands
        sys.stderr.write(f"ft_launcher: destroying the process group at exit: {exc!r}\n")


def serve(nonce: str, handlers: dict[int, object], mask: set[int], started: float,
          forget: frozenset[str] | set[str] = frozenset(),
          record: tuple[str, int] | None = None) -> None:
    """Tell the launcher this standby is ready, wait for the record, run the script.

    The ready message carries the seconds since ``started`` and the thread count. Returns
    when the script returns; exits 0 when the launcher closes stdin without a record.
    ``record``: (directory, local rank) for the learned-preloads recorder (``learning``).
    """
    threads = len(os.listdir("/proc/self/task"))
    say(nonce, f"ready {time.monotonic() - started:.3f} {threads}")
    fields = _read_record()
    if fields is None:  # the launcher closed the pool
        sys.exit(0)
    _become_worker(nonce, fields, handlers, mask, set(forget), record)


def main() -> None:
    """Entry point of a spawned standby process (see the module docstring)."""
    nonce, _run_dir, path0, preload = sys.argv[1:5]
    started = time.monotonic()
    handlers, mask = initial_signals()
    sys.path[0] = path0  # where the script will import from, so local modules preload too
    modules = [m for m in preload.split(",") if m]
    if not _preload(nonce, modules):
        sys.exit(EXIT_PRELOAD_FAILED)
    serve(nonce, handlers, mask, started)
