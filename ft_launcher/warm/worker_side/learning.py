"""Learned preloads, the parts that run outside the launcher.

In a warm worker: a recorder thread notes which installed modules the script imported
(``Recorder``), a few times with growing gaps after activation, and writes their names to
``learned_<LOCAL_RANK>`` in the run's private directory. In the zygote's learner (a fork of
the zygote that will replace it, ``zygote.py``): ``learn`` imports the names the launcher
validated, one at a time, and stops at the first that makes forking unsafe, fails, or reads
a variable that differs per rank.

Like the rest of ``worker_side`` this imports only what a fresh interpreter has loaded.
"""

import _thread
import os
import sys
import time

from ft_launcher.warm.worker_side import warmups

# After activation: the script's imports settle early. The first look catches the compiler,
# which a script's torch.compile() imports within its first second or so: a fault soon
# after the first step then finds it learned.
RECORD_AT_S = (1.0, 3.0, 10.0, 30.0, 90.0)
FILE_PREFIX = "learned_"
MAX_NAMES = 5000  # the launcher reads no more than this either
# Set per rank by the launcher: a module that reads one of these at import would keep the
# zygote's value (none) in every worker. FT_RUN_DIR is the zygote's too.
RANK_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES"})
RANK_PREFIXES = ("FT_", "TORCHELASTIC_")
SHARED_VARIABLES = frozenset({"FT_RUN_DIR"})


def valid_name(name: str) -> bool:
    """A dotted module name of ASCII identifiers, at most 200 characters."""
    return 0 < len(name) <= 200 and name.isascii() and \
        all(part.isidentifier() for part in name.split("."))


def _under(path: str, directories: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in directories if d)


def _origins(module: object, real: dict[str, str]) -> list[str] | None:
    """The files or directories a module came from ([] for a built-in or frozen one), or
    None when it was not imported by name (no spec: made by hand). Reads the module's
    ``__dict__`` only: a lazy module's ``__getattr__`` would import from this thread.
    ``real`` caches each directory's real path (modules share a few hundred)."""
    try:
        namespace = object.__getattribute__(module, "__dict__")
        if namespace.get("__spec__") is None:
            return None
        found = [namespace.get("__file__"), *(namespace.get("__path__") or ())]
        paths = []
        for path in found:
            if isinstance(path, str):
                folder, name = os.path.split(os.path.abspath(path))
                if folder not in real:
                    real[folder] = os.path.realpath(folder)
                paths.append(os.path.join(real[folder], name))
        return paths
    except Exception:  # noqa: BLE001 - an odd object in sys.modules: not a candidate
        return None


def candidates(modules: dict[str, object], baseline: set[str], project: list[str],
               installed: list[str]) -> list[str]:
    """The modules imported since activation that a zygote may import for the next worker,
    in import order: importable by name (a spec, and for a dotted name its package loaded:
    torch's compiler loads each compiled kernel as a module ``<hash>.kernel`` of no
    package), not private (a leading underscore), not ``__main__``, not this launcher, and
    not the user's own code (a file under a ``project`` directory that is not under an
    ``installed`` one: a restart must run the code as it is then)."""
    found: list[str] = []
    real: dict[str, str] = {}
    for name, module in modules.items():
        if name in baseline or not valid_name(name) or name.startswith("_") \
                or name.split(".")[0] == "ft_launcher":
            continue
        package = name.rpartition(".")[0]
        if package and package not in modules:  # not imported by name (see the docstring)
            continue
        origins = _origins(module, real)
        if origins is None or any(_under(p, project) and not _under(p, installed)
                                  for p in origins):
            continue
        found.append(name)
        if len(found) >= MAX_NAMES:
            break
    return found


def installed_dirs() -> list[str]:
    """Where installed code lives: the interpreter's prefixes and site directories."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    dirs |= {p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))}
    return sorted(os.path.realpath(d) for d in dirs if d)


def write_names(directory: str, local_rank: int, names: list[str]) -> None:
    """Replace ``learned_<local_rank>`` in ``directory`` in one rename (O_EXCL temporary file,
    never through a link)."""
    final = os.path.join(directory, f"{FILE_PREFIX}{local_rank}")
    tmp = os.path.join(directory, f".{FILE_PREFIX}{local_rank}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        data = "".join(f"{n}\n" for n in names).encode()
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)
    os.rename(tmp, final)


class Recorder:
    """Writes the candidates of this worker at ``RECORD_AT_S`` after activation, each time
    the set changed, from a thread of its own (``_thread``: the ``threading`` module is not
    loaded by a fresh interpreter). The directory and local rank come from the launcher
    through the zygote, never from the script's environment."""

    def __init__(self, directory: str, local_rank: int, project: list[str]) -> None:
        self.directory, self.local_rank = directory, local_rank
        self.started = time.monotonic()
        self.baseline = set(sys.modules)
        self.path_at_start = list(sys.path)
        self.project = [os.path.realpath(p) for p in project]
        self.installed = installed_dirs()

    def start(self) -> None:
        _thread.start_new_thread(self._run, ())

    def names(self) -> list[str]:
        # sys.path entries the script added hold its own code too.
        added = [os.path.realpath(p) for p in sys.path
                 if isinstance(p, str) and p and p not in self.path_at_start]
        return candidates(sys.modules.copy(), self.baseline, self.project + added,
                          self.installed)

    def _run(self) -> None:
        try:
            last: list[str] | None = None
            for at in RECORD_AT_S:
                delay = self.started + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                names = self.names()
                if names and names != last:
                    write_names(self.directory, self.local_rank, names)
                    last = names
        except BaseException:  # noqa: BLE001, S110 - never a word in the worker's output
            pass


def read_names(fd: int) -> list[str]:
    """The names the launcher sent (one per line, from the start of ``fd``); invalid ones
    are skipped."""
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    text = b"".join(chunks).decode(errors="replace")
    return [n for n in text.splitlines() if valid_name(n)][:MAX_NAMES]


def _importing_module() -> str:
    """The module whose top-level code is running (the innermost ``<module>`` frame)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            return str(frame.f_globals.get("__name__", "?"))
        frame = frame.f_back
    return "?"


# Where ``__getitem__`` is called from when the whole environment is walked rather than a
# variable named: ``items()`` and ``values()`` (their views' ``__iter__``, in the module
# ``_collections_abc``, which names itself ``collections.abc``) and ``copy()``.
_WALKS = frozenset({("collections.abc", "__iter__"), ("os", "copy")})


def _walking() -> bool:
    """Whether ``__getitem__`` (the caller) was called by a walk of the whole mapping."""
    frame = sys._getframe(2)
    return (frame.f_globals.get("__name__"), frame.f_code.co_name) in _WALKS


class _EnvWatch:
    """While active, notes the first rank variable a module reads by name through
    ``os.environ`` (``os.getenv``, ``.get``, ``in`` and ``[]`` all end in ``__getitem__``),
    and which module read it. A walk over every variable is not such a read: networkx picks
    its ``NETWORKX_*`` settings from ``os.environ.items()`` at import, and torch's compiler
    imports networkx. Reads from C (``getenv``) are not seen, nor what a module keeps of a
    walk."""

    def __init__(self) -> None:
        self.read: str | None = None
        self.cls = type(os.environ)
        watch = self

        def __getitem__(environ, key):  # noqa: N807
            if watch.read is None and isinstance(key, str) and key not in SHARED_VARIABLES \
                    and (key in RANK_VARIABLES or key.startswith(RANK_PREFIXES)) \
                    and not _walking():
                watch.read = f"{_importing_module()} reads {key} at import"
            return watch.cls.__getitem__(environ, key)

        self.watched = type("WatchedEnviron", (self.cls,), {"__getitem__": __getitem__})

    def __enter__(self) -> "_EnvWatch":
        os.environ.__class__ = self.watched
        return self

    def __exit__(self, *exc: object) -> None:
        os.environ.__class__ = self.cls


def import_one(name: str) -> str | None:
    """Import ``name``; ``"Error: message"`` when it fails."""
    try:
        __import__(name)
    except BaseException as exc:  # noqa: BLE001 - any failure refuses the module
        return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    return None


def learn(names: list[str], forget: set[str], unsafe, say
          ) -> tuple[int, set[str], tuple[str, str] | None, list[str]]:
    """Import ``names`` in order (those not loaded yet), calling ``say(name)`` before each,
    then run torch's compiler's warm-ups when it is among them (``warmups.run``).

    Returns how many were imported, the zygote's own modules still to forget in workers,
    ``(name, reason)`` for the first that failed, made forking unsafe (``unsafe()``) or
    read a rank variable (the process is then spoilt and must not become the zygote; a
    warm-up's is the compiler's), and the warm-ups that ran.

    The zygote's own modules (``forget``) leave ``sys.modules`` meanwhile: one that a
    learned module imports is the workers' from then on. The collector is off: a full
    collection here would write to every object the zygote shares with its forks."""
    had_gc = "gc" in sys.modules
    import gc  # noqa: PLC0415 - built in; one of the zygote's own when no preload loaded it

    own = forget if had_gc else forget | {"gc"}
    saved = {m: sys.modules.pop(m) for m in own if m in sys.modules}
    was_enabled = gc.isenabled()
    gc.disable()
    imported, refused, warmed = 0, None, []
    try:
        imported, refused = _import_all(names, unsafe, say)
        if refused is None:
            warmed, spoilt = warmups.run(names, unsafe)
            if spoilt is not None:
                refused = (warmups.COMPILER, f"its warm-up {spoilt[0]}: {spoilt[1]}")
    finally:
        if was_enabled:
            gc.enable()
    still = {m for m in saved if m not in sys.modules}
    for m in still:
        sys.modules[m] = saved[m]
    return imported, still, refused, warmed


def _import_all(names: list[str], unsafe, say) -> tuple[int, tuple[str, str] | None]:
    """Import each of ``names`` not loaded yet; the count, and the first refused."""
    imported = 0
    for name in names:
        if name in sys.modules:
            continue
        say(name)
        with _EnvWatch() as watch:
            failure = import_one(name)
        reason = failure or watch.read or unsafe()
        if reason is not None:
            return imported, (name, reason)
        imported += 1
    return imported, None
