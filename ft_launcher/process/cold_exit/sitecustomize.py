"""Loaded by a cold worker's interpreter at start-up (``site`` imports ``sitecustomize``):
destroys the default process group of a script that ended without an uncaught exception
and left it up, after the script's own exit handlers.

Why: a process that reaches the interpreter's finalization with a live gloo group can die
of SIGABRT ("terminate called without an active exception"): a gloo
thread that drops the last reference to a tensor after finalization began must take the
GIL, and the interpreter then ends that thread from inside C++ code, which aborts. The
launcher would count the rank as failed. A warm worker gets the same end from
``activation.py``; this gives it to a cold one.

The launcher puts this file's directory first on the worker's ``PYTHONPATH`` and the value
the script should see in ``FT_COLD_EXIT_PYTHONPATH`` (``-`` when it was unset). Before the
script runs, this module takes both back out: ``PYTHONPATH``, ``sys.path`` and
``sys.modules`` (no ``sitecustomize`` of ours, no ``atexit``) are what the interpreter
would have had without it, and an interpreter the script starts inherits nothing. A
``sitecustomize`` of the user's or of the system further on ``sys.path`` is then imported,
as it would have been. Only ``/proc/PID/environ`` still shows the two variables.

The interpreter does not tell an exit handler the status ``sys.exit`` was given: an
uncaught exception is the failure it can see (``sys.last_value``), and then the group is
left alone, since its pending collectives could hold the exit. Imports only what a fresh
interpreter has loaded, and none of ft_launcher.
"""

import os
import sys

_ORIGINAL = "FT_COLD_EXIT_PYTHONPATH"  # also in __init__.py (ORIGINAL)


def _destroy_group_unless_failed() -> None:
    if getattr(sys, "last_value", None) is not None:  # an uncaught exception ended it
        return
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the script's exit status stands
        sys.stderr.write(f"ft_launcher: destroying the process group at exit: {exc!r}\n")


def _take_back_out() -> None:
    """Leave ``PYTHONPATH`` and ``sys.path`` as they would be without this module."""
    here = os.path.dirname(os.path.abspath(__file__))
    original = os.environ.pop(_ORIGINAL, "-")
    if original == "-":
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = original
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path_importer_cache.pop(here, None)


def _start() -> None:
    had_atexit = "atexit" in sys.modules
    import atexit  # noqa: PLC0415 - built in

    # Registered before the script runs, so it runs after the script's own handlers.
    atexit.register(_destroy_group_unless_failed)
    if not had_atexit:
        del sys.modules["atexit"]  # the registration lives in the interpreter
    _take_back_out()
    del sys.modules["sitecustomize"]  # this module; its functions keep what they need
    try:
        import sitecustomize  # noqa: F401, PLC0415 - the next one on sys.path, if any
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        # None further on: end as the interpreter's own search for one ends, which
        # ``site`` passes over in silence, and which leaves no "sitecustomize" module.
        raise ImportError("no sitecustomize", name="sitecustomize") from None


# Only as a cold worker's sitecustomize (an import of this module by name does nothing).
if __name__ == "sitecustomize" and _ORIGINAL in os.environ:
    _start()
